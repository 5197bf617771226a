//! One HTTP request through the filter, host-independent: `envoy.rs` calls these methods from
//! Envoy's callbacks with the real host; tests call them with [`crate::host::mock::MockHost`].
//!
//! - request headers: drop client routing headers; LLM paths pause for the body, other paths
//!   are routed at once.
//! - request body: at end of stream, pass admission (with a concurrency limit: take a token,
//!   or wait in the VM's queue until the root context's tick admits the request or answers
//!   408), then decide (nothing changes yet), apply the decision to the request (destination
//!   header; in PD mode the new body and the prefill callout), and only when all of that
//!   worked, commit it (index, in-flight counts, delta log).
//! - prefill callout answer, response headers and body: in PD mode through the split's
//!   [`Leg`], which its protocol's module drives (`crate::pd`).
//! - log (always called, also on resets): the in-flight counts go down.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Duration;

use kvmesh_core::paths::PathClass;
use kvmesh_core::priority::{Class, OBJECTIVE_HEADER, PRIORITY_HEADER, SMG_PRIORITY_HEADER};
use kvmesh_core::{Endpoint, WorkerId};

use crate::admission::{Entry, WaitRoom};
use crate::gateway::{Gateway, Now, Outcome, Plan, Prediction, Reply, RequestInfo, Routed, DECISION_KEY, FAILOVER_KEY};
use crate::headers::Headers;
use crate::host::{Action, Callout, LabelledMetric, Metric, StreamHost};
use crate::pd::Leg;
use crate::request::worker_headers::is_routing_header;
use crate::response_feedback::ResponseFeedback;
use crate::shared::admission::SharedBucket;

use hygiene::{redact_answer, TraceHeaders};
use verdict::Verdict;
use worker_headers::{callout_headers, forwarded_to_prefill, set_destination};
pub use worker_headers::{DST_HEADER, ENDPOINTS_HEADER, RETRIES_HEADER, TIMEOUT_HEADER};
pub const WORKER_HEADER: &str = "x-kvmesh-worker";
pub const PREFILL_HEADER: &str = "x-kvmesh-prefill";

/// One VM's admission queue of paused requests (each with its class: a slot taken for one
/// that went away goes back to that class).
pub type Room = WaitRoom<(Class, Weak<RefCell<RequestFilter>>)>;

/// Where a request waits when the concurrency limit is reached: the VM's queue, the request's
/// own handle in it, and its context id (the tick enters that context to resume it).
pub struct Seat {
    pub room: Rc<RefCell<Room>>,
    /// The VM's requests waiting for their worker's answer (see [`unanswered`]).
    pub unanswered: Rc<RefCell<Unanswered>>,
    pub me: Weak<RefCell<RequestFilter>>,
    pub ctx: u32,
}

/// Where a request stands with the concurrency limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    /// No limit applied to it (yet).
    Free,
    /// Paused in the VM's queue.
    Waiting,
    /// It took a token, given back when it ends.
    Holds,
}

