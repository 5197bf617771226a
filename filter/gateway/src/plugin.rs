//! The plugin (root context) logic of one VM, host-independent: the configuration, parsed and
//! validated once; the VM's [`Gateway`]; and the tick — adopt the control plane's worker
//! table, drive the control-plane [`Link`] (lease, streams, reports), run eviction.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use kvmesh_core::Config;
use kvmesh_proto::v1::{Snapshot, WatchRequest};
use kvmesh_proto::{Message, REPORT, SERVICE, WATCH};

use crate::admission::Wake;
use crate::gateway::{Gateway, Now};
use crate::host::{now_ms, HostError, LinkHost, Metric, StreamHost, VmHost};
use crate::link::{Link, Step, LEASE_MS};
use crate::request::{RequestFilter, Room};
use crate::shared::admission::SharedBucket;
use crate::shared::{Inflight, Lease, SharedStore};

/// The control-plane side of the plugin: where to connect, as whom, and the link's state.
struct ControlPlane {
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

/// Most index hashes per report message (512 KiB of hashes; the control plane decodes at
/// most 16 MiB per message by default).
pub const MAX_HASHES_PER_REPORT: usize = 1 << 16;

#[derive(Default)]
pub struct Plugin {
    gateway: Option<Rc<RefCell<Gateway>>>,
    control_plane: Option<ControlPlane>,
    /// This root context's id: the tick enters requests' contexts and comes back to it.
    context_id: u32,
    /// The VM's admission queue.
    room: Rc<RefCell<Room>>,
    /// Prefill callouts dispatched from the tick (for requests admitted from the queue): the
    /// host answers them to the root context, which hands them on.
    callouts: HashMap<u32, (u32, Weak<RefCell<RequestFilter>>)>,
    /// When this VM last recorded its memory (ms).
    memory_recorded_ms: u64,
    /// Never holds the control-plane streams: another plugin in this Envoy does (see
    /// [`Plugin::follow`]).
    follower: bool,
}

impl Plugin {
    /// Parses and validates the plugin configuration; `seed` seeds this VM's randomness.
    pub fn configure(&mut self, host: &dyn VmHost, bytes: &[u8], seed: u64) -> Result<(), String> {
        let config = Config::from_json(bytes).map_err(|e| format!("invalid configuration: {e}"))?;
        match &config.pd {
            Some(pd) => log::info!(
                "PD mode: prefill policy {}, decode policy {}, {} static workers",
                pd.prefill_policy,
                pd.decode_policy,
                config.workers.workers.len()
            ),
            None => log::info!(
                "policy {} over {} static workers, max payload {} bytes",
                config.policy,
                config.workers.workers.len(),
                config.max_payload_size
            ),
        }
        let cluster = config.control_plane_cluster.as_deref().map(grpc_target).transpose()?;
        let token = config.control_plane_token.clone();
        let report_interval_ms = config.report_interval_ms;
        let gateway = Gateway::new(config, host, seed);
        self.control_plane = cluster.map(|cluster| ControlPlane {
            cluster,
            token,
            gateway_id: String::new(),
            id_seed: seed.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15,
            awaiting_table: false,
            link: Link::new(report_interval_ms),
        });
        self.gateway = Some(Rc::new(RefCell::new(gateway)));
        Ok(())
    }

    /// Leaves the control-plane streams to another plugin of this Envoy for good (the native
    /// build's background thread holds them): this one only follows the table and index the
    /// stream owner shares, as a VM without the lease does, and keeps its stats to itself.
    pub fn follow(&mut self) {
        self.control_plane = None;
        self.follower = true;
    }

    /// The gateway every request context of this VM shares.
    pub fn gateway(&self) -> Option<Rc<RefCell<Gateway>>> {
        self.gateway.clone()
    }

    pub fn set_context_id(&mut self, id: u32) {
        self.context_id = id;
    }

