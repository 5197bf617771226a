//! The native builds end to end (`filter/native`, `xtask/naive-filter`'s native build): real
//! Envoy loading each as a dynamic module in place of the `.wasm`, real simulated workers, and
//! for kvmesh's native build the real kvmesh-cp. kvmesh's native build must route as the filter
//! does and keep the same stats (the benchmarks compare the two), and do what the `.wasm` does
//! without a Wasm VM's timers and gRPC streams: follow the control plane, share prefixes across
//! gateways, and wake requests waiting in the admission queue.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{free_port, repo_root, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

const FAST: &[&str] = &["--time-scale", "0"];

fn native(module: &str) -> std::path::PathBuf {
    repo_root().join("target/release").join(module)
}

/// `n` workers and an Envoy running `module` (a `lib<name>.so` under target/release) with
/// `filter` settings over them.
fn stack(module: &str, n: usize, filter: Value) -> (Vec<Sim>, Envoy) {
    let sims: Vec<Sim> = (0..n).map(|_| Sim::start(FAST).expect("sim starts")).collect();
    let mut filter = filter;
    filter["worker_urls"] = json!(sims.iter().map(Sim::url).collect::<Vec<_>>());
    let mut opts = EnvoyOptions::new(filter).expect("options");
    opts.native_module = Some(native(module));
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
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.{name}")).unwrap();
    assert_eq!(stat("kvmesh_requests_total"), Some(14));
    assert_eq!(stat("kvmesh_cache_hits_total"), Some(7));
}

