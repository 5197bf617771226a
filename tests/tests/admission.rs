//! The concurrency limit and its queue (sglang-router's `--max-concurrent-requests`,
//! `--queue-size`, `--queue-timeout-secs`, `--rate-limit-tokens-per-second`) through the real
//! Envoy and the real `.wasm`: past the limit a request waits in the filter's queue and is
//! routed when a slot comes back; a full queue answers 429, a wait past the timeout 408. The
//! limit is exact across Envoy's threads: the bucket's refill never admits past it.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{fast_prefill, pd_options, post_in_thread, DECODE_20MS, HANG};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

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

/// Starts a long request and returns once it holds the only token.
fn hold_the_token(envoy: &Envoy, url: &str, tokens: u32) -> JoinHandle<(Response, Instant)> {
    let long = post_in_thread(url, body("the long one", tokens));
    wait_until("the long request in flight", Duration::from_secs(10), || envoy.in_flight() == Some(1)).unwrap();
    long
}

#[test]
fn past_the_limit_a_request_waits_in_the_queue_and_past_the_queue_a_429() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let envoy = Envoy::start(&EnvoyOptions::new(limited(json!([sim.url()]), 1, 30)).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let long = hold_the_token(&envoy, &url, 100);
    // Two at once: one takes the only place in the queue (where it is seen waiting), the
    // other finds it full.
    let others: Vec<_> = (0..2).map(|i| post_in_thread(&url, body(&format!("short {i}"), 1))).collect();
    envoy.wait_for_queued(1);
    let mut results: Vec<(Response, Instant)> = others.into_iter().map(|h| h.join().unwrap()).collect();
    results.sort_by_key(|(r, _)| r.status);
    let (served, full) = (&results[0], &results[1]);
    assert_eq!(full.0.status, 429, "{}", full.0.text());
    assert_eq!(full.0.json().unwrap()["error"]["code"], "too_many_requests");
    assert_eq!(full.0.header("retry-after"), Some("1"));
    assert_eq!(served.0.status, 200, "{}", served.0.text());
    let (long, long_done) = long.join().unwrap();
    assert_eq!(long.status, 200);
    // A full queue answers at once: before the queued request got the slot (the long
    // request's end at 2 s) and before the long request ended.
    assert!(full.1 < served.1 && full.1 < long_done, "the 429 came after a token was back");
    let r = http::post_json(&url, &body("room again", 1)).unwrap();
    assert_eq!(r.status, 200, "tokens come back: {}", r.text());
    assert_eq!(envoy.filter_stat("kvmesh_queued"), 0);
    assert_eq!(sim.stats().unwrap()["requests"], 3, "the refused request never reached the worker");
}

#[test]
fn a_request_waiting_past_the_queue_timeout_gets_a_json_408() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let envoy = Envoy::start(&EnvoyOptions::new(limited(json!([sim.url()]), 8, 1)).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let long = hold_the_token(&envoy, &url, 200);
    // Three wait; the long request holds the only slot for 4 s (the refill frees none), so
    // all of them time out.
    let waiting: Vec<_> = (0..3).map(|i| post_in_thread(&url, body(&format!("waiting {i}"), 100))).collect();
    envoy.wait_for_queued(3);
    let results: Vec<(Response, Instant)> = waiting.into_iter().map(|h| h.join().unwrap()).collect();
    let timed_out: Vec<_> = results.iter().filter(|(r, _)| r.status == 408).collect();
    assert!(timed_out.len() == 3, "statuses {:?}", results.iter().map(|(r, _)| r.status).collect::<Vec<_>>());
    let (long, long_done) = long.join().unwrap();
    assert_eq!(long.status, 200);
    for (r, done) in &timed_out {
        assert_eq!(r.json().unwrap()["error"]["code"], "queue_timeout", "{}", r.text());
        // The timeout, not a token, ended its wait: the long request (4 s) still held its token.
        assert!(*done < long_done, "the 408 came after the long request ended");
    }
    assert!(results.iter().all(|(r, _)| r.status == 408 || r.status == 200));
    assert_eq!(sim.stats().unwrap()["requests"], 1, "the timed-out ones never reached the worker");
}

/// In PD mode a request admitted from the queue sends its prefill leg from the root context's
/// tick; the answer must still reach the request (else it would hang until its timeout).
#[test]
fn pd_requests_admitted_from_the_queue_complete_both_legs() {
    let prefill = fast_prefill();
    let boot = prefill.bootstrap_port.unwrap().to_string();
    let decode = Sim::decode(&[DECODE_20MS, &["--default-bootstrap-port", &boot]].concat()).unwrap();
    let mut filter = limited(json!([]), 8, 30);
    filter.as_object_mut().unwrap().remove("worker_urls");
    filter["prefill"] = json!([[prefill.url(), null]]);
    filter["decode"] = json!([decode.url()]);
    let envoy = Envoy::start(&pd_options(filter, false)).unwrap();
    let url = envoy.url("/generate");
    let started = Instant::now();
    let long = hold_the_token(&envoy, &url, 60);
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

/// sglang-router's own e2e test `test_rate_limit_queue_and_timeout`, against a fresh Envoy with
/// four worker threads each round: a limit of 1, a queue of 1, a 1 s queue timeout, and four
/// requests at once to a worker that takes 2 s. Exactly one runs; the one that waits times out
/// (the running one holds the only slot for 2 s), the rest find the queue full. Rounds:
/// `KVMESH_ADMISSION_ROUNDS` (default 2; the check ran 20).
#[test]
fn one_slot_one_place_in_the_queue_four_requests_on_four_threads_run_after_run() {
    let rounds: usize = std::env::var("KVMESH_ADMISSION_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let sim = Sim::start(DECODE_20MS).unwrap();
    let mut failed = Vec::new();
    for round in 0..rounds {
        let mut filter = limited(json!([sim.url()]), 1, 1);
        // sglang-router's default refill: the limit's size per second.
        filter.as_object_mut().unwrap().remove("rate_limit_tokens_per_second");
        let mut opts = EnvoyOptions::new(filter).unwrap();
        opts.concurrency = 4;
        let envoy = Envoy::start(&opts).unwrap();
        let url = envoy.url("/generate");
        let before = sim.stats().unwrap()["requests"].as_u64().unwrap_or(0);
        // 100 tokens at 20 ms: 2 s each, as the peer's `--latency-ms 2000` worker.
        let gate = std::sync::Arc::new(std::sync::Barrier::new(4));
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let (url, gate) = (url.clone(), std::sync::Arc::clone(&gate));
                std::thread::spawn(move || {
                    gate.wait();
                    http::post_json(&url, &body(&format!("q{i}"), 100)).map(|r| r.status).unwrap_or(599)
                })
            })
            .collect();
        let mut statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        statuses.sort_unstable();
        let reached = sim.stats().unwrap()["requests"].as_u64().unwrap_or(0) - before;
        // The peer's assertions, and exactly one reached the worker.
        let non_200: Vec<u16> = statuses.iter().copied().filter(|&s| s != 200).collect();
        let ok = statuses.contains(&200)
            && statuses.contains(&408)
            && non_200.len() >= 2
            && non_200.iter().all(|s| [408, 429].contains(s))
            && reached == 1;
        eprintln!("round {round}: {statuses:?}, {reached} reached the worker");
        if !ok {
            failed.push((round, statuses, reached));
        }
    }
    assert!(failed.is_empty(), "{} of {rounds} rounds failed: {failed:?}", failed.len());
}