pub struct RequestFilter {
    gateway: Option<Rc<RefCell<Gateway>>>,
    /// How this request can wait in the queue (none: it cannot; the limit then only admits).
    seat: Option<Seat>,
    admission: Admission,
    /// Its priority class (read only under a concurrency limit: none without one).
    class: Option<Class>,
    /// Its tenant id, `anonymous` if it names none (read only when tenants are configured),
    /// its weight where tenant weights are (fair shares), and whether its tokens are counted
    /// (fair shares or a tokens-per-minute limit).
    tenant: Option<String>,
    weight: Option<u32>,
    metered: bool,
    /// Its tenant's `x-ratelimit-*` headers, for the response (tenant limits only).
    rate_headers: tenant::RateHeaders,
    /// The whole request body's size, once it is here.
    body_size: usize,
    endpoint: Option<Endpoint>,
    path: String,
    request_id: Option<String>,
    /// The routing key a header gave (`consistent_hashing`), and whether the headers were
    /// looked up for one (a policy that wants a key was in force then).
    routing_key: Option<String>,
    key_checked: bool,
    /// The client's request headers, kept in PD mode for the prefill leg (read once).
    client_headers: Option<Headers>,
    /// The client's trace context is not W3C's: it goes to no worker (see [`TraceHeaders`]).
    bad_trace: bool,
    /// The committed main leg (the worker, or the decode worker in PD mode).
    routed: Option<Routed>,
    /// A PD split: its prefill leg, as its protocol runs it.
    leg: Option<Leg>,
    /// This filter answered locally.
    replied: bool,
    /// What the response said about the worker (`None`: no response headers seen).
    verdict: Option<Verdict>,
    /// The chosen worker failed and another one answered.
    failed_over: bool,
    /// The main leg was sent and nothing came back yet (for the stall window).
    awaiting: bool,
    /// What sending the request again takes, should its worker hang before answering (a
    /// regular, non-streaming request with fallbacks), and the callout that did it.
    resend: Option<Resend>,
    moved: Option<(u32, String)>,
    /// Decode workers whose failure counts only if the prefill leg succeeds.
    deferred: Vec<WorkerId>,
    /// Engine feedback on the response (regular requests).
    feedback: Option<ResponseFeedback>,
    /// The response body reached its end.
    complete: bool,
    /// A passthrough answer, read through before the client gets it: secrets and the
    /// workers' key (this one, if any) taken out ([`kvmesh_core::secrets`]).
    redact: Option<Option<String>>,
}

/// The request's body replaced by `body` (the client's was `size` bytes), with its length.
fn replace_body(host: &dyn StreamHost, size: usize, body: &[u8]) -> Result<(), Reply> {
    let internal = |what: &str, e: crate::host::HostError| Reply::error(500, "internal", &format!("{what}: {e}"));
    host.set_request_body(size, body).map_err(|e| internal("cannot rewrite the request body", e))?;
    host.set_request_header("content-length", Some(&body.len().to_string()))
        .map_err(|e| internal("cannot set content-length", e))
}

/// A fresh request id: 32 hex digits.
fn new_request_id(host: &dyn StreamHost) -> String {
    let a = kvmesh_core::rng::random_u64().unwrap_or_else(|_| host.now_nanos());
    let b = kvmesh_core::rng::random_u64().unwrap_or_else(|_| a.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15);
    format!("{a:016x}{b:016x}")
}

impl RequestFilter {
    pub fn new(gateway: Option<Rc<RefCell<Gateway>>>) -> Self {
        Self {
            gateway,
            seat: None,
            admission: Admission::Free,
            class: None,
            tenant: None,
            weight: None,
            metered: false,
            rate_headers: Vec::new(),
            body_size: 0,
            endpoint: None,
            path: String::new(),
            request_id: None,
            routing_key: None,
            key_checked: false,
            client_headers: None,
            bad_trace: false,
            routed: None,
            leg: None,
            replied: false,
            verdict: None,
            failed_over: false,
            awaiting: false,
            resend: None,
            moved: None,
            deferred: Vec::new(),
            feedback: None,
            complete: false,
            redact: None,
        }
    }

    /// A filter that can wait in `room` (the VM's queue) as context `ctx`, shared with the
    /// glue (the tick reaches it through the room).
    pub fn seated(
        gateway: Option<Rc<RefCell<Gateway>>>,
        room: Rc<RefCell<Room>>,
        unanswered: Rc<RefCell<Unanswered>>,
        ctx: u32,
    ) -> Rc<RefCell<Self>> {
        Rc::new_cyclic(|me| {
            let mut f = Self::new(gateway);
            f.seat = Some(Seat { room, unanswered, me: me.clone(), ctx });
            RefCell::new(f)
        })
    }

