//! The validated configuration. [`Config::from_settings`] is the one place where
//! [`RoutingSettings`] (from the filter's plugin JSON, or `kvmesh-cp`'s flags and YAML, or a
//! control-plane snapshot) are checked and completed with defaults; [`Config::from_json`]
//! reads the filter's plugin JSON: the routing settings plus the keys only the filter has
//! (`worker_urls`, `prefill`, `decode`, `upstream_cluster`, `control_plane_cluster`,
//! `control_plane_address`, `report_interval_ms`, `control_plane_token`,
//! `route_sets_worker_header`, `original_dst_header`, `worker_api_key`).

use serde::Deserialize;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::admission::AdmissionParams;
use crate::breaker::BreakerParams;
use crate::models::ModelRules;
use crate::policy::{CacheAwareParams, PolicyKind, PrefixHashParams, UtilityParams};
use crate::priority::{parse_per_class, ClassLimits};
use crate::router::RouterParams;
use crate::settings::{PdDecider, PdProtocol, RoutingSettings};
use crate::tenant::{valid_tenant, TenantParams, DEFAULT_TENANT_HEADER};
use crate::worker::{AddrError, WorkerTable};

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("configuration is not valid JSON: {0}")]
    Json(String),
    #[error("configuration `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// A plugin JSON key that is unknown or has the wrong type.
    #[error("configuration `{key}`: {reason}")]
    Key { key: String, reason: String },
    #[error("configuration `worker_urls`: {0}")]
    Worker(#[from] AddrError),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, reason: reason.into() }
}

/// Whether PD mode skips the prefill leg (llm-d's decider), validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decider {
    /// Split every request (sglang-router's behaviour).
    Always,
    /// Skip the prefill leg when at most this many prompt tokens are uncached on the decode
    /// worker.
    Prefix { non_cached_tokens: u64 },
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The routing settings this configuration was built from, as given (unset fields
    /// unset): the layer the control plane's settings are overlaid on.
    pub settings: RoutingSettings,
    pub policy: PolicyKind,
    pub cache_aware: CacheAwareParams,
    pub eviction_interval_secs: u64,
    /// Per-worker index budget in bytes of routing text (sglang-router counts characters).
    pub max_tree_size: u64,
    /// Bytes per prefix-index block.
    pub block_size: usize,
    /// Bytes of routing text per engine token (capacities and cached-token reports).
    pub bytes_per_token: u64,
    /// Largest request body accepted, in bytes.
    pub max_payload_size: u64,
    /// The static workers, used until a control-plane snapshot arrives.
    pub workers: WorkerTable,
    /// Prefill/decode disaggregation, when enabled.
    pub pd: Option<PdConfig>,
    /// Upper bound of a request (and of the prefill leg), like sglang-router's flag.
    pub request_timeout_secs: u64,
    /// The stall window in milliseconds (0: off); see `worker_stall_secs`.
    pub worker_stall_ms: u64,
    /// Overload thresholds (0: off); see `overload_waiting_requests`, `overload_kv_usage`.
    pub overload_waiting: u64,
    pub overload_kv_usage: f64,
    /// Attempts per request, the first included (sglang-router's `--retry-max-retries`, which
    /// counts the same way: `--disable-retries` is 1), at most [`MAX_ATTEMPTS`]: the worker the
    /// policy chose, then the next ones Envoy fails over to.
    pub max_attempts: u32,
    /// The concurrency limit and its queue (`max_concurrent_requests` and the rest); none when
    /// no limit is set (sglang-router's default).
    pub admission: Option<AdmissionParams>,
    /// Tenant ids and their limits (issue 47); none when no tenant setting is given.
    pub tenants: Option<TenantParams>,
    /// InferenceObjectives' priorities (`priority_objective`), when no priority header says.
    pub objectives: Vec<(String, i64)>,
    /// The served model's chat template as a shape (`chat_shape`): chats' routing text.
    pub chat_shape: Option<crate::chat_shape::ChatShape>,
    /// Passive health: the per-worker circuit breakers (sglang-router's `--cb-*` flags and
    /// `--disable-circuit-breaker`).
    pub breaker: BreakerParams,
    /// The Envoy cluster (ORIGINAL_DST) the prefill callouts go through.
    pub upstream_cluster: String,
    /// The Envoy cluster (HTTP/2) of `kvmesh-cp`; none means static workers only.
    pub control_plane_cluster: Option<String>,
    /// `http://host:port` of `kvmesh-cp`'s gRPC port, for a build that opens the streams
    /// itself instead of through an Envoy cluster (the native build needs it beside
    /// `control_plane_cluster`; the `.wasm` reads only the cluster).
    pub control_plane_address: Option<String>,
    /// How often the stream owner reports to the control plane.
    pub report_interval_ms: u64,
    /// The bearer token presented to the control plane on both streams (its
    /// `--grpc-token-file`); none sends no credential.
    pub control_plane_token: Option<String>,
    /// `Authorization: Bearer <worker_api_key>`, written on every request the filter sends a
    /// worker (both PD legs), in place of the client's: workers launched with `--api-key`
    /// (sglang-router's `--api-key`). None: the client's passes unchanged.
    pub worker_authorization: Option<String>,
    /// Read-only worker paths that pass through (see [`crate::paths`]).
    pub passthrough_paths: Vec<String>,
    /// The route adds `x-kvmesh-worker: %UPSTREAM_REMOTE_ADDRESS%` to every response
    /// (overwriting any the worker sent): the filter reads which worker answered from the
    /// response headers it reads anyway, instead of asking Envoy for the upstream address and
    /// setting the header itself (two host calls, one of which copies into the VM).
    pub route_sets_worker_header: bool,
    /// Also name the chosen worker alone in `x-envoy-original-dst-host`, for an ORIGINAL_DST
    /// workers' cluster (`use_http_header`); off when the cluster reads only the list in
    /// `x-gateway-destination-endpoint` (`override_host`): one header write less per request.
    pub original_dst_header: bool,
    /// `prefix_hash`'s parameters (`max_blocks` already in blocks).
    pub prefix_hash: PrefixHashParams,
    /// `marginal_utility`'s parameters.
    pub utility: UtilityParams,
    /// Where `consistent_hashing` finds a request's routing key.
    pub routing_key: RoutingKey,
    /// How a request's `model` picks its pool (`--enable-igw`, `--model-alias`).
    pub models: ModelRules,
}

