//! The table follower: which control-plane table (version, epoch) and settings this VM routes
//! on, and adopting the one the stream owner published in shared data. On the owner, it also
//! publishes each snapshot's table for the others ([`TableFollower::publish`]).

use kvmesh_core::models::{ServedModel, MAX_MODELS_PER_WORKER, MAX_MODEL_NAME};
use kvmesh_core::{Role, RoutingSettings, Worker, WorkerTable};
use kvmesh_proto::v1 as proto;
use kvmesh_proto::Message;

use super::view::RoutingView;
use crate::shared::{Polled, SharedStore, SharedTable};

/// What this VM follows of the control plane.
pub(super) struct TableFollower {
    /// The plugin configuration's routing settings (the control plane's are overlaid on them).
    base: RoutingSettings,
    /// The control-plane table version this VM applied.
    pub(super) table_version: Option<u64>,
    /// The publication epoch that version belongs to (see [`SharedTable::publish`]): versions
    /// start again when kvmesh-cp restarts, so a version alone can repeat with another table.
    table_epoch: Option<u64>,
    /// The version of the shared table value this VM published or decoded last (the polled
    /// records name the one they go with).
    pub(super) shared_table_version: Option<u64>,
    /// The control plane's routing settings last applied.
    cp_settings: Option<RoutingSettings>,
    /// The settings message `cp_settings` came from, as received (a republished table
    /// carries the same one: compared before converting).
    cp_settings_wire: Option<proto::RoutingSettings>,
    /// The workers' authorization of the plugin configuration (`worker_api_key`), and the
    /// control plane's (its `--api-key`, on full snapshots), which wins when it has one.
    plugin_authorization: Option<String>,
    cp_authorization: Option<String>,
}

impl TableFollower {
    /// A follower of nothing yet, whose settings start as `base` (the plugin configuration's).
    pub(super) fn new(base: RoutingSettings, plugin_authorization: Option<String>) -> Self {
        Self {
            base,
            table_version: None,
            table_epoch: None,
            shared_table_version: None,
            cp_settings: None,
            cp_settings_wire: None,
            plugin_authorization,
            cp_authorization: None,
        }
    }

    /// Adopts the table the stream owner published, when it changed (every VM, on its tick
    /// and before each request: one small shared-data read).
    pub(super) fn sync(&mut self, store: &dyn SharedStore, view: &mut RoutingView) {
        if view.config.control_plane_cluster.is_none() {
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
            self.set_settings(view, snapshot.settings.as_ref());
            self.set_authorization(view, &snapshot.worker_authorization);
            self.adopt_table(view, &snapshot);
            self.shared_table_version = Some(snapshot.version);
        }
        if let Some((_, records)) = polled {
            let workers = &mut view.table.workers;
            for (i, p) in records.iter().enumerate() {
                // In the table's order, unless the table changed in between.
                let at = match workers.get(i) {
                    Some(w) if w.id == p.id => Some(i),
                    _ => workers.iter().position(|w| w.id == p.id),
                };
                if let Some(w) = at.and_then(|i| workers.get_mut(i)) {
                    p.apply_to(w);
                }
            }
        }
        view.table.version = version;
        self.table_version = Some(version);
        self.table_epoch = Some(epoch);
    }

    /// The owner's side: a snapshot that changes the table or the settings is adopted here and
    /// published for the other VMs under `epoch` — the table value only when the workers or
    /// the settings changed (or this VM has published none yet), the polled records always.
    pub(super) fn publish(
        &mut self,
        store: &dyn SharedStore,
        view: &mut RoutingView,
        snapshot: &proto::Snapshot,
        epoch: u64,
    ) {
        // What the other VMs adopt: the table, with the settings in force (a delta without
        // settings keeps the last ones).
        let settings = snapshot.settings.clone().or_else(|| self.cp_settings.as_ref().map(Into::into));
        // A full snapshot says whether kvmesh-cp has a workers' key; a delta keeps the last.
        let authorization = match snapshot.full {
            true => snapshot.worker_authorization.clone(),
            false => self.cp_authorization.clone().unwrap_or_default(),
        };
        let shared = proto::Snapshot {
            version: snapshot.version,
            full: true,
            workers: snapshot.workers.clone(),
            workers_changed: true,
            settings,
            worker_authorization: authorization,
            ..Default::default()
        };
        let structure = snapshot.full
            || snapshot.settings.is_some()
            || self.shared_table_version.is_none()
            || !same_workers(&view.table, &shared);
        self.set_settings(view, shared.settings.as_ref());
        self.set_authorization(view, &shared.worker_authorization);
        self.adopt_table(view, &shared);
        let encoded = structure.then(|| shared.encode_to_vec());
        if structure {
            self.shared_table_version = Some(snapshot.version);
        }
        let polled: Vec<Polled> = view.table.workers.iter().map(Polled::from).collect();
        let table_version = self.shared_table_version.unwrap_or(snapshot.version);
        SharedTable::publish(store, snapshot.version, epoch, encoded.as_deref(), table_version, &polled);
        self.table_epoch = Some(epoch);
    }

