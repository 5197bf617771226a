//! Prefill/decode disaggregation end to end: real Envoy with `envoy/envoy-pd.yaml`, the real
//! filter, simulated prefill workers (with bootstrap KV servers) and decode workers that
//! fetch the KV of each room — a wrong host, port or room fails the request visibly.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{fast_decode, fast_prefill, generate, generate_tokens, pd_options, HANG};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{free_port, wait_until, Envoy, Sim};
use serde_json::{json, Value};

struct Pd {
    prefill: Vec<(Sim, Option<u16>)>,
    decode: Vec<Sim>,
    envoy: Envoy,
}

/// Prefill workers and decode workers. The first prefill worker is configured with `none`:
/// it listens on the decode workers' default bootstrap port (as SGLang's default 8998 would
/// be); the others announce their own port.
fn pd_stack(prefills: usize, decodes: usize, filter: Value) -> Pd {
    pd_stack_on(prefills, decodes, filter, false)
}

/// The same, on kvmesh's native build (`libkvmesh_native.so`) when `native`.
fn pd_stack_on(prefills: usize, decodes: usize, filter: Value, native: bool) -> Pd {
    let prefill: Vec<(Sim, Option<u16>)> = (0..prefills)
        .map(|i| {
            let sim = fast_prefill();
            let announced = sim.bootstrap_port.filter(|_| i > 0);
            (sim, announced)
        })
        .collect();
    // With `none`, the decode worker falls back to its default port: the first prefill's.
    let decode: Vec<Sim> = (0..decodes).map(|_| fast_decode(prefill.first().map(|(s, _)| s))).collect();
    let mut filter = filter;
    filter["prefill"] = json!(prefill.iter().map(|(s, p)| json!([s.url(), p])).collect::<Vec<_>>());
    filter["decode"] = json!(decode.iter().map(Sim::url).collect::<Vec<_>>());
    let envoy = Envoy::start(&pd_options(filter, native)).unwrap();
    Pd { prefill, decode, envoy }
}

impl Pd {
    fn sim(&self, addr: &str) -> &Sim {
        self.prefill.iter().map(|(s, _)| s).chain(&self.decode).find(|s| s.addr() == addr).expect("a known worker")
    }

    /// The body worker `addr` received for request `id`.
    fn received(&self, addr: &str, id: &str) -> Value {
        let log = http::get(&format!("{}/sim/requests", self.sim(addr).url())).unwrap().json().unwrap();
        let found = log.as_array().unwrap().iter().rev().find(|r| r["x_request_id"] == id).cloned();
        found.unwrap_or_else(|| panic!("{addr} saw no request {id}: {log}"))["body"].clone()
    }

    fn prefill_port(&self, addr: &str) -> Value {
        json!(self.prefill.iter().find(|(s, _)| s.addr() == addr).expect("a prefill worker").1)
    }
}

fn send(pd: &Pd, path: &str, body: &Value, id: &str) -> Response {
    http::post(&pd.envoy.url(path), body.to_string().as_bytes(), &[("x-request-id", id)]).unwrap()
}

fn legs(r: &Response) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.text());
    let decode = r.header("x-kvmesh-worker").expect("x-kvmesh-worker").to_string();
    assert_eq!(r.header("x-sim-worker"), Some(decode.as_str()), "the decode worker answered");
    (r.header("x-kvmesh-prefill").expect("x-kvmesh-prefill").to_string(), decode)
}