/// Where a request's routing key comes from (`consistent_hashing`): the first of `headers`
/// present (names lowercase), else the top-level body field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingKey {
    pub headers: Vec<String>,
    pub body_field: Option<String>,
}

/// PD mode settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    pub prefill_policy: PolicyKind,
    pub decode_policy: PolicyKind,
    pub decider: Decider,
    pub protocol: PdProtocol,
    /// vLLM: a failed prefill leg runs the request on the decode worker alone (else a 502).
    pub prefill_fallback: bool,
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

/// The plugin JSON keys only the filter has (the rest are [`RoutingSettings`]).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterKeys {
    #[serde(default)]
    worker_urls: Vec<String>,
    #[serde(default)]
    prefill: Vec<PrefillSpec>,
    #[serde(default)]
    decode: Vec<String>,
    upstream_cluster: Option<String>,
    control_plane_cluster: Option<String>,
    control_plane_address: Option<String>,
    report_interval_ms: Option<u64>,
    control_plane_token: Option<String>,
    #[serde(default)]
    route_sets_worker_header: bool,
    original_dst_header: Option<bool>,
    worker_api_key: Option<String>,
}

const FILTER_KEYS: [&str; 11] = [
    "worker_urls",
    "prefill",
    "decode",
    "upstream_cluster",
    "control_plane_cluster",
    "control_plane_address",
    "report_interval_ms",
    "control_plane_token",
    "route_sets_worker_header",
    "original_dst_header",
    "worker_api_key",
];

/// Deserialises `map` as `T`; when that fails, names the first key that fails on its own.
fn typed<T: for<'de> Deserialize<'de>>(map: Map<String, Value>) -> Result<T, ConfigError> {
    serde_json::from_value::<T>(Value::Object(map.clone())).map_err(|whole| {
        for (key, value) in map {
            let one = Map::from_iter([(key.clone(), value)]);
            if let Err(e) = serde_json::from_value::<T>(Value::Object(one)) {
                return ConfigError::Key { key, reason: e.to_string() };
            }
        }
        ConfigError::Json(whole.to_string())
    })
}

