//! The state itself: what kvmesh-cp tracks, behind one lock (the workers, the global prefix
//! index, the changes not yet published, the gateways), its counters, and the channel the
//! deltas go out on. The jobs done on it are the sibling modules'.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvmesh_core::index::PrefixIndex;
use kvmesh_proto::v1::{IndexEvict, IndexInsert, Snapshot};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::broadcast;

use super::worker::WorkerEntry;
use crate::settings::Settings;

/// Everything behind the lock.
#[derive(Default)]
pub(super) struct Inner {
    pub(super) workers: BTreeMap<u32, WorkerEntry>,
    pub(super) ids: HashMap<String, u32>,
    /// Ids from the state file for URLs not registered (yet) since the start.
    pub(super) remembered: HashMap<String, u32>,
    pub(super) next_id: u32,
    pub(super) index: PrefixIndex,
    pub(super) version: u64,
    pub(super) published_at: Option<Instant>,
    pub(super) pending_inserts: Vec<IndexInsert>,
    pub(super) pending_evictions: Vec<IndexEvict>,
    pub(super) workers_dirty: bool,
    pub(super) gateways: HashMap<String, Gateway>,
}

/// What kvmesh-cp keeps about one gateway (one Envoy).
#[derive(Debug)]
pub(super) struct Gateway {
    pub(super) seen: Instant,
    /// Open `Report` streams under this id (two while the stream moves between VMs).
    pub(super) reporting: u32,
    /// Open `Watch` streams under this id (at most [`super::gateways::MAX_WATCHES`]).
    pub(super) watching: u32,
    /// The insert budget: a token bucket of hashes.
    pub(super) budget: f64,
    pub(super) budget_at: Instant,
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
    /// `--lora-adapter` loads that worked, and that failed.
    pub adapter_loads: Counter,
    pub adapter_load_failures: Counter,
}

/// The control plane's state, shared by every task (see the sibling modules for what each does with it).
pub struct State {
    pub settings: Settings,
    pub(super) inner: Mutex<Inner>,
    pub counters: Counters,
    pub(super) deltas: broadcast::Sender<Arc<Snapshot>>,
}

/// Now, in ms since the epoch.
pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl State {
    /// A state without workers yet: new ids start at `next_id`, and the URLs in `remembered`
    /// get their old ids back.
    pub(super) fn empty(settings: Settings, next_id: u32, remembered: HashMap<String, u32>) -> Arc<Self> {
        let (deltas, _) = broadcast::channel(1024);
        let inner = Inner {
            next_id,
            remembered,
            // Each report bounds the workers it names to their capacity: by recency, not scans.
            index: PrefixIndex::with_recency(),
            ..Default::default()
        };
        Arc::new(Self { settings, inner: Mutex::new(inner), counters: Counters::default(), deltas })
    }

    /// The state behind its lock, taken even when poisoned (a panic while it was held leaves it usable).
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
