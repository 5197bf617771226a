//! The requests of one VM waiting for their worker's answer, and what becomes of them when the
//! worker is found hung.
//!
//! kvmesh-cp marks a worker `unresponsive` when it answers none of its probes (health, load)
//! for `--worker-unresponsive-secs`: a stopped or wedged process, not one busy with long
//! generations (those still answer probes). New requests avoid it from the next snapshot; the
//! ones already sent to it would otherwise wait for the request timeout (30 minutes). Envoy
//! does not move them: nothing was refused or reset, and a failed active health check only
//! drains an HTTP connection pool (Envoy 1.40 keeps the busy connections' requests, even with
//! `close_connections_on_host_health_failure`). So the tick does, for each one that has had no
//! response yet:
//! - a regular non-streaming request with fallbacks and a body of at most
//!   [`RESEND_MAX_BYTES`] (kept from the decision, not read again) is sent again, as a callout
//!   through the workers' cluster, to the first fallback that is not hung; the callout's answer
//!   (status and body) becomes the client's, `x-kvmesh-worker` naming the worker that gave it,
//!   and counts as a failover. The attempt on the hung worker ends with that local reply.
//! - any other (streaming, PD, no fallback, a larger body, no callout sent, or none answered)
//!   gets a JSON 503 (`worker_unresponsive`, `retry-after: 1`): nothing has reached the
//!   client, and the request may be sent again.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Weak;
use std::time::Duration;

use kvmesh_core::WorkerId;

use super::{callout_headers, forwarded_to_prefill, RequestFilter};
use crate::gateway::{Plan, Reply, FAILOVER_KEY};
use crate::host::{Callout, Metric, StreamHost};

/// The largest request body kept for sending the request again (1 MiB): a larger request on a
/// hung worker gets the 503. Kept only until the worker's response starts.
pub const RESEND_MAX_BYTES: usize = 1 << 20;

/// What sending a request again takes: the body as the worker got it, the fallbacks in order.
pub(super) struct Resend {
    body: Vec<u8>,
    fallbacks: Vec<String>,
}

impl Resend {
    /// For a regular request with fallbacks whose body (`body`, or the one the plan rewrote)
    /// is small enough; `None` otherwise.
    pub(super) fn keep(plan: &Plan, body: Vec<u8>) -> Option<Self> {
        if plan.pd().is_some() || plan.fallbacks().is_empty() {
            return None;
        }
        let body = plan.body().map_or(body, <[u8]>::to_vec);
        (body.len() <= RESEND_MAX_BYTES).then(|| Self { body, fallbacks: plan.fallbacks().to_vec() })
    }
}

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

    /// Whether this request was sent to a worker and waits for its answer (a tick may have to
    /// move it: see [`crate::request::unanswered`]).
    pub fn awaits_answer(&self) -> bool {
        self.awaiting && !self.replied
    }

    /// The worker answered (or the request ended).
    pub(super) fn answered(&self) {
        if let Some(seat) = &self.seat {
            if let Ok(mut sent) = seat.unanswered.try_borrow_mut() {
                sent.remove(seat.ctx);
            }
        }
    }

    /// The tick found this request's worker hung (`hung`: every worker found so; in this
    /// request's context), and nothing has come back from it yet: sent again to a fallback
    /// (the callout's token is returned, for a host that answers callouts to the root
    /// context), or a JSON 503.
    pub fn worker_hung(&mut self, host: &dyn StreamHost, hung: &[WorkerId]) -> Option<u32> {
        if !self.awaiting || self.replied || self.verdict.is_some() || self.moved.is_some() {
            return None;
        }
        let addr = self.routed.as_ref().map(|r| r.addr.clone())?;
        self.answered();
        if let Some(token) = self.send_again(host, hung) {
            log::warn!("worker {addr} stopped answering kvmesh-cp's probes: its waiting request is sent again");
            return Some(token);
        }
        log::warn!("worker {addr} stopped answering kvmesh-cp's probes: its waiting request gets a 503");
        let message = format!(
            "worker {addr} stopped answering (no answer to the control plane's probes); the request was not answered and may be sent again"
        );
        self.reply(host, Reply { retry_after: Some(1), ..Reply::error(503, "worker_unresponsive", &message) });
        None
    }

    /// The request as its worker got it, as a callout to the first fallback not in `hung`.
    fn send_again(&mut self, host: &dyn StreamHost, hung: &[WorkerId]) -> Option<u32> {
        let resend = self.resend.take()?;
        let rank = self.routed.as_ref()?.dp_rank;
        let (target, cluster, how) = self.with_gateway(|g| {
            let usable = |addr: &&String| g.front().worker_at(addr, rank).is_some_and(|w| !hung.contains(&w));
            let target = resend.fallbacks.iter().find(usable)?.clone();
            Some((target, g.front().upstream_cluster().to_string(), g.front().destination()))
        })??;
        let client = host.request_headers();
        let mut headers = callout_headers(&self.path, &target).to_vec();
        if let Some(id) = self.request_id.as_deref() {
            headers.push(("x-request-id", id));
        }
        // The client's end-to-end headers go along; with a workers' key, that in place of the
        // client's authorization (as on the first attempt).
        let ours = how.authorization.as_deref();
        if let Some(auth) = ours {
            headers.push(("authorization", auth));
        }
        let theirs = |n: &str| ours.is_none() || !n.eq_ignore_ascii_case("authorization");
        headers.extend(client.pairs().filter(|(n, _)| forwarded_to_prefill(n) && theirs(n)));
        let timeout = Duration::from_secs(how.timeout_secs);
        let callout = Callout { cluster: &cluster, headers: &headers, body: &resend.body, timeout };
        match host.dispatch(callout) {
            Ok(token) => {
                self.moved = Some((token, target));
                Some(token)
            }
            Err(e) => {
                log::warn!("cannot send the request again to {target}: {e}");
                None
            }
        }
    }

    /// The fallback answered the request sent again (or the callout failed): its answer is the
    /// client's, else a JSON 503.
    pub(super) fn moved_answered(&mut self, host: &dyn StreamHost, body_size: usize) {
        let Some((_, target)) = self.moved.take() else { return };
        if self.verdict.is_some() || self.replied {
            // The hung worker answered after all, first: its response is under way.
            return;
        }
        let Some(hung) = self.routed.as_ref().map(|r| (r.worker, r.addr.clone())) else { return };
        let Some(status) = host.callout_status() else {
            let message = format!(
                "worker {} stopped answering (no answer to the control plane's probes) and {target}, which the request was sent to again, gave no answer; it may be sent again",
                hung.1
            );
            self.reply(host, Reply { retry_after: Some(1), ..Reply::error(503, "worker_unresponsive", &message) });
            return;
        };
        let body = host.callout_body(body_size);
        self.replied = true;
        self.failed_over = true;
        let _ = host.set_filter_state(FAILOVER_KEY, &target);
        host.increment(Metric::Failovers);
        self.with_gateway(|g| g.outcomes().failover(host, hung.0));
        let headers = [("content-type", "application/json"), ("x-kvmesh-worker", target.as_str())];
        if let Err(e) = host.send_reply(status, &headers, &body) {
            log::warn!("cannot send {target}'s answer: {e}");
        }
    }
}
