//! The publisher: what only the VM holding the control-plane streams does — it queues the
//! index inserts and stale blocks made on this Envoy and builds the reports (the periodic one,
//! and the full one for a control plane that just connected), and it names the epoch the
//! tables it publishes belong to.

use std::collections::{BTreeMap, VecDeque};

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::fleet::{Usage, MAX_SHIPPED};
use kvmesh_core::{Router, WorkerId};
use kvmesh_proto::v1::{self as proto, IndexEvict, IndexInsert, ReportBatch, WorkerCounts};

use super::view::{Mode, RoutingView};
use crate::now::Now;
use crate::shared::{Delta, Inflight, SharedStore};

/// Most block hashes held for the next report (8 MiB; the oldest batches go first).
pub const REPORT_QUEUE_HASHES: usize = 1 << 20;

/// Most stale block hashes held for the next report (the oldest go first past it).
const STALE_QUEUE_HASHES: usize = 1 << 16;

/// Index inserts made on this Envoy that the control plane has not been told about, bounded
/// by the number of hashes they hold.
#[derive(Default)]
struct ReportQueue {
    batches: VecDeque<(WorkerId, Vec<u64>)>,
    hashes: usize,
}

impl ReportQueue {
    fn push(&mut self, worker: WorkerId, hashes: Vec<u64>) {
        self.hashes = self.hashes.saturating_add(hashes.len());
        self.batches.push_back((worker, hashes));
        while self.hashes > REPORT_QUEUE_HASHES {
            let Some((_, dropped)) = self.batches.pop_front() else { break };
            self.hashes = self.hashes.saturating_sub(dropped.len());
        }
    }

    fn take(&mut self) -> VecDeque<(WorkerId, Vec<u64>)> {
        self.hashes = 0;
        std::mem::take(&mut self.batches)
    }
}

/// The stream owner's reporting state (empty on every other VM: another VM's queue would
/// never be sent; when a VM takes the streams over, its full report covers what it indexed).
#[derive(Default)]
pub struct Publisher {
    /// This VM holds the control-plane streams (the plugin says so on every tick).
    reporting: bool,
    /// This Envoy's gateway id: inserts a delta says it reported itself are not applied again.
    pub(super) own_id: Option<String>,
    unreported: ReportQueue,
    /// Blocks engine feedback showed stale, for the next report.
    stale: VecDeque<(WorkerId, Vec<u64>)>,
    /// The epoch this VM publishes under while it holds the streams: new with every full
    /// snapshot (a connection, so a control plane that may have restarted).
    pub(super) epoch: u64,
    /// This Envoy's tenant usage as last reported: taken off the fleet's the control plane
    /// ships, so that it is not counted twice.
    reported_usage: Usage,
    /// This Envoy's admitted requests per tenant as last reported, likewise.
    reported_requests: Usage,
}

impl Publisher {
    /// The gateway id this Envoy reports under (its own inserts, echoed back in snapshots,
    /// are skipped: see [`super::Gateway::apply_snapshot`]).
    pub fn set_own_id(&mut self, id: &str) {
        self.own_id = Some(id.to_string());
    }

    /// A snapshot's index changes as delta-log entries, less this Envoy's own inserts
    /// echoed back by the control plane (they are in its index already).
    pub(super) fn deltas_of(&self, snapshot: &proto::Snapshot) -> Vec<Delta> {
        let mut deltas: Vec<Delta> = Vec::with_capacity(snapshot.inserts.len() + snapshot.evictions.len());
        let own_id = self.own_id.as_deref();
        let own = |i: &&IndexInsert| !i.origin.is_empty() && own_id == Some(i.origin.as_str());
        deltas.extend(snapshot.inserts.iter().filter(|i| !own(i)).map(|i| Delta {
            worker: i.worker,
            evict: false,
            from_cp: true,
            hashes: i.hashes.clone(),
        }));
        deltas.extend(snapshot.evictions.iter().map(|e| Delta {
            worker: e.worker,
            evict: true,
            from_cp: true,
            hashes: e.hashes.clone(),
        }));
        deltas
    }

