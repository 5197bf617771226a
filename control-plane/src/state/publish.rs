//! What the filters get: the changes not yet published (index inserts and evictions, a
//! changed worker table) go out as versioned deltas on a broadcast channel; a gateway that
//! (re)connects starts from the full snapshot; `/snapshot` shows where publishing stands.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_proto::v1::{IndexEvict, IndexInsert, ServedModel, Snapshot, Worker};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use super::store::{now_ms, Inner, State};
use super::worker::{role_name, WorkerEntry};

impl State {
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
            // Full snapshots only (a delta keeps the last).
            worker_authorization: String::new(),
            sent_at_ms: now_ms(),
        };
        let version = delta.version;
        drop(inner);
        let _span = tracing::info_span!(target: crate::telemetry::SPANS, "snapshot.publish", version, workers_changed,
            inserts = delta.inserts.len(), evictions = delta.evictions.len(), watchers = self.deltas.receiver_count())
        .entered();
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
            worker_authorization: self.settings.worker_key().map(|k| format!("Bearer {k}")).unwrap_or_default(),
            sent_at_ms: now_ms(),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.deltas.subscribe()
    }

    /// `/snapshot`: a debugging view.
    pub fn describe(&self) -> Value {
        let inner = self.lock();
        let workers: Vec<Value> = inner
            .workers
            .values()
            .map(|w| json!({"id": w.id, "url": w.name(), "role": role_name(w.role), "healthy": w.healthy, "load": w.load()}))
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
}

impl WorkerEntry {
    /// The worker as the filters see it.
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
            models: self
                .served()
                .iter()
                .map(|m| ServedModel {
                    id: m.id.clone(),
                    parent: m.parent.clone().unwrap_or_default(),
                    owned_by: m.owned_by.clone(),
                })
                .collect(),
            pd_protocol: self.pd_protocol.map(kvmesh_proto::pd_protocol_to_wire),
            unresponsive: self.unresponsive,
            dp_rank: self.dp_rank,
        }
    }
}

/// Evicted `(hash, worker)` entries, grouped by worker, to go out in the next delta.
pub(super) fn push_evictions(inner: &mut Inner, evicted: Vec<(u64, u32)>) {
    let mut per_worker: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for (hash, worker) in evicted {
        per_worker.entry(worker).or_default().push(hash);
    }
    inner.pending_evictions.extend(per_worker.into_iter().map(|(worker, hashes)| IndexEvict { worker, hashes }));
}