    /// A request context's filter, able to wait in this VM's queue.
    pub fn new_request(&self, context_id: u32) -> Rc<RefCell<RequestFilter>> {
        RequestFilter::seated(self.gateway(), Rc::clone(&self.room), context_id)
    }

    /// The whole tick of a VM that holds requests and may hold the control-plane streams (a
    /// `.wasm` VM's root context): [`Plugin::tick`], then [`Plugin::wake_waiting`].
    pub fn on_tick<H: StreamHost + LinkHost>(&mut self, host: &H) {
        self.tick(host, Some(host));
        self.wake_waiting(host);
    }

    /// The plugin's periodic work: the gateway's (the shared table, ended requests, engine
    /// feedback, heartbeat, eviction) and, given `link`, the control-plane link's (lease,
    /// connect, reports); then its memory, once a second.
    pub fn tick(&mut self, host: &dyn VmHost, link: Option<&dyn LinkHost>) {
        self.tick_gateway(host, link);
        let now = now_ms(host);
        if now.saturating_sub(self.memory_recorded_ms) >= 1_000 {
            self.memory_recorded_ms = now;
            // Native builds have no VM memory to speak of (0).
            let bytes = host.vm_memory_bytes();
            if bytes > 0 {
                host.record(Metric::VmMemory, bytes);
            }
        }
    }

    /// The admission queue's turn, after the gateway's (admitted requests borrow it): the
    /// requests waiting too long get a 408, the oldest get the tokens left; each in its own
    /// context, then back to the root's.
    pub fn wake_waiting(&mut self, host: &dyn StreamHost) {
        let Some((params, vm)) =
            self.gateway.as_ref().and_then(|g| g.try_borrow().ok()).map(|g| (g.config().admission, g.vm_id()))
        else {
            return;
        };
        let now = now_ms(host);
        // Callouts whose request went away (Envoy cancelled them with the stream).
        self.callouts.retain(|_, (_, w)| w.strong_count() > 0);
        let wakes = match self.room.try_borrow_mut() {
            Ok(mut room) if !room.is_empty() || params.is_some() => room.tick(host, params.as_ref(), vm, now),
            _ => return,
        };
        if params.is_some() {
            host.record(Metric::Queued, SharedBucket::queued(host, now));
        }
        if wakes.is_empty() {
            return;
        }
        for wake in wakes {
            let (ctx, waiter, admit) = match wake {
                Wake::Admit(ctx, w) => (ctx, w, true),
                Wake::Expire(ctx, w) => (ctx, w, false),
            };
            let Some(filter) = waiter.upgrade() else { continue };
            if host.enter_context(ctx).is_err() {
                continue; // the stream is gone; its on_log cleans up
            }
            let Ok(mut f) = filter.try_borrow_mut() else { continue };
            if admit {
                f.admitted(host);
                if let Some(token) = f.callout_token() {
                    self.callouts.insert(token, (ctx, Rc::downgrade(&filter)));
                }
            } else {
                f.expired(host);
            }
        }
        let _ = host.enter_context(self.context_id);
    }

    /// An HTTP callout answered to the root context: a prefill leg dispatched from the tick.
    pub fn on_callout_response(&mut self, host: &dyn StreamHost, token: u32, body_size: usize) {
        let Some((ctx, waiter)) = self.callouts.remove(&token) else { return };
        let Some(filter) = waiter.upgrade() else { return };
        if host.enter_context(ctx).is_ok() {
            if let Ok(mut f) = filter.try_borrow_mut() {
                f.on_callout_response(host, token, body_size);
            }
        }
        let _ = host.enter_context(self.context_id);
    }

