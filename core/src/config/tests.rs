use super::*;

/// docs/configuration.md's "Filter-only plugin keys" table has a row for every key, and
/// no row for a key the filter does not take. (Native only: the wasm32 runner has no files.)
#[cfg(not(target_arch = "wasm32"))]
#[test]
fn every_filter_only_key_is_documented() {
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md")).unwrap();
    let table = docs.split("### Filter-only plugin keys").nth(1).unwrap().split("\n## ").next().unwrap();
    let documented: Vec<&str> = table.lines().filter_map(|l| l.strip_prefix("| `")?.split('`').next()).collect();
    let mut want = FILTER_KEYS.to_vec();
    want.sort_unstable();
    let mut got = documented.clone();
    got.sort_unstable();
    assert_eq!(got, want, "the filter-only keys in docs/configuration.md");
}

#[test]
fn priority_classes_get_their_reserves_bounds_and_timeouts() {
    let json = br#"{"max_concurrent_requests":4,"priority_reserved":["interactive=2","system=1"],
        "priority_queue_size":["interactive=5"],"priority_queue_timeout_secs":["default=3"]}"#;
    let p = Config::from_json(json).unwrap().admission.unwrap();
    assert_eq!(p.classes.reserved, [0, 0, 2, 1]);
    assert_eq!(p.classes.queue_size, [None, None, Some(5), None]);
    assert_eq!(p.timeout_ms(crate::priority::Class::Default), 3_000);
    assert_eq!(p.timeout_ms(crate::priority::Class::System), 60_000);
    for (json, field) in [
        (&br#"{"max_concurrent_requests":2,"priority_reserved":["system=3"]}"#[..], "priority_reserved"),
        (br#"{"max_concurrent_requests":2,"priority_queue_size":["vip=3"]}"#, "priority_queue_size"),
        (br#"{"max_concurrent_requests":2,"priority_queue_timeout_secs":["system=0"]}"#, "priority_queue_timeout_secs"),
    ] {
        let e = Config::from_json(json).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
}

#[test]
fn tenant_weights_turn_tenants_on_and_refuse_garbage() {
    let t = Config::from_json(br#"{"tenant_weight":["team-a=3"]}"#).unwrap().tenants.unwrap();
    assert_eq!(t.weights, Some(vec![("team-a".to_string(), 3)]));
    assert_eq!(Config::from_json(b"{}").unwrap().tenants, None);
    for bad in [&br#"{"tenant_weight":["team-a=0"]}"#[..], br#"{"tenant_weight":["team-a"]}"#] {
        assert!(Config::from_json(bad).unwrap_err().to_string().contains("tenant_weight"));
    }
}

#[test]
fn admission_is_off_unless_a_concurrency_limit_is_set() {
    for json in [&b"{}"[..], br#"{"max_concurrent_requests":-1}"#, br#"{"max_concurrent_requests":0}"#] {
        assert_eq!(Config::from_json(json).unwrap().admission, None);
    }
    let c = Config::from_json(br#"{"max_concurrent_requests":8}"#).unwrap();
    let want = AdmissionParams {
        capacity: 8,
        refill_per_sec: 8.0,
        queue_size: 100,
        queue_timeout_ms: 60_000,
        classes: Default::default(),
    };
    assert_eq!(c.admission, Some(want), "sglang-router's defaults: refill = limit, queue 100, 60 s");
    let json =
        br#"{"max_concurrent_requests":4,"rate_limit_tokens_per_second":1,"queue_size":0,"queue_timeout_secs":2}"#;
    let want = AdmissionParams {
        capacity: 4,
        refill_per_sec: 1.0,
        queue_size: 0,
        queue_timeout_ms: 2_000,
        classes: Default::default(),
    };
    assert_eq!(Config::from_json(json).unwrap().admission, Some(want));
    for (json, field) in [
        (&br#"{"max_concurrent_requests":4,"queue_timeout_secs":0}"#[..], "queue_timeout_secs"),
        (br#"{"max_concurrent_requests":99999999999}"#, "max_concurrent_requests"),
        (br#"{"max_concurrent_requests":4,"queue_size":99999999999}"#, "queue_size"),
    ] {
        let e = Config::from_json(json).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
}

#[test]
fn defaults_match_sglang_router() {
    let c = Config::from_json(b"{}").unwrap();
    assert_eq!(c.policy, PolicyKind::CacheAware);
    assert_eq!(c.cache_aware.cache_threshold, 0.3);
    assert_eq!(c.cache_aware.balance_abs_threshold, 64);
    assert_eq!(c.cache_aware.balance_rel_threshold, 1.5);
    assert_eq!(c.eviction_interval_secs, 120);
    assert_eq!(c.max_tree_size, 1 << 26);
    assert_eq!(c.breaker, BreakerParams::default());
    assert_eq!(Config::from_json(b"").unwrap(), c);
}

#[test]
fn circuit_breaker_settings() {
    let c = Config::from_json(
        br#"{"cb_failure_threshold":3,"cb_success_threshold":1,"cb_timeout_duration_secs":2,
            "cb_window_duration_secs":30,"disable_circuit_breaker":true}"#,
    )
    .unwrap();
    let want = BreakerParams {
        failure_threshold: 3,
        success_threshold: 1,
        timeout_ms: 2_000,
        window_ms: 30_000,
        disabled: true,
    };
    assert_eq!(c.breaker, want);
    let huge = Config::from_json(br#"{"cb_timeout_duration_secs":18446744073709551615}"#).unwrap();
    assert_eq!(huge.breaker.timeout_ms, u64::MAX, "saturates");
    let err = |json: &str| Config::from_json(json.as_bytes()).unwrap_err().to_string();
    for field in ["cb_failure_threshold", "cb_success_threshold", "cb_timeout_duration_secs", "cb_window_duration_secs"]
    {
        assert!(err(&format!(r#"{{"{field}":0}}"#)).contains(&format!("`{field}`")), "{field}");
    }
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
    assert!(err(r#"{"prefix_hash_load_factor":0.5}"#).contains("`prefix_hash_load_factor`"));
    assert!(err(r#"{"utility_window_size":1}"#).contains("`utility_window_size`"));
    assert!(err(r#"{"utility_window_size":8,"utility_min_history":9}"#).contains("`utility_min_history`"));
    assert!(err(r#"{"utility_latency_weight":-1}"#).contains("`utility_latency_weight`"));
    assert!(err(r#"{"routing_key_headers":["bad header"]}"#).contains("`routing_key_headers`"));
    assert!(err(r#"{"max_prefix_blocks_to_match":0}"#).contains("`max_prefix_blocks_to_match`"));
    assert!(err(r#"{"prefix_cache_weight":0,"prefix_load_weight":0}"#).contains("`prefix_cache_weight`"));
    assert!(err(r#"{"cache_threshold":1.5}"#).contains("`cache_threshold`"));
    assert!(err(r#"{"balance_rel_threshold":0.5}"#).contains("`balance_rel_threshold`"));
    assert!(err(r#"{"block_size":0}"#).contains("`block_size`"));
    assert!(err(r#"{"worker_urls":["10.0.0.1:80"]}"#).contains("`worker_urls`"));
    assert_eq!(err(r#"{"polcy":"random"}"#), "configuration `polcy`: unknown key");
    assert!(err(r#"{"policy":5}"#).contains("configuration `policy`: invalid type"));
    assert!(err(r#"{"report_interval_ms":"soon"}"#).contains("`report_interval_ms`"));
    assert!(err(r#"{"retry_jitter_factor":2}"#).contains("`retry_jitter_factor`"));
    assert!(err(r#"{"control_plane_token":"two words"}"#).contains("`control_plane_token`"));
    assert!(err(r#"{"control_plane_token":7}"#).contains("`control_plane_token`"));
    for bad in [r#""""#, r#""two words""#, r#""a\r\nx: 1""#, "7"] {
        assert!(err(&format!(r#"{{"worker_api_key":{bad}}}"#)).contains("`worker_api_key`"), "{bad}");
    }
    let keyed = Config::from_json(br#"{"worker_api_key":"wk-1"}"#).unwrap();
    assert_eq!(keyed.worker_authorization.as_deref(), Some("Bearer wk-1"));
    assert_eq!(
        keyed.with_settings(&RoutingSettings::default()).unwrap().worker_authorization,
        keyed.worker_authorization
    );
    assert!(err(r#"{"control_plane_address":"http://127.0.0.1:18000"}"#).contains("without control_plane_cluster"));
    let no_scheme = r#"{"control_plane_cluster":"cp","control_plane_address":"127.0.0.1:18000"}"#;
    assert!(err(no_scheme).contains("`control_plane_address`"));
    assert!(err(r#"{"control_plane_cluster":"cp","control_plane_address":7}"#).contains("`control_plane_address`"));
    let ok = r#"{"control_plane_cluster":"cp","control_plane_address":"http://127.0.0.1:18000"}"#;
    let config = Config::from_json(ok.as_bytes()).unwrap();
    assert_eq!(config.control_plane_address.as_deref(), Some("http://127.0.0.1:18000"));
    let again = config.with_settings(&config.settings).unwrap();
    assert_eq!(again.control_plane_address, config.control_plane_address, "a filter-only key survives new settings");
    assert!(err("[1]").contains("JSON object"));
    assert!(err("{").contains("not valid JSON"));
}

#[test]
fn every_policy_is_available_with_its_parameters() {
    for k in PolicyKind::ALL {
        let c = Config::from_json(format!(r#"{{"policy":"{k}"}}"#).as_bytes()).unwrap();
        assert_eq!(c.policy, k);
    }
    let c = Config::from_json(
        br#"{"policy":"prefix_hash","max_prefix_blocks_to_match":100,"prefix_token_count":64,"block_size":16,
            "lru_capacity_per_server":500,"prefix_hash_load_factor":2,"routing_key_headers":["X-User"],
            "routing_key_body_field":"user","utility_window_size":30,"utility_load_weight":0.5}"#,
    )
    .unwrap();
    // 64 tokens of 4 bytes in blocks of 16: 16 blocks, fewer than 100.
    assert_eq!((c.prefix_hash.max_blocks, c.prefix_hash.lru_capacity, c.prefix_hash.load_factor), (16, 500, 2.0));
    assert_eq!(c.routing_key, RoutingKey { headers: vec!["x-user".into()], body_field: Some("user".into()) });
    assert_eq!((c.utility.window_size, c.utility.min_history, c.utility.load_weight), (30, 10, 0.5));
    let d = Config::default();
    assert_eq!((d.prefix_hash.max_blocks, d.utility.window_size, d.utility.min_history), (32, 20, 10));
    assert_eq!(Config::from_json(b"{}").unwrap().prefix_hash, d.prefix_hash);
    // A window smaller than the default history: the history follows it.
    assert_eq!(Config::from_json(br#"{"utility_window_size":4}"#).unwrap().utility.min_history, 4);
}

#[test]
fn pd_legs_default_to_the_main_policy_then_to_cache_aware_and_power_of_two() {
    let pd = |json: &str| Config::from_json(json.as_bytes()).unwrap().pd.unwrap();
    let p = pd(r#"{"pd_disaggregation":true}"#);
    assert_eq!((p.prefill_policy, p.decode_policy), (PolicyKind::CacheAware, PolicyKind::PowerOfTwo));
    let p = pd(r#"{"pd_disaggregation":true,"policy":"round_robin","decode_policy":"random"}"#);
    assert_eq!((p.prefill_policy, p.decode_policy), (PolicyKind::RoundRobin, PolicyKind::Random));
}

#[test]
fn other_settings_keep_the_filter_only_parts() {
    let c = Config::from_json(
        br#"{"policy":"round_robin","control_plane_cluster":"cp","report_interval_ms":7,
            "worker_urls":["http://127.0.0.1:1"],"control_plane_token":"s3cr3t"}"#,
    )
    .unwrap();
    let mut s = c.settings.clone();
    s.overlay(&RoutingSettings { cache_threshold: Some(0.9), ..Default::default() });
    let d = c.with_settings(&s).unwrap();
    assert_eq!((d.policy, d.cache_aware.cache_threshold), (PolicyKind::RoundRobin, 0.9));
    assert_eq!((d.control_plane_cluster.as_deref(), d.report_interval_ms), (Some("cp"), 7));
    assert_eq!(d.control_plane_token.as_deref(), Some("s3cr3t"));
    assert_eq!(d.workers, c.workers);
    assert_eq!(d.settings, s);
    assert!(c.with_settings(&RoutingSettings { block_size: Some(0), ..Default::default() }).is_err());
}