    fn reply(&mut self, host: &dyn StreamHost, reply: Reply) -> Action {
        host.increment(Metric::LocalReplies);
        self.replied = true;
        let retry_after = reply.retry_after.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/json")];
        if let Some(secs) = retry_after.as_deref() {
            headers.push(("retry-after", secs));
        }
        if let Some(methods) = reply.allow {
            headers.push(("allow", methods));
        }
        headers.extend(reply.headers.iter().map(|(n, v)| (*n, v.as_str())));
        if let Err(e) = host.send_reply(reply.status, &headers, &reply.body) {
            log::warn!("cannot send a local reply: {e}");
        }
        Action::Pause
    }

    fn not_configured(&mut self, host: &dyn StreamHost) -> Action {
        self.reply(
            host,
            Reply {
                retry_after: Some(1),
                ..Reply::error(503, "not_configured", "the kvmesh filter has no configuration")
            },
        )
    }

    fn with_gateway<T>(&self, f: impl FnOnce(&mut Gateway) -> T) -> Option<T> {
        let gateway = self.gateway.as_ref()?;
        let mut g = gateway.try_borrow_mut().ok()?;
        Some(f(&mut g))
    }

    fn count_route(host: &dyn StreamHost, routed: &Routed) {
        host.increment(Metric::Requests);
        if routed.matched_bytes > 0 {
            host.increment(Metric::CacheHits);
        }
    }

    pub fn on_request_headers(&mut self, host: &dyn StreamHost, end_of_stream: bool) -> Action {
        let headers = host.request_headers();
        // By name, whatever the value (one that is not UTF-8 is still a routing header).
        let maybe_routing = |(n, _): &(&[u8], &[u8])| n.first().is_some_and(|c| c.eq_ignore_ascii_case(&b'x'));
        let names = headers.raw_pairs().filter(maybe_routing).filter_map(|(n, _)| std::str::from_utf8(n).ok());
        for name in names.filter(|n| is_routing_header(n)) {
            let _ = host.set_request_header(name, None);
        }
        let [method, path, content_length] = headers.lookup([":method", ":path", "content-length"]);
        let (method, path) = (method.unwrap_or(""), path.unwrap_or("/"));
        // Trace context and request id, on every path: what reaches the workers and the logs
        // is well formed, or the gateway's own.
        let trace = TraceHeaders::scan(&headers);
        if !trace.traceparent_ok {
            self.bad_trace = true;
            let _ = host.set_request_header("traceparent", None);
            let _ = host.set_request_header("tracestate", None);
        }
        let request_id = trace.request_id.map(str::to_string).or_else(|| {
            // Present but not one usable id: replaced. Absent: ours on the LLM paths (below).
            trace.request_id_seen.then(|| {
                let id = new_request_id(host);
                let _ = host.set_request_header("x-request-id", Some(&id));
                id
            })
        });
        let Some(class) = self.with_gateway(|g| g.front().classify(method, path)) else {
            return self.not_configured(host);
        };
        let endpoint = match class {
            PathClass::Llm(endpoint) => endpoint,
            PathClass::WrongMethod => return self.reply(host, Reply::method_not_allowed(method, path)),
            PathClass::NotFound => return self.reply(host, Reply::not_found(method, path)),
            PathClass::Passthrough => return self.route_other(host, path, Now::from_nanos(host.now_nanos())),
        };
        let content_length = content_length.and_then(|v| v.trim().parse().ok());
        let Some(reply) = self.with_gateway(|g| {
            g.front().check_length(content_length).or_else(|| end_of_stream.then(|| g.front().empty_body()))
        }) else {
            return self.not_configured(host);
        };
        if let Some(reply) = reply {
            return self.reply(host, reply);
        }
        self.path = path.to_string();
        self.request_id = Some(match request_id {
            Some(id) => id,
            None => {
                // Absent, too long or not visible ASCII: both legs and the logs get ours.
                let id = new_request_id(host);
                let _ = host.set_request_header("x-request-id", Some(&id));
                id
            }
        });
        let (pd, limited, tenants, objective);
        (self.key_checked, self.routing_key, pd, limited, tenants, objective) = self
            .with_gateway(|g| {
                let (front, c) = (g.front(), g.config());
                let limited = c.admission.is_some();
                // A named InferenceObjective's class, looked up only where it can matter.
                let objective = match limited && !c.objectives.is_empty() {
                    true => headers.get(OBJECTIVE_HEADER).and_then(|n| Class::of_objective(&c.objectives, n)),
                    false => None,
                };
                (front.wants_key(), front.routing_key(&headers), c.pd.is_some(), limited, c.tenants.clone(), objective)
            })
            .unwrap_or_default();
        if let Some(t) = tenants {
            let (id, verdict) = tenant::admit(host, &t, &headers);
            self.weight = t.weights.as_ref().map(|w| kvmesh_core::fair::weight_of(w, &id));
            self.metered = self.weight.is_some() || t.tokens_per_minute.is_some();
            self.tenant = Some(id);
            match verdict {
                Ok(rate) => self.rate_headers = rate,
                Err(reply) => return self.reply(host, reply),
            }
        }
        if limited {
            let [kvmesh, smg] = headers.lookup([PRIORITY_HEADER, SMG_PRIORITY_HEADER]);
            self.class = Some(Class::from_priority_headers(kvmesh, smg).or(objective).unwrap_or_default());
        }
        if pd {
            self.client_headers = Some(headers);
        }
        self.endpoint = Some(endpoint);
        // The body is delivered to us only with `allow_on_headers_stop_iteration: true`.
        Action::Pause
    }

