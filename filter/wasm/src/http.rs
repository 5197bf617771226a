//! One HTTP request: the glue between Envoy's callbacks and [`Gateway`].
//!
//! headers: drop client routing headers; LLM paths pause for the body, others are routed at
//! once. body: at end of stream, route by the whole body and set the ORIGINAL_DST header.
//! response headers: add `x-kvmesh-worker`. log (always called, also on resets): release the
//! in-flight count.

use std::cell::RefCell;
use std::rc::Rc;

use kvmesh_core::Endpoint;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::gateway::{is_routing_header, Gateway, Outcome, Reply, Routed};
use crate::host::{now_nanos, EnvoyShared, Metrics};

/// The header Envoy's ORIGINAL_DST cluster (`use_http_header`) connects to.
const DST_HEADER: &str = "x-envoy-original-dst-host";
const WORKER_HEADER: &str = "x-kvmesh-worker";

pub struct Http {
    gateway: Option<Rc<RefCell<Gateway>>>,
    metrics: Option<Rc<Metrics>>,
    endpoint: Option<Endpoint>,
    routed: Option<Routed>,
}

impl Http {
    pub fn new(gateway: Option<Rc<RefCell<Gateway>>>, metrics: Option<Rc<Metrics>>) -> Self {
        Self { gateway, metrics, endpoint: None, routed: None }
    }

    fn metric(&self, pick: impl Fn(&Metrics) -> Option<u32>) -> Option<u32> {
        self.metrics.as_deref().and_then(pick)
    }

    fn reply(&self, reply: Reply) -> Action {
        Metrics::incr(self.metric(|m| m.local_replies));
        let retry_after = reply.retry_after.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(secs) = retry_after.as_deref() {
            headers.push(("retry-after", secs));
        }
        let _ = hostcalls::send_http_response(u32::from(reply.status), headers, Some(&reply.body));
        Action::Pause
    }

    fn apply(&mut self, outcome: Outcome) -> Action {
        match outcome {
            Outcome::Reply(reply) => self.reply(reply),
            Outcome::Route(routed) => {
                if hostcalls::set_map_value(MapType::HttpRequestHeaders, DST_HEADER, Some(&routed.addr)).is_err() {
                    return self.reply(Reply {
                        status: 500,
                        body: kvmesh_core::errors::error_json(500, "internal", "cannot set the destination"),
                        retry_after: None,
                    });
                }
                Metrics::incr(self.metric(|m| m.requests));
                if routed.matched_bytes > 0 {
                    Metrics::incr(self.metric(|m| m.cache_hits));
                }
                self.routed = Some(routed);
                Action::Continue
            }
        }
    }

    fn not_configured(&self) -> Action {
        self.reply(Reply {
            status: 503,
            body: kvmesh_core::errors::error_json(503, "not_configured", "the kvmesh filter has no configuration"),
            retry_after: Some(1),
        })
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

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = hostcalls::get_map(MapType::HttpRequestHeaders).unwrap_or_default();
        strip_routing_headers(&headers);
        let Some(gateway) = self.gateway.clone() else {
            return self.not_configured();
        };
        let Ok(mut gw) = gateway.try_borrow_mut() else {
            return self.not_configured();
        };

        let post = header(&headers, ":method") == Some("POST");
        let endpoint = header(&headers, ":path").filter(|_| post).and_then(Endpoint::from_path);
        let Some(endpoint) = endpoint else {
            let outcome = gw.route_other(&EnvoyShared);
            drop(gw);
            return self.apply(outcome);
        };
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
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        if self.routed.is_some() {
            return Action::Continue;
        }
        let Some(gateway) = self.gateway.clone() else {
            return self.not_configured();
        };
        let Ok(mut gw) = gateway.try_borrow_mut() else {
            return self.not_configured();
        };
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
        let outcome = gw.route_request(&EnvoyShared, endpoint, &body);
        Metrics::record(self.metric(|m| m.decision_ns), now_nanos().saturating_sub(started));
        drop(gw);
        self.apply(outcome)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(routed) = &self.routed {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, WORKER_HEADER, Some(&routed.addr));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let (Some(routed), Some(gateway)) = (self.routed.take(), &self.gateway) else {
            return;
        };
        if let Ok(gw) = gateway.try_borrow() {
            gw.finish(&EnvoyShared, &routed);
        }
    }
}
