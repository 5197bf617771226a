//! Envoy's endpoint discovery service (EDS, state-of-the-world over gRPC): the cluster the
//! filter routes into gets exactly the workers of the control plane's table, with their
//! health, so that Envoy's `override_host` load balancer can reach every worker a filter
//! names, and its retries can move a request to the next one (see docs/ARCHITECTURE.md,
//! "Failover").
//!
//! Every cluster name Envoy asks for gets every worker (all roles: in PD mode the decode leg
//! and the prefill callout share one cluster; the filter's header names the worker). Workers
//! whose URL host is not an IP address are left out (an EDS endpoint is an address), with a
//! warning. A worker the control plane finds unhealthy is sent as UNHEALTHY, which
//! `override_host` does not pick.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use kvmesh_proto::eds::endpoint_discovery_service_server::EndpointDiscoveryService;
use kvmesh_proto::eds::{
    Address, Any, ClusterLoadAssignment, DiscoveryRequest, DiscoveryResponse, Endpoint, HealthStatus, LbEndpoint,
    LocalityLbEndpoints, SocketAddress,
};
use kvmesh_proto::{Message, CLUSTER_LOAD_ASSIGNMENT};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::{sleep_until, Instant};
use tonic::{Request, Response, Status, Streaming};

use crate::election::Leadership;
use crate::endpoint_acks::EndpointAcks;
use crate::state::{State, WorkerEntry};

/// Most cluster names one stream may ask for.
const MAX_RESOURCE_NAMES: usize = 64;

/// A worker URL's EDS endpoint: `(ip, port)`; `None` when its host is not an IP address.
fn ip_endpoint(url: &str) -> Option<crate::endpoint_acks::Endpoint> {
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = host.parse().ok()?;
    let port: u32 = port.parse().ok().filter(|p| (1..=65535).contains(p))?;
    Some((ip.to_string(), port))
}

/// A worker as an EDS endpoint: `(ip, port, healthy)`; `None` when its URL has no IP address.
fn endpoint_of(w: &WorkerEntry) -> Option<(String, u32, bool)> {
    ip_endpoint(&w.url).map(|(ip, port)| (ip, port, w.healthy))
}

/// The endpoints a table's healthy workers need in Envoy's cluster before a filter may pick
/// them (see [`crate::endpoint_acks`]).
pub fn healthy_endpoints(workers: &[kvmesh_proto::v1::Worker]) -> Vec<crate::endpoint_acks::Endpoint> {
    workers.iter().filter(|w| w.healthy).filter_map(|w| ip_endpoint(&w.url)).collect()
}