    /// A read-only path on the allowlist: to one healthy worker, uncounted.
    fn route_other(&mut self, host: &dyn StreamHost, path: &str, now: Now) -> Action {
        // The model list is the gateway's own (the union over the workers).
        if let Some(Some(reply)) = self.with_gateway(|g| g.models_reply(host, path)) {
            return self.reply(host, reply);
        }
        let Some(outcome) = self.with_gateway(|g| (g.route_other(host, now), g.front().destination())) else {
            return self.not_configured(host);
        };
        match outcome {
            (Err(reply), _) => self.reply(host, reply),
            // Nothing to commit but the destination.
            (Ok((routed, fallbacks)), how) => match set_destination(host, &routed.addr, &fallbacks, &how) {
                Ok(()) => {
                    self.routed = Some(routed);
                    let key = how.authorization.as_deref().and_then(|a| a.strip_prefix("Bearer "));
                    self.redact = Some(key.map(str::to_string));
                    Action::Continue
                }
                Err(e) => self.reply(host, Reply::error(500, "internal", &format!("cannot set the destination: {e}"))),
            },
        }
    }

    pub fn on_request_body(&mut self, host: &dyn StreamHost, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() || self.routed.is_some() || self.replied {
            return Action::Continue;
        }
        let Some(too_large) = self.with_gateway(|g| g.front().over_limit(body_size).then(|| g.front().too_large()))
        else {
            return self.not_configured(host);
        };
        if let Some(reply) = too_large {
            return self.reply(host, reply);
        }
        if !end_of_stream {
            return Action::Pause; // Buffer until the whole body is here.
        }
        self.body_size = body_size;
        let entry = self.enter(host);
        match self.who().entered(host, &entry) {
            Some(reply) => self.reply(host, reply),
            None if entry == Entry::Queued => Action::Pause,
            None => self.route_body(host),
        }
    }

    /// Whether this request waits in its VM's admission queue (only a tick moves it on).
    pub fn is_waiting(&self) -> bool {
        self.admission == Admission::Waiting
    }

    /// The prefill callout this request has out, if any (one dispatched from the tick is
    /// answered to the root context, which hands it on by this token).
    pub fn callout_token(&self) -> Option<u32> {
        let leg = self.leg.as_ref().and_then(Leg::token);
        leg.or(self.moved.as_ref().map(|(token, _)| *token))
    }

