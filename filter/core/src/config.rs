//! The routing configuration: sglang-router's knobs, in the filter's plugin configuration
//! (JSON, snake_case keys named after `kvmesh-cp`'s flags). Parsed and validated once.

use serde::Deserialize;
use thiserror::Error;

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
}

pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.3;
pub const DEFAULT_BALANCE_ABS_THRESHOLD: u64 = 64;
pub const DEFAULT_BALANCE_REL_THRESHOLD: f64 = 1.5;
pub const DEFAULT_EVICTION_INTERVAL_SECS: u64 = 120;
pub const DEFAULT_MAX_TREE_SIZE: u64 = 1 << 26;
pub const DEFAULT_BLOCK_SIZE: usize = 32;
pub const DEFAULT_MAX_PAYLOAD_SIZE: u64 = 256 * 1024 * 1024;

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
        }
    }
}

impl Config {
    /// Parses and validates a JSON configuration; an empty one means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let raw: Raw = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        let d = Self::default();
        let policy = match raw.policy {
            Some(p) => p.parse::<PolicyKind>().map_err(|e| invalid("policy", e))?,
            None => d.policy,
        };
        if !policy.implemented() {
            return Err(invalid("policy", format!("`{policy}` is not available in this build yet")));
        }
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
        Ok(Self {
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
            workers: WorkerTable::from_urls(&raw.worker_urls)?,
        })
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
