//! What the filters get: the changes not yet published ([`Publication`](super::publication))
//! go out as versioned deltas on a broadcast channel; a gateway that (re)connects starts from
//! the full snapshot; `/snapshot` shows where publishing stands.

use std::sync::Arc;

use kvmesh_proto::v1::{IndexInsert, ServedModel, Snapshot, Worker};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use kvmesh_core::fleet;

use super::store::{now_ms, State};
use super::worker::{role_name, WorkerEntry};

impl State {
    /// Sends a delta if anything changed. Returns its version.
    pub fn publish(&self) -> Option<u64> {
        let mut inner = self.lock();
        let now = now_ms();
        let usage = inner.tenants_mut().due(fleet::CHANGE_TOKENS, now).map(|u| kvmesh_proto::usage_to_wire(&u));
        let requests =
            inner.tenant_requests_mut().due(fleet::CHANGE_REQUESTS, now).map(|u| kvmesh_proto::usage_to_wire(&u));
        let (registry, _, publication, _) = inner.parts();
        let workers = || registry.entries().map(WorkerEntry::proto).collect();
        let delta = publication.next_delta(workers, [usage, requests], now)?;
        drop(inner);
        let (version, workers_changed) = (delta.version, delta.workers_changed);
        let _span = tracing::info_span!(target: crate::telemetry::SPANS, "snapshot.publish", version, workers_changed,
            inserts = delta.inserts.len(), evictions = delta.evictions.len(), watchers = self.deltas().receivers())
        .entered();
        self.deltas().send(delta);
        self.counters.deltas.inc();
        Some(version)
    }

    /// Everything, for a gateway that (re)connects.
    pub fn full_snapshot(&self) -> Snapshot {
        let inner = self.lock();
        let now = now_ms();
        let usage = inner.tenants().fleet(now);
        let requests = inner.tenant_requests().fleet(now);
        Snapshot {
            version: inner.publication().version(),
            full: true,
            workers: inner.registry().entries().map(WorkerEntry::proto).collect(),
            workers_changed: true,
            inserts: inner
                .index()
                .export()
                .into_iter()
                .map(|(worker, hashes)| IndexInsert { worker, hashes, ..Default::default() })
                .collect(),
            evictions: Vec::new(),
            settings: Some((&self.routing()).into()),
            worker_authorization: self.settings.worker_key().map(|k| format!("Bearer {k}")).unwrap_or_default(),
            sent_at_ms: now,
            tenant_usage: (!usage.entries.is_empty()).then(|| kvmesh_proto::usage_to_wire(&usage)),
            tenant_requests: (!requests.entries.is_empty()).then(|| kvmesh_proto::usage_to_wire(&requests)),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Snapshot>> {
        self.deltas().subscribe()
    }

    /// `/snapshot`: a debugging view.
    pub fn describe(&self) -> Value {
        let inner = self.lock();
        let workers: Vec<Value> = inner
            .registry()
            .entries()
            .map(|w| json!({"id": w.id, "url": w.name(), "role": role_name(w.role), "healthy": w.healthy, "load": w.load()}))
            .collect();
        json!({
            "version": inner.publication().version(),
            "pending": inner.publication().pending(),
            "age_ms": inner.publication().age_ms(),
            "workers": workers,
            "index_blocks": inner.index().len(),
            "index_entries": inner.index().entries(),
            "gateways": inner.gateways().ids(),
            // The fleet's tenant usage as the last delta carried it (decayed to now).
            "tenant_usage": inner.tenants().shipped().at(now_ms()).entries.into_iter().map(|(t, v)| (t, json!(v))).collect::<serde_json::Map<_, _>>(),
            "tenant_requests": inner.tenant_requests().shipped().at(now_ms()).entries.into_iter().map(|(t, v)| (t, json!(v))).collect::<serde_json::Map<_, _>>(),
            "settings": self.routing(),
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
