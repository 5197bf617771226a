//! The control-plane side of a [`Gateway`]: snapshots in (worker table, routing settings,
//! index deltas) and reports out (index inserts, per-worker counts).

use kvmesh_core::breaker::BreakerState;
use kvmesh_core::{Role, RoutingSettings, Worker, WorkerTable};
use kvmesh_proto::v1::{self as proto, IndexEvict, IndexInsert, ReportBatch, WorkerCounts};
use kvmesh_proto::Message;

use super::{build_mode, Gateway, Mode, Now};
use crate::shared::{Delta, Inflight, Polled, SharedStore, SharedTable};
use kvmesh_core::rng::RngCore;
use kvmesh_core::{Router, WorkerId};

/// The worker table of a control-plane snapshot (workers whose URL is not usable are left out
/// and logged).
/// Whether `table` lists the same workers as `snapshot` (ids, URLs, roles, bootstrap ports, in
/// order): then only their polled state (health, load, queue, KV use, utility) can differ.
fn same_workers(table: &WorkerTable, snapshot: &proto::Snapshot) -> bool {
    table.workers.len() == snapshot.workers.len()
        && table.workers.iter().zip(&snapshot.workers).all(|(w, p)| {
            w.id == p.id
                && w.url == p.url
                && w.role == role_of(p.role)
                && w.bootstrap_port == p.bootstrap_port.and_then(|b| u16::try_from(b).ok())
        })
}

fn role_of(role: i32) -> Role {
    match proto::Role::try_from(role) {
        Ok(proto::Role::Prefill) => Role::Prefill,
        Ok(proto::Role::Decode) => Role::Decode,
        _ => Role::Regular,
    }
}

/// What is shared of `worker` on every table change (see [`SharedTable::publish`]).
fn polled_of(w: &Worker) -> Polled {
    Polled { id: w.id, healthy: w.healthy, load: w.load, waiting: w.waiting, kv_usage: w.kv_usage, utility: w.utility }
}

/// Copies what the control plane polls into `worker` (scores that are not finite: none).
fn apply_polled(worker: &mut Worker, p: &Polled) {
    worker.healthy = p.healthy;
    worker.load = p.load;
    worker.waiting = p.waiting;
    worker.kv_usage = p.kv_usage.filter(|u| u.is_finite());
    worker.utility = p.utility.filter(|u| u.is_finite());
}

/// [`apply_polled`] from the control plane's message.
fn set_polled(worker: &mut Worker, w: &proto::Worker) {
    let p = Polled {
        id: w.id,
        healthy: w.healthy,
        load: w.load,
        waiting: w.waiting,
        kv_usage: w.kv_usage,
        utility: w.utility,
    };
    apply_polled(worker, &p);
}

