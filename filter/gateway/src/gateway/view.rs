//! The routing view: what one VM decides on — its configuration, the worker table, the routers
//! (policy and prefix index), passive health and stalls — and the decision itself. Deciding
//! changes nothing but the RNG; the routers learn a decision only when it is committed.

use std::borrow::Cow;

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::dp;
use kvmesh_core::models::{serves, Pool, Pools, ServedModel};
use kvmesh_core::pd::{Partners, PdDecision, PdRouter};
use kvmesh_core::policy::{Candidate, PolicyKind};
use kvmesh_core::request::{self, ParsedRequest, RequestError, MAX_ROUTING_KEY};
use kvmesh_core::rng::{random_u64, seeded, FastRng, RngCore};
use kvmesh_core::settings::PdProtocol;
use kvmesh_core::{Config, Decision, Endpoint, Role, Router, RoutingText, WorkerId, WorkerTable};

use super::plan::{Chosen, Outcome, PdPlan, Plan, Prediction, RequestInfo};
use super::reply::Reply;
use crate::headers::Headers;
use crate::health::Health;
use crate::now::Now;
use crate::pd::{self, PrefillLeg, Split};
use crate::routed::Routed;
use crate::shared::{Delta, Inflight};
use crate::stall::Stalls;

/// With a control plane, a filter's own eviction only keeps its index under this many times
/// `max_tree_size` (the control plane's evictions do the real work).
pub const CONTROL_PLANE_EVICTION_CAP: u64 = 2;

// One per VM, built once: the size difference between a router and a PD pair of them costs
// nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Mode {
    Regular(Router),
    Pd(PdRouter),
}

fn build_mode(config: &Config) -> Mode {
    let params = config.router_params();
    match &config.pd {
        Some(pd) => Mode::Pd(PdRouter::new(params, pd.prefill_policy, pd.decode_policy, pd.decider)),
        None => Mode::Regular(Router::new(params, config.policy)),
    }
}

/// Whether a worker whose breaker is half-open may be chosen (its probe slot free): yes for
/// requests that are committed (the commit takes the slot), no for the uncounted other paths.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Probes {
    Allowed,
    Refused,
}

/// What one VM routes on.
pub(super) struct RoutingView {
    pub(super) config: Config,
    pub(super) table: WorkerTable,
    pub(super) mode: Mode,
    pub(super) rng: FastRng,
    pub(super) health: Health,
    /// Workers holding this VM's requests without answering (see [`Stalls`]).
    pub(super) stalls: Stalls,
    /// The model pools of `table` under the configuration's rules.
    pools: Pools,
    last_eviction_secs: u64,
}

/// The pools of `table`'s workers under `config`'s model rules.
fn pools_of(table: &WorkerTable, config: &Config) -> Pools {
    Pools::new(table.workers.iter().map(|w| &w.models[..]), &config.models)
}

impl RoutingView {
    pub(super) fn new(config: Config, seed: u64) -> Self {
        Self {
            table: config.workers.clone(),
            mode: build_mode(&config),
            rng: seeded(seed),
            health: Health::new(config.breaker),
            stalls: Stalls::new(config.worker_stall_ms),
            pools: pools_of(&config.workers, &config),
            last_eviction_secs: 0,
            config,
        }
    }

    /// Routes with `config` from now on (new settings from the control plane): the routers
    /// are rebuilt only when the routing changed, so the index survives a new load threshold.
    pub(super) fn reconfigure(&mut self, mut config: Config) {
        config.workers = self.table.clone();
        if config.router_params() != self.config.router_params()
            || config.policy != self.config.policy
            || config.pd != self.config.pd
        {
            self.mode = build_mode(&config);
        }
        self.health.set_params(config.breaker);
        self.stalls.set_window(config.worker_stall_ms);
        self.pools = pools_of(&self.table, &config);
        self.config = config;
    }

    /// Replaces the worker table. Index entries of ids that now name another worker (or none)
    /// are forgotten, so that no prefix is attributed to the wrong worker.
    pub(super) fn set_table(&mut self, table: WorkerTable) {
        let stale: Vec<WorkerId> = self
            .table
            .workers
            .iter()
            .filter(|old| {
                table
                    .get(old.id)
                    .is_none_or(|new| new.url != old.url || new.role != old.role || new.dp_rank != old.dp_rank)
            })
            .map(|w| w.id)
            .collect();
        for id in stale {
            match &mut self.mode {
                Mode::Regular(r) => r.forget_worker(id),
                Mode::Pd(pd) => {
                    pd.prefill_router().forget_worker(id);
                    pd.decode_router().forget_worker(id);
                }
            }
        }
        self.pools = pools_of(&table, &self.config);
        self.table = table;
    }