pub const DEFAULT_CACHE_THRESHOLD: f64 = 0.3;
pub const DEFAULT_BALANCE_ABS_THRESHOLD: u64 = 64;
pub const DEFAULT_BALANCE_REL_THRESHOLD: f64 = 1.5;
pub const DEFAULT_EVICTION_INTERVAL_SECS: u64 = 120;
pub const DEFAULT_MAX_TREE_SIZE: u64 = 1 << 26;
pub const DEFAULT_BLOCK_SIZE: usize = 32;
pub const DEFAULT_MAX_PAYLOAD_SIZE: u64 = 256 * 1024 * 1024;
pub const DEFAULT_REQUEST_TIMEOUT_SECS: u64 = 1800;
/// SMG's overload thresholds: waiting requests, KV cache usage.
pub const DEFAULT_OVERLOAD_WAITING: u64 = 8;
pub const DEFAULT_OVERLOAD_KV_USAGE: f64 = 0.8;
/// The stall window's default, in seconds.
pub const DEFAULT_WORKER_STALL_SECS: u64 = 15;
/// sglang-router's `--retry-max-retries` default (attempts, the first included).
pub const DEFAULT_RETRY_MAX_RETRIES: u32 = 5;
/// Most attempts per request, whatever `retry_max_retries` says.
pub const MAX_ATTEMPTS: u32 = 16;
pub const DEFAULT_NON_CACHED_TOKENS: u64 = 128;
pub const DEFAULT_BYTES_PER_TOKEN: u64 = 4;
/// llm-d's prefix-cache scorer defaults.
pub const DEFAULT_MAX_PREFIX_BLOCKS: u64 = 256;
pub const DEFAULT_LRU_CAPACITY_PER_SERVER: u64 = 31_250;
/// SMG's prefix_hash defaults.
pub const DEFAULT_PREFIX_TOKEN_COUNT: u64 = 256;
pub const DEFAULT_PREFIX_HASH_LOAD_FACTOR: f64 = 1.25;
pub const DEFAULT_PREFIX_CACHE_WEIGHT: f64 = 2.0;
pub const DEFAULT_PREFIX_LOAD_WEIGHT: f64 = 1.0;
/// SMG's default routing-key header, and a common session header.
pub const DEFAULT_ROUTING_KEY_HEADERS: [&str; 2] = ["x-smg-routing-key", "x-session-id"];
/// Seed 002's defaults.
pub const DEFAULT_UTILITY_WINDOW: u64 = 20;
pub const DEFAULT_UTILITY_MIN_HISTORY: u64 = 10;
pub const DEFAULT_UTILITY_THROUGHPUT_WEIGHT: f64 = 0.6;
pub const DEFAULT_UTILITY_LATENCY_WEIGHT: f64 = 0.4;
pub const DEFAULT_UTILITY_LOAD_WEIGHT: f64 = 1.0;
pub const DEFAULT_UPSTREAM_CLUSTER: &str = "kvmesh_workers";
pub const DEFAULT_REPORT_INTERVAL_MS: u64 = 20;

impl Default for Config {
    fn default() -> Self {
        Self {
            settings: RoutingSettings::default(),
            policy: PolicyKind::CacheAware,
            cache_aware: CacheAwareParams {
                cache_threshold: DEFAULT_CACHE_THRESHOLD,
                balance_abs_threshold: DEFAULT_BALANCE_ABS_THRESHOLD,
                balance_rel_threshold: DEFAULT_BALANCE_REL_THRESHOLD,
            },
            eviction_interval_secs: DEFAULT_EVICTION_INTERVAL_SECS,
            max_tree_size: DEFAULT_MAX_TREE_SIZE,
            block_size: DEFAULT_BLOCK_SIZE,
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
            max_payload_size: DEFAULT_MAX_PAYLOAD_SIZE,
            workers: WorkerTable::default(),
            pd: None,
            request_timeout_secs: DEFAULT_REQUEST_TIMEOUT_SECS,
            worker_stall_ms: DEFAULT_WORKER_STALL_SECS * 1000,
            overload_waiting: DEFAULT_OVERLOAD_WAITING,
            overload_kv_usage: DEFAULT_OVERLOAD_KV_USAGE,
            max_attempts: DEFAULT_RETRY_MAX_RETRIES,
            admission: None,
            tenants: None,
            objectives: Vec::new(),
            chat_shape: None,
            breaker: BreakerParams::default(),
            upstream_cluster: DEFAULT_UPSTREAM_CLUSTER.to_string(),
            control_plane_cluster: None,
            control_plane_address: None,
            report_interval_ms: DEFAULT_REPORT_INTERVAL_MS,
            control_plane_token: None,
            worker_authorization: None,
            route_sets_worker_header: false,
            original_dst_header: true,
            passthrough_paths: crate::paths::DEFAULT_PASSTHROUGH.iter().map(|p| p.to_string()).collect(),
            prefix_hash: PrefixHashParams {
                // 256 tokens of 4 bytes in blocks of 32 bytes: 32 blocks (SMG's count wins).
                max_blocks: (DEFAULT_PREFIX_TOKEN_COUNT * DEFAULT_BYTES_PER_TOKEN).div_ceil(DEFAULT_BLOCK_SIZE as u64)
                    as usize,
                cache_weight: DEFAULT_PREFIX_CACHE_WEIGHT,
                load_weight: DEFAULT_PREFIX_LOAD_WEIGHT,
                load_factor: DEFAULT_PREFIX_HASH_LOAD_FACTOR,
                lru_capacity: DEFAULT_LRU_CAPACITY_PER_SERVER,
            },
            utility: UtilityParams {
                window_size: DEFAULT_UTILITY_WINDOW as usize,
                min_history: DEFAULT_UTILITY_MIN_HISTORY as usize,
                throughput_weight: DEFAULT_UTILITY_THROUGHPUT_WEIGHT,
                latency_weight: DEFAULT_UTILITY_LATENCY_WEIGHT,
                load_weight: DEFAULT_UTILITY_LOAD_WEIGHT,
            },
            models: ModelRules::default(),
            routing_key: RoutingKey {
                headers: DEFAULT_ROUTING_KEY_HEADERS.iter().map(|h| h.to_string()).collect(),
                body_field: None,
            },
        }
    }
}

