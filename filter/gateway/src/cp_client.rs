//! The control-plane client of one VM, beside [`Link`] (the link's state machine): on the
//! tick it takes or keeps the lease and does what the link answers (open the streams, report,
//! hand over); it applies the snapshots that arrive and sends the full report a new connection
//! needs — all over [`LinkHost`].

use kvmesh_core::Config;
use kvmesh_proto::v1::{Snapshot, WatchRequest};
use kvmesh_proto::{Message, REPORT, SERVICE, WATCH};

use crate::gateway::{Gateway, Now};
use crate::host::{now_ms, HostError, LinkHost, Metric, VmHost};
use crate::link::{Link, Step, LEASE_MS};
use crate::shared::Lease;

/// Most index hashes per report message (512 KiB of hashes; the control plane decodes at
/// most 16 MiB per message by default).
pub const MAX_HASHES_PER_REPORT: usize = 1 << 16;

/// Where to connect, as whom, and the link's state.
pub struct ControlPlaneClient {
    cluster: String,
    /// The bearer token sent as initial metadata on both streams.
    token: Option<String>,
    /// This Envoy's id (shared by its VMs), read or made on connect.
    gateway_id: String,
    /// Randomness for making that id, should this VM be the first to need it.
    id_seed: u64,
    /// Connected, but the first snapshot of this connection has not been applied: nothing is
    /// reported until it is, so that the index goes out under the new table's ids.
    awaiting_table: bool,
    link: Link,
}

impl ControlPlaneClient {
    /// The client `config` asks for (none: static workers only); `seed` is the VM's.
    pub fn new(config: &Config, seed: u64) -> Result<Option<Self>, String> {
        let Some(cluster) = config.control_plane_cluster.as_deref().map(grpc_target).transpose()? else {
            return Ok(None);
        };
        Ok(Some(Self {
            cluster,
            token: config.control_plane_token.clone(),
            gateway_id: String::new(),
            id_seed: seed.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15,
            awaiting_table: false,
            link: Link::new(config.report_interval_ms),
        }))
    }

    /// Whether both streams are open.
    pub fn is_connected(&self) -> bool {
        self.link.is_connected()
    }

    /// The tick's turn at `now` (ms): the lease, then what the link answers.
    pub fn tick(&mut self, host: &dyn VmHost, link: &dyn LinkHost, gateway: &mut Gateway, now: u64) {
        let holds = Lease::hold(host, gateway.ledger().vm(), now, LEASE_MS);
        match self.link.tick(now, holds) {
            Step::Nothing => {}
            Step::Connect => match self.connect(link) {
                Ok((watch, report)) => {
                    gateway.publisher().set_own_id(&self.gateway_id);
                    self.link.connected(watch, report, now);
                    self.awaiting_table = true;
                }
                Err(e) => {
                    log::warn!("cannot open the control-plane streams on cluster {}: {e}", self.cluster);
                    self.link.connect_failed(now);
                }
            },
            Step::Close { watch, report } => {
                log::info!("control-plane stream handed over to another VM");
                link.cancel_grpc(watch);
                link.cancel_grpc(report);
            }
            Step::Report { .. } if self.awaiting_table => {}
            Step::Report { report, counts_due } => {
                let batch = gateway.take_report(host, &self.gateway_id, Now::from_ms(now));
                if !batch.inserts.is_empty() || counts_due {
                    match link.send_grpc(report, &batch.encode_to_vec(), false) {
                        Ok(()) => self.link.reported(now),
                        Err(e) => {
                            log::warn!("report to the control plane failed: {e}; reconnecting");
                            self.reconnect(link, now);
                        }
                    }
                }
            }
        }
    }

    /// After a failed send: the link backs off, and both streams are cancelled.
    fn reconnect(&mut self, link: &dyn LinkHost, now: u64) {
        for token in self.link.send_failed(now).into_iter().flat_map(|(w, r)| [w, r]) {
            link.cancel_grpc(token);
        }
    }