/// Both legs saw the same bootstrap fields, naming the prefill worker; lists for batches.
fn assert_same_bootstrap(pd: &Pd, prefill: &str, decode: &str, id: &str, batch: Option<usize>) -> Value {
    let p = pd.received(prefill, id);
    let d = pd.received(decode, id);
    for field in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        assert_eq!(p[field], d[field], "{field} differs between the legs");
    }
    let port = pd.prefill_port(prefill);
    match batch {
        None => {
            assert_eq!(p["bootstrap_host"], "127.0.0.1");
            assert_eq!(p["bootstrap_port"], port);
            assert!(p["bootstrap_room"].as_u64().unwrap() <= i64::MAX as u64);
        }
        Some(n) => {
            assert_eq!(p["bootstrap_host"], json!(vec!["127.0.0.1"; n]));
            assert_eq!(p["bootstrap_port"], json!(vec![port; n]));
            let rooms: HashSet<u64> =
                p["bootstrap_room"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap()).collect();
            assert_eq!(rooms.len(), n, "distinct rooms per item");
        }
    }
    assert_eq!(p["rid"], d["rid"], "one rid on both legs");
    let rids = match &p["rid"] {
        Value::Array(items) => items.clone(),
        one => vec![one.clone()],
    };
    for rid in rids {
        // The gateway's own (`kvmesh-<16 hex>-<item>`), never the client's.
        let rid = rid.as_str().unwrap_or_else(|| panic!("rid not a string: {p}"));
        assert!(rid.starts_with("kvmesh-") && rid.len() == 28, "the gateway's rid: {p}");
    }
    p
}

#[test]
fn every_endpoint_streaming_or_not_single_or_batch_pairs_correctly() {
    every_endpoint_pairs_correctly(false);
}

/// The native build sends the prefill leg as a per-stream callout and rewrites the body
/// through Envoy's buffers: the same pairs, bodies and answers.
#[test]
fn the_native_build_pairs_every_endpoint_correctly() {
    every_endpoint_pairs_correctly(true);
}

fn every_endpoint_pairs_correctly(native: bool) {
    let pd = pd_stack_on(2, 2, json!({}), native);
    let mut ports_seen = HashSet::new();
    let mut n = 0;
    for stream in [false, true] {
        for batch in [None, Some(3)] {
            let prompt = |i: usize| format!("case {n} item {i}: {}", "words ".repeat(40));
            let text: Value = match batch {
                None => json!(prompt(0)),
                Some(k) => json!((0..k).map(prompt).collect::<Vec<_>>()),
            };
            let mut cases = vec![
                // A client's rid, a prefix of every rid the gateway makes: replaced on both legs.
                (
                    "/generate",
                    json!({"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 3},
                                     "rid": batch.map_or(json!("kvmesh-"), |k| json!(vec!["kvmesh-"; k]))}),
                ),
                ("/v1/completions", json!({"prompt": text, "stream": stream, "max_tokens": 3})),
            ];
            if batch.is_none() {
                cases.push((
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": prompt(0)}], "stream": stream, "max_tokens": 3}),
                ));
            }
            for (path, body) in cases {
                n += 1;
                let id = format!("req-{n}");
                let r = send(&pd, path, &body, &id);
                let (prefill, decode) = legs(&r);
                let text = r.text();
                if stream {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{path}: {text}");
                } else {
                    let v = r.json().unwrap();
                    let items = if batch.is_some() && path == "/generate" { v.as_array().unwrap().len() } else { 1 };
                    assert_eq!(items, if path == "/generate" { batch.unwrap_or(1) } else { 1 }, "{v}");
                }
                let received = assert_same_bootstrap(
                    &pd,
                    &prefill,
                    &decode,
                    &id,
                    if path == "/v1/chat/completions" { None } else { batch },
                );
                ports_seen.insert(if batch.is_some() {
                    received["bootstrap_port"][0].clone()
                } else {
                    received["bootstrap_port"].clone()
                });
            }
        }
    }
    assert!(ports_seen.contains(&Value::Null), "a `none` bootstrap port is sent as null: {ports_seen:?}");
    assert!(ports_seen.iter().any(Value::is_u64), "a configured bootstrap port is sent as a number: {ports_seen:?}");
}

fn tags(logprobs: &Value) -> Vec<String> {
    logprobs.as_array().unwrap().iter().map(|e| e[2].as_str().unwrap().to_string()).collect()
}