/// A weight: finite and not negative.
fn weight(field: &'static str, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    match v {
        Some(w) if !w.is_finite() || w < 0.0 => Err(invalid(field, format!("{w} must be a number >= 0"))),
        Some(w) => Ok(w),
        None => Ok(default),
    }
}

/// `prefix_hash`'s parameters, with the matched prefix in blocks of `block_size` bytes.
fn prefix_hash_params(
    s: &RoutingSettings,
    block_size: u64,
    bytes_per_token: u64,
) -> Result<PrefixHashParams, ConfigError> {
    let blocks = positive("max_prefix_blocks_to_match", s.max_prefix_blocks_to_match, DEFAULT_MAX_PREFIX_BLOCKS)?;
    if blocks > 1 << 20 {
        return Err(invalid("max_prefix_blocks_to_match", format!("{blocks} is over 1048576")));
    }
    let tokens = positive("prefix_token_count", s.prefix_token_count, DEFAULT_PREFIX_TOKEN_COUNT)?;
    let token_blocks = tokens.saturating_mul(bytes_per_token).div_ceil(block_size.max(1)).max(1);
    let load_factor = s.prefix_hash_load_factor.unwrap_or(DEFAULT_PREFIX_HASH_LOAD_FACTOR);
    if !load_factor.is_finite() || load_factor < 1.0 {
        return Err(invalid("prefix_hash_load_factor", format!("{load_factor} must be >= 1")));
    }
    let cache_weight = weight("prefix_cache_weight", s.prefix_cache_weight, DEFAULT_PREFIX_CACHE_WEIGHT)?;
    let load_weight = weight("prefix_load_weight", s.prefix_load_weight, DEFAULT_PREFIX_LOAD_WEIGHT)?;
    if cache_weight + load_weight <= 0.0 {
        return Err(invalid("prefix_cache_weight", "prefix and load weights are both 0"));
    }
    Ok(PrefixHashParams {
        // At most 2^20 (checked above), so it fits any usize.
        max_blocks: usize::try_from(blocks.min(token_blocks)).unwrap_or(1 << 20),
        cache_weight,
        load_weight,
        load_factor,
        lru_capacity: positive("lru_capacity_per_server", s.lru_capacity_per_server, DEFAULT_LRU_CAPACITY_PER_SERVER)?,
    })
}

/// `marginal_utility`'s parameters.
fn utility_params(s: &RoutingSettings) -> Result<UtilityParams, ConfigError> {
    let max = crate::policy::MAX_WINDOW as u64;
    let window = s.utility_window_size.unwrap_or(DEFAULT_UTILITY_WINDOW);
    if !(2..=max).contains(&window) {
        return Err(invalid("utility_window_size", format!("{window} is not between 2 and {max}")));
    }
    let min_history = s.utility_min_history.unwrap_or(DEFAULT_UTILITY_MIN_HISTORY.min(window));
    if !(2..=window).contains(&min_history) {
        return Err(invalid(
            "utility_min_history",
            format!("{min_history} is not between 2 and the window ({window})"),
        ));
    }
    Ok(UtilityParams {
        // At most MAX_WINDOW (checked above).
        window_size: usize::try_from(window).unwrap_or(20),
        min_history: usize::try_from(min_history).unwrap_or(10),
        throughput_weight: weight(
            "utility_throughput_weight",
            s.utility_throughput_weight,
            DEFAULT_UTILITY_THROUGHPUT_WEIGHT,
        )?,
        latency_weight: weight("utility_latency_weight", s.utility_latency_weight, DEFAULT_UTILITY_LATENCY_WEIGHT)?,
        load_weight: weight("utility_load_weight", s.utility_load_weight, DEFAULT_UTILITY_LOAD_WEIGHT)?,
    })
}

