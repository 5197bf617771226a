//! One VM's routing state and decisions, independent of proxy-wasm: what to do with a request
//! given its path, its body and the shared state. Deciding ([`Gateway::route_request`])
//! changes nothing; [`Gateway::commit`] records a decision once everything that could fail in
//! applying it (headers, body, callout) has succeeded. `request.rs` drives both.

use kvmesh_core::bootstrap::{random_rooms, Bootstrap};
use kvmesh_core::breaker::BreakerState;
use kvmesh_core::errors::error_json;
use kvmesh_core::paths::{self, PathClass};
use kvmesh_core::pd::{PdDecision, PdRouter};
use kvmesh_core::policy::{Candidate, PolicyKind};
use kvmesh_core::request::{self, RequestError, MAX_ROUTING_KEY};
use kvmesh_core::rng::{random_u64, seeded, FastRng, RngCore};
use kvmesh_core::{Config, Decision, Endpoint, Role, Router, RoutingSettings, RoutingText, WorkerId, WorkerTable};

use crate::headers::Headers;
use crate::health::Health;
use crate::shared::{Delta, DeltaLog, EndedBy, Inflight, SharedStore, VmLedger};
use crate::stall::Stalls;

/// What the filter does with a request.
#[derive(Debug)]
pub enum Outcome {
    /// Send it where the plan says, then [`Gateway::commit`] the plan.
    Route(Plan),
    /// Answer locally with a JSON error.
    Reply(Reply),
}

/// A worker as the glue needs it: id, address, and what it was believed to hold.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub worker: WorkerId,
    pub addr: String,
    /// Whether it was added to the in-flight table (and must be taken off when done).
    pub counted: bool,
    /// Bytes of the routing text the worker was believed to hold already.
    pub matched_bytes: usize,
}

/// A decision not yet recorded anywhere: where to send the request and, in PD mode, what to
/// send the prefill worker.
#[derive(Debug)]
pub struct Plan {
    chosen: Chosen,
    main: Routed,
    /// Where Envoy fails the main leg over to, in order (other available workers of its
    /// role, least loaded first; at most `max_attempts - 1`).
    fallbacks: Vec<String>,
    /// Boxed: `Outcome` stays small for the regular requests.
    pd: Option<Box<PdPlan>>,
    /// The shared counts as read for this decision (the commit's CAS starts from them).
    inflight: Inflight,
    /// When the decision was made: a half-open worker's probe slot is taken at that time.
    now: Now,
    /// A batch: no prediction is judged (its items' reports cannot be told apart).
    batch: bool,
}

#[derive(Debug)]
enum Chosen {
    Regular(Decision),
    Pd(PdDecision),
}

/// Most `/abort_request` calls for one request's prefill leg (one per batch item).
pub const MAX_ABORTS: usize = 16;

/// The PD part of a plan.
#[derive(Debug, PartialEq)]
pub struct PdPlan {
    pub prefill: Routed,
    /// The body both legs receive (bootstrap fields and `rid` injected).
    pub body: Vec<u8>,
    /// Whether the prefill's input logprobs must be merged into the decode response.
    pub merge_logprobs: bool,
    pub stream: bool,
    /// The rids the prefill leg can be aborted by, should the request end before it answers.
    pub abort_rids: Vec<String>,
}

impl Plan {
    /// Where the request itself goes (the decode worker in PD mode).
    pub fn addr(&self) -> &str {
        &self.main.addr
    }

    pub fn pd(&self) -> Option<&PdPlan> {
        self.pd.as_deref()
    }

    /// Where Envoy fails the main leg over to, in order.
    pub fn fallbacks(&self) -> &[String] {
        &self.fallbacks
    }
}

/// `first,then,...`: the value `override_host` reads, in the order it tries them.
pub fn endpoint_list(first: &str, then: &[String]) -> String {
    let mut out = String::with_capacity(first.len() + then.iter().map(|a| a.len() + 1).sum::<usize>());
    out.push_str(first);
    for addr in then {
        out.push(',');
        out.push_str(addr);
    }
    out
}

/// A committed plan: the legs, counted in flight.
#[derive(Debug)]
pub struct Committed {
    pub main: Routed,
    pub prediction: Option<Prediction>,
    pub prefill: Option<Routed>,
    pub merge_logprobs: bool,
    pub stream: bool,
}

#[derive(Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    /// Seconds for a `retry-after` header.
    pub retry_after: Option<u32>,
    /// The methods an `allow` header lists (405).
    pub allow: Option<&'static str>,
}

impl Reply {
    pub fn error(status: u16, code: &str, message: &str) -> Self {
        Self { status, body: error_json(status, code, message), retry_after: None, allow: None }
    }

    /// 405 for an LLM endpoint asked with another method than POST.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let msg = format!("{method} is not allowed on {path}: use POST");
        Self { allow: Some("POST"), ..Self::error(405, "method_not_allowed", &msg) }
    }

    /// 404 for a path the gateway does not serve (worker admin operations among them).
    pub fn not_found(method: &str, path: &str) -> Self {
        let msg = format!(
            "{method} {path} is not served by the gateway (LLM endpoints: POST /generate, /v1/chat/completions, \
             /v1/completions; read-only worker endpoints such as GET /v1/models; worker administration goes \
             through kvmesh-cp)"
        );
        Self::error(404, "not_found", &msg)
    }

    pub fn request(e: &RequestError) -> Self {
        Self::error(e.status(), e.code(), &e.to_string())
    }

    /// 503 with retry-after: none available, or (`full`) all of them overloaded.
    fn no_worker_or_full(what: &str, full: bool) -> Self {
        if !full {
            return Self::no_worker(what);
        }
        Self {
            retry_after: Some(1),
            ..Self::error(
                503,
                "overloaded",
                &format!("every {what} is overloaded (queue or KV cache full); retry later"),
            )
        }
    }

    fn no_worker(what: &str) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::error(503, "no_healthy_worker", &format!("no healthy {what} is available"))
        }
    }
}

/// How a routed request's destination headers are written (from the configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Destination {
    /// The whole request's budget, for `x-envoy-upstream-rq-timeout-ms`.
    pub timeout_secs: u64,
    /// Also write `x-envoy-original-dst-host` (`original_dst_header`).
    pub original_dst: bool,
}

impl Default for Destination {
    /// As configured by default.
    fn default() -> Self {
        Self { timeout_secs: kvmesh_core::config::DEFAULT_REQUEST_TIMEOUT_SECS, original_dst: true }
    }
}

/// A time from the host's clock, in milliseconds since the epoch: a type of its own, so that
/// the circuit breakers (which time out to the millisecond) cannot be handed seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Now(u64);

impl Now {
    /// From the host's clock (`Host::now_nanos`).
    pub fn from_nanos(nanos: u64) -> Self {
        Self(nanos / 1_000_000)
    }

    pub fn from_ms(ms: u64) -> Self {
        Self(ms)
    }

    pub fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(1000))
    }

    pub fn ms(self) -> u64 {
        self.0
    }
}

/// Per-request facts from the host.
#[derive(Clone, Copy, Default)]
pub struct RequestInfo<'a> {
    /// The request id (`x-request-id`), used as `rid` in PD bodies when the client set none.
    pub request_id: Option<&'a str>,
    /// The routing key a request header gave (`consistent_hashing`; see [`Gateway::routing_key`]).
    pub routing_key: Option<&'a str>,
    /// Reads the request headers again, for a VM that learns only at the body that a key is
    /// needed (its first snapshot, or new settings, arrived in between); none when the headers
    /// were already looked up for a key (or cannot be read again).
    pub headers: Option<&'a dyn Fn() -> Headers>,
    /// When the request body was complete.
    pub now: Now,
}

// One per VM, built once: the size difference between a router and a PD pair of them costs
// nothing.
#[allow(clippy::large_enum_variant)]
enum Mode {
    Regular(Router),
    Pd(PdRouter),
}

