//! The routing configuration: sglang-router's knobs, in the filter's plugin configuration
//! (JSON, snake_case keys named after `kvmesh-cp`'s flags). Parsed and validated once.

use serde::Deserialize;
use thiserror::Error;

use crate::pd::Decider;
use crate::policy::{CacheAwareParams, PolicyKind};
use crate::worker::{AddrError, WorkerTable};

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("configuration is not valid JSON: {0}")]
    Json(String),
    #[error("configuration `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("configuration `worker_urls`: {0}")]
    Worker(#[from] AddrError),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, reason: reason.into() }
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub policy: PolicyKind,
    pub cache_aware: CacheAwareParams,
    pub eviction_interval_secs: u64,
    /// Per-worker index budget in bytes of routing text (sglang-router counts characters).
    pub max_tree_size: u64,
    /// Bytes per prefix-index block.
    pub block_size: usize,
    /// Largest request body accepted, in bytes.
    pub max_payload_size: u64,
    /// The static workers, used until a control-plane snapshot arrives.
    pub workers: WorkerTable,
    /// Prefill/decode disaggregation, when enabled.
    pub pd: Option<PdConfig>,
    /// Upper bound of a request (and of the prefill leg), like sglang-router's flag.
    pub request_timeout_secs: u64,
    /// Passive health: this many consecutive failures take a worker out of rotation for
    /// `cb_timeout_duration_secs` (sglang-router's circuit-breaker flags).
    pub cb_failure_threshold: u32,
    pub cb_timeout_duration_secs: u64,
    /// The Envoy cluster (ORIGINAL_DST) the prefill callouts go through.
    pub upstream_cluster: String,
    /// The Envoy cluster (HTTP/2) of `kvmesh-cp`; none means static workers only.
    pub control_plane_cluster: Option<String>,
    /// How often the stream owner reports to the control plane.
    pub report_interval_ms: u64,
}

/// PD mode settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    pub prefill_policy: PolicyKind,
    pub decode_policy: PolicyKind,
    pub decider: Decider,
}

/// A `--prefill URL [BOOTSTRAP_PORT|none]` entry in JSON: `"url"`, `["url", port|null|"none"]`
/// or `{"url": ..., "bootstrap_port": ...}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum PrefillSpec {
    Url(String),
    Pair(String, Option<PortSpec>),
    Object { url: String, bootstrap_port: Option<PortSpec> },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PortSpec {
    Port(u16),
    Word(String),
}

impl PrefillSpec {
    fn parts(self) -> Result<(String, Option<u16>), ConfigError> {
        let (url, port) = match self {
            PrefillSpec::Url(u) => (u, None),
            PrefillSpec::Pair(u, p) | PrefillSpec::Object { url: u, bootstrap_port: p } => (u, p),
        };
        let port = match port {
            None => None,
            Some(PortSpec::Port(p)) => Some(p),
            Some(PortSpec::Word(w)) if w.eq_ignore_ascii_case("none") => None,
            Some(PortSpec::Word(w)) => {
                return Err(invalid("prefill", format!("bootstrap port `{w}` of {url} is not a port or `none`")))
            }
        };
        Ok((url, port))
    }
}

struct PdRaw {
    prefill_policy: Option<String>,
    decode_policy: Option<String>,
    decider: Option<String>,
    non_cached_tokens: Option<u64>,
}

/// The JSON form; every key is optional.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    policy: Option<String>,
    cache_threshold: Option<f64>,
    balance_abs_threshold: Option<u64>,
    balance_rel_threshold: Option<f64>,
    eviction_interval_secs: Option<u64>,
    max_tree_size: Option<u64>,
    block_size: Option<usize>,
    max_payload_size: Option<u64>,
    #[serde(default)]
    worker_urls: Vec<String>,
    pd_disaggregation: Option<bool>,
    #[serde(default)]
    prefill: Vec<PrefillSpec>,
    #[serde(default)]
    decode: Vec<String>,
    prefill_policy: Option<String>,
    decode_policy: Option<String>,
    pd_decider: Option<String>,
    non_cached_tokens: Option<u64>,
    request_timeout_secs: Option<u64>,
    cb_failure_threshold: Option<u32>,
    cb_timeout_duration_secs: Option<u64>,
    upstream_cluster: Option<String>,
    control_plane_cluster: Option<String>,
    report_interval_ms: Option<u64>,
}

pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.3;
pub const DEFAULT_BALANCE_ABS_THRESHOLD: u64 = 64;
pub const DEFAULT_BALANCE_REL_THRESHOLD: f64 = 1.5;
pub const DEFAULT_EVICTION_INTERVAL_SECS: u64 = 120;
pub const DEFAULT_MAX_TREE_SIZE: u64 = 1 << 26;
pub const DEFAULT_BLOCK_SIZE: usize = 32;
pub const DEFAULT_MAX_PAYLOAD_SIZE: u64 = 256 * 1024 * 1024;
pub const DEFAULT_REQUEST_TIMEOUT_SECS: u64 = 1800;
pub const DEFAULT_CB_FAILURE_THRESHOLD: u32 = 10;
pub const DEFAULT_CB_TIMEOUT_DURATION_SECS: u64 = 60;
pub const DEFAULT_NON_CACHED_TOKENS: u64 = 128;
pub const DEFAULT_UPSTREAM_CLUSTER: &str = "kvmesh_workers";

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: PolicyKind::CacheAware,
            cache_aware: CacheAwareParams {
                cache_threshold: DEFAULT_CACHE_THRESHOLD,
                balance_abs_threshold: DEFAULT_BALANCE_ABS_THRESHOLD,
                balance_rel_threshold: DEFAULT_BALANCE_REL_THRESHOLD,
            },
            eviction_interval_secs: DEFAULT_EVICTION_INTERVAL_SECS,
            max_tree_size: DEFAULT_MAX_TREE_SIZE,
            block_size: DEFAULT_BLOCK_SIZE,
            max_payload_size: DEFAULT_MAX_PAYLOAD_SIZE,
            workers: WorkerTable::default(),
            pd: None,
            request_timeout_secs: DEFAULT_REQUEST_TIMEOUT_SECS,
            cb_failure_threshold: DEFAULT_CB_FAILURE_THRESHOLD,
            cb_timeout_duration_secs: DEFAULT_CB_TIMEOUT_DURATION_SECS,
            upstream_cluster: DEFAULT_UPSTREAM_CLUSTER.to_string(),
            control_plane_cluster: None,
            report_interval_ms: 20,
        }
    }
}

fn policy_named(field: &'static str, name: Option<String>, default: PolicyKind) -> Result<PolicyKind, ConfigError> {
    let policy = match name {
        Some(p) => p.parse::<PolicyKind>().map_err(|e| invalid(field, e))?,
        None => default,
    };
    if !policy.implemented() {
        return Err(invalid(field, format!("`{policy}` is not available in this build yet")));
    }
    Ok(policy)
}