/// The prefill's entries for every prompt token, then the decode's.
fn assert_merged(logprobs: &Value) {
    let tags = tags(logprobs);
    let (last, prefill) = tags.split_last().unwrap();
    assert!(!prefill.is_empty());
    for (i, t) in prefill.iter().enumerate() {
        assert_eq!(t, &format!("p{i}"), "prefill logprobs first, in order: {tags:?}");
    }
    assert_eq!(last, &format!("d{}", prefill.len() - 1), "then the decode's: {tags:?}");
}

#[test]
fn input_logprobs_of_the_prefill_come_first_in_json_and_sse() {
    logprobs_merge(false);
}

/// The native build holds the decode response until the prefill's callout answers, then
/// rewrites it (JSON at its end, SSE event by event).
#[test]
fn the_native_build_merges_the_prefill_logprobs_in_json_and_sse() {
    logprobs_merge(true);
}

fn logprobs_merge(native: bool) {
    let pd = pd_stack_on(1, 1, json!({}), native);
    let single =
        json!({"text": "The quick brown fox jumps", "return_logprob": true, "sampling_params": {"max_new_tokens": 2}});
    let r = send(&pd, "/generate", &single, "lp-1");
    legs(&r);
    assert_merged(&r.json().unwrap()["meta_info"]["input_token_logprobs"]);

    let batch = json!({"text": ["first prompt here", "a second, longer prompt here", "third"], "return_logprob": true, "sampling_params": {"max_new_tokens": 2}});
    let r = send(&pd, "/generate", &batch, "lp-2");
    legs(&r);
    let items = r.json().unwrap();
    assert_eq!(items.as_array().unwrap().len(), 3);
    let lens: Vec<usize> = items
        .as_array()
        .unwrap()
        .iter()
        .map(|it| {
            assert_merged(&it["meta_info"]["input_token_logprobs"]);
            tags(&it["meta_info"]["input_token_logprobs"]).len()
        })
        .collect();
    assert!(lens[0] != lens[1], "each item got its own prefill logprobs: {lens:?}");

    for (id, body) in [("lp-3", single.clone()), ("lp-4", batch.clone())] {
        let mut body = body;
        body["stream"] = json!(true);
        let mut s = http::post_streaming(&pd.envoy.url("/generate"), &body).unwrap();
        assert_eq!(s.status, 200, "{id}");
        let events = s.events().unwrap();
        let data: Vec<Value> =
            events.iter().filter(|e| e.data != "[DONE]").map(|e| serde_json::from_str(&e.data).unwrap()).collect();
        assert!(!data.is_empty());
        for e in &data {
            assert_merged(&e["meta_info"]["input_token_logprobs"]);
        }
        let indexes: HashSet<u64> = data.iter().map(|e| e["index"].as_u64().unwrap()).collect();
        assert_eq!(indexes.len(), if id == "lp-4" { 3 } else { 1 });
    }
}

/// Decode legs go to the less loaded of two decode workers (`power_of_two`, PD's default), and
/// the shared prefix keeps its prefill worker.
#[test]
fn shared_prefixes_keep_their_prefill_worker_while_decode_spreads() {
    let prefill = [fast_prefill(), fast_prefill()];
    // Decode workers that stream for many seconds: every request sent below stays in flight.
    let slow = ["--time-scale", "1", "--decode-ms-per-token", "20", "--batch-slowdown", "0"];
    let decode: Vec<Sim> = (0..2).map(|_| Sim::decode(&slow).unwrap()).collect();
    let mut opts = pd_options(
        json!({
            "prefill": prefill.iter().map(|p| json!([p.url(), p.bootstrap_port])).collect::<Vec<_>>(),
            "decode": decode.iter().map(Sim::url).collect::<Vec<_>>(),
        }),
        false,
    );
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    let system = "You are a code reviewer. Be specific and cite line numbers. ".repeat(20);
    let mut prefills = HashSet::new();
    let mut held = Vec::new();
    // In each pair the first request finds both decode workers equally loaded, the second
    // finds the first's worker one request ahead and must go to the other. Random choices
    // would pass all 14 pairs with probability 2^-14 = 6.1e-5.
    for pair in 0..14 {
        let mut decodes = Vec::new();
        for i in [2 * pair, 2 * pair + 1] {
            let body = json!({"text": format!("{system}Review change {i}."), "stream": true,
                              "sampling_params": {"max_new_tokens": 2000}});
            let s = http::post_streaming(&envoy.url("/generate"), &body).unwrap();
            assert_eq!(s.status, 200, "request {i}");
            prefills.insert(s.header("x-kvmesh-prefill").expect("a prefill leg").to_string());
            decodes.push(s.header("x-kvmesh-worker").expect("a decode worker").to_string());
            held.push(s);
        }
        assert_ne!(decodes[0], decodes[1], "pair {pair}: the second went to the more loaded decode worker");
    }
    assert_eq!(prefills.len(), 1, "{prefills:?}");
    // Every request after the first found the shared prompt on its prefill worker.
    assert_eq!(envoy.filter_stat("sgl_router_pd_cache_hits_total"), 27);
    assert_eq!(envoy.filter_stat("sgl_router_pd_cache_misses_total"), 1);
}