mod feedback;
mod sync;

pub use feedback::Prediction;
pub use sync::table_from;

/// With a control plane, a filter's own eviction only keeps its index under this many times
/// `max_tree_size` (the control plane's evictions do the real work).
pub const CONTROL_PLANE_EVICTION_CAP: u64 = 2;

/// Most block hashes held for the next report (8 MiB; the oldest batches go first).
pub const REPORT_QUEUE_HASHES: usize = 1 << 20;

/// Index inserts made on this Envoy that the control plane has not been told about, bounded
/// by the number of hashes they hold.
#[derive(Default)]
struct ReportQueue {
    batches: std::collections::VecDeque<(WorkerId, Vec<u64>)>,
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

    fn take(&mut self) -> std::collections::VecDeque<(WorkerId, Vec<u64>)> {
        self.hashes = 0;
        std::mem::take(&mut self.batches)
    }
}

/// Whether a worker whose breaker is half-open may be chosen (its probe slot free): yes for
/// requests that are committed (the commit takes the slot), no for the uncounted other paths.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Probes {
    Allowed,
    Refused,
}

/// The available workers of `role` with their loads: the table's plus this Envoy's in-flight
/// counts. A worker is available when healthy and its circuit breaker admits a request (with
/// `Probes::Refused`, only a closed breaker does). Stalled workers are left out while others
/// are available, then overloaded ones; `.1` says that some were available but every one of
/// them was overloaded.
fn candidates(g: &Gateway, inflight: &Inflight, role: Role, now: Now, probes: Probes) -> (Vec<Candidate>, bool) {
    let available: Vec<&kvmesh_core::Worker> = g
        .table
        .healthy_with(role)
        .filter(|w| match probes {
            Probes::Allowed => g.health.available(w.id, now),
            Probes::Refused => g.health.state(w.id, now) == BreakerState::Closed,
        })
        .collect();
    let moving: Vec<&kvmesh_core::Worker> =
        available.iter().copied().filter(|w| !g.stalls.stalled(w.id, now.ms())).collect();
    let pool = if moving.is_empty() { available } else { moving };
    let (max_waiting, max_kv) = (g.config.overload_waiting, g.config.overload_kv_usage);
    let candidate = |w: &&kvmesh_core::Worker| Candidate {
        id: w.id,
        load: w.load + u64::from(inflight.count(w.id)),
        affinity: w.affinity,
        utility: w.utility,
    };
    let room: Vec<Candidate> = pool.iter().filter(|w| !w.overloaded(max_waiting, max_kv)).map(candidate).collect();
    if room.is_empty() && !pool.is_empty() {
        if probes == Probes::Refused {
            // Read-only paths (health, models) cost a worker nothing: not shed.
            return (pool.iter().map(candidate).collect(), false);
        }
        return (room, true);
    }
    (room, false)
}

/// One VM's routing state.
pub struct Gateway {
    /// The plugin configuration's routing settings (the control plane's are overlaid on them).
    base: RoutingSettings,
    config: Config,
    table: WorkerTable,
    mode: Mode,
    rng: FastRng,
    log: DeltaLog,
    health: Health,
    /// Workers holding this VM's requests without answering (see [`Stalls`]).
    stalls: Stalls,
    last_eviction_secs: u64,
    /// Index inserts made on this Envoy that the control plane has not been told about: kept
    /// only by the VM that holds the control-plane streams (another VM's queue would never be
    /// sent; when a VM takes the streams over, its full report covers what it indexed).
    unreported: ReportQueue,
    /// Blocks engine feedback showed stale, for the next report (the stream owner's only).
    stale: std::collections::VecDeque<(WorkerId, Vec<u64>)>,
    /// Engine feedback of this VM's responses since the last tick (merged into shared data
    /// on the tick, not per response).
    pending_feedback: crate::shared::feedback::Pending,
    /// This VM holds the control-plane streams (the plugin says so on every tick).
    reporting: bool,
    /// This Envoy's gateway id: inserts a delta says it reported itself are not applied again.
    own_id: Option<String>,
    /// The control-plane table version this VM applied.
    table_version: Option<u64>,
    /// The publication epoch that version belongs to (see [`SharedTable::publish`]): versions
    /// start again when kvmesh-cp restarts, so a version alone can repeat with another table.
    table_epoch: Option<u64>,
    /// The epoch this VM publishes under while it holds the streams: new with every full
    /// snapshot (a connection, so a control plane that may have restarted).
    publish_epoch: u64,
    /// The version of the shared table value this VM published or decoded last (the polled
    /// records name the one they go with).
    shared_table_version: Option<u64>,
    /// The control plane's routing settings last applied.
    cp_settings: Option<RoutingSettings>,
    /// The settings message `cp_settings` came from, as received (a republished table
    /// carries the same one: compared before converting).
    cp_settings_wire: Option<kvmesh_proto::v1::RoutingSettings>,
    /// What this VM has in flight, per worker, as counted in [`Inflight`] (published by
    /// [`Gateway::heartbeat`]): requests that ended leave it when their end is written.
    mine: std::collections::BTreeMap<WorkerId, u32>,
    /// Requests that ended here and are not written to [`Inflight`] yet (the next commit or
    /// tick writes them). Only while this VM is the Envoy's only one (`alone`): another VM
    /// would count them as load until then (a session's next turn, sent as the last one
    /// ended, could be moved off its worker), so with others each end is written at once.
    ended: EndedBy,
    /// This VM was the only one registered at its last two heartbeats (a second apart): the
    /// VMs of one Envoy start together, and one that registered a moment before the others
    /// must not take itself for alone until they have registered.
    alone: bool,
    /// The registry held only this VM at the last heartbeat.
    only_me: bool,
    /// `mine` changed since it was last published.
    mine_changed: bool,
    last_heartbeat_ms: u64,
}

fn build_mode(config: &Config) -> Mode {
    let params = config.router_params();
    match &config.pd {
        Some(pd) => Mode::Pd(PdRouter::new(params, pd.prefill_policy, pd.decode_policy, pd.decider)),
        None => Mode::Regular(Router::new(params, config.policy)),
    }
}

impl Gateway {
    /// A gateway routing with `config`, whose routing settings stay the base the control
    /// plane's settings are overlaid on.
    pub fn new(config: Config, store: &dyn SharedStore, seed: u64) -> Self {
        Self {
            base: config.settings.clone(),
            table: config.workers.clone(),
            mode: build_mode(&config),
            rng: seeded(seed),
            log: DeltaLog::new(store, seed as u32 ^ (seed >> 32) as u32),
            health: Health::new(config.breaker),
            stalls: Stalls::new(config.worker_stall_ms),
            last_eviction_secs: 0,
            unreported: ReportQueue::default(),
            stale: std::collections::VecDeque::new(),
            pending_feedback: crate::shared::feedback::Pending::default(),
            reporting: false,
            own_id: None,
            table_version: None,
            table_epoch: None,
            publish_epoch: 0,
            shared_table_version: None,
            cp_settings: None,
            cp_settings_wire: None,
            mine: std::collections::BTreeMap::new(),
            ended: EndedBy::new(),
            alone: false,
            only_me: false,
            mine_changed: false,
            last_heartbeat_ms: 0,
            config,
        }
    }