    fn tick_gateway(&mut self, host: &dyn VmHost, link: Option<&dyn LinkHost>) {
        let Some(gateway) = &self.gateway else { return };
        let Ok(mut gateway) = gateway.try_borrow_mut() else { return };
        let now = now_ms(host);
        gateway.sync_table(host);
        gateway.write_ended(host);
        gateway.flush_feedback(host);
        if let (Some(cp), Some(link)) = (self.control_plane.as_mut(), link) {
            let holds = Lease::hold(host, gateway.vm_id(), now, LEASE_MS);
            match cp.link.tick(now, holds) {
                Step::Nothing => {}
                Step::Connect => match connect(link, cp) {
                    Ok((watch, report)) => {
                        gateway.set_own_id(&cp.gateway_id);
                        cp.link.connected(watch, report, now);
                        cp.awaiting_table = true;
                    }
                    Err(e) => {
                        log::warn!("cannot open the control-plane streams on cluster {}: {e}", cp.cluster);
                        cp.link.connect_failed(now);
                    }
                },
                Step::Close { watch, report } => {
                    log::info!("control-plane stream handed over to another VM");
                    link.cancel_grpc(watch);
                    link.cancel_grpc(report);
                }
                Step::Report { .. } if cp.awaiting_table => {}
                Step::Report { report, counts_due } => {
                    let batch = gateway.take_report(host, &cp.gateway_id, Now::from_ms(now));
                    if !batch.inserts.is_empty() || counts_due {
                        match link.send_grpc(report, &batch.encode_to_vec(), false) {
                            Ok(()) => cp.link.reported(now),
                            Err(e) => {
                                log::warn!("report to the control plane failed: {e}; reconnecting");
                                for token in cp.link.send_failed(now).into_iter().flat_map(|(w, r)| [w, r]) {
                                    link.cancel_grpc(token);
                                }
                            }
                        }
                    }
                }
            }
        }
        gateway.heartbeat(host, now);
        if let Some(cp) = &self.control_plane {
            gateway.set_reporting(cp.link.is_connected());
        }
        host.record(Metric::InFlight, in_flight(host));
        if let Some(evicted) = gateway.tick(host, now / 1_000) {
            if evicted > 0 {
                log::info!("evicted {evicted} index blocks, {} left", gateway.index_len());
            }
        }
        // One gauge for the whole Envoy: with a control plane, the stream owner's index (it
        // applies every snapshot at once) is the one to show; idle VMs catch up lazily.
        let owner = !self.follower && self.control_plane.as_ref().is_none_or(|cp| cp.link.is_connected());
        if owner {
            host.record(Metric::IndexBlocks, gateway.index_len() as u64);
        }
    }

    /// Writes what the tick would: this VM's ended requests and engine-feedback counts.
    pub fn flush(&self, host: &dyn VmHost) {
        let Some(gateway) = &self.gateway else { return };
        let Ok(mut gateway) = gateway.try_borrow_mut() else { return };
        gateway.write_ended(host);
        gateway.flush_feedback(host);
    }

    /// A stream of this plugin ended, `others` of its streams still live. For a host without
    /// a timer, the last one's end may be the last chance to run for a long while: what the
    /// tick keeps goes to shared data now.
    pub fn on_stream_end(&self, host: &dyn VmHost, others: usize) {
        if others == 0 {
            self.flush(host);
        }
    }