    /// Overlays the control plane's routing settings (the fields it sets win) on the plugin
    /// configuration's; the view is reconfigured with them. Settings that do not convert or
    /// validate are logged and the current configuration stays.
    fn set_settings(&mut self, view: &mut RoutingView, from_cp: Option<&proto::RoutingSettings>) {
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
        match view.config.with_settings(&merged) {
            Ok(config) => view.reconfigure(config),
            Err(e) => log::warn!("control plane settings ignored: {e}"),
        }
    }

    /// The control plane's workers' authorization (`wire`; empty: none), in force over the
    /// plugin configuration's when it has one. A value that could not be a header is ignored.
    fn set_authorization(&mut self, view: &mut RoutingView, wire: &str) {
        let header_safe = |v: &str| v.len() <= 1100 && v.bytes().all(|b| b == b' ' || b.is_ascii_graphic());
        self.cp_authorization = Some(wire).filter(|w| !w.is_empty() && header_safe(w)).map(str::to_string);
        view.config.worker_authorization = self.cp_authorization.clone().or_else(|| self.plugin_authorization.clone());
    }

    /// Takes `snapshot`'s worker table. Most tables the control plane sends carry new loads
    /// or health for the same workers: those are updated in place, without parsing every URL
    /// again (this runs on the request path, whenever a VM sees a new table).
    fn adopt_table(&mut self, view: &mut RoutingView, snapshot: &proto::Snapshot) {
        if same_workers(&view.table, snapshot) {
            for (worker, w) in view.table.workers.iter_mut().zip(&snapshot.workers) {
                Polled::from(w).apply_to(worker);
            }
            view.table.version = snapshot.version;
        } else {
            view.set_table(table_from(snapshot));
        }
        self.table_version = Some(snapshot.version);
    }
}

/// Whether `table` lists the same workers as `snapshot` (ids, URLs, roles, bootstrap ports, PD
/// protocols, data-parallel ranks, in order): then only their polled state (health, load, queue, KV use, utility)
/// can differ.
fn same_workers(table: &WorkerTable, snapshot: &proto::Snapshot) -> bool {
    table.workers.len() == snapshot.workers.len()
        && table.workers.iter().zip(&snapshot.workers).all(|(w, p)| {
            w.id == p.id
                && w.url == p.url
                && w.role == role_of(p.role)
                && w.bootstrap_port == p.bootstrap_port.and_then(|b| u16::try_from(b).ok())
                && same_models(&w.models, &p.models)
                && w.pd_protocol == p.pd_protocol.and_then(kvmesh_proto::pd_protocol_from_wire)
                && w.dp_rank == p.dp_rank
        })
}

/// A card's `owned_by` when it is short (64 bytes), else none.
fn owned_by(m: &proto::ServedModel) -> &str {
    if m.owned_by.len() <= 64 {
        &m.owned_by
    } else {
        ""
    }
}

/// Whether `models` is what [`models_of`] makes of `wire` (compared in place: this runs on
/// every snapshot).
fn same_models(models: &[ServedModel], wire: &[proto::ServedModel]) -> bool {
    let kept = wire.iter().filter(|m| !m.id.is_empty() && m.id.len() <= MAX_MODEL_NAME).take(MAX_MODELS_PER_WORKER);
    models.len() == kept.clone().count()
        && models
            .iter()
            .zip(kept)
            .all(|(m, w)| m.id == w.id && m.parent.as_deref().unwrap_or("") == w.parent && m.owned_by == owned_by(w))
}

/// The names a worker serves, as the control plane listed them: at most
/// [`MAX_MODELS_PER_WORKER`], names of 1 to [`MAX_MODEL_NAME`] bytes (others left out).
fn models_of(w: &proto::Worker) -> Vec<ServedModel> {
    let fits = |s: &str| !s.is_empty() && s.len() <= MAX_MODEL_NAME;
    w.models
        .iter()
        .filter(|m| fits(&m.id))
        .take(MAX_MODELS_PER_WORKER)
        .map(|m| ServedModel {
            id: m.id.clone(),
            parent: Some(m.parent.clone()).filter(|p| fits(p)),
            owned_by: owned_by(m).to_string(),
        })
        .collect()
}

fn role_of(role: i32) -> Role {
    match proto::Role::try_from(role) {
        Ok(proto::Role::Prefill) => Role::Prefill,
        Ok(proto::Role::Decode) => Role::Decode,
        Ok(proto::Role::Both) => Role::Both,
        _ => Role::Regular,
    }
}

/// The worker table of a control-plane snapshot (workers whose URL is not usable are left out
/// and logged).
pub fn table_from(snapshot: &proto::Snapshot) -> WorkerTable {
    let workers = snapshot
        .workers
        .iter()
        .filter(|w| {
            let fits = w.dp_rank.is_none_or(|r| r < kvmesh_core::dp::MAX_DP_SIZE);
            if !fits {
                log::warn!("control plane worker {} skipped: data-parallel rank {:?} out of range", w.url, w.dp_rank);
            }
            fits
        })
        .filter_map(|w| match Worker::from_url(w.id, &w.url).map(|x| x.with_dp_rank(w.dp_rank)) {
            Ok(mut worker) => {
                worker.role = role_of(w.role);
                worker.bootstrap_port = w.bootstrap_port.and_then(|p| u16::try_from(p).ok());
                worker.models = models_of(w);
                worker.pd_protocol = w.pd_protocol.and_then(kvmesh_proto::pd_protocol_from_wire);
                Polled::from(w).apply_to(&mut worker);
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