    /// A message on stream `token`: a snapshot, if it is the watch stream.
    pub fn on_message(&mut self, host: &dyn LinkHost, gateway: &mut Gateway, token: u32, size: usize) {
        if !self.link.is_watch(token) {
            return;
        }
        let bytes = host.grpc_message(size);
        let snapshot = match Snapshot::decode(bytes.as_slice()) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("undecodable snapshot from the control plane: {e}");
                return;
            }
        };
        self.link.snapshot_received();
        if snapshot.full {
            log::info!("control plane snapshot {} with {} workers", snapshot.version, snapshot.workers.len());
        }
        gateway.apply_snapshot(host, &snapshot);
        gateway.publisher().fleet_usage(host, &snapshot, now_ms(host));
        host.record(Metric::SnapshotVersion, snapshot.version);
        host.record(Metric::IndexBlocks, gateway.index_len() as u64);
        // The first snapshot of a connection is full and its table now applied (ids that name
        // another worker forgotten): the index goes out under the ids the control plane uses.
        if self.awaiting_table && snapshot.full {
            self.awaiting_table = false;
            let Some((_, report)) = self.link.streams() else { return };
            for chunk in gateway.full_report(&self.gateway_id, MAX_HASHES_PER_REPORT) {
                if let Err(e) = host.send_grpc(report, &chunk.encode_to_vec(), false) {
                    log::warn!("full report to the control plane failed: {e}; reconnecting");
                    self.reconnect(host, now_ms(host));
                    return;
                }
            }
            self.link.reported(now_ms(host));
        }
    }

    /// Stream `token` closed: both go, and the link reconnects after its backoff.
    pub fn on_close(&mut self, host: &dyn LinkHost, token: u32, status: u32) {
        if let Some(other) = self.link.stream_closed(token, now_ms(host)) {
            log::warn!("control-plane stream closed (grpc status {status}); reconnecting with backoff");
            if let Some(other) = other {
                host.cancel_grpc(other);
            }
        }
    }

    /// Opens both streams (with the token as `authorization` metadata) and sends the watch
    /// request. The full report of this VM's index (so that a restarted control plane learns what
    /// the gateways already know) follows the first snapshot. On failure, whatever was opened is
    /// cancelled.
    fn connect(&mut self, host: &dyn LinkHost) -> Result<(u32, u32), HostError> {
        self.gateway_id = crate::shared::gateway_id(host, host.node_id(), self.id_seed);
        let authorization = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let metadata: Vec<(&str, &[u8])> =
            authorization.as_ref().map(|a| ("authorization", a.as_bytes())).into_iter().collect();
        let watch = host.open_grpc_stream(&self.cluster, SERVICE, WATCH, &metadata)?;
        let request = WatchRequest { gateway_id: self.gateway_id.clone() }.encode_to_vec();
        if let Err(e) = host.send_grpc(watch, &request, true) {
            host.cancel_grpc(watch);
            return Err(e);
        }
        let report = match host.open_grpc_stream(&self.cluster, SERVICE, REPORT, &metadata) {
            Ok(r) => r,
            Err(e) => {
                host.cancel_grpc(watch);
                return Err(e);
            }
        };
        Ok((watch, report))
    }
}

/// What the streams are opened on. Envoy takes a bare cluster name as the streams'
/// `:authority` too, and Istio's cluster names (`outbound|PORT|SUBSET|HOST`) are not valid
/// authorities: the HTTP/2 stream would be refused as a protocol error. For those, the filter
/// hands Envoy a serialized `envoy.config.core.v3.GrpcService` instead (Envoy's Wasm host
/// accepts either): `envoy_grpc { cluster_name: <the cluster>, authority: "HOST:PORT" }`, the
/// authority Istio itself gives gRPC calls to that Service.
fn grpc_target(cluster: &str) -> Result<String, String> {
    let mut parts = cluster.split('|');
    let (Some("outbound"), Some(port), Some(_subset), Some(host), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Ok(cluster.to_string());
    };
    let authority = format!("{host}:{port}");
    // Protobuf fields: tag, length (one byte while under 128, which keeps the text ASCII), bytes.
    let field = |tag: u8, value: &str| -> Option<String> {
        let len = u8::try_from(value.len()).ok().filter(|l| *l < 128)?;
        Some(format!("{}{}{value}", char::from(tag), char::from(len)))
    };
    let envoy_grpc = field(0x0a, cluster).zip(field(0x12, &authority)).map(|(c, a)| c + &a);
    envoy_grpc.and_then(|inner| field(0x0a, &inner)).ok_or_else(|| {
        format!(
            "invalid configuration: control_plane_cluster `{cluster}` is too long to open gRPC streams on \
             (the cluster name and `{authority}` must fit in 123 bytes)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use crate::plugin::Plugin;

    #[test]
    fn istio_cluster_names_get_a_valid_authority() {
        // A plain cluster name is passed as it is: Envoy makes it the authority too.
        assert_eq!(grpc_target("kvmesh_control_plane").unwrap(), "kvmesh_control_plane");
        // Istio's: a GrpcService { envoy_grpc { cluster_name, authority } }, byte for byte.
        let cluster = "outbound|18000||kvmesh-cp.kvmesh.svc.cluster.local";
        let authority = "kvmesh-cp.kvmesh.svc.cluster.local:18000";
        let mut inner = vec![0x0a, cluster.len() as u8];
        inner.extend_from_slice(cluster.as_bytes());
        inner.extend_from_slice(&[0x12, authority.len() as u8]);
        inner.extend_from_slice(authority.as_bytes());
        let mut want = vec![0x0a, inner.len() as u8];
        want.extend_from_slice(&inner);
        assert_eq!(grpc_target(cluster).unwrap().into_bytes(), want);
        // What the streams open on.
        let host = MockHost::new();
        let mut p = Plugin::default();
        let config = format!(r#"{{"control_plane_cluster":"{}"}}"#, cluster);
        p.configure(&host, config.as_bytes(), 1).unwrap();
        p.on_tick(&host);
        let opened = host.grpc_opened.borrow().clone();
        assert_eq!(opened.len(), 2);
        assert!(opened.iter().all(|(_, c)| c.as_bytes().starts_with(&want)), "{opened:?}");
        // Too long for one-byte lengths: refused with a message, never a stream Envoy rejects.
        let long = format!("outbound|8000||{}.svc.cluster.local", "x".repeat(60));
        let e = Plugin::default().configure(&host, format!(r#"{{"control_plane_cluster":"{long}"}}"#).as_bytes(), 1);
        assert!(e.unwrap_err().contains("too long"));
        // Not Istio's shape (five parts): passed as it is.
        assert_eq!(grpc_target("outbound|1|a|b|c").unwrap(), "outbound|1|a|b|c");
    }
}