/// Where `consistent_hashing` reads the key: header names (lowercased; at most 16 tokens of
/// at most 128 bytes) and a body field (at most 128 bytes).
fn routing_key(s: &RoutingSettings) -> Result<RoutingKey, ConfigError> {
    let headers = match &s.routing_key_headers {
        None => DEFAULT_ROUTING_KEY_HEADERS.iter().map(|h| h.to_string()).collect(),
        Some(hs) if hs.len() > 16 => {
            return Err(invalid("routing_key_headers", format!("{} headers: at most 16", hs.len())))
        }
        Some(hs) => {
            let token = |h: &String| {
                !h.is_empty()
                    && h.len() <= 128
                    && h.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b))
            };
            if let Some(h) = hs.iter().find(|h| !token(h)) {
                return Err(invalid("routing_key_headers", format!("`{h}` is not a header name")));
            }
            hs.iter().map(|h| h.to_ascii_lowercase()).collect()
        }
    };
    let body_field = match s.routing_key_body_field.as_deref() {
        None | Some("") => None,
        Some(f) if f.len() > 128 => return Err(invalid("routing_key_body_field", "longer than 128 bytes")),
        Some(f) => Some(f.to_string()),
    };
    Ok(RoutingKey { headers, body_field })
}

/// sglang-router's `--queue-size` and `--queue-timeout-secs` defaults.
pub const DEFAULT_QUEUE_SIZE: u64 = 100;
pub const DEFAULT_QUEUE_TIMEOUT_SECS: u64 = 60;

/// The admission settings: on when `max_concurrent_requests` is positive (-1, 0 or unset: no
/// limit). The refill rate defaults to the limit, as in sglang-router.
fn admission(s: &RoutingSettings) -> Result<Option<AdmissionParams>, ConfigError> {
    let capacity = match s.max_concurrent_requests {
        None | Some(..=0) => return Ok(None),
        Some(n) => u32::try_from(n)
            .ok()
            .filter(|n| *n <= 1_000_000)
            .ok_or_else(|| invalid("max_concurrent_requests", format!("{n} is over 1000000")))?,
    };
    let refill_per_sec = match s.rate_limit_tokens_per_second {
        None | Some(..=0) => f64::from(capacity),
        Some(r) if r > 1_000_000 => {
            return Err(invalid("rate_limit_tokens_per_second", format!("{r} is over 1000000")))
        }
        Some(r) => r as f64,
    };
    let queue_size = s.queue_size.unwrap_or(DEFAULT_QUEUE_SIZE);
    let queue_size = u32::try_from(queue_size)
        .ok()
        .filter(|n| *n <= 1_000_000)
        .ok_or_else(|| invalid("queue_size", format!("{queue_size} is over 1000000")))?;
    let timeout = positive("queue_timeout_secs", s.queue_timeout_secs, DEFAULT_QUEUE_TIMEOUT_SECS)?;
    if timeout > 86_400 {
        return Err(invalid("queue_timeout_secs", format!("{timeout} is over a day")));
    }
    let classes = class_limits(s, capacity)?;
    Ok(Some(AdmissionParams { capacity, refill_per_sec, queue_size, queue_timeout_ms: timeout * 1000, classes }))
}

/// The per-class settings (`priority_reserved`, `priority_queue_size`,
/// `priority_queue_timeout_secs`): reserves within the limit, bounds and timeouts as the
/// global ones.
fn class_limits(s: &RoutingSettings, capacity: u32) -> Result<ClassLimits, ConfigError> {
    let entries = |v: &Option<Vec<String>>| v.as_deref().unwrap_or_default().to_vec();
    let reserved = parse_per_class("priority_reserved", &entries(&s.priority_reserved))
        .map_err(|e| invalid("priority_reserved", e))?;
    let sizes = parse_per_class("priority_queue_size", &entries(&s.priority_queue_size))
        .map_err(|e| invalid("priority_queue_size", e))?;
    let timeouts = parse_per_class("priority_queue_timeout_secs", &entries(&s.priority_queue_timeout_secs))
        .map_err(|e| invalid("priority_queue_timeout_secs", e))?;
    let mut out = ClassLimits::default();
    let mut total = 0u64;
    for (i, r) in reserved.iter().enumerate() {
        let r = r.unwrap_or(0);
        total = total.saturating_add(r);
        if let (Some(slot), Ok(r)) = (out.reserved.get_mut(i), u32::try_from(r)) {
            *slot = r;
        }
    }
    if total > u64::from(capacity) {
        return Err(invalid("priority_reserved", format!("{total} reserved slots are over max_concurrent_requests")));
    }
    for (i, n) in sizes.iter().enumerate() {
        if let (Some(slot), Some(n)) = (out.queue_size.get_mut(i), n) {
            *slot = Some(
                u32::try_from(*n)
                    .ok()
                    .filter(|n| *n <= 1_000_000)
                    .ok_or_else(|| invalid("priority_queue_size", format!("{n} is over 1000000")))?,
            );
        }
    }
    for (i, t) in timeouts.iter().enumerate() {
        if let (Some(slot), Some(t)) = (out.queue_timeout_ms.get_mut(i), t) {
            if *t == 0 || *t > 86_400 {
                return Err(invalid("priority_queue_timeout_secs", format!("{t} is not within 1..=86400")));
            }
            *slot = Some(t * 1000);
        }
    }
    Ok(out)
}