fn assert_prefill_error(r: &Response, prefill: &str) {
    assert_eq!(r.status, 502, "{}", r.text());
    let v = r.json().unwrap();
    assert_eq!(v["error"]["code"], "prefill_failed");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(prefill), "{msg} names {prefill}");
}

#[test]
fn a_dead_prefill_worker_gives_502_then_is_avoided() {
    dead_prefill_worker(false);
}

/// The native build's callout to a dead prefill worker fails in its `http_callout_done` hook:
/// the same 502, the same breaker.
#[test]
fn the_native_build_answers_a_dead_prefill_worker_with_502_then_avoids_it() {
    dead_prefill_worker(true);
}

fn dead_prefill_worker(native: bool) {
    let live = fast_prefill();
    let decode = fast_decode(None);
    let dead = format!("127.0.0.1:{}", free_port().unwrap());
    let filter = json!({
        "prefill": [[live.url(), live.bootstrap_port], [format!("http://{dead}"), 1]],
        "decode": [decode.url()],
        "prefill_policy": "round_robin",
        "cb_failure_threshold": 1,
    });
    let mut opts = pd_options(filter, native);
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();

    let mut failures = 0;
    for i in 0..8 {
        let r = generate(&envoy, &format!("prompt {i}"));
        if r.status == 200 {
            assert_eq!(r.header("x-kvmesh-prefill"), Some(live.addr().as_str()));
        } else {
            // The gateway's own answer for the prefill leg (not the decode worker's, whose
            // bootstrap fetch from the dead worker fails too).
            assert_prefill_error(&r, &dead);
            assert_eq!(r.header("x-sim-worker"), None, "{}", r.text());
            failures += 1;
        }
    }
    assert_eq!(failures, 1, "after one failure the dead prefill worker is out of rotation");
}

#[test]
fn a_failing_prefill_worker_gives_502_naming_it() {
    let failing = Sim::prefill(&["--time-scale", "0", "--fail-rate", "1"]).unwrap();
    // The decode leg would wait a minute for the KV the failed prefill never publishes.
    let decode = Sim::decode(&["--time-scale", "0", "--bootstrap-timeout-ms", "60000"]).unwrap();
    let filter = json!({"prefill": [[failing.url(), failing.bootstrap_port]], "decode": [decode.url()]});
    let envoy = Envoy::start(&pd_options(filter, false)).unwrap();
    let started = Instant::now();
    let r = http::post_json(&envoy.url("/generate"), &json!({"text": "hello", "stream": true})).unwrap();
    assert_prefill_error(&r, &failing.addr());
    assert!(r.json().unwrap()["error"]["message"].as_str().unwrap().contains("500"));
    assert!(started.elapsed() < HANG, "answered after {:?}: it waited for the decode leg", started.elapsed());
}

