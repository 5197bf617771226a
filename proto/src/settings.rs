//! Conversions between the `RoutingSettings` message and
//! [`kvmesh_core::settings::RoutingSettings`] (the one declaration of the routing settings).
//! Both directions destructure their source exhaustively, so a field added on one side and
//! not here does not compile.

use kvmesh_core::policy::PolicyKind;
use kvmesh_core::settings::{PdDecider, RoutingSettings};

use crate::v1;

/// A message the core settings cannot represent (a newer control plane's enum value).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingsError {
    #[error("routing setting `{field}`: unknown value {value}")]
    UnknownValue { field: &'static str, value: i32 },
}

fn policy_to(p: PolicyKind) -> i32 {
    let p = match p {
        PolicyKind::Random => v1::Policy::Random,
        PolicyKind::RoundRobin => v1::Policy::RoundRobin,
        PolicyKind::PowerOfTwo => v1::Policy::PowerOfTwo,
        PolicyKind::CacheAware => v1::Policy::CacheAware,
        PolicyKind::PrefixHash => v1::Policy::PrefixHash,
        PolicyKind::MarginalUtility => v1::Policy::MarginalUtility,
        PolicyKind::ConsistentHashing => v1::Policy::ConsistentHashing,
    };
    p as i32
}

fn policy_from(field: &'static str, value: Option<i32>) -> Result<Option<PolicyKind>, SettingsError> {
    let Some(value) = value else { return Ok(None) };
    let p = match v1::Policy::try_from(value) {
        Ok(v1::Policy::Random) => PolicyKind::Random,
        Ok(v1::Policy::RoundRobin) => PolicyKind::RoundRobin,
        Ok(v1::Policy::PowerOfTwo) => PolicyKind::PowerOfTwo,
        Ok(v1::Policy::CacheAware) => PolicyKind::CacheAware,
        Ok(v1::Policy::PrefixHash) => PolicyKind::PrefixHash,
        Ok(v1::Policy::MarginalUtility) => PolicyKind::MarginalUtility,
        Ok(v1::Policy::ConsistentHashing) => PolicyKind::ConsistentHashing,
        Ok(v1::Policy::Unspecified) | Err(_) => return Err(SettingsError::UnknownValue { field, value }),
    };
    Ok(Some(p))
}

fn decider_to(d: PdDecider) -> i32 {
    let d = match d {
        PdDecider::Always => v1::PdDecider::Always,
        PdDecider::Prefix => v1::PdDecider::Prefix,
    };
    d as i32
}

fn decider_from(value: Option<i32>) -> Result<Option<PdDecider>, SettingsError> {
    let Some(value) = value else { return Ok(None) };
    match v1::PdDecider::try_from(value) {
        Ok(v1::PdDecider::Always) => Ok(Some(PdDecider::Always)),
        Ok(v1::PdDecider::Prefix) => Ok(Some(PdDecider::Prefix)),
        Ok(v1::PdDecider::Unspecified) | Err(_) => Err(SettingsError::UnknownValue { field: "pd_decider", value }),
    }
}

