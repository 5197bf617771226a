//! The state itself: what kvmesh-cp tracks, behind one lock (the registry, the global prefix
//! index, the publication, the gateways, the tenants' usage and requests: each an owner of its own), its counters, and the
//! channel the deltas go out on. The jobs done on it are the sibling modules'.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::gateways::Gateways;
use super::global_index::GlobalIndex;
use super::publication::{Deltas, Publication};
use super::registry::Registry;
use super::tenants::TenantUsage;
use crate::settings::Settings;

/// Everything behind the lock: one owner per part, each holding its data privately. Where an
/// invariant spans parts (an index change and the eviction the filters are told of; a worker
/// removed and its index entries), the job holds this one guard and calls each part's methods.
#[derive(Default)]
pub(super) struct Locked {
    registry: Registry,
    index: GlobalIndex,
    publication: Publication,
    gateways: Gateways,
    tenants: TenantUsage,
    /// The same tables for admitted requests (requests-per-second limits across gateways).
    tenant_requests: TenantUsage,
}

impl Locked {
    /// The registry (a reader's view).
    pub(super) fn registry(&self) -> &Registry {
        &self.registry
    }

    pub(super) fn index(&self) -> &GlobalIndex {
        &self.index
    }

    pub(super) fn publication(&self) -> &Publication {
        &self.publication
    }

    pub(super) fn gateways(&self) -> &Gateways {
        &self.gateways
    }

    /// The tenants' usage as each gateway reported it (fair shares across gateways).
    pub(super) fn tenants(&self) -> &TenantUsage {
        &self.tenants
    }

    pub(super) fn tenants_mut(&mut self) -> &mut TenantUsage {
        &mut self.tenants
    }

    /// The tenants' admitted requests as each gateway reported them.
    pub(super) fn tenant_requests(&self) -> &TenantUsage {
        &self.tenant_requests
    }

    pub(super) fn tenant_requests_mut(&mut self) -> &mut TenantUsage {
        &mut self.tenant_requests
    }

    /// The registry, to write (the publication is then told by the caller).
    pub(super) fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    pub(super) fn publication_mut(&mut self) -> &mut Publication {
        &mut self.publication
    }

    pub(super) fn gateways_mut(&mut self) -> &mut Gateways {
        &mut self.gateways
    }

    /// Every part, to write together: the registry, the index, the publication, the gateways.
    pub(super) fn parts(&mut self) -> (&mut Registry, &mut GlobalIndex, &mut Publication, &mut Gateways) {
        (&mut self.registry, &mut self.index, &mut self.publication, &mut self.gateways)
    }
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
    /// Worker tables a `Watch` stream holds until Envoy's endpoints list their healthy workers.
    pub tables_held: Gauge,
}

/// The control plane's state, shared by every task (see the sibling modules for what each does with it).
pub struct State {
    pub settings: Settings,
    locked: Mutex<Locked>,
    pub counters: Counters,
    deltas: Deltas,
    /// The InferenceObjectives discovery found, `name=N` (`objectives.rs`; its own lock, never
    /// taken while waiting for the state's).
    objectives: Mutex<Vec<String>>,
}

/// Now, in ms since the epoch.
pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl State {
    /// A state without workers yet: new ids start at `next_id`, and the URLs in `remembered`
    /// get their old ids back.
    pub(super) fn empty(settings: Settings, next_id: u32, remembered: HashMap<String, u32>) -> Arc<Self> {
        let locked = Locked { registry: Registry::new(next_id, remembered), ..Default::default() };
        Arc::new(Self {
            settings,
            locked: Mutex::new(locked),
            counters: Counters::default(),
            deltas: Deltas::default(),
            objectives: Mutex::default(),
        })
    }

    /// The discovered objectives, behind their own lock.
    pub(super) fn objectives(&self) -> MutexGuard<'_, Vec<String>> {
        self.objectives.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state behind its lock, taken even when poisoned (a panic while it was held leaves it usable).
    pub(super) fn lock(&self) -> MutexGuard<'_, Locked> {
        self.locked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The deltas' channel (sent on without the lock held).
    pub(super) fn deltas(&self) -> &Deltas {
        &self.deltas
    }
}