pub fn table_from(snapshot: &proto::Snapshot) -> WorkerTable {
    let workers = snapshot
        .workers
        .iter()
        .filter_map(|w| match Worker::from_url(w.id, &w.url) {
            Ok(mut worker) => {
                worker.role = role_of(w.role);
                worker.bootstrap_port = w.bootstrap_port.and_then(|p| u16::try_from(p).ok());
                set_polled(&mut worker, w);
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

    /// Overlays the control plane's routing settings (the fields it sets win) on the plugin
    /// configuration's; rebuilds the routers when the routing changes. Settings that do not
    /// convert or validate are logged and the current configuration stays.
    fn set_settings(&mut self, from_cp: Option<&proto::RoutingSettings>) {
        let Some(message) = from_cp else { return };
        if self.cp_settings_wire.as_ref() == Some(message) {
            return; // What every table republished with new loads carries: nothing to convert.
        }
        self.cp_settings_wire = Some(message.clone());
        let cp = match RoutingSettings::try_from(message.clone()) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("control plane settings ignored: {e}");
                return;
            }
        };
        if self.cp_settings.as_ref() == Some(&cp) {
            return;
        }
        let mut merged = self.base.clone();
        merged.overlay(&cp);
        self.cp_settings = Some(cp);
        match self.config.with_settings(&merged) {
            Ok(mut config) => {
                config.workers = self.table.clone();
                if config.router_params() != self.config.router_params()
                    || config.policy != self.config.policy
                    || config.pd != self.config.pd
                {
                    self.mode = build_mode(&config);
                }
                self.health.set_params(config.breaker);
                self.stalls.set_window(config.worker_stall_ms);
                self.config = config;
            }
            Err(e) => log::warn!("control plane settings ignored: {e}"),
        }
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
                self.publish_epoch = self.rng.next_u64();
            }
            // What the other VMs adopt: the table, with the settings in force (a delta without
            // settings keeps the last ones).
            let settings = snapshot.settings.clone().or_else(|| self.cp_settings.as_ref().map(Into::into));
            let shared = proto::Snapshot {
                version: snapshot.version,
                full: true,
                workers: snapshot.workers.clone(),
                workers_changed: true,
                settings,
                ..Default::default()
            };
            // The table value is shared again only when the workers or the settings changed
            // (or this VM has published none yet); otherwise only the polled records.
            let structure = snapshot.full
                || snapshot.settings.is_some()
                || self.shared_table_version.is_none()
                || !same_workers(&self.table, &shared);
            self.set_settings(shared.settings.as_ref());
            self.adopt_table(&shared);
            let encoded = structure.then(|| shared.encode_to_vec());
            if structure {
                self.shared_table_version = Some(snapshot.version);
            }
            let polled: Vec<Polled> = self.table.workers.iter().map(polled_of).collect();
            let table_version = self.shared_table_version.unwrap_or(snapshot.version);
            SharedTable::publish(
                store,
                snapshot.version,
                self.publish_epoch,
                encoded.as_deref(),
                table_version,
                &polled,
            );
            self.table_epoch = Some(self.publish_epoch);
        }
        let mut deltas: Vec<Delta> = Vec::with_capacity(snapshot.inserts.len() + snapshot.evictions.len());
        // This Envoy's own inserts, echoed back by the control plane, are in its index already.
        let own = |i: &&IndexInsert| !i.origin.is_empty() && self.own_id.as_deref() == Some(i.origin.as_str());
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
            self.apply_delta(d);
        }
        self.log.append(store, &deltas);
    }

    /// Adopts the table the stream owner published, when it changed (every VM, on its tick
    /// and before each request: one small shared-data read).
    pub fn sync_table(&mut self, store: &dyn SharedStore) {
        if self.config.control_plane_cluster.is_none() {
            return; // Static workers only: nothing to read.
        }
        let Some((version, epoch)) = SharedTable::version(store) else { return };
        if self.table_version == Some(version) && self.table_epoch == Some(epoch) {
            return;
        }
        // Most new versions carry new loads or health only: the polled records (a few hundred
        // bytes) are read, and the table itself decoded only when it changed — or when a new
        // epoch began, whose versions say nothing about the last one's.
        let polled = SharedTable::polled(store);
        let table_at = polled.as_ref().map(|(v, _)| *v);
        if self.table_epoch != Some(epoch) || table_at.is_none() || table_at != self.shared_table_version {
            let value = SharedTable::value(store);
            let Some(snapshot) = value.and_then(|b| proto::Snapshot::decode(b.as_slice()).ok()) else { return };
            self.set_settings(snapshot.settings.as_ref());
            self.adopt_table(&snapshot);
            self.shared_table_version = Some(snapshot.version);
        }
        if let Some((_, records)) = polled {
            let workers = &mut self.table.workers;
            for (i, p) in records.iter().enumerate() {
                // In the table's order, unless the table changed in between.
                let at = match workers.get(i) {
                    Some(w) if w.id == p.id => Some(i),
                    _ => workers.iter().position(|w| w.id == p.id),
                };
                if let Some(w) = at.and_then(|i| workers.get_mut(i)) {
                    apply_polled(w, p);
                }
            }
        }
        self.table.version = version;
        self.table_version = Some(version);
        self.table_epoch = Some(epoch);
    }

    /// Takes `snapshot`'s worker table. Most tables the control plane sends carry new loads
    /// or health for the same workers: those are updated in place, without parsing every URL
    /// again (this runs on the request path, whenever a VM sees a new table).
    fn adopt_table(&mut self, snapshot: &proto::Snapshot) {
        if same_workers(&self.table, snapshot) {
            for (worker, w) in self.table.workers.iter_mut().zip(&snapshot.workers) {
                set_polled(worker, w);
            }
            self.table.version = snapshot.version;
            self.table_version = Some(snapshot.version);
        } else {
            self.set_table(table_from(snapshot));
        }
    }

    /// What the stream owner sends on its report tick (at `now`): inserts made on this
    /// Envoy since the last report, and per worker the counts (in flight, finished, failed,
    /// failovers) and the circuit breaker's state.
    pub fn take_report(&mut self, store: &dyn SharedStore, gateway_id: &str, now: Now) -> ReportBatch {
        self.catch_up(store, Inflight::load(store).head());
        let inserts = self
            .unreported
            .take()
            .into_iter()
            .map(|(worker, hashes)| IndexInsert { worker, hashes, ..Default::default() })
            .collect();
        let mut counts: std::collections::BTreeMap<WorkerId, WorkerCounts> = Inflight::counts(store)
            .into_iter()
            .map(|c| {
                let counts = WorkerCounts {
                    worker: c.worker,
                    in_flight: c.in_flight,
                    requests: c.finished,
                    errors: c.failed,
                    ..Default::default()
                };
                (c.worker, counts)
            })
            .collect();
        // Breakers of workers no longer in the table (kept until idle) are not reported.
        for b in self.health.report(store, now).into_iter().filter(|b| self.table.get(b.worker).is_some()) {
            let entry =
                counts.entry(b.worker).or_insert_with(|| WorkerCounts { worker: b.worker, ..Default::default() });
            entry.set_breaker(match b.state {
                BreakerState::Closed => proto::BreakerState::Closed,
                BreakerState::Open => proto::BreakerState::Open,
                BreakerState::HalfOpen => proto::BreakerState::HalfOpen,
            });
            entry.failovers = b.failovers;
        }
        for (worker, feedback) in
            crate::shared::feedback::read(store).into_iter().filter(|(w, _)| self.table.get(*w).is_some())
        {
            counts.entry(worker).or_insert_with(|| WorkerCounts { worker, ..Default::default() }).feedback =
                Some(feedback);
        }
        let stale = self.stale.drain(..).map(|(worker, hashes)| IndexEvict { worker, hashes }).collect();
        ReportBatch { gateway_id: gateway_id.to_string(), inserts, counts: counts.into_values().collect(), stale }
    }

    /// Everything this VM's index holds, for a control plane that just (re)connected: report
    /// batches of at most `max_hashes` hashes each (at least one batch, possibly empty).
    pub fn full_report(&mut self, gateway_id: &str, max_hashes: usize) -> Vec<ReportBatch> {
        let max_hashes = max_hashes.max(1);
        let batch = || ReportBatch { gateway_id: gateway_id.to_string(), ..Default::default() };
        let mut out: Vec<ReportBatch> = Vec::new();
        let mut room = 0usize;
        let mut export = |r: &mut Router| {
            // A group of workers at a time, about `max_hashes` blocks each: the memory of one
            // batch's worth of recency stamps, not of the whole index.
            let mut sizes: Vec<(WorkerId, u64)> = r.index().sizes().collect();
            sizes.sort_unstable();
            let mut groups: Vec<Vec<WorkerId>> = Vec::new();
            let mut filled = u64::MAX;
            for (worker, size) in sizes {
                match groups.last_mut() {
                    Some(g) if filled.saturating_add(size) <= max_hashes as u64 => {
                        g.push(worker);
                        filled += size;
                    }
                    _ => {
                        groups.push(vec![worker]);
                        filled = size;
                    }
                }
            }
            for (worker, hashes) in groups.iter().flat_map(|g| r.index().export_workers(g)) {
                let mut rest = hashes.as_slice();
                while !rest.is_empty() {
                    if room == 0 {
                        out.push(batch());
                        room = max_hashes;
                    }
                    let Some((now, later)) = rest.split_at_checked(room.min(rest.len())) else { break };
                    if let Some(last) = out.last_mut() {
                        // Newest first within the piece: see `PrefixIndex::export`.
                        let hashes = kvmesh_core::index::as_insert(now);
                        last.inserts.push(IndexInsert { worker, hashes, ..Default::default() });
                    }
                    room -= now.len();
                    rest = later;
                }
            }
        };
        match &mut self.mode {
            Mode::Regular(r) => export(r),
            Mode::Pd(pd) => {
                export(pd.prefill_router());
                export(pd.decode_router());
            }
        }
        self.unreported.take();
        if out.is_empty() {
            out.push(batch());
        }
        out
    }

    pub fn table_version(&self) -> Option<u64> {
        self.table_version
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::{Outcome, RequestInfo};
    use crate::shared::fake::FakeStore;
    use kvmesh_core::Endpoint;

    fn gateway(store: &FakeStore, seed: u64) -> Gateway {
        let json = r#"{"control_plane_cluster":"cp","worker_urls":["http://127.0.0.1:1"],"cache_threshold":0.2,
            "balance_abs_threshold":5}"#;
        let mut g = Gateway::new(kvmesh_core::Config::from_json(json.as_bytes()).unwrap(), store, seed);
        g.set_reporting(true);
        g
    }

    fn cp_settings(json: &str) -> Option<proto::RoutingSettings> {
        Some((&serde_json::from_str::<RoutingSettings>(json).unwrap()).into())
    }

    fn worker(id: u32, port: u16) -> proto::Worker {
        proto::Worker { id, url: format!("http://127.0.0.1:{port}"), healthy: true, ..Default::default() }
    }

    fn route(g: &mut Gateway, store: &FakeStore, text: &str) -> String {
        let body = format!(r#"{{"text":"{text}"}}"#);
        match g.route_request(store, Endpoint::Generate, body.as_bytes(), &RequestInfo::default()) {
            Outcome::Route(plan) => g.commit(store, plan).main.addr,
            Outcome::Reply(r) => panic!("not routed: {}", r.status),
        }
    }

    #[test]
    fn marginal_utility_scores_from_the_snapshot_steer_every_vm() {
        let store = FakeStore::default();
        let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
        let scored = |id, port, utility| proto::Worker { utility, ..worker(id, port) };
        let full = proto::Snapshot {
            version: 4,
            full: true,
            workers: vec![scored(10, 20, Some(-1.0)), scored(11, 21, Some(1.5)), scored(12, 22, Some(f64::NAN))],
            workers_changed: true,
            settings: cp_settings(r#"{"policy":"marginal_utility"}"#),
            ..Default::default()
        };
        owner.apply_snapshot(&store, &full);
        assert!(owner.table.get(12).is_some_and(|w| w.utility.is_none()), "not finite: no score");
        // Every request goes to the best score while the loads stay equal (each is finished
        // before the next: routed requests stay in flight, so end them).
        for i in 0..5 {
            assert_eq!(route(&mut other, &store, &format!("q{i}")), "127.0.0.1:21");
            crate::shared::Inflight::finish(&store, 11, false);
        }
    }

    /// A restarted control plane counts its versions from the start again: a VM that last
    /// saw the old one's version 2 (and has been idle since, as a native build's thread can
    /// be) still adopts the new one's version 2, which lists another table.
    #[test]
    fn a_restarted_control_planes_repeated_version_is_still_adopted() {
        let store = FakeStore::default();
        let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
        let snap = |version, workers: Vec<proto::Worker>| proto::Snapshot {
            version,
            full: version == 1,
            workers,
            workers_changed: true,
            ..Default::default()
        };
        owner.apply_snapshot(&store, &snap(1, vec![worker(10, 20)]));
        owner.apply_snapshot(&store, &snap(2, vec![worker(10, 20)]));
        route(&mut other, &store, "a");
        assert_eq!(other.table_version(), Some(2));
        owner.apply_snapshot(&store, &snap(3, vec![worker(10, 20), worker(11, 21)]));
        // The control plane restarts before `other` routes again; its first snapshot is a
        // full one numbered 2 again, with both workers.
        let mut again = snap(2, vec![worker(10, 20), worker(11, 21)]);
        again.full = true;
        owner.apply_snapshot(&store, &again);
        route(&mut other, &store, "b");
        assert_eq!(other.table.workers.len(), 2, "the new table, though its version is the one seen last");
        let served: std::collections::HashSet<String> =
            (0..8).map(|i| route(&mut other, &store, &format!("distinct prompt {i} ").repeat(20))).collect();
        assert!(served.contains("127.0.0.1:21"), "the added worker gets traffic: {served:?}");
    }

    #[test]
    fn the_owner_shares_the_table_and_index_with_the_other_vms() {
        let store = FakeStore::default();
        let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
        let text = "p".repeat(300);
        let hashes = kvmesh_core::blocks::block_hashes(text.as_bytes(), 32);
        let full = proto::Snapshot {
            version: 3,
            full: true,
            workers: vec![worker(10, 20), worker(11, 21), worker(12, 22)],
            workers_changed: true,
            inserts: vec![IndexInsert { worker: 11, hashes, ..Default::default() }],
            settings: cp_settings(r#"{"cache_threshold":0.1}"#),
            ..Default::default()
        };
        owner.apply_snapshot(&store, &full);
        assert_eq!(owner.table_version(), Some(3));
        assert_eq!(owner.config().cache_aware.cache_threshold, 0.1, "the control plane's setting wins");
        assert_eq!(owner.config().cache_aware.balance_abs_threshold, 5, "the plugin's stays where the cp sets none");
        // The other VM adopts the table and the index before its next request.
        assert_eq!(route(&mut other, &store, &format!("{text}?")), "127.0.0.1:21");
        assert_eq!(other.table_version(), Some(3));
        assert_eq!(other.config().cache_aware.cache_threshold, 0.1);
        assert_eq!(other.config().cache_aware.balance_abs_threshold, 5);
        // A worker-set delta without settings keeps the control plane's settings, on every VM.
        let delta = proto::Snapshot {
            version: 4,
            workers: vec![worker(10, 20), worker(11, 21)],
            workers_changed: true,
            ..Default::default()
        };
        owner.apply_snapshot(&store, &delta);
        route(&mut other, &store, "x");
        assert_eq!(
            (owner.config().cache_aware.cache_threshold, other.config().cache_aware.cache_threshold),
            (0.1, 0.1)
        );
        assert_eq!(other.table_version(), Some(4));
    }

    #[test]
    fn control_plane_settings_switch_the_policy_and_bad_ones_are_ignored() {
        let store = FakeStore::default();
        let mut g = gateway(&store, 1);
        let full = |version, settings| proto::Snapshot {
            version,
            full: true,
            workers: vec![worker(0, 30), worker(1, 31), worker(2, 32)],
            workers_changed: true,
            settings,
            ..Default::default()
        };
        g.apply_snapshot(&store, &full(1, cp_settings(r#"{"policy":"round_robin"}"#)));
        assert_eq!(g.config().policy, kvmesh_core::policy::PolicyKind::RoundRobin);
        let text = "s".repeat(200);
        let picks: Vec<String> = (0..3).map(|_| route(&mut g, &store, &text)).collect();
        assert_eq!(picks.iter().collect::<std::collections::HashSet<_>>().len(), 3, "round robin: {picks:?}");
        // Invalid (block_size 0) and unconvertible (an unknown policy number) settings change nothing.
        g.apply_snapshot(&store, &full(2, cp_settings(r#"{"block_size":0}"#)));
        let unknown = proto::RoutingSettings { policy: Some(99), ..Default::default() };
        g.apply_snapshot(&store, &full(3, Some(unknown)));
        assert_eq!(g.config().policy, kvmesh_core::policy::PolicyKind::RoundRobin);
        assert_eq!(g.config().block_size, 32);
        assert_eq!(g.table_version(), Some(3));
    }

    #[test]
    fn a_table_with_new_loads_for_the_same_workers_is_adopted_in_place_and_a_new_role_is_not() {
        let store = FakeStore::default();
        let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
        let with = |version, loads: [u64; 2], healthy: bool| proto::Snapshot {
            version,
            full: version == 1,
            workers: vec![
                proto::Worker { load: loads[0], healthy, ..worker(0, 30) },
                proto::Worker { load: loads[1], ..worker(1, 31) },
            ],
            workers_changed: true,
            // As from kvmesh-cp: settings only in a full snapshot.
            settings: if version == 1 { cp_settings(r#"{"policy":"power_of_two"}"#) } else { None },
            ..Default::default()
        };
        owner.apply_snapshot(&store, &with(1, [0, 0], true));
        route(&mut other, &store, "first");
        let table_cas = store.get("kvmesh.cp.table").1;
        assert!(table_cas.is_some());
        let url_before = other.table.get(0).map(|w| w.url.as_ptr());
        for (version, loads, want) in [(2, [50, 0], "127.0.0.1:31"), (3, [0, 50], "127.0.0.1:30")] {
            owner.apply_snapshot(&store, &with(version, loads, true));
            for _ in 0..4 {
                let to = route(&mut other, &store, "q");
                crate::shared::Inflight::finish(&store, if to.ends_with("31") { 1 } else { 0 }, false);
                assert_eq!(to, want, "loads {loads:?}");
            }
            assert_eq!(other.table_version(), Some(version));
            assert_eq!(other.table.get(0).map(|w| w.load), Some(loads[0]));
        }
        assert_eq!(other.table.get(0).map(|w| w.url.as_ptr()), url_before, "the same workers, updated in place");
        owner.apply_snapshot(&store, &with(4, [0, 0], false));
        route(&mut other, &store, "q");
        assert_eq!(other.table.get(0).map(|w| w.healthy), Some(false));
        assert_eq!(store.get("kvmesh.cp.table").1, table_cas, "only the polled records were shared again");
        // A new role for the same URL is a new worker: the table is rebuilt.
        let mut pd = with(5, [0, 0], true);
        pd.workers[1].role = proto::Role::Prefill as i32;
        owner.apply_snapshot(&store, &pd);
        route(&mut other, &store, "q");
        assert_eq!(other.table.get(1).map(|w| w.role), Some(kvmesh_core::worker::Role::Prefill));
    }

    #[test]
    fn a_new_owner_names_the_table_the_last_owner_published() {
        let store = FakeStore::default();
        let (mut a, mut b) = (gateway(&store, 1), gateway(&store, 2));
        let snap = |version, full| proto::Snapshot {
            version,
            full,
            workers: vec![worker(0, 30), worker(1, 31)],
            workers_changed: true,
            ..Default::default()
        };
        a.apply_snapshot(&store, &snap(1, true));
        route(&mut b, &store, "q");
        // A reconnects: the same workers, published again as a table of version 3.
        a.apply_snapshot(&store, &snap(3, true));
        // B takes the streams over without having routed since, and gets new loads.
        b.apply_snapshot(&store, &snap(4, false));
        let (table_at, _) = SharedTable::polled(&store).unwrap();
        assert_eq!(table_at, 3, "the records name the table that is in shared data");
        let decoded = a.shared_table_version;
        route(&mut a, &store, "q");
        assert_eq!(a.shared_table_version, decoded, "A decodes no table for new loads");
    }

    #[test]
    fn an_id_that_changes_worker_loses_its_index_entries() {
        let store = FakeStore::default();
        let mut g = gateway(&store, 1);
        let snapshot = |version, workers: Vec<proto::Worker>| proto::Snapshot {
            version,
            full: true,
            workers,
            workers_changed: true,
            ..Default::default()
        };
        g.apply_snapshot(&store, &snapshot(1, vec![worker(0, 30), worker(1, 31)]));
        // Only id 0 is up when the prefix is first routed.
        let mut down = worker(1, 31);
        down.healthy = false;
        g.apply_snapshot(&store, &snapshot(2, vec![worker(0, 30), down]));
        assert_eq!(route(&mut g, &store, &"q".repeat(300)), "127.0.0.1:30");
        assert!(g.index_len() > 0);
        // Same id, same worker, new health: the index stays.
        g.apply_snapshot(&store, &snapshot(3, vec![worker(0, 30), worker(1, 31)]));
        assert!(g.index_len() > 0);
        // Id 0 now names another worker: its blocks are forgotten.
        g.apply_snapshot(&store, &snapshot(4, vec![worker(0, 40), worker(1, 31)]));
        assert_eq!(g.index_len(), 0);
    }

    #[test]
    fn a_delta_does_not_echo_this_envoys_own_inserts() {
        let store = FakeStore::default();
        let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
        owner.set_own_id("envoy/a");
        let full = proto::Snapshot {
            version: 1,
            full: true,
            workers: vec![worker(0, 20), worker(1, 21)],
            workers_changed: true,
            ..Default::default()
        };
        owner.apply_snapshot(&store, &full);
        let insert = |origin: &str, hashes: Vec<u64>| IndexInsert { worker: 1, hashes, origin: origin.into() };
        let delta = proto::Snapshot {
            version: 2,
            inserts: vec![insert("envoy/a", vec![1, 2, 3]), insert("envoy/b", vec![4]), insert("", vec![5])],
            ..Default::default()
        };
        let before = owner.index_len();
        owner.apply_snapshot(&store, &delta);
        assert_eq!(owner.index_len(), before + 2, "only the other gateway's and the control plane's blocks");
        // The other VMs get the same through the delta log.
        route(&mut other, &store, "x");
        assert_eq!(other.index_len(), 1 + 2, "its own block, and the two from the delta");
    }

    #[test]
    fn reports_carry_new_inserts_once_and_the_counts() {
        let store = FakeStore::default();
        let mut g = gateway(&store, 1);
        g.apply_snapshot(
            &store,
            &proto::Snapshot {
                version: 1,
                full: true,
                workers: vec![worker(0, 30)],
                workers_changed: true,
                ..Default::default()
            },
        );
        route(&mut g, &store, &"r".repeat(100));
        let report = g.take_report(&store, "gw", Now::default());
        assert_eq!(report.inserts.len(), 1);
        assert_eq!(report.counts[0].in_flight, 1);
        assert!(g.take_report(&store, "gw", Now::default()).inserts.is_empty(), "reported once");
        let full = g.full_report("gw", 1 << 16);
        assert_eq!(full.len(), 1);
        assert_eq!(full[0].inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), 4);
        // In chunks of at most 3 hashes: every hash once, no chunk over the bound.
        route(&mut g, &store, &"s".repeat(100));
        let chunks = g.full_report("gw", 3);
        let sizes: Vec<usize> = chunks.iter().map(|b| b.inserts.iter().map(|i| i.hashes.len()).sum()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 8, "{sizes:?}");
        assert!(sizes.iter().all(|&n| (1..=3).contains(&n)), "{sizes:?}");
        assert!(chunks.iter().all(|b| b.gateway_id == "gw" && b.counts.is_empty()));
    }
}
