//! The gRPC service the filters connect to: `Watch` (a full snapshot, then every delta) and
//! `Report` (prefix inserts and in-flight counts from one gateway).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use kvmesh_proto::v1::kvmesh_server::Kvmesh;
use kvmesh_proto::v1::{ReportAck, ReportBatch, Snapshot, WatchRequest};
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status, Streaming};

use crate::election::Leadership;
use crate::endpoint_acks::{Endpoint, EndpointAcks};
use crate::state::{GatewayError, State};
use crate::telemetry::SPANS;

/// Most index hashes per snapshot message (512 KiB): a full snapshot goes out as a full
/// message with the workers, the settings and the first hashes, then deltas of the same
/// version carrying the rest.
pub const FULL_CHUNK_HASHES: usize = 1 << 16;

/// `full` as messages of at most `max_hashes` hashes each (the first is the full one).
pub fn split_full(mut full: Snapshot, max_hashes: usize) -> Vec<Snapshot> {
    let max_hashes = max_hashes.max(1);
    let inserts = std::mem::take(&mut full.inserts);
    let rest = || Snapshot { version: full.version, sent_at_ms: full.sent_at_ms, ..Default::default() };
    let mut parts = Vec::new();
    let mut current = Vec::new();
    let mut room = max_hashes;
    for insert in inserts {
        let mut hashes = insert.hashes.as_slice();
        while !hashes.is_empty() {
            let (now, later) = hashes.split_at(room.min(hashes.len()));
            current.push(kvmesh_proto::v1::IndexInsert {
                worker: insert.worker,
                // Pieces of an oldest-first list, each newest first: the gateway's inserts
                // then keep the recency order (see `PrefixIndex::export`).
                hashes: kvmesh_core::index::as_insert(now),
                ..Default::default()
            });
            room -= now.len();
            hashes = later;
            if room == 0 {
                parts.push(std::mem::take(&mut current));
                room = max_hashes;
            }
        }
    }
    if !current.is_empty() || parts.is_empty() {
        parts.push(current);
    }
    let mut out: Vec<Snapshot> = parts.into_iter().map(|inserts| Snapshot { inserts, ..rest() }).collect();
    if let Some(first) = out.first_mut() {
        let inserts = std::mem::take(&mut first.inserts);
        *first = Snapshot { inserts, ..full };
    }
    out
}

/// A full snapshot for `gateway` (a span when traces are on).
fn full_snapshot(state: &State, gateway: &str) -> Snapshot {
    let span = tracing::info_span!(target: SPANS, "snapshot.full", gateway, version = tracing::field::Empty,
                                   blocks = tracing::field::Empty);
    let _in = span.enter();
    let full = state.full_snapshot();
    span.record("version", full.version);
    span.record("blocks", full.inserts.iter().map(|i| i.hashes.len()).sum::<usize>());
    full
}

