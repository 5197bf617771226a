//! A request's prefill leg, when the gateway sends it (SGLang's beside the decode leg, vLLM's
//! before it): its answer, which the split's protocol reads (`crate::pd`) and this applies,
//! and for a leg still out when the request ends, the protocol's abort.

use std::time::Duration;

use super::{callout_headers, RequestFilter};
use crate::gateway::{Now, Reply};
use crate::host::{Callout, Metric, StreamHost};
use crate::pd::{Answer, Leg};
use crate::pd_leg::Effect;

impl RequestFilter {
    /// The prefill callout answered (or failed).
    pub fn on_callout_response(&mut self, host: &dyn StreamHost, token: u32, body_size: usize) {
        if self.moved.as_ref().is_some_and(|(t, _)| *t == token) {
            return self.moved_answered(host, body_size);
        }
        let prefill_fallback = self.with_gateway(|g| g.config().pd.as_ref().is_none_or(|pd| pd.prefill_fallback));
        let request_size = self.body_size;
        let Some(leg) = self.leg.as_mut().filter(|leg| leg.awaits(token)) else { return };
        let status = host.callout_status();
        let answer =
            Answer { status, size: body_size, request_size, prefill_fallback: prefill_fallback != Some(false) };
        let effects = leg.answered(host, &answer);
        // A client error (a bad sampling parameter, say) fails the request, not the worker.
        let worker_ok = status.is_some_and(|s| s < 500);
        let now = Now::from_nanos(host.now_nanos());
        let deferred = std::mem::take(&mut self.deferred);
        if let Some(prefill) = self.leg.as_ref().map(Leg::prefill) {
            self.with_gateway(|g| {
                g.ledger_mut().finish(host, prefill, worker_ok);
                g.outcomes().record(host, prefill.worker, worker_ok, now);
                g.outcomes().ended(prefill.worker, status.is_some(), now.ms());
                // The prefill did its part: decode failures seen meanwhile were the decode's own.
                for &worker in deferred.iter().filter(|_| answer.ok()) {
                    g.outcomes().record(host, worker, false, now);
                }
            });
        }
        for effect in effects {
            match effect {
                Effect::Fail502(message) => {
                    self.reply(host, Reply::error(502, "prefill_failed", &message));
                    return;
                }
                Effect::ReplaceHeldBody { size, body } => {
                    if let Err(e) = host.set_response_body(size, &body) {
                        log::warn!("cannot replace the held response body: {e}");
                    }
                }
                Effect::ResumeResponse => {
                    if let Some(f) = self.feedback.as_mut() {
                        f.flushed();
                    }
                    if let Err(e) = host.resume_response() {
                        log::warn!("cannot resume the response: {e}");
                    }
                }
                Effect::DecodeBody(decode) => {
                    let length = decode.len().to_string();
                    let written = host
                        .set_request_body(self.body_size, &decode)
                        .and_then(|()| host.set_request_header("content-length", Some(&length)));
                    if let Err(e) = written {
                        let msg = format!("cannot hand the prefill's KV to the decode leg: {e}");
                        self.reply(host, Reply::error(500, "internal", &msg));
                        return;
                    }
                    self.body_size = decode.len();
                }
                Effect::ResumeRequest => {
                    // The decode worker gets it now: its stall window starts here.
                    if let Some(decode) = self.routed.as_ref().map(|r| r.worker) {
                        self.with_gateway(|g| g.outcomes().sent(decode, now.ms()));
                        self.awaiting = true;
                        self.wait_for_answer(decode);
                    }
                    if let Err(e) = host.resume_request() {
                        log::warn!("cannot resume the request after its prefill: {e}");
                    }
                }
            }
        }
    }

    /// A prefill leg still out when the request ends: the callouts its protocol stops it
    /// with (answers are not awaited: the stream is gone).
    pub(super) fn abort_prefill(&self, host: &dyn StreamHost, leg: &Leg) {
        let aborts = leg.aborts();
        if aborts.is_empty() {
            return;
        }
        let cluster = self.with_gateway(|g| g.front().upstream_cluster().to_string()).unwrap_or_default();
        let authorization = self.with_gateway(|g| g.front().destination().authorization).flatten();
        let addr = leg.prefill().addr.as_str();
        for (path, body) in &aborts {
            let mut headers = callout_headers(path, addr).to_vec();
            if let Some(auth) = authorization.as_deref() {
                headers.push(("authorization", auth));
            }
            let callout = Callout {
                cluster: &cluster,
                headers: &headers,
                body: body.as_bytes(),
                timeout: Duration::from_secs(5),
            };
            match host.dispatch_detached(callout) {
                Ok(()) => host.increment(Metric::PrefillAborts),
                Err(e) => log::warn!("cannot abort the prefill leg on {addr} ({path} {body}): {e}"),
            }
        }
    }
}