#[test]
fn bad_bodies_are_refused_before_any_worker_sees_them() {
    let pd = pd_stack(1, 1, json!({}));
    let url = pd.envoy.url("/generate");
    let r = http::post(&url, b"text=hello", &[]).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json().unwrap()["error"]["message"].as_str().unwrap().contains("not valid JSON"));
    let r = http::post_json(&url, &json!({"text": ["a", "b", "c"], "sampling_params": [{}, {}]})).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json().unwrap()["error"]["message"].as_str().unwrap().contains("`sampling_params`"));
    let r = http::post_json(&pd.envoy.url("/v1/completions"), &json!({"prompt": ["a", "b"], "rid": ["x"]})).unwrap();
    assert_eq!(r.status, 400);
    for sim in pd.prefill.iter().map(|(s, _)| s).chain(&pd.decode) {
        assert_eq!(sim.stats().unwrap()["requests"], 0, "{} saw a bad request", sim.addr());
    }
    // And the gateway still serves.
    legs(&http::post_json(&url, &json!({"text": "fine"})).unwrap());
}

/// PD mode with static workers: one live prefill worker, and decode workers at `decodes`
/// (URLs; dead ones are free ports nobody listens on). One Envoy thread.
fn pd_with(prefill: &Sim, decodes: &[String]) -> Envoy {
    let filter = json!({
        "prefill": [[prefill.url(), prefill.bootstrap_port]],
        "decode": decodes,
        "decode_policy": "round_robin",
    });
    let mut opts = pd_options(filter, false);
    opts.concurrency = 1;
    Envoy::start(&opts).unwrap()
}

#[test]
fn a_dead_decode_worker_is_failed_over_to_another_with_the_same_prefill() {
    let prefill = fast_prefill();
    let decode = fast_decode(None);
    let dead = format!("127.0.0.1:{}", free_port().unwrap());
    let envoy = pd_with(&prefill, &[decode.url(), format!("http://{dead}")]);
    for i in 0..6 {
        let r = generate_tokens(&envoy, &format!("pd prompt {i}"), 2);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvmesh-worker"), Some(decode.addr().as_str()), "the live decode worker answered");
        assert_eq!(r.header("x-kvmesh-prefill"), Some(prefill.addr().as_str()));
    }
    let failovers = envoy.filter_stat("kvmesh_failovers_total");
    assert!(failovers >= 1, "round robin sent some decode legs to the dead worker first");
}

#[test]
fn a_failed_decode_leg_ends_the_request_without_waiting_for_the_prefill() {
    // A prefill that takes minutes: 5 s per uncached token.
    let prefill = Sim::prefill(&["--time-scale", "1", "--prefill-us-per-token", "5000000"]).unwrap();
    let dead = format!("127.0.0.1:{}", free_port().unwrap());
    let envoy = pd_with(&prefill, &[format!("http://{dead}")]);
    let started = Instant::now();
    let body = json!({"text": "a prompt of some twenty tokens or so, long enough to keep the prefill busy"});
    let r = http::post_json(&envoy.url("/generate"), &body).unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.text().contains(&dead), "names the decode worker: {}", r.text());
    assert!(started.elapsed() < HANG, "waited {:?} for the prefill", started.elapsed());
    let in_flight = envoy.in_flight();
    wait_until("both legs off the in-flight table", Duration::from_secs(5), || envoy.in_flight() == Some(0))
        .unwrap_or_else(|e| panic!("{e}: {in_flight:?}"));
}

