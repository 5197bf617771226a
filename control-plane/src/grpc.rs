//! The gRPC service the filters connect to: `Watch` (a full snapshot, then every delta) and
//! `Report` (prefix inserts and in-flight counts from one gateway).

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use kvmesh_proto::v1::kvmesh_server::Kvmesh;
use kvmesh_proto::v1::{ReportAck, ReportBatch, Snapshot, WatchRequest};
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status, Streaming};

use crate::state::{GatewayError, State};

fn refused(e: GatewayError) -> Status {
    match e {
        GatewayError::BadId(_) => Status::invalid_argument(e.to_string()),
        GatewayError::TooMany => Status::resource_exhausted(e.to_string()),
    }
}

/// Ends a gateway's `Report` stream in the state however the handler ends (finished, failed,
/// or dropped because the client went away).
struct Reporting {
    state: Arc<State>,
    gateway: String,
}

impl Drop for Reporting {
    fn drop(&mut self) {
        self.state.report_stream_closed(&self.gateway);
    }
}

pub struct Service {
    pub state: Arc<State>,
}

type Snapshots = Pin<Box<dyn Stream<Item = Result<Snapshot, Status>> + Send>>;

#[tonic::async_trait]
impl Kvmesh for Service {
    type WatchStream = Snapshots;

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<Snapshots>, Status> {
        let gateway = request.into_inner().gateway_id;
        let state = self.state.clone();
        if let Err(e) = state.gateway_connected(&gateway) {
            state.bad_report();
            return Err(refused(e));
        }
        // Subscribe before taking the full snapshot so that no delta falls in between.
        let mut deltas = state.subscribe();
        let full = state.full_snapshot();
        tracing::info!(%gateway, version = full.version, blocks = full.inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), "gateway watching");
        let stream = async_stream::stream! {
            let mut seen = full.version;
            yield Ok(full);
            loop {
                match deltas.recv().await {
                    Ok(delta) if delta.version > seen => {
                        seen = delta.version;
                        yield Ok((*delta).clone());
                    }
                    Ok(_) => {}
                    Err(RecvError::Lagged(missed)) => {
                        tracing::warn!(%gateway, missed, "gateway fell behind; sending a full snapshot");
                        let full = state.full_snapshot();
                        seen = full.version;
                        yield Ok(full);
                    }
                    Err(RecvError::Closed) => break,
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report(&self, request: Request<Streaming<ReportBatch>>) -> Result<Response<ReportAck>, Status> {
        let mut stream = request.into_inner();
        let mut batches = 0;
        // One stream is one gateway: the id of its first batch, tracked until it ends.
        let mut reporting: Option<Reporting> = None;
        loop {
            match stream.message().await {
                Ok(Some(batch)) => {
                    match reporting.as_ref().map(|r| r.gateway == batch.gateway_id) {
                        Some(true) => {}
                        Some(false) => {
                            self.state.bad_report();
                            tracing::warn!("report stream changed its gateway_id; closed");
                            return Err(Status::invalid_argument("a report stream carries one gateway_id"));
                        }
                        None => {
                            if let Err(e) = self.state.report_stream_opened(&batch.gateway_id) {
                                self.state.bad_report();
                                tracing::warn!("report stream refused: {e}");
                                return Err(refused(e));
                            }
                            reporting =
                                Some(Reporting { state: self.state.clone(), gateway: batch.gateway_id.clone() });
                        }
                    }
                    self.state.report(batch);
                    batches += 1;
                }
                Ok(None) => break,
                Err(status) => {
                    // A malformed message ends this stream only; the service keeps serving.
                    self.state.bad_report();
                    tracing::warn!(%status, "bad report stream");
                    return Err(status);
                }
            }
        }
        Ok(Response::new(ReportAck { batches }))
    }
}
