//! One worker as the registry keeps it: where it came from, its health and load as probed,
//! what the gateways report about it, and the views of it that the admin API and the
//! filters read.

use std::collections::HashMap;

use kvmesh_core::models::ServedModel;
use kvmesh_core::policy::UtilityWindow;
use kvmesh_core::settings::PdProtocol;
use kvmesh_proto::v1::{BreakerState, Role};

use super::counts::LastCounts;

use crate::feedback::FeedbackTotals;

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

/// One registered worker.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub id: u32,
    pub url: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    /// The PD protocol it speaks when not the deployment's (a pod's `kvmesh.io/pd-protocol`).
    pub pd_protocol: Option<PdProtocol>,
    pub source: Source,
    pub healthy: bool,
    /// Added through the API and not yet probed: unhealthy (no traffic) until its first
    /// health check passes.
    awaiting_probe: bool,
    fails: u32,
    oks: u32,
    /// Taken out because it answered none of its health and load probes for
    /// `--worker-unresponsive-secs` (a hung worker); back as soon as it answers one.
    pub unresponsive: bool,
    /// When the oldest probe it has not answered since its last answer was sent (none: every
    /// probe sent was answered, or none was sent — a worker not asked is not silent).
    unanswered_since: Option<std::time::Instant>,
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
    /// The model names it serves, as it last said (empty: not known yet).
    pub models: Vec<ServedModel>,
    /// A model name given for it (the API's `model_id`): served besides what it lists, which
    /// then stays a name it answers to (as SMG's `--model-id-from` does).
    pub model_id: Option<String>,
    /// `--dp-aware`: the data-parallel rank of the worker at `url` this entry is (every rank
    /// is an entry of its own: own id, load, index); none: the worker is one target.
    pub dp_rank: Option<u32>,
    /// Its engine's KV-event publisher, when a pod annotation or the add-worker API names one
    /// (over `--kv-events-*`).
    pub kv_events: Option<crate::settings::KvEventEndpoints>,
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

    /// The names it serves as the filters see them: the given `model_id` first, then what
    /// it listed.
    pub fn served(&self) -> Vec<ServedModel> {
        let given = self.model_id.iter().filter(|id| !self.models.iter().any(|m| &m.id == *id));
        given
            .map(|id| ServedModel { id: id.clone(), parent: None, owned_by: String::new() })
            .chain(self.models.iter().cloned())
            .collect()
    }

    /// Whether the probes ask it: healthy, or taken out for not answering (so that it comes
    /// back when it does).
    pub fn probed(&self) -> bool {
        self.healthy || self.unresponsive
    }

    /// The load filters see: the worker's own report, else the gateways' in-flight sum.
    pub fn load(&self) -> u64 {
        self.polled_load.unwrap_or_else(|| self.inflight_total())
    }

    /// A worker just registered: no probes, loads or counts yet. `awaiting_probe`: unhealthy
    /// (no traffic) until its first health check passes.
    pub(super) fn new(
        id: u32,
        url: &str,
        role: Role,
        bootstrap_port: Option<u16>,
        source: Source,
        awaiting_probe: bool,
    ) -> Self {
        Self {
            id,
            url: url.to_string(),
            role,
            bootstrap_port,
            pd_protocol: None,
            source,
            healthy: !awaiting_probe,
            awaiting_probe,
            fails: 0,
            oks: 0,
            unresponsive: false,
            unanswered_since: None,
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
            models: Vec::new(),
            model_id: None,
            dp_rank: None,
            kv_events: None,
        }
    }

    /// A new entry for rank `rank` of this entry's worker, under `id`: its health, probe
    /// state and names; no load, counts or index yet.
    pub(super) fn rank_of(&self, id: u32, rank: Option<u32>) -> Self {
        let mut entry = Self::new(id, &self.url, self.role, self.bootstrap_port, self.source, false);
        entry.healthy = self.healthy;
        entry.awaiting_probe = self.awaiting_probe;
        entry.unresponsive = self.unresponsive;
        entry.fails = self.fails;
        entry.oks = self.oks;
        entry.pd_protocol = self.pd_protocol;
        entry.models = self.models.clone();
        entry.model_id = self.model_id.clone();
        entry.kv_capacity_reported = self.kv_capacity_reported;
        entry.dp_rank = rank;
        entry
    }

    /// One health-check result with the failure (`fail_at`) and success (`ok_at`)
    /// thresholds. Says whether `healthy` changed.
    pub(super) fn health_result(&mut self, ok: bool, fail_at: u32, ok_at: u32) -> bool {
        let was = self.healthy;
        if ok {
            self.fails = 0;
            self.oks += 1;
            if !self.healthy && (self.oks >= ok_at || self.awaiting_probe) {
                self.healthy = true;
                self.unresponsive = false;
                self.unanswered_since = None;
            }
            self.awaiting_probe = false;
        } else {
            self.oks = 0;
            self.fails += 1;
            if self.fails >= fail_at {
                // Unhealthy by its health checks: an answer to a load poll no longer brings
                // it back, only passed health checks do.
                self.healthy = false;
                self.unresponsive = false;
            }
        }
        was != self.healthy
    }

    /// It answered a probe (any HTTP status). Taken out for not answering, it is back unless
    /// `fail_at` health checks failed meanwhile. Says whether it is back in rotation.
    pub(super) fn answered(&mut self, fail_at: u32) -> bool {
        self.unanswered_since = None;
        if !self.unresponsive {
            return false;
        }
        self.unresponsive = false;
        if self.fails < fail_at {
            self.healthy = true;
            return true;
        }
        false
    }

    /// A probe of it is being sent at `now`: its silence counts from the oldest one not answered.
    pub(super) fn asking(&mut self, now: std::time::Instant) {
        self.unanswered_since.get_or_insert(now);
    }

    /// Takes it out when healthy and silent for more than `silence` at `now`; says whether it did.
    pub(super) fn take_out_if_silent(&mut self, now: std::time::Instant, silence: std::time::Duration) -> bool {
        if self.healthy && self.unanswered_since.is_some_and(|at| now.saturating_duration_since(at) > silence) {
            self.healthy = false;
            self.unresponsive = true;
            return true;
        }
        false
    }

    /// `gateway`'s last cumulative counts for it (zeros: none yet).
    pub(super) fn last_counts(&self, gateway: &str) -> LastCounts {
        self.last_counts.get(gateway).cloned().unwrap_or_default()
    }

    /// `gateway`'s cumulative counts for it are now `counts`.
    pub(super) fn set_last_counts(&mut self, gateway: &str, counts: LastCounts) {
        self.last_counts.insert(gateway.to_string(), counts);
    }

    /// Forgets what `gateway` says about it now: its in-flight count and breaker there. Says
    /// whether the load the filters see changed.
    pub(super) fn drop_gateway_now(&mut self, gateway: &str) -> bool {
        self.breakers.remove(gateway);
        self.inflight.remove(gateway).is_some_and(|n| n != 0) && self.polled_load.is_none()
    }

    /// Forgets `gateway`'s cumulative counts (the gateway is forgotten).
    pub(super) fn forget_gateway_counts(&mut self, gateway: &str) {
        self.last_counts.remove(gateway);
    }

    /// What the admin API, metrics and logs call it: its URL, with `@rank` for a
    /// data-parallel rank (as sglang-router lists them).
    pub fn name(&self) -> String {
        match self.dp_rank {
            Some(r) => format!("{}@{r}", self.url),
            None => self.url.clone(),
        }
    }

    /// A bare entry (tests of modules that read the table).
    #[cfg(test)]
    pub fn for_test(url: &str, healthy: bool) -> Self {
        Self { healthy, ..Self::new(0, url, Role::Regular, None, Source::Static, false) }
    }
}

/// A role as the admin API and the state file name it.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Regular => "regular",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}
