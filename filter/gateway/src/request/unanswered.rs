//! The requests of one VM waiting for their worker's answer, and failing them when the worker
//! is found hung.
//!
//! kvmesh-cp marks a worker `unresponsive` when it answers none of its probes (health, load)
//! for `--worker-unresponsive-secs`: a stopped or wedged process, not one busy with long
//! generations (those still answer probes). New requests avoid it from the next snapshot; the
//! ones already sent to it would otherwise wait for the request timeout (30 minutes), so the
//! tick answers each of them that has had no response yet with a JSON 503
//! (`worker_unresponsive`, `retry-after: 1`): nothing has reached the client, and the request
//! may be sent again.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Weak;

use kvmesh_core::WorkerId;

use super::RequestFilter;
use crate::gateway::Reply;
use crate::host::StreamHost;

/// A VM's requests sent to a worker that has not answered them yet, by context id.
#[derive(Default)]
pub struct Unanswered {
    by_ctx: HashMap<u32, (WorkerId, Weak<RefCell<RequestFilter>>)>,
}

impl Unanswered {
    pub fn add(&mut self, ctx: u32, worker: WorkerId, filter: Weak<RefCell<RequestFilter>>) {
        self.by_ctx.insert(ctx, (worker, filter));
    }

    pub fn remove(&mut self, ctx: u32) {
        self.by_ctx.remove(&ctx);
    }

    pub fn len(&self) -> usize {
        self.by_ctx.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ctx.is_empty()
    }

    /// The requests waiting on one of `workers`, with their context ids.
    pub fn waiting_on(&self, workers: &[WorkerId]) -> Vec<(u32, Weak<RefCell<RequestFilter>>)> {
        self.by_ctx.iter().filter(|(_, (w, _))| workers.contains(w)).map(|(&ctx, (_, f))| (ctx, f.clone())).collect()
    }
}

impl RequestFilter {
    /// The main leg went to `worker`: this request waits for its answer.
    pub(super) fn wait_for_answer(&self, worker: WorkerId) {
        if let Some(seat) = &self.seat {
            if let Ok(mut sent) = seat.unanswered.try_borrow_mut() {
                sent.add(seat.ctx, worker, seat.me.clone());
            }
        }
    }

    /// The worker answered (or the request ended).
    pub(super) fn answered(&self) {
        if let Some(seat) = &self.seat {
            if let Ok(mut sent) = seat.unanswered.try_borrow_mut() {
                sent.remove(seat.ctx);
            }
        }
    }

    /// The tick found this request's worker hung (in this request's context): a JSON 503 if
    /// nothing has come back from it yet.
    pub fn worker_hung(&mut self, host: &dyn StreamHost) {
        if !self.awaiting || self.replied || self.verdict.is_some() {
            return;
        }
        let Some(addr) = self.routed.as_ref().map(|r| r.addr.clone()) else { return };
        log::warn!("worker {addr} stopped answering kvmesh-cp's probes: its waiting request gets a 503");
        let message = format!(
            "worker {addr} stopped answering (no answer to the control plane's probes); the request was not answered and may be sent again"
        );
        self.reply(host, Reply { retry_after: Some(1), ..Reply::error(503, "worker_unresponsive", &message) });
        self.answered();
    }
}
