//! The filter's request logic, independent of proxy-wasm: what to do with a request given its
//! path, its body and the shared state. `http.rs` translates host callbacks into these calls.

use kvmesh_core::errors::error_json;
use kvmesh_core::policy::Candidate;
use kvmesh_core::request::{self, RequestError};
use kvmesh_core::rng::FastRng;
use kvmesh_core::{Config, Endpoint, Router, WorkerId, WorkerTable};

use crate::shared::{Inflight, InsertLog, SharedStore};

/// What the filter does with a request.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Send it to `addr`. `counted` when it was added to the in-flight table (and must be
    /// taken off it when the stream ends).
    Route(Routed),
    /// Answer locally with a JSON error.
    Reply(Reply),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub worker: WorkerId,
    pub addr: String,
    pub counted: bool,
    /// Bytes of the routing text the worker was believed to hold already.
    pub matched_bytes: usize,
}

#[derive(Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    /// Seconds for a `retry-after` header.
    pub retry_after: Option<u32>,
}

impl Reply {
    fn error(status: u16, code: &str, message: &str) -> Self {
        Self { status, body: error_json(status, code, message), retry_after: None }
    }

    fn request(e: &RequestError) -> Self {
        Self::error(e.status(), e.code(), &e.to_string())
    }

    fn no_worker() -> Self {
        Self { retry_after: Some(1), ..Self::error(503, "no_healthy_worker", "no healthy worker is available") }
    }
}

/// One VM's routing state.
pub struct Gateway {
    config: Config,
    table: WorkerTable,
    router: Router,
    rng: FastRng,
    log: InsertLog,
    last_eviction_secs: u64,
}