/// A prefill worker killed while its legs are in flight: those requests fail fast with a JSON
/// 502 naming it (never a hang, never a decode answer without its KV); once its breaker is
/// open, every request is served by the other prefill worker.
#[test]
fn a_prefill_worker_dying_between_the_legs_fails_fast_then_is_avoided() {
    // Prefill takes ~1 s (5 ms per uncached token), so legs are in flight when it dies.
    let mut slow = Sim::prefill(&["--time-scale", "1", "--prefill-us-per-token", "5000"]).unwrap();
    let slow_boot = slow.bootstrap_port.unwrap();
    let other = fast_prefill();
    // A decode worker would wait a minute for a KV that never comes.
    let decode = Sim::decode(&["--time-scale", "0", "--bootstrap-timeout-ms", "60000"]).unwrap();
    let filter = json!({
        "prefill": [[slow.url(), slow_boot], [other.url(), other.bootstrap_port]],
        "decode": [decode.url()],
        "prefill_policy": "round_robin",
        "cb_failure_threshold": 2,
    });
    let envoy = Envoy::start(&pd_options(filter, false)).unwrap();
    let url = envoy.url("/generate");
    let prompt = |i: usize| json!({"text": format!("{i} {}", "words to prefill ".repeat(40)), "sampling_params": {"max_new_tokens": 2}});
    // Requests in flight on both prefill workers.
    let inflight: Vec<_> = (0..6)
        .map(|i| {
            let (url, body) = (url.clone(), prompt(i));
            std::thread::spawn(move || http::post_json(&url, &body).unwrap())
        })
        .collect();
    wait_until("legs in flight on the slow prefill worker", Duration::from_secs(10), || {
        slow.stats().is_ok_and(|s| s["running"].as_u64().unwrap_or(0) + s["waiting"].as_u64().unwrap_or(0) > 0)
    })
    .unwrap();
    let killed = Instant::now();
    slow.proc().kill();
    let mut failed = 0;
    for t in inflight {
        let r = t.join().unwrap();
        if r.status != 200 {
            // Whichever leg notices first: the gateway's 502 naming the prefill worker, or the
            // decode worker's own error (it could not fetch the KV from that prefill worker).
            if r.status == 502 {
                assert_prefill_error(&r, &slow.addr());
            } else {
                let bootstrap = format!("{}:{slow_boot}", slow.host);
                assert!(r.status >= 500 && r.text().contains(&bootstrap), "{} {}", r.status, r.text());
            }
            failed += 1;
        }
    }
    assert!(failed >= 1, "some legs were on the killed worker");
    assert!(killed.elapsed() < HANG, "the failed requests ended only {:?} after the kill", killed.elapsed());
    // Its breaker opens after two failures (some may still be needed: the legs in flight may
    // have failed on the decode side first); then the other prefill worker serves all.
    let mut served_after = 0;
    let mut failed_after = Vec::new();
    for i in 0..40 {
        let r = http::post_json(&url, &prompt(100 + i)).unwrap();
        if r.status == 200 {
            assert_eq!(r.header("x-kvmesh-prefill"), Some(other.addr().as_str()));
            served_after += 1;
        } else {
            assert_prefill_error(&r, &slow.addr());
            failed_after.push(i);
        }
    }
    // (Each Envoy thread sees another's breaker change on its next 20 ms tick.)
    assert!(failed_after.iter().all(|&i| i < 10), "failed later: {failed_after:?}");
    assert!(served_after >= 35, "{served_after} of 40 served once the dead prefill worker was left");
}

/// Polls a sim's `/sim/stats` until nothing is in progress there, for at most [`HANG`]: far
/// longer than a stopped leg takes to notice, far shorter than either worker's own timeout.
fn settles(sim: &Sim) -> Result<(), String> {
    wait_until("the worker to have nothing in progress", HANG, || {
        sim.stats().ok().and_then(|s| s["in_progress"].as_u64()) == Some(0)
    })
    .map_err(|e| e.to_string())
}

/// A failed leg takes the other one down with it: a prefill that fails leaves no decode
/// waiting for its KV (the decode stream is reset), and a decode that fails leaves no prefill
/// computing a KV nobody will fetch (the gateway sends `/abort_request`: Envoy does not cancel
/// a Wasm callout when its stream ends) — long before either worker's own timeout.
#[test]
fn a_failed_leg_leaves_nothing_behind_on_the_other_side() {
    failed_leg(false);
}

/// The native build's `/abort_request` goes out from the main thread: a stream's own callout
/// would be cancelled as the request ends, before it reached the prefill worker.
#[test]
fn the_native_build_aborts_the_prefill_leg_of_a_failed_request() {
    failed_leg(true);
}