    /// Whether this VM holds the control-plane streams: only then are inserts queued for
    /// reports (a VM that stops holding them drops its queues).
    pub fn set_reporting(&mut self, on: bool) {
        if !on && self.reporting {
            self.unreported.take();
            self.stale.clear();
            self.reported_usage = Usage::default();
            self.reported_requests = Usage::default();
        }
        self.reporting = on;
    }

    /// Inserts for the next report (`cp`: a control plane is configured).
    pub(super) fn queue_insert(&mut self, cp: bool, worker: WorkerId, hashes: Vec<u64>) {
        if cp && self.reporting {
            self.unreported.push(worker, hashes);
        }
    }

    /// Stale blocks for the next report (`cp`: a control plane is configured).
    pub(super) fn queue_stale(&mut self, cp: bool, worker: WorkerId, hashes: Vec<u64>) {
        if !cp || !self.reporting {
            return;
        }
        self.stale.push_back((worker, hashes));
        while self.stale.iter().map(|(_, h)| h.len()).sum::<usize>() > STALE_QUEUE_HASHES {
            self.stale.pop_front();
        }
    }

    /// Hashes queued for the next report.
    #[cfg(test)]
    pub fn unreported_hashes(&self) -> usize {
        self.unreported.hashes
    }

    /// The periodic report (at `now`): inserts made on this Envoy since the last one, and per
    /// worker the counts (in flight, finished, failed, failovers), the circuit breaker's state
    /// and the engine feedback.
    pub(super) fn report(
        &mut self,
        store: &dyn SharedStore,
        view: &RoutingView,
        gateway_id: &str,
        now: Now,
    ) -> ReportBatch {
        let inserts = self
            .unreported
            .take()
            .into_iter()
            .map(|(worker, hashes)| IndexInsert { worker, hashes, ..Default::default() })
            .collect();
        let mut counts: BTreeMap<WorkerId, WorkerCounts> = Inflight::counts(store)
            .into_iter()
            .map(|c| {
                let counts = WorkerCounts {
                    worker: c.worker,
                    in_flight: c.in_flight,
                    requests: c.finished,
                    errors: c.failed,
                    ..Default::default()
                };
                (c.worker, counts)
            })
            .collect();
        // Breakers of workers no longer in the table (kept until idle) are not reported.
        for b in view.health.report(store, now).into_iter().filter(|b| view.table.get(b.worker).is_some()) {
            let entry =
                counts.entry(b.worker).or_insert_with(|| WorkerCounts { worker: b.worker, ..Default::default() });
            entry.set_breaker(match b.state {
                BreakerState::Closed => proto::BreakerState::Closed,
                BreakerState::Open => proto::BreakerState::Open,
                BreakerState::HalfOpen => proto::BreakerState::HalfOpen,
            });
            entry.failovers = b.failovers;
        }
        for (worker, feedback) in
            crate::shared::feedback::read(store).into_iter().filter(|(w, _)| view.table.get(*w).is_some())
        {
            counts.entry(worker).or_insert_with(|| WorkerCounts { worker, ..Default::default() }).feedback =
                Some(feedback);
        }
        let stale = self.stale.drain(..).map(|(worker, hashes)| IndexEvict { worker, hashes }).collect();
        // This Envoy's tenant usage, where its VMs charge any (tenant weights).
        let tenant_usage = crate::shared::tenant_usage::read(store).map(|(envoy, _)| {
            self.reported_usage = envoy.at(now.ms());
            kvmesh_proto::usage_to_wire(&self.reported_usage)
        });
        // Its admitted requests per tenant, where a requests-per-second limit counts them.
        let tenant_requests = crate::shared::tenants::usage(store, now.ms()).map(|requests| {
            self.reported_requests = requests;
            kvmesh_proto::usage_to_wire(&self.reported_requests)
        });
        ReportBatch {
            gateway_id: gateway_id.to_string(),
            inserts,
            counts: counts.into_values().collect(),
            stale,
            tenant_usage,
            tenant_requests,
        }
    }

