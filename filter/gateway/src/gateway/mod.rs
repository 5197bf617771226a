//! One VM's routing state, independent of the host: what to do with a request given its
//! path, its body and the shared state. Deciding ([`Gateway::route_request`]) changes nothing
//! that outlives the call; [`Gateway::commit`] records a decision once everything that could
//! fail in applying it (headers, body, callout) has succeeded. `request.rs` drives both.
//!
//! A [`Gateway`] is four parts, each with one job, and the delta log they share:
//! - [`view::RoutingView`]: configuration, worker table, routers, health — and the decision;
//! - [`follower::TableFollower`]: which control-plane table and settings the view is on;
//! - [`publisher::Publisher`]: the stream owner's reports (and its publication epoch);
//! - [`ledger::Ledger`]: this VM's share of the in-flight counts.

mod follower;
mod ledger;
mod plan;
mod publisher;
mod record;
mod reply;
mod view;

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::feedback::{judge, Judged, Verdict};
use kvmesh_core::paths::{self, PathClass};
use kvmesh_core::pd::PdDecision;
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::request::{self, RequestError};
use kvmesh_core::rng::RngCore;
use kvmesh_core::usage::Usage;
use kvmesh_core::{Config, Decision, Endpoint, WorkerId};
use kvmesh_proto::v1::{self as proto, IndexInsert, ReportBatch};

pub use self::follower::table_from;
pub use self::plan::{endpoint_list, Committed, Destination, Outcome, PdPlan, Plan, Prediction, RequestInfo};
pub use self::publisher::REPORT_QUEUE_HASHES;
pub use self::record::{DECISION_KEY, FAILOVER_KEY};
pub use self::reply::Reply;
pub use self::view::CONTROL_PLANE_EVICTION_CAP;
pub use crate::now::Now;
pub use crate::pd::{PrefillLeg, PREFILLER_HEADER};
pub use crate::routed::Routed;

use self::follower::TableFollower;
use self::ledger::Ledger;
use self::plan::Chosen;
use self::publisher::Publisher;
use self::view::RoutingView;
use crate::headers::Headers;
use crate::shared::feedback::Pending;
use crate::shared::{Delta, DeltaLog, Inflight, SharedStore};

/// One VM's routing state.
pub struct Gateway {
    view: RoutingView,
    follower: TableFollower,
    publisher: Publisher,
    ledger: Ledger,
    /// Index changes shared with the other VMs of this Envoy.
    log: DeltaLog,
    /// Engine feedback of this VM's responses since the last tick (merged into shared data
    /// on the tick, not per response).
    pending_feedback: Pending,
    /// The prefill logprobs this VM's requests hold for merging (capped per VM).
    merge_room: kvmesh_core::logprobs::MergeRoom,
    /// Alone in its Envoy, a VM reads and writes no shared data per request: `seen` is what
    /// `kvmesh.state` held at its last write or tick, `unlogged` the index inserts not yet in
    /// the delta log (both written on the tick, see [`Gateway::write_ended`]).
    seen: Inflight,
    unlogged: Vec<Delta>,
    unlogged_hashes: usize,
}

/// Index changes of other VMs a request applies before its decision (about: whole log slots
/// are read): a large batch (a full snapshot) is spread over requests and ticks.
const CATCH_UP_PER_REQUEST: usize = 1 << 15;

/// Index inserts a VM alone keeps for its tick's write: past these it writes them at once
/// (half a delta-log slot, so that one request's inserts on top still fit in one slot).
const UNLOGGED_HASHES: usize = DeltaLog::SLOT_HASHES / 2;

/// Index changes of other VMs the tick applies.
const CATCH_UP_PER_TICK: usize = 1 << 18;

impl Gateway {
    /// A gateway routing with `config`, whose routing settings stay the base the control
    /// plane's settings are overlaid on.
    pub fn new(config: Config, store: &dyn SharedStore, seed: u64) -> Self {
        Self {
            follower: TableFollower::new(config.settings.clone(), config.worker_authorization.clone()),
            view: RoutingView::new(config, seed),
            publisher: Publisher::default(),
            ledger: Ledger::new(),
            log: DeltaLog::new(store, seed as u32 ^ (seed >> 32) as u32),
            pending_feedback: Pending::default(),
            merge_room: Default::default(),
            seen: Inflight::load(store),
            unlogged: Vec::new(),
            unlogged_hashes: 0,
        }
    }