fn refused(e: GatewayError) -> Status {
    match e {
        GatewayError::BadId(_) => Status::invalid_argument(e.to_string()),
        GatewayError::TooMany | GatewayError::TooManyWatches => Status::resource_exhausted(e.to_string()),
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

/// Ends a gateway's `Watch` stream in the state when the stream is dropped (the client went
/// away, or the server shut down).
struct Watching {
    state: Arc<State>,
    gateway: String,
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.state.watch_closed(&self.gateway);
    }
}

/// Waits (bounded) until Envoy's cluster lists the healthy workers of a snapshot that carries
/// the worker table (see [`crate::endpoint_acks`]). An endpoint waited for in vain is not
/// waited for again while it stays in the table (`waived`): an Envoy that stopped
/// acknowledging holds each table up once, not every table after it.
async fn endpoints_in_envoy(acks: &EndpointAcks, snapshot: &Snapshot, gateway: &str, waived: &mut BTreeSet<Endpoint>) {
    if !snapshot.workers_changed {
        return;
    }
    let mut needed = crate::eds::healthy_endpoints(&snapshot.workers);
    waived.retain(|e| needed.contains(e));
    needed.retain(|e| !waived.contains(e));
    if !acks.wait_for(&needed).await {
        let missing = acks.missing(&needed);
        tracing::warn!(%gateway, version = snapshot.version, ?missing,
            "Envoy's endpoints do not list these healthy workers yet (--eds-wait-ms passed): the table goes out anyway");
        waived.extend(missing);
    }
}

pub struct Service {
    pub state: Arc<State>,
    /// What Envoy's EDS streams acknowledged: a table waits for its healthy workers there.
    pub acks: Arc<EndpointAcks>,
    /// A standby refuses both streams (UNAVAILABLE) and ends them when it stops leading.
    pub leadership: Leadership,
}

type Snapshots = Pin<Box<dyn Stream<Item = Result<Snapshot, Status>> + Send>>;

#[tonic::async_trait]
impl Kvmesh for Service {
    type WatchStream = Snapshots;

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<Snapshots>, Status> {
        self.leadership.check()?;
        let gateway = request.into_inner().gateway_id;
        let state = self.state.clone();
        if let Err(e) = state.gateway_connected(&gateway) {
            state.bad_report();
            return Err(refused(e));
        }
        // Subscribe before taking the full snapshot so that no delta falls in between.
        let mut deltas = state.subscribe();
        let full = full_snapshot(&state, &gateway);
        tracing::info!(%gateway, version = full.version, blocks = full.inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), "gateway watching");
        let watching = Watching { state: state.clone(), gateway: gateway.clone() };
        let acks = self.acks.clone();
        let stream = async_stream::stream! {
            let _watching = watching;
            let mut seen = full.version;
            let mut waived = BTreeSet::new();
            endpoints_in_envoy(&acks, &full, &gateway, &mut waived).await;
            for part in split_full(full, FULL_CHUNK_HASHES) {
                yield Ok(part);
            }
            loop {
                match deltas.recv().await {
                    Ok(delta) if delta.version > seen => {
                        seen = delta.version;
                        endpoints_in_envoy(&acks, &delta, &gateway, &mut waived).await;
                        yield Ok((*delta).clone());
                    }
                    Ok(_) => {}
                    Err(RecvError::Lagged(missed)) => {
                        tracing::warn!(%gateway, missed, "gateway fell behind; sending a full snapshot");
                        let full = full_snapshot(&state, &gateway);
                        seen = full.version;
                        endpoints_in_envoy(&acks, &full, &gateway, &mut waived).await;
                        for part in split_full(full, FULL_CHUNK_HASHES) {
                            yield Ok(part);
                        }
                    }
                    Err(RecvError::Closed) => break,
                }
            }
        };
        Ok(Response::new(self.leadership.guard(Box::pin(stream))))
    }

    async fn report(&self, request: Request<Streaming<ReportBatch>>) -> Result<Response<ReportAck>, Status> {
        self.leadership.check()?;
        let mut stream = request.into_inner();
        let mut batches = 0;
        // One stream is one gateway: the id of its first batch, tracked until it ends.
        let mut reporting: Option<Reporting> = None;
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                () = self.leadership.lost() => return Err(Status::unavailable(crate::election::STANDBY)),
            };
            match message {
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
                    let hashes: usize = batch.inserts.iter().map(|i| i.hashes.len()).sum();
                    let span = tracing::info_span!(target: SPANS, "report", gateway = %batch.gateway_id,
                                                   inserts = batch.inserts.len(), hashes);
                    span.in_scope(|| self.state.report(batch));
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_proto::v1::{IndexInsert, Worker};

    #[test]
    fn a_full_snapshot_goes_out_in_bounded_messages() {
        let full = Snapshot {
            version: 7,
            full: true,
            workers: vec![Worker { id: 0, ..Default::default() }],
            workers_changed: true,
            inserts: vec![
                IndexInsert { worker: 0, hashes: (0..5).collect(), ..Default::default() },
                IndexInsert { worker: 1, hashes: (5..8).collect(), ..Default::default() },
            ],
            ..Default::default()
        };
        let parts = split_full(full.clone(), 3);
        let sizes: Vec<usize> = parts.iter().map(|p| p.inserts.iter().map(|i| i.hashes.len()).sum()).collect();
        assert_eq!(sizes, [3, 3, 2]);
        assert!(parts[0].full && parts[0].workers_changed && parts[0].workers.len() == 1);
        assert!(parts[1..].iter().all(|p| !p.full && !p.workers_changed && p.workers.is_empty() && p.version == 7));
        let mut all: Vec<(u32, u64)> =
            parts.iter().flat_map(|p| &p.inserts).flat_map(|i| i.hashes.iter().map(move |&h| (i.worker, h))).collect();
        all.sort();
        assert_eq!(all, (0..5).map(|h| (0, h)).chain((5..8).map(|h| (1, h))).collect::<Vec<_>>());
        // The lists are oldest first: pieces go in that order, each newest first (an insert
        // stamps its first hash as the most recently used).
        let pieces: Vec<(u32, Vec<u64>)> =
            parts.iter().flat_map(|p| &p.inserts).map(|i| (i.worker, i.hashes.clone())).collect();
        assert_eq!(pieces, [(0, vec![2, 1, 0]), (0, vec![4, 3]), (1, vec![5]), (1, vec![7, 6])]);
        // Small ones stay one message; an empty index is one full message.
        let one = split_full(full.clone(), 100);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].inserts[0].hashes, [4, 3, 2, 1, 0]);
        let empty = Snapshot { version: 1, full: true, ..Default::default() };
        assert_eq!(split_full(empty.clone(), 3), vec![empty]);
    }

    #[tokio::test]
    async fn an_endpoint_waited_for_in_vain_is_not_waited_for_again_while_it_stays() {
        let acks = EndpointAcks::new(std::time::Duration::from_millis(10), Default::default());
        let stuck = acks.open();
        stuck.acked(&[]);
        let worker =
            |port: u16| Worker { url: format!("http://127.0.0.1:{port}"), healthy: true, ..Default::default() };
        let table = |ports: &[u16]| Snapshot {
            workers_changed: true,
            workers: ports.iter().map(|p| worker(*p)).collect(),
            ..Default::default()
        };
        let mut waived = BTreeSet::new();
        endpoints_in_envoy(&acks, &table(&[1]), "g", &mut waived).await;
        assert_eq!(waived, BTreeSet::from([("127.0.0.1".to_string(), 1)]), "given up on once");
        endpoints_in_envoy(&acks, &table(&[1, 2]), "g", &mut waived).await;
        assert_eq!(waived.len(), 2, "the new one is waited for, then waived too");
        // Gone from the table: waited for again should it come back.
        endpoints_in_envoy(&acks, &table(&[2]), "g", &mut waived).await;
        assert_eq!(waived, BTreeSet::from([("127.0.0.1".to_string(), 2)]));
        stuck.acked(&[("127.0.0.1".into(), 1, true)]);
        endpoints_in_envoy(&acks, &table(&[1]), "g", &mut waived).await;
        assert!(waived.is_empty(), "covered: nothing waived");
    }
}