fn failed_leg(native: bool) {
    // Under the native conformance run every Envoy is the native build, this case's too.
    let native = native || kvmesh_testkit::envoy::native_conformance().is_some();
    let start = |prefill: &[&str], decode: &[&str]| {
        let p = Sim::prefill(prefill).unwrap();
        let boot = p.bootstrap_port.unwrap().to_string();
        let d = Sim::decode(&[decode, &["--default-bootstrap-port", &boot]].concat()).unwrap();
        let envoy = Envoy::start(&pd_options(json!({"prefill": [[p.url(), null]], "decode": [d.url()]}), native));
        (p, d, envoy.unwrap())
    };
    let body = json!({"text": "tell me a story ".repeat(200), "sampling_params": {"max_new_tokens": 4}}).to_string();
    let send = |envoy: &Envoy, id: &str| {
        let headers = [("content-type", "application/json"), ("x-request-id", id)];
        http::post(&envoy.url("/generate"), body.as_bytes(), &headers).unwrap()
    };
    // The prefill computes for 80 s (800 tokens at 100 ms) unless stopped.
    let slow_prefill = ["--time-scale", "1", "--prefill-us-per-token", "100000"];

    // The prefill fails mid-computation (aborted at the worker, whose bootstrap server stays
    // up) while the decode waits (up to 30 s) for a KV that will never be published.
    let (prefill, decode, envoy) = start(&slow_prefill, &["--time-scale", "0", "--bootstrap-timeout-ms", "30000"]);
    std::thread::scope(|scope| {
        let request = scope.spawn(|| send(&envoy, "fail-the-prefill"));
        wait_until("both legs under way", Duration::from_secs(10), || {
            [&prefill, &decode].iter().all(|s| s.stats().ok().and_then(|s| s["in_progress"].as_u64()) == Some(1))
        })
        .unwrap();
        // The rid is the gateway's own, not the client's x-request-id.
        let rid = rid_seen(&prefill, "fail-the-prefill");
        assert!(rid.starts_with("kvmesh-") && rid.len() == 28, "{rid}");
        let abort = format!("{}/abort_request", prefill.url());
        let r =
            http::post(&abort, json!({ "rid": rid }).to_string().as_bytes(), &[("content-type", "application/json")]);
        assert_eq!(r.unwrap().json().unwrap()["aborted"], true, "the prefill leg runs under that rid");
        let r = request.join().unwrap();
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(r.json().unwrap()["error"]["code"], "prefill_failed");
    });
    settles(&decode).unwrap();
    drop(envoy);

    // The decode fails at once.
    let (prefill, decode, envoy) = start(&slow_prefill, &["--time-scale", "0", "--fail-rate", "1"]);
    let r = send(&envoy, "fail-the-decode");
    assert!(r.status >= 500, "{} {}", r.status, r.text());
    let legs = || prefill.stats().ok().and_then(|s| s["requests"].as_u64());
    if native {
        // Envoy cancels a stream's own callouts when the stream ends: a decode that fails at
        // once can end the request before the prefill leg reached its worker (seen on a cold
        // CI run). Sent or not, nothing may be left computing there, and the abort still goes.
        assert!(legs().is_some_and(|n| n <= 1), "at most the one prefill leg: {:?}", legs());
    } else {
        // A Wasm callout outlives its stream: the prefill leg always arrives.
        wait_until("the prefill leg to arrive", Duration::from_secs(5), || legs() == Some(1)).unwrap();
    }
    settles(&prefill).unwrap();
    assert_eq!(envoy.filter_stat("kvmesh_prefill_aborts_total"), 1);
    // Stopping is not enough (the worker may have noticed its client go, and a leg that never
    // arrived has nothing to stop): the abort arrived, naming this request.
    let aborts = || -> Vec<Value> {
        let log = http::get(&format!("{}/sim/requests", prefill.url())).unwrap().json().unwrap();
        log.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["path"] == "/abort_request")
            .map(|r| r["body"]["rid"].clone())
            .collect()
    };
    wait_until("the prefill worker to receive /abort_request", Duration::from_secs(5), || !aborts().is_empty())
        .unwrap();
    // The decode leg got the same body, so the same rid, whether the prefill leg arrived or not.
    let rid = rid_seen(&decode, "fail-the-decode");
    assert_eq!(aborts(), vec![json!(rid)], "one abort, of the failed request, by the gateway's rid");
}