    /// The workers the control plane found hung (answering none of its probes).
    pub fn hung_workers(&self) -> Vec<WorkerId> {
        self.view.table.workers.iter().filter(|w| w.unresponsive).map(|w| w.id).collect()
    }

    /// Where this VM's requests hold prefill logprobs while merging them.
    pub fn merge_room(&self) -> &kvmesh_core::logprobs::MergeRoom {
        &self.merge_room
    }

    /// This VM's id in shared data (lease owner, log writer).
    pub fn vm_id(&self) -> u32 {
        self.log.vm()
    }

    pub fn config(&self) -> &Config {
        &self.view.config
    }

    /// Whether a control plane is configured (inserts and stale blocks are then reported).
    fn has_control_plane(&self) -> bool {
        self.view.config.control_plane_cluster.is_some()
    }

    /// Whether completion metrics (tokens, latency) of responses go anywhere: to the control
    /// plane, in reports. Without one, a response with no prediction to judge is not scanned.
    pub fn reports_usage(&self) -> bool {
        self.has_control_plane()
    }

    /// What the gateway does with `method` on `path`.
    pub fn classify(&self, method: &str, path: &str) -> PathClass {
        paths::classify(method, path, &self.view.config.passthrough_paths)
    }

    /// How a routed request's destination headers are written (its timeout also bounds the
    /// prefill leg).
    pub fn destination(&self) -> Destination {
        let config = &self.view.config;
        Destination {
            timeout_secs: config.request_timeout_secs,
            original_dst: config.original_dst_header,
            authorization: config.worker_authorization.clone(),
        }
    }

    /// The Envoy cluster the prefill callouts go through.
    pub fn upstream_cluster(&self) -> &str {
        &self.view.config.upstream_cluster
    }

    /// The body size limit (`max_payload_size`), the one place it is read: a request whose
    /// declared `content-length` exceeds it is refused before its body is read.
    pub fn check_length(&self, content_length: Option<u64>) -> Option<Reply> {
        let limit = self.view.config.max_payload_size;
        content_length.filter(|&len| len > limit).map(|_| Reply::request(&RequestError::TooLarge { limit }))
    }

    /// Whether a body of `len` bytes is over the limit (a body that grows past it while
    /// buffering is refused with [`Gateway::too_large`]).
    pub fn over_limit(&self, len: usize) -> bool {
        len as u64 > self.view.config.max_payload_size
    }

    /// A body that grew past the limit while buffering.
    pub fn too_large(&self) -> Reply {
        Reply::request(&RequestError::TooLarge { limit: self.view.config.max_payload_size })
    }

    /// An LLM request that arrived with no body at all.
    pub fn empty_body(&self) -> Reply {
        Reply::request(&RequestError::EmptyBody)
    }

    /// Whether this VM holds the control-plane streams: only then are inserts queued for
    /// reports (a VM that stops holding them drops its queue).
    pub fn set_reporting(&mut self, on: bool) {
        self.publisher.set_reporting(on);
    }

    /// The gateway id this Envoy reports under (see [`Self::apply_snapshot`]).
    pub fn set_own_id(&mut self, id: &str) {
        self.publisher.own_id = Some(id.to_string());
    }

    /// Hashes queued for the next report.
    #[cfg(test)]
    pub fn unreported_hashes(&self) -> usize {
        self.publisher.unreported_hashes()
    }

    /// Whether a policy in force hashes on a routing key (its headers are then looked up).
    pub fn wants_key(&self) -> bool {
        self.view.uses(PolicyKind::ConsistentHashing)
    }

    /// See [`view::RoutingView::routing_key`].
    pub fn routing_key(&self, headers: &Headers) -> Option<String> {
        self.view.routing_key(headers)
    }