/// The tenant settings: on when any is given.
fn tenants(s: &RoutingSettings) -> Result<Option<TenantParams>, ConfigError> {
    let (header, identity) = (s.tenant_header.as_deref(), s.tenant_identity.as_deref().filter(|i| !i.is_empty()));
    let rps = s.tenant_requests_per_second;
    let weights = s.tenant_weight.as_deref().unwrap_or_default().to_vec();
    if header.is_none()
        && identity.is_none()
        && rps.is_none()
        && s.max_tenants.is_none()
        && weights.is_empty()
        && s.tenant_tokens_per_minute.is_none()
    {
        return Ok(None);
    }
    let header = header.filter(|h| !h.is_empty()).unwrap_or(DEFAULT_TENANT_HEADER);
    if !valid_tenant(header) || header.len() > 64 {
        return Err(invalid("tenant_header", "not a header name"));
    }
    let xfcc = match identity {
        Some(i) if i.eq_ignore_ascii_case("xfcc") => true,
        Some(other) => return Err(invalid("tenant_identity", format!("`{other}` is not one of: xfcc"))),
        None => false,
    };
    let requests_per_second = match rps {
        None | Some(0) => None,
        Some(n) => Some(
            u32::try_from(n)
                .ok()
                .filter(|n| *n <= 1_000_000)
                .ok_or_else(|| invalid("tenant_requests_per_second", format!("{n} is over 1000000")))?,
        ),
    };
    let max_tenants = s.max_tenants.unwrap_or(64);
    if !(1..=4096).contains(&max_tenants) {
        return Err(invalid("max_tenants", format!("{max_tenants} is not within 1..=4096")));
    }
    Ok(Some(TenantParams {
        header: header.to_ascii_lowercase(),
        xfcc,
        requests_per_second,
        max_tenants: max_tenants as usize,
        tokens_per_minute: s.tenant_tokens_per_minute.filter(|n| *n > 0),
        weights: if weights.is_empty() {
            None
        } else {
            Some(crate::fair::parse_weights(&weights).map_err(|e| invalid("tenant_weight", e))?)
        },
    }))
}

fn positive(field: &'static str, v: Option<u64>, default: u64) -> Result<u64, ConfigError> {
    match v {
        Some(0) => Err(invalid(field, "must be greater than 0")),
        Some(v) => Ok(v),
        None => Ok(default),
    }
}

/// The circuit-breaker settings: counts and durations at least 1 (seconds become
/// milliseconds, saturating).
fn breaker_params(s: &RoutingSettings, d: &BreakerParams) -> Result<BreakerParams, ConfigError> {
    let count = |field, v: Option<u32>, default: u32| {
        positive(field, v.map(u64::from), u64::from(default)).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    };
    let ms = |field, v: Option<u64>, default_ms: u64| {
        positive(field, v, default_ms.div_ceil(1000)).map(|secs| secs.saturating_mul(1000))
    };
    Ok(BreakerParams {
        failure_threshold: count("cb_failure_threshold", s.cb_failure_threshold, d.failure_threshold)?,
        success_threshold: count("cb_success_threshold", s.cb_success_threshold, d.success_threshold)?,
        timeout_ms: ms("cb_timeout_duration_secs", s.cb_timeout_duration_secs, d.timeout_ms)?,
        window_ms: ms("cb_window_duration_secs", s.cb_window_duration_secs, d.window_ms)?,
        disabled: s.disable_circuit_breaker.unwrap_or(d.disabled),
    })
}

