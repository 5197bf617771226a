//! One HTTP request: the glue between Envoy's callbacks and [`Gateway`].
//!
//! - request headers: drop client routing headers; LLM paths pause for the body, others are
//!   routed at once.
//! - request body: at end of stream, route by the whole body and set the ORIGINAL_DST header.
//!   In PD mode, also replace the body (bootstrap fields), and dispatch the prefill leg.
//! - prefill callout answer: release and account the prefill leg; a failure becomes a 502 (or
//!   an SSE error event once the response has started).
//! - response headers/body: add `x-kvmesh-worker` (and `x-kvmesh-prefill`); merge the prefill's
//!   input logprobs when the client asked for them, waiting for the prefill only then.
//! - log (always called, also on resets): release in-flight counts.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use kvmesh_core::logprobs::{PrefillLogprobs, SseMerger};
use kvmesh_core::Endpoint;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::gateway::{is_routing_header, Gateway, Outcome, PdRouted, Reply, RequestInfo, Routed};
use crate::host::{now_nanos, EnvoyShared, Metrics};

/// The header Envoy's ORIGINAL_DST cluster (`use_http_header`) connects to.
const DST_HEADER: &str = "x-envoy-original-dst-host";
const WORKER_HEADER: &str = "x-kvmesh-worker";
const PREFILL_HEADER: &str = "x-kvmesh-prefill";

/// The prefill leg of a PD request.
struct PrefillLeg {
    routed: Routed,
    token: u32,
    /// The callout has not answered yet.
    pending: bool,
    stream: bool,
    /// `Some` while logprobs must be merged: filled when the prefill answered.
    merge: Option<Merge>,
    /// The response headers wait for the prefill (only when merging).
    headers_paused: bool,
    /// A prefill failure to report inside an already started stream.
    error_event: Option<Vec<u8>>,
    /// Bytes of decode response Envoy holds for us while the prefill answer is awaited.
    buffered: Option<usize>,
    /// The decode response has ended (seen while buffering).
    ended: bool,
}

enum Merge {
    Waiting,
    Json(PrefillLogprobs),
    Sse(SseMerger),
    /// The decode response is not something to merge into (an error, or no logprobs).
    Off,
}

pub struct Http {
    gateway: Option<Rc<RefCell<Gateway>>>,
    metrics: Option<Rc<Metrics>>,
    endpoint: Option<Endpoint>,
    path: String,
    request_id: Option<String>,
    routed: Option<Routed>,
    prefill: Option<PrefillLeg>,
    /// This filter answered locally.
    replied: bool,
    /// Response headers have gone downstream.
    response_started: bool,
    /// The upstream's answer was not a server error (`None`: no answer seen).
    upstream_ok: Option<bool>,
}

impl Http {
    pub fn new(gateway: Option<Rc<RefCell<Gateway>>>, metrics: Option<Rc<Metrics>>) -> Self {
        Self {
            gateway,
            metrics,
            endpoint: None,
            path: String::new(),
            request_id: None,
            routed: None,
            prefill: None,
            replied: false,
            response_started: false,
            upstream_ok: None,
        }
    }

    fn metric(&self, pick: impl Fn(&Metrics) -> Option<u32>) -> Option<u32> {
        self.metrics.as_deref().and_then(pick)
    }

    fn reply(&mut self, reply: Reply) -> Action {
        Metrics::incr(self.metric(|m| m.local_replies));
        self.replied = true;
        let retry_after = reply.retry_after.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(secs) = retry_after.as_deref() {
            headers.push(("retry-after", secs));
        }
        let _ = hostcalls::send_http_response(u32::from(reply.status), headers, Some(&reply.body));
        Action::Pause
    }

