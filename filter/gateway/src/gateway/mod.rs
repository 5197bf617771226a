//! One VM's routing state, independent of the host: what to do with a request given its
//! path, its body and the shared state. Deciding ([`Gateway::route_request`]) changes nothing
//! that outlives the call; [`Gateway::commit`] records a decision once everything that could
//! fail in applying it (headers, body, callout) has succeeded. `request.rs` drives both.
//!
//! A [`Gateway`] is four parts, each with one job, and the delta log they share:
//! - [`view::RoutingView`]: configuration, worker table, routers, health — and the decision;
//! - [`follower::TableFollower`]: which control-plane table and settings the view is on;
//! - [`publisher::Publisher`]: the stream owner's reports (and its publication epoch);
//! - [`ledger::Ledger`]: this VM's share of the in-flight counts (and, alone in its Envoy, what
//!   it keeps for its tick's write).
//!
//! Two handles lend the view out: [`Front`] reads what a request meets before its decision,
//! [`Outcomes`] takes what happened to the workers.

mod feedback;
mod follower;
mod front;
mod ledger;
mod outcomes;
mod plan;
mod publisher;
mod record;
mod reply;
mod view;

use kvmesh_core::pd::PdDecision;
use kvmesh_core::request;
use kvmesh_core::rng::RngCore;
use kvmesh_core::{Config, Decision, Endpoint};
use kvmesh_proto::v1::{self as proto, ReportBatch};

pub use self::feedback::EngineFeedback;
pub use self::follower::table_from;
pub use self::front::Front;
pub use self::outcomes::Outcomes;
pub use self::plan::{endpoint_list, Committed, Destination, Outcome, PdPlan, Plan, Prediction, RequestInfo};
pub use self::publisher::{Publisher, REPORT_QUEUE_HASHES};
pub use self::record::{push_who, DECISION_KEY, FAILOVER_KEY};
pub use self::reply::Reply;
pub use self::view::CONTROL_PLANE_EVICTION_CAP;
pub use crate::now::Now;
pub use crate::pd::{PrefillLeg, PREFILLER_HEADER};
pub use crate::routed::Routed;

use self::follower::TableFollower;
use self::ledger::Ledger;
use self::plan::Chosen;
use self::view::RoutingView;
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
}

/// Index changes of other VMs a request applies before its decision (about: whole log slots
/// are read): a large batch (a full snapshot) is spread over requests and ticks.
const CATCH_UP_PER_REQUEST: usize = 1 << 15;

/// Index changes of other VMs the tick applies.
const CATCH_UP_PER_TICK: usize = 1 << 18;

impl Gateway {
    /// A gateway routing with `config`, whose routing settings stay the base the control
    /// plane's settings are overlaid on.
    pub fn new(config: Config, store: &dyn SharedStore, seed: u64) -> Self {
        let log = DeltaLog::new(store, seed as u32 ^ (seed >> 32) as u32);
        Self {
            follower: TableFollower::new(config.settings.clone(), config.worker_authorization.clone()),
            view: RoutingView::new(config, seed),
            publisher: Publisher::default(),
            ledger: Ledger::new(log.vm(), store),
            log,
            pending_feedback: Pending::default(),
            merge_room: Default::default(),
        }
    }

    /// Where this VM's requests hold prefill logprobs while merging them.
    pub fn merge_room(&self) -> &kvmesh_core::logprobs::MergeRoom {
        &self.merge_room
    }

    pub fn config(&self) -> &Config {
        &self.view.config
    }

    /// Whether a control plane is configured (inserts and stale blocks are then reported).
    fn has_control_plane(&self) -> bool {
        self.view.config.control_plane_cluster.is_some()
    }