impl Gateway {
    pub fn new(config: Config, store: &dyn SharedStore, seed: u64) -> Self {
        Self {
            table: config.workers.clone(),
            router: Router::new(&config),
            rng: FastRng::seeded(seed),
            log: InsertLog::new(store, seed as u32 ^ (seed >> 32) as u32),
            last_eviction_secs: 0,
            config,
        }
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

    /// The healthy workers with their loads: the table's plus this Envoy's in-flight counts.
    fn candidates(&self, inflight: &Inflight) -> Vec<Candidate> {
        self.table.healthy().map(|w| Candidate { id: w.id, load: w.load + u64::from(inflight.count(w.id)) }).collect()
    }

    /// Routes an LLM request by its body.
    pub fn route_request(&mut self, store: &dyn SharedStore, endpoint: Endpoint, body: &[u8]) -> Outcome {
        if body.len() as u64 > self.config.max_payload_size {
            return Outcome::Reply(self.too_large());
        }
        let parsed = match request::parse(endpoint, body) {
            Ok(p) => p,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        if self.router.policy().uses_text() {
            for insert in self.log.poll(store) {
                self.router.apply_insert(insert.worker, &insert.hashes);
            }
        }
        let inflight = Inflight::load(store);
        let cands = self.candidates(&inflight);
        let Some(decision) = self.router.route(&parsed.text, &cands, &mut self.rng) else {
            return Outcome::Reply(Reply::no_worker());
        };
        if !decision.inserted.is_empty() {
            self.log.append(store, decision.worker, &decision.inserted);
        }
        let counted = inflight.add_loaded(store, decision.worker, 1);
        self.routed(decision.worker, counted, decision.matched_bytes)
    }

    /// Routes a request on another path (models, health, info) to any healthy worker.
    pub fn route_other(&mut self, store: &dyn SharedStore) -> Outcome {
        let cands = self.candidates(&Inflight::load(store));
        match self.router.route_any(&cands, &mut self.rng) {
            Some(pos) => self.routed(cands[pos].id, false, 0),
            None => Outcome::Reply(Reply::no_worker()),
        }
    }

    fn routed(&self, worker: WorkerId, counted: bool, matched_bytes: usize) -> Outcome {
        match self.table.get(worker) {
            Some(w) => Outcome::Route(Routed { worker, addr: w.addr.clone(), counted, matched_bytes }),
            None => Outcome::Reply(Reply::no_worker()),
        }
    }

    /// The stream of a counted request ended (completed, failed or reset).
    pub fn finish(&self, store: &dyn SharedStore, routed: &Routed) {
        if routed.counted {
            Inflight::add(store, routed.worker, -1);
        }
    }

    /// Periodic work: LRU eviction every `eviction_interval_secs`. Returns the number of
    /// blocks evicted when it ran.
    pub fn tick(&mut self, now_secs: u64) -> Option<usize> {
        if self.last_eviction_secs == 0 {
            self.last_eviction_secs = now_secs;
        }
        if now_secs.saturating_sub(self.last_eviction_secs) < self.config.eviction_interval_secs {
            return None;
        }
        self.last_eviction_secs = now_secs;
        Some(self.router.evict().len())
    }

    pub fn index_len(&self) -> usize {
        self.router.index().len()
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
        }
    }

    fn reply(o: Outcome) -> Reply {
        match o {
            Outcome::Reply(r) => r,
            Outcome::Route(r) => panic!("expected a reply, routed to {}", r.addr),
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
        let first = routed(g.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}a"))));
        assert!(first.counted);
        let again = routed(g.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}b"))));
        assert_eq!(again.addr, first.addr);
        assert!(again.matched_bytes >= 384);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
        g.finish(&store, &first);
        g.finish(&store, &again);
        assert_eq!(Inflight::read(&store), vec![(first.worker, 0)]);
    }

    #[test]
    fn another_vm_sees_the_prefix() {
        let store = FakeStore::default();
        let mut a = gateway(&store, "");
        let mut b = Gateway::new(a.config().clone(), &store, 7);
        let prefix = "q".repeat(400);
        let on_a = routed(a.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}1"))));
        let on_b = routed(b.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}2"))));
        assert_eq!(on_a.addr, on_b.addr);
    }

    #[test]
    fn bad_requests_get_json_errors_and_do_not_count() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_payload_size":64"#);
        let r = reply(g.route_request(&store, Endpoint::Generate, br#"{"text": 5}"#));
        assert_eq!(r.status, 400);
        assert!(String::from_utf8_lossy(&r.body).contains("`text`"));
        assert_eq!(reply(g.route_request(&store, Endpoint::Generate, b"{")).status, 400);
        assert_eq!(reply(g.route_request(&store, Endpoint::Generate, &[b' '; 100])).status, 413);
        assert_eq!(g.check_length(Some(65)).map(|r| r.status), Some(413));
        assert_eq!(g.check_length(Some(64)), None);
        assert!(Inflight::read(&store).is_empty());
    }

    #[test]
    fn no_workers_is_503_with_retry_after() {
        let store = FakeStore::default();
        let mut g = Gateway::new(Config::default(), &store, 1);
        let r = reply(g.route_request(&store, Endpoint::Generate, &body("x")));
        assert_eq!((r.status, r.retry_after), (503, Some(1)));
        assert_eq!(reply(g.route_other(&store)).status, 503);
    }

    #[test]
    fn other_paths_go_to_some_worker_uncounted() {
        let store = FakeStore::default();
        let mut g = gateway(&store, "");
        let r = routed(g.route_other(&store));
        assert!(r.addr.starts_with("127.0.0.1:3000") && !r.counted);
    }

    #[test]
    fn loaded_workers_are_avoided() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","balance_abs_threshold":2"#);
        let prefix = "z".repeat(400);
        let first = routed(g.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}0"))));
        for i in 1..3 {
            let r = routed(g.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}{i}"))));
            assert_eq!(r.worker, first.worker);
        }
        // Three in flight on one worker, none elsewhere: imbalanced past abs threshold 2.
        let r = routed(g.route_request(&store, Endpoint::Generate, &body(&format!("{prefix}3"))));
        assert_ne!(r.worker, first.worker);
    }

    #[test]
    fn eviction_runs_on_its_interval() {
        let store = FakeStore::default();
        let mut g = gateway(&store, r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10"#);
        routed(g.route_request(&store, Endpoint::Generate, &body(&"e".repeat(320))));
        assert_eq!(g.index_len(), 20);
        assert_eq!(g.tick(100), None);
        assert_eq!(g.tick(105), None);
        assert_eq!(g.tick(110), Some(16));
        assert_eq!(g.index_len(), 4);
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
            if let Outcome::Route(r) = g.route_request(&store, Endpoint::Generate, &bodies[i % 4096]) {
                g.finish(&store, &r);
            }
        }
        eprintln!("per request: {:?}", t.elapsed() / 40960);
    }
}