    /// A message on a control-plane stream: a snapshot, on the watch stream.
    pub fn on_grpc_message(&mut self, host: &dyn LinkHost, token: u32, size: usize) {
        let (Some(cp), Some(gateway)) = (self.control_plane.as_mut(), &self.gateway) else { return };
        if !cp.link.is_watch(token) {
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
        cp.link.snapshot_received();
        let Ok(mut g) = gateway.try_borrow_mut() else { return };
        if snapshot.full {
            log::info!("control plane snapshot {} with {} workers", snapshot.version, snapshot.workers.len());
        }
        g.apply_snapshot(host, &snapshot);
        host.record(Metric::SnapshotVersion, snapshot.version);
        host.record(Metric::IndexBlocks, g.index_len() as u64);
        // The first snapshot of a connection is full and its table now applied (ids that name
        // another worker forgotten): the index goes out under the ids the control plane uses.
        if cp.awaiting_table && snapshot.full {
            cp.awaiting_table = false;
            let Some((_, report)) = cp.link.streams() else { return };
            for chunk in g.full_report(&cp.gateway_id, MAX_HASHES_PER_REPORT) {
                if let Err(e) = host.send_grpc(report, &chunk.encode_to_vec(), false) {
                    log::warn!("full report to the control plane failed: {e}; reconnecting");
                    for token in cp.link.send_failed(now_ms(host)).into_iter().flat_map(|(w, r)| [w, r]) {
                        host.cancel_grpc(token);
                    }
                    return;
                }
            }
            cp.link.reported(now_ms(host));
        }
    }

    /// A control-plane stream closed: both go, and the link reconnects after its backoff.
    pub fn on_grpc_close(&mut self, host: &dyn LinkHost, token: u32, status: u32) {
        let Some(cp) = self.control_plane.as_mut() else { return };
        if let Some(other) = cp.link.stream_closed(token, now_ms(host)) {
            log::warn!("control-plane stream closed (grpc status {status}); reconnecting with backoff");
            if let Some(other) = other {
                host.cancel_grpc(other);
            }
        }
    }
}

/// For a host that opens the control-plane streams itself instead of through an Envoy cluster
/// (the native build): where to — `control_plane_address`, which it needs beside
/// `control_plane_cluster` (none: static workers only).
pub fn own_link_address(config: &Config) -> Result<Option<&str>, String> {
    match (&config.control_plane_cluster, &config.control_plane_address) {
        (Some(_), None) => {
            Err("invalid configuration: the native build needs `control_plane_address` (http://host:port \
             of kvmesh-cp's gRPC port) beside control_plane_cluster"
                .into())
        }
        (_, address) => Ok(address.as_deref()),
    }
}

/// Requests in flight through this Envoy (all its VMs): the `kvmesh_in_flight` gauge.
pub fn in_flight(store: &dyn SharedStore) -> u64 {
    Inflight::counts(store).iter().map(|c| u64::from(c.in_flight)).sum()
}

/// When a plugin's host gives it no timer (the native build's worker threads tick on their
/// streams' hooks): whether a tick is due.
#[derive(Default)]
pub struct Pacer {
    last_ms: u64,
}

impl Pacer {
    /// Whether `period_ms` has passed since the last tick it allowed (or `always`); if so, the
    /// tick is taken now.
    pub fn due(&mut self, now_ms: u64, period_ms: u64, always: bool) -> bool {
        if !always && now_ms.saturating_sub(self.last_ms) < period_ms {
            return false;
        }
        self.last_ms = now_ms;
        true
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

/// Opens both streams (with the token as `authorization` metadata) and sends the watch
/// request. The full report of this VM's index (so that a restarted control plane learns what
/// the gateways already know) follows the first snapshot. On failure, whatever was opened is
/// cancelled.
fn connect(host: &dyn LinkHost, cp: &mut ControlPlane) -> Result<(u32, u32), HostError> {
    cp.gateway_id = crate::shared::gateway_id(host, host.node_id(), cp.id_seed);
    let authorization = cp.token.as_ref().map(|t| format!("Bearer {t}"));
    let metadata: Vec<(&str, &[u8])> =
        authorization.as_ref().map(|a| ("authorization", a.as_bytes())).into_iter().collect();
    let watch = host.open_grpc_stream(&cp.cluster, SERVICE, WATCH, &metadata)?;
    let request = WatchRequest { gateway_id: cp.gateway_id.clone() }.encode_to_vec();
    if let Err(e) = host.send_grpc(watch, &request, true) {
        host.cancel_grpc(watch);
        return Err(e);
    }
    let report = match host.open_grpc_stream(&cp.cluster, SERVICE, REPORT, &metadata) {
        Ok(r) => r,
        Err(e) => {
            host.cancel_grpc(watch);
            return Err(e);
        }
    };
    Ok((watch, report))
}

#[cfg(test)]
mod tests;