    /// The fleet's tenant usage a snapshot carries, received at `now_ms`: less what this Envoy
    /// reported itself, it becomes the rest of the fleet's for every VM's fair pick
    /// (`crate::shared::tenant_usage`); its admitted requests likewise become the rest of the
    /// fleet's for the requests-per-second limit (`crate::shared::tenant_requests`). A VM that
    /// has not reported yet (it just took the streams over) takes off the Envoy's as it stands.
    pub fn fleet_usage(&self, store: &dyn SharedStore, snapshot: &proto::Snapshot, now_ms: u64) {
        if let Some(requests) = &snapshot.tenant_requests {
            let own = if self.reported_requests.entries.is_empty() {
                crate::shared::tenants::usage(store, now_ms).unwrap_or_default()
            } else {
                self.reported_requests.clone()
            };
            let rest = kvmesh_proto::usage_from_wire(requests, MAX_SHIPPED, now_ms).minus(&own, now_ms);
            if !crate::shared::tenant_requests::set_rest(store, &rest) {
                log::debug!("cannot share the fleet's tenant requests: shared data refused the write");
            }
        }
        let Some(usage) = &snapshot.tenant_usage else { return };
        let envoy = || crate::shared::tenant_usage::read(store).map(|(envoy, _)| envoy).unwrap_or_default();
        let own = if self.reported_usage.entries.is_empty() { envoy() } else { self.reported_usage.clone() };
        let rest = kvmesh_proto::usage_from_wire(usage, MAX_SHIPPED, now_ms).minus(&own, now_ms);
        if !crate::shared::tenant_usage::set_rest(store, &rest) {
            log::debug!("cannot share the fleet's tenant usage: shared data refused the write");
        }
    }

    /// Everything `view`'s index holds, for a control plane that just (re)connected: report
    /// batches of at most `max_hashes` hashes each (at least one batch, possibly empty).
    pub(super) fn full_report(
        &mut self,
        view: &mut RoutingView,
        gateway_id: &str,
        max_hashes: usize,
    ) -> Vec<ReportBatch> {
        let max_hashes = max_hashes.max(1);
        let batch = || ReportBatch { gateway_id: gateway_id.to_string(), ..Default::default() };
        let mut out: Vec<ReportBatch> = Vec::new();
        let mut room = 0usize;
        let mut export = |r: &mut Router| {
            // A group of workers at a time, about `max_hashes` blocks each: the memory of one
            // batch's worth of recency stamps, not of the whole index.
            let mut sizes: Vec<(WorkerId, u64)> = r.index().sizes().collect();
            sizes.sort_unstable();
            let mut groups: Vec<Vec<WorkerId>> = Vec::new();
            let mut filled = u64::MAX;
            for (worker, size) in sizes {
                match groups.last_mut() {
                    Some(g) if filled.saturating_add(size) <= max_hashes as u64 => {
                        g.push(worker);
                        filled += size;
                    }
                    _ => {
                        groups.push(vec![worker]);
                        filled = size;
                    }
                }
            }
            for (worker, hashes) in groups.iter().flat_map(|g| r.index().export_workers(g)) {
                let mut rest = hashes.as_slice();
                while !rest.is_empty() {
                    if room == 0 {
                        out.push(batch());
                        room = max_hashes;
                    }
                    let Some((now, later)) = rest.split_at_checked(room.min(rest.len())) else { break };
                    if let Some(last) = out.last_mut() {
                        // Newest first within the piece: see `PrefixIndex::export`.
                        let hashes = kvmesh_core::index::as_insert(now);
                        last.inserts.push(IndexInsert { worker, hashes, ..Default::default() });
                    }
                    room -= now.len();
                    rest = later;
                }
            }
        };
        match &mut view.mode {
            Mode::Regular(r) => export(r),
            Mode::Pd(pd) => {
                export(pd.prefill_router());
                export(pd.decode_router());
            }
        }
        self.unreported.take();
        if out.is_empty() {
            out.push(batch());
        }
        out
    }
}