    /// This VM's id in shared data (lease owner, log writer).
    pub fn vm_id(&self) -> u32 {
        self.log.vm()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn max_payload_size(&self) -> u64 {
        self.config.max_payload_size
    }

    /// What the gateway does with `method` on `path`.
    pub fn classify(&self, method: &str, path: &str) -> PathClass {
        paths::classify(method, path, &self.config.passthrough_paths)
    }

    /// How a routed request's destination headers are written (its timeout also bounds the
    /// prefill leg).
    pub fn destination(&self) -> Destination {
        Destination { timeout_secs: self.config.request_timeout_secs, original_dst: self.config.original_dst_header }
    }

    /// The Envoy cluster the prefill callouts go through.
    pub fn upstream_cluster(&self) -> &str {
        &self.config.upstream_cluster
    }

    /// A request whose declared `content-length` exceeds the limit is refused before its
    /// body is read.
    pub fn check_length(&self, content_length: Option<u64>) -> Option<Reply> {
        let limit = self.config.max_payload_size;
        content_length.filter(|&len| len > limit).map(|_| Reply::request(&RequestError::TooLarge { limit }))
    }

    /// A body that grew past the limit while buffering.
    pub fn too_large(&self) -> Reply {
        Reply::request(&RequestError::TooLarge { limit: self.config.max_payload_size })
    }

    /// An LLM request that arrived with no body at all.
    pub fn empty_body(&self) -> Reply {
        Reply::request(&RequestError::EmptyBody)
    }

    /// The router whose index holds `worker`'s prefixes.
    fn router_of(&mut self, worker: WorkerId) -> Option<&mut Router> {
        let role = self.table.get(worker)?.role;
        match (&mut self.mode, role) {
            (Mode::Regular(r), Role::Regular) => Some(r),
            (Mode::Pd(pd), Role::Prefill) => Some(pd.prefill_router()),
            (Mode::Pd(pd), Role::Decode) => Some(pd.decode_router()),
            _ => None,
        }
    }

    /// Applies the prefix inserts other VMs made.
    fn catch_up(&mut self, store: &dyn SharedStore, head: u64) {
        let uses_text = match &mut self.mode {
            Mode::Regular(r) => r.uses_text(),
            Mode::Pd(pd) => pd.prefill_router().uses_text() || pd.decode_router().uses_text(),
        };
        if !uses_text {
            return;
        }
        for delta in self.log.poll(store, head) {
            self.apply_delta(&delta);
            match (delta.evict, delta.from_cp) {
                (false, false) => self.queue_report(delta.worker, delta.hashes),
                // Engine feedback on another VM of this Envoy.
                (true, false) => self.queue_stale(delta.worker, delta.hashes),
                _ => {}
            }
        }
    }

    fn apply_delta(&mut self, delta: &Delta) {
        if let Some(router) = self.router_of(delta.worker) {
            if delta.evict {
                router.apply_evictions(delta.worker, &delta.hashes);
            } else {
                router.apply_insert(delta.worker, &delta.hashes);
            }
        }
    }

    fn queue_report(&mut self, worker: WorkerId, hashes: Vec<u64>) {
        if self.config.control_plane_cluster.is_none() || !self.reporting {
            return;
        }
        self.unreported.push(worker, hashes);
    }

    /// Whether this VM holds the control-plane streams: only then are inserts queued for
    /// reports (a VM that stops holding them drops its queue).
    pub fn set_reporting(&mut self, on: bool) {
        if !on && self.reporting {
            self.unreported.take();
            self.stale.clear();
        }
        self.reporting = on;
    }

    /// The gateway id this Envoy reports under (see [`Self::apply_snapshot`]).
    pub fn set_own_id(&mut self, id: &str) {
        self.own_id = Some(id.to_string());
    }

    /// Hashes queued for the next report.
    #[cfg(test)]
    pub fn unreported_hashes(&self) -> usize {
        self.unreported.hashes
    }

    fn routed(&self, worker: WorkerId, matched_bytes: usize) -> Option<Routed> {
        let w = self.table.get(worker)?;
        Some(Routed { worker, addr: w.addr.clone(), counted: false, matched_bytes })
    }

    /// Whether a policy in force hashes on a routing key (its headers are then looked up).
    pub fn wants_key(&self) -> bool {
        self.uses(PolicyKind::ConsistentHashing)
    }

    /// Whether the main policy or a PD leg's is `kind`.
    fn uses(&self, kind: PolicyKind) -> bool {
        match &self.config.pd {
            Some(pd) => pd.prefill_policy == kind || pd.decode_policy == kind,
            None => self.config.policy == kind,
        }
    }

    /// The routing key of a request with these headers: the first of the configured
    /// `routing_key_headers` present with a value of 1 to 1024 bytes, when a policy in force
    /// hashes on it (none otherwise: nothing is kept).
    pub fn routing_key(&self, headers: &Headers) -> Option<String> {
        if !self.uses(PolicyKind::ConsistentHashing) {
            return None;
        }
        self.config.routing_key.headers.iter().find_map(|name| {
            headers
                .pairs()
                .find(|(n, v)| n.eq_ignore_ascii_case(name) && !v.is_empty() && v.len() <= MAX_ROUTING_KEY)
                .map(|(_, v)| v.to_string())
        })
    }

    /// Decides where an LLM request goes, by its body. Changes nothing that outlives the call
    /// (other VMs' index changes are applied first, as on every request).
    pub fn route_request(
        &mut self,
        store: &dyn SharedStore,
        endpoint: Endpoint,
        body: &[u8],
        info: &RequestInfo<'_>,
    ) -> Outcome {
        if body.len() as u64 > self.config.max_payload_size {
            return Outcome::Reply(self.too_large());
        }
        let parsed = match request::parse(endpoint, body) {
            Ok(p) => p,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        self.sync_table(store);
        let inflight = Inflight::load(store).discount(&self.ended);
        self.catch_up(store, inflight.head());
        let now = info.now;
        self.health.sync_if_probing(store, now);
        // The key the headers gave; when none did and this VM has only now learned (in the
        // sync above) that consistent hashing is in force, the headers are read again.
        let late_key = match (info.routing_key, info.headers) {
            (None, Some(fetch)) if self.uses(PolicyKind::ConsistentHashing) => self.routing_key(&fetch()),
            _ => None,
        };
        let header_key = info.routing_key.or(late_key.as_deref());
        let body_key = match (&self.config.routing_key.body_field, header_key) {
            (Some(field), None) if self.uses(PolicyKind::ConsistentHashing) => request::top_level_key(body, field),
            _ => None,
        };
        let key = header_key.or(body_key.as_deref()).map(str::as_bytes);
        let main_role = if matches!(self.mode, Mode::Pd(_)) { Role::Decode } else { Role::Regular };
        let (main_cands, main_full) = candidates(self, &inflight, main_role, now, Probes::Allowed);
        let chosen = match &self.mode {
            Mode::Regular(router) => {
                match router.decide(RoutingText::from(&parsed).with_key(key), &main_cands, &mut self.rng) {
                    Some(d) => Chosen::Regular(d),
                    None => return Outcome::Reply(Reply::no_worker_or_full("worker", main_full)),
                }
            }
            Mode::Pd(pd) => {
                let (prefill, prefill_full) = candidates(self, &inflight, Role::Prefill, now, Probes::Allowed);
                match pd.decide(RoutingText::from(&parsed).with_key(key), &prefill, &main_cands, &mut self.rng) {
                    Some(d) => Chosen::Pd(d),
                    None if main_cands.is_empty() => {
                        return Outcome::Reply(Reply::no_worker_or_full("decode worker", main_full))
                    }
                    None => return Outcome::Reply(Reply::no_worker_or_full("prefill worker", prefill_full)),
                }
            }
        };
        let (main, prefill) = match &chosen {
            Chosen::Regular(d) | Chosen::Pd(PdDecision::DecodeOnly(d)) => (d, None),
            Chosen::Pd(PdDecision::Split { prefill, decode }) => (decode, Some(prefill)),
        };
        let Some(main_routed) = self.routed(main.worker, main.matched_bytes) else {
            return Outcome::Reply(Reply::no_worker("worker"));
        };
        let fallbacks = self.fallbacks(main_cands, main.worker, now);
        let pd = match prefill {
            None => None,
            Some(p) => {
                let (Some(worker), Some(routed)) = (self.table.get(p.worker), self.routed(p.worker, p.matched_bytes))
                else {
                    return Outcome::Reply(Reply::no_worker("prefill worker"));
                };
                let rng = &mut self.rng;
                let boot = Bootstrap {
                    host: worker.host.clone(),
                    port: worker.bootstrap_port,
                    rooms: random_rooms(parsed.batch.unwrap_or(1), || random_u64().unwrap_or_else(|_| rng.next_u64())),
                    request_id: info.request_id.map(String::from),
                };
                let body = match boot.inject(body, &parsed) {
                    Ok(b) => b,
                    Err(e) => return Outcome::Reply(Reply::request(&e)),
                };
                Some(Box::new(PdPlan {
                    prefill: routed,
                    abort_rids: boot.injected_rids(&parsed, MAX_ABORTS),
                    body,
                    merge_logprobs: parsed.return_logprob && endpoint == Endpoint::Generate,
                    stream: parsed.stream,
                }))
            }
        };
        let batch = parsed.batch.is_some();
        Outcome::Route(Plan { chosen, main: main_routed, fallbacks, pd, inflight, now, batch })
    }

    /// Records a plan that was applied: the index learns the prefix, the legs are counted in
    /// flight, and the new blocks go to the other VMs (one CAS for counts and log sequence,
    /// plus the log slot) and into the next report.
    pub fn commit(&mut self, store: &dyn SharedStore, plan: Plan) -> Committed {
        let Plan { chosen, mut main, pd, inflight, now, fallbacks: _, batch } = plan;
        // What the index believed the chosen worker held, read before this insert: its own
        // match (a policy that chose by load reports none, though the worker may hold part of
        // the prompt). A partial last block counts whole (within the one-block tolerance).
        let prediction = match (&chosen, &self.mode) {
            (Chosen::Regular(d), Mode::Regular(_)) if !batch && !d.blocks.is_empty() => {
                let bytes = d.held_blocks.saturating_mul(self.config.block_size).max(d.matched_bytes);
                Some(Prediction::new(d.worker, bytes, &d.blocks, self.config.block_size))
            }
            _ => None,
        };
        let decisions: Vec<&Decision> = match &chosen {
            Chosen::Regular(d) | Chosen::Pd(PdDecision::DecodeOnly(d)) => vec![d],
            Chosen::Pd(PdDecision::Split { prefill, decode }) => vec![decode, prefill],
        };
        let deltas: Vec<Delta> = decisions
            .iter()
            .filter(|d| !d.blocks.is_empty())
            .map(|d| Delta { worker: d.worker, evict: false, from_cp: false, hashes: d.blocks.clone() })
            .collect();
        let counts: Vec<(WorkerId, i32)> = decisions.iter().map(|d| (d.worker, 1)).collect();
        for d in &decisions {
            if self.health.take_probe(store, d.worker, now) {
                log::info!("worker {}: half-open, probing it with one request", d.worker);
            }
        }
        let (counted, seq) = inflight.commit(store, &counts, &self.ended, !deltas.is_empty());
        if counted {
            self.ended_written();
        }
        if let Some(seq) = seq {
            self.log.write(store, seq, &deltas);
        }
        match (&mut self.mode, &chosen) {
            (Mode::Regular(router), Chosen::Regular(d)) => router.commit(d),
            (Mode::Pd(pd), Chosen::Pd(d)) => pd.commit(d),
            // The mode cannot change between deciding and committing (same callback).
            _ => {}
        }
        for d in deltas {
            self.queue_report(d.worker, d.hashes);
        }
        if counted {
            for d in &decisions {
                *self.mine.entry(d.worker).or_default() += 1;
            }
            self.mine_changed = true;
        }
        main.counted = counted;
        let (prefill, merge_logprobs, stream) = match pd {
            Some(p) => (Some(Routed { counted, ..p.prefill }), p.merge_logprobs, p.stream),
            None => (None, false, false),
        };
        Committed { main, prediction, prefill, merge_logprobs, stream }
    }

    /// Where Envoy fails over to when `chosen` fails: the other candidates, least loaded
    /// first (ties in random order), at most `max_attempts - 1` of them.
    fn fallbacks(&mut self, mut cands: Vec<Candidate>, chosen: WorkerId, now: Now) -> Vec<String> {
        let room = (self.config.max_attempts as usize).saturating_sub(1);
        // Only workers whose breaker is closed: Envoy's attempts are not probes the breaker
        // could account for.
        cands.retain(|c| c.id != chosen && self.health.state(c.id, now) == BreakerState::Closed);
        if room == 0 || cands.is_empty() {
            return Vec::new();
        }
        let start = (self.rng.next_u32() as usize) % cands.len();
        cands.rotate_left(start);
        cands.sort_by_key(|c| c.load);
        cands.iter().take(room).filter_map(|c| self.table.get(c.id)).map(|w| w.addr.clone()).collect()
    }

    /// The worker at `addr` (`ip:port`, as Envoy reports the upstream it used).
    pub fn worker_at(&self, addr: &str) -> Option<WorkerId> {
        self.table.iter().find(|w| w.addr == addr).map(|w| w.id)
    }

    /// Routes a request on another path (models, health, info) to any available worker (a
    /// decode worker in PD mode). Not counted, nothing to commit.
    pub fn route_other(&mut self, store: &dyn SharedStore, now: Now) -> Result<(Routed, Vec<String>), Reply> {
        self.sync_table(store);
        let role = if matches!(self.mode, Mode::Pd(_)) { Role::Decode } else { Role::Regular };
        let (cands, _) = candidates(self, &Inflight::load(store).discount(&self.ended), role, now, Probes::Refused);
        let pos = match &mut self.mode {
            Mode::Regular(r) => r.route_any(&cands, &mut self.rng),
            Mode::Pd(pd) => pd.decode_router().route_any(&cands, &mut self.rng),
        };
        let routed = pos
            .and_then(|p| cands.get(p))
            .and_then(|c| self.routed(c.id, 0))
            .ok_or_else(|| Reply::no_worker("worker"))?;
        let fallbacks = self.fallbacks(cands, routed.worker, now);
        Ok((routed, fallbacks))
    }

    /// A counted leg that never ran to its end (a prefill callout cancelled with its stream):
    /// off the in-flight table, not counted as finished (see [`Gateway::finish`] for when).
    pub fn release(&mut self, store: &dyn SharedStore, routed: &Routed) {
        if routed.counted {
            self.ended.entry(routed.worker).or_default().left += 1;
            self.write_ended_unless_alone(store);
        }
    }

    /// The stream of a counted request ended (completed, failed or reset): written at once
    /// when other VMs route too; by a VM alone, with its next commit or tick (its own
    /// decisions discount it until then).
    pub fn finish(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool) {
        if routed.counted {
            let e = self.ended.entry(routed.worker).or_default();
            e.left += 1;
            e.finished += 1;
            e.failed += u32::from(!ok);
            self.write_ended_unless_alone(store);
        }
    }

    fn write_ended_unless_alone(&mut self, store: &dyn SharedStore) {
        if !self.alone {
            self.write_ended(store);
        }
    }

    /// Writes the requests that ended here since the last write (on the tick: when no request
    /// was routed since, nothing else would).
    pub fn write_ended(&mut self, store: &dyn SharedStore) {
        if !self.ended.is_empty() && Inflight::end(store, &self.ended) {
            self.ended_written();
        }
    }

    /// The ended requests are in [`Inflight`] now: no longer this VM's there either.
    fn ended_written(&mut self) {
        for (worker, e) in std::mem::take(&mut self.ended) {
            if let Some(n) = self.mine.get_mut(&worker) {
                *n = n.saturating_sub(e.left);
                if *n == 0 {
                    self.mine.remove(&worker);
                }
                self.mine_changed = true;
            }
        }
    }

    /// On the tick: publishes what this VM has in flight (when it changed, and at least once a
    /// second as a heartbeat), and takes back the counts of VMs that died (see [`VmLedger`]).
    pub fn heartbeat(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let due = now_ms.saturating_sub(self.last_heartbeat_ms) >= 1_000;
        if due {
            let only_me = VmLedger::register(store, self.vm_id()) == [self.vm_id()];
            self.alone = only_me && self.only_me;
            self.only_me = only_me;
        }
        if self.mine_changed || due {
            let counts: Vec<(WorkerId, u32)> = self.mine.iter().map(|(&w, &n)| (w, n)).collect();
            VmLedger::publish(store, self.vm_id(), now_ms, &counts);
            self.mine_changed = false;
        }
        if due {
            self.last_heartbeat_ms = now_ms;
            for (worker, n) in VmLedger::reap(store, self.vm_id(), now_ms) {
                log::warn!("a VM that died had {n} requests in flight to worker {worker}: taken back");
                Inflight::add(store, worker, -i32::try_from(n).unwrap_or(i32::MAX));
            }
        }
    }

    /// A request went to `worker` (the stall window starts if it held none).
    pub fn sent(&mut self, worker: WorkerId, now_ms: u64) {
        self.stalls.sent(worker, now_ms);
    }

    /// A request to `worker` ended; `answered`: the worker itself answered.
    pub fn ended(&mut self, worker: WorkerId, answered: bool, now_ms: u64) {
        self.stalls.ended(worker, answered, now_ms);
    }

    /// A request to `routed`'s worker succeeded or failed (at `now`): its circuit breaker
    /// learns it. Only what the worker did counts (see `request.rs`'s `Verdict`): a
    /// 4xx is a success, Envoy's own refusals and clients that went away are not reported.
    pub fn outcome(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool, now: Now) {
        self.record_outcome(store, routed.worker, ok, now);
    }

    /// What a request did to `worker` (`ok`: not a failure of the worker's), at `now`.
    pub fn record(&mut self, store: &dyn SharedStore, worker: WorkerId, ok: bool, now: Now) {
        self.record_outcome(store, worker, ok, now);
    }

    /// A failure of `worker` learned without a [`Routed`] (an attempt Envoy retried on
    /// another worker, say), at `now`: counts against its circuit breaker.
    pub fn worker_failed(&mut self, store: &dyn SharedStore, worker: WorkerId, now: Now) {
        self.record_outcome(store, worker, false, now);
    }

    fn record_outcome(&mut self, store: &dyn SharedStore, worker: WorkerId, ok: bool, now: Now) {
        let Some((from, to)) = self.health.record(store, worker, ok, now) else { return };
        let addr = self.table.get(worker).map_or("?", |w| w.addr.as_str());
        match to {
            BreakerState::Open => log::warn!(
                "worker {addr}: circuit breaker open ({} from {}); out of rotation for {} s",
                if from == BreakerState::HalfOpen { "its probe failed" } else { "failures" },
                from.name(),
                self.health.params().timeout_ms / 1000
            ),
            _ => log::info!("worker {addr}: circuit breaker {} (was {})", to.name(), from.name()),
        }
    }

    /// A request that `from` failed was sent again to another worker: counted per worker
    /// (cumulative, reported to the control plane as `WorkerCounts.failovers`).
    pub fn failover(&mut self, store: &dyn SharedStore, from: WorkerId) {
        self.health.count_failover(store, from);
    }

    /// `worker`'s circuit breaker at `now`, as this VM sees it.
    pub fn breaker_state(&self, worker: WorkerId, now: Now) -> BreakerState {
        self.health.state(worker, now)
    }

    /// Periodic work: the circuit breakers as the other VMs left them, and LRU eviction every
    /// `eviction_interval_secs`. Returns the number of blocks evicted when that ran.
    ///
    /// With a control plane, evictions come from it (its global LRU, as deltas), so that every
    /// gateway forgets the same blocks; locally the index is only capped, at
    /// [`CONTROL_PLANE_EVICTION_CAP`] times `max_tree_size`, in case the control plane is away.
    pub fn tick(&mut self, store: &dyn SharedStore, now_secs: u64) -> Option<usize> {
        self.health.sync(store);
        if self.last_eviction_secs == 0 {
            self.last_eviction_secs = now_secs;
        }
        if now_secs.saturating_sub(self.last_eviction_secs) < self.config.eviction_interval_secs {
            return None;
        }
        self.last_eviction_secs = now_secs;
        let factor = if self.config.control_plane_cluster.is_some() { CONTROL_PLANE_EVICTION_CAP } else { 1 };
        Some(match &mut self.mode {
            Mode::Regular(r) => r.evict_to_multiple(factor).len(),
            Mode::Pd(pd) => {
                pd.prefill_router().evict_to_multiple(factor).len() + pd.decode_router().evict_to_multiple(factor).len()
            }
        })
    }

    /// The regular router's index (tests).
    #[cfg(test)]
    pub fn regular_index(&self) -> Option<&kvmesh_core::index::PrefixIndex> {
        match &self.mode {
            Mode::Regular(r) => Some(r.index()),
            Mode::Pd(_) => None,
        }
    }

    pub fn index_len(&mut self) -> usize {
        match &mut self.mode {
            Mode::Regular(r) => r.index().len(),
            Mode::Pd(pd) => pd.prefill_router().index().len() + pd.decode_router().index().len(),
        }
    }
}

/// Whether a client-sent request header could steer routing and must be dropped.
pub fn is_routing_header(name: &str) -> bool {
    // Every request header passes here: no allocation.
    name.eq_ignore_ascii_case("x-envoy-original-dst-host")
        || name.eq_ignore_ascii_case("x-gateway-destination-endpoint")
        || name.get(..9).is_some_and(|p| p.eq_ignore_ascii_case("x-kvmesh-"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    fn req(g: &mut Gateway, store: &FakeStore, endpoint: Endpoint, body: &[u8]) -> Outcome {
        g.route_request(
            store,
            endpoint,
            body,
            &RequestInfo { request_id: Some("rq-1"), routing_key: None, headers: None, now: Now::from_secs(1000) },
        )
    }

    fn plan(o: Outcome) -> Plan {
        match o {
            Outcome::Route(p) => p,
            Outcome::Reply(r) => panic!("expected a route, got {} {}", r.status, String::from_utf8_lossy(&r.body)),
        }
    }

    /// Decides and commits, as the filter does when applying the plan worked.
    fn route(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> Committed {
        let p = plan(req(g, store, Endpoint::Generate, body));
        g.commit(store, p)
    }

    fn routed(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> Routed {
        let c = route(g, store, body);
        assert!(c.prefill.is_none(), "expected one leg, got a PD split");
        c.main
    }

    fn reply(o: Outcome) -> Reply {
        match o {
            Outcome::Reply(r) => r,
            Outcome::Route(p) => panic!("expected a reply, routed to {}", p.addr()),
        }
    }

    fn gateway(store: &FakeStore, extra: &str) -> Gateway {
        let json = format!(
            r#"{{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"]{extra}}}"#
        );
        let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 42);
        g.set_reporting(true);
        g
    }

    fn body(text: &str) -> Vec<u8> {
        format!(r#"{{"text":"{text}"}}"#).into_bytes()
    }

    #[test]
    fn consistent_hashing_keys_come_from_the_headers_then_the_body_field() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","policy":"consistent_hashing","routing_key_body_field":"user""#);
        let hdr = |v: &str| Headers::from_pairs([("X-Session-Id", v.as_bytes())]);
        assert_eq!(g.routing_key(&hdr("s1")).as_deref(), Some("s1"), "a default header, any case");
        assert_eq!(g.routing_key(&hdr("")), None);
        assert_eq!(g.routing_key(&hdr(&"k".repeat(MAX_ROUTING_KEY + 1))), None, "too long");
        let owner = |g: &mut Gateway, key: Option<&str>, body: &[u8]| {
            let info = RequestInfo { request_id: None, routing_key: key, headers: None, now: Now::from_secs(1000) };
            let p = plan(g.route_request(&store, Endpoint::Generate, body, &info));
            g.commit(&store, p).main.addr
        };
        for key in ["alice", "bob", "carol", "dave"] {
            let first = owner(&mut g, Some(key), &body("one prompt"));
            for i in 0..5 {
                assert_eq!(owner(&mut g, Some(key), &body(&format!("other prompt {i}"))), first, "{key}");
            }
            // The same key in the body field when no header gives one.
            let in_body = format!(r#"{{"text":"x","user":"{key}"}}"#);
            assert_eq!(owner(&mut g, None, in_body.as_bytes()), first, "{key} from the body");
        }
        let spread: std::collections::HashSet<String> =
            (0..24).map(|i| owner(&mut g, Some(&format!("user-{i}")), &body("p"))).collect();
        assert_eq!(spread.len(), 3, "keys spread over every worker");
        // No key captured at the headers (the VM did not know yet): the headers are read again.
        let first = owner(&mut g, Some("erin"), &body("p"));
        let fetch = || Headers::from_pairs([("x-smg-routing-key", &b"erin"[..])]);
        for _ in 0..5 {
            let info =
                RequestInfo { request_id: None, routing_key: None, headers: Some(&fetch), now: Now::from_secs(1000) };
            let p = plan(g.route_request(&store, Endpoint::Generate, &body("q"), &info));
            assert_eq!(g.commit(&store, p).main.addr, first);
        }
        // Another policy keeps no key.
        let g = gateway(&store, "");
        assert_eq!(g.routing_key(&hdr("s1")), None);
    }

    #[test]
    fn shared_prefix_sticks_and_inflight_is_tracked() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        let prefix = "p".repeat(400);
        g.heartbeat(&store, 1_000); // registered, and the Envoy's only VM two heartbeats running
        g.heartbeat(&store, 2_000);
        let first = routed(&mut g, &store, &body(&format!("{prefix}a")));
        assert!(first.counted);
        let again = routed(&mut g, &store, &body(&format!("{prefix}b")));
        assert_eq!(again.addr, first.addr);
        assert!(again.matched_bytes >= 384);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
        g.finish(&store, &first, true);
        g.finish(&store, &again, false);
        // Ending touches no shared data: the next commit writes the ends with its own count.
        assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
        let third = routed(&mut g, &store, &body(&format!("{prefix}c")));
        assert_eq!(third.addr, first.addr);
        let c = Inflight::counts(&store);
        assert_eq!((c[0].in_flight, c[0].finished, c[0].failed), (1, 2, 1));
        // With no request to carry them, the tick writes them.
        g.finish(&store, &third, true);
        g.write_ended(&store);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 0)]);
        // With another VM, an end is written at once: it would count it as load meanwhile.
        let mut other = Gateway::new(g.config().clone(), &store, 7);
        other.heartbeat(&store, 1_000);
        g.heartbeat(&store, 3_000);
        let fourth = routed(&mut g, &store, &body(&format!("{prefix}d")));
        g.finish(&store, &fourth, true);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 0)]);
    }

    #[test]
    fn a_vms_own_ended_requests_count_at_once_in_its_decisions() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        g.heartbeat(&store, 1_000);
        g.heartbeat(&store, 2_000);
        let held = routed(&mut g, &store, &body(&"x".repeat(400)));
        g.finish(&store, &held, true);
        let p = plan(req(&mut g, &store, Endpoint::Generate, &body(&"y".repeat(400))));
        assert_eq!(p.inflight.count(held.worker), 0, "not written yet, but not counted as load");
        assert_eq!(Inflight::read(&store), vec![(held.worker, 1)]);
    }

    #[test]
    fn a_plan_that_is_not_committed_leaves_no_trace() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","control_plane_cluster":"cp""#);
        let text = body(&"u".repeat(400));
        let p = plan(req(&mut g, &store, Endpoint::Generate, &text));
        drop(p); // e.g. the destination header could not be set: a local reply instead
        assert_eq!(g.index_len(), 0, "no phantom index entry");
        assert!(Inflight::read(&store).is_empty(), "nothing counted");
        assert_eq!(Inflight::load(&store).head(), 0, "nothing in the delta log for the other VMs");
        assert!(g.take_report(&store, "gw", Now::default()).inserts.is_empty(), "nothing reported");
        let c = route(&mut g, &store, &text);
        assert!(c.main.counted && g.index_len() > 0);
        assert_eq!(g.take_report(&store, "gw", Now::default()).inserts.len(), 1);
    }

    #[test]
    fn the_requests_of_a_vm_that_died_do_not_stay_in_flight() {
        let store = FakeStore::default();
        let mut a = gateway(&store, "");
        // a has been the Envoy's only VM for two heartbeats: it keeps its ends.
        a.heartbeat(&store, 1_000);
        a.heartbeat(&store, 2_000);
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        b.heartbeat(&store, 2_000);
        assert!(a.alone && !b.alone, "b just came: a learns of it at its next heartbeat");
        let mut on_b = Vec::new();
        for i in 0..3 {
            routed(&mut a, &store, &body(&format!("on a {i}")));
            on_b.push(routed(&mut b, &store, &body(&format!("on b {i}"))));
        }
        let total = |s: &FakeStore| Inflight::counts(s).iter().map(|c| c.in_flight).sum::<u32>();
        assert_eq!(total(&store), 6);
        // One of a's requests ended, not written when a dies: a's ledger still counts it.
        let ended_on_a = routed(&mut a, &store, &body("on a, ended"));
        a.finish(&store, &ended_on_a, true);
        a.heartbeat(&store, 2_500); // publishes what a has in flight (not a registry check)
        b.heartbeat(&store, 2_500);
        assert_eq!(total(&store), 7);
        drop(a); // trapped: its streams never reach on_log
        for t in (3_000..=12_000).step_by(1_000) {
            b.heartbeat(&store, t);
            assert_eq!(total(&store), 7, "not before the heartbeat is stale ({t} ms)");
        }
        b.heartbeat(&store, 13_000);
        assert_eq!(total(&store), 3, "a's four are taken back, b's stay");
        for r in &on_b {
            b.finish(&store, r, true);
        }
        assert_eq!(total(&store), 0, "b is not alone: its ends are written at once");
    }

    #[test]
    fn vms_that_start_together_never_take_themselves_for_alone() {
        let store = FakeStore::default();
        let mut a = gateway(&store, "");
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        // a registers a moment before b: alone at that check, but not at the next.
        a.heartbeat(&store, 1_000);
        b.heartbeat(&store, 1_001);
        assert!(!a.alone && !b.alone);
        a.heartbeat(&store, 2_000);
        b.heartbeat(&store, 2_001);
        assert!(!a.alone && !b.alone);
        // A VM on its own is, from its second heartbeat.
        let lone_store = FakeStore::default();
        let mut c = gateway(&lone_store, "");
        c.heartbeat(&lone_store, 1_000);
        assert!(!c.alone);
        c.heartbeat(&lone_store, 2_000);
        assert!(c.alone);
    }

    #[test]
    fn another_vm_sees_the_prefix() {
        let store = FakeStore::default();
        let mut a = gateway(&store, "");
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        let prefix = "q".repeat(400);
        let on_a = routed(&mut a, &store, &body(&format!("{prefix}1")));
        let on_b = routed(&mut b, &store, &body(&format!("{prefix}2")));
        assert_eq!(on_a.addr, on_b.addr);
    }

    #[test]
    fn bad_requests_get_json_errors_and_do_not_count() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_payload_size":64"#);
        let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text": 5}"#));
        assert_eq!(r.status, 400);
        assert!(String::from_utf8_lossy(&r.body).contains("`text`"));
        assert_eq!(reply(req(&mut g, &store, Endpoint::Generate, b"{")).status, 400);
        assert_eq!(reply(req(&mut g, &store, Endpoint::Generate, &[b' '; 100])).status, 413);
        assert_eq!(g.check_length(Some(65)).map(|r| r.status), Some(413));
        assert_eq!(g.check_length(Some(64)), None);
        assert!(Inflight::read(&store).is_empty());
    }

    #[test]
    fn no_workers_is_503_with_retry_after() {
        let store = FakeStore::default();
        let mut g = Gateway::new(Config::default(), &store, 1);
        let r = reply(req(&mut g, &store, Endpoint::Generate, &body("x")));
        assert_eq!((r.status, r.retry_after), (503, Some(1)));
        assert_eq!(g.route_other(&store, Now::from_secs(0)).map(|r| r.0.addr), Err(Reply::no_worker("worker")));
    }

    #[test]
    fn other_paths_spread_over_the_workers_uncounted() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..60 {
            let (r, fallbacks) = g.route_other(&store, Now::from_secs(0)).unwrap();
            assert!(!r.counted);
            assert_eq!(fallbacks.len(), 2, "the two other workers to fail over to");
            assert!(!fallbacks.contains(&r.addr));
            seen.insert(r.addr);
        }
        let all: std::collections::BTreeSet<String> =
            ["127.0.0.1:30001", "127.0.0.1:30002", "127.0.0.1:30003"].iter().map(|s| s.to_string()).collect();
        assert_eq!(seen, all);
        assert!(Inflight::read(&store).is_empty(), "other paths are not counted");
    }

    #[test]
    fn overloaded_workers_are_passed_over_and_all_overloaded_is_a_503() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","overload_waiting_requests":8,"overload_kv_usage":0.8"#);
        g.table.workers[0].waiting = Some(9);
        g.table.workers[1].kv_usage = Some(0.95);
        g.table.workers[2].waiting = Some(8); // at the threshold, not past it
        for i in 0..20 {
            let r = routed(&mut g, &store, &body(&format!("text {i}")));
            assert_eq!(r.worker, 2, "the only worker with room");
        }
        g.table.workers[2].kv_usage = Some(0.81);
        let r = reply(req(&mut g, &store, Endpoint::Generate, &body("one more")));
        assert_eq!((r.status, r.retry_after), (503, Some(1)));
        assert!(String::from_utf8_lossy(&r.body).contains("overloaded"));
        assert!(g.route_other(&store, Now::from_secs(0)).is_ok(), "read-only paths are not shed");
        // Thresholds at 0 are off.
        let mut g = gateway(&store, r#","overload_waiting_requests":0,"overload_kv_usage":0"#);
        g.table.workers.iter_mut().for_each(|w| (w.waiting, w.kv_usage) = (Some(1000), Some(1.0)));
        routed(&mut g, &store, &body("fine"));
    }

    #[test]
    fn loaded_workers_are_avoided() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","balance_abs_threshold":2"#);
        let prefix = "z".repeat(400);
        let first = routed(&mut g, &store, &body(&format!("{prefix}0")));
        for i in 1..3 {
            let r = routed(&mut g, &store, &body(&format!("{prefix}{i}")));
            assert_eq!(r.worker, first.worker);
        }
        // Three in flight on one worker, none elsewhere: imbalanced past abs threshold 2.
        let r = routed(&mut g, &store, &body(&format!("{prefix}3")));
        assert_ne!(r.worker, first.worker);
    }

    #[test]
    fn eviction_runs_on_its_interval() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10"#);
        routed(&mut g, &store, &body(&"e".repeat(320)));
        assert_eq!(g.index_len(), 20);
        assert_eq!(g.tick(&store, 100), None);
        assert_eq!(g.tick(&store, 105), None);
        assert_eq!(g.tick(&store, 110), Some(16));
        assert_eq!(g.index_len(), 4);
    }

    #[test]
    fn with_a_control_plane_local_eviction_is_only_a_cap() {
        let store = FakeStore::default();
        let mut g = gateway(
            &store,
            r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10,"control_plane_cluster":"cp""#,
        );
        routed(&mut g, &store, &body(&"e".repeat(320)));
        g.tick(&store, 100);
        assert_eq!(g.tick(&store, 110), Some(12), "down to 2 x max_tree_size, not to it");
        assert_eq!(g.index_len(), 8);
    }

    fn pd_gateway(store: &FakeStore, extra: &str) -> Gateway {
        let json = format!(
            r#"{{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998],["http://127.0.0.1:30002","none"]],
                "decode":["http://127.0.0.1:30003","http://127.0.0.1:30004"],"cb_failure_threshold":1{extra}}}"#
        );
        Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 5)
    }

    /// A PD split, committed: the legs and the body both receive.
    fn split(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> (Committed, Vec<u8>) {
        let p = plan(req(g, store, Endpoint::Generate, body));
        let sent = p.pd().map(|pd| pd.body.clone()).expect("a PD split");
        let c = g.commit(store, p);
        assert!(c.prefill.is_some());
        (c, sent)
    }

    #[test]
    fn pd_split_injects_bootstrap_and_counts_both_legs() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let (c, sent) = split(&mut g, &store, br#"{"text":["a","b","c"],"return_logprob":true}"#);
        let prefill = c.prefill.unwrap();
        assert!(prefill.addr.ends_with(":30001") || prefill.addr.ends_with(":30002"));
        assert!(c.main.addr.ends_with(":30003") || c.main.addr.ends_with(":30004"));
        assert!(c.merge_logprobs && !c.stream);
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        let rooms = v["bootstrap_room"].as_array().unwrap();
        assert_eq!(rooms.len(), 3);
        assert!(rooms[0] != rooms[1] && rooms[1] != rooms[2]);
        assert_eq!(v["bootstrap_host"][2], "127.0.0.1");
        let expected_port =
            if prefill.addr.ends_with(":30001") { serde_json::json!(8998) } else { serde_json::Value::Null };
        assert_eq!(v["bootstrap_port"][0], expected_port);
        assert_eq!(v["rid"], serde_json::json!(["rq-1-0", "rq-1-1", "rq-1-2"]));
        let mut counts = Inflight::read(&store);
        counts.sort();
        let mut expected = vec![(prefill.worker, 1), (c.main.worker, 1)];
        expected.sort();
        assert_eq!(counts, expected);
    }

    /// Decides at `now` (seconds) and commits: the worker, or the status of the local reply.
    fn route_at(g: &mut Gateway, store: &FakeStore, text: &str, now: u64) -> Result<Routed, u16> {
        let info = RequestInfo { request_id: None, routing_key: None, headers: None, now: Now::from_secs(now) };
        match g.route_request(store, Endpoint::Generate, &body(text), &info) {
            Outcome::Route(p) => Ok(g.commit(store, p).main),
            Outcome::Reply(r) => Err(r.status),
        }
    }

    #[test]
    fn a_failing_worker_is_opened_probed_and_closed_on_every_vm() {
        let store = FakeStore::default();
        let cb =
            r#","policy":"round_robin","cb_failure_threshold":3,"cb_success_threshold":2,"cb_timeout_duration_secs":5"#;
        let mut a = gateway(&store, cb);
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        let bad = routed(&mut a, &store, &body("x"));
        // Three failures, seen on two VMs, open it for both.
        a.outcome(&store, &bad, false, Now::from_secs(100));
        b.outcome(&store, &bad, false, Now::from_secs(100));
        assert_eq!(a.breaker_state(bad.worker, Now::from_secs(100)), BreakerState::Closed);
        b.worker_failed(&store, bad.worker, Now::from_secs(101));
        assert_eq!(b.breaker_state(bad.worker, Now::from_secs(101)), BreakerState::Open);
        a.tick(&store, 101);
        for g in [&mut a, &mut b] {
            for i in 0..12 {
                assert_ne!(route_at(g, &store, &format!("q{i}"), 105).unwrap().worker, bad.worker, "open until 106");
            }
        }
        // Half-open: exactly one request, on one VM, probes it.
        let mut probes = Vec::new();
        for i in 0..12 {
            for g in [&mut a, &mut b] {
                let r = route_at(g, &store, &format!("p{i}"), 106).unwrap();
                if r.worker == bad.worker {
                    probes.push(r);
                }
            }
        }
        assert_eq!(probes.len(), 1, "one probe at a time across the VMs");
        assert_eq!(
            a.route_other(&store, Now::from_secs(106)).map(|r| r.0.worker == bad.worker),
            Ok(false),
            "other paths never probe"
        );
        // It answers: the slot is free again; a second success closes it.
        a.outcome(&store, &probes[0], true, Now::from_secs(107));
        b.tick(&store, 107);
        let second = (0..6)
            .find_map(|i| route_at(&mut b, &store, &format!("s{i}"), 107).ok().filter(|r| r.worker == bad.worker));
        let second = second.expect("a second probe");
        b.outcome(&store, &second, true, Now::from_secs(108));
        assert_eq!(b.breaker_state(bad.worker, Now::from_secs(108)), BreakerState::Closed);
        a.tick(&store, 108);
        let back =
            (0..9).filter(|i| route_at(&mut a, &store, &format!("c{i}"), 108).unwrap().worker == bad.worker).count();
        assert_eq!(back, 3, "round robin over all three again");
    }

    #[test]
    fn a_failed_probe_opens_it_again() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","cb_failure_threshold":1,"cb_timeout_duration_secs":5"#);
        let bad = routed(&mut g, &store, &body("x"));
        g.outcome(&store, &bad, false, Now::from_secs(100));
        let probe = (0..30)
            .find_map(|i| route_at(&mut g, &store, &format!("p{i}"), 105).ok().filter(|r| r.worker == bad.worker));
        g.outcome(&store, &probe.expect("a probe"), false, Now::from_secs(106));
        assert_eq!(g.breaker_state(bad.worker, Now::from_secs(110)), BreakerState::Open, "for another 5 s from 106");
        assert_eq!(g.breaker_state(bad.worker, Now::from_secs(111)), BreakerState::HalfOpen);
    }

    #[test]
    fn breakers_keep_time_to_the_millisecond() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","cb_failure_threshold":1,"cb_timeout_duration_secs":5"#);
        let w = routed(&mut g, &store, &body("x"));
        g.outcome(&store, &w, false, Now::from_ms(100_900));
        assert_eq!(g.breaker_state(w.worker, Now::from_ms(105_899)), BreakerState::Open);
        assert_eq!(g.breaker_state(w.worker, Now::from_ms(105_900)), BreakerState::HalfOpen);
        assert_eq!(Now::from_nanos(1_234_567_890).ms(), 1_234);
    }

    #[test]
    fn client_errors_and_disabled_breakers_never_take_a_worker_out() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","cb_failure_threshold":1"#);
        let w = routed(&mut g, &store, &body("x"));
        // The filter reports a 4xx as a success (the worker answered).
        for t in 0..100 {
            g.outcome(&store, &w, true, Now::from_secs(t));
        }
        assert_eq!(g.breaker_state(w.worker, Now::from_secs(100)), BreakerState::Closed);
        let mut off = gateway(&store, r#","cb_failure_threshold":1,"disable_circuit_breaker":true"#);
        for t in 0..100 {
            off.outcome(&store, &w, false, Now::from_secs(t));
        }
        assert!((0..30).any(|i| route_at(&mut off, &store, &format!("d{i}"), 100).unwrap().worker == w.worker));
    }

    #[test]
    fn when_every_worker_is_open_the_answer_is_503() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","cb_failure_threshold":1"#);
        for port in 1..=3 {
            let w = g.table.workers.iter().find(|w| w.addr.ends_with(&format!(":3000{port}"))).unwrap().id;
            g.worker_failed(&store, w, Now::from_secs(100));
        }
        assert_eq!(route_at(&mut g, &store, "x", 101).unwrap_err(), 503);
        assert_eq!(g.route_other(&store, Now::from_secs(101)).unwrap_err().status, 503);
    }

    #[test]
    fn reports_carry_breaker_states_and_failovers() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","cb_failure_threshold":1,"control_plane_cluster":"cp""#);
        let w = routed(&mut g, &store, &body("x"));
        g.failover(&store, w.worker);
        g.failover(&store, w.worker);
        g.worker_failed(&store, w.worker, Now::from_secs(100));
        let other = g.table.workers.iter().map(|w| w.id).find(|&id| id != w.worker).unwrap();
        g.failover(&store, other); // a worker with no request counts yet
        g.failover(&store, 99); // not in the table: not reported
        let report = g.take_report(&store, "gw", Now::from_ms(100_500));
        let c = report.counts.iter().find(|c| c.worker == w.worker).unwrap();
        assert_eq!((c.breaker(), c.failovers, c.in_flight), (kvmesh_proto::v1::BreakerState::Open, 2, 1));
        let o = report.counts.iter().find(|c| c.worker == other).unwrap();
        assert_eq!((o.breaker(), o.failovers, o.requests), (kvmesh_proto::v1::BreakerState::Closed, 1, 0));
        assert!(report.counts.iter().all(|c| c.worker != 99));
        let later = g.take_report(&store, "gw", Now::from_ms(200_000));
        let c = later.counts.iter().find(|c| c.worker == w.worker).unwrap();
        assert_eq!(c.breaker(), kvmesh_proto::v1::BreakerState::HalfOpen);
    }

    #[test]
    fn pd_failed_prefill_is_avoided_next_time() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let text = format!(r#"{{"text":"{}"}}"#, "s".repeat(300));
        let (first, _) = split(&mut g, &store, text.as_bytes());
        let failed = first.prefill.unwrap();
        g.outcome(&store, &failed, false, Now::from_secs(1000));
        for _ in 0..10 {
            let (next, _) = split(&mut g, &store, text.as_bytes());
            assert_ne!(next.prefill.unwrap().worker, failed.worker, "the failed prefill worker is out of rotation");
        }
    }

    #[test]
    fn pd_without_decode_workers_is_503_naming_the_role() {
        let store = FakeStore::default();
        let json = r#"{"pd_disaggregation":true,"prefill":["http://127.0.0.1:1"]}"#;
        let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), &store, 1);
        let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text":"x"}"#));
        assert_eq!(r.status, 503);
        assert!(String::from_utf8_lossy(&r.body).contains("decode worker"));
        assert!(Inflight::read(&store).is_empty());
    }

    #[test]
    fn pd_other_paths_go_to_decode_workers() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        for _ in 0..10 {
            let (r, fallbacks) = g.route_other(&store, Now::from_secs(0)).unwrap();
            assert!(r.addr.ends_with(":30003") || r.addr.ends_with(":30004"));
            assert_eq!(fallbacks.len(), 1, "the other decode worker, never a prefill worker");
            assert!(fallbacks.iter().all(|a| (a.ends_with(":30003") || a.ends_with(":30004")) && *a != r.addr));
        }
    }

    #[test]
    fn pd_bad_batches_are_refused_before_anything_is_counted() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text":["a","b"],"sampling_params":[{}]}"#));
        assert_eq!(r.status, 400);
        assert!(String::from_utf8_lossy(&r.body).contains("`sampling_params`"));
        assert!(Inflight::read(&store).is_empty());
        assert_eq!(g.index_len(), 0);
    }

    #[test]
    fn routing_headers_are_recognised() {
        for h in ["x-envoy-original-dst-host", "X-Gateway-Destination-Endpoint", "x-kvmesh-worker", "x-kvmesh-anything"]
        {
            assert!(is_routing_header(h), "{h}");
        }
        for h in ["x-request-id", "content-type", "x-envoy-expected-rq-timeout-ms"] {
            assert!(!is_routing_header(h), "{h}");
        }
    }
}