/// The seeds' other policies on the PD legs: `prefix_hash` keeps each session's prefill worker,
/// `consistent_hashing` its decode worker (by `x-session-id`), the bootstrap fields still pair
/// the legs; and the `prefix` decider still sees what a decode worker holds when that leg runs
/// `prefix_hash` (which indexes fewer blocks for its own scoring).
#[test]
fn prefix_hash_and_consistent_hashing_choose_the_legs_and_the_prefix_decider_still_works() {
    let pd = pd_stack(3, 3, json!({"prefill_policy": "prefix_hash", "decode_policy": "consistent_hashing"}));
    let mut prefill_of = std::collections::HashMap::new();
    let mut decode_of = std::collections::HashMap::new();
    // Twelve sessions: rendezvous hashing over three workers at random ports puts all of them
    // on one worker with probability 3^-11 (six sessions: 1 in 243, seen on a CI run).
    for turn in 0..3 {
        for s in 0..12 {
            let id = format!("ph-{s}-{turn}");
            let body = json!({
                "text": format!("Session {s}: {}Turn {turn}.", "Summarise the thread so far. ".repeat(60)),
                "sampling_params": {"max_new_tokens": 1},
            });
            let key = format!("session-{s}");
            let headers = [("x-request-id", id.as_str()), ("x-session-id", key.as_str())];
            let r = http::post(&pd.envoy.url("/generate"), body.to_string().as_bytes(), &headers).unwrap();
            let (p, d) = legs(&r);
            assert_same_bootstrap(&pd, &p, &d, &id, None);
            assert_eq!(prefill_of.entry(s).or_insert_with(|| p.clone()), &p, "session {s}: its prefill worker");
            assert_eq!(decode_of.entry(s).or_insert_with(|| d.clone()), &d, "session {s}: its decode worker");
        }
    }
    let keys_spread: HashSet<&String> = decode_of.values().collect();
    assert!(keys_spread.len() >= 2, "keys spread over the decode workers: {decode_of:?}");

    let pd = pd_stack(
        1,
        2,
        json!({"prefill_policy": "prefix_hash", "decode_policy": "prefix_hash", "pd_decider": "prefix",
               "non_cached_tokens": 8}),
    );
    // 4000 bytes: 125 blocks, far past the 32 prefix_hash scores on.
    let text = "Read the whole contract before answering. ".repeat(95);
    let first = send(&pd, "/generate", &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}), "dec-1");
    let (_, decode) = legs(&first);
    let again = format!("{text}Now?");
    let body = json!({"text": again, "sampling_params": {"max_new_tokens": 1}, "rid": "dec"});
    let r = send(&pd, "/generate", &body, "dec-2");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvmesh-prefill"), None, "the decode worker holds all but a few tokens: no prefill leg");
    assert_eq!(r.header("x-kvmesh-worker"), Some(decode.as_str()));
    let alone = pd.received(&decode, "dec-2");
    assert!(alone.get("bootstrap_room").is_none(), "run on the decode worker alone");
    // Alone too, the worker sees the gateway's rid, never the client's.
    assert!(alone["rid"].as_str().is_some_and(|rid| rid.starts_with("kvmesh-") && rid.len() == 28), "{alone}");
}

/// The `rid` worker `sim` received for the request the client sent as `x-request-id: id`.
fn rid_seen(sim: &Sim, id: &str) -> String {
    let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    let seen = log.as_array().unwrap().iter().rev().find(|r| r["x_request_id"] == id).cloned();
    let seen = seen.unwrap_or_else(|| panic!("{} saw no request {id}: {log}", sim.addr()));
    seen["body"]["rid"].as_str().unwrap_or_else(|| panic!("no rid: {seen}")).to_string()
}