impl From<&RoutingSettings> for v1::RoutingSettings {
    fn from(s: &RoutingSettings) -> Self {
        let RoutingSettings {
            policy,
            prefill_policy,
            decode_policy,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            eviction_interval_secs,
            max_tree_size,
            block_size,
            max_payload_size,
            request_timeout_secs,
            worker_stall_secs,
            overload_waiting_requests,
            overload_kv_usage,
            pd_disaggregation,
            pd_decider,
            non_cached_tokens,
            cb_failure_threshold,
            cb_timeout_duration_secs,
            cb_success_threshold,
            cb_window_duration_secs,
            disable_circuit_breaker,
            retry_max_retries,
            retry_initial_backoff_ms,
            retry_max_backoff_ms,
            retry_backoff_multiplier,
            retry_jitter_factor,
            disable_retries,
            max_concurrent_requests,
            queue_size,
            queue_timeout_secs,
            rate_limit_tokens_per_second,
            passthrough_paths,
            bytes_per_token,
            max_prefix_blocks_to_match,
            prefix_token_count,
            lru_capacity_per_server,
            prefix_hash_load_factor,
            prefix_cache_weight,
            prefix_load_weight,
            routing_key_headers,
            routing_key_body_field,
            utility_window_size,
            utility_min_history,
            utility_throughput_weight,
            utility_latency_weight,
            utility_load_weight,
        } = s.clone();
        Self {
            policy: policy.map(policy_to),
            prefill_policy: prefill_policy.map(policy_to),
            decode_policy: decode_policy.map(policy_to),
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            eviction_interval_secs,
            max_tree_size,
            block_size,
            max_payload_size,
            request_timeout_secs,
            worker_stall_secs,
            overload_waiting_requests,
            overload_kv_usage,
            pd_disaggregation,
            pd_decider: pd_decider.map(decider_to),
            non_cached_tokens,
            cb_failure_threshold,
            cb_timeout_duration_secs,
            cb_success_threshold,
            cb_window_duration_secs,
            disable_circuit_breaker,
            retry_max_retries,
            retry_initial_backoff_ms,
            retry_max_backoff_ms,
            retry_backoff_multiplier,
            retry_jitter_factor,
            disable_retries,
            max_concurrent_requests,
            queue_size,
            queue_timeout_secs,
            rate_limit_tokens_per_second,
            passthrough_paths: passthrough_paths.map(|paths| v1::PathList { paths }),
            bytes_per_token,
            max_prefix_blocks_to_match,
            prefix_token_count,
            lru_capacity_per_server,
            prefix_hash_load_factor,
            prefix_cache_weight,
            prefix_load_weight,
            routing_key_headers: routing_key_headers.map(|values| v1::StringList { values }),
            routing_key_body_field,
            utility_window_size,
            utility_min_history,
            utility_throughput_weight,
            utility_latency_weight,
            utility_load_weight,
        }
    }
}

impl TryFrom<v1::RoutingSettings> for RoutingSettings {
    type Error = SettingsError;

