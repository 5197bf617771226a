//! The concurrency limit and its queue (sglang-router's `--max-concurrent-requests`,
//! `--queue-size`, `--queue-timeout-secs`, `--rate-limit-tokens-per-second`) through the real
//! Envoy and the real `.wasm`: past the limit a request waits in the filter's queue and is
//! routed when a token comes back; a full queue answers 429, a wait past the timeout 408.
//!
//! The bucket refills at `rate-limit-tokens-per-second` (at least 1 per second), so a waiting
//! request may also get in through the refill: the assertions hold either way.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{free_port, repo_root, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

/// A 20 ms-per-token worker, so that `max_new_tokens` sets how long a request holds its token.
fn slow_sim() -> Sim {
    Sim::start(&["--time-scale", "1", "--decode-ms-per-token", "20", "--batch-slowdown", "0"]).unwrap()
}

fn limited(workers: Value, queue_size: u32, queue_timeout_secs: u32) -> Value {
    json!({
        "worker_urls": workers,
        "max_concurrent_requests": 1,
        "rate_limit_tokens_per_second": 1,
        "queue_size": queue_size,
        "queue_timeout_secs": queue_timeout_secs,
    })
}

fn body(text: &str, tokens: u32) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": tokens}})
}

/// Sends in a thread; returns the response and how long the client waited.
fn spawn(url: &str, body: Value) -> JoinHandle<(Response, Duration)> {
    let url = url.to_string();
    std::thread::spawn(move || {
        let started = Instant::now();
        let r = http::post_json(&url, &body).unwrap();
        (r, started.elapsed())
    })
}

/// What the client waited beyond the worker's own time (`meta_info.e2e_latency`).
fn waited(r: &Response, client: Duration) -> Duration {
    let server = r.json().ok().and_then(|v| v["meta_info"]["e2e_latency"].as_f64()).unwrap_or(0.0);
    client.saturating_sub(Duration::from_secs_f64(server))
}

/// Starts a long request and returns once it holds the only token.
fn hold_the_token(envoy: &Envoy, url: &str, tokens: u32) -> JoinHandle<(Response, Duration)> {
    let long = spawn(url, body("the long one", tokens));
    wait_until("the long request in flight", Duration::from_secs(10), || {
        envoy.stat("wasmcustom.kvmesh_in_flight").ok().flatten() == Some(1)
    })
    .unwrap();
    long
}

#[test]
fn past_the_limit_a_request_waits_in_the_queue_and_past_the_queue_a_429() {
    let sim = slow_sim();
    let envoy = Envoy::start(&EnvoyOptions::new(limited(json!([sim.url()]), 1, 30)).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let long = hold_the_token(&envoy, &url, 100);
    // Two at once: one takes the only place in the queue, the other finds it full.
    let others: Vec<_> = (0..2).map(|i| spawn(&url, body(&format!("short {i}"), 1))).collect();
    let mut results: Vec<(Response, Duration)> = others.into_iter().map(|h| h.join().unwrap()).collect();
    results.sort_by_key(|(r, _)| r.status);
    let (served, full) = (&results[0], &results[1]);
    assert_eq!(full.0.status, 429, "{}", full.0.text());
    assert_eq!(full.0.json().unwrap()["error"]["code"], "too_many_requests");
    assert_eq!(full.0.header("retry-after"), Some("1"));
    assert!(full.1 < Duration::from_millis(900), "a full queue answers at once, took {:?}", full.1);
    assert_eq!(served.0.status, 200, "{}", served.0.text());
    // It waited for the token: the refill (1 s) or the long request's end (2 s), whichever first.
    let w = waited(&served.0, served.1);
    assert!(w >= Duration::from_millis(700), "the queued request waited only {w:?}");
    assert_eq!(long.join().unwrap().0.status, 200);
    let r = http::post_json(&url, &body("room again", 1)).unwrap();
    assert_eq!(r.status, 200, "tokens come back: {}", r.text());
    assert_eq!(envoy.stat("wasmcustom.kvmesh_queued").unwrap(), Some(0));
}

#[test]
fn a_request_waiting_past_the_queue_timeout_gets_a_json_408() {
    let sim = slow_sim();
    let envoy = Envoy::start(&EnvoyOptions::new(limited(json!([sim.url()]), 8, 1)).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let long = hold_the_token(&envoy, &url, 200);
    // Three wait; the refill lets at most one in per second, and the one let in holds its token
    // for 2 s (a short one would give it back at once to the next in line), so at least two
    // time out.
    let waiting: Vec<_> = (0..3).map(|i| spawn(&url, body(&format!("waiting {i}"), 100))).collect();
    let results: Vec<(Response, Duration)> = waiting.into_iter().map(|h| h.join().unwrap()).collect();
    let timed_out: Vec<_> = results.iter().filter(|(r, _)| r.status == 408).collect();
    assert!(timed_out.len() >= 2, "statuses {:?}", results.iter().map(|(r, _)| r.status).collect::<Vec<_>>());
    for (r, took) in &timed_out {
        assert_eq!(r.json().unwrap()["error"]["code"], "queue_timeout", "{}", r.text());
        assert!(*took >= Duration::from_millis(950) && *took < Duration::from_secs(3), "408 after {took:?}");
    }
    assert!(results.iter().all(|(r, _)| r.status == 408 || r.status == 200));
    assert!(sim.stats().unwrap()["requests"].as_u64().unwrap_or(0) <= 2, "the timed-out ones never reached the worker");
    assert_eq!(long.join().unwrap().0.status, 200);
}

/// In PD mode a request admitted from the queue sends its prefill leg from the root context's
/// tick; the answer must still reach the request (else it would hang until its timeout).
#[test]
fn pd_requests_admitted_from_the_queue_complete_both_legs() {
    let boot = free_port().unwrap();
    let prefill =
        Sim::start(&["--role", "prefill", "--bootstrap-port", &boot.to_string(), "--time-scale", "0"]).unwrap();
    let decode = Sim::start(&[
        "--role",
        "decode",
        "--time-scale",
        "1",
        "--decode-ms-per-token",
        "20",
        "--batch-slowdown",
        "0",
        "--default-bootstrap-port",
        &boot.to_string(),
    ])
    .unwrap();
    let mut filter = limited(json!([]), 8, 30);
    filter.as_object_mut().unwrap().remove("worker_urls");
    filter["prefill"] = json!([[prefill.url(), null]]);
    filter["decode"] = json!([decode.url()]);
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let long = hold_the_token(&envoy, &url, 60);
    let waiting: Vec<_> = (0..2).map(|i| spawn(&url, body(&format!("queued pd {i}"), 1))).collect();
    for h in waiting {
        let (r, took) = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvmesh-prefill"), Some(prefill.addr().as_str()));
        assert!(waited(&r, took) >= Duration::from_millis(700), "it waited in the queue");
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
    assert_eq!(long.join().unwrap().0.status, 200);
    assert_eq!(prefill.stats().unwrap()["requests"].as_u64(), Some(3), "one prefill leg each");
}
