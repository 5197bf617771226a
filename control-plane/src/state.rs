//! The control plane's state: the worker registry (static, API and discovery sources), their
//! health and load, the global prefix index merged from every gateway's reports, and the
//! versioned snapshots streamed to the filters (full on connect, deltas after).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvmesh_core::index::PrefixIndex;
use kvmesh_core::policy::{utility_scores, UtilityWindow};
use kvmesh_proto::v1::{
    BreakerState, Feedback, IndexEvict, IndexInsert, ReportBatch, Role, Snapshot, Worker, WorkerCounts,
};
use prometheus_client::metrics::counter::Counter;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::capacity;
use crate::feedback::FeedbackTotals;
use crate::settings::Settings;

/// Where a worker came from (discovery only removes what it added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Static,
    Api,
    Discovery,
}

/// How full a worker is: requests waiting in its queue, fraction of its KV cache in use (as
/// the load poll reads them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    pub waiting: Option<u64>,
    pub kv_usage: Option<f64>,
}

#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub id: u32,
    pub url: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    pub source: Source,
    pub healthy: bool,
    /// Added through the API and not yet probed: unhealthy (no traffic) until its first
    /// health check passes.
    awaiting_probe: bool,
    fails: u32,
    oks: u32,
    /// Load the worker reports (`/get_load` or `/metrics`).
    pub polled_load: Option<u64>,
    /// The worker's own cache hit rate, when its `/metrics` says.
    pub cache_hit_rate: Option<f64>,
    /// Its queue and KV cache, when it says (`/get_load`, `/metrics`).
    pub pressure: Pressure,
    /// In-flight requests per gateway, as reported.
    pub inflight: HashMap<String, u32>,
    /// Finished and failed requests, summed over gateways.
    pub requests: u64,
    pub errors: u64,
    /// Requests the gateways moved from this worker to another, summed over gateways.
    pub failovers: u64,
    /// Each gateway's last cumulative (wrapping) counts, to add the differences.
    last_counts: HashMap<String, LastCounts>,
    /// The circuit breaker of each gateway with a live report stream, where it is not closed.
    pub breakers: HashMap<String, BreakerState>,
    /// The KV capacity in tokens the worker reported (`/get_server_info`).
    pub kv_capacity_reported: Option<u64>,
    /// Engine feedback summed over the gateways.
    pub feedback: FeedbackTotals,
    /// marginal_utility: the last completed requests (from the gateways' completion metrics)
    /// and the score they give, shipped to the filters.
    pub window: UtilityWindow,
    pub utility: Option<f64>,
}

/// One gateway's last cumulative counts for one worker.
#[derive(Clone, Debug, Default)]
struct LastCounts {
    requests: u32,
    errors: u32,
    failovers: u32,
    feedback: Feedback,
    /// When these counts arrived (ms since the epoch; 0: never).
    at_ms: u64,
}

impl WorkerEntry {
    pub fn inflight_total(&self) -> u64 {
        self.inflight.values().map(|&n| u64::from(n)).sum()
    }

    /// The worker's circuit breaker over the gateways: `open` when any gateway has it open,
    /// else `half_open` when any is probing it, else `closed`.
    pub fn circuit_breaker(&self) -> &'static str {
        let any = |state| self.breakers.values().any(|&b| b == state);
        if any(BreakerState::Open) {
            "open"
        } else if any(BreakerState::HalfOpen) {
            "half_open"
        } else {
            "closed"
        }
    }

    /// How many gateways have the worker's circuit breaker open.
    pub fn breakers_open(&self) -> usize {
        self.breakers.values().filter(|&&b| b == BreakerState::Open).count()
    }

    /// The load filters see: the worker's own report, else the gateways' in-flight sum.
    pub fn load(&self) -> u64 {
        self.polled_load.unwrap_or_else(|| self.inflight_total())
    }

    /// A worker just registered: no probes, loads or counts yet. `awaiting_probe`: unhealthy
    /// (no traffic) until its first health check passes.
    fn new(id: u32, url: &str, role: Role, bootstrap_port: Option<u16>, source: Source, awaiting_probe: bool) -> Self {
        Self {
            id,
            url: url.to_string(),
            role,
            bootstrap_port,
            source,
            healthy: !awaiting_probe,
            awaiting_probe,
            fails: 0,
            oks: 0,
            polled_load: None,
            cache_hit_rate: None,
            pressure: Default::default(),
            inflight: HashMap::new(),
            requests: 0,
            errors: 0,
            failovers: 0,
            breakers: HashMap::new(),
            last_counts: HashMap::new(),
            kv_capacity_reported: None,
            feedback: FeedbackTotals::default(),
            window: UtilityWindow::default(),
            utility: None,
        }
    }

    /// A bare entry (tests of modules that read the table).
    #[cfg(test)]
    pub fn for_test(url: &str, healthy: bool) -> Self {
        Self { healthy, ..Self::new(0, url, Role::Regular, None, Source::Static, false) }
    }

    fn proto(&self) -> Worker {
        Worker {
            id: self.id,
            url: self.url.clone(),
            role: self.role as i32,
            healthy: self.healthy,
            load: self.load(),
            bootstrap_port: self.bootstrap_port.map(u32::from),
            waiting: self.pressure.waiting,
            kv_usage: self.pressure.kv_usage,
            utility: self.utility,
        }
    }
}

/// What `--state-file` keeps across restarts: the workers added through the API, and every
/// worker's id by URL, so that static, API and discovered workers keep their ids (filters'
/// index entries stay right) and ids are never reused.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Persisted {
    pub next_id: u32,
    pub ids: BTreeMap<String, u32>,
    pub api_workers: Vec<PersistedWorker>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PersistedWorker {
    pub url: String,
    pub role: String,
    pub bootstrap_port: Option<u16>,
}

/// Most ids of workers not registered now that the state file remembers.
const MAX_REMEMBERED: usize = 4096;

#[derive(Default)]
struct Inner {
    workers: BTreeMap<u32, WorkerEntry>,
    ids: HashMap<String, u32>,
    /// Ids from the state file for URLs not registered (yet) since the start.
    remembered: HashMap<String, u32>,
    next_id: u32,
    index: PrefixIndex,
    version: u64,
    published_at: Option<Instant>,
    pending_inserts: Vec<IndexInsert>,
    pending_evictions: Vec<IndexEvict>,
    workers_dirty: bool,
    gateways: HashMap<String, Gateway>,
}

/// What kvmesh-cp keeps about one gateway (one Envoy).
#[derive(Debug)]
struct Gateway {
    seen: Instant,
    /// Open `Report` streams under this id (two while the stream moves between VMs).
    reporting: u32,
    /// The insert budget: a token bucket of hashes.
    budget: f64,
    budget_at: Instant,
}

/// Most gateway ids kvmesh-cp keeps at once; past it, new ids are refused.
pub const MAX_GATEWAYS: usize = 1024;
/// Longest gateway id, in bytes.
pub const MAX_GATEWAY_ID: usize = 128;
/// A reporting gateway silent this long no longer counts in flight.
pub const INFLIGHT_TTL: Duration = Duration::from_secs(30);
/// A gateway gone this long is forgotten (with the cumulative counts it reported: should it
/// come back after that, its counts are taken anew).
pub const GATEWAY_TTL: Duration = Duration::from_secs(3600);

/// Why a gateway is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum GatewayError {
    BadId(String),
    TooMany,
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadId(why) => write!(f, "bad gateway_id: {why}"),
            Self::TooMany => write!(f, "kvmesh-cp already tracks {MAX_GATEWAYS} gateways"),
        }
    }
}