    /// Brings this VM's view up to date with shared data before a decision: the table the
    /// stream owner published, the index changes other VMs logged, and — when their generation
    /// moved — the breakers. Returns the in-flight counts read for the decision (less this
    /// VM's ended requests not written yet).
    ///
    /// A VM alone in its Envoy without a control plane reads nothing: no other VM publishes a
    /// table, logs inserts, moves a breaker or counts a request, and what the tick finds (a VM
    /// that joined, one that died) it applies then. Its loads are the last value seen with its
    /// own requests since. With a control plane, Envoy's main-thread VM may hold the streams
    /// and publish other gateways' inserts and loads: those are read before each decision.
    fn refresh(&mut self, store: &dyn SharedStore) -> Inflight {
        if self.routes_locally() {
            return self.ledger.local_loads(&self.seen);
        }
        self.sync(store);
        let inflight = Inflight::load(store).discount(self.ledger.ended());
        self.catch_up(store, &inflight, CATCH_UP_PER_REQUEST);
        self.view.health.sync_if_changed(store, inflight.breakers());
        inflight
    }

    /// Adopts the table the stream owner published, if it changed (see [`TableFollower::sync`]).
    fn sync(&mut self, store: &dyn SharedStore) {
        self.follower.sync(store, &mut self.view);
    }

    /// Whether this VM decides on its own counts alone, reading no shared data per request:
    /// it routes alone in its Envoy and no control plane publishes through another VM.
    fn routes_locally(&self) -> bool {
        self.ledger.alone && !self.has_control_plane()
    }

    /// Applies the prefix inserts other VMs made (and queues them for the report, on the
    /// stream owner), up to about `max_hashes` of them: the rest on the next call.
    fn catch_up(&mut self, store: &dyn SharedStore, read: &Inflight, max_hashes: usize) {
        if !self.view.uses_text() {
            return;
        }
        let cp = self.has_control_plane();
        for delta in self.log.poll(store, read.recent(), read.head(), max_hashes) {
            self.view.apply_delta(&delta);
            match (delta.evict, delta.from_cp) {
                (false, false) => self.publisher.queue_insert(cp, delta.worker, delta.hashes),
                // Engine feedback on another VM of this Envoy.
                (true, false) => self.publisher.queue_stale(cp, delta.worker, delta.hashes),
                _ => {}
            }
        }
    }