impl Config {
    /// Parses and validates a JSON configuration; an empty one means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let raw: Raw = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        let d = Self::default();
        let pd_raw = PdRaw {
            prefill_policy: raw.prefill_policy,
            decode_policy: raw.decode_policy,
            decider: raw.pd_decider,
            non_cached_tokens: raw.non_cached_tokens,
        };
        let policy = policy_named("policy", raw.policy, d.policy)?;
        let cache_threshold = raw.cache_threshold.unwrap_or(d.cache_aware.cache_threshold);
        if !(0.0..=1.0).contains(&cache_threshold) {
            return Err(invalid("cache_threshold", format!("{cache_threshold} is not between 0 and 1")));
        }
        let balance_rel_threshold = raw.balance_rel_threshold.unwrap_or(d.cache_aware.balance_rel_threshold);
        if !balance_rel_threshold.is_finite() || balance_rel_threshold < 1.0 {
            return Err(invalid("balance_rel_threshold", format!("{balance_rel_threshold} must be >= 1")));
        }
        let positive = |field: &'static str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(invalid(field, "must be greater than 0")),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        let block_size = positive("block_size", raw.block_size.map(|b| b as u64), d.block_size as u64)?;
        if block_size > 1 << 20 {
            return Err(invalid("block_size", format!("{block_size} is larger than 1 MiB")));
        }
        Self {
            policy,
            cache_aware: CacheAwareParams {
                cache_threshold,
                balance_abs_threshold: raw.balance_abs_threshold.unwrap_or(d.cache_aware.balance_abs_threshold),
                balance_rel_threshold,
            },
            eviction_interval_secs: positive(
                "eviction_interval_secs",
                raw.eviction_interval_secs,
                d.eviction_interval_secs,
            )?,
            max_tree_size: positive("max_tree_size", raw.max_tree_size, d.max_tree_size)?,
            block_size: block_size as usize,
            max_payload_size: positive("max_payload_size", raw.max_payload_size, d.max_payload_size)?,
            request_timeout_secs: positive("request_timeout_secs", raw.request_timeout_secs, d.request_timeout_secs)?,
            cb_failure_threshold: positive(
                "cb_failure_threshold",
                raw.cb_failure_threshold.map(u64::from),
                u64::from(d.cb_failure_threshold),
            )? as u32,
            cb_timeout_duration_secs: positive(
                "cb_timeout_duration_secs",
                raw.cb_timeout_duration_secs,
                d.cb_timeout_duration_secs,
            )?,
            pd: None,
            workers: WorkerTable::default(),
            upstream_cluster: raw.upstream_cluster.unwrap_or(d.upstream_cluster),
            control_plane_cluster: raw.control_plane_cluster.filter(|c| !c.is_empty()),
            report_interval_ms: positive("report_interval_ms", raw.report_interval_ms, d.report_interval_ms)?,
        }
        .with_workers(raw.pd_disaggregation.unwrap_or(false), raw.worker_urls, raw.prefill, raw.decode, pd_raw)
    }

    /// Fills in the worker table (and the PD settings in PD mode).
    fn with_workers(
        mut self,
        pd: bool,
        worker_urls: Vec<String>,
        prefill: Vec<PrefillSpec>,
        decode: Vec<String>,
        pd_raw: PdRaw,
    ) -> Result<Self, ConfigError> {
        if !pd {
            if !prefill.is_empty() || !decode.is_empty() {
                return Err(invalid("prefill", "prefill and decode workers need \"pd_disaggregation\": true"));
            }
            self.workers = WorkerTable::from_urls(&worker_urls)?;
            return Ok(self);
        }
        if !worker_urls.is_empty() {
            return Err(invalid("worker_urls", "in PD mode workers are given as `prefill` and `decode`"));
        }
        let prefill = prefill.into_iter().map(PrefillSpec::parts).collect::<Result<Vec<_>, _>>()?;
        self.workers = WorkerTable::pd(&prefill, &decode)?;
        let decider = match pd_raw.decider.as_deref() {
            None | Some("always") => Decider::Always,
            Some("prefix") => {
                Decider::Prefix { non_cached_tokens: pd_raw.non_cached_tokens.unwrap_or(DEFAULT_NON_CACHED_TOKENS) }
            }
            Some(other) => return Err(invalid("pd_decider", format!("unknown decider `{other}` (always, prefix)"))),
        };
        self.pd = Some(PdConfig {
            prefill_policy: policy_named("prefill_policy", pd_raw.prefill_policy, PolicyKind::CacheAware)?,
            decode_policy: policy_named("decode_policy", pd_raw.decode_policy, PolicyKind::PowerOfTwo)?,
            decider,
        });
        Ok(self)
    }

    /// The per-worker index budget in blocks.
    pub fn max_blocks_per_worker(&self) -> u64 {
        (self.max_tree_size / self.block_size as u64).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_sglang_router() {
        let c = Config::from_json(b"{}").unwrap();
        assert_eq!(c.policy, PolicyKind::CacheAware);
        assert_eq!(c.cache_aware.cache_threshold, 0.3);
        assert_eq!(c.cache_aware.balance_abs_threshold, 64);
        assert_eq!(c.cache_aware.balance_rel_threshold, 1.5);
        assert_eq!(c.eviction_interval_secs, 120);
        assert_eq!(c.max_tree_size, 1 << 26);
        assert_eq!(Config::from_json(b"").unwrap(), c);
    }

    #[test]
    fn full_config() {
        let c = Config::from_json(
            br#"{"policy":"power_of_two","cache_threshold":0.5,"balance_abs_threshold":2,
                "block_size":16,"max_payload_size":1024,"worker_urls":["http://127.0.0.1:30001"]}"#,
        )
        .unwrap();
        assert_eq!(c.policy, PolicyKind::PowerOfTwo);
        assert_eq!(c.cache_aware.balance_abs_threshold, 2);
        assert_eq!(c.workers.workers[0].addr, "127.0.0.1:30001");
        assert_eq!(c.max_payload_size, 1024);
    }

    #[test]
    fn pd_config() {
        let c = Config::from_json(
            br#"{"pd_disaggregation":true,
                "prefill":[["http://127.0.0.1:1",8998],["http://127.0.0.1:2","none"],{"url":"http://127.0.0.1:5","bootstrap_port":null},"http://127.0.0.1:6"],
                "decode":["http://127.0.0.1:3"],"pd_decider":"prefix","non_cached_tokens":64}"#,
        )
        .unwrap();
        let pd = c.pd.unwrap();
        assert_eq!((pd.prefill_policy, pd.decode_policy), (PolicyKind::CacheAware, PolicyKind::PowerOfTwo));
        assert_eq!(pd.decider, Decider::Prefix { non_cached_tokens: 64 });
        let ports: Vec<Option<u16>> = c.workers.workers.iter().map(|w| w.bootstrap_port).collect();
        assert_eq!(ports, vec![Some(8998), None, None, None, None]);
        let err = |json: &str| Config::from_json(json.as_bytes()).unwrap_err().to_string();
        assert!(err(r#"{"prefill":["http://127.0.0.1:1"]}"#).contains("pd_disaggregation"));
        assert!(err(r#"{"pd_disaggregation":true,"worker_urls":["http://127.0.0.1:1"]}"#).contains("`worker_urls`"));
        assert!(err(r#"{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:1","x"]]}"#).contains("`prefill`"));
        assert!(err(r#"{"pd_disaggregation":true,"pd_decider":"sometimes"}"#).contains("`pd_decider`"));
        assert!(err(r#"{"pd_disaggregation":true,"decode_policy":"nope"}"#).contains("`decode_policy`"));
    }

    #[test]
    fn bad_values_name_the_field() {
        let err = |json: &str| Config::from_json(json.as_bytes()).unwrap_err().to_string();
        assert!(err(r#"{"policy":"fastest"}"#).contains("`policy`"));
        assert!(err(r#"{"policy":"marginal_utility"}"#).contains("not available"));
        assert!(err(r#"{"cache_threshold":1.5}"#).contains("`cache_threshold`"));
        assert!(err(r#"{"balance_rel_threshold":0.5}"#).contains("`balance_rel_threshold`"));
        assert!(err(r#"{"block_size":0}"#).contains("`block_size`"));
        assert!(err(r#"{"worker_urls":["10.0.0.1:80"]}"#).contains("`worker_urls`"));
        assert!(err(r#"{"polcy":"random"}"#).contains("polcy"));
        assert!(err(r#"{"policy":5}"#).contains("not valid JSON"));
    }
}
