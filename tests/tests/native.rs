//! The native experiments end to end (`filter/native`, `xtask/naive-filter`'s native build):
//! real Envoy loading each as a dynamic module in place of the `.wasm`, real simulated
//! workers. They exist to measure the Wasm boundary (`cargo xtask bench instructions`), so
//! what they measure must be the same work: kvmesh's native build routes as the filter does
//! and keeps the same stats.

use std::collections::HashSet;

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{repo_root, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

const FAST: &[&str] = &["--time-scale", "0"];

/// `n` workers and an Envoy running `module` (a `lib<name>.so` under target/release) with
/// `filter` settings over them.
fn stack(module: &str, n: usize, filter: Value) -> (Vec<Sim>, Envoy) {
    let sims: Vec<Sim> = (0..n).map(|_| Sim::start(FAST).expect("sim starts")).collect();
    let mut filter = filter;
    filter["worker_urls"] = json!(sims.iter().map(Sim::url).collect::<Vec<_>>());
    let mut opts = EnvoyOptions::new(filter).expect("options");
    opts.native_module = Some(repo_root().join("target/release").join(module));
    let envoy = Envoy::start(&opts).expect("envoy loads the module and starts");
    (sims, envoy)
}

/// The worker that served, as the simulator says.
fn served_by(r: &Response) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    r.header("x-sim-worker").expect("x-sim-worker").to_string()
}

fn requests_seen(sims: &[Sim]) -> u64 {
    sims.iter().map(|s| s.stats().unwrap()["requests"].as_u64().unwrap()).sum()
}

#[test]
fn kvmesh_native_routes_shared_prefixes_to_one_worker_and_spreads_the_rest() {
    let (_sims, envoy) = stack("libkvmesh_native.so", 4, json!({"policy": "cache_aware"}));
    let system = "You are a careful assistant. Answer in full sentences. ".repeat(40);
    let mut sticky = HashSet::new();
    for i in 0..8 {
        let r = http::post_json(&envoy.url("/generate"), &json!({"text": format!("{system}Question {i}?")})).unwrap();
        sticky.insert(served_by(&r));
    }
    assert_eq!(sticky.len(), 1, "one worker serves the shared prefix: {sticky:?}");
    let mut spread = HashSet::new();
    for i in 0..6 {
        let text = format!("Conversation {i}: {}", format!("topic {i} ").repeat(120));
        let r = http::post_json(&envoy.url("/v1/completions"), &json!({"prompt": text, "max_tokens": 2})).unwrap();
        spread.insert(served_by(&r));
    }
    assert_eq!(spread.len(), 3, "distinct prefixes go to the three other workers: {spread:?}");
    assert!(spread.is_disjoint(&sticky));
    // The filter's stats, under the dynamic modules' namespace: 14 routed, 7 of them hits.
    let stat = |name: &str| envoy.stat(&format!("dynamicmodulescustom.{name}")).unwrap();
    assert_eq!(stat("kvmesh_requests_total"), Some(14));
    assert_eq!(stat("kvmesh_cache_hits_total"), Some(7));
}

#[test]
fn kvmesh_native_answers_bad_requests_with_json_errors_and_never_forwards_them() {
    let (sims, envoy) = stack("libkvmesh_native.so", 2, json!({"max_payload_size": 1 << 20}));
    let url = envoy.url("/generate");
    let too_big = json!({"text": "x".repeat(2 << 20)}).to_string();
    let cases: [(&[u8], u16); 3] = [(b"{\"text\": ", 400), (br#"{"text": 5}"#, 400), (too_big.as_bytes(), 413)];
    for (body, status) in cases {
        let r = http::post(&url, body, &[]).unwrap();
        assert_eq!(r.status, status, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
        let v = r.json().unwrap();
        assert!(v["error"]["message"].is_string() && v["error"]["code"].is_string(), "{v}");
        served_by(&http::post_json(&url, &json!({"text": "still fine"})).unwrap());
    }
    assert_eq!(requests_seen(&sims), 3, "only the good requests reached workers");
}

#[test]
fn the_native_naive_filter_routes_by_the_prompt() {
    let (_sims, envoy) = stack("libkvmesh_naive_filter.so", 4, json!({}));
    let mut workers = HashSet::new();
    for i in 0..16 {
        let body = json!({"text": format!("prompt number {i}")});
        let first = served_by(&http::post_json(&envoy.url("/generate"), &body).unwrap());
        let again = served_by(&http::post_json(&envoy.url("/generate"), &body).unwrap());
        assert_eq!(first, again, "the same prompt goes to the same worker");
        workers.insert(first);
    }
    assert!(workers.len() >= 3, "16 prompts hash over the workers: {workers:?}");
}