    /// The routers whose indexes hold `worker`'s prefixes (both PD routers' for a worker of
    /// role `both`: whichever leg it served, it holds what it computed).
    fn routers_of(&mut self, worker: WorkerId) -> (Option<&mut Router>, Option<&mut Router>) {
        let Some(role) = self.table.get(worker).map(|w| w.role) else { return (None, None) };
        match (&mut self.mode, role) {
            (Mode::Regular(r), Role::Regular) => (Some(r), None),
            (Mode::Pd(pd), Role::Prefill) => (Some(pd.prefill_router()), None),
            (Mode::Pd(pd), Role::Decode) => (Some(pd.decode_router()), None),
            (Mode::Pd(pd), Role::Both) => {
                let (prefill, decode) = pd.routers();
                (Some(prefill), Some(decode))
            }
            _ => (None, None),
        }
    }

    /// Whether a policy in force reads the routing text (only then do index changes matter).
    pub(super) fn uses_text(&mut self) -> bool {
        match &mut self.mode {
            Mode::Regular(r) => r.uses_text(),
            Mode::Pd(pd) => pd.prefill_router().uses_text() || pd.decode_router().uses_text(),
        }
    }

    /// An index change made elsewhere (another VM, the control plane, engine feedback).
    pub(super) fn apply_delta(&mut self, delta: &Delta) {
        let (first, second) = self.routers_of(delta.worker);
        for router in [first, second].into_iter().flatten() {
            if delta.evict {
                router.apply_evictions(delta.worker, &delta.hashes);
            } else {
                router.apply_insert(delta.worker, &delta.hashes);
            }
        }
    }

    fn routed(&self, worker: WorkerId, matched_bytes: usize) -> Option<Routed> {
        let w = self.table.get(worker)?;
        Some(Routed { worker, addr: w.addr.clone(), counted: false, matched_bytes, dp_rank: w.dp_rank })
    }

    /// Whether the main policy or a PD leg's is `kind`.
    pub(super) fn uses(&self, kind: PolicyKind) -> bool {
        match &self.config.pd {
            Some(pd) => pd.prefill_policy == kind || pd.decode_policy == kind,
            None => self.config.policy == kind,
        }
    }

