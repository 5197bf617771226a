//! The control-plane side of a [`Gateway`]: snapshots in (worker table, routing settings,
//! index deltas) and reports out (index inserts, per-worker counts).

use kvmesh_core::{Config, Role, Worker, WorkerTable};
use kvmesh_proto::v1::{self as proto, IndexInsert, ReportBatch, WorkerCounts};
use kvmesh_proto::Message;

use super::{build_mode, Gateway, Mode};
use crate::health::Health;
use crate::shared::{Delta, Inflight, SharedStore, SharedTable};
use kvmesh_core::{Router, WorkerId};

/// The worker table of a control-plane snapshot (workers whose URL is not usable are left out
/// and logged).
pub fn table_from(snapshot: &proto::Snapshot) -> WorkerTable {
    let workers = snapshot
        .workers
        .iter()
        .filter_map(|w| match Worker::from_url(w.id, &w.url) {
            Ok(mut worker) => {
                worker.role = match proto::Role::try_from(w.role) {
                    Ok(proto::Role::Prefill) => Role::Prefill,
                    Ok(proto::Role::Decode) => Role::Decode,
                    _ => Role::Regular,
                };
                worker.bootstrap_port = w.bootstrap_port.and_then(|p| u16::try_from(p).ok());
                worker.healthy = w.healthy;
                worker.load = w.load;
                Some(worker)
            }
            Err(e) => {
                log::warn!("control plane worker {} skipped: {e}", w.url);
                None
            }
        })
        .collect();
    WorkerTable { version: snapshot.version, workers }
}

/// The control-plane side: snapshots in, reports out.
impl Gateway {
    /// Replaces the worker table. Index entries of ids that now name another worker (or none)
    /// are forgotten, so that no prefix is attributed to the wrong worker.
    fn set_table(&mut self, table: WorkerTable) {
        let stale: Vec<WorkerId> = self
            .table
            .workers
            .iter()
            .filter(|old| table.get(old.id).is_none_or(|new| new.url != old.url || new.role != old.role))
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
        self.table_version = Some(table.version);
        self.table = table;
    }

    /// Merges the control plane's routing settings over the plugin configuration; rebuilds
    /// the routers when they change.
    fn set_policy(&mut self, policy_json: &str) {
        if policy_json.is_empty() || policy_json == self.policy_json {
            return;
        }
        self.policy_json = policy_json.to_string();
        let mut merged = match &self.base {
            serde_json::Value::Object(m) => m.clone(),
            _ => serde_json::Map::new(),
        };
        if let Ok(serde_json::Value::Object(policy)) = serde_json::from_str::<serde_json::Value>(policy_json) {
            merged.extend(policy);
        }
        for key in ["worker_urls", "prefill", "decode"] {
            merged.remove(key);
        }
        match Config::from_json(serde_json::Value::Object(merged).to_string().as_bytes()) {
            Ok(mut config) => {
                config.workers = self.table.clone();
                let rebuild = config.policy != self.config.policy
                    || config.pd != self.config.pd
                    || config.cache_aware != self.config.cache_aware
                    || config.block_size != self.config.block_size
                    || config.max_tree_size != self.config.max_tree_size;
                if rebuild {
                    self.mode = build_mode(&config);
                }
                self.health = Health::new(config.cb_failure_threshold, config.cb_timeout_duration_secs);
                self.config = config;
            }
            Err(e) => log::warn!("control plane policy ignored: {e}"),
        }
    }

    /// A snapshot from the stream (on the VM that owns it): applied here, and shared with the
    /// other VMs — the table through shared data, index changes through the delta log.
    pub fn apply_snapshot(&mut self, store: &dyn SharedStore, snapshot: &proto::Snapshot) {
        if snapshot.full || snapshot.workers_changed || !snapshot.policy_json.is_empty() {
            let mut shared = proto::Snapshot {
                version: snapshot.version,
                full: true,
                workers: snapshot.workers.clone(),
                workers_changed: true,
                policy_json: snapshot.policy_json.clone(),
                ..Default::default()
            };
            if shared.policy_json.is_empty() {
                shared.policy_json = self.policy_json.clone();
            }
            self.set_policy(&shared.policy_json);
            self.set_table(table_from(&shared));
            SharedTable::publish(store, snapshot.version, &shared.encode_to_vec());
        }
        let mut deltas: Vec<Delta> = Vec::with_capacity(snapshot.inserts.len() + snapshot.evictions.len());
        deltas.extend(snapshot.inserts.iter().map(|i| Delta {
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
            self.apply_delta(d);
        }
        self.log.append(store, &deltas);
    }

    /// Adopts the table the stream owner published, when it changed (every VM, on its tick
    /// and before each request: one small shared-data read).
    pub fn sync_table(&mut self, store: &dyn SharedStore) {
        let Some(version) = SharedTable::version(store) else { return };
        if self.table_version == Some(version) {
            return;
        }
        let Some(snapshot) = SharedTable::value(store).and_then(|b| proto::Snapshot::decode(b.as_slice()).ok()) else {
            return;
        };
        self.set_policy(&snapshot.policy_json);
        self.set_table(table_from(&snapshot));
        self.table_version = Some(version);
    }

    /// What the stream owner sends on its report tick: inserts made on this Envoy since the
    /// last report, and the in-flight counts.
    pub fn take_report(&mut self, store: &dyn SharedStore, gateway_id: &str) -> ReportBatch {
        self.catch_up(store);
        let inserts = std::mem::take(&mut self.unreported)
            .into_iter()
            .map(|(worker, hashes)| IndexInsert { worker, hashes })
            .collect();
        let counts = Inflight::counts(store)
            .into_iter()
            .map(|c| WorkerCounts { worker: c.worker, in_flight: c.in_flight, requests: c.finished, errors: c.failed })
            .collect();
        ReportBatch { gateway_id: gateway_id.to_string(), inserts, counts }
    }

    /// Everything this VM's index holds, for a control plane that just (re)connected.
    pub fn full_report(&mut self, gateway_id: &str) -> ReportBatch {
        let mut inserts = Vec::new();
        let mut export = |r: &mut Router| {
            inserts.extend(r.index().export().into_iter().map(|(worker, hashes)| IndexInsert { worker, hashes }));
        };
        match &mut self.mode {
            Mode::Regular(r) => export(r),
            Mode::Pd(pd) => {
                export(pd.prefill_router());
                export(pd.decode_router());
            }
        }
        self.unreported.clear();
        ReportBatch { gateway_id: gateway_id.to_string(), inserts, ..Default::default() }
    }

    pub fn table_version(&self) -> Option<u64> {
        self.table_version
    }
}
