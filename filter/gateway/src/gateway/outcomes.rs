//! What happened to the workers' requests, as one VM learns it: the stall window (sent,
//! ended) and the circuit breakers (outcomes, failovers). Only what the worker did counts
//! (see `request/verdict.rs`): a 4xx is a success, Envoy's own refusals and clients that
//! went away are not reported.

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::WorkerId;

use super::view::RoutingView;
use crate::now::Now;
use crate::shared::SharedStore;

/// The workers' health as a [`super::Gateway`]'s requests report it ([`super::Gateway::outcomes`]).
pub struct Outcomes<'a> {
    pub(super) view: &'a mut RoutingView,
}

impl Outcomes<'_> {
    /// A request went to `worker` (the stall window starts if it held none).
    pub fn sent(&mut self, worker: WorkerId, now_ms: u64) {
        self.view.stalls.sent(worker, now_ms);
    }

    /// A request to `worker` ended; `answered`: the worker itself answered.
    pub fn ended(&mut self, worker: WorkerId, answered: bool, now_ms: u64) {
        self.view.stalls.ended(worker, answered, now_ms);
    }

    /// What a request did to `worker` (`ok`: not a failure of the worker's), at `now`: its
    /// circuit breaker learns it, and a change of state is logged.
    pub fn record(&mut self, store: &dyn SharedStore, worker: WorkerId, ok: bool, now: Now) {
        let view = &mut *self.view;
        let Some((from, to)) = view.health.record(store, worker, ok, now) else { return };
        let addr = view.table.get(worker).map_or("?", |w| w.addr.as_str());
        match to {
            BreakerState::Open => log::warn!(
                "worker {addr}: circuit breaker open ({} from {}); out of rotation for {} s",
                if from == BreakerState::HalfOpen { "its probe failed" } else { "failures" },
                from.name(),
                view.health.params().timeout_ms / 1000
            ),
            _ => log::info!("worker {addr}: circuit breaker {} (was {})", to.name(), from.name()),
        }
    }

    /// A request that `from` failed was sent again to another worker: counted per worker
    /// (cumulative, reported to the control plane as `WorkerCounts.failovers`).
    pub fn failover(&mut self, store: &dyn SharedStore, from: WorkerId) {
        self.view.health.count_failover(store, from);
    }
}