    fn set_destination(&mut self, routed: &Routed) -> bool {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, DST_HEADER, Some(&routed.addr)).is_ok()
    }

    fn apply(&mut self, outcome: Outcome, body_size: usize) -> Action {
        match outcome {
            Outcome::Reply(reply) => self.reply(reply),
            Outcome::Route(routed) => {
                if !self.set_destination(&routed) {
                    self.release(&routed);
                    return self.reply(Reply::error(500, "internal", "cannot set the destination"));
                }
                self.count_route(&routed);
                self.routed = Some(routed);
                Action::Continue
            }
            Outcome::Pd(pd) => self.dispatch_pd(pd, body_size),
        }
    }

    fn count_route(&self, routed: &Routed) {
        Metrics::incr(self.metric(|m| m.requests));
        if routed.matched_bytes > 0 {
            Metrics::incr(self.metric(|m| m.cache_hits));
        }
    }

    /// Sends the rewritten body to the decode worker (the main request) and to the prefill
    /// worker (a callout), concurrently.
    fn dispatch_pd(&mut self, pd: PdRouted, body_size: usize) -> Action {
        let PdRouted { decode, prefill, body, merge_logprobs, stream } = pd;
        let length = body.len().to_string();
        let rewritten = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, body_size, &body).is_ok()
            && hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", Some(&length)).is_ok()
            && self.set_destination(&decode);
        if !rewritten {
            self.release(&decode);
            self.release(&prefill);
            return self.reply(Reply::error(500, "internal", "cannot rewrite the request for PD dispatch"));
        }
        let (timeout, cluster) = match self.gateway.as_ref().and_then(|g| g.try_borrow().ok()) {
            Some(g) => (Duration::from_secs(g.config().request_timeout_secs), g.config().upstream_cluster.clone()),
            None => (Duration::from_secs(60), "kvmesh_workers".to_string()),
        };
        let mut headers = vec![
            (":method", "POST"),
            (":path", self.path.as_str()),
            (":authority", prefill.addr.as_str()),
            (DST_HEADER, prefill.addr.as_str()),
            ("content-type", "application/json"),
        ];
        if let Some(id) = self.request_id.as_deref() {
            headers.push(("x-request-id", id));
        }
        let token = match hostcalls::dispatch_http_call(&cluster, headers, Some(&body), vec![], timeout) {
            Ok(t) => t,
            Err(status) => {
                self.release(&decode);
                self.release(&prefill);
                let msg = format!("cannot dispatch the prefill leg to {}: {status:?}", prefill.addr);
                return self.reply(Reply::error(502, "prefill_failed", &msg));
            }
        };
        self.count_route(&prefill);
        self.prefill = Some(PrefillLeg {
            routed: prefill,
            token,
            pending: true,
            stream,
            merge: merge_logprobs.then_some(Merge::Waiting),
            headers_paused: false,
            error_event: None,
            buffered: None,
            ended: false,
        });
        self.routed = Some(decode);
        Action::Continue
    }

    /// Takes a request that was never sent off the in-flight table.
    fn release(&self, routed: &Routed) {
        if let Some(g) = self.gateway.as_ref().and_then(|g| g.try_borrow().ok()) {
            g.release(&EnvoyShared, routed);
        }
    }

    /// A request ended: off the in-flight table, counted as finished (and failed).
    fn finish(&self, routed: &Routed, ok: bool) {
        if let Some(g) = self.gateway.as_ref().and_then(|g| g.try_borrow().ok()) {
            g.finish(&EnvoyShared, routed, ok);
        }
    }

    fn report(&self, routed: &Routed, ok: bool) {
        if let Some(mut g) = self.gateway.as_ref().and_then(|g| g.try_borrow_mut().ok()) {
            g.outcome(&EnvoyShared, routed, ok, now_nanos() / 1_000_000_000);
        }
    }

    fn not_configured(&mut self) -> Action {
        self.reply(Reply {
            retry_after: Some(1),
            ..Reply::error(503, "not_configured", "the kvmesh filter has no configuration")
        })
    }

    /// The prefill leg answered (or failed).
    fn prefill_answered(&mut self, body_size: usize) {
        let Some(leg) = self.prefill.as_mut() else { return };
        leg.pending = false;
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        let routed = leg.routed.clone();
        let ok = (200..300).contains(&status);
        self.finish(&routed, ok);
        self.report(&routed, ok);
        if !ok {
            let why = if status == 0 {
                "no response (connection failure or timeout)".to_string()
            } else {
                format!("HTTP {status}")
            };
            let detail = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size.min(512))
                .ok()
                .flatten()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let msg = format!("prefill worker {} failed: {why} {detail}", routed.addr);
            self.prefill_failed(msg.trim_end().to_string());
            return;
        }
        let Some(leg) = self.prefill.as_mut() else { return };
        if matches!(leg.merge, Some(Merge::Waiting)) {
            let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            leg.merge = Some(match PrefillLogprobs::from_response(&body) {
                Ok(lp) if leg.stream => Merge::Sse(SseMerger::new(lp)),
                Ok(lp) => Merge::Json(lp),
                Err(e) => {
                    log::warn!("prefill response of {} has no usable logprobs: {e}", routed.addr);
                    Merge::Off
                }
            });
        }
        // Decode response data that arrived meanwhile is held by Envoy: merge it in place.
        if let Some(size) = leg.buffered.take() {
            let held = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size).ok().flatten().unwrap_or_default();
            let merged = match leg.merge.as_mut() {
                Some(Merge::Json(lp)) if leg.ended => lp.merge_json(&held).ok(),
                Some(Merge::Sse(m)) => {
                    let mut out = m.push(&held);
                    if leg.ended {
                        out.extend(m.finish());
                    }
                    Some(out)
                }
                _ => None,
            };
            if let Some(out) = merged {
                let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, &out);
            }
            let json_incomplete = matches!(leg.merge, Some(Merge::Json(_))) && !leg.ended;
            if json_incomplete {
                // The rest of the JSON body is still coming; the body callback merges at its end.
                leg.buffered = Some(size);
                if leg.headers_paused {
                    leg.headers_paused = false;
                }
                return;
            }
            leg.headers_paused = false;
            let _ = hostcalls::resume_http_response();
            return;
        }
        if leg.headers_paused {
            leg.headers_paused = false;
            let _ = hostcalls::resume_http_response();
        }
    }

    fn prefill_failed(&mut self, message: String) {
        if !self.response_started {
            // Envoy resets the decode leg when a local reply replaces its response.
            self.reply(Reply::error(502, "prefill_failed", &message));
            return;
        }
        if let Some(leg) = self.prefill.as_mut() {
            let body = kvmesh_core::errors::error_json(502, "prefill_failed", &message);
            let mut event = b"data: ".to_vec();
            event.extend_from_slice(&body);
            event.extend_from_slice(b"\n\n");
            leg.error_event = Some(event);
        }
    }
}