    /// The whole body is here and admitted: decide, apply, commit.
    fn route_body(&mut self, host: &dyn StreamHost) -> Action {
        let Some(endpoint) = self.endpoint else { return Action::Continue };
        let body = host.request_body(self.body_size);
        let body_size = self.body_size;
        let started = host.now_nanos();
        let headers = || host.request_headers();
        let info = RequestInfo {
            request_id: self.request_id.as_deref(),
            routing_key: self.routing_key.as_deref(),
            headers: (!self.key_checked).then_some(&headers),
            now: Now::from_nanos(started),
        };
        let Some(outcome) = self.with_gateway(|g| g.route_request(host, endpoint, &body, &info)) else {
            return self.not_configured(host);
        };
        let decided = host.now_nanos();
        host.record(Metric::DecisionNs, decided.saturating_sub(started));
        match outcome {
            Outcome::Reply(reply) => self.reply(host, reply),
            Outcome::Route(plan) => {
                self.resend = Resend::keep(&plan, body);
                self.apply(host, plan, body_size, Now::from_nanos(decided))
            }
        }
    }

    /// Applies a decision (made at `decided`) to the request; commits it only when
    /// everything worked.
    fn apply(&mut self, host: &dyn StreamHost, plan: Plan, body_size: usize, decided: Now) -> Action {
        let sequential = plan.pd().is_some_and(|pd| pd.leg.waits_for_prefill());
        // A PD leg that sends the client's body on (llm-d's sidecar, vLLM's decode leg) sends
        // the gateway's version of it when there is one (a client's rank taken out).
        let mut body_size = body_size;
        if let (Some(body), Some(None)) = (plan.body(), plan.pd().map(|p| p.leg.decode_body())) {
            if let Err(reply) = replace_body(host, body_size, body) {
                return self.reply(host, reply);
            }
            body_size = body.len();
            self.body_size = body_size;
        }
        let token = match self.prepare(host, &plan, body_size) {
            Ok(token) => token,
            Err(reply) => return self.reply(host, reply),
        };
        let Some(committed) = self.with_gateway(|g| g.commit(host, plan)) else {
            return self.not_configured(host);
        };
        Self::count_route(host, &committed.main);
        self.charge_routed(host, body_size, committed.main.matched_bytes);
        if let Some(model) = &committed.model {
            host.increment_labelled(LabelledMetric::ModelRequests, model);
            if committed.main.matched_bytes > 0 {
                host.increment_labelled(LabelledMetric::ModelCacheHits, model);
            }
        }
        // For access logs and tracing: one host call, whatever the mode.
        if let Err(e) = host.set_filter_state(DECISION_KEY, &self.who().record(&committed.record)) {
            log::debug!("cannot record the decision: {e}");
        }
        let now_ms = decided.ms();
        self.with_gateway(|g| {
            // vLLM's decode worker gets the request only once its prefill answered: its stall
            // window starts then (`first_answered`), not while the prefill runs.
            if !sequential {
                g.outcomes().sent(committed.main.worker, now_ms);
            }
            if let (Some(p), Some(_)) = (&committed.prefill, token) {
                g.outcomes().sent(p.worker, now_ms);
            }
        });
        self.awaiting = !sequential;
        if self.awaiting {
            self.wait_for_answer(committed.main.worker);
        }
        // sglang-router's PD counters: the prefill worker held more than cache_threshold.
        match committed.pd_cache_hit {
            Some(true) => host.increment(Metric::PdCacheHits),
            Some(false) => host.increment(Metric::PdCacheMisses),
            None => {}
        }
        if let (Some(prefill), Some(leg)) = (committed.prefill, committed.leg) {
            // A leg the gateway sends is a request routed (not one the decode pod's sidecar runs).
            if token.is_some() {
                Self::count_route(host, &prefill);
            }
            let room = committed.merge_logprobs.then(|| self.with_gateway(|g| g.merge_room().clone())).flatten();
            self.leg = Some(Leg::start(leg, prefill, token, committed.stream, room));
        }
        if committed.stream {
            self.resend = None;
        }
        // PD too: the decode response's completion metrics count (no prediction is judged).
        self.feedback = self.feedback_for(committed.prediction, committed.main.worker, now_ms);
        self.routed = Some(committed.main);
        if sequential && token.is_some() {
            // vLLM: the request waits for its prefill leg (see `on_callout_response`).
            return Action::Pause;
        }
        Action::Continue
    }

