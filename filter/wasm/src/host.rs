//! The host side of the glue: Envoy's shared data and metrics through
//! `proxy_wasm::hostcalls`, every `Status` handled (the SDK's trait helpers unwrap).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

use crate::shared::{SetError, SharedStore};

/// Envoy's shared data for this VM id.
pub struct EnvoyShared;

impl SharedStore for EnvoyShared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Other),
        }
    }
}

/// The filter's stats, in Envoy's `/stats` (and `/stats/prometheus`).
pub struct Metrics {
    pub requests: Option<u32>,
    pub local_replies: Option<u32>,
    pub cache_hits: Option<u32>,
    pub decision_ns: Option<u32>,
    pub index_blocks: Option<u32>,
    pub snapshot_version: Option<u32>,
}

impl Metrics {
    pub fn define() -> Self {
        let def = |t, name| hostcalls::define_metric(t, name).ok();
        Self {
            requests: def(MetricType::Counter, "kvmesh_requests_total"),
            local_replies: def(MetricType::Counter, "kvmesh_local_replies_total"),
            cache_hits: def(MetricType::Counter, "kvmesh_cache_hits_total"),
            decision_ns: def(MetricType::Histogram, "kvmesh_route_decision_ns"),
            index_blocks: def(MetricType::Gauge, "kvmesh_index_blocks"),
            snapshot_version: def(MetricType::Gauge, "kvmesh_snapshot_version"),
        }
    }

    pub fn incr(id: Option<u32>) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    pub fn record(id: Option<u32>, value: u64) {
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// Nanoseconds since the epoch, from the host's clock (0 if unavailable).
pub fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}
