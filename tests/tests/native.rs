//! The native builds end to end (`filter/native`, `xtask/naive-filter`'s native build): real
//! Envoy loading each as a dynamic module in place of the `.wasm`, real simulated workers, and
//! for kvmesh's native build the real kvmesh-cp. kvmesh's native build must route as the filter
//! does and keep the same stats (the benchmarks compare the two), and do what the `.wasm` does
//! without a Wasm VM's timers and gRPC streams: follow the control plane, share prefixes across
//! gateways, and wake requests waiting in the admission queue.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{
    control_plane, fast_prefill, gateway_with, generate, native_module, pd_options, post_in_thread, served, sims, sync,
    DECODE_20MS, FAST, HANG,
};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{repo_root, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

/// `n` workers and an Envoy running `module` (a `lib<name>.so`) with `filter` settings over them.
fn stack(module: std::path::PathBuf, n: usize, filter: Value) -> (Vec<Sim>, Envoy) {
    let sims = sims(n, FAST);
    let mut filter = filter;
    filter["worker_urls"] = json!(sims.iter().map(Sim::url).collect::<Vec<_>>());
    let mut opts = EnvoyOptions::new(filter).expect("options");
    opts.native_module = Some(module);
    let envoy = Envoy::start(&opts).expect("envoy loads the module and starts");
    (sims, envoy)
}

fn requests_seen(sims: &[Sim]) -> u64 {
    sims.iter().map(|s| s.stats().unwrap()["requests"].as_u64().unwrap()).sum()
}

#[test]
fn kvmesh_native_routes_shared_prefixes_to_one_worker_and_spreads_the_rest() {
    let (_sims, envoy) = stack(native_module(), 4, json!({"policy": "cache_aware"}));
    let system = "You are a careful assistant. Answer in full sentences. ".repeat(40);
    let mut sticky = HashSet::new();
    for i in 0..8 {
        let r = http::post_json(&envoy.url("/generate"), &json!({"text": format!("{system}Question {i}?")})).unwrap();
        sticky.insert(served(&r));
    }
    assert_eq!(sticky.len(), 1, "one worker serves the shared prefix: {sticky:?}");
    let mut spread = HashSet::new();
    for i in 0..6 {
        let text = format!("Conversation {i}: {}", format!("topic {i} ").repeat(120));
        let r = http::post_json(&envoy.url("/v1/completions"), &json!({"prompt": text, "max_tokens": 2})).unwrap();
        spread.insert(served(&r));
    }
    assert_eq!(spread.len(), 3, "distinct prefixes go to the three other workers: {spread:?}");
    assert!(spread.is_disjoint(&sticky));
    // The filter's stats, under the dynamic modules' namespace: 14 routed, 7 of them hits.
    assert_eq!(envoy.filter_stat("kvmesh_requests_total"), 14);
    assert_eq!(envoy.cache_hits(), 7);
}

/// Bad requests get the same answers from the native build as from the `.wasm` (status,
/// content type, JSON body: the SPEC's errors, not Envoy's wrapping of a local reply), and
/// none reaches a worker.
#[test]
fn kvmesh_native_answers_bad_requests_as_the_wasm_filter_does_and_never_forwards_them() {
    let settings = json!({"max_payload_size": 1 << 20});
    let (sims, envoy) = stack(native_module(), 2, settings.clone());
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
        served(&http::post_json(&envoy.url("/generate"), &json!({"text": "still fine"})).unwrap());
    }
    assert_eq!(requests_seen(&sims), 4, "only the good requests reached workers");
}

