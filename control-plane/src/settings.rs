//! The control plane's validated settings: plain data that [`crate::args`] fills from the
//! flags and `--config`, and that every other module reads (none of them imports `args`).

use std::collections::BTreeMap;

use kvmesh_core::RoutingSettings;

/// Everything `kvmesh-cp` runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub host: String,
    pub grpc_port: u16,
    pub http_port: u16,
    /// `/metrics` alone on this port, when set.
    pub prometheus_port: Option<u16>,
    /// The address of that listener (`--prometheus-host`, else `--host`).
    pub prometheus_host: String,
    pub workers: Vec<String>,
    pub pd: bool,
    /// `(url, bootstrap port)`.
    pub prefill: Vec<(String, Option<u16>)>,
    pub decode: Vec<String>,
    /// The routing settings shipped to every filter (validated; `pd_disaggregation` set).
    pub routing: RoutingSettings,
    pub block_size: usize,
    pub max_tree_size: u64,
    pub eviction_interval_secs: u64,
    /// Active health checks (`--disable-health-check` turns them off).
    pub health_checks: bool,
    pub health_interval_secs: u64,
    pub health_timeout_secs: u64,
    pub health_failure_threshold: u32,
    pub health_success_threshold: u32,
    pub health_endpoint: String,
    pub load_poll_interval_ms: u64,
    pub push_interval_ms: u64,
    pub discovery: Option<DiscoveryConfig>,
    /// `--log-level` (`RUST_LOG` wins).
    pub log_level: String,
    /// What to warn about at startup: flags given that have no effect (yet).
    pub warnings: Vec<String>,
}

/// What Kubernetes discovery looks for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiscoveryConfig {
    pub namespace: Option<String>,
    pub selector: BTreeMap<String, String>,
    pub prefill_selector: BTreeMap<String, String>,
    pub decode_selector: BTreeMap<String, String>,
    pub port: u16,
    pub bootstrap_annotation: String,
    pub role_label: String,
    pub pd: bool,
}
