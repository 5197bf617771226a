//! The filter's request logic, independent of proxy-wasm: what to do with a request given its
//! path, its body and the shared state. `http.rs` translates host callbacks into these calls.

use kvmesh_core::bootstrap::{random_rooms, Bootstrap};
use kvmesh_core::errors::error_json;
use kvmesh_core::pd::{PdDecision, PdRouter};
use kvmesh_core::policy::Candidate;
use kvmesh_core::request::{self, RequestError};
use kvmesh_core::rng::{random_u64, seeded, FastRng, RngCore};
use kvmesh_core::{Config, Decision, Endpoint, Role, Router, WorkerId, WorkerTable};

use crate::health::Health;
use crate::shared::{Delta, DeltaLog, Inflight, SharedStore};

/// What the filter does with a request.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Send it to one worker.
    Route(Routed),
    /// PD: send the rewritten body to the decode worker and, at the same time, to the
    /// prefill worker as a callout.
    Pd(PdRouted),
    /// Answer locally with a JSON error.
    Reply(Reply),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub worker: WorkerId,
    pub addr: String,
    /// Whether it was added to the in-flight table (and must be taken off when done).
    pub counted: bool,
    /// Bytes of the routing text the worker was believed to hold already.
    pub matched_bytes: usize,
}

#[derive(Debug, PartialEq)]
pub struct PdRouted {
    pub decode: Routed,
    pub prefill: Routed,
    /// The body both legs receive (bootstrap fields and `rid` injected).
    pub body: Vec<u8>,
    /// Whether the prefill's input logprobs must be merged into the decode response.
    pub merge_logprobs: bool,
    pub stream: bool,
}

#[derive(Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    /// Seconds for a `retry-after` header.
    pub retry_after: Option<u32>,
}

impl Reply {
    pub fn error(status: u16, code: &str, message: &str) -> Self {
        Self { status, body: error_json(status, code, message), retry_after: None }
    }

    fn request(e: &RequestError) -> Self {
        Self::error(e.status(), e.code(), &e.to_string())
    }

    fn no_worker(what: &str) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::error(503, "no_healthy_worker", &format!("no healthy {what} is available"))
        }
    }
}

/// Per-request facts from the host.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestInfo<'a> {
    /// The request id (`x-request-id`), used as `rid` in PD bodies when the client set none.
    pub request_id: Option<&'a str>,
    /// Seconds since the epoch.
    pub now_secs: u64,
}

enum Mode {
    Regular(Router),
    Pd(PdRouter),
}

mod sync;

pub use sync::table_from;

/// Most index inserts held for the next report (older ones are dropped first).
const REPORT_QUEUE: usize = 16_384;

/// The available workers of `role` with their loads: the table's plus this Envoy's in-flight
/// counts.
fn candidates(table: &WorkerTable, health: &Health, inflight: &Inflight, role: Role, now: u64) -> Vec<Candidate> {
    table
        .healthy_with(role)
        .filter(|w| health.available(w.id, now))
        .map(|w| Candidate { id: w.id, load: w.load + u64::from(inflight.count(w.id)) })
        .collect()
}

/// One VM's routing state.
pub struct Gateway {
    /// The plugin configuration as given (the control plane's policy is merged over it).
    base: serde_json::Value,
    config: Config,
    table: WorkerTable,
    mode: Mode,
    rng: FastRng,
    log: DeltaLog,
    health: Health,
    last_eviction_secs: u64,
    /// Index inserts made on this Envoy that the control plane has not been told about.
    unreported: Vec<(WorkerId, Vec<u64>)>,
    /// The control-plane table version this VM applied.
    table_version: Option<u64>,
    policy_json: String,
}

fn build_mode(config: &Config) -> Mode {
    match &config.pd {
        Some(pd) => Mode::Pd(PdRouter::new(config, pd.prefill_policy, pd.decode_policy, pd.decider)),
        None => Mode::Regular(Router::new(config)),
    }
}

impl Gateway {
    pub fn new(config: Config, store: &dyn SharedStore, seed: u64) -> Self {
        Self::with_base(config, serde_json::Value::Null, store, seed)
    }