impl Config {
    /// Validates routing settings and fills in the defaults: the one place that does. The
    /// filter-only parts (workers, clusters, report interval) are left at their defaults.
    pub fn from_settings(s: &RoutingSettings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let policy = s.policy.unwrap_or(d.policy);
        let cache_threshold = s.cache_threshold.unwrap_or(d.cache_aware.cache_threshold);
        if !(0.0..=1.0).contains(&cache_threshold) {
            return Err(invalid("cache_threshold", format!("{cache_threshold} is not between 0 and 1")));
        }
        let balance_rel_threshold = s.balance_rel_threshold.unwrap_or(d.cache_aware.balance_rel_threshold);
        if !balance_rel_threshold.is_finite() || balance_rel_threshold < 1.0 {
            return Err(invalid("balance_rel_threshold", format!("{balance_rel_threshold} must be >= 1")));
        }
        let block_size = positive("block_size", s.block_size, d.block_size as u64)?;
        if block_size > 1 << 20 {
            return Err(invalid("block_size", format!("{block_size} is larger than 1 MiB")));
        }
        if let Some(j) = s.retry_jitter_factor.filter(|j| !(0.0..=1.0).contains(j)) {
            return Err(invalid("retry_jitter_factor", format!("{j} is not between 0 and 1")));
        }
        if let Some(m) = s.retry_backoff_multiplier.filter(|m| !m.is_finite() || *m <= 0.0) {
            return Err(invalid("retry_backoff_multiplier", format!("{m} must be greater than 0")));
        }
        let pd = if s.pd_disaggregation == Some(true) {
            let decider = match s.pd_decider.unwrap_or(PdDecider::Always) {
                PdDecider::Always => Decider::Always,
                PdDecider::Prefix => {
                    Decider::Prefix { non_cached_tokens: s.non_cached_tokens.unwrap_or(DEFAULT_NON_CACHED_TOKENS) }
                }
            };
            // Like sglang-router, `--policy` is the default of both legs.
            Some(PdConfig {
                prefill_policy: s.prefill_policy.or(s.policy).unwrap_or(PolicyKind::CacheAware),
                decode_policy: s.decode_policy.or(s.policy).unwrap_or(PolicyKind::PowerOfTwo),
                decider,
                protocol: s.pd_protocol.unwrap_or(PdProtocol::Sglang),
                prefill_fallback: s.pd_prefill_fallback.unwrap_or(true),
            })
        } else {
            None
        };
        let breaker = breaker_params(s, &d.breaker)?;
        let bytes_per_token = match positive("bytes_per_token", s.bytes_per_token, d.bytes_per_token)? {
            n if n > 1024 => return Err(invalid("bytes_per_token", format!("{n} is over 1024"))),
            n => n,
        };
        let passthrough_paths = match &s.passthrough_paths {
            None => d.passthrough_paths.clone(),
            Some(paths) => {
                if paths.len() > 256 {
                    return Err(invalid("passthrough_paths", format!("{} paths: at most 256", paths.len())));
                }
                if let Some(p) = paths.iter().find(|p| !p.starts_with('/') || p.len() > 512 || p.contains(['?', '#'])) {
                    return Err(invalid("passthrough_paths", format!("`{p}` is not a path (starts with /, no query)")));
                }
                paths.clone()
            }
        };
        Ok(Self {
            settings: s.clone(),
            policy,
            cache_aware: CacheAwareParams {
                cache_threshold,
                balance_abs_threshold: s.balance_abs_threshold.unwrap_or(d.cache_aware.balance_abs_threshold),
                balance_rel_threshold,
            },
            eviction_interval_secs: positive(
                "eviction_interval_secs",
                s.eviction_interval_secs,
                d.eviction_interval_secs,
            )?,
            max_tree_size: positive("max_tree_size", s.max_tree_size, d.max_tree_size)?,
            // At most 1 MiB (checked above), so it fits any usize.
            block_size: usize::try_from(block_size).unwrap_or(DEFAULT_BLOCK_SIZE),
            bytes_per_token,
            prefix_hash: prefix_hash_params(s, block_size, bytes_per_token)?,
            utility: utility_params(s)?,
            routing_key: routing_key(s)?,
            models: ModelRules::from_settings(s).map_err(|reason| invalid("model_alias", reason))?,
            max_payload_size: positive("max_payload_size", s.max_payload_size, d.max_payload_size)?,
            request_timeout_secs: positive("request_timeout_secs", s.request_timeout_secs, d.request_timeout_secs)?,
            worker_stall_ms: match s.worker_stall_secs {
                Some(secs) if secs > 86_400 => {
                    return Err(invalid("worker_stall_secs", format!("{secs} is over a day")))
                }
                Some(secs) => secs * 1000,
                None => d.worker_stall_ms,
            },
            overload_waiting: s.overload_waiting_requests.unwrap_or(d.overload_waiting),
            overload_kv_usage: match s.overload_kv_usage {
                Some(u) if !(0.0..=1.0).contains(&u) => {
                    return Err(invalid("overload_kv_usage", format!("{u} is not between 0 and 1")))
                }
                Some(u) => u,
                None => d.overload_kv_usage,
            },
            max_attempts: if s.disable_retries == Some(true) {
                1
            } else {
                s.retry_max_retries.unwrap_or(d.max_attempts).clamp(1, MAX_ATTEMPTS)
            },
            admission: admission(s)?,
            tenants: tenants(s)?,
            objectives: crate::priority::parse_objectives(s.priority_objective.as_deref().unwrap_or_default())
                .map_err(|e| invalid("priority_objective", e))?,
            chat_shape: crate::chat_shape::ChatShape::from_setting(s.chat_shape.as_deref())
                .map_err(|e| invalid("chat_shape", e))?,
            breaker,
            pd,
            passthrough_paths,
            ..d
        })
    }