fn strip_routing_headers(headers: &[(String, String)]) {
    for (name, _) in headers.iter().filter(|(n, _)| is_routing_header(n)) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None);
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

impl Context for Http {
    fn on_http_call_response(&mut self, token_id: u32, _num_headers: usize, body_size: usize, _num_trailers: usize) {
        if self.prefill.as_ref().is_some_and(|leg| leg.token == token_id && leg.pending) {
            self.prefill_answered(body_size);
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = hostcalls::get_map(MapType::HttpRequestHeaders).unwrap_or_default();
        strip_routing_headers(&headers);
        let Some(gateway) = self.gateway.clone() else { return self.not_configured() };
        let Ok(mut gw) = gateway.try_borrow_mut() else { return self.not_configured() };

        let post = header(&headers, ":method") == Some("POST");
        let path = header(&headers, ":path").unwrap_or("/");
        let Some(endpoint) = Endpoint::from_path(path).filter(|_| post) else {
            let outcome = gw.route_other(&EnvoyShared, now_nanos() / 1_000_000_000);
            drop(gw);
            return self.apply(outcome, 0);
        };
        self.path = path.to_string();
        self.request_id = header(&headers, "x-request-id").map(String::from);
        let content_length = header(&headers, "content-length").and_then(|v| v.trim().parse().ok());
        let reply = gw.check_length(content_length).or_else(|| end_of_stream.then(|| gw.empty_body()));
        drop(gw);
        if let Some(reply) = reply {
            return self.reply(reply);
        }
        self.endpoint = Some(endpoint);
        // The body is delivered to us only with `allow_on_headers_stop_iteration: true`.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(endpoint) = self.endpoint else { return Action::Continue };
        if self.routed.is_some() || self.replied {
            return Action::Continue;
        }
        let Some(gateway) = self.gateway.clone() else { return self.not_configured() };
        let Ok(mut gw) = gateway.try_borrow_mut() else { return self.not_configured() };
        if body_size as u64 > gw.config().max_payload_size {
            let reply = gw.too_large();
            drop(gw);
            return self.reply(reply);
        }
        if !end_of_stream {
            return Action::Pause; // Buffer until the whole body is here.
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size).ok().flatten().unwrap_or_default();
        let started = now_nanos();
        let info = RequestInfo { request_id: self.request_id.as_deref(), now_secs: started / 1_000_000_000 };
        let outcome = gw.route_request(&EnvoyShared, endpoint, &body, &info);
        drop(gw);
        Metrics::record(self.metric(|m| m.decision_ns), now_nanos().saturating_sub(started));
        self.apply(outcome, body_size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.replied {
            return Action::Continue;
        }
        let Some(routed) = self.routed.clone() else { return Action::Continue };
        let status = hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        self.report(&routed, status < 500);
        self.upstream_ok = Some(status < 500);
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, WORKER_HEADER, Some(&routed.addr));
        if let Some(leg) = self.prefill.as_mut() {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, PREFILL_HEADER, Some(&leg.routed.addr));
            if leg.merge.is_some() {
                if status != 200 {
                    leg.merge = Some(Merge::Off);
                } else {
                    if !leg.stream {
                        // The merged body has another length.
                        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, "content-length", None);
                    }
                    if leg.pending {
                        // Only when merging does the response wait for the prefill answer.
                        leg.headers_paused = true;
                        return Action::Pause;
                    }
                }
            }
        }
        self.response_started = true;
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.response_started = true;
        let Some(leg) = self.prefill.as_mut() else { return Action::Continue };
        if matches!(leg.merge, Some(Merge::Waiting)) {
            // Hold the data (Envoy buffers it) until the prefill has answered.
            leg.buffered = Some(body_size);
            leg.ended |= end_of_stream;
            return Action::Pause;
        }
        leg.buffered = None;
        let error_event = leg.error_event.take();
        let merge = leg.merge.as_mut();
        if error_event.is_none() && !matches!(merge, Some(Merge::Json(_) | Merge::Sse(_))) {
            return Action::Continue;
        }
        if matches!(merge, Some(Merge::Json(_))) && !end_of_stream {
            return Action::Pause; // Buffer the whole JSON response.
        }
        let chunk =
            hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size).ok().flatten().unwrap_or_default();
        let mut out = error_event.unwrap_or_default();
        match merge {
            Some(Merge::Json(lp)) => out.extend(lp.merge_json(&chunk).unwrap_or(chunk)),
            Some(Merge::Sse(m)) => {
                out.extend(m.push(&chunk));
                if end_of_stream {
                    out.extend(m.finish());
                }
            }
            _ => out.extend(chunk),
        }
        let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, body_size, &out);
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(routed) = self.routed.take() {
            // A local reply after routing (a failed prefill leg) cancelled the decode leg: not
            // the decode worker's failure. Otherwise no answer at all counts as one.
            let ok = self.upstream_ok.unwrap_or(self.replied);
            self.finish(&routed, ok);
        }
        // A prefill callout still out is cancelled with the stream: release it here.
        if let Some(leg) = self.prefill.take().filter(|leg| leg.pending) {
            self.release(&leg.routed);
        }
    }
}