/// A gateway id is 1 to [`MAX_GATEWAY_ID`] visible ASCII characters.
pub fn check_gateway_id(id: &str) -> Result<(), GatewayError> {
    if id.is_empty() || id.len() > MAX_GATEWAY_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(GatewayError::BadId(format!("must be 1 to {MAX_GATEWAY_ID} visible ASCII characters")));
    }
    Ok(())
}

/// Monotonic counters; the `/metrics` registry holds the same handles.
#[derive(Default, Debug, Clone)]
pub struct Counters {
    /// Gateway report batches merged.
    pub reports: Counter,
    /// Report entries naming unknown workers, and report streams that did not decode.
    pub bad_reports: Counter,
    /// Blocks evicted from the global index.
    pub evicted_blocks: Counter,
    /// Of those, blocks a worker's own response showed it no longer held (engine feedback).
    pub stale_blocks: Counter,
    /// Snapshot deltas pushed.
    pub deltas: Counter,
    /// gRPC streams and admin requests refused for a missing or wrong credential.
    pub auth_failures: Counter,
    /// Reported index hashes dropped by the limits (per report, per second per gateway).
    pub dropped_inserts: Counter,
}

pub struct State {
    pub settings: Settings,
    inner: Mutex<Inner>,
    pub counters: Counters,
    deltas: broadcast::Sender<Arc<Snapshot>>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl State {
    /// The state without a state file (tests).
    #[cfg(test)]
    pub fn new(settings: Settings) -> Arc<Self> {
        Self::build(settings, Persisted::default())
    }

    /// The state, with what `--state-file` kept (a missing file is a first start).
    pub fn open(settings: Settings) -> Result<Arc<Self>, String> {
        let persisted = match &settings.state_file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => serde_json::from_str(&text).map_err(|e| format!("--state-file {}: {e}", path.display()))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Persisted::default(),
                Err(e) => return Err(format!("--state-file {}: {e}", path.display())),
            },
            None => Persisted::default(),
        };
        Ok(Self::build(settings, persisted))
    }

    fn build(settings: Settings, persisted: Persisted) -> Arc<Self> {
        let (deltas, _) = broadcast::channel(1024);
        let inner = Inner {
            next_id: persisted.next_id,
            remembered: persisted.ids.into_iter().collect(),
            // Each report bounds the workers it names to their capacity: by recency, not scans.
            index: PrefixIndex::with_recency(),
            ..Default::default()
        };
        let state = Arc::new(Self { settings, inner: Mutex::new(inner), counters: Counters::default(), deltas });
        let s = &state.settings;
        for url in &s.workers {
            let _ = state.add_worker(url, Role::Regular, None, Source::Static);
        }
        for (url, port) in &s.prefill {
            let _ = state.add_worker(url, Role::Prefill, *port, Source::Static);
        }
        for url in &s.decode {
            let _ = state.add_worker(url, Role::Decode, None, Source::Static);
        }
        for w in persisted.api_workers {
            let role = match w.role.as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                _ => Role::Regular,
            };
            if let Err(e) = state.add_worker(&w.url, role, w.bootstrap_port, Source::Api) {
                tracing::warn!(url = %w.url, "worker from the state file not restored: {e}");
            }
        }
        state.persist();
        state
    }

    /// Writes `--state-file` (a new file renamed over the old one).
    fn persist(&self) {
        let Some(path) = &self.settings.state_file else { return };
        let persisted = {
            let inner = self.lock();
            let mut ids: BTreeMap<String, u32> =
                inner.remembered.iter().take(MAX_REMEMBERED).map(|(u, &id)| (u.clone(), id)).collect();
            ids.extend(inner.workers.values().map(|w| (w.url.clone(), w.id)));
            Persisted {
                next_id: inner.next_id,
                ids,
                api_workers: inner
                    .workers
                    .values()
                    .filter(|w| w.source == Source::Api)
                    .map(|w| PersistedWorker {
                        url: w.url.clone(),
                        role: role_name(w.role).into(),
                        bootstrap_port: w.bootstrap_port,
                    })
                    .collect(),
            }
        };
        let tmp = path.with_extension("tmp");
        let written = serde_json::to_vec_pretty(&persisted)
            .map_err(|e| e.to_string())
            .and_then(|bytes| std::fs::write(&tmp, bytes).map_err(|e| e.to_string()))
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
        if let Err(e) = written {
            tracing::error!(path = %path.display(), "cannot write the state file: {e}");
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a worker (ids are never reused, so filters' index entries stay unambiguous).
    pub fn add_worker(
        &self,
        url: &str,
        role: Role,
        bootstrap_port: Option<u16>,
        source: Source,
    ) -> Result<u32, String> {
        crate::urls::check(url, &self.settings.worker_policy)?;
        let mut inner = self.lock();
        if let Some(&id) = inner.ids.get(url) {
            return Err(format!("worker {url} is already registered (id {id})"));
        }
        // The id this URL had before a restart, if the state file says and it is free.
        let id = match inner.remembered.remove(url) {
            Some(id) if !inner.workers.contains_key(&id) => id,
            _ => inner.next_id,
        };
        inner.next_id = inner.next_id.max(id.saturating_add(1));
        inner.ids.insert(url.to_string(), id);
        // A worker someone named at runtime gets traffic only once it answered a health check.
        let awaiting_probe = source == Source::Api && self.settings.health_checks;
        let entry = WorkerEntry::new(id, url, role, bootstrap_port, source, awaiting_probe);
        inner.workers.insert(id, entry);
        inner.workers_dirty = true;
        drop(inner);
        tracing::info!(url, ?role, id, ?source, "worker added");
        self.persist();
        Ok(id)
    }

    pub fn remove_worker(&self, url: &str) -> bool {
        let mut inner = self.lock();
        let Some(id) = inner.ids.remove(url) else { return false };
        inner.workers.remove(&id);
        inner.index.remove_worker(id);
        inner.workers_dirty = true;
        drop(inner);
        tracing::info!(url, id, "worker removed");
        self.persist();
        true
    }

    pub fn workers(&self) -> Vec<WorkerEntry> {
        self.lock().workers.values().cloned().collect()
    }

    pub fn index_size_of(&self, id: u32) -> u64 {
        self.lock().index.size_of(id)
    }

    /// Applies one health-check result with the failure/success thresholds.
    pub fn health_result(&self, id: u32, ok: bool) {
        let (fail_at, ok_at) = (self.settings.health_failure_threshold, self.settings.health_success_threshold);
        let mut inner = self.lock();
        let Some(w) = inner.workers.get_mut(&id) else { return };
        let was = w.healthy;
        if ok {
            w.fails = 0;
            w.oks += 1;
            if !w.healthy && (w.oks >= ok_at || w.awaiting_probe) {
                w.healthy = true;
            }
            w.awaiting_probe = false;
        } else {
            w.oks = 0;
            w.fails += 1;
            if w.healthy && w.fails >= fail_at {
                w.healthy = false;
            }
        }
        if was != w.healthy {
            tracing::warn!(url = %w.url, healthy = w.healthy, "worker health changed");
            inner.workers_dirty = true;
        }
    }

    pub fn load_result(&self, id: u32, load: Option<u64>, cache_hit_rate: Option<f64>) {
        let mut inner = self.lock();
        let Some(w) = inner.workers.get_mut(&id) else { return };
        if cache_hit_rate.is_some() {
            w.cache_hit_rate = cache_hit_rate;
        }
        if w.polled_load != load {
            w.polled_load = load;
            inner.workers_dirty = true;
        }
    }

    /// How full worker `id` is, as just polled.
    pub fn pressure_result(&self, id: u32, pressure: Pressure) {
        let mut inner = self.lock();
        let Some(w) = inner.workers.get_mut(&id) else { return };
        if w.pressure != pressure {
            w.pressure = pressure;
            inner.workers_dirty = true;
        }
    }

    /// A `Report` stream of `gateway` opened: it is tracked (up to [`MAX_GATEWAYS`]) until the
    /// last of its streams closes.
    pub fn report_stream_opened(&self, gateway: &str) -> Result<(), GatewayError> {
        check_gateway_id(gateway)?;
        let mut inner = self.lock();
        let now = Instant::now();
        let burst = self.burst();
        if !inner.gateways.contains_key(gateway) && inner.gateways.len() >= MAX_GATEWAYS {
            return Err(GatewayError::TooMany);
        }
        let g = inner.gateways.entry(gateway.to_string()).or_insert(Gateway {
            seen: now,
            reporting: 0,
            budget: burst,
            budget_at: now,
        });
        g.reporting += 1;
        g.seen = now;
        Ok(())
    }

    /// A `Report` stream of `gateway` ended. When it was the last one, the gateway's in-flight
    /// counts are dropped (its requests no longer count as load), and so are its circuit
    /// breakers; its cumulative counts are kept, so that the same gateway reporting again is
    /// not counted twice.
    pub fn report_stream_closed(&self, gateway: &str) {
        let mut inner = self.lock();
        let Some(g) = inner.gateways.get_mut(gateway) else { return };
        g.reporting = g.reporting.saturating_sub(1);
        g.seen = Instant::now();
        if g.reporting == 0 {
            Self::drop_inflight(&mut inner, gateway);
        }
    }

    /// Forgets what `gateway` said about now: its in-flight counts and breaker states.
    fn drop_inflight(inner: &mut Inner, gateway: &str) {
        let mut changed = false;
        for w in inner.workers.values_mut() {
            w.breakers.remove(gateway);
            if w.inflight.remove(gateway).is_some_and(|n| n != 0) && w.polled_load.is_none() {
                changed = true;
            }
        }
        inner.workers_dirty |= changed;
    }

    /// Forgets the in-flight counts of gateways silent for [`INFLIGHT_TTL`] and gateways gone
    /// for [`GATEWAY_TTL`]. Returns how many gateways are left.
    pub fn prune_gateways(&self, now: Instant) -> usize {
        let mut inner = self.lock();
        let silent: Vec<String> = inner
            .gateways
            .iter()
            .filter(|(_, g)| now.saturating_duration_since(g.seen) >= INFLIGHT_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &silent {
            Self::drop_inflight(&mut inner, id);
        }
        let gone: Vec<String> = inner
            .gateways
            .iter()
            .filter(|(_, g)| g.reporting == 0 && now.saturating_duration_since(g.seen) >= GATEWAY_TTL)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            inner.gateways.remove(id);
            for w in inner.workers.values_mut() {
                w.last_counts.remove(id);
            }
        }
        inner.gateways.len()
    }

    /// Hashes a gateway may report at once (four seconds' worth).
    fn burst(&self) -> f64 {
        self.settings.limits.max_inserts_per_sec as f64 * 4.0
    }

    /// Merges one gateway report. Entries naming unknown workers are dropped and counted;
    /// so are hashes past the per-report limit and the gateway's rate. The global index stays
    /// within `max_index_entries` (evicting the least recently used at once past 1/8 slack).
    pub fn report(&self, batch: ReportBatch) {
        self.report_at(batch, now_ms());
    }

    /// [`report`](Self::report) arriving at `at_ms` (ms since the epoch): its inserts within
    /// the gateway's budget, each worker it named bounded to its KV capacity, its stale blocks
    /// forgotten, the whole index bounded, then its counts; counted once the lock is released.
    fn report_at(&self, batch: ReportBatch, at_ms: u64) {
        let ReportBatch { gateway_id, inserts, counts, stale } = batch;
        let gateway = if gateway_id.is_empty() { "unknown".to_string() } else { gateway_id };
        let mut tally = Tally::default();
        {
            let mut inner = self.lock();
            let touched = self.merge_inserts(&mut inner, &gateway, inserts, &mut tally);
            self.bound_to_capacity(&mut inner, touched, &mut tally);
            self.forget_stale(&mut inner, stale, &mut tally);
            self.bound_total(&mut inner, &mut tally);
            self.merge_counts(&mut inner, &gateway, &counts, at_ms, &mut tally);
        }
        if tally.bad > 0 {
            tracing::warn!(bad = tally.bad, "report names unknown workers; entries dropped");
        }
        if tally.dropped > 0 {
            tracing::debug!(dropped = tally.dropped, "report over its limits; hashes dropped");
        }
        self.counters.reports.inc();
        self.counters.bad_reports.inc_by(tally.bad);
        self.counters.dropped_inserts.inc_by(tally.dropped);
        self.counters.evicted_blocks.inc_by(tally.evicted);
    }

    /// How many hashes `gateway` may report now: its budget refilled for the time since it
    /// last reported, within the per-report limit.
    fn insert_allowance(&self, inner: &mut Inner, gateway: &str) -> usize {
        let now = Instant::now();
        let (rate, burst) = (self.settings.limits.max_inserts_per_sec as f64, self.burst());
        match inner.gateways.get_mut(gateway) {
            Some(g) => {
                g.seen = now;
                g.budget = (g.budget + now.saturating_duration_since(g.budget_at).as_secs_f64() * rate).min(burst);
                g.budget_at = now;
                (g.budget as usize).min(self.settings.limits.max_inserts_per_report)
            }
            // Reports outside a tracked stream (tests): the per-report limit only.
            None => self.settings.limits.max_inserts_per_report,
        }
    }

    /// Adds the reported blocks within the gateway's allowance (the news go out as inserts
    /// naming the gateway); returns the workers they named.
    fn merge_inserts(
        &self,
        inner: &mut Inner,
        gateway: &str,
        inserts: Vec<IndexInsert>,
        tally: &mut Tally,
    ) -> Vec<u32> {
        let mut allowed = self.insert_allowance(inner, gateway);
        let mut taken = 0usize;
        let mut touched: Vec<u32> = Vec::new();
        for insert in inserts {
            if !inner.workers.contains_key(&insert.worker) {
                tally.bad += 1;
                continue;
            }
            let n = insert.hashes.len().min(allowed);
            tally.dropped += (insert.hashes.len() - n) as u64;
            allowed -= n;
            taken += n;
            let Some(hashes) = insert.hashes.get(..n) else { continue };
            let mut added = Vec::new();
            inner.index.insert_reporting(insert.worker, hashes, |h| added.push(h));
            if !touched.contains(&insert.worker) {
                touched.push(insert.worker);
            }
            if !added.is_empty() {
                inner.pending_inserts.push(IndexInsert {
                    worker: insert.worker,
                    hashes: added,
                    origin: gateway.to_string(),
                });
            }
        }
        if let Some(g) = inner.gateways.get_mut(gateway) {
            g.budget = (g.budget - taken as f64).max(0.0);
        }
        touched
    }

    /// Each worker with a known KV capacity stays within it: its least recently used blocks
    /// go at once (--max-tree-size waits for the periodic eviction, as in sglang-router,
    /// whether the capacity is known or not).
    fn bound_to_capacity(&self, inner: &mut Inner, touched: Vec<u32>, tally: &mut Tally) {
        for worker in touched {
            let Some(capacity) = inner.workers.get(&worker).and_then(|w| self.kv_capacity(w)) else { continue };
            let bound = capacity::capacity_blocks(&self.settings, capacity);
            let out = inner.index.evict_worker_to(worker, bound);
            if !out.is_empty() {
                tally.evicted += out.len() as u64;
                inner.pending_evictions.push(IndexEvict { worker, hashes: out });
            }
        }
    }

    /// Blocks a worker's response showed it no longer held: every gateway forgets them.
    fn forget_stale(&self, inner: &mut Inner, stale: Vec<IndexEvict>, tally: &mut Tally) {
        for stale in stale {
            if !inner.workers.contains_key(&stale.worker) {
                tally.bad += 1;
                continue;
            }
            let n = stale.hashes.len().min(self.settings.limits.max_inserts_per_report);
            let Some(hashes) = stale.hashes.get(..n) else { continue };
            let before = inner.index.size_of(stale.worker);
            for &h in hashes {
                inner.index.remove(h, stale.worker);
            }
            let gone = before.saturating_sub(inner.index.size_of(stale.worker));
            self.counters.stale_blocks.inc_by(gone);
            tally.evicted += gone;
            inner.pending_evictions.push(IndexEvict { worker: stale.worker, hashes: hashes.to_vec() });
        }
    }

    /// The global index stays within `max_index_entries`: past it and 1/8 slack, the least
    /// recently used entries go at once.
    fn bound_total(&self, inner: &mut Inner, tally: &mut Tally) {
        let max = self.settings.limits.max_index_entries;
        if inner.index.entries() > max.saturating_add(max / 8) {
            let out = inner.index.evict_total_to(max);
            tally.evicted += out.len() as u64;
            push_evictions(inner, out);
        }
    }

    /// The gateway's counts: every worker's in-flight and breaker as this gateway sees them,
    /// its cumulative counts by difference, and the utility scores they give. A batch without
    /// counts (a chunk of the full report on connect) leaves them be.
    fn merge_counts(&self, inner: &mut Inner, gateway: &str, counts: &[WorkerCounts], at_ms: u64, tally: &mut Tally) {
        if counts.is_empty() {
            return;
        }
        let window = self.settings.utility.map(|u| u.window_size);
        let mut changed = false;
        for w in inner.workers.values_mut() {
            changed |= match counts.iter().find(|c| c.worker == w.id) {
                Some(c) => merge_worker_counts(w, gateway, c, window, at_ms),
                None => not_counted(w, gateway),
            };
        }
        tally.bad += counts.iter().filter(|c| !inner.workers.contains_key(&c.worker)).count() as u64;
        changed |= self.score_utility(inner, at_ms);
        inner.workers_dirty |= changed;
    }

    /// marginal_utility: every worker's score from its window at `now_ms`, z-scored among the
    /// workers of its role (prefill, decode and regular workers are separate pools). Scores
    /// are rounded to 1/1000 so that noise does not republish the table; says whether one
    /// changed.
    fn score_utility(&self, inner: &mut Inner, now_ms: u64) -> bool {
        let Some(params) = self.settings.utility else { return false };
        let mut changed = false;
        for role in [Role::Regular, Role::Prefill, Role::Decode] {
            let ids: Vec<u32> = inner.workers.values().filter(|w| w.role == role).map(|w| w.id).collect();
            let trends: Vec<_> = ids
                .iter()
                .map(|id| inner.workers.get(id).and_then(|w| w.window.trend(params.min_history, now_ms)))
                .collect();
            let scores = utility_scores(&trends, params.throughput_weight, params.latency_weight);
            for (id, score) in ids.iter().zip(scores) {
                let Some(w) = inner.workers.get_mut(id) else { continue };
                let score = score.map(|u| (u * 1000.0).round() / 1000.0);
                changed |= w.utility != score;
                w.utility = score;
            }
        }
        changed
    }

    pub fn bad_report(&self) {
        self.counters.bad_reports.inc();
    }

    /// LRU-evicts every worker's index to its bound (its KV capacity within
    /// `max_tree_size`); the evictions go out in the next delta.
    pub fn evict(&self) -> usize {
        let bounds: Vec<(u32, u64)> = {
            let inner = self.lock();
            inner.index.sizes().map(|(w, _)| (w, self.bound_of(&inner, w))).collect()
        };
        self.evict_with(|index| {
            bounds
                .iter()
                .flat_map(|&(w, bound)| index.evict_worker_to(w, bound).into_iter().map(move |h| (h, w)))
                .collect()
        })
    }

    /// The most blocks `worker`'s part of the index may hold.
    fn bound_of(&self, inner: &Inner, worker: u32) -> u64 {
        let entry = inner.workers.get(&worker);
        let bound = capacity::bound_blocks(&self.settings, entry.and_then(|w| self.kv_capacity(w)));
        match entry {
            // prefix_hash keeps llm-d's per-server LRU capacity.
            Some(w) if self.settings.prefix_hash_roles.contains(&w.role) => {
                bound.min(self.settings.lru_capacity_per_server.max(1))
            }
            _ => bound,
        }
    }

    /// A worker's KV capacity in tokens: `--worker-kv-capacity`, else what it reported.
    pub fn kv_capacity(&self, w: &WorkerEntry) -> Option<u64> {
        self.settings.kv_capacity.get(w.url.trim_end_matches('/')).copied().or(w.kv_capacity_reported)
    }

    /// What worker `id` reported as its KV capacity (None: it does not say). A smaller
    /// capacity than before evicts its least recently used blocks at once.
    pub fn capacity_result(&self, id: u32, tokens: Option<u64>) {
        let bound = {
            let mut inner = self.lock();
            let Some(w) = inner.workers.get_mut(&id) else { return };
            if w.kv_capacity_reported == tokens {
                return;
            }
            tracing::info!(url = %w.url, ?tokens, "worker KV capacity");
            w.kv_capacity_reported = tokens;
            self.bound_of(&inner, id)
        };
        self.evict_with(|index| index.evict_worker_to(id, bound).into_iter().map(|h| (h, id)).collect());
    }

    /// Tokens' worth of the blocks worker `id` holds in the index.
    pub fn index_tokens_of(&self, id: u32) -> u64 {
        capacity::tokens_of_blocks(&self.settings, self.index_size_of(id))
    }

    /// Forgets the whole global index (the workers' caches were flushed); the evictions go
    /// out in the next delta, so every filter forgets it too.
    pub fn forget_index(&self) -> usize {
        self.evict_with(|index| index.evict_total_to(0))
    }

    fn evict_with(&self, evict: impl FnOnce(&mut PrefixIndex) -> Vec<(u64, u32)>) -> usize {
        let mut inner = self.lock();
        let evicted = evict(&mut inner.index);
        let n = evicted.len();
        push_evictions(&mut inner, evicted);
        drop(inner);
        self.counters.evicted_blocks.inc_by(n as u64);
        n
    }

    /// Sends a delta if anything changed. Returns its version.
    pub fn publish(&self) -> Option<u64> {
        let mut inner = self.lock();
        if inner.pending_inserts.is_empty() && inner.pending_evictions.is_empty() && !inner.workers_dirty {
            return None;
        }
        inner.version += 1;
        inner.published_at = Some(Instant::now());
        let workers_changed = std::mem::take(&mut inner.workers_dirty);
        let delta = Snapshot {
            version: inner.version,
            full: false,
            workers: if workers_changed {
                inner.workers.values().map(WorkerEntry::proto).collect()
            } else {
                Vec::new()
            },
            workers_changed,
            inserts: std::mem::take(&mut inner.pending_inserts),
            evictions: std::mem::take(&mut inner.pending_evictions),
            settings: None,
            sent_at_ms: now_ms(),
        };
        let version = delta.version;
        drop(inner);
        let _ = self.deltas.send(Arc::new(delta));
        self.counters.deltas.inc();
        Some(version)
    }

    /// Everything, for a gateway that (re)connects.
    pub fn full_snapshot(&self) -> Snapshot {
        let inner = self.lock();
        Snapshot {
            version: inner.version,
            full: true,
            workers: inner.workers.values().map(WorkerEntry::proto).collect(),
            workers_changed: true,
            inserts: inner
                .index
                .export()
                .into_iter()
                .map(|(worker, hashes)| IndexInsert { worker, hashes, ..Default::default() })
                .collect(),
            evictions: Vec::new(),
            settings: Some((&self.settings.routing).into()),
            sent_at_ms: now_ms(),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.deltas.subscribe()
    }

    /// A gateway opened `Watch` (it is listed in `/snapshot`, not tracked past its TTL).
    pub fn gateway_connected(&self, id: &str) -> Result<(), GatewayError> {
        check_gateway_id(id)?;
        let mut inner = self.lock();
        if !inner.gateways.contains_key(id) && inner.gateways.len() >= MAX_GATEWAYS {
            return Err(GatewayError::TooMany);
        }
        let now = Instant::now();
        let burst = self.burst();
        inner
            .gateways
            .entry(id.to_string())
            .or_insert(Gateway { seen: now, reporting: 0, budget: burst, budget_at: now })
            .seen = now;
        Ok(())
    }

    /// `/snapshot`: a debugging view.
    pub fn describe(&self) -> Value {
        let inner = self.lock();
        let workers: Vec<Value> = inner
            .workers
            .values()
            .map(|w| json!({"id": w.id, "url": w.url, "role": role_name(w.role), "healthy": w.healthy, "load": w.load()}))
            .collect();
        let pending = !inner.pending_inserts.is_empty() || !inner.pending_evictions.is_empty() || inner.workers_dirty;
        json!({
            "version": inner.version,
            "pending": pending,
            "age_ms": inner.published_at.map(|t| t.elapsed().as_millis() as u64),
            "workers": workers,
            "index_blocks": inner.index.len(),
            "index_entries": inner.index.entries(),
            "gateways": inner.gateways.keys().collect::<Vec<_>>(),
            "settings": self.settings.routing,
        })
    }

    /// Which workers hold leading blocks of `text` (the routing text), deepest first.
    pub fn match_text(&self, text: &[u8]) -> Vec<(String, usize)> {
        let hashes = kvmesh_core::blocks::block_hashes(text, self.settings.block_size);
        let inner = self.lock();
        let mut out: Vec<(String, usize)> = inner
            .index
            .match_prefix(&hashes)
            .into_iter()
            .filter_map(|m| Some((inner.workers.get(&m.worker)?.url.clone(), m.blocks)))
            .collect();
        out.sort_by_key(|m| std::cmp::Reverse(m.1));
        out
    }

    pub fn index_stats(&self) -> (usize, u64) {
        let inner = self.lock();
        (inner.index.len(), inner.index.entries())
    }
}

/// What merging one report found: entries naming unknown workers, hashes over the limits,
/// blocks evicted from the global index.
#[derive(Default)]
struct Tally {
    bad: u64,
    dropped: u64,
    evicted: u64,
}

/// One worker's counts from `gateway`: its breaker there, its in-flight requests, the
/// cumulative counts added by difference, the completions pushed into its utility window
/// (`window`: its size, when marginal_utility is in force). Says whether the load filters
/// see changed.
fn merge_worker_counts(
    w: &mut WorkerEntry,
    gateway: &str,
    c: &WorkerCounts,
    window: Option<usize>,
    at_ms: u64,
) -> bool {
    // An unknown state number (a newer gateway) reads as closed.
    match c.breaker() {
        BreakerState::Closed => w.breakers.remove(gateway),
        state => w.breakers.insert(gateway.to_string(), state),
    };
    let old = w.inflight.insert(gateway.to_string(), c.in_flight).unwrap_or(0);
    let changed = old != c.in_flight && w.polled_load.is_none();
    // The first report of a gateway counts from zero; the same gateway (one id per Envoy,
    // whichever VM holds its stream) is counted by differences.
    let feedback = c.feedback.unwrap_or_default();
    let now = LastCounts { requests: c.requests, errors: c.errors, failovers: c.failovers, feedback, at_ms };
    let last = w.last_counts.get(gateway).cloned().unwrap_or_default();
    if let Some(size) = window {
        push_completions(w, size, &last, &now);
    }
    w.requests += u64::from(c.requests.wrapping_sub(last.requests));
    w.errors += u64::from(c.errors.wrapping_sub(last.errors));
    w.failovers += u64::from(c.failovers.wrapping_sub(last.failovers));
    w.feedback.add(&last.feedback, &now.feedback);
    w.last_counts.insert(gateway.to_string(), now);
    changed
}

/// The completions since the gateway's `last` counts, spread over the time between the two
/// reports (a first report: over the last second), into the worker's window of `size`.
fn push_completions(w: &mut WorkerEntry, size: usize, last: &LastCounts, now: &LastCounts) {
    if w.window.capacity() != size {
        w.window = UtilityWindow::new(size);
    }
    let at_ms = now.at_ms;
    let from = if last.at_ms == 0 { at_ms.saturating_sub(1000) } else { last.at_ms };
    w.window.push_batch(
        from.min(at_ms),
        at_ms,
        u64::from(now.feedback.completions.wrapping_sub(last.feedback.completions)),
        now.feedback.completion_tokens.saturating_sub(last.feedback.completion_tokens),
        now.feedback.e2e_latency_ms.saturating_sub(last.feedback.e2e_latency_ms),
    );
}

/// A worker missing from the gateway's counts: nothing in flight there, breaker closed. Says
/// whether the load filters see changed.
fn not_counted(w: &mut WorkerEntry, gateway: &str) -> bool {
    let changed = w.inflight.insert(gateway.to_string(), 0).is_some_and(|old| old != 0) && w.polled_load.is_none();
    w.breakers.remove(gateway);
    changed
}

/// Evicted `(hash, worker)` entries, grouped by worker, to go out in the next delta.
fn push_evictions(inner: &mut Inner, evicted: Vec<(u64, u32)>) {
    let mut per_worker: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for (hash, worker) in evicted {
        per_worker.entry(worker).or_default().push(hash);
    }
    inner.pending_evictions.extend(per_worker.into_iter().map(|(worker, hashes)| IndexEvict { worker, hashes }));
}

pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Regular => "regular",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state from kvmesh-cp's command line (shared with the admin API's tests).
    pub(crate) fn state(args: &[&str]) -> Arc<State> {
        let mut argv = vec!["kvmesh-cp"];
        argv.extend(args);
        State::new(crate::args::Args::parse_from(argv).map_err(|e| e.one_line()).unwrap().load().unwrap())
    }

    #[test]
    fn reports_merge_into_one_index_and_deltas_carry_only_news() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let mut rx = s.subscribe();
        assert_eq!(s.publish(), Some(1), "the initial worker set");
        assert!(rx.try_recv().unwrap().workers_changed);
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2], ..Default::default() }],
            ..Default::default()
        });
        s.report(ReportBatch {
            gateway_id: "b".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2, 3], ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.publish(), Some(2));
        let d = rx.try_recv().unwrap();
        assert_eq!(d.inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), 3, "{d:?}");
        let origins: Vec<&str> = d.inserts.iter().map(|i| i.origin.as_str()).collect();
        assert_eq!(origins, ["a", "b"], "each insert names the gateway that reported it");
        assert!(!d.workers_changed);
        assert_eq!(s.publish(), None, "nothing new");
        let full = s.full_snapshot();
        assert_eq!((full.version, full.workers.len(), full.inserts[0].hashes.len()), (2, 2, 3));
    }

    #[test]
    fn unknown_workers_in_reports_are_dropped_and_counted() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 42, hashes: vec![1], ..Default::default() }],
            counts: vec![WorkerCounts { worker: 43, in_flight: 1, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.counters.bad_reports.get(), 2);
        assert_eq!(s.index_stats(), (0, 0));
    }

    #[test]
    fn health_thresholds() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--health-failure-threshold",
            "2",
            "--health-success-threshold",
            "2",
        ]);
        s.publish();
        s.health_result(0, false);
        assert!(s.workers()[0].healthy);
        s.health_result(0, false);
        assert!(!s.workers()[0].healthy);
        s.health_result(0, true);
        assert!(!s.workers()[0].healthy);
        s.health_result(0, true);
        assert!(s.workers()[0].healthy);
    }

    #[test]
    fn eviction_bounds_the_index_and_is_published() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "--max-tree-size", "64", "--block-size", "16"]);
        s.publish();
        let mut rx = s.subscribe();
        s.report(ReportBatch {
            gateway_id: "a".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: (0..10).collect(), ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.evict(), 6);
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions[0].hashes.len(), 6);
        assert_eq!(s.index_stats().0, 4);
    }

    #[test]
    fn forgetting_the_index_evicts_everything_and_tells_the_filters() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        s.publish();
        let mut rx = s.subscribe();
        for worker in [0, 1] {
            s.report(ReportBatch {
                gateway_id: "a".into(),
                inserts: vec![IndexInsert { worker, hashes: (0..5).collect(), ..Default::default() }],
                ..Default::default()
            });
        }
        s.publish();
        let _ = rx.try_recv();
        assert_eq!(s.forget_index(), 10);
        assert_eq!(s.index_stats(), (0, 0));
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions.iter().map(|e| e.hashes.len()).sum::<usize>(), 10);
    }

    #[test]
    fn an_api_worker_is_unhealthy_until_its_first_health_check_passes() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "--health-success-threshold", "3"]);
        let id = s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api).unwrap();
        let health = |s: &State| s.workers().iter().find(|w| w.id == id).unwrap().healthy;
        assert!(!health(&s), "no traffic before it is probed");
        assert!(s.workers()[0].healthy, "static workers start healthy");
        s.health_result(id, false);
        assert!(!health(&s));
        s.health_result(id, true);
        assert!(health(&s), "the first passed check is enough, whatever the success threshold");
        // Without health checks nothing would ever probe it: it starts healthy.
        let s = state(&["--disable-health-check"]);
        s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api).unwrap();
        assert!(s.workers()[0].healthy);
    }

    #[test]
    fn the_url_policy_applies_to_every_source() {
        let s = state(&["--worker-cidrs", "127.0.0.0/8"]);
        for source in [Source::Api, Source::Discovery, Source::Static] {
            assert!(s
                .add_worker("http://169.254.169.254:80", Role::Regular, None, source)
                .unwrap_err()
                .contains("link-local"));
            assert!(s.add_worker("http://0.0.0.0:9901", Role::Regular, None, source).is_err());
            assert!(s.add_worker("http://[::]:9901", Role::Regular, None, source).is_err());
            assert!(s
                .add_worker("http://10.0.0.1:80", Role::Regular, None, source)
                .unwrap_err()
                .contains("--worker-cidrs"));
        }
        assert!(s.add_worker("http://127.0.0.5:80", Role::Regular, None, Source::Api).is_ok());
        assert_eq!(s.workers().len(), 1);
    }

    #[test]
    fn reports_are_limited_per_message_and_per_gateway_rate_and_drops_are_counted() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--max-inserts-per-report",
            "100",
            "--max-inserts-per-sec",
            "50",
        ]);
        s.report_stream_opened("gw").unwrap();
        let batch = |from: u64, n: u64| ReportBatch {
            gateway_id: "gw".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: (from..from + n).collect(), ..Default::default() }],
            ..Default::default()
        };
        // Per message: 100 of 150.
        s.report(batch(0, 150));
        assert_eq!((s.index_stats().1, s.counters.dropped_inserts.get()), (100, 50));
        // The bucket held 4 s x 50 = 200: 100 are left, then it is empty.
        s.report(batch(1000, 100));
        s.report(batch(2000, 100));
        let (_, entries) = s.index_stats();
        assert!((200..=205).contains(&entries), "{entries}");
        assert!(s.counters.dropped_inserts.get() >= 145);
    }

    #[test]
    fn the_global_index_is_bounded_on_insert_and_the_evictions_are_published() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--max-index-entries", "80"]);
        s.publish();
        let mut rx = s.subscribe();
        for round in 0..20u64 {
            s.report(ReportBatch {
                gateway_id: "gw".into(),
                inserts: vec![IndexInsert {
                    worker: (round % 2) as u32,
                    hashes: (round * 10..round * 10 + 10).collect(),
                    ..Default::default()
                }],
                ..Default::default()
            });
            assert!(s.index_stats().1 <= 90, "within the bound and its 1/8 slack: {:?}", s.index_stats());
        }
        assert!(s.counters.evicted_blocks.get() >= 110);
        s.publish();
        let d = rx.try_recv().unwrap();
        assert!(d.evictions.iter().map(|e| e.hashes.len()).sum::<usize>() >= 110, "the filters forget them too");
        // The newest survive: the last round is still there.
        assert!(s.index_size_of(1) > 0);
    }

    #[test]
    fn every_eviction_of_a_report_is_counted() {
        // Worker 0 holds at most 8 blocks (64 tokens); the index at most 16 entries (and 2 slack).
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--worker-kv-capacity",
            "http://127.0.0.1:1=64",
            "--max-index-entries",
            "16",
        ]);
        s.publish();
        let mut rx = s.subscribe();
        // One report: 4 blocks over worker 0's capacity, 2 stale, then 21 entries bounded to 16.
        s.report(ReportBatch {
            gateway_id: "gw".into(),
            inserts: vec![
                IndexInsert { worker: 0, hashes: (0..12).collect(), ..Default::default() },
                IndexInsert { worker: 1, hashes: (100..115).collect(), ..Default::default() },
            ],
            stale: vec![IndexEvict { worker: 1, hashes: vec![100, 101] }],
            ..Default::default()
        });
        assert_eq!(s.index_stats().1, 16);
        s.publish();
        let told: usize = rx.try_recv().unwrap().evictions.iter().map(|e| e.hashes.len()).sum();
        assert_eq!(told, 4 + 2 + 5);
        assert_eq!(s.counters.evicted_blocks.get(), 4 + 2 + 5, "capacity, stale and total evictions all count");
        assert_eq!(s.counters.stale_blocks.get(), 2);
    }

    #[test]
    fn a_gateways_inflight_goes_when_its_last_stream_ends_and_counts_are_not_doubled() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        let counts = |in_flight, requests| ReportBatch {
            gateway_id: "envoy/1".into(),
            counts: vec![WorkerCounts { worker: 0, in_flight, requests, ..Default::default() }],
            ..Default::default()
        };
        // VM a holds the stream.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(4, 10));
        assert_eq!((s.workers()[0].load(), s.workers()[0].requests), (4, 10));
        // The lease moves: VM b opens its stream (same Envoy, same id) before a's ends.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(2, 12));
        s.report_stream_closed("envoy/1");
        assert_eq!((s.workers()[0].load(), s.workers()[0].requests), (2, 12), "b's counts stay; nothing doubled");
        // A full-report chunk carries no counts and changes none.
        s.report(ReportBatch { gateway_id: "envoy/1".into(), ..Default::default() });
        assert_eq!(s.workers()[0].load(), 2);
        s.report_stream_closed("envoy/1");
        assert_eq!(s.workers()[0].load(), 0, "no stream left: its in-flight is gone");
        // It comes back (a control-plane hiccup): cumulative counts continue, never re-added.
        s.report_stream_opened("envoy/1").unwrap();
        s.report(counts(0, 15));
        assert_eq!(s.workers()[0].requests, 15);
        // A gateway silent past the TTL loses its in-flight even with a stream open.
        s.report(counts(3, 15));
        s.prune_gateways(Instant::now() + INFLIGHT_TTL);
        assert_eq!(s.workers()[0].load(), 0);
        // Gone past the gateway TTL: forgotten.
        s.report_stream_closed("envoy/1");
        assert_eq!(s.prune_gateways(Instant::now() + GATEWAY_TTL), 0);
    }

    #[test]
    fn breakers_are_merged_over_the_live_gateways_and_failovers_summed() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let report = |gateway: &str, breaker: BreakerState, failovers: u32| {
            let mut c = WorkerCounts { worker: 0, failovers, ..Default::default() };
            c.set_breaker(breaker);
            s.report(ReportBatch { gateway_id: gateway.into(), counts: vec![c], ..Default::default() });
        };
        let w = |s: &State| s.workers().into_iter().next().unwrap();
        for g in ["a", "b"] {
            s.report_stream_opened(g).unwrap();
        }
        report("a", BreakerState::Closed, 0);
        assert_eq!((w(&s).circuit_breaker(), w(&s).breakers_open()), ("closed", 0));
        report("a", BreakerState::HalfOpen, 1);
        assert_eq!(w(&s).circuit_breaker(), "half_open");
        report("b", BreakerState::Open, 2);
        assert_eq!((w(&s).circuit_breaker(), w(&s).breakers_open(), w(&s).failovers), ("open", 1, 3));
        report("a", BreakerState::Open, 4);
        assert_eq!((w(&s).breakers_open(), w(&s).failovers), (2, 6), "cumulative: a's 1 then 4");
        assert_eq!(s.workers()[1].circuit_breaker(), "closed", "another worker");
        // A report without this worker: closed there. A gateway whose stream ended: forgotten.
        s.report(ReportBatch {
            gateway_id: "a".into(),
            counts: vec![WorkerCounts { worker: 1, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(w(&s).breakers_open(), 1);
        s.report_stream_closed("b");
        assert_eq!((w(&s).circuit_breaker(), w(&s).failovers), ("closed", 6));
        // A state number from a newer gateway reads as closed.
        let c = WorkerCounts { worker: 0, breaker: 77, ..Default::default() };
        s.report(ReportBatch { gateway_id: "a".into(), counts: vec![c], ..Default::default() });
        assert_eq!(w(&s).circuit_breaker(), "closed");
    }

    #[test]
    fn completion_metrics_fill_windows_and_a_worker_slowing_down_scores_below_a_steady_one() {
        let urls = ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--policy", "marginal_utility"];
        let s = state(&urls);
        s.report_stream_opened("g").unwrap();
        // Every second, each worker finishes 2 requests of 10 tokens; worker 0's latency grows
        // by 100 ms a report, worker 1's stays at 200 ms.
        let (mut lat0, mut lat1, mut done) = (0u64, 0u64, 0u32);
        for i in 1..=12u64 {
            done += 2;
            lat0 += 2 * 100 * i;
            lat1 += 2 * 200;
            let fb = |lat| Feedback {
                completions: done,
                completion_tokens: 10 * u64::from(done),
                e2e_latency_ms: lat,
                ..Default::default()
            };
            let counts = vec![
                WorkerCounts { worker: 0, feedback: Some(fb(lat0)), ..Default::default() },
                WorkerCounts { worker: 1, feedback: Some(fb(lat1)), ..Default::default() },
            ];
            s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 1_000_000 + 1000 * i);
            let ws = s.workers();
            if i < 5 {
                assert_eq!((ws[0].utility, ws[1].utility), (None, None), "below min_history after {i} reports");
            }
        }
        let ws = s.workers();
        assert_eq!((ws[0].window.len(), ws[1].window.len()), (20, 20), "the window slides");
        let (u0, u1) = (ws[0].utility.unwrap(), ws[1].utility.unwrap());
        assert!(u0 < 0.0 && u1 > 0.0, "slowing {u0} vs steady {u1}");
        let snap = s.full_snapshot();
        assert_eq!(snap.workers.iter().map(|w| w.utility).collect::<Vec<_>>(), vec![Some(u0), Some(u1)]);
        // Silence: the windows go stale, and the next report (no completions) clears the scores.
        let counts = vec![WorkerCounts {
            worker: 0,
            feedback: Some(Feedback { completions: done, ..Default::default() }),
            ..Default::default()
        }];
        s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 1_000_000 + 30_000);
        assert!(s.workers().iter().all(|w| w.utility.is_none()));
        // Without marginal_utility in force, no windows are kept.
        let s = state(&urls[..3]);
        let fb = Feedback { completions: 5, completion_tokens: 50, e2e_latency_ms: 500, ..Default::default() };
        let counts = vec![WorkerCounts { worker: 0, feedback: Some(fb), ..Default::default() }];
        s.report_at(ReportBatch { gateway_id: "g".into(), counts, ..Default::default() }, 5_000);
        assert_eq!((s.workers()[0].window.len(), s.workers()[0].utility), (0, None));
    }

    #[test]
    fn prefix_hash_workers_are_evicted_to_the_lru_capacity_per_server() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--policy",
            "prefix_hash",
            "--lru-capacity-per-server",
            "3",
        ]);
        let hashes: Vec<u64> = (1..=10).collect();
        s.report(ReportBatch {
            gateway_id: "g".into(),
            inserts: vec![IndexInsert { worker: 0, hashes, ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(s.index_size_of(0), 10);
        assert_eq!(s.evict(), 7);
        assert_eq!(s.index_size_of(0), 3);
    }

    #[test]
    fn gateway_ids_are_bounded() {
        let s = state(&[]);
        assert!(matches!(s.report_stream_opened(&"x".repeat(MAX_GATEWAY_ID + 1)), Err(GatewayError::BadId(_))));
        assert!(matches!(s.report_stream_opened(""), Err(GatewayError::BadId(_))));
        assert!(matches!(s.gateway_connected("a b"), Err(GatewayError::BadId(_))));
        for i in 0..MAX_GATEWAYS {
            s.gateway_connected(&format!("gw-{i}")).unwrap();
        }
        assert_eq!(s.report_stream_opened("one-too-many"), Err(GatewayError::TooMany));
        assert!(s.report_stream_opened("gw-7").is_ok(), "known ids still work");
    }

    #[test]
    fn the_state_file_keeps_api_workers_and_every_id_across_a_restart() {
        let dir = std::env::temp_dir().join(format!("kvmesh-cp-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("state.json");
        let _ = std::fs::remove_file(&file);
        let flags = |extra: &[&str]| {
            let mut f = vec!["--state-file", file.to_str().unwrap(), "--worker-urls", "http://127.0.0.1:1"];
            f.extend(extra);
            f.into_iter().map(String::from).collect::<Vec<_>>()
        };
        let start = |extra: &[&str]| {
            let argv: Vec<String> = std::iter::once("kvmesh-cp".to_string()).chain(flags(extra)).collect();
            State::open(crate::args::Args::parse_from(argv).unwrap().load().unwrap()).unwrap()
        };
        let s = start(&[]);
        assert_eq!(s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api), Ok(1));
        assert_eq!(s.add_worker("http://127.0.0.1:3", Role::Regular, None, Source::Discovery), Ok(2));
        assert_eq!(s.add_worker("http://127.0.0.1:4", Role::Regular, None, Source::Api), Ok(3));
        assert!(s.remove_worker("http://127.0.0.1:4"));
        drop(s);
        // Restarted, with one more static worker: everyone keeps their id, the discovered
        // worker gets its id back when it is discovered again, new ids are never old ones.
        let s = start(&["http://127.0.0.1:5"]);
        let ids: Vec<(String, u32, bool)> = s.workers().iter().map(|w| (w.url.clone(), w.id, w.healthy)).collect();
        assert_eq!(
            ids,
            [
                ("http://127.0.0.1:1".to_string(), 0, true),
                ("http://127.0.0.1:2".to_string(), 1, false),
                ("http://127.0.0.1:5".to_string(), 4, true)
            ],
            "the API worker is back, unhealthy until probed"
        );
        assert_eq!(s.add_worker("http://127.0.0.1:3", Role::Regular, None, Source::Discovery), Ok(2));
        assert_eq!(s.add_worker("http://127.0.0.1:4", Role::Regular, None, Source::Api), Ok(5));
        std::fs::write(&file, "not json").unwrap();
        let argv: Vec<String> = std::iter::once("kvmesh-cp".to_string()).chain(flags(&[])).collect();
        let e = State::open(crate::args::Args::parse_from(argv).unwrap().load().unwrap()).err().unwrap();
        assert!(e.starts_with("--state-file"), "{e}");
    }

    #[test]
    fn ids_are_never_reused_and_inflight_is_load_without_polling() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        assert!(s.remove_worker("http://127.0.0.1:1"));
        assert_eq!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api), Ok(1));
        assert!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api).is_err());
        let counts = |in_flight, requests, errors| {
            vec![WorkerCounts { worker: 1, in_flight, requests, errors, ..Default::default() }]
        };
        s.report(ReportBatch { gateway_id: "a".into(), counts: counts(3, 10, 1), ..Default::default() });
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, 5, 0), ..Default::default() });
        s.report(ReportBatch { gateway_id: "a".into(), counts: counts(3, 12, 1), ..Default::default() });
        assert_eq!(s.workers()[0].load(), 5);
        assert_eq!((s.workers()[0].requests, s.workers()[0].errors), (17, 1));
        // Cumulative counts wrap at 2^32.
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, u32::MAX, 0), ..Default::default() });
        s.report(ReportBatch { gateway_id: "b".into(), counts: counts(2, 1, 0), ..Default::default() });
        assert_eq!(s.workers()[0].requests, 17 + (u32::MAX - 5) as u64 + 2);
        s.load_result(1, Some(9), None);
        assert_eq!(s.workers()[0].load(), 9);
    }

    fn insert(s: &State, worker: u32, hashes: &[u64]) {
        let inserts = vec![IndexInsert { worker, hashes: hashes.to_vec(), ..Default::default() }];
        s.report(ReportBatch { gateway_id: "g".into(), inserts, ..Default::default() });
    }

    fn held(s: &State, worker: u32, hashes: &[u64]) -> Vec<u64> {
        let snap = s.full_snapshot();
        let all: Vec<u64> = snap.inserts.iter().filter(|i| i.worker == worker).flat_map(|i| i.hashes.clone()).collect();
        hashes.iter().copied().filter(|h| all.contains(h)).collect()
    }

    #[test]
    fn each_worker_is_bounded_to_its_capacity_evicting_by_last_use() {
        // Worker 0: 64 tokens = 256 bytes = 8 blocks of 32 bytes. Worker 1: no capacity known.
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "--worker-kv-capacity",
            "http://127.0.0.1:1=64",
        ]);
        let mut rx = s.subscribe();
        s.publish();
        let _ = rx.try_recv();
        insert(&s, 0, &[1, 2, 3, 4, 5, 6]); // prefix A
        insert(&s, 0, &[11, 12, 13, 14]); // prefix B: 10 blocks, A's two deepest go
        assert_eq!(s.index_size_of(0), 8);
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 5, 6]), vec![1, 2, 3, 4]);
        insert(&s, 0, &[1, 2, 3]); // a request on A's first blocks: used again
        insert(&s, 0, &[21, 22, 23]); // prefix C: the three least recently used go
        assert_eq!(held(&s, 0, &[1, 2, 3, 4, 11, 12, 13, 14, 21, 22, 23]), vec![1, 2, 3, 11, 12, 21, 22, 23]);
        assert_eq!(s.index_tokens_of(0), 64, "within the capacity");
        for i in 0..100u64 {
            insert(&s, 1, &[1000 + i]);
        }
        assert_eq!(s.index_size_of(1), 100, "unbounded but for --max-tree-size");
        // The filters are told.
        s.publish();
        let d = rx.try_recv().unwrap();
        let mut evicted: Vec<u64> =
            d.evictions.iter().filter(|e| e.worker == 0).flat_map(|e| e.hashes.clone()).collect();
        evicted.sort_unstable();
        assert_eq!(evicted, vec![4, 5, 6, 13, 14]);
        // A capacity reported later (16 tokens: 2 blocks) applies at once.
        s.capacity_result(1, Some(16));
        assert_eq!(s.index_size_of(1), 2);
        assert_eq!(held(&s, 1, &[1098, 1099]), vec![1098, 1099], "the most recent stay");
        // The override wins over what the worker says.
        s.capacity_result(0, Some(1 << 20));
        insert(&s, 0, &[31, 32]);
        assert_eq!(s.index_size_of(0), 8);
    }

    #[test]
    fn stale_blocks_and_feedback_from_reports() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        insert(&s, 0, &[1, 2, 3, 4]);
        let mut rx = s.subscribe();
        let feedback = Feedback {
            predictions: 3,
            accurate: 2,
            over: 1,
            predicted_tokens: 40,
            cached_tokens: 8,
            ..Default::default()
        };
        s.report(ReportBatch {
            gateway_id: "g".into(),
            stale: vec![IndexEvict { worker: 0, hashes: vec![3, 4] }, IndexEvict { worker: 9, hashes: vec![1] }],
            counts: vec![WorkerCounts { worker: 0, feedback: Some(feedback), ..Default::default() }],
            ..Default::default()
        });
        assert_eq!(held(&s, 0, &[1, 2, 3, 4]), vec![1, 2]);
        assert_eq!((s.counters.stale_blocks.get(), s.counters.bad_reports.get()), (2, 1));
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions, vec![IndexEvict { worker: 0, hashes: vec![3, 4] }], "every gateway forgets them");
        let w = s.workers().into_iter().next().unwrap();
        assert_eq!((w.feedback.predictions, w.feedback.over, w.feedback.accuracy()), (3, 1, Some(2.0 / 3.0)));
    }
}