/// A body that arrives in many chunks (a 600 KB prompt) is read once, whole: routed, and the
/// worker gets it unchanged.
#[test]
fn kvmesh_native_routes_a_body_that_arrives_in_many_chunks() {
    let (sims, envoy) = stack(native_module(), 2, json!({"max_payload_size": 1 << 20}));
    let text = "A long document to summarise, sentence after sentence. ".repeat(11_000);
    let r = http::post_json(&envoy.url("/generate"), &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}))
        .unwrap();
    served(&r);
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
    let (_sims, envoy) = stack(repo_root().join("target/release/libkvmesh_naive_filter.so"), 4, json!({}));
    // The naive filter names no worker of its own: the simulator says which one served.
    let served_by = |r: &Response| {
        assert_eq!(r.status, 200, "{}", r.text());
        r.header("x-sim-worker").expect("x-sim-worker").to_string()
    };
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

/// Without static workers the native gateway routes only what kvmesh-cp's snapshots say (the
/// ticker thread's streams, shared with the worker threads); what one gateway indexes reaches
/// kvmesh-cp in its reports and, through it, the other gateway.
#[test]
fn native_gateways_follow_the_control_plane_and_share_prefixes_through_it() {
    let sims = sims(4, FAST);
    let cp = control_plane(&sims, &[]);
    // Native gateways with no workers of their own: everything comes from kvmesh-cp.
    let native_gateway = || {
        let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
        opts.native_module = Some(native_module());
        gateway_with(&cp, opts)
    };
    let (a, b) = (native_gateway(), native_gateway());
    let mut used = HashSet::new();
    for i in 0..6 {
        let prefix = format!("Conversation {i}. The user is asking about topic {i}. ").repeat(25);
        let first = served(&generate(&a, &format!("{prefix}First question?")));
        used.insert(first.clone());
        wait_until("kvmesh-cp to learn gateway A's prefix", Duration::from_secs(10), || {
            cp.holder(&prefix) == Some(format!("http://{first}"))
        })
        .unwrap();
        sync(&cp, &b);
        let hits = b.cache_hits();
        assert_eq!(served(&generate(&b, &format!("{prefix}Second question?"))), first, "gateway B, prefix {i}");
        assert_eq!(b.cache_hits(), hits + 1, "gateway B found prefix {i} in its index");
    }
    assert!(used.len() >= 2, "distinct prefixes spread over the control plane's workers: {used:?}");
    let requests = |e: &Envoy| e.filter_stat("kvmesh_requests_total");
    assert_eq!(requests(&a) + requests(&b), 12);
    // Engine feedback (each response's cached tokens against the prediction) reaches
    // kvmesh-cp although both gateways are idle now: a thread flushes it as its last stream
    // ends, since no timer would reach it afterwards.
    let predictions = || -> u64 { cp.workers().iter().filter_map(|w| w["prediction"]["predictions"].as_u64()).sum() };
    wait_until("kvmesh-cp to learn the 12 predictions' outcomes", Duration::from_secs(10), || predictions() == 12)
        .unwrap_or_else(|e| panic!("{e}: {}", predictions()));
}