    /// Decides where an LLM request goes, by its body: the view is refreshed from shared data,
    /// then decides. Changes nothing that outlives the call.
    pub fn route_request(
        &mut self,
        store: &dyn SharedStore,
        endpoint: Endpoint,
        body: &[u8],
        info: &RequestInfo<'_>,
    ) -> Outcome {
        if self.over_limit(body.len()) {
            return Outcome::Reply(self.too_large());
        }
        let parsed = match request::parse(endpoint, body) {
            Ok(p) => p,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        self.serve(store, info.now.ms());
        let inflight = self.refresh(store);
        if !parsed.client_dp_rank {
            return self.view.decide(endpoint, body, &parsed, info, inflight);
        }
        // A client's data-parallel rank never reaches a worker: the request is decided on the
        // body without it, which the worker gets unless the plan writes one of its own.
        let body = match kvmesh_core::dp::without_rank(body) {
            Ok(b) => b,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        let parsed = match request::parse(endpoint, &body) {
            Ok(p) => p,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        let mut outcome = self.view.decide(endpoint, &body, &parsed, info, inflight);
        if let Outcome::Route(plan) = &mut outcome {
            plan.body.get_or_insert_with(|| body.clone().into_boxed_slice());
        }
        outcome
    }

    /// Records a plan that was applied: the index learns the prefix, the legs are counted in
    /// flight, and the new blocks go to the other VMs (one CAS for counts and log sequence,
    /// plus the log slot) and into the next report.
    pub fn commit(&mut self, store: &dyn SharedStore, plan: Plan) -> Committed {
        let Plan { chosen, mut main, pd, inflight, now, fallbacks: _, body: _, rid, batch, model } = plan;
        let prediction = self.view.prediction(&chosen, batch);
        let record = record::decision_record(
            &self.view.config,
            &chosen,
            &main.addr,
            pd.as_ref().map(|p| p.prefill.addr.as_str()),
            pd.as_ref().and_then(|p| p.leg.rid()).or(rid.as_deref()),
            model.as_deref(),
        );
        let decisions: Vec<&Decision> = match &chosen {
            Chosen::Regular(d) | Chosen::Pd(PdDecision::DecodeOnly(d)) => vec![d],
            Chosen::Pd(PdDecision::Split { prefill, decode }) => vec![decode, prefill],
        };
        let deltas: Vec<Delta> = decisions
            .iter()
            .filter(|d| !d.blocks.is_empty())
            .map(|d| Delta { worker: d.worker, evict: false, from_cp: false, hashes: d.blocks.clone() })
            .collect();
        // The legs the gateway sends are counted in flight (and may take a half-open
        // worker's probe): not a prefill that the decode pod's sidecar runs, whose end the
        // gateway never sees. Its prefix is indexed all the same: that pod computes it.
        let sent = match &pd {
            Some(p) if !p.leg.sent_by_gateway() => 1,
            _ => decisions.len(),
        };
        let legs = decisions.get(..sent).unwrap_or_default();
        let counts: Vec<(WorkerId, i32)> = legs.iter().map(|d| (d.worker, 1)).collect();
        for d in legs {
            if self.view.health.take_probe(store, d.worker, now) {
                log::info!("worker {}: half-open, probing it with one request", d.worker);
            }
        }
        let counted = if inflight.is_local() {
            // Decided alone: counted and logged with the tick's write.
            self.ledger.start(legs.iter().map(|d| d.worker));
            self.unlogged_hashes += deltas.iter().map(|d| d.hashes.len()).sum::<usize>();
            self.unlogged.extend(deltas.iter().cloned());
            if self.unlogged_hashes >= UNLOGGED_HASHES {
                self.write_unwritten(store);
            }
            true
        } else {
            // Encoded once: the commit stamps the sequence number it takes.
            let mut batch = (!deltas.is_empty()).then(|| DeltaLog::encode(0, self.vm_id(), &deltas));
            let (counted, seq) = inflight.commit(store, &counts, self.ledger.ended(), batch.as_mut());
            if counted {
                self.ledger.written();
            }
            if let (Some(seq), Some(batch)) = (seq, &batch) {
                self.log.write_encoded(store, seq, batch);
            }
            if counted {
                self.ledger.counted(legs.iter().map(|d| d.worker));
            }
            counted
        };
        self.view.commit(&chosen);
        let cp = self.has_control_plane();
        for d in deltas {
            self.publisher.queue_insert(cp, d.worker, d.hashes);
        }
        main.counted = counted;
        let pd_cache_hit = pd.as_ref().map(|p| p.cache_hit);
        let (prefill, leg, merge_logprobs, stream) = match pd {
            Some(p) => {
                let PdPlan { prefill, leg, merge_logprobs, stream, cache_hit: _ } = *p;
                let counted = counted && leg.sent_by_gateway();
                (Some(Routed { counted, ..prefill }), Some(leg), merge_logprobs, stream)
            }
            None => (None, None, false, false),
        };
        // Per-model counters only where the gateway routes by model (several names, adapters,
        // aliases or --enable-igw): one model alone is the gateway's own totals.
        let model = model.filter(|_| self.view.routes_by_model());
        Committed { main, prediction, prefill, leg, pd_cache_hit, merge_logprobs, stream, model, record }
    }

    /// The worker at `addr` (`ip:port`, as Envoy reports the upstream it used) of
    /// data-parallel rank `rank` (none: a worker that is one target).
    pub fn worker_at(&self, addr: &str, rank: Option<u32>) -> Option<WorkerId> {
        self.view.worker_at(addr, rank)
    }

    /// `GET /v1/models` and `/v1/models/{id}` answered by the gateway from its table (see
    /// [`RoutingView::models_reply`]); none for other paths, or when no worker said what it
    /// serves.
    pub fn models_reply(&mut self, store: &dyn SharedStore, path: &str) -> Option<Reply> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let id = match path.strip_prefix("/v1/models") {
            Some("" | "/") => None,
            Some(rest) => Some(rest.strip_prefix('/')?),
            None => return None,
        };
        self.sync(store);
        self.view.models_reply(id)
    }

    /// Routes a request on another path (models, health, info) to any available worker (a
    /// decode worker in PD mode). Not counted, nothing to commit.
    pub fn route_other(&mut self, store: &dyn SharedStore, now: Now) -> Result<(Routed, Vec<String>), Reply> {
        self.serve(store, now.ms());
        self.sync(store);
        let loads = match self.routes_locally() {
            true => self.ledger.local_loads(&self.seen),
            false => Inflight::load(store).discount(self.ledger.ended()),
        };
        self.view.route_other(&loads, now)
    }

    /// A counted leg that never ran to its end (a prefill callout cancelled with its stream):
    /// off the in-flight table, not counted as finished (see [`Gateway::finish`] for when).
    pub fn release(&mut self, store: &dyn SharedStore, routed: &Routed) {
        self.ledger.release(store, routed);
    }

    /// For a host whose plugins tick only on their streams' hooks: every end is written at
    /// once when other VMs route too (a busy stream without hooks would keep the ends of the
    /// requests before it from the others, and from the Envoy-wide gauge, while it runs).
    pub fn write_ends_at_once(&mut self) {
        self.ledger.untimed = true;
    }

    /// The stream of a counted request ended (completed, failed or reset): written with this
    /// VM's next commit or tick — a shared-data read and compare-and-swap saved per request
    /// under load — or at once when other VMs route too and it was this VM's last request in
    /// flight (see [`ledger::Ledger`]'s `ended`). Its own decisions discount it at once.
    pub fn finish(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool) {
        self.ledger.finish(store, routed, ok);
    }

    /// Writes the requests that ended here since the last write (on the tick: when no request
    /// was routed since, nothing else would) and, for a VM alone, those it routed and the
    /// inserts it has not logged yet; then reads `kvmesh.state` afresh for its next decisions.
    pub fn write_ended(&mut self, store: &dyn SharedStore) {
        if self.ledger.alone {
            if !self.write_unwritten(store) {
                // Nothing of its own to write; a VM that died may have been taken back.
                self.seen = Inflight::load(store);
            }
        } else if self.ledger.started_any() || !self.unlogged.is_empty() {
            // Left from a time alone (a write that did not go through): out now.
            self.write_unwritten(store);
        } else {
            self.ledger.write_ended(store);
        }
    }

    /// This VM routes requests (it is then one of the VMs that count them: Envoy's main-thread
    /// VM never is). Called with every request; registers the VM the first time.
    pub fn serve(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let vm = self.vm_id();
        self.ledger.serve(store, vm, now_ms);
    }

    /// Whether this VM knows if it is alone in its Envoy (two heartbeats a second apart).
    pub fn settled(&self) -> bool {
        self.ledger.settled()
    }

    /// Whether this VM is the only one in its Envoy (it then reads no shared data per request).
    pub fn alone(&self) -> bool {
        self.ledger.alone
    }

    /// A VM alone: its routed and ended requests into `kvmesh.state` and its inserts into the
    /// delta log, one write each.
    /// Returns whether it wrote; a VM alone then decides on what it wrote from now on (its
    /// written requests are in `seen`, no longer in its own counts).
    fn write_unwritten(&mut self, store: &dyn SharedStore) -> bool {
        if !self.ledger.unwritten() && self.unlogged.is_empty() {
            return false;
        }
        let batch = std::mem::take(&mut self.unlogged);
        self.unlogged_hashes = 0;
        let one_slot =
            !batch.is_empty() && batch.iter().map(|d| d.hashes.len()).sum::<usize>() <= DeltaLog::SLOT_HASHES;
        let mut encoded = one_slot.then(|| DeltaLog::encode(0, self.vm_id(), &batch));
        let (_, seq) = self.ledger.write_started(store, encoded.as_mut());
        match (seq, &encoded) {
            (Some(seq), Some(encoded)) => self.log.write_encoded(store, seq, encoded),
            (Some(seq), None) => self.log.write(store, seq, &batch),
            // Past one slot, or the counts not written (kept for the next try): the inserts
            // are logged all the same.
            (None, _) if !batch.is_empty() => self.log.append(store, &batch),
            (None, _) => {}
        }
        self.seen = Inflight::load(store);
        true
    }

    /// On the tick: publishes what this VM has in flight and takes back the counts of VMs
    /// that died (see [`ledger::Ledger::heartbeat`]).
    pub fn heartbeat(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let vm = self.vm_id();
        let was_alone = self.ledger.alone;
        self.ledger.heartbeat(store, vm, now_ms);
        match (was_alone, self.ledger.alone) {
            // Another VM registered: what this one kept for its tick goes out now.
            (true, false) => {
                self.write_unwritten(store);
            }
            // From now on it decides on what it last saw and its own requests.
            (false, true) => self.seen = Inflight::load(store),
            _ => {}
        }
    }

    /// A request went to `worker` (the stall window starts if it held none).
    pub fn sent(&mut self, worker: WorkerId, now_ms: u64) {
        self.view.stalls.sent(worker, now_ms);
    }

    /// A request to `worker` ended; `answered`: the worker itself answered.
    pub fn ended(&mut self, worker: WorkerId, answered: bool, now_ms: u64) {
        self.view.stalls.ended(worker, answered, now_ms);
    }

    /// A request to `routed`'s worker succeeded or failed (at `now`): its circuit breaker
    /// learns it. Only what the worker did counts (see `request/verdict.rs`): a
    /// 4xx is a success, Envoy's own refusals and clients that went away are not reported.
    pub fn outcome(&mut self, store: &dyn SharedStore, routed: &Routed, ok: bool, now: Now) {
        self.view.record_outcome(store, routed.worker, ok, now);
    }

    /// What a request did to `worker` (`ok`: not a failure of the worker's), at `now`.
    pub fn record(&mut self, store: &dyn SharedStore, worker: WorkerId, ok: bool, now: Now) {
        self.view.record_outcome(store, worker, ok, now);
    }

    /// A failure of `worker` learned without a [`Routed`] (an attempt Envoy retried on
    /// another worker, say), at `now`: counts against its circuit breaker.
    pub fn worker_failed(&mut self, store: &dyn SharedStore, worker: WorkerId, now: Now) {
        self.view.record_outcome(store, worker, false, now);
    }

    /// A request that `from` failed was sent again to another worker: counted per worker
    /// (cumulative, reported to the control plane as `WorkerCounts.failovers`).
    pub fn failover(&mut self, store: &dyn SharedStore, from: WorkerId) {
        self.view.health.count_failover(store, from);
    }

    /// `worker`'s circuit breaker at `now`, as this VM sees it.
    pub fn breaker_state(&self, worker: WorkerId, now: Now) -> BreakerState {
        self.view.health.state(worker, now)
    }

    /// Periodic work: the circuit breakers as the other VMs left them, and LRU eviction every
    /// `eviction_interval_secs` (see [`view::RoutingView::evict_when_due`]). Returns the
    /// number of blocks evicted when that ran.
    pub fn tick(&mut self, store: &dyn SharedStore, now_secs: u64) -> Option<usize> {
        self.view.health.sync(store);
        self.catch_up(store, &Inflight::load(store), CATCH_UP_PER_TICK);
        self.view.bound_indexes();
        self.view.evict_when_due(now_secs)
    }

    /// The regular router's index (tests).
    #[cfg(test)]
    pub fn regular_index(&self) -> Option<&kvmesh_core::index::PrefixIndex> {
        match &self.view.mode {
            view::Mode::Regular(r) => Some(r.index()),
            view::Mode::Pd(_) => None,
        }
    }

    pub fn index_len(&mut self) -> usize {
        self.view.index_len()
    }

    /// A snapshot from the stream (on the VM that owns it): applied here, and shared with the
    /// other VMs — the table through shared data, index changes through the delta log.
    pub fn apply_snapshot(&mut self, store: &dyn SharedStore, snapshot: &proto::Snapshot) {
        if snapshot.full || snapshot.workers_changed || snapshot.settings.is_some() {
            // A VM that has just taken the streams over starts from what the last owner
            // published (the records it shares name that table's version).
            self.sync(store);
            if snapshot.full {
                // A connection's first snapshot: its versions may repeat ones already
                // published (a restarted kvmesh-cp counts from the start again).
                self.publisher.epoch = self.view.rng.next_u64();
            }
            self.follower.publish(store, &mut self.view, snapshot, self.publisher.epoch);
        }
        let mut deltas: Vec<Delta> = Vec::with_capacity(snapshot.inserts.len() + snapshot.evictions.len());
        // This Envoy's own inserts, echoed back by the control plane, are in its index already.
        let own_id = self.publisher.own_id.as_deref();
        let own = |i: &&IndexInsert| !i.origin.is_empty() && own_id == Some(i.origin.as_str());
        deltas.extend(snapshot.inserts.iter().filter(|i| !own(i)).map(|i| Delta {
            worker: i.worker,
            evict: false,
            from_cp: true,
            hashes: i.hashes.clone(),
        }));
        deltas.extend(snapshot.evictions.iter().map(|e| Delta {
            worker: e.worker,
            evict: true,
            from_cp: true,
            hashes: e.hashes.clone(),
        }));
        for d in &deltas {
            self.view.apply_delta(d);
        }
        self.log.append(store, &deltas);
    }

    /// Adopts the table the stream owner published, when it changed (every VM, on its tick
    /// and before each request: one small shared-data read).
    pub fn sync_table(&mut self, store: &dyn SharedStore) {
        self.sync(store);
    }

    /// What the stream owner sends on its report tick (at `now`): see
    /// [`publisher::Publisher::report`]; the other VMs' inserts are caught up with first.
    pub fn take_report(&mut self, store: &dyn SharedStore, gateway_id: &str, now: Now) -> ReportBatch {
        self.catch_up(store, &Inflight::load(store), CATCH_UP_PER_TICK);
        self.publisher.report(store, &self.view, gateway_id, now)
    }

    /// Everything this VM's index holds, for a control plane that just (re)connected: report
    /// batches of at most `max_hashes` hashes each (at least one batch, possibly empty).
    pub fn full_report(&mut self, gateway_id: &str, max_hashes: usize) -> Vec<ReportBatch> {
        self.publisher.full_report(&mut self.view, gateway_id, max_hashes)
    }

    // Engine feedback: what a worker's response said it had cached (`cached_tokens`)
    // against the prefix this gateway's index matched for it when the request was routed.
    // The comparison is counted per worker (`kvmesh.feedback`, reported to the control
    // plane); when the worker held less, the blocks it did not hold are dropped for it — here,
    // in the other VMs (through the delta log) and, through the report, in the control plane
    // and so in every gateway.

    /// A response of `prediction`'s worker ended, carrying `usage`: judged, counted, and the
    /// stale blocks dropped. Returns the judgement (None: the response said no
    /// `cached_tokens`).
    pub fn feedback(&mut self, store: &dyn SharedStore, prediction: &Prediction, usage: &Usage) -> Option<Judged> {
        let config = &self.view.config;
        let (block_size, per_token) = (config.block_size as u64, config.bytes_per_token);
        let judged = usage
            .cached_tokens
            .map(|cached| judge(prediction.matched_bytes, prediction.matched_blocks, cached, block_size, per_token));
        self.pending_feedback.add(prediction.worker, judged.as_ref(), usage);
        // From the first block the worker did not hold to the request's last: the routing
        // indexed the whole request for it, and a worker's blocks stay a run from the first
        // (what the index's binary search relies on).
        let stale = match judged.as_ref().filter(|j| j.verdict == Verdict::Over) {
            Some(j) => prediction.hashes.get(j.stale.start..).unwrap_or_default().to_vec(),
            None => Vec::new(),
        };
        if let (false, Some(j)) = (stale.is_empty(), judged.as_ref()) {
            log::debug!(
                "worker {}: {} cached tokens where {} were predicted; {} blocks dropped",
                prediction.worker,
                j.cached_tokens,
                j.predicted_tokens,
                stale.len()
            );
            let delta = Delta { worker: prediction.worker, evict: true, from_cp: false, hashes: stale };
            self.view.apply_delta(&delta);
            self.log.append(store, std::slice::from_ref(&delta));
            let cp = self.has_control_plane();
            self.publisher.queue_stale(cp, delta.worker, delta.hashes);
        }
        judged
    }

    /// A response of `worker` that carried completion metrics but had no prediction to judge.
    pub fn count_usage(&mut self, worker: WorkerId, usage: &Usage) {
        self.pending_feedback.add(worker, None, usage);
    }

    /// On the tick: this VM's feedback since the last tick into the shared counts.
    pub fn flush_feedback(&mut self, store: &dyn SharedStore) {
        self.pending_feedback.flush(store);
    }

    pub fn table_version(&self) -> Option<u64> {
        self.follower.table_version
    }
}

/// Whether a client-sent request header could steer routing and must be dropped.
pub fn is_routing_header(name: &str) -> bool {
    // Every request header passes here: no allocation, and most leave at the first byte.
    name.as_bytes().first().is_some_and(|c| c.eq_ignore_ascii_case(&b'x'))
        && (name.eq_ignore_ascii_case("x-envoy-original-dst-host")
            || name.eq_ignore_ascii_case("x-gateway-destination-endpoint")
            || name.eq_ignore_ascii_case(PREFILLER_HEADER)
            || name.get(..9).is_some_and(|p| p.eq_ignore_ascii_case("x-kvmesh-")))
}

#[cfg(test)]
mod tests;