/// Bad requests get the same answers from the native build as from the `.wasm` (status,
/// content type, JSON body: the SPEC's errors, not Envoy's wrapping of a local reply), and
/// none reaches a worker.
#[test]
fn kvmesh_native_answers_bad_requests_as_the_wasm_filter_does_and_never_forwards_them() {
    let settings = json!({"max_payload_size": 1 << 20});
    let (sims, envoy) = stack("libkvmesh_native.so", 2, settings.clone());
    let mut wasm_settings = settings;
    wasm_settings["worker_urls"] = json!(sims.iter().map(Sim::url).collect::<Vec<_>>());
    let wasm = Envoy::start(&EnvoyOptions::new(wasm_settings).unwrap()).unwrap();
    let too_big = json!({"text": "x".repeat(2 << 20)}).to_string();
    let cases: [(&str, &[u8], u16); 4] = [
        ("/generate", b"{\"text\": ", 400),
        ("/generate", br#"{"text": 5}"#, 400),
        ("/v1/chat/completions", br#"{"messages": "hi"}"#, 400),
        ("/generate", too_big.as_bytes(), 413),
    ];
    for (path, body, status) in cases {
        let native = http::post(&envoy.url(path), body, &[]).unwrap();
        let reference = http::post(&wasm.url(path), body, &[]).unwrap();
        assert_eq!(native.status, status, "{}", native.text());
        assert_eq!(native.status, reference.status);
        assert_eq!(native.header("content-type"), Some("application/json"));
        assert_eq!(native.json().unwrap(), reference.json().unwrap(), "{path}: the same error as the .wasm's");
        served_by(&http::post_json(&envoy.url("/generate"), &json!({"text": "still fine"})).unwrap());
    }
    assert_eq!(requests_seen(&sims), 4, "only the good requests reached workers");
}

/// A body that arrives in many chunks (a 600 KB prompt) is read once, whole: routed, and the
/// worker gets it unchanged.
#[test]
fn kvmesh_native_routes_a_body_that_arrives_in_many_chunks() {
    let (sims, envoy) = stack("libkvmesh_native.so", 2, json!({"max_payload_size": 1 << 20}));
    let text = "A long document to summarise, sentence after sentence. ".repeat(11_000);
    let r = http::post_json(&envoy.url("/generate"), &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}))
        .unwrap();
    served_by(&r);
    let seen: Vec<Value> = sims
        .iter()
        .flat_map(|s| {
            http::get(&format!("{}/sim/requests", s.url()))
                .unwrap()
                .json()
                .unwrap()
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(seen.len(), 1, "one request reached a worker");
    assert_eq!(seen[0]["body"]["text"].as_str().map(str::len), Some(text.len()), "the worker got the whole prompt");
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

/// A native gateway with no workers of its own: everything comes from `cp`.
fn native_gateway(cp: &ControlPlane) -> Envoy {
    let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
    opts.use_control_plane(cp);
    opts.native_module = Some(native("libkvmesh_native.so"));
    let envoy = Envoy::start(&opts).unwrap();
    wait_until("the native gateway to apply a snapshot", Duration::from_secs(20), || version(&envoy) >= 1).unwrap();
    envoy
}

fn version(envoy: &Envoy) -> u64 {
    envoy.stat("wasmcustom.kvmesh_snapshot_version").unwrap().unwrap_or(0)
}

fn generate(envoy: &Envoy, text: &str) -> Response {
    http::post_json(&envoy.url("/generate"), &json!({"text": text, "sampling_params": {"max_new_tokens": 1}})).unwrap()
}

/// Without static workers the native gateway routes only what kvmesh-cp's snapshots say (the
/// ticker thread's streams, shared with the worker threads); what one gateway indexes reaches
/// kvmesh-cp in its reports and, through it, the other gateway.
#[test]
fn native_gateways_follow_the_control_plane_and_share_prefixes_through_it() {
    let sims: Vec<Sim> = (0..4).map(|_| Sim::start(FAST).unwrap()).collect();
    let mut flags = vec!["--worker-urls".to_string()];
    flags.extend(sims.iter().map(Sim::url));
    let cp = ControlPlane::start(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let (a, b) = (native_gateway(&cp), native_gateway(&cp));
    let mut used = HashSet::new();
    for i in 0..6 {
        let prefix = format!("Conversation {i}. The user is asking about topic {i}. ").repeat(25);
        let first = served_by(&generate(&a, &format!("{prefix}First question?")));
        used.insert(first.clone());
        let holder = || {
            let m = cp.match_text(prefix.as_bytes()).unwrap();
            m[0]["url"].as_str().map(|u| u.trim_start_matches("http://").to_string())
        };
        wait_until("kvmesh-cp to learn gateway A's prefix", Duration::from_secs(10), || {
            holder().as_deref() == Some(first.as_str())
        })
        .unwrap();
        let v = cp.settled_version().unwrap();
        wait_until("gateway B to apply it", Duration::from_secs(10), || version(&b) >= v).unwrap();
        assert_eq!(served_by(&generate(&b, &format!("{prefix}Second question?"))), first, "gateway B, prefix {i}");
    }
    assert!(used.len() >= 2, "distinct prefixes spread over the control plane's workers: {used:?}");
    let stat = |e: &Envoy, name: &str| e.stat(&format!("wasmcustom.{name}")).unwrap().unwrap_or(0);
    assert_eq!(stat(&a, "kvmesh_requests_total") + stat(&b, "kvmesh_requests_total"), 12);
    assert!(stat(&b, "kvmesh_cache_hits_total") >= 6, "gateway B's routes were cache hits");
    // Engine feedback (each response's cached tokens against the prediction) reaches
    // kvmesh-cp although both gateways are idle now: a thread flushes it as its last stream
    // ends, since no timer would reach it afterwards.
    let predictions = || -> u64 {
        let workers = http::get(&cp.url("/workers")).unwrap().json().unwrap();
        workers.as_array().unwrap().iter().filter_map(|w| w["prediction"]["predictions"].as_u64()).sum()
    };
    wait_until("kvmesh-cp to learn the 12 predictions' outcomes", Duration::from_secs(10), || predictions() == 12)
        .unwrap_or_else(|e| panic!("{e}: {}", predictions()));
}

/// A 20 ms-per-token worker, so that `max_new_tokens` sets how long a request holds its token.
fn slow_sim() -> Sim {
    Sim::start(&["--time-scale", "1", "--decode-ms-per-token", "20", "--batch-slowdown", "0"]).unwrap()
}

fn spawn(url: &str, body: Value) -> std::thread::JoinHandle<(Response, Duration)> {
    let url = url.to_string();
    std::thread::spawn(move || {
        let started = Instant::now();
        let r = http::post_json(&url, &body).unwrap();
        (r, started.elapsed())
    })
}

/// With no timer of its own on Envoy's worker threads, the native build's ticker wakes the
/// threads that hold queued requests: requests waiting past the queue timeout get their JSON
/// 408 while nothing else happens, and one waiting for a token is routed once a token is back.
/// (The bucket refills at 1 token a second, so one of several waiting may get in that way.)
#[test]
fn kvmesh_native_wakes_queued_requests_to_admit_or_expire_them() {
    let sim = slow_sim();
    let body = |text: &str, tokens: u32| json!({"text": text, "sampling_params": {"max_new_tokens": tokens}});
    let start = |timeout: u32, long_tokens: u32| {
        let mut opts = EnvoyOptions::new(json!({
            "worker_urls": [sim.url()],
            "max_concurrent_requests": 1,
            "rate_limit_tokens_per_second": 1,
            "queue_size": 4,
            "queue_timeout_secs": timeout,
        }))
        .unwrap();
        opts.native_module = Some(native("libkvmesh_native.so"));
        let envoy = Envoy::start(&opts).unwrap();
        let before = sim.stats().unwrap()["requests"].as_u64().unwrap();
        let long = spawn(&envoy.url("/generate"), body("the long one", long_tokens));
        wait_until("the long request at the worker", Duration::from_secs(10), || {
            sim.stats().unwrap()["requests"].as_u64().unwrap() > before
        })
        .unwrap();
        (envoy, long, before)
    };

    // A 1 s queue timeout; the long request holds the only token for 4 s; three wait, and the
    // one the refill may let in holds its token for 2 s: at least two time out.
    let (envoy, long, before) = start(1, 200);
    let waiting: Vec<_> = (0..3).map(|i| spawn(&envoy.url("/generate"), body(&format!("waiting {i}"), 100))).collect();
    let results: Vec<(Response, Duration)> = waiting.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = results.iter().map(|(r, _)| r.status).collect();
    let timed_out: Vec<_> = results.iter().filter(|(r, _)| r.status == 408).collect();
    assert!(timed_out.len() >= 2 && statuses.iter().all(|s| [200, 408].contains(s)), "statuses {statuses:?}");
    for (r, took) in timed_out {
        assert_eq!(r.json().unwrap()["error"]["code"], "queue_timeout", "{}", r.text());
        assert!(*took >= Duration::from_millis(950) && *took < Duration::from_secs(3), "408 after {took:?}");
    }
    assert!(
        sim.stats().unwrap()["requests"].as_u64().unwrap() - before <= 2,
        "the timed-out ones never reached the worker"
    );
    assert_eq!(long.join().unwrap().0.status, 200);
    drop(envoy);

    // A long queue timeout: the waiting request is routed when the token comes back (the
    // long request's end at 0.8 s, or the refill at 1 s).
    let (envoy, long, _) = start(30, 40);
    let (r, took) = spawn(&envoy.url("/generate"), body("waiting", 1)).join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(took >= Duration::from_millis(500), "it waited for a token, only {took:?}");
    assert_eq!(long.join().unwrap().0.status, 200);
}

/// PD with a concurrency limit: a request admitted from the queue sends its prefill leg from
/// the tick, on its own stream (entered by the tick), and the answer comes back to it.
#[test]
fn kvmesh_native_pd_requests_admitted_from_the_queue_complete_both_legs() {
    let boot = free_port().unwrap();
    let prefill =
        Sim::start(&["--role", "prefill", "--bootstrap-port", &boot.to_string(), "--time-scale", "0"]).unwrap();
    let decode_args = ["--role", "decode", "--time-scale", "1", "--decode-ms-per-token", "20", "--batch-slowdown", "0"];
    let decode = Sim::start(&[&decode_args[..], &["--default-bootstrap-port", &boot.to_string()]].concat()).unwrap();
    let mut opts = EnvoyOptions::new(json!({
        "prefill": [[prefill.url(), null]],
        "decode": [decode.url()],
        "max_concurrent_requests": 1,
        "rate_limit_tokens_per_second": 1,
        "queue_size": 8,
        "queue_timeout_secs": 30,
    }))
    .unwrap();
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    opts.native_module = Some(native("libkvmesh_native.so"));
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let body = |text: &str, tokens: u32| json!({"text": text, "sampling_params": {"max_new_tokens": tokens}});
    let long = spawn(&url, body("the long one", 60));
    wait_until("the long request at the decode worker", Duration::from_secs(10), || {
        decode.stats().unwrap()["requests"].as_u64().unwrap() > 0
    })
    .unwrap();
    let waiting: Vec<_> = (0..2).map(|i| spawn(&url, body(&format!("queued pd {i}"), 1))).collect();
    for h in waiting {
        let (r, took) = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvmesh-prefill"), Some(prefill.addr().as_str()));
        assert!(took >= Duration::from_millis(700), "it waited in the queue: {took:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
    assert_eq!(long.join().unwrap().0.status, 200);
    assert_eq!(prefill.stats().unwrap()["requests"].as_u64(), Some(3), "one prefill leg each");
}

/// What `cargo xtask package` writes for users (`envoy-native.yaml`, `envoy-pd-native.yaml`):
/// each shipped configuration with only its Wasm filter entry replaced — by the dynamic-modules
/// filter loading the native build with the same JSON plus the template's control-plane
/// address — and Envoy accepts each with the module and refuses it without.
#[test]
fn the_shipped_configurations_rendered_for_the_native_build_differ_only_in_the_filter() {
    let module = native("libkvmesh_native.so");
    let scratch = kvmesh_testkit::scratch_dir("native-configs").unwrap();
    for template in ["envoy/envoy.yaml", "envoy/envoy-pd.yaml"] {
        let path = repo_root().join(template);
        let rendered = kvmesh_testkit::envoy::native_template(&path, &module).unwrap();
        let mut shipped: Value = serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut native: Value = serde_norway::from_str(&rendered).unwrap();
        let filters = "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters";
        let wasm = shipped.pointer_mut(filters).unwrap().as_array_mut().unwrap().remove(0);
        let dm = native.pointer_mut(filters).unwrap().as_array_mut().unwrap().remove(0);
        assert_eq!(shipped, native, "{template}: nothing but the filter entry changes");
        assert_eq!(wasm["name"], "envoy.filters.http.wasm");
        assert_eq!(dm["name"], "envoy.filters.http.dynamic_modules");
        assert_eq!(dm["typed_config"]["dynamic_module_config"]["name"], "kvmesh_native");
        let settings = |v: &Value| -> Value { serde_json::from_str(v.as_str().unwrap()).unwrap() };
        let mut want = settings(&wasm["typed_config"]["config"]["configuration"]["value"]);
        want["control_plane_address"] = json!("http://127.0.0.1:18000");
        assert_eq!(settings(&dm["typed_config"]["filter_config"]["value"]), want, "{template}: the same settings");

        let file = scratch.path().join(path.file_name().unwrap());
        std::fs::write(&file, &rendered).unwrap();
        kvmesh_testkit::envoy::validate_with_modules(&file, module.parent()).unwrap();
        let refused = kvmesh_testkit::envoy::validate_with_modules(&file, Some(scratch.path()));
        assert!(refused.is_err(), "{template}: Envoy loads the module while validating, so it must be found");
    }
}