/// With no timer of its own on Envoy's worker threads, the native build's ticker wakes the
/// threads that hold queued requests: requests waiting past the queue timeout get their JSON
/// 408 while nothing else happens, and one waiting for a token is routed once a token is back.
/// (The bucket refills at 1 token a second, so one of several waiting may get in that way.)
#[test]
fn kvmesh_native_wakes_queued_requests_to_admit_or_expire_them() {
    let sim = Sim::start(DECODE_20MS).unwrap();
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
        opts.native_module = Some(native_module());
        let envoy = Envoy::start(&opts).unwrap();
        let before = sim.stats().unwrap()["requests"].as_u64().unwrap();
        let long = post_in_thread(&envoy.url("/generate"), body("the long one", long_tokens));
        wait_until("the long request at the worker", Duration::from_secs(10), || {
            sim.stats().unwrap()["requests"].as_u64().unwrap() > before
        })
        .unwrap();
        (envoy, long, before)
    };

    // A 1 s queue timeout; the long request holds the only token for 4 s; three wait, and the
    // one the refill may let in holds its token for 2 s: at least two time out.
    let (envoy, long, before) = start(1, 200);
    let waiting: Vec<_> =
        (0..3).map(|i| post_in_thread(&envoy.url("/generate"), body(&format!("waiting {i}"), 100))).collect();
    envoy.wait_for_queued(3);
    let results: Vec<(Response, Instant)> = waiting.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = results.iter().map(|(r, _)| r.status).collect();
    let timed_out: Vec<_> = results.iter().filter(|(r, _)| r.status == 408).collect();
    assert!(timed_out.len() >= 2 && statuses.iter().all(|s| [200, 408].contains(s)), "statuses {statuses:?}");
    let (long, long_done) = long.join().unwrap();
    assert_eq!(long.status, 200);
    for (r, done) in timed_out {
        assert_eq!(r.json().unwrap()["error"]["code"], "queue_timeout", "{}", r.text());
        // The timeout, not a token, ended its wait: the long request still held its token.
        assert!(*done < long_done, "the 408 came after the long request ended");
    }
    assert!(
        sim.stats().unwrap()["requests"].as_u64().unwrap() - before <= 2,
        "the timed-out ones never reached the worker"
    );
    drop(envoy);

    // A long queue timeout: the waiting request is routed when the token comes back (the
    // long request's end at 0.8 s, or the refill at 1 s).
    let (envoy, long, _) = start(30, 40);
    let waiting = post_in_thread(&envoy.url("/generate"), body("waiting", 1));
    envoy.wait_for_queued(1);
    let (r, _) = waiting.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(long.join().unwrap().0.status, 200);
}

/// PD with a concurrency limit: a request admitted from the queue sends its prefill leg from
/// the tick, on its own stream (entered by the tick), and the answer comes back to it.
#[test]
fn kvmesh_native_pd_requests_admitted_from_the_queue_complete_both_legs() {
    let prefill = fast_prefill();
    let boot = prefill.bootstrap_port.unwrap().to_string();
    let decode = Sim::decode(&[DECODE_20MS, &["--default-bootstrap-port", &boot]].concat()).unwrap();
    let filter = json!({
        "prefill": [[prefill.url(), null]],
        "decode": [decode.url()],
        "max_concurrent_requests": 1,
        "rate_limit_tokens_per_second": 1,
        "queue_size": 8,
        "queue_timeout_secs": 30,
    });
    let envoy = Envoy::start(&pd_options(filter, true)).unwrap();
    let url = envoy.url("/generate");
    let body = |text: &str, tokens: u32| json!({"text": text, "sampling_params": {"max_new_tokens": tokens}});
    let started = Instant::now();
    let long = post_in_thread(&url, body("the long one", 60));
    wait_until("the long request at the decode worker", Duration::from_secs(10), || {
        decode.stats().unwrap()["requests"].as_u64().unwrap() > 0
    })
    .unwrap();
    let waiting: Vec<_> = (0..2).map(|i| post_in_thread(&url, body(&format!("queued pd {i}"), 1))).collect();
    envoy.wait_for_queued(2);
    for h in waiting {
        let (r, _) = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvmesh-prefill"), Some(prefill.addr().as_str()));
    }
    // Far sooner than the queue timeout (30 s), which a lost answer would have waited for.
    assert!(started.elapsed() < HANG, "took {:?}", started.elapsed());
    assert_eq!(long.join().unwrap().0.status, 200);
    assert_eq!(prefill.stats().unwrap()["requests"].as_u64(), Some(3), "one prefill leg each");
}

/// What `cargo xtask package` writes for users (`envoy-native.yaml`, `envoy-pd-native.yaml`):
/// each shipped configuration with only its Wasm filter entry replaced — by the dynamic-modules
/// filter loading the native build with the same JSON plus the template's control-plane
/// address — and Envoy accepts each with the module and refuses it without.
#[test]
fn the_shipped_configurations_rendered_for_the_native_build_differ_only_in_the_filter() {
    let module = native_module();
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