    /// The response's engine feedback, when any is due: a prediction to judge, or completion
    /// metrics for a control plane (nobody else reads them). Otherwise the response body is
    /// not read at all.
    fn feedback_for(&self, prediction: Option<Prediction>, worker: WorkerId, now_ms: u64) -> Option<ResponseFeedback> {
        let due =
            prediction.is_some() || self.metered || self.with_gateway(|g| g.front().reports_usage()).unwrap_or(false);
        due.then(|| ResponseFeedback::new(prediction, worker, now_ms))
    }

    /// Everything that can fail before a decision commits: the destination header and, in
    /// PD mode, the new body and the prefill callout (whose token is returned).
    fn prepare(&self, host: &dyn StreamHost, plan: &Plan, body_size: usize) -> Result<Option<u32>, Reply> {
        let internal = |what: &str, e: crate::host::HostError| Reply::error(500, "internal", &format!("{what}: {e}"));
        let how = self.with_gateway(|g| g.front().destination()).unwrap_or_default();
        let Some(pd) = plan.pd() else {
            if let Some(body) = plan.body() {
                // A data-parallel rank named, or a client's taken out; the gateway's rid.
                replace_body(host, body_size, body)?;
            }
            set_destination(host, plan.addr(), plan.fallbacks(), &how)
                .map_err(|e| internal("cannot set the destination", e))?;
            return Ok(None);
        };
        if let Some(body) = pd.leg.decode_body() {
            // Both legs get the same body, sent at once.
            let length = body.len().to_string();
            host.set_request_body(body_size, body).map_err(|e| internal("cannot rewrite the request body", e))?;
            host.set_request_header("content-length", Some(&length))
                .map_err(|e| internal("cannot set content-length", e))?;
        }
        set_destination(host, plan.addr(), plan.fallbacks(), &how)
            .map_err(|e| internal("cannot set the destination", e))?;
        if let Some(name) = pd.leg.decode_header() {
            host.set_request_header(name, Some(&pd.prefill.addr))
                .map_err(|e| internal("cannot name the prefill worker", e))?;
        }
        let Some(body) = pd.leg.callout_body() else { return Ok(None) };
        let cluster = self
            .with_gateway(|g| g.front().upstream_cluster().to_string())
            .unwrap_or_else(|| "kvmesh_workers".to_string());
        // The headers as the client sent them (kept from `on_request_headers`), not read again.
        let read;
        let client = match &self.client_headers {
            Some(kept) => kept,
            None => {
                read = host.request_headers();
                &read
            }
        };
        let mut headers = callout_headers(&self.path, &pd.prefill.addr).to_vec();
        if let Some(id) = self.request_id.as_deref() {
            headers.push(("x-request-id", id));
        }
        // The client's end-to-end headers (authorization, trace context, ...) go to both legs;
        // with a workers' key, that in place of the client's authorization.
        let ours = how.authorization.as_deref();
        if let Some(auth) = ours {
            headers.push(("authorization", auth));
        }
        let theirs = |n: &str| ours.is_none() || !n.eq_ignore_ascii_case("authorization");
        let traced = |n: &str| {
            !self.bad_trace || !(n.eq_ignore_ascii_case("traceparent") || n.eq_ignore_ascii_case("tracestate"))
        };
        headers.extend(client.pairs().filter(|(n, _)| forwarded_to_prefill(n) && theirs(n) && traced(n)));
        let callout =
            Callout { cluster: &cluster, headers: &headers, body, timeout: Duration::from_secs(how.timeout_secs) };
        let token = host.dispatch(callout).map_err(|e| {
            let msg = format!("cannot dispatch the prefill leg to {}: {e}", pd.prefill.addr);
            Reply::error(502, "prefill_failed", &msg)
        })?;
        Ok(Some(token))
    }

