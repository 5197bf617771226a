//! The plugin (root context) logic of one VM, host-independent: the configuration, parsed and
//! validated once; the VM's [`Gateway`]; the tick — adopt the control plane's worker table,
//! let the [`ControlPlaneClient`] drive the link (lease, streams, reports), run eviction —
//! and the admission queue's wake-ups.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::Duration;

use kvmesh_core::Config;

use crate::admission::Wake;
use crate::cp_client::ControlPlaneClient;
use crate::gateway::Gateway;
use crate::host::{now_ms, LinkHost, Metric, StreamHost, VmHost};
use crate::request::{RequestFilter, Room, Unanswered};
use crate::shared::admission::SharedBucket;

/// How often a VM ticks (the table, ended requests, the lease, reports, eviction): Wasm VMs
/// ask Envoy for this period, the native build ticks on its streams' hooks as often.
pub const TICK: Duration = Duration::from_millis(20);
use crate::shared::{Inflight, SharedStore};

#[derive(Default)]
pub struct Plugin {
    gateway: Option<Rc<RefCell<Gateway>>>,
    control_plane: Option<ControlPlaneClient>,
    /// This root context's id: the tick enters requests' contexts and comes back to it.
    context_id: u32,
    /// The VM's admission queue.
    room: Rc<RefCell<Room>>,
    /// The VM's requests waiting for their worker's answer.
    unanswered: Rc<RefCell<Unanswered>>,
    /// Callouts dispatched from the tick (prefill legs of requests admitted from the queue,
    /// requests sent again off a hung worker): the host answers them to the root context,
    /// which hands them on.
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
        self.control_plane = ControlPlaneClient::new(&config, seed)?;
        // The limit's shared value exists before this VM's first request (the main thread's VM
        // is configured before any worker thread's takes one): requests then change it only by
        // compare-and-swap.
        if let Some(params) = &config.admission {
            if SharedBucket::create(host, params, now_ms(host)).is_err() {
                log::warn!("cannot create the concurrency limit's shared value");
            }
        }
        let mut gateway = Gateway::new(config, host, seed);
        if !host.has_timer() {
            gateway.ledger_mut().write_ends_at_once();
        }
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
        RequestFilter::seated(self.gateway(), Rc::clone(&self.room), Rc::clone(&self.unanswered), context_id)
    }

    /// The whole tick of a VM that holds requests and may hold the control-plane streams (a
    /// `.wasm` VM's root context): [`Plugin::tick`], then [`Plugin::wake_waiting`].
    pub fn on_tick<H: StreamHost + LinkHost>(&mut self, host: &H) {
        self.tick(host, Some(host));
        self.wake_waiting(host);
        self.fail_hung(host);
    }

    /// Requests waiting on a worker the control plane found hung are sent again to another
    /// worker, or get a 503, each in its own context (see [`crate::request::unanswered`]);
    /// then back to the root's.
    pub fn fail_hung(&mut self, host: &dyn StreamHost) {
        if self.unanswered.try_borrow().map_or(true, |u| u.is_empty()) {
            return;
        }
        let hung = match self.gateway.as_ref().map(|g| g.try_borrow().map(|g| g.front().hung_workers())) {
            Some(Ok(hung)) if !hung.is_empty() => hung,
            _ => return,
        };
        let waiting = match self.unanswered.try_borrow() {
            Ok(u) => u.waiting_on(&hung),
            Err(_) => return,
        };
        for (ctx, filter) in waiting {
            let Some(filter) = filter.upgrade() else {
                if let Ok(mut u) = self.unanswered.try_borrow_mut() {
                    u.remove(ctx);
                }
                continue;
            };
            if host.enter_context(ctx).is_err() {
                continue; // the stream is gone; its on_log cleans up
            }
            let moved = filter.try_borrow_mut().ok().and_then(|mut f| f.worker_hung(host, &hung));
            if let Some(token) = moved {
                self.callouts.insert(token, (ctx, Rc::downgrade(&filter)));
            }
        }
        let _ = host.enter_context(self.context_id);
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

    /// The tick period to ask the host for, given the one a build wants (`wanted`): a profiling
    /// build's long period (one that keeps the tick out of the requests it counts) applies only
    /// once the VM knows whether it is alone in its Envoy, which takes two heartbeats a second
    /// apart at the usual period — so that the counted requests take the production path.
    pub fn tick_period(&self, wanted: Duration) -> Duration {
        let settled = self.gateway.as_ref().and_then(|g| g.try_borrow().ok()).is_none_or(|g| g.ledger().settled());
        if settled {
            wanted
        } else {
            wanted.min(TICK)
        }
    }

    /// The admission queue's turn, after the gateway's (admitted requests borrow it): the
    /// requests waiting too long get a 408, the oldest get the tokens left; each in its own
    /// context, then back to the root's.
    pub fn wake_waiting(&mut self, host: &dyn StreamHost) {
        let Some((params, vm)) =
            self.gateway.as_ref().and_then(|g| g.try_borrow().ok()).map(|g| (g.config().admission, g.ledger().vm()))
        else {
            return;
        };
        let now = now_ms(host);
        // Callouts whose request went away (Envoy cancelled them with the stream).
        self.callouts.retain(|_, (_, w)| w.strong_count() > 0);
        let wakes = match self.room.try_borrow_mut() {
            Ok(mut room) if !room.is_empty() || params.is_some() || room.has_charges() => {
                room.tick(host, params.as_ref(), vm, now)
            }
            _ => return,
        };
        if params.is_some() {
            host.record(Metric::Queued, SharedBucket::queued(host, now));
        }
        if wakes.is_empty() {
            return;
        }
        for wake in wakes {
            let (ctx, (class, waiter), admit) = match wake {
                Wake::Admit(ctx, w) => (ctx, w, true),
                Wake::Expire(ctx, w) => (ctx, w, false),
            };
            // A slot taken for a request that cannot take it (gone, or no longer waiting) goes
            // back at once: nobody else would give it back.
            let delivered = self.wake_one(host, ctx, &waiter, admit);
            if admit && !delivered {
                if let Some(params) = &params {
                    SharedBucket::give_back(host, params, vm, class, now);
                    if let Ok(mut room) = self.room.try_borrow_mut() {
                        room.gave_back();
                    }
                }
            }
        }
        let _ = host.enter_context(self.context_id);
    }

    /// Admits or expires one waiting request in its own context; whether an admitted one took
    /// its slot.
    fn wake_one(
        &mut self,
        host: &dyn StreamHost,
        ctx: u32,
        waiter: &Weak<RefCell<RequestFilter>>,
        admit: bool,
    ) -> bool {
        let Some(filter) = waiter.upgrade() else { return false };
        if host.enter_context(ctx).is_err() {
            return false; // the stream is gone; its on_log cleans up the rest
        }
        let Ok(mut f) = filter.try_borrow_mut() else { return false };
        if !admit {
            f.expired(host);
            return false;
        }
        let took = f.admitted(host);
        if let Some(token) = f.callout_token() {
            self.callouts.insert(token, (ctx, Rc::downgrade(&filter)));
        }
        took
    }

    /// An HTTP callout answered to the root context: one dispatched from the tick.
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
        gateway.feedback().flush(host);
        if let (Some(cp), Some(link)) = (self.control_plane.as_mut(), link) {
            cp.tick(host, link, &mut gateway, now);
        }
        gateway.heartbeat(host, now);
        if let Some(cp) = &self.control_plane {
            gateway.publisher().set_reporting(cp.is_connected());
        }
        host.record(Metric::InFlight, in_flight(host));
        if let Some(evicted) = gateway.tick(host, now / 1_000) {
            if evicted > 0 {
                log::info!("evicted {evicted} index blocks, {} left", gateway.index_len());
            }
        }
        // One gauge for the whole Envoy: with a control plane, the stream owner's index (it
        // applies every snapshot at once) is the one to show; idle VMs catch up lazily.
        let owner = !self.follower && self.control_plane.as_ref().is_none_or(ControlPlaneClient::is_connected);
        if owner {
            host.record(Metric::IndexBlocks, gateway.index_len() as u64);
        }
    }

    /// Writes what the tick would: this VM's ended requests and engine-feedback counts.
    pub fn flush(&self, host: &dyn VmHost) {
        let Some(gateway) = &self.gateway else { return };
        let Ok(mut gateway) = gateway.try_borrow_mut() else { return };
        gateway.write_ended(host);
        gateway.feedback().flush(host);
    }

    /// A stream of this plugin ended, `others` of its streams still live. For a host without
    /// a timer, the last one's end may be the last chance to run for a long while: what the
    /// tick keeps goes to shared data now — unless the VM is alone in its Envoy: then nobody
    /// else reads it, and its next tick writes it. Its tenants' charges go either way: the
    /// stream owner that reports them to kvmesh-cp is another plugin there.
    pub fn on_stream_end(&self, host: &dyn VmHost, others: usize) {
        let alone = self.gateway.as_ref().and_then(|g| g.try_borrow().ok()).is_some_and(|g| g.ledger().alone());
        if others == 0 {
            if let Ok(mut room) = self.room.try_borrow_mut() {
                room.share_charges(host, now_ms(host));
            }
        }
        if others == 0 && !alone {
            self.flush(host);
        }
    }

    /// A message on a control-plane stream: a snapshot, on the watch stream.
    pub fn on_grpc_message(&mut self, host: &dyn LinkHost, token: u32, size: usize) {
        let (Some(cp), Some(gateway)) = (self.control_plane.as_mut(), &self.gateway) else { return };
        let Ok(mut gateway) = gateway.try_borrow_mut() else { return };
        cp.on_message(host, &mut gateway, token, size);
    }

    /// A control-plane stream closed: both go, and the link reconnects after its backoff.
    pub fn on_grpc_close(&mut self, host: &dyn LinkHost, token: u32, status: u32) {
        if let Some(cp) = self.control_plane.as_mut() {
            cp.on_close(host, token, status);
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

#[cfg(test)]
mod tests;
