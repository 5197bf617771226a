//! The control plane's state: the worker registry (static, API and discovery sources), their
//! health and load, the global prefix index merged from every gateway's reports, and the
//! versioned snapshots streamed to the filters (full on connect, deltas after).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvmesh_core::index::PrefixIndex;
use kvmesh_proto::v1::{IndexEvict, IndexInsert, ReportBatch, Role, Snapshot, Worker};
use prometheus_client::metrics::counter::Counter;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::settings::Settings;

/// Where a worker came from (discovery only removes what it added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Static,
    Api,
    Discovery,
}

#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub id: u32,
    pub url: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    pub source: Source,
    pub healthy: bool,
    fails: u32,
    oks: u32,
    /// Load the worker reports (`/get_load` or `/metrics`).
    pub polled_load: Option<u64>,
    /// The worker's own cache hit rate, when its `/metrics` says.
    pub cache_hit_rate: Option<f64>,
    /// In-flight requests per gateway, as reported.
    pub inflight: HashMap<String, u32>,
    /// Finished and failed requests, summed over gateways.
    pub requests: u64,
    pub errors: u64,
    /// Each gateway's last cumulative (wrapping) counts, to add the differences.
    last_counts: HashMap<String, (u32, u32)>,
}

impl WorkerEntry {
    pub fn inflight_total(&self) -> u64 {
        self.inflight.values().map(|&n| u64::from(n)).sum()
    }

    /// The load filters see: the worker's own report, else the gateways' in-flight sum.
    pub fn load(&self) -> u64 {
        self.polled_load.unwrap_or_else(|| self.inflight_total())
    }

    fn proto(&self) -> Worker {
        Worker {
            id: self.id,
            url: self.url.clone(),
            role: self.role as i32,
            healthy: self.healthy,
            load: self.load(),
            bootstrap_port: self.bootstrap_port.map(u32::from),
        }
    }
}