    /// This configuration with other routing settings (the control plane's over the plugin's):
    /// the filter-only parts are kept.
    pub fn with_settings(&self, s: &RoutingSettings) -> Result<Self, ConfigError> {
        Ok(Self {
            workers: self.workers.clone(),
            upstream_cluster: self.upstream_cluster.clone(),
            control_plane_cluster: self.control_plane_cluster.clone(),
            control_plane_address: self.control_plane_address.clone(),
            report_interval_ms: self.report_interval_ms,
            control_plane_token: self.control_plane_token.clone(),
            worker_authorization: self.worker_authorization.clone(),
            route_sets_worker_header: self.route_sets_worker_header,
            original_dst_header: self.original_dst_header,
            ..Self::from_settings(s)?
        })
    }

    /// Parses and validates the filter's plugin JSON; an empty one means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let map = match serde_json::from_slice::<Value>(bytes).map_err(|e| ConfigError::Json(e.to_string()))? {
            Value::Object(map) => map,
            _ => return Err(ConfigError::Json("the configuration must be a JSON object".into())),
        };
        let (filter, routing): (Map<String, Value>, Map<String, Value>) =
            map.into_iter().partition(|(k, _)| FILTER_KEYS.contains(&k.as_str()));
        if let Some(key) = routing.keys().find(|k| !RoutingSettings::FIELDS.contains(&k.as_str())) {
            return Err(ConfigError::Key { key: key.clone(), reason: "unknown key".into() });
        }
        let settings: RoutingSettings = typed(routing)?;
        let keys: FilterKeys = typed(filter)?;
        let mut config = Self::from_settings(&settings)?;
        if let Some(cluster) = keys.upstream_cluster {
            config.upstream_cluster = cluster;
        }
        config.control_plane_cluster = keys.control_plane_cluster.filter(|c| !c.is_empty());
        config.control_plane_address = match keys.control_plane_address.filter(|a| !a.is_empty()) {
            Some(_) if config.control_plane_cluster.is_none() => {
                return Err(invalid("control_plane_address", "is set without control_plane_cluster"))
            }
            Some(a) if !a.starts_with("http://") || a.len() <= "http://".len() => {
                return Err(invalid("control_plane_address", "must be http://host:port (kvmesh-cp's gRPC port)"))
            }
            a => a,
        };
        config.route_sets_worker_header = keys.route_sets_worker_header;
        config.original_dst_header = keys.original_dst_header.unwrap_or(config.original_dst_header);
        config.report_interval_ms = positive("report_interval_ms", keys.report_interval_ms, config.report_interval_ms)?;
        config.control_plane_token = match keys.control_plane_token.filter(|t| !t.is_empty()) {
            Some(t) if t.len() > 4096 || !t.bytes().all(|b| b.is_ascii_graphic()) => {
                return Err(invalid(
                    "control_plane_token",
                    "must be at most 4096 visible ASCII characters, without spaces",
                ))
            }
            t => t,
        };
        config.worker_authorization = match keys.worker_api_key {
            None => None,
            Some(k) if !k.is_empty() && k.len() <= 1024 && k.bytes().all(|b| b.is_ascii_graphic()) => {
                Some(format!("Bearer {k}"))
            }
            Some(_) => {
                return Err(invalid("worker_api_key", "must be 1 to 1024 visible ASCII characters, without spaces"))
            }
        };
        config.workers = if config.pd.is_none() {
            if !keys.prefill.is_empty() || !keys.decode.is_empty() {
                return Err(invalid("prefill", "prefill and decode workers need \"pd_disaggregation\": true"));
            }
            WorkerTable::from_urls(&keys.worker_urls)?
        } else {
            if !keys.worker_urls.is_empty() {
                return Err(invalid("worker_urls", "in PD mode workers are given as `prefill` and `decode`"));
            }
            let prefill = keys.prefill.into_iter().map(PrefillSpec::parts).collect::<Result<Vec<_>, _>>()?;
            WorkerTable::pd(&prefill, &keys.decode)?
        };
        Ok(config)
    }

    /// The per-worker index budget in blocks.
    pub fn max_blocks_per_worker(&self) -> u64 {
        (self.max_tree_size / self.block_size as u64).max(1)
    }

    /// What a [`crate::Router`] needs: the cache-aware parameters and the index geometry.
    pub fn router_params(&self) -> RouterParams {
        RouterParams {
            cache_aware: self.cache_aware,
            prefix_hash: self.prefix_hash,
            utility_load_weight: self.utility.load_weight,
            block_size: self.block_size,
            max_blocks: self.max_blocks_per_worker(),
            max_entries: crate::router::MAX_INDEX_ENTRIES,
        }
    }
}

#[cfg(test)]
mod tests;