/// The endpoints of every worker, sorted (so that an unchanged table compares equal).
pub fn endpoints(workers: &[WorkerEntry]) -> Vec<(String, u32, bool)> {
    let mut out: Vec<_> = workers
        .iter()
        .filter_map(|w| {
            let e = endpoint_of(w);
            if e.is_none() {
                tracing::warn!(url = %w.url, "worker left out of EDS: its URL host is not an IP address");
            }
            e
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn assignment(cluster: &str, endpoints: &[(String, u32, bool)]) -> Any {
    let lb_endpoints = endpoints
        .iter()
        .map(|(ip, port, healthy)| LbEndpoint {
            endpoint: Some(Endpoint {
                address: Some(Address {
                    socket_address: Some(SocketAddress { address: ip.clone(), port_value: *port }),
                }),
                hostname: String::new(),
            }),
            health_status: if *healthy { HealthStatus::Healthy } else { HealthStatus::Unhealthy } as i32,
        })
        .collect();
    let cla = ClusterLoadAssignment {
        cluster_name: cluster.to_string(),
        endpoints: vec![LocalityLbEndpoints { lb_endpoints }],
    };
    Any { type_url: CLUSTER_LOAD_ASSIGNMENT.to_string(), value: cla.encode_to_vec() }
}

/// Endpoints that left the table stay in the assignment (as they were) for the table wait
/// longer: a filter that has not applied the table without them yet may still name one, and
/// Envoy can then still send to it (the cluster has no fallback). A dead worker's lingering
/// endpoint gets nothing: no filter names it once its table has gone out.
struct Linger {
    wait: Duration,
    /// `(ip, port)` → its last `healthy`, and when it goes.
    gone: BTreeMap<(String, u32), (bool, Instant)>,
}

impl Linger {
    fn new(wait: Duration) -> Self {
        Self { wait, gone: BTreeMap::new() }
    }

    /// The endpoints to send at `at`: `now`, plus those of `previous` that left it less than
    /// the wait ago (sorted).
    fn apply(
        &mut self,
        now: Vec<(String, u32, bool)>,
        previous: &[(String, u32, bool)],
        at: Instant,
    ) -> Vec<(String, u32, bool)> {
        let present: BTreeSet<(&str, u32)> = now.iter().map(|(ip, port, _)| (ip.as_str(), *port)).collect();
        for (ip, port, healthy) in previous {
            if !self.wait.is_zero() && !present.contains(&(ip.as_str(), *port)) {
                self.gone.entry((ip.clone(), *port)).or_insert((*healthy, at + self.wait));
            }
        }
        self.gone.retain(|(ip, port), (_, until)| *until > at && !present.contains(&(ip.as_str(), *port)));
        let mut out = now;
        out.extend(self.gone.iter().map(|((ip, port), (healthy, _))| (ip.clone(), *port, *healthy)));
        out.sort();
        out
    }

    /// When the next lingering endpoint goes (far off when none does).
    fn next_expiry(&self) -> Instant {
        self.gone.values().map(|(_, until)| *until).min().unwrap_or_else(|| Instant::now() + Duration::from_secs(3600))
    }
}

/// A request kvmesh-cp can answer.
fn check(req: &DiscoveryRequest) -> Result<(), Status> {
    if req.type_url != CLUSTER_LOAD_ASSIGNMENT {
        return Err(Status::invalid_argument(format!("kvmesh-cp serves only {CLUSTER_LOAD_ASSIGNMENT}")));
    }
    if req.resource_names.len() > MAX_RESOURCE_NAMES {
        return Err(Status::invalid_argument(format!("at most {MAX_RESOURCE_NAMES} clusters per stream")));
    }
    Ok(())
}

pub struct Service {
    pub state: Arc<State>,
    /// Where each stream records what Envoy acknowledged.
    pub acks: Arc<EndpointAcks>,
    /// A standby refuses the stream (UNAVAILABLE; Envoy keeps the endpoints it has and
    /// retries) and ends it when it stops leading.
    pub leadership: Leadership,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EndpointDiscoveryService for Service {
    type StreamEndpointsStream = Responses;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        self.leadership.check()?;
        let peer = request.remote_addr();
        let mut requests = request.into_inner();
        let state = self.state.clone();
        let mut changes = state.subscribe();
        let acks = self.acks.open();
        let wait = self.acks.wait();
        let stream = async_stream::try_stream! {
            let mut names: BTreeSet<String> = BTreeSet::new();
            let mut sent: Option<(BTreeSet<String>, Vec<(String, u32, bool)>)> = None;
            let mut version = 0u64;
            let mut linger = Linger::new(wait);
            loop {
                // Wait for a request, a change of the worker table, or a removed endpoint's
                // time to go.
                let expiry = linger.next_expiry();
                let event = tokio::select! {
                    () = sleep_until(expiry) => None,
                    req = requests.next() => match req {
                        None => break,
                        Some(Err(e)) => { tracing::debug!(?peer, "EDS stream ended: {e}"); break }
                        Some(Ok(req)) => Some(req),
                    },
                    change = changes.recv() => match change {
                        Ok(s) if s.full || s.workers_changed => None,
                        Ok(_) => continue,
                        Err(RecvError::Lagged(_)) => None,
                        Err(RecvError::Closed) => break,
                    },
                };
                if let Some(req) = event {
                    check(&req)?;
                    if let Some(e) = &req.error_detail {
                        tracing::warn!(?peer, version = %req.version_info, "Envoy refused endpoints: {}", e.message);
                    } else if let Some((_, endpoints)) = sent.as_ref().filter(|_| req.response_nonce == version.to_string()) {
                        // Envoy applied the last assignment (an ACK names its nonce).
                        acks.acked(endpoints);
                    }
                    names = req.resource_names.into_iter().collect();
                }
                if names.is_empty() {
                    continue;
                }
                let previous = sent.as_ref().map(|(_, e)| e.as_slice()).unwrap_or_default();
                let now = linger.apply(endpoints(&state.workers()), previous, Instant::now());
                if sent.as_ref().is_some_and(|(n, e)| *n == names && *e == now) {
                    continue;
                }
                version += 1;
                let resources = names.iter().map(|name| assignment(name, &now)).collect();
                yield DiscoveryResponse {
                    version_info: version.to_string(),
                    resources,
                    type_url: CLUSTER_LOAD_ASSIGNMENT.to_string(),
                    nonce: version.to_string(),
                };
                sent = Some((names.clone(), now));
            }
        };
        Ok(Response::new(self.leadership.guard(Box::pin(stream))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(url: &str, healthy: bool) -> WorkerEntry {
        WorkerEntry::for_test(url, healthy)
    }

    #[test]
    fn workers_become_sorted_endpoints_and_hostnames_are_left_out() {
        let ws = [
            worker("http://127.0.0.2:30002", false),
            worker("http://127.0.0.1:30001/", true),
            worker("http://sglang.default.svc:30000", true),
            worker("http://[::1]:30003", true),
        ];
        assert_eq!(
            endpoints(&ws),
            vec![
                ("127.0.0.1".to_string(), 30001, true),
                ("127.0.0.2".to_string(), 30002, false),
                ("::1".to_string(), 30003, true)
            ]
        );
    }

    #[test]
    fn a_removed_endpoint_lingers_for_the_wait_then_goes() {
        let ep = |port: u32, healthy: bool| ("127.0.0.1".to_string(), port, healthy);
        let t0 = Instant::now();
        let wait = Duration::from_secs(1);
        let mut linger = Linger::new(wait);
        let sent = linger.apply(vec![ep(1, true), ep(2, true)], &[], t0);
        // 2 leaves the table: still sent, as it was, until the wait is over.
        let sent = linger.apply(vec![ep(1, true)], &sent, t0);
        assert_eq!(sent, vec![ep(1, true), ep(2, true)]);
        assert_eq!(linger.next_expiry(), t0 + wait);
        let later = linger.apply(vec![ep(1, true)], &sent, t0 + wait / 2);
        assert_eq!(later, sent, "the wait counts from when it left");
        assert_eq!(linger.apply(vec![ep(1, true)], &later, t0 + wait), vec![ep(1, true)]);
        // Back in the table before it went: the table's health wins.
        let sent = linger.apply(vec![ep(1, true)], &[ep(1, true), ep(2, true)], t0);
        assert_eq!(linger.apply(vec![ep(1, true), ep(2, false)], &sent, t0), vec![ep(1, true), ep(2, false)]);
        assert!(linger.gone.is_empty());
        // No wait: gone at once.
        assert_eq!(Linger::new(Duration::ZERO).apply(vec![], &[ep(1, true)], t0), vec![]);
    }

    #[test]
    fn requests_for_other_types_or_too_many_clusters_are_refused() {
        let ok = DiscoveryRequest {
            type_url: CLUSTER_LOAD_ASSIGNMENT.into(),
            resource_names: vec!["kvmesh_workers".into()],
            ..Default::default()
        };
        assert!(check(&ok).is_ok());
        let other =
            DiscoveryRequest { type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(), ..ok.clone() };
        assert_eq!(check(&other).unwrap_err().code(), tonic::Code::InvalidArgument);
        let many = DiscoveryRequest { resource_names: vec!["c".into(); MAX_RESOURCE_NAMES + 1], ..ok };
        assert_eq!(check(&many).unwrap_err().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn an_assignment_decodes_as_envoy_would_read_it() {
        let any =
            assignment("kvmesh_workers", &[("127.0.0.1".into(), 30001, true), ("127.0.0.2".into(), 30002, false)]);
        assert_eq!(any.type_url, CLUSTER_LOAD_ASSIGNMENT);
        let cla = ClusterLoadAssignment::decode(any.value.as_slice()).unwrap();
        assert_eq!(cla.cluster_name, "kvmesh_workers");
        let eps = &cla.endpoints[0].lb_endpoints;
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[1].health_status, HealthStatus::Unhealthy as i32);
        let addr = eps[0].endpoint.as_ref().unwrap().address.as_ref().unwrap().socket_address.as_ref().unwrap();
        assert_eq!((addr.address.as_str(), addr.port_value), ("127.0.0.1", 30001));
    }
}