#[derive(Default)]
struct Inner {
    workers: BTreeMap<u32, WorkerEntry>,
    ids: HashMap<String, u32>,
    next_id: u32,
    index: PrefixIndex,
    version: u64,
    published_at: Option<Instant>,
    pending_inserts: Vec<IndexInsert>,
    pending_evictions: Vec<IndexEvict>,
    workers_dirty: bool,
    gateways: HashMap<String, Instant>,
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
    /// Snapshot deltas pushed.
    pub deltas: Counter,
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
    pub fn new(settings: Settings) -> Arc<Self> {
        let (deltas, _) = broadcast::channel(1024);
        let state = Arc::new(Self { settings, inner: Mutex::default(), counters: Counters::default(), deltas });
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
        state
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
        kvmesh_core::worker::socket_addr(url).map_err(|e| e.to_string())?;
        let mut inner = self.lock();
        if let Some(&id) = inner.ids.get(url) {
            return Err(format!("worker {url} is already registered (id {id})"));
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.ids.insert(url.to_string(), id);
        let entry = WorkerEntry {
            id,
            url: url.to_string(),
            role,
            bootstrap_port,
            source,
            healthy: true,
            fails: 0,
            oks: 0,
            polled_load: None,
            cache_hit_rate: None,
            inflight: HashMap::new(),
            requests: 0,
            errors: 0,
            last_counts: HashMap::new(),
        };
        inner.workers.insert(id, entry);
        inner.workers_dirty = true;
        tracing::info!(url, ?role, id, ?source, "worker added");
        Ok(id)
    }

    pub fn remove_worker(&self, url: &str) -> bool {
        let mut inner = self.lock();
        let Some(id) = inner.ids.remove(url) else { return false };
        inner.workers.remove(&id);
        inner.index.remove_worker(id);
        inner.workers_dirty = true;
        tracing::info!(url, id, "worker removed");
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
            if !w.healthy && w.oks >= ok_at {
                w.healthy = true;
            }
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

    /// Merges one gateway report. Entries naming unknown workers are dropped and counted.
    pub fn report(&self, batch: ReportBatch) {
        let mut bad = 0u64;
        {
            let mut inner = self.lock();
            let gateway = if batch.gateway_id.is_empty() { "unknown".to_string() } else { batch.gateway_id };
            inner.gateways.insert(gateway.clone(), Instant::now());
            for insert in batch.inserts {
                if !inner.workers.contains_key(&insert.worker) {
                    bad += 1;
                    continue;
                }
                let mut added = Vec::new();
                inner.index.insert_reporting(insert.worker, &insert.hashes, |h| added.push(h));
                if !added.is_empty() {
                    inner.pending_inserts.push(IndexInsert { worker: insert.worker, hashes: added });
                }
            }
            let mut changed = false;
            for w in inner.workers.values_mut() {
                let Some(c) = batch.counts.iter().find(|c| c.worker == w.id) else {
                    changed |=
                        w.inflight.insert(gateway.clone(), 0).is_some_and(|old| old != 0) && w.polled_load.is_none();
                    continue;
                };
                let old = w.inflight.insert(gateway.clone(), c.in_flight).unwrap_or(0);
                changed |= old != c.in_flight && w.polled_load.is_none();
                // The first report of a gateway counts from zero.
                let (last_req, last_err) =
                    w.last_counts.insert(gateway.clone(), (c.requests, c.errors)).unwrap_or((0, 0));
                w.requests += u64::from(c.requests.wrapping_sub(last_req));
                w.errors += u64::from(c.errors.wrapping_sub(last_err));
            }
            bad += batch.counts.iter().filter(|c| !inner.workers.contains_key(&c.worker)).count() as u64;
            inner.workers_dirty |= changed;
        }
        if bad > 0 {
            tracing::warn!(bad, "report names unknown workers; entries dropped");
        }
        self.counters.reports.inc();
        self.counters.bad_reports.inc_by(bad);
    }

    pub fn bad_report(&self) {
        self.counters.bad_reports.inc();
    }

    /// LRU-evicts every worker's index to `max_tree_size`; the evictions go out in the next
    /// delta.
    pub fn evict(&self) -> usize {
        let max_blocks = (self.settings.max_tree_size / self.settings.block_size as u64).max(1);
        let mut inner = self.lock();
        let evicted = inner.index.evict_to(max_blocks);
        let n = evicted.len();
        let mut per_worker: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for (hash, worker) in evicted {
            per_worker.entry(worker).or_default().push(hash);
        }
        inner.pending_evictions.extend(per_worker.into_iter().map(|(worker, hashes)| IndexEvict { worker, hashes }));
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
            inserts: inner.index.export().into_iter().map(|(worker, hashes)| IndexInsert { worker, hashes }).collect(),
            evictions: Vec::new(),
            settings: Some((&self.settings.routing).into()),
            sent_at_ms: now_ms(),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.deltas.subscribe()
    }

    pub fn gateway_connected(&self, id: &str) {
        self.lock().gateways.insert(id.to_string(), Instant::now());
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

pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Regular => "regular",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_proto::v1::WorkerCounts;

    fn state(args: &[&str]) -> Arc<State> {
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
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2] }],
            ..Default::default()
        });
        s.report(ReportBatch {
            gateway_id: "b".into(),
            inserts: vec![IndexInsert { worker: 0, hashes: vec![1, 2, 3] }],
            ..Default::default()
        });
        assert_eq!(s.publish(), Some(2));
        let d = rx.try_recv().unwrap();
        assert_eq!(d.inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), 3, "{d:?}");
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
            inserts: vec![IndexInsert { worker: 42, hashes: vec![1] }],
            counts: vec![WorkerCounts { worker: 43, in_flight: 1, ..Default::default() }],
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
            inserts: vec![IndexInsert { worker: 0, hashes: (0..10).collect() }],
            ..Default::default()
        });
        assert_eq!(s.evict(), 6);
        s.publish();
        let d = rx.try_recv().unwrap();
        assert_eq!(d.evictions[0].hashes.len(), 6);
        assert_eq!(s.index_stats().0, 4);
    }

    #[test]
    fn ids_are_never_reused_and_inflight_is_load_without_polling() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1"]);
        assert!(s.remove_worker("http://127.0.0.1:1"));
        assert_eq!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api), Ok(1));
        assert!(s.add_worker("http://127.0.0.1:1", Role::Regular, None, Source::Api).is_err());
        let counts = |in_flight, requests, errors| vec![WorkerCounts { worker: 1, in_flight, requests, errors }];
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
}