    pub fn on_response_headers(&mut self, host: &dyn StreamHost) -> Action {
        if self.replied {
            return Action::Continue;
        }
        let Some(routed) = self.routed.clone() else { return Action::Continue };
        self.resend = None; // the worker answered: nothing to send again
                            // Envoy says which worker answered: another than the chosen one means the chosen one
                            // failed and Envoy failed over (the ones in between failed too, unseen). A route that
                            // names it in the response saves asking (and the header needs no setting then).
        let from_route = self.with_gateway(|g| g.config().route_sets_worker_header).unwrap_or(false);
        let names: &[&str] = if from_route { &[":status", WORKER_HEADER] } else { &[":status"] };
        let mut values = host.response_header_values(names).into_iter();
        let status = values.next().flatten().and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
        let named = values.next().flatten().filter(|a| !a.is_empty() && a != "-");
        let upstream = match &named {
            Some(addr) => Some(addr.clone()),
            None => host.upstream_address().filter(|a| !a.is_empty()),
        };
        // A response below 500 from a worker is the worker's own answer: Envoy's code details
        // (one more host call) are asked only when they can change the verdict.
        let verdict = match &upstream {
            Some(_) if status < 500 => Verdict::Worker(true),
            _ => Verdict::of(status, host.response_code_details().as_deref()),
        };
        self.verdict = Some(verdict);
        let now = Now::from_nanos(host.now_nanos());
        let served = upstream.unwrap_or_else(|| routed.addr.clone());
        if std::mem::take(&mut self.awaiting) {
            self.answered();
            // The worker asked first answered itself, or did not (a timeout, a reset, a failover).
            let answered = matches!(verdict, Verdict::Worker(_)) && served == routed.addr;
            self.with_gateway(|g| g.outcomes().ended(routed.worker, answered, now.ms()));
        }
        let mut judged: Vec<(WorkerId, bool)> = Vec::with_capacity(2);
        if served != routed.addr {
            if !std::mem::replace(&mut self.failed_over, true) {
                let _ = host.set_filter_state(FAILOVER_KEY, &served);
            }
            host.increment(Metric::Failovers);
            log::info!("worker {} failed; Envoy failed over to {served}", routed.addr);
            judged.push((routed.worker, false));
            if let (Some(ok), Some(worker)) =
                (verdict.health(), self.with_gateway(|g| g.front().worker_at(&served, routed.dp_rank)).flatten())
            {
                judged.push((worker, ok));
            }
            self.with_gateway(|g| g.outcomes().failover(host, routed.worker));
        } else if let Some(ok) = verdict.health() {
            judged.push((routed.worker, ok));
        }
        // In PD mode a decode failure may be the prefill's doing (the decode worker could not
        // fetch the KV from a prefill worker that died): while the prefill leg is out, decode
        // failures wait for its answer, and count only if the prefill succeeded.
        let prefill_out = self.leg.as_ref().is_some_and(Leg::defers_decode_failures);
        self.with_gateway(|g| {
            for &(worker, ok) in &judged {
                if !ok && prefill_out {
                    continue;
                }
                g.outcomes().record(host, worker, ok, now);
            }
        });
        if prefill_out {
            self.deferred.extend(judged.iter().filter(|(_, ok)| !ok).map(|&(w, _)| w));
        }
        if let Some(f) = self.feedback.as_mut() {
            f.headers(status, served == routed.addr);
        }
        if named.as_deref() != Some(served.as_str()) {
            let _ = host.set_response_header(WORKER_HEADER, Some(&served));
        }
        if let Some(addr) = self.leg.as_ref().and_then(Leg::named_prefill) {
            let _ = host.set_response_header(PREFILL_HEADER, Some(addr));
        }
        for (name, value) in &self.rate_headers {
            let _ = host.set_response_header(name, Some(value));
        }
        if self.redact.is_some() {
            // Read through whole, perhaps shortened.
            let _ = host.set_response_header("content-length", None);
        }
        let Some(leg) = self.leg.as_mut() else { return Action::Continue };
        let (action, drop_length) = leg.decode_headers(status);
        if drop_length {
            let _ = host.set_response_header("content-length", None);
        }
        action
    }

