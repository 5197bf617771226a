//! A request's prefill leg, when the gateway sends it: its answer (SGLang's leg beside the
//! decode leg, vLLM's before it) and, for a leg still out when the request ends, the abort.

use std::time::Duration;

use kvmesh_core::logprobs::{MergeError, MAX_MERGE_BYTES};

use super::{callout_headers, RequestFilter, ERROR_DETAIL_BYTES};
use crate::gateway::{Now, Reply};
use crate::host::{Callout, Metric, StreamHost};
use crate::pd_leg::{Effect, PdLeg, PrefillResult};

impl RequestFilter {
    /// The prefill callout answered (or failed).
    pub fn on_callout_response(&mut self, host: &dyn StreamHost, token: u32, body_size: usize) {
        if self.first.as_ref().is_some_and(|(t, _)| *t == token) {
            return self.first_answered(host, body_size);
        }
        if self.moved.as_ref().is_some_and(|(t, _)| *t == token) {
            return self.moved_answered(host, body_size);
        }
        let Some(leg) = self.pd.as_mut().filter(|leg| leg.awaits(token)) else { return };
        let status = host.callout_status();
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        // A client error (a bad sampling parameter, say) fails the request, not the worker.
        let worker_ok = status.is_some_and(|s| s < 500);
        let prefill = leg.prefill().clone();
        let result = if ok {
            // A prefill answer too large to merge is not even copied into the VM.
            let body = match leg.wants_prefill_body() {
                true if body_size > MAX_MERGE_BYTES => {
                    leg.refuse_merge(&MergeError::TooLarge(body_size));
                    None
                }
                wanted => wanted.then(|| host.callout_body(body_size)),
            };
            PrefillResult::Ok { body }
        } else {
            let why = status
                .map_or_else(|| "no response (connection failure or timeout)".to_string(), |s| format!("HTTP {s}"));
            let detail = host.callout_body(body_size.min(ERROR_DETAIL_BYTES));
            let detail = String::from_utf8_lossy(&detail);
            PrefillResult::Failed {
                message: format!("prefill worker {} failed: {why} {detail}", prefill.addr).trim_end().to_string(),
            }
        };
        let effects = leg.prefill_answered(result, |size| host.response_body(0..size));
        let now = Now::from_nanos(host.now_nanos());
        let deferred = std::mem::take(&mut self.deferred);
        self.with_gateway(|g| {
            g.finish(host, &prefill, worker_ok);
            g.outcome(host, &prefill, worker_ok, now);
            g.ended(prefill.worker, status.is_some(), now.ms());
            // The prefill did its part: decode failures seen meanwhile were the decode's own.
            for &worker in deferred.iter().filter(|_| ok) {
                g.worker_failed(host, worker, now);
            }
        });
        for effect in effects {
            match effect {
                Effect::Fail502(message) => {
                    self.reply(host, Reply::error(502, "prefill_failed", &message));
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
            }
        }
    }

    /// vLLM's prefill leg answered (or failed): with its `kv_transfer_params` the held
    /// request goes to the decode worker carrying them; without (an error, a timeout, an
    /// answer without them) it runs on the decode worker alone, as the client sent it, and
    /// `kvmesh_prefill_fallbacks_total` counts it.
    pub(super) fn first_answered(&mut self, host: &dyn StreamHost, body_size: usize) {
        let Some((_, prefill)) = self.first.take() else { return };
        let status = host.callout_status();
        let worker_ok = status.is_some_and(|s| s < 500);
        // An answer past the merge bound is not copied in: the request runs on the decode
        // worker alone, as for an answer without `kv_transfer_params`.
        let params = status
            .filter(|s| (200..300).contains(s) && body_size <= MAX_MERGE_BYTES)
            .and_then(|_| kvmesh_core::vllm::transfer_params(&host.callout_body(body_size)));
        let now = Now::from_nanos(host.now_nanos());
        self.with_gateway(|g| {
            g.finish(host, &prefill, worker_ok);
            g.outcome(host, &prefill, worker_ok, now);
            g.ended(prefill.worker, status.is_some(), now.ms());
        });
        let body = host.request_body(self.body_size);
        let decode = params.as_deref().map(|p| kvmesh_core::vllm::decode_body(&body, p));
        match decode {
            Some(Ok(decode)) => {
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
                self.sidecar_prefill = Some(prefill.addr);
            }
            _ => {
                let why = status.map_or_else(|| "no response".to_string(), |s| format!("HTTP {s}"));
                let fallback = self.with_gateway(|g| g.config().pd.as_ref().is_none_or(|pd| pd.prefill_fallback));
                if fallback == Some(false) {
                    let msg = format!("prefill worker {} gave no KV transfer ({why})", prefill.addr);
                    self.reply(host, Reply::error(502, "prefill_failed", &msg));
                    return;
                }
                log::warn!(
                    "prefill worker {} gave no KV transfer ({why}): the decode worker runs it alone",
                    prefill.addr
                );
                host.increment(Metric::PrefillFallbacks);
            }
        }
        // The decode worker gets it now: its stall window starts here.
        if let Some(decode) = self.routed.as_ref().map(|r| r.worker) {
            self.with_gateway(|g| g.sent(decode, now.ms()));
            self.awaiting = true;
            self.wait_for_answer(decode);
        }
        if let Err(e) = host.resume_request() {
            log::warn!("cannot resume the request after its prefill: {e}");
        }
    }

    /// Envoy does not cancel a Wasm callout when its stream ends (the ABI has no call for it):
    /// the prefill worker would go on computing, and publishing, a KV no decode will fetch. It
    /// is told to stop instead, with SGLang's `/abort_request` for each rid the gateway gave
    /// the request (answers are not awaited: the stream is gone).
    pub(super) fn abort_prefill(&self, host: &dyn StreamHost, leg: &PdLeg) {
        let cluster = self.with_gateway(|g| g.upstream_cluster().to_string()).unwrap_or_default();
        let authorization = self.with_gateway(|g| g.destination().authorization).flatten();
        let addr = leg.prefill().addr.as_str();
        for rid in &self.abort_rids {
            let body = serde_json::json!({ "rid": rid }).to_string();
            let mut headers = callout_headers("/abort_request", addr).to_vec();
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
                Err(e) => log::warn!("cannot abort the prefill leg {rid} on {addr}: {e}"),
            }
        }
    }
}
