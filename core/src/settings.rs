//! The routing settings: every knob that shapes a routing decision, declared once.
//!
//! [`RoutingSettings`] is plain data, every field optional (unset means "the default, or what
//! the layer below says"). It is
//!
//! - the `kvmesh-cp` command line: the control plane flattens it into its flags (`--policy`,
//!   `--cache-threshold`, ...; with the `cli` feature, which derives `clap::Args`), so the
//!   same flags also make its `--config` YAML keys;
//! - the routing part of the filter's plugin JSON (snake_case keys, unknown keys refused);
//! - the `RoutingSettings` protobuf message the control plane ships in snapshots
//!   (`kvmesh-proto` converts both ways, generated from the message's fields). A new setting
//!   goes last here and, numbered next, last in the message: `kvmesh-proto` does not compile
//!   while the two differ, and its tests check the order and numbers.
//!
//! Validation into a [`crate::Config`] happens in one place, [`crate::Config::from_settings`].

use serde::{Deserialize, Serialize};

pub use crate::pd_protocol::PdProtocol;
use crate::policy::PolicyKind;

crate::named::named_enum! {
    /// The PD decider's names (`--pd-decider`).
    pub enum PdDecider as "decider" {
        /// Split every request (sglang-router's behaviour).
        Always = 1 => "always",
        /// Run a request on the decode worker alone when at most `non_cached_tokens` of its
        /// prompt are not cached there (llm-d's decider).
        Prefix = 2 => "prefix",
    }
}

