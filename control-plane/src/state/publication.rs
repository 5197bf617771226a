//! The publication's owner: what changed since the last delta (index inserts and evictions, a
//! changed worker table), the version, and the channel the deltas go out on. Only this file
//! writes them. As kube-rs's reflector has a writer and readers, the publication has
//! [`Deltas`], the sending end, and the receivers [`Deltas::subscribe`] hands out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_proto::v1::{IndexEvict, IndexInsert, RoutingSettings, Snapshot, TenantUsage, Worker};
use tokio::sync::broadcast;

/// The changes not yet published, and the last version (behind the state's lock).
#[derive(Default)]
pub(super) struct Publication {
    version: u64,
    published_at: Option<Instant>,
    pending_inserts: Vec<IndexInsert>,
    pending_evictions: Vec<IndexEvict>,
    workers_dirty: bool,
    /// The routing settings, when they changed since the last delta (discovered objectives).
    pending_settings: Option<RoutingSettings>,
}

impl Publication {
    // ---- reads

    /// The last version published.
    pub(super) fn version(&self) -> u64 {
        self.version
    }

    /// Whether anything waits for the next delta.
    pub(super) fn pending(&self) -> bool {
        !self.pending_inserts.is_empty()
            || !self.pending_evictions.is_empty()
            || self.workers_dirty
            || self.pending_settings.is_some()
    }

    /// How long ago the last delta went out (none: never).
    pub(super) fn age_ms(&self) -> Option<u64> {
        self.published_at.map(|t| t.elapsed().as_millis() as u64)
    }

    // ---- writes

    /// The worker table changed: it goes out whole with the next delta.
    pub(super) fn workers_changed(&mut self) {
        self.workers_dirty = true;
    }

    /// The routing settings changed: they go out with the next delta.
    pub(super) fn settings_changed(&mut self, settings: RoutingSettings) {
        self.pending_settings = Some(settings);
    }

    /// `worker` holds the new blocks `hashes`, reported by gateway `origin`.
    pub(super) fn inserted(&mut self, worker: u32, hashes: Vec<u64>, origin: &str) {
        if !hashes.is_empty() {
            self.pending_inserts.push(IndexInsert { worker, hashes, origin: origin.to_string() });
        }
    }

    /// `worker` no longer holds `hashes`.
    pub(super) fn evicted(&mut self, worker: u32, hashes: Vec<u64>) {
        self.pending_evictions.push(IndexEvict { worker, hashes });
    }

    /// Evicted `(hash, worker)` entries, grouped by worker.
    pub(super) fn evicted_entries(&mut self, evicted: Vec<(u64, u32)>) {
        let mut per_worker: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for (hash, worker) in evicted {
            per_worker.entry(worker).or_default().push(hash);
        }
        self.pending_evictions.extend(per_worker.into_iter().map(|(worker, hashes)| IndexEvict { worker, hashes }));
    }

    /// The next delta, if anything changed (`workers`: the table, asked for only when it
    /// changed; `tenants`: the fleet's tenant usage and admitted requests, each when it changed
    /// enough), stamped `sent_at_ms`; the pending changes are taken.
    pub(super) fn next_delta(
        &mut self,
        workers: impl FnOnce() -> Vec<Worker>,
        tenants: [Option<TenantUsage>; 2],
        sent_at_ms: u64,
    ) -> Option<Snapshot> {
        let [tenant_usage, tenant_requests] = tenants;
        if !self.pending() && tenant_usage.is_none() && tenant_requests.is_none() {
            return None;
        }
        self.version += 1;
        self.published_at = Some(Instant::now());
        let workers_changed = std::mem::take(&mut self.workers_dirty);
        Some(Snapshot {
            version: self.version,
            full: false,
            workers: if workers_changed { workers() } else { Vec::new() },
            workers_changed,
            inserts: std::mem::take(&mut self.pending_inserts),
            evictions: std::mem::take(&mut self.pending_evictions),
            settings: self.pending_settings.take(),
            // Full snapshots only (a delta keeps the last).
            worker_authorization: String::new(),
            sent_at_ms,
            tenant_usage,
            tenant_requests,
        })
    }
}

/// The deltas' channel: sent on outside the state's lock, read by every `Watch` stream.
pub(super) struct Deltas(broadcast::Sender<Arc<Snapshot>>);

impl Default for Deltas {
    fn default() -> Self {
        Self(broadcast::channel(1024).0)
    }
}

impl Deltas {
    pub(super) fn send(&self, delta: Snapshot) {
        let _ = self.0.send(Arc::new(delta));
    }

    /// A reader: every delta sent from now on.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.0.subscribe()
    }

    pub(super) fn receivers(&self) -> usize {
        self.0.receiver_count()
    }
}