    /// What a request meets before its decision (see [`Front`]).
    pub fn front(&self) -> Front<'_> {
        Front { view: &self.view }
    }

    /// What happened to the workers' requests (see [`Outcomes`]).
    pub fn outcomes(&mut self) -> Outcomes<'_> {
        Outcomes { view: &mut self.view }
    }

    /// This VM's in-flight bookkeeping: whether it routes alone, its id.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// This VM's in-flight bookkeeping, to record a request's end.
    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// The stream owner's reports: whether this VM queues them, under which gateway id.
    pub fn publisher(&mut self) -> &mut Publisher {
        &mut self.publisher
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
            return self.ledger.local_loads();
        }
        self.sync_table(store);
        let inflight = Inflight::load(store).discount(self.ledger.ended());
        self.catch_up(store, &inflight, CATCH_UP_PER_REQUEST);
        self.view.health.sync_if_changed(store, inflight.breakers());
        inflight
    }

    /// Whether this VM decides on its own counts alone, reading no shared data per request:
    /// it routes alone in its Envoy and no control plane publishes through another VM.
    fn routes_locally(&self) -> bool {
        self.ledger.alone() && !self.has_control_plane()
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
        if self.front().over_limit(body.len()) {
            return Outcome::Reply(self.front().too_large());
        }
        let parsed = match request::parse_with(endpoint, body, self.config().chat_shape.as_ref()) {
            Ok(p) => p,
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        self.ledger.serve(store, info.now.ms());
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
        let parsed = match request::parse_with(endpoint, &body, self.config().chat_shape.as_ref()) {
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
        for d in legs {
            if self.view.health.take_probe(store, d.worker, now) {
                log::info!("worker {}: half-open, probing it with one request", d.worker);
            }
        }
        let workers = legs.iter().map(|d| d.worker);
        let counted = self.ledger.commit(store, &mut self.log, inflight, workers, &deltas);
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
        self.sync_table(store);
        self.view.models_reply(id)
    }

    /// Routes a request on another path (models, health, info) to any available worker (a
    /// decode worker in PD mode). Not counted, nothing to commit.
    pub fn route_other(&mut self, store: &dyn SharedStore, now: Now) -> Result<(Routed, Vec<String>), Reply> {
        self.ledger.serve(store, now.ms());
        self.sync_table(store);
        let loads = match self.routes_locally() {
            true => self.ledger.local_loads(),
            false => Inflight::load(store).discount(self.ledger.ended()),
        };
        self.view.route_other(&loads, now)
    }

    /// On the tick: the requests that ended here since the last write, and for a VM alone
    /// what it routed and the inserts it has not logged (see [`Ledger::write_ended`]).
    pub fn write_ended(&mut self, store: &dyn SharedStore) {
        self.ledger.write_ended(store, &mut self.log);
    }

    /// On the tick: publishes what this VM has in flight and takes back the counts of VMs
    /// that died (see [`Ledger::heartbeat`]).
    pub fn heartbeat(&mut self, store: &dyn SharedStore, now_ms: u64) {
        self.ledger.heartbeat(store, now_ms, &mut self.log);
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
            self.sync_table(store);
            if snapshot.full {
                // A connection's first snapshot: its versions may repeat ones already
                // published (a restarted kvmesh-cp counts from the start again).
                self.publisher.epoch = self.view.rng.next_u64();
            }
            self.follower.publish(store, &mut self.view, snapshot, self.publisher.epoch);
        }
        let deltas = self.publisher.deltas_of(snapshot);
        for d in &deltas {
            self.view.apply_delta(d);
        }
        self.log.append(store, &deltas);
    }

    /// Adopts the table the stream owner published, when it changed (every VM, on its tick
    /// and before each request: one small shared-data read).
    pub fn sync_table(&mut self, store: &dyn SharedStore) {
        self.follower.sync(store, &mut self.view);
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

    /// Engine feedback on this VM's responses (see [`EngineFeedback`]).
    pub fn feedback(&mut self) -> EngineFeedback<'_> {
        let cp = self.has_control_plane();
        EngineFeedback {
            view: &mut self.view,
            log: &mut self.log,
            publisher: &mut self.publisher,
            pending: &mut self.pending_feedback,
            cp,
        }
    }

    pub fn table_version(&self) -> Option<u64> {
        self.follower.table_version
    }
}

#[cfg(test)]
mod tests;