/// Declares [`RoutingSettings`] from one list of fields: the struct (serde, and clap with the
/// `cli` feature), its field names and the overlay, so that none of them can miss a field.
macro_rules! routing_settings {
    ($($(#[$attr:meta])* $field:ident: $ty:ty,)*) => {
        /// Every routing setting, each optional. See the module documentation.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        #[cfg_attr(feature = "cli", command(next_help_heading = "Routing (shipped to every filter)"))]
        #[serde(deny_unknown_fields, rename_all = "snake_case")]
        pub struct RoutingSettings {
            $(
                $(#[$attr])*
                #[cfg_attr(feature = "cli", arg(long))]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }

        impl RoutingSettings {
            /// The field names: the plugin JSON keys; with `_` as `-`, the flags.
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            /// Sets every field that `over` sets (the control plane's settings over the plugin's).
            pub fn overlay(&mut self, over: &Self) {
                $( if over.$field.is_some() { self.$field.clone_from(&over.$field); } )*
            }
        }
    };
}

routing_settings! {
    /// Routing policy: random, round_robin, power_of_two, cache_aware, prefix_hash (llm-d's
    /// prefix-cache scorer with load), marginal_utility (seed 002: performance trends from
    /// completion metrics, with load) or consistent_hashing (sticky by a routing key). In PD
    /// mode, the policy of each leg whose own flag is unset. Default cache_aware.
    policy: PolicyKind,
    /// PD mode: the prefill leg's policy (default: --policy, else cache_aware).
    prefill_policy: PolicyKind,
    /// PD mode: the decode leg's policy (default: --policy, else power_of_two).
    decode_policy: PolicyKind,
    /// Cache-aware: the prefix-match ratio above which the longest match wins (0..1). Default 0.3.
    cache_threshold: f64,
    /// Cache-aware: imbalanced when max_load - min_load exceeds this (and the relative
    /// threshold is met). Default 64.
    balance_abs_threshold: u64,
    /// Cache-aware: imbalanced when max_load > min_load * this (and the absolute threshold is
    /// met); at least 1. Default 1.5.
    balance_rel_threshold: f64,
    /// Seconds between LRU evictions of the prefix index. Default 120.
    eviction_interval_secs: u64,
    /// Per-worker prefix-index budget, in bytes of routing text. Default 67108864 (2^26).
    max_tree_size: u64,
    /// Bytes of routing text per prefix-index block (kvmesh). Default 32.
    block_size: u64,
    /// Largest request body accepted, in bytes (413 above). Default 268435456 (256 MiB).
    max_payload_size: u64,
    /// Upper bound of a request and of the prefill leg, in seconds: past it the client gets a
    /// JSON 504. Default 1800.
    request_timeout_secs: u64,
    /// Prefill/decode disaggregation (implied by --prefill or --decode).
    #[cfg_attr(feature = "cli", arg(num_args = 0, default_missing_value = "true"))]
    pd_disaggregation: bool,
    /// PD decider: always (split every request) or prefix (decode alone when little is
    /// uncached) (kvmesh). Default always.
    pd_decider: PdDecider,
    /// PD `prefix` decider: most uncached prompt tokens run on the decode worker alone
    /// (kvmesh). Default 128.
    non_cached_tokens: u64,
    /// Circuit breaker: failures within the window that open a worker's breaker (counted
    /// only while they are at least as many as the successes since the first of them).
    /// Default 10.
    cb_failure_threshold: u32,
    /// Circuit breaker: seconds an open breaker keeps the worker out before one probe
    /// request is let through (half-open). Default 60.
    cb_timeout_duration_secs: u64,
    /// Circuit breaker: successful half-open probes that close the breaker again (a failed
    /// one opens it for another timeout). Default 3.
    cb_success_threshold: u32,
    /// Circuit breaker: the sliding window failures are counted in, in seconds. Default 120.
    cb_window_duration_secs: u64,
    /// Circuit breaker: off; every worker stays available whatever its failures.
    #[cfg_attr(feature = "cli", arg(num_args = 0, default_missing_value = "true"))]
    disable_circuit_breaker: bool,
    /// Attempts per request, the first included (as sglang-router counts): a request whose
    /// worker refuses the connection, resets or answers 5xx before the response starts is
    /// sent by Envoy to the next worker the filter listed. Default 5, at most 16.
    retry_max_retries: u32,
    /// No effect in kvmesh: Envoy's route `retry_policy.retry_back_off.base_interval` spaces
    /// the attempts (envoy/envoy.yaml: 50 ms, sglang-router's default).
    retry_initial_backoff_ms: u64,
    /// No effect in kvmesh: Envoy's route `retry_policy.retry_back_off.max_interval`
    /// (envoy/envoy.yaml: 30 s, sglang-router's default).
    retry_max_backoff_ms: u64,
    /// No effect in kvmesh: Envoy's retry backoff doubles (with full jitter) between attempts.
    retry_backoff_multiplier: f64,
    /// No effect in kvmesh: Envoy's retry backoff is fully jittered (0..1).
    retry_jitter_factor: f64,
    /// One attempt per request: no failover to another worker.
    #[cfg_attr(feature = "cli", arg(num_args = 0, default_missing_value = "true"))]
    disable_retries: bool,
    /// Requests admitted at once per Envoy, exactly (a token bucket of this size; every request
    /// that ends gives its token back; the refill never admits past it); past it, requests wait
    /// in the queue. -1 (default): no limit.
    #[cfg_attr(feature = "cli", arg(allow_negative_numbers = true))]
    max_concurrent_requests: i64,
    /// Requests that may wait for a token per Envoy (default 100); past it, a JSON 429. 0: 429
    /// at once.
    queue_size: u64,
    /// Longest wait in the queue, in seconds (default 60); past it, a JSON 408.
    queue_timeout_secs: u64,
    /// Tokens added to the bucket per second (default: `--max-concurrent-requests`); never
    /// admits past `--max-concurrent-requests`.
    #[cfg_attr(feature = "cli", arg(allow_negative_numbers = true))]
    rate_limit_tokens_per_second: i64,
    /// Read-only worker paths the gateway passes through (GET/HEAD) to one healthy worker;
    /// `/x/*` matches below `/x/`. Anything else but the LLM endpoints is a 404 from the
    /// gateway (kvmesh). Default /health /health_generate /liveness /readiness
    /// /get_model_info /get_server_info /v1/models /v1/models/*.
    #[cfg_attr(feature = "cli", arg(num_args = 0..))]
    passthrough_paths: Vec<String>,
    /// Seconds a worker may hold requests without answering any before new requests pass it
    /// over while other workers can take them (kvmesh; a frozen worker leaves rotation within
    /// seconds). 0 turns it off. Default 15.
    worker_stall_secs: u64,
    /// A worker with more requests waiting in its queue is passed over while others have room;
    /// when all are past a threshold the gateway answers 503 with retry-after (kvmesh, as SMG).
    /// 0 turns it off. Default 8.
    overload_waiting_requests: u64,
    /// A worker with more of its KV cache in use (0..1) is passed over while others have room
    /// (kvmesh, as SMG). 0 turns it off. Default 0.8.
    overload_kv_usage: f64,
    /// Bytes of routing text per engine token: converts a worker's KV capacity (tokens) into
    /// its share of the prefix index, and the prefix the gateway believed cached into the
    /// tokens the worker reports (kvmesh; 4 is the usual ratio for English text and the
    /// simulator's). Default 4.
    bytes_per_token: u64,
    /// prefix_hash: leading blocks of the routing text matched (llm-d's
    /// maxPrefixBlocksToMatch). Default 256.
    max_prefix_blocks_to_match: u64,
    /// prefix_hash: leading prompt tokens hashed (SMG's; in blocks with --bytes-per-token and
    /// --block-size, the smaller of this and --max-prefix-blocks-to-match counts). Default 256.
    prefix_token_count: u64,
    /// prefix_hash: index blocks kept per worker, least recently used evicted (llm-d's
    /// lruCapacityPerServer, within --max-tree-size). Default 31250.
    lru_capacity_per_server: u64,
    /// prefix_hash: a worker with more than this times the mean load is passed over (SMG's;
    /// at least 1). Default 1.25.
    prefix_hash_load_factor: f64,
    /// prefix_hash: weight of the prefix score (matched / considered blocks, 0..1) (kvmesh).
    /// Default 2.
    prefix_cache_weight: f64,
    /// prefix_hash: weight of the load score (1 for the least loaded worker, 0 for the most)
    /// (kvmesh). Default 1.
    prefix_load_weight: f64,
    /// consistent_hashing: request headers whose first present value is the routing key
    /// (SMG's). Default x-smg-routing-key x-session-id.
    #[cfg_attr(feature = "cli", arg(num_args = 0..))]
    routing_key_headers: Vec<String>,
    /// consistent_hashing: a top-level body field (string or number) that is the routing key
    /// when no header gives one, e.g. `user` (kvmesh). Default none.
    routing_key_body_field: String,
    /// marginal_utility: completed requests kept per worker (seed 002's window_size; 2..1024).
    /// Default 20.
    utility_window_size: u64,
    /// marginal_utility: completed requests a worker needs before its trend counts (seed 002's
    /// min_history_for_trend; 2..window). Default 10.
    utility_min_history: u64,
    /// marginal_utility: weight of the z-scored throughput gradient. Default 0.6.
    utility_throughput_weight: f64,
    /// marginal_utility: weight of the z-scored latency gradient. Default 0.4.
    utility_latency_weight: f64,
    /// marginal_utility: weight of one request in flight against one unit of utility, in the
    /// filter (kvmesh). Default 1.
    utility_load_weight: f64,
    /// PD protocol: sglang (bootstrap fields, the gateway sends the prefill leg), llm-d (the
    /// decode pod's routing sidecar runs the prefill named by `x-prefiller-host-port`) or vllm
    /// (the gateway runs the prefill first and hands its `kv_transfer_params` to the decode).
    /// Default sglang.
    pd_protocol: PdProtocol,
    /// PD vllm: a prefill leg that fails or gives no `kv_transfer_params` runs the request on
    /// the decode worker alone (true) or fails it with a 502 naming the prefill worker
    /// (false). Default true.
    pd_prefill_fallback: bool,
    /// Route by the request's `model` even when one model is served (SMG's multi-model
    /// "inference gateway" mode); several served names, an adapter or an alias turn it on
    /// anyway. An unknown model is a 404 from the gateway.
    #[cfg_attr(feature = "cli", arg(num_args = 0, default_missing_value = "true"))]
    enable_igw: bool,
    /// An extra client-facing name for a served model, `alias=canonical` (repeatable, as SMG).
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    model_alias: Vec<String>,

    // ---- Tenants and priorities (issue 47) ----
    /// Slots of --max-concurrent-requests reserved for a priority class, `class=N`
    /// (repeatable; classes sheddable, default, interactive, system): no lower class takes them
    /// while that class does not use them (kvmesh, as SMG's reserved floors). Default none.
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    priority_reserved: Vec<String>,
    /// A class's own queue bound, `class=N` (repeatable); other classes share --queue-size
    /// (kvmesh). Sheddable requests never queue. Default none.
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    priority_queue_size: Vec<String>,
    /// A class's own queue timeout in seconds, `class=N` (repeatable); others wait
    /// --queue-timeout-secs (kvmesh). Default none.
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    priority_queue_timeout_secs: Vec<String>,
    /// The request header naming a request's tenant, e.g. llm-d's
    /// x-llm-d-inference-fairness-id, SMG's x-smg-tenant-id, or the header Istio's
    /// RequestAuthentication copies a JWT claim into (kvmesh). Default kvmesh-tenant.
    tenant_header: String,
    /// An identity source for the tenant id a client cannot forge: `xfcc` (the caller's SPIFFE
    /// id, from the x-forwarded-client-cert element this Envoy added); the tenant header is
    /// then removed and not read (kvmesh). Default none.
    tenant_identity: String,
    /// Requests per second per tenant through one Envoy, across its threads; past it, a JSON
    /// 429 with OpenAI's x-ratelimit-* headers (kvmesh). Default none.
    tenant_requests_per_second: u64,
    /// Tenants tracked at once per Envoy (1..4096); requests of others count as `other`
    /// (kvmesh). Default 64.
    max_tenants: u64,
    /// A tenant's weight in the fair share of the concurrency limit, `tenant=W` (repeatable,
    /// 1..1000; others 1): within a class, the waiting request whose tenant used the fewest
    /// tokens per unit of weight goes first (kvmesh). Default none.
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    tenant_weight: Vec<String>,
    /// Tokens per minute per tenant through one Envoy (uncached prompt tokens as a request is
    /// routed, generated tokens as its response ends); once a tenant's minute reached it, a
    /// JSON 429 with OpenAI's x-ratelimit-*-tokens headers (kvmesh). Default none.
    tenant_tokens_per_minute: u64,
    /// An InferenceObjective's priority, `name=N` (repeatable): a request whose
    /// x-gateway-inference-objective header names it gets N's class, unless kvmesh-priority or
    /// x-smg-priority say otherwise. kvmesh-cp with --inference-pool adds the pool's
    /// InferenceObjectives (kvmesh, as GIE's endpoint picker). Default none.
    #[cfg_attr(feature = "cli", arg(action = clap::ArgAction::Append))]
    priority_objective: Vec<String>,
    /// The served model's chat template as a shape (JSON: start, default_system, role_before,
    /// role_after, after, trim, generation): a chat's routing text is then the prompt the engine
    /// tokenizes. kvmesh-cp derives it from the tokenizer_config.json beside
    /// --kv-events-tokenizer (kvmesh). Default none (kvmesh's `role: content` lines).
    chat_shape: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_takes_every_field_the_top_layer_sets() {
        let mut base: RoutingSettings =
            serde_json::from_str(r#"{"policy":"round_robin","cache_threshold":0.2,"block_size":16}"#).unwrap();
        let over: RoutingSettings =
            serde_json::from_str(r#"{"cache_threshold":0.7,"pd_decider":"prefix","disable_retries":false}"#).unwrap();
        base.overlay(&over);
        assert_eq!(base.policy, Some(PolicyKind::RoundRobin), "kept");
        assert_eq!(base.cache_threshold, Some(0.7), "overridden");
        assert_eq!(base.pd_decider, Some(PdDecider::Prefix), "added");
        assert_eq!(base.disable_retries, Some(false), "an explicit false is a setting too");
        assert_eq!(base.block_size, Some(16));
    }

    #[test]
    fn serde_names_are_the_field_names_and_unknown_keys_are_refused() {
        let s = RoutingSettings { policy: Some(PolicyKind::CacheAware), queue_size: Some(3), ..Default::default() };
        assert_eq!(serde_json::to_string(&s).unwrap(), r#"{"policy":"cache_aware","queue_size":3}"#);
        assert!(serde_json::from_str::<RoutingSettings>(r#"{"polcy":"random"}"#)
            .unwrap_err()
            .to_string()
            .contains("polcy"));
        let e = serde_json::from_str::<RoutingSettings>(r#"{"policy":"fastest"}"#).unwrap_err().to_string();
        assert!(e.contains("unknown policy `fastest`"), "{e}");
        assert_eq!(RoutingSettings::FIELDS.len(), 62);
        assert!(RoutingSettings::FIELDS.contains(&"rate_limit_tokens_per_second"));
    }
}