    /// A gateway that remembers its plugin configuration `base` (JSON), so that a policy
    /// from the control plane can be merged over it.
    pub fn with_base(config: Config, base: serde_json::Value, store: &dyn SharedStore, seed: u64) -> Self {
        Self {
            base,
            table: config.workers.clone(),
            mode: build_mode(&config),
            rng: seeded(seed),
            log: DeltaLog::new(store, seed as u32 ^ (seed >> 32) as u32),
            health: Health::new(config.cb_failure_threshold, config.cb_timeout_duration_secs),
            last_eviction_secs: 0,
            unreported: Vec::new(),
            table_version: None,
            policy_json: String::new(),
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
            if !delta.evict && !delta.from_cp {
                self.queue_report(delta.worker, delta.hashes);
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
        if self.config.control_plane_cluster.is_none() {
            return;
        }
        if self.unreported.len() >= REPORT_QUEUE {
            self.unreported.drain(..REPORT_QUEUE / 2);
        }
        self.unreported.push((worker, hashes));
    }

    /// Counts a routed request (and its other leg) in flight and shares the decisions' new
    /// index blocks with the other VMs: one CAS for both, plus the log slot.
    fn commit(&mut self, store: &dyn SharedStore, state: Inflight, decisions: &[&Decision]) -> bool {
        let deltas: Vec<Delta> = decisions
            .iter()
            .filter(|d| !d.inserted.is_empty())
            .map(|d| Delta { worker: d.worker, evict: false, from_cp: false, hashes: d.inserted.clone() })
            .collect();
        let counts: Vec<(WorkerId, i32)> = decisions.iter().map(|d| (d.worker, 1)).collect();
        let (counted, seq) = state.commit(store, &counts, !deltas.is_empty());
        if let Some(seq) = seq {
            self.log.write(store, seq, &deltas);
        }
        for d in deltas {
            self.queue_report(d.worker, d.hashes);
        }
        counted
    }

    fn routed(&self, d: &Decision, counted: bool) -> Option<Routed> {
        let w = self.table.get(d.worker)?;
        Some(Routed { worker: d.worker, addr: w.addr.clone(), counted, matched_bytes: d.matched_bytes })
    }

    /// Routes an LLM request by its body.
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
        let inflight = Inflight::load(store);
        self.catch_up(store, inflight.head());
        let now = info.now_secs;
        let (table, health) = (&self.table, &self.health);
        let cands = |role| candidates(table, health, &inflight, role, now);
        let decision = match &mut self.mode {
            Mode::Regular(router) => {
                router.route(&parsed.text, &cands(Role::Regular), &mut self.rng).map(PdDecision::DecodeOnly)
            }
            Mode::Pd(pd) => {
                let (prefill, decode) = (cands(Role::Prefill), cands(Role::Decode));
                match pd.route(&parsed.text, &prefill, &decode, &mut self.rng) {
                    Some(d) => Some(d),
                    None if decode.is_empty() => return Outcome::Reply(Reply::no_worker("decode worker")),
                    None => return Outcome::Reply(Reply::no_worker("prefill worker")),
                }
            }
        };
        match decision {
            None => Outcome::Reply(Reply::no_worker("worker")),
            Some(PdDecision::DecodeOnly(d)) => {
                let counted = self.commit(store, inflight, &[&d]);
                self.routed(&d, counted).map_or(Outcome::Reply(Reply::no_worker("worker")), Outcome::Route)
            }
            Some(PdDecision::Split { prefill, decode }) => {
                let Some(p) = self.table.get(prefill.worker) else {
                    return Outcome::Reply(Reply::no_worker("prefill worker"));
                };
                let rng = &mut self.rng;
                let boot = Bootstrap {
                    host: p.host.clone(),
                    port: p.bootstrap_port,
                    rooms: random_rooms(parsed.batch.unwrap_or(1), || random_u64().unwrap_or_else(|_| rng.next_u64())),
                    request_id: info.request_id.map(String::from),
                };
                let new_body = match boot.inject(body, &parsed) {
                    Ok(b) => b,
                    Err(e) => return Outcome::Reply(Reply::request(&e)),
                };
                let counted = self.commit(store, inflight, &[&decode, &prefill]);
                match (self.routed(&decode, counted), self.routed(&prefill, counted)) {
                    (Some(decode), Some(prefill)) => Outcome::Pd(PdRouted {
                        decode,
                        prefill,
                        body: new_body,
                        merge_logprobs: parsed.return_logprob && endpoint == Endpoint::Generate,
                        stream: parsed.stream,
                    }),
                    _ => Outcome::Reply(Reply::no_worker("worker")),
                }
            }
        }
    }

    /// Routes a request on another path (models, health, info) to any available worker (a
    /// decode worker in PD mode).
    pub fn route_other(&mut self, store: &dyn SharedStore, now: u64) -> Outcome {
        self.sync_table(store);
        let role = if matches!(self.mode, Mode::Pd(_)) { Role::Decode } else { Role::Regular };
        let cands = candidates(&self.table, &self.health, &Inflight::load(store), role, now);
        let pos = match &mut self.mode {
            Mode::Regular(r) => r.route_any(&cands, &mut self.rng),
            Mode::Pd(pd) => pd.decode_router().route_any(&cands, &mut self.rng),
        };
        let Some(pos) = pos else { return Outcome::Reply(Reply::no_worker("worker")) };
        let d = Decision { pos, worker: cands[pos].id, reason: None, matched_bytes: 0, inserted: Vec::new() };
        self.routed(&d, false).map_or(Outcome::Reply(Reply::no_worker("worker")), Outcome::Route)
    }

    /// A counted request was never sent (the filter answered instead): uncount it.
    pub fn release(&self, store: &dyn SharedStore, routed: &Routed) {
        if routed.counted {
            Inflight::add(store, routed.worker, -1);
        }
    }

    /// The stream of a counted request ended (completed, failed or reset).
    pub fn finish(&self, store: &dyn SharedStore, routed: &Routed, ok: bool) {
        if routed.counted {
            Inflight::finish(store, routed.worker, !ok);
        }
    }

    /// A request to `routed`'s worker succeeded or failed: passive health.
    pub fn outcome(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool, now: u64) {
        if ok {
            self.health.success(routed.worker);
        } else if self.health.failure(store, routed.worker, now) {
            log::warn!("worker {} taken out of rotation after failures", routed.addr);
        }
    }

    /// Periodic work: breakers opened by other VMs, and LRU eviction every
    /// `eviction_interval_secs`. Returns the number of blocks evicted when that ran.
    pub fn tick(&mut self, store: &dyn SharedStore, now_secs: u64) -> Option<usize> {
        self.health.sync(store);
        if self.last_eviction_secs == 0 {
            self.last_eviction_secs = now_secs;
        }
        if now_secs.saturating_sub(self.last_eviction_secs) < self.config.eviction_interval_secs {
            return None;
        }
        self.last_eviction_secs = now_secs;
        Some(match &mut self.mode {
            Mode::Regular(r) => r.evict().len(),
            Mode::Pd(pd) => pd.prefill_router().evict().len() + pd.decode_router().evict().len(),
        })
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
    let name = name.to_ascii_lowercase();
    name == "x-envoy-original-dst-host" || name == "x-gateway-destination-endpoint" || name.starts_with("x-kvmesh-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    pub trait Req {
        fn req(&mut self, store: &FakeStore, endpoint: Endpoint, body: &[u8]) -> Outcome;
    }

    impl Req for Gateway {
        fn req(&mut self, store: &FakeStore, endpoint: Endpoint, body: &[u8]) -> Outcome {
            self.route_request(store, endpoint, body, &RequestInfo { request_id: Some("rq-1"), now_secs: 1000 })
        }
    }

    fn gateway(store: &FakeStore, extra: &str) -> Gateway {
        let json = format!(
            r#"{{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"]{extra}}}"#
        );
        Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 42)
    }

    fn routed(o: Outcome) -> Routed {
        match o {
            Outcome::Route(r) => r,
            Outcome::Reply(r) => panic!("expected a route, got {} {}", r.status, String::from_utf8_lossy(&r.body)),
            Outcome::Pd(p) => panic!("expected a route, got a PD split {p:?}"),
        }
    }

    fn reply(o: Outcome) -> Reply {
        match o {
            Outcome::Reply(r) => r,
            Outcome::Route(r) => panic!("expected a reply, routed to {}", r.addr),
            Outcome::Pd(p) => panic!("expected a reply, got a PD split {p:?}"),
        }
    }

    fn body(text: &str) -> Vec<u8> {
        format!(r#"{{"text":"{text}"}}"#).into_bytes()
    }

    #[test]
    fn shared_prefix_sticks_and_inflight_is_tracked() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        let prefix = "p".repeat(400);
        let first = routed(g.req(&store, Endpoint::Generate, &body(&format!("{prefix}a"))));
        assert!(first.counted);
        let again = routed(g.req(&store, Endpoint::Generate, &body(&format!("{prefix}b"))));
        assert_eq!(again.addr, first.addr);
        assert!(again.matched_bytes >= 384);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
        g.finish(&store, &first, true);
        g.finish(&store, &again, true);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 0)]);
    }

    #[test]
    fn another_vm_sees_the_prefix() {
        let store = FakeStore::default();
        let mut a = gateway(&store, "");
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        let prefix = "q".repeat(400);
        let on_a = routed(a.req(&store, Endpoint::Generate, &body(&format!("{prefix}1"))));
        let on_b = routed(b.req(&store, Endpoint::Generate, &body(&format!("{prefix}2"))));
        assert_eq!(on_a.addr, on_b.addr);
    }

    #[test]
    fn bad_requests_get_json_errors_and_do_not_count() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_payload_size":64"#);
        let r = reply(g.req(&store, Endpoint::Generate, br#"{"text": 5}"#));
        assert_eq!(r.status, 400);
        assert!(String::from_utf8_lossy(&r.body).contains("`text`"));
        assert_eq!(reply(g.req(&store, Endpoint::Generate, b"{")).status, 400);
        assert_eq!(reply(g.req(&store, Endpoint::Generate, &[b' '; 100])).status, 413);
        assert_eq!(g.check_length(Some(65)).map(|r| r.status), Some(413));
        assert_eq!(g.check_length(Some(64)), None);
        assert!(Inflight::read(&store).is_empty());
    }

    #[test]
    fn no_workers_is_503_with_retry_after() {
        let store = FakeStore::default();
        let mut g = Gateway::new(Config::default(), &store, 1);
        let r = reply(g.req(&store, Endpoint::Generate, &body("x")));
        assert_eq!((r.status, r.retry_after), (503, Some(1)));
        assert_eq!(reply(g.route_other(&store, 0)).status, 503);
    }

    #[test]
    fn other_paths_go_to_some_worker_uncounted() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        let r = routed(g.route_other(&store, 0));
        assert!(r.addr.starts_with("127.0.0.1:3000") && !r.counted);
    }

    #[test]
    fn loaded_workers_are_avoided() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","balance_abs_threshold":2"#);
        let prefix = "z".repeat(400);
        let first = routed(g.req(&store, Endpoint::Generate, &body(&format!("{prefix}0"))));
        for i in 1..3 {
            let r = routed(g.req(&store, Endpoint::Generate, &body(&format!("{prefix}{i}"))));
            assert_eq!(r.worker, first.worker);
        }
        // Three in flight on one worker, none elsewhere: imbalanced past abs threshold 2.
        let r = routed(g.req(&store, Endpoint::Generate, &body(&format!("{prefix}3"))));
        assert_ne!(r.worker, first.worker);
    }

    #[test]
    fn eviction_runs_on_its_interval() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10"#);
        routed(g.req(&store, Endpoint::Generate, &body(&"e".repeat(320))));
        assert_eq!(g.index_len(), 20);
        assert_eq!(g.tick(&store, 100), None);
        assert_eq!(g.tick(&store, 105), None);
        assert_eq!(g.tick(&store, 110), Some(16));
        assert_eq!(g.index_len(), 4);
    }

    fn pd_gateway(store: &FakeStore, extra: &str) -> Gateway {
        let json = format!(
            r#"{{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998],["http://127.0.0.1:30002","none"]],
                "decode":["http://127.0.0.1:30003","http://127.0.0.1:30004"],"cb_failure_threshold":1{extra}}}"#
        );
        Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 5)
    }

    fn split(o: Outcome) -> PdRouted {
        match o {
            Outcome::Pd(p) => p,
            Outcome::Route(r) => panic!("expected a PD split, routed to {}", r.addr),
            Outcome::Reply(r) => panic!("expected a PD split, got {} {}", r.status, String::from_utf8_lossy(&r.body)),
        }
    }

    #[test]
    fn pd_split_injects_bootstrap_and_counts_both_legs() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let p = split(g.req(&store, Endpoint::Generate, br#"{"text":["a","b","c"],"return_logprob":true}"#));
        assert!(p.prefill.addr.ends_with(":30001") || p.prefill.addr.ends_with(":30002"));
        assert!(p.decode.addr.ends_with(":30003") || p.decode.addr.ends_with(":30004"));
        assert!(p.merge_logprobs && !p.stream);
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        let rooms = v["bootstrap_room"].as_array().unwrap();
        assert_eq!(rooms.len(), 3);
        assert!(rooms[0] != rooms[1] && rooms[1] != rooms[2]);
        assert_eq!(v["bootstrap_host"][2], "127.0.0.1");
        let expected_port =
            if p.prefill.addr.ends_with(":30001") { serde_json::json!(8998) } else { serde_json::Value::Null };
        assert_eq!(v["bootstrap_port"][0], expected_port);
        assert_eq!(v["rid"], serde_json::json!(["rq-1-0", "rq-1-1", "rq-1-2"]));
        let mut counts = Inflight::read(&store);
        counts.sort();
        let mut expected = vec![(p.prefill.worker, 1), (p.decode.worker, 1)];
        expected.sort();
        assert_eq!(counts, expected);
    }

    #[test]
    fn pd_failed_prefill_is_avoided_next_time() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let text = format!(r#"{{"text":"{}"}}"#, "s".repeat(300));
        let first = split(g.req(&store, Endpoint::Generate, text.as_bytes()));
        g.outcome(&store, &first.prefill, false, 1000);
        for _ in 0..10 {
            let next = split(g.req(&store, Endpoint::Generate, text.as_bytes()));
            assert_ne!(next.prefill.worker, first.prefill.worker, "the failed prefill worker is out of rotation");
        }
    }

    #[test]
    fn pd_without_decode_workers_is_503_naming_the_role() {
        let store = FakeStore::default();
        let json = r#"{"pd_disaggregation":true,"prefill":["http://127.0.0.1:1"]}"#;
        let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), &store, 1);
        let r = reply(g.req(&store, Endpoint::Generate, br#"{"text":"x"}"#));
        assert_eq!(r.status, 503);
        assert!(String::from_utf8_lossy(&r.body).contains("decode worker"));
        assert!(Inflight::read(&store).is_empty());
    }

    #[test]
    fn pd_other_paths_go_to_decode_workers() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        for _ in 0..10 {
            let r = routed(g.route_other(&store, 0));
            assert!(r.addr.ends_with(":30003") || r.addr.ends_with(":30004"));
        }
    }

    #[test]
    fn pd_bad_batches_are_refused_before_anything_is_counted() {
        let store = FakeStore::default();
        let mut g = pd_gateway(&store, "");
        let r = reply(g.req(&store, Endpoint::Generate, br#"{"text":["a","b"],"sampling_params":[{}]}"#));
        assert_eq!(r.status, 400);
        assert!(String::from_utf8_lossy(&r.body).contains("`sampling_params`"));
        assert!(Inflight::read(&store).is_empty());
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

#[cfg(test)]
mod timing {
    use super::tests::Req;
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    #[ignore]
    fn time_route_request() {
        let store = FakeStore::default();
        let json = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003","http://127.0.0.1:30004"]}"#;
        let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), &store, 42);
        let bodies: Vec<Vec<u8>> = (0..4096).map(|i| {
            let group = i % 16;
            let system = format!("System prompt {group}: you are assistant number {group}. ").repeat(20);
            serde_json::json!({"text": format!("{system}Question {i}: what is {i} squared?"), "sampling_params": {"max_new_tokens": 1}}).to_string().into_bytes()
        }).collect();
        let t = std::time::Instant::now();
        for i in 0..40960 {
            if let Outcome::Route(r) = g.req(&store, Endpoint::Generate, &bodies[i % 4096]) {
                g.finish(&store, &r, true);
            }
        }
        eprintln!("per request: {:?}", t.elapsed() / 40960);
        let pd = r#"{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998],["http://127.0.0.1:30002",8999]],"decode":["http://127.0.0.1:30003","http://127.0.0.1:30004"]}"#;
        let mut g = Gateway::new(Config::from_json(pd.as_bytes()).unwrap(), &store, 42);
        let t = std::time::Instant::now();
        for i in 0..40960 {
            if let Outcome::Pd(p) = g.req(&store, Endpoint::Generate, &bodies[i % 4096]) {
                g.finish(&store, &p.prefill, true);
                g.finish(&store, &p.decode, true);
            }
        }
        eprintln!("PD per request: {:?}", t.elapsed() / 40960);
    }
}