    pub fn on_response_body(&mut self, host: &dyn StreamHost, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(key) = &self.redact {
            return redact_answer(host, key.as_deref(), body_size, end_of_stream);
        }
        if let Some(f) = self.feedback.as_mut() {
            f.body(host, body_size);
            if end_of_stream {
                self.complete = true;
            }
        }
        let action = match self.leg.as_mut() {
            None => Action::Continue,
            Some(leg) => {
                let step = leg.decode_body(body_size, end_of_stream, || host.response_body(0..body_size));
                if let Some(out) = step.replace {
                    if let Err(e) = host.set_response_body(body_size, &out) {
                        log::warn!("cannot rewrite the response body: {e}");
                    }
                }
                step.action
            }
        };
        if let (Action::Continue, Some(f)) = (action, self.feedback.as_mut()) {
            f.flushed();
        }
        action
    }

    pub fn on_log(&mut self, host: &dyn StreamHost) {
        match std::mem::replace(&mut self.admission, Admission::Free) {
            Admission::Free => {}
            Admission::Waiting => {
                if let Some(seat) = &self.seat {
                    if let Ok(mut room) = seat.room.try_borrow_mut() {
                        room.remove(seat.ctx);
                    }
                }
            }
            Admission::Holds => {
                if let Some((Some(params), vm)) = self.with_gateway(|g| (g.config().admission, g.ledger().vm())) {
                    let class = self.class.unwrap_or_default();
                    SharedBucket::give_back(host, &params, vm, class, crate::host::now_ms(host));
                    if let Some(Ok(mut room)) = self.seat.as_ref().map(|s| s.room.try_borrow_mut()) {
                        room.gave_back();
                    }
                }
            }
        }
        if let Some(f) = self.feedback.take() {
            self.charge_generated(host, f.generated());
            let complete = self.complete;
            self.with_gateway(|g| f.finish(g, host, complete));
        }
        let routed = self.routed.take();
        let leg = self.leg.take();
        let awaiting = std::mem::take(&mut self.awaiting);
        if awaiting {
            self.answered();
        }
        // The clock only for a leg that got no answer (the stall window).
        let prefill_out = leg.as_ref().is_some_and(Leg::pending);
        let now_ms = if awaiting || prefill_out { crate::host::now_ms(host) } else { 0 };
        self.with_gateway(|g| {
            if let (true, Some(routed)) = (awaiting, &routed) {
                g.outcomes().ended(routed.worker, false, now_ms);
            }
            if let Some(leg) = leg.as_ref().filter(|l| l.pending()) {
                g.outcomes().ended(leg.prefill().worker, false, now_ms);
            }
            if let Some(routed) = routed {
                let verdict = match self.verdict {
                    Some(v) => v,
                    // A local reply after routing (a failed prefill leg) cancelled the decode
                    // leg: not the decode worker's failure.
                    None if self.replied => Verdict::NotTheWorker,
                    // No response at all: Envoy says why (a client that went away is not the
                    // worker's failure); a host that cannot say counts it as a failure.
                    None => match host.response_code_details() {
                        Some(details) => Verdict::of(0, Some(&details)),
                        None => Verdict::WorkerFailed,
                    },
                };
                g.ledger_mut().finish(host, &routed, verdict.health() != Some(false) && !self.failed_over);
            }
            // A prefill callout still out when the stream ends serves nobody (vLLM's: the
            // request ended before it answered): release it.
            if let Some(leg) = leg.as_ref().filter(|l| l.pending()) {
                g.ledger_mut().release(host, leg.prefill());
            }
        });
        if let Some(leg) = leg.filter(Leg::pending) {
            self.abort_prefill(host, &leg);
        }
    }
}

mod admit;
mod hygiene;
mod prefill;
mod tenant;
pub mod unanswered;
mod verdict;
mod worker_headers;
use unanswered::Resend;
pub use unanswered::{Unanswered, RESEND_MAX_BYTES};
#[cfg(test)]
mod record_tests;
#[cfg(test)]
mod tests;