    /// The routing key of a request with these headers: the first of the configured
    /// `routing_key_headers` present with a value of 1 to 1024 bytes, when a policy in force
    /// hashes on it (none otherwise: nothing is kept).
    pub(super) fn routing_key(&self, headers: &Headers) -> Option<String> {
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

    fn main_role(&self) -> Role {
        if matches!(self.mode, Mode::Pd(_)) {
            Role::Decode
        } else {
            Role::Regular
        }
    }

    /// The available workers of `role` with their loads: the table's plus this Envoy's
    /// in-flight counts. A worker is available when healthy and its circuit breaker admits a
    /// request (with `Probes::Refused`, only a closed breaker does). Stalled workers are left
    /// out while others are available, then overloaded ones; `.1` says that some were
    /// available but every one of them was overloaded. Only workers of `pool` count.
    fn candidates(
        &self,
        inflight: &Inflight,
        role: Role,
        now: Now,
        probes: Probes,
        pool: &Pool<'_>,
    ) -> (Vec<Candidate>, bool) {
        let available: Vec<&kvmesh_core::Worker> = self
            .table
            .healthy_with(role)
            .filter(|w| serves(&w.models, pool))
            .filter(|w| match probes {
                Probes::Allowed => self.health.available(w.id, now),
                Probes::Refused => self.health.state(w.id, now) == BreakerState::Closed,
            })
            .collect();
        let moving: Vec<&kvmesh_core::Worker> =
            available.iter().copied().filter(|w| !self.stalls.stalled(w.id, now.ms())).collect();
        let pool = if moving.is_empty() { available } else { moving };
        let (max_waiting, max_kv) = (self.config.overload_waiting, self.config.overload_kv_usage);
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

    /// Decides where an LLM request goes, on this view as it stands (refreshed by the
    /// caller) and `inflight`, the shared counts read for it.
    pub(super) fn decide(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        parsed: &ParsedRequest<'_>,
        info: &RequestInfo<'_>,
        inflight: Inflight,
    ) -> Outcome {
        let now = info.now;
        // The key the headers gave; when none did and this VM has only now learned (in the
        // refresh) that consistent hashing is in force, the headers are read again.
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
        // The pool the request's model names: its workers only, its own prefix keys.
        let pool = match self.pools.resolve(parsed.model.as_deref()) {
            Ok(pool) => pool,
            Err(e) => return Outcome::Reply(Reply::model(&e)),
        };
        let text = RoutingText::from(parsed).with_key(key).for_model(pool.key);
        let model = pool.name.map(Box::from);
        let (main_cands, main_full) = self.candidates(&inflight, self.main_role(), now, Probes::Allowed, &pool);
        let (prefill, prefill_full) = match self.mode {
            Mode::Pd(_) => self.candidates(&inflight, Role::Prefill, now, Probes::Allowed, &pool),
            Mode::Regular(_) => (Vec::new(), false),
        };
        // Only the gateway writes transfer parameters, in every mode: a client's could name
        // any host for a worker to exchange KV with (a regular vLLM worker launched with a KV
        // connector acts on `kv_transfer_params`, and the blocks it pulls would serve other
        // clients' prefixes from its cache).
        if let Some(field) = parsed.client_bootstrap {
            return Outcome::Reply(Reply::request(&RequestError::Reserved(field)));
        }
        // A decode worker takes a request only with a partner, or alone as a `both` worker.
        let pairs = Pairs { table: &self.table, default: self.default_protocol(), prefill: &prefill };
        let decode: Vec<Candidate> = match self.mode {
            Mode::Pd(_) => main_cands.iter().filter(|d| pairs.can_serve(d.id)).cloned().collect(),
            Mode::Regular(_) => Vec::new(),
        };
        let chosen = match &self.mode {
            Mode::Regular(router) => match router.decide(text, &main_cands, &mut self.rng) {
                Some(d) => Chosen::Regular(d),
                None => return Outcome::Reply(Reply::no_worker_or_full("worker", main_full)),
            },
            Mode::Pd(pd) => match pd.decide_paired(text, &decode, |d| pairs.partners(d), &mut self.rng) {
                Some(d) => Chosen::Pd(d),
                None if main_cands.is_empty() => {
                    return Outcome::Reply(Reply::no_worker_or_full("decode worker", main_full))
                }
                None if decode.is_empty() && !prefill.is_empty() => {
                    return Outcome::Reply(Reply::no_worker("prefill worker speaking a decode worker's PD protocol"))
                }
                None => return Outcome::Reply(Reply::no_worker_or_full("prefill worker", prefill_full)),
            },
        };
        let (main, prefill) = match &chosen {
            Chosen::Regular(d) | Chosen::Pd(PdDecision::DecodeOnly(d)) => (d, None),
            Chosen::Pd(PdDecision::Split { prefill, decode }) => (decode, Some(prefill)),
        };
        let Some(main_routed) = self.routed(main.worker, main.matched_bytes) else {
            return Outcome::Reply(Reply::no_worker("worker"));
        };
        let protocol =
            self.table.get(main.worker).map_or(self.default_protocol(), |w| w.protocol(self.default_protocol()));
        let mut main_cands = main_cands;
        if matches!(self.mode, Mode::Pd(_)) {
            // Envoy fails a PD request over only to decode workers speaking the same protocol,
            // and never to its own prefill worker.
            let same = |c: &Candidate| {
                self.table.get(c.id).is_some_and(|w| w.protocol(self.default_protocol()) == protocol)
                    && prefill.is_none_or(|p| p.worker != c.id)
            };
            main_cands.retain(same);
        }
        let fallbacks = self.fallbacks(main_cands, main.worker, now);
        // A data-parallel rank is named in the body (regular mode; see docs/configuration.md
        // for PD); a PD request run on the decode worker alone gets the gateway's rid.
        let pd_mode = matches!(self.mode, Mode::Pd(_));
        let mut rid = None;
        let ranked = match (prefill, main_routed.dp_rank) {
            (None, Some(rank)) if !pd_mode => dp::with_rank(body, parsed, rank).map(Some),
            (None, _) if pd_mode => {
                let rng = &mut self.rng;
                let random = || random_u64().unwrap_or_else(|_| rng.next_u64());
                PrefillLeg::alone(protocol, body, parsed, random).map(|alone| {
                    alone.map(|(body, own)| {
                        rid = Some(own);
                        body
                    })
                })
            }
            _ => Ok(None),
        };
        let ranked = match ranked {
            Ok(b) => b.map(Vec::into_boxed_slice),
            Err(e) => return Outcome::Reply(Reply::request(&e)),
        };
        let pd = match prefill {
            None => None,
            Some(p) => match self.pd_plan(endpoint, body, parsed, p, protocol) {
                Ok(plan) => Some(plan),
                Err(reply) => return Outcome::Reply(reply),
            },
        };
        let batch = parsed.batch.is_some();
        Outcome::Route(Plan {
            chosen,
            main: main_routed,
            fallbacks,
            pd,
            body: ranked,
            rid,
            inflight,
            now,
            batch,
            model,
        })
    }

    /// The deployment's PD protocol (a worker may speak another, [`kvmesh_core::Worker::protocol`]).
    fn default_protocol(&self) -> PdProtocol {
        self.config.pd.as_ref().map_or(pd::DEFAULT, |pd| pd.protocol)
    }

    /// The prefill leg of a split in the pair's `protocol`: its worker and that protocol's
    /// plan (`crate::pd`).
    fn pd_plan(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        parsed: &ParsedRequest<'_>,
        prefill: &Decision,
        protocol: PdProtocol,
    ) -> Result<Box<PdPlan>, Reply> {
        let Some(routed) = self.routed(prefill.worker, prefill.matched_bytes) else {
            return Err(Reply::no_worker("prefill worker"));
        };
        let Some(worker) = self.table.get(prefill.worker) else {
            return Err(Reply::no_worker("prefill worker"));
        };
        // Over the whole routing text, as sglang-router's match rate.
        let text_len = parsed.text_len.max(parsed.text.len()) as f64;
        let cache_hit = prefill.matched_bytes as f64 > self.config.cache_aware.cache_threshold * text_len;
        let rng = &mut self.rng;
        let random = || random_u64().unwrap_or_else(|_| rng.next_u64());
        let split = Split { endpoint, body, parsed, prefill: worker };
        let leg = PrefillLeg::plan(protocol, &split, random).map_err(|e| Reply::request(&e))?;
        let merge_logprobs = leg.merges_logprobs();
        Ok(Box::new(PdPlan { prefill: routed, leg, merge_logprobs, stream: parsed.stream, cache_hit }))
    }

    /// Where Envoy fails over to when `chosen` fails: the other candidates, least loaded
    /// first (ties in random order), at most `max_attempts - 1` of them. Envoy sends the same
    /// body to each, so with data-parallel ranks only the same rank of other workers can take
    /// it (the body names the rank), each address once.
    fn fallbacks(&mut self, mut cands: Vec<Candidate>, chosen: WorkerId, now: Now) -> Vec<String> {
        let room = (self.config.max_attempts as usize).saturating_sub(1);
        let (addr, rank) = self.table.get(chosen).map_or((None, None), |w| (Some(w.addr.as_str()), w.dp_rank));
        let elsewhere =
            |c: &Candidate| self.table.get(c.id).is_some_and(|w| Some(w.addr.as_str()) != addr && w.dp_rank == rank);
        // Only workers whose breaker is closed: Envoy's attempts are not probes the breaker
        // could account for.
        cands.retain(|c| c.id != chosen && elsewhere(c) && self.health.state(c.id, now) == BreakerState::Closed);
        if room == 0 || cands.is_empty() {
            return Vec::new();
        }
        let start = (self.rng.next_u32() as usize) % cands.len();
        cands.rotate_left(start);
        cands.sort_by_key(|c| c.load);
        cands.iter().take(room).filter_map(|c| self.table.get(c.id)).map(|w| w.addr.clone()).collect()
    }

    /// A request on another path (models, health, info) to any available worker (a decode
    /// worker in PD mode), and where Envoy fails it over to.
    pub(super) fn route_other(&mut self, inflight: &Inflight, now: Now) -> Result<(Routed, Vec<String>), Reply> {
        let (cands, _) = self.candidates(inflight, self.main_role(), now, Probes::Refused, &Pool::ANY);
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

    /// `GET /v1/models` (`id` none) or `/v1/models/{id}`, answered from the table: the names
    /// the healthy workers serve (adapters with their parent), once each. None when no worker
    /// has said what it serves (the request then goes to a worker, as other read-only paths).
    pub(super) fn models_reply(&self, id: Option<&str>) -> Option<Reply> {
        if self.pools.names().is_empty() {
            return None;
        }
        let mut served: Vec<&ServedModel> =
            self.table.iter().filter(|w| w.healthy).flat_map(|w| w.models.iter()).collect();
        served.sort_by(|a, b| a.id.cmp(&b.id));
        served.dedup_by(|a, b| a.id == b.id);
        Some(match id {
            None => Reply::models(&served),
            Some(id) => match served.iter().find(|m| m.id == id) {
                Some(m) => Reply::model_card(m),
                None => Reply::model(&kvmesh_core::models::ModelError::Unknown(id.to_string())),
            },
        })
    }

    /// What the index believed the chosen worker held, read before the decision's insert: its
    /// own match (a policy that chose by load reports none, though the worker may hold part
    /// of the prompt). A partial last block counts whole (within the one-block tolerance).
    pub(super) fn prediction(&self, chosen: &Chosen, batch: bool) -> Option<Prediction> {
        match (chosen, &self.mode) {
            (Chosen::Regular(d), Mode::Regular(_)) if !batch && !d.blocks.is_empty() => {
                let bytes = d.held_blocks.saturating_mul(self.config.block_size).max(d.matched_bytes);
                Some(Prediction::new(d.worker, bytes, &d.blocks, self.config.block_size))
            }
            _ => None,
        }
    }

    /// The routers learn a committed decision (its prefix is indexed for its workers).
    pub(super) fn commit(&mut self, chosen: &Chosen) {
        match (&mut self.mode, chosen) {
            (Mode::Regular(router), Chosen::Regular(d)) => router.commit(d),
            (Mode::Pd(pd), Chosen::Pd(d)) => pd.commit(d),
            // The mode cannot change between deciding and committing (same callback).
            _ => {}
        }
    }

    /// The worker at `addr` (`ip:port`, as Envoy reports the upstream it used) that is rank
    /// `rank` (a request's fallbacks are its own rank of other workers).
    pub(super) fn worker_at(&self, addr: &str, rank: Option<u32>) -> Option<WorkerId> {
        self.table.iter().find(|w| w.is_at(addr, rank)).map(|w| w.id)
    }

    /// LRU eviction every `eviction_interval_secs`; returns the number of blocks evicted when
    /// it ran. With a control plane, evictions come from it (its global LRU, as deltas), so
    /// that every gateway forgets the same blocks; locally the index is only capped, at
    /// [`CONTROL_PLANE_EVICTION_CAP`] times `max_tree_size`, in case the control plane is away.
    pub(super) fn evict_when_due(&mut self, now_secs: u64) -> Option<usize> {
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

    /// Keeps each router's index to its entry bound (the tick's part: see [`kvmesh_core::router::Router::bound`]).
    pub(super) fn bound_indexes(&mut self) -> usize {
        match &mut self.mode {
            Mode::Regular(r) => r.bound(),
            Mode::Pd(pd) => pd.prefill_router().bound() + pd.decode_router().bound(),
        }
    }

    /// Whether requests are routed by their `model` (see [`Pools::by_model`]).
    pub(super) fn routes_by_model(&self) -> bool {
        self.pools.by_model()
    }

    /// Blocks in this VM's prefix index (both legs' in PD mode).
    pub(super) fn index_len(&mut self) -> usize {
        match &mut self.mode {
            Mode::Regular(r) => r.index().len(),
            Mode::Pd(pd) => pd.prefill_router().index().len() + pd.decode_router().index().len(),
        }
    }
}

/// Who pairs with whom in PD mode: a prefill and a decode worker pair when they speak the same
/// PD protocol (a worker's own, else the deployment's) and are not the same worker (one of role
/// `both`); a `both` worker with nobody to pair with runs a request alone.
struct Pairs<'a> {
    table: &'a WorkerTable,
    default: PdProtocol,
    /// The available prefill workers.
    prefill: &'a [Candidate],
}

impl<'a> Pairs<'a> {
    fn protocol(&self, id: WorkerId) -> Option<PdProtocol> {
        self.table.get(id).map(|w| w.protocol(self.default))
    }

    /// Whether decode worker `decode` can take a request: it has a partner, or runs alone.
    fn can_serve(&self, decode: WorkerId) -> bool {
        let alone = self.table.get(decode).is_some_and(|w| w.role == Role::Both);
        alone || self.prefill.iter().any(|p| self.pairs(p.id, decode))
    }

    fn pairs(&self, prefill: WorkerId, decode: WorkerId) -> bool {
        prefill != decode && self.protocol(prefill).is_some() && self.protocol(prefill) == self.protocol(decode)
    }

    /// The prefill candidates that pair with `decode`.
    fn partners(&self, decode: WorkerId) -> Partners<'a> {
        let prefill = if self.prefill.iter().all(|p| self.pairs(p.id, decode)) {
            Cow::Borrowed(self.prefill)
        } else {
            Cow::Owned(self.prefill.iter().filter(|p| self.pairs(p.id, decode)).cloned().collect())
        };
        Partners { prefill, alone: self.table.get(decode).is_some_and(|w| w.role == Role::Both) }
    }
}