    fn try_from(m: v1::RoutingSettings) -> Result<Self, SettingsError> {
        let v1::RoutingSettings {
            policy,
            prefill_policy,
            decode_policy,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            eviction_interval_secs,
            max_tree_size,
            block_size,
            max_payload_size,
            request_timeout_secs,
            worker_stall_secs,
            overload_waiting_requests,
            overload_kv_usage,
            pd_disaggregation,
            pd_decider,
            non_cached_tokens,
            cb_failure_threshold,
            cb_timeout_duration_secs,
            cb_success_threshold,
            cb_window_duration_secs,
            disable_circuit_breaker,
            retry_max_retries,
            retry_initial_backoff_ms,
            retry_max_backoff_ms,
            retry_backoff_multiplier,
            retry_jitter_factor,
            disable_retries,
            max_concurrent_requests,
            queue_size,
            queue_timeout_secs,
            rate_limit_tokens_per_second,
            passthrough_paths,
            bytes_per_token,
            max_prefix_blocks_to_match,
            prefix_token_count,
            lru_capacity_per_server,
            prefix_hash_load_factor,
            prefix_cache_weight,
            prefix_load_weight,
            routing_key_headers,
            routing_key_body_field,
            utility_window_size,
            utility_min_history,
            utility_throughput_weight,
            utility_latency_weight,
            utility_load_weight,
        } = m;
        Ok(Self {
            policy: policy_from("policy", policy)?,
            prefill_policy: policy_from("prefill_policy", prefill_policy)?,
            decode_policy: policy_from("decode_policy", decode_policy)?,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            eviction_interval_secs,
            max_tree_size,
            block_size,
            max_payload_size,
            request_timeout_secs,
            worker_stall_secs,
            overload_waiting_requests,
            overload_kv_usage,
            pd_disaggregation,
            pd_decider: decider_from(pd_decider)?,
            non_cached_tokens,
            cb_failure_threshold,
            cb_timeout_duration_secs,
            cb_success_threshold,
            cb_window_duration_secs,
            disable_circuit_breaker,
            retry_max_retries,
            retry_initial_backoff_ms,
            retry_max_backoff_ms,
            retry_backoff_multiplier,
            retry_jitter_factor,
            disable_retries,
            max_concurrent_requests,
            queue_size,
            queue_timeout_secs,
            rate_limit_tokens_per_second,
            passthrough_paths: passthrough_paths.map(|l| l.paths),
            bytes_per_token,
            max_prefix_blocks_to_match,
            prefix_token_count,
            lru_capacity_per_server,
            prefix_hash_load_factor,
            prefix_cache_weight,
            prefix_load_weight,
            routing_key_headers: routing_key_headers.map(|l| l.values),
            routing_key_body_field,
            utility_window_size,
            utility_min_history,
            utility_throughput_weight,
            utility_latency_weight,
            utility_load_weight,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field set, none to its type's default.
    fn everything() -> RoutingSettings {
        let s: RoutingSettings = serde_json::from_str(
            r#"{"policy":"round_robin","prefill_policy":"random","decode_policy":"cache_aware",
                "cache_threshold":0.4,"balance_abs_threshold":3,"balance_rel_threshold":1.25,
                "eviction_interval_secs":5,"max_tree_size":1000,"block_size":16,"max_payload_size":77,
                "request_timeout_secs":9,"worker_stall_secs":3,"overload_waiting_requests":5,"overload_kv_usage":0.5,"pd_disaggregation":true,"pd_decider":"prefix","non_cached_tokens":12,
                "cb_failure_threshold":4,"cb_timeout_duration_secs":6,"cb_success_threshold":2,
                "cb_window_duration_secs":30,"disable_circuit_breaker":true,"retry_max_retries":3,
                "retry_initial_backoff_ms":10,"retry_max_backoff_ms":100,"retry_backoff_multiplier":2.0,
                "retry_jitter_factor":0.1,"disable_retries":true,"max_concurrent_requests":-1,"queue_size":8,
                "queue_timeout_secs":11,"rate_limit_tokens_per_second":50,
                "passthrough_paths":["/health","/v1/models/*"],"bytes_per_token":3,
                "max_prefix_blocks_to_match":64,"prefix_token_count":128,"lru_capacity_per_server":99,
                "prefix_hash_load_factor":1.5,"prefix_cache_weight":3.0,"prefix_load_weight":0.5,
                "routing_key_headers":["x-user"],"routing_key_body_field":"user","utility_window_size":30,
                "utility_min_history":12,"utility_throughput_weight":0.7,"utility_latency_weight":0.3,
                "utility_load_weight":2.0}"#,
        )
        .unwrap();
        let keys = serde_json::to_value(&s).unwrap().as_object().unwrap().len();
        assert_eq!(keys, RoutingSettings::FIELDS.len(), "the sample sets every field");
        s
    }

    #[test]
    fn every_field_survives_the_round_trip_through_bytes() {
        use prost::Message;
        let s = everything();
        let bytes = v1::RoutingSettings::from(&s).encode_to_vec();
        let back = RoutingSettings::try_from(v1::RoutingSettings::decode(bytes.as_slice()).unwrap()).unwrap();
        assert_eq!(back, s);
        let empty = RoutingSettings::default();
        assert_eq!(RoutingSettings::try_from(v1::RoutingSettings::from(&empty)).unwrap(), empty);
    }

    #[test]
    fn unknown_enum_values_are_errors_naming_the_field() {
        let m = v1::RoutingSettings { decode_policy: Some(42), ..Default::default() };
        assert_eq!(
            RoutingSettings::try_from(m).unwrap_err(),
            SettingsError::UnknownValue { field: "decode_policy", value: 42 }
        );
        let m = v1::RoutingSettings { pd_decider: Some(0), ..Default::default() };
        assert!(RoutingSettings::try_from(m).unwrap_err().to_string().contains("`pd_decider`"));
    }

    #[test]
    fn the_message_declares_the_core_fields_under_the_same_names() {
        let proto = include_str!("../kvmesh.proto");
        let body = proto.split("message RoutingSettings {").nth(1).unwrap().split('}').next().unwrap();
        let names: Vec<&str> = body
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("optional "))
            .filter_map(|l| l.split_whitespace().nth(2))
            .collect();
        assert_eq!(names, RoutingSettings::FIELDS);
    }
}
