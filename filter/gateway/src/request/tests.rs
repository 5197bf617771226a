use super::*;
use crate::host::mock::MockHost;
use crate::host::VmHost;
use crate::shared::Inflight;
use kvmesh_core::Config;
use std::collections::HashSet;

mod calls;
mod hygiene;

const REGULAR: &str = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"]}"#;
const PD: &str = r#"{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998]],
    "decode":["http://127.0.0.1:30003"],"cb_failure_threshold":1}"#;

fn gateway(host: &MockHost, json: &str) -> Rc<RefCell<Gateway>> {
    Rc::new(RefCell::new(Gateway::new(Config::from_json(json.as_bytes()).unwrap(), host, 9)))
}

/// Runs the request side of a POST through a fresh filter.
fn send(host: &MockHost, gw: &Rc<RefCell<Gateway>>, path: &str, body: &str) -> (RequestFilter, Action) {
    host.request(
        "POST",
        path,
        &[("x-request-id", "rq-7"), ("content-length", &body.len().to_string())],
        body.as_bytes(),
    );
    let mut f = RequestFilter::new(Some(Rc::clone(gw)));
    assert_eq!(f.on_request_headers(host, false), Action::Pause, "LLM paths wait for the body");
    assert_eq!(f.on_request_body(host, body.len() / 2, false), Action::Pause, "buffered until the end");
    let action = f.on_request_body(host, body.len(), true);
    (f, action)
}

/// The shared counts once the gateway wrote what ended (as its next commit or tick does).
fn counts(host: &MockHost, gw: &Rc<RefCell<Gateway>>) -> Vec<crate::shared::Counts> {
    gw.borrow_mut().write_ended(host);
    Inflight::counts(host)
}

fn inflight(host: &MockHost, gw: &Rc<RefCell<Gateway>>) -> u32 {
    counts(host, gw).iter().map(|c| c.in_flight).sum()
}

#[test]
fn a_regular_request_is_routed_counted_and_released() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    let (mut f, action) = send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    assert_eq!(action, Action::Continue);
    let dst = host.request_header(DST_HEADER).unwrap();
    assert!(dst == "127.0.0.1:30001" || dst == "127.0.0.1:30002");
    assert_eq!(inflight(&host, &gw), 1);
    assert_eq!(host.metric_sum(Metric::Requests), 1);
    assert_eq!(host.metric_count(Metric::DecisionNs), 1);
    host.set_response(200, b"{}");
    assert_eq!(f.on_response_headers(&host), Action::Continue);
    assert_eq!(host.response_header(WORKER_HEADER).as_deref(), Some(dst.as_str()));
    f.on_log(&host);
    assert_eq!(inflight(&host, &gw), 0);
    assert_eq!(counts(&host, &gw)[0].finished, 1);
}

/// Not a test: the whole request path in a loop, for a native profile
/// (`perf record` on `cargo test -p kvmesh-gateway --release --lib profile_ -- --ignored`),
/// with the overhead benchmark's request stream and four workers.
#[test]
#[ignore]
fn profile_the_request_path() {
    let host = MockHost::new();
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let urls: Vec<String> = (0..env("PROFILE_WORKERS", 4)).map(|i| format!("http://127.0.0.1:{}", 30001 + i)).collect();
    let gw = gateway(&host, &serde_json::json!({ "worker_urls": urls }).to_string());
    // The Envoy's only VM, as in the benchmarks' one-thread Envoy.
    gw.borrow_mut().ledger_mut().serve(&host, 0);
    gw.borrow_mut().heartbeat(&host, 1_000);
    gw.borrow_mut().heartbeat(&host, 2_000);
    let repeat = env("PROFILE_PROMPT_REPEAT", 20);
    // No cached_tokens: engine feedback judges nothing (a steady index, as with a worker whose
    // reports match the prediction).
    let resp = br#"{"text":"x","meta_info":{"prompt_tokens":300,"completion_tokens":1,"e2e_latency":0.001}}"#;
    let n: usize = std::env::var("PROFILE_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let bodies: Vec<(String, String)> = (0..4096)
        .map(|i| {
            let group = i % 16;
            let system = format!("System prompt {group}: you are assistant number {group}. ").repeat(repeat);
            let text = format!("{system}Question {i}: what is {i} squared?");
            let body = serde_json::json!({"text": text, "sampling_params": {"max_new_tokens": 1}}).to_string();
            let len = body.len().to_string();
            (body, len)
        })
        .collect();
    let started = std::time::Instant::now();
    for i in 0..n {
        let (body, len) = &bodies[i % bodies.len()];
        host.request("POST", "/generate", &[("content-length", len), ("x-request-id", "r1")], body.as_bytes());
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        f.on_request_headers(&host, false);
        f.on_request_body(&host, body.len(), true);
        host.set_response(200, resp);
        *host.upstream.borrow_mut() = host.request_header(DST_HEADER);
        f.on_response_headers(&host);
        f.on_response_body(&host, resp.len(), true);
        f.on_log(&host);
        if i % 1000 == 0 {
            host.calls.borrow_mut().clear();
            host.metrics.borrow_mut().clear();
            host.now_ms.set(host.now_ms.get() + 20);
            gw.borrow_mut().feedback().flush(&host);
            gw.borrow_mut().write_ended(&host);
        }
    }
    eprintln!("{n} requests: {:.2} us each", started.elapsed().as_secs_f64() * 1e6 / n as f64);
}

/// A route that names the worker in the response (`route_sets_worker_header`): read from
/// the response headers, not asked of Envoy; trusted only when the configuration says so.
#[test]
fn the_worker_named_by_the_route_is_read_not_asked() {
    let three = r#""worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"]"#;
    for from_route in [true, false] {
        let host = MockHost::new();
        let gw = gateway(&host, &format!(r#"{{{three},"route_sets_worker_header":{from_route}}}"#));
        // Answered by the chosen worker.
        let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
        let dst = host.request_header(DST_HEADER).unwrap();
        let fallback = host.request_header(ENDPOINTS_HEADER).unwrap().split(',').nth(1).unwrap().to_string();
        host.set_response(200, b"{}");
        *host.upstream.borrow_mut() = Some(dst.clone());
        if from_route {
            host.response_headers.borrow_mut().push((WORKER_HEADER.into(), dst.clone()));
        } else {
            // A worker's own header means nothing without the route's promise.
            host.response_headers.borrow_mut().push((WORKER_HEADER.into(), fallback.clone()));
        }
        host.calls.borrow_mut().clear();
        f.on_response_headers(&host);
        let calls = host.calls.borrow().clone();
        let n = |name: &str| calls.iter().filter(|c| **c == name).count();
        assert_eq!(host.response_header(WORKER_HEADER), Some(dst.clone()), "from_route {from_route}");
        assert_eq!(host.metric_sum(Metric::Failovers), 0, "from_route {from_route}");
        let expected = if from_route { (0, 0) } else { (1, 1) };
        assert_eq!((n("upstream_address"), n("set_response_header")), expected, "{calls:?}");
        f.on_log(&host);
        // Envoy failed over, and the route says so.
        if from_route {
            let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"hello again"}"#);
            let dst = host.request_header(DST_HEADER).unwrap();
            let other = host.request_header(ENDPOINTS_HEADER).unwrap().split(',').nth(1).unwrap().to_string();
            host.set_response(200, b"{}");
            *host.upstream.borrow_mut() = None;
            host.response_headers.borrow_mut().push((WORKER_HEADER.into(), other.clone()));
            f.on_response_headers(&host);
            assert_ne!(dst, other);
            assert_eq!(host.metric_sum(Metric::Failovers), 1);
            assert_eq!(host.response_header(WORKER_HEADER), Some(other));
        }
    }
}

#[test]
fn envoy_gets_the_workers_to_fail_over_to_and_the_time_budget() {
    let host = MockHost::new();
    let three = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"],
        "request_timeout_secs":7}"#;
    let gw = gateway(&host, three);
    let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    let dst = host.request_header(DST_HEADER).unwrap();
    let list = host.request_header(ENDPOINTS_HEADER).unwrap();
    let listed: Vec<&str> = list.split(',').collect();
    assert_eq!(listed.len(), 3, "the chosen worker, then the two others: {list}");
    assert_eq!(listed[0], dst);
    assert_eq!(listed.iter().collect::<HashSet<_>>().len(), 3, "no worker twice");
    assert_eq!(host.request_header(RETRIES_HEADER).as_deref(), Some("2"));
    assert_eq!(host.request_header(TIMEOUT_HEADER).as_deref(), Some("7000"));
    // Envoy failed over: another worker answered. The chosen one is blamed, the answer's
    // worker is named, and the failover is counted.
    host.set_response(200, b"{}");
    *host.upstream.borrow_mut() = Some(listed[1].to_string());
    f.on_response_headers(&host);
    assert_eq!(host.response_header(WORKER_HEADER).as_deref(), Some(listed[1]));
    assert_eq!(host.metric_sum(Metric::Failovers), 1);
    f.on_log(&host);
    let counts = counts(&host, &gw);
    assert_eq!(counts.iter().map(|c| c.failed).sum::<u32>(), 1, "the chosen worker's attempt failed");
    assert_eq!(inflight(&host, &gw), 0);
    // Without retries: one worker, no failover.
    let host = MockHost::new();
    let gw =
        gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"],"disable_retries":true}"#);
    send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    assert_eq!(host.request_header(ENDPOINTS_HEADER), host.request_header(DST_HEADER));
    assert_eq!(host.request_header(RETRIES_HEADER).as_deref(), Some("0"));
}

/// `original_dst_header: false` (an `override_host` cluster reading the list alone): the
/// pick is written once, first in the list, and nothing else changes.
#[test]
fn the_pick_alone_is_written_only_for_clusters_that_read_it() {
    let three = r#""worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"]"#;
    for original_dst in [true, false] {
        let host = MockHost::new();
        let gw = gateway(&host, &format!(r#"{{{three},"original_dst_header":{original_dst}}}"#));
        host.calls.borrow_mut().clear();
        let (mut f, action) = send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
        assert_eq!(action, Action::Continue);
        let list = host.request_header(ENDPOINTS_HEADER).unwrap();
        let first = list.split(',').next().map(str::to_string);
        assert_eq!(list.split(',').count(), 3);
        assert_eq!(host.request_header(DST_HEADER), first.filter(|_| original_dst), "original_dst {original_dst}");
        let writes = host.calls.borrow().iter().filter(|c| **c == "set_request_header").count();
        assert_eq!(writes, if original_dst { 4 } else { 3 }, "{:?}", host.calls.borrow());
        assert_eq!(host.request_header(RETRIES_HEADER).as_deref(), Some("2"));
        assert!(host.request_header(TIMEOUT_HEADER).is_some());
        host.set_response(200, b"{}");
        f.on_response_headers(&host);
        f.on_log(&host);
        assert_eq!(inflight(&host, &gw), 0);
    }
    let bad = format!(r#"{{{three},"original_dst_header":"no"}}"#);
    let err = Config::from_json(bad.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("original_dst_header"), "{err}");
}

#[test]
fn a_worker_that_holds_requests_without_answering_is_passed_over() {
    let host = MockHost::new();
    let json = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"],"policy":"round_robin",
        "worker_stall_secs":2}"#;
    let gw = gateway(&host, json);
    let (_held, _) = send(&host, &gw, "/generate", r#"{"text":"a"}"#);
    let frozen = host.request_header(DST_HEADER).unwrap();
    host.advance_ms(2_500);
    // The frozen worker holds one request for 2.5 s: round robin skips it from now on.
    for _ in 0..4 {
        let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"b"}"#);
        assert_ne!(host.request_header(DST_HEADER).unwrap(), frozen);
        host.set_response(200, b"{}");
        f.on_response_headers(&host);
        f.on_log(&host);
    }
}

#[test]
fn client_routing_headers_are_dropped_and_never_pick_the_destination() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    let body = r#"{"text":"x"}"#;
    host.request(
        "POST",
        "/generate",
        &[(DST_HEADER, "10.9.9.9:80"), ("x-kvmesh-worker", "evil"), ("x-gateway-destination-endpoint", "1.1.1.1:1")],
        body.as_bytes(),
    );
    let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
    assert_eq!(f.on_request_headers(&host, false), Action::Pause);
    assert!(host.request_header("x-kvmesh-worker").is_none());
    assert!(host.request_header("x-gateway-destination-endpoint").is_none());
    assert!(host.request_header(DST_HEADER).is_none(), "removed before any decision");
    f.on_request_body(&host, body.len(), true);
    assert!(host.request_header(DST_HEADER).unwrap().starts_with("127.0.0.1:3000"));
}

#[test]
fn a_decision_that_cannot_be_applied_is_a_500_and_leaves_no_trace() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    let text = format!(r#"{{"text":"{}"}}"#, "k".repeat(300));
    host.refuse_headers.set(true);
    let (mut f, action) = send(&host, &gw, "/generate", &text);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.reply().unwrap().status, 500);
    assert_eq!(inflight(&host, &gw), 0);
    assert_eq!(gw.borrow_mut().index_len(), 0, "the prefix was not indexed");
    f.on_log(&host);
    assert!(counts(&host, &gw).is_empty(), "nothing was counted, nothing finished");
}

#[test]
fn bad_bodies_and_sizes_get_json_errors() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001"],"max_payload_size":64}"#);
    let (_, action) = send(&host, &gw, "/v1/chat/completions", r#"{"messages":"hi"}"#);
    assert_eq!(action, Action::Pause);
    let r = host.reply().unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("`messages`"));
    // Declared too large: refused at the headers.
    host.request("POST", "/generate", &[("content-length", "65")], b"");
    let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
    assert_eq!(f.on_request_headers(&host, false), Action::Pause);
    assert_eq!(host.reply().unwrap().status, 413);
    // Grows too large while buffering.
    host.request("POST", "/generate", &[], b"");
    let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
    f.on_request_headers(&host, false);
    assert_eq!(f.on_request_body(&host, 65, false), Action::Pause);
    assert_eq!(host.reply().unwrap().status, 413);
    // No body at all.
    host.request("POST", "/generate", &[], b"");
    let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
    f.on_request_headers(&host, true);
    assert_eq!(host.reply().unwrap().status, 400);
    assert_eq!(host.metric_sum(Metric::LocalReplies), 4);
    assert_eq!(inflight(&host, &gw), 0);
}

#[test]
fn read_only_paths_go_to_a_worker_uncounted() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    for (method, path) in [("GET", "/v1/models"), ("HEAD", "/health"), ("GET", "/get_model_info?x=1")] {
        host.request(method, path, &[], b"");
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        assert_eq!(f.on_request_headers(&host, true), Action::Continue, "{method} {path}");
        assert!(host.request_header(DST_HEADER).is_some());
        f.on_log(&host);
    }
    assert!(counts(&host, &gw).is_empty());
}

#[test]
fn other_methods_on_llm_endpoints_are_405_and_admin_paths_404() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    for method in ["PUT", "GET", "DELETE"] {
        host.request(method, "/generate", &[], b"{}");
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        assert_eq!(f.on_request_headers(&host, false), Action::Pause);
        let r = host.reply().unwrap();
        assert_eq!(r.status, 405, "{method}");
        assert!(r.headers.contains(&("allow".into(), "POST".into())));
        assert_eq!(r.json()["error"]["code"], "method_not_allowed");
        assert!(host.request_header(DST_HEADER).is_none(), "never forwarded");
    }
    for path in ["/flush_cache", "/update_weights_from_disk", "/init_weights_update_group", "/abort_request", "/sleep"]
    {
        host.request("POST", path, &[], b"{}");
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        assert_eq!(f.on_request_headers(&host, false), Action::Pause);
        let r = host.reply().unwrap();
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("not_found")), "{path}");
        assert!(host.request_header(DST_HEADER).is_none(), "{path} never reaches a worker");
    }
}

#[test]
fn a_bad_request_id_is_replaced_for_both_legs() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let long = "x".repeat(59_000);
    for bad in [long.as_str(), "has space", ""] {
        let body = r#"{"text":["a","b"]}"#;
        host.request("POST", "/generate", &[("x-request-id", bad)], body.as_bytes());
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        f.on_request_headers(&host, false);
        assert_eq!(f.on_request_body(&host, body.len(), true), Action::Continue);
        let id = host.request_header("x-request-id").unwrap();
        assert_eq!(id.len(), 32, "a generated id replaces {:?}", &bad[..bad.len().min(10)]);
        let v: serde_json::Value = serde_json::from_slice(&callout(&host).body).unwrap();
        let rids = v["rid"].as_array().unwrap();
        assert_eq!(rids.len(), 2, "one rid per item");
        assert!(rids.iter().all(|r| r.as_str().is_some_and(|r| r.starts_with("kvmesh-") && !r.contains(&id))));
        assert!(callout(&host).headers.contains(&("x-request-id".into(), id)));
        f.on_log(&host);
    }
}

#[test]
fn passive_health_counts_only_what_the_worker_did() {
    // One failure opens the breaker: a worker that is never skipped was never blamed.
    let json = r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"],"cb_failure_threshold":1,"policy":"random"}"#;
    let blamed = |status: u16, details: Option<&str>| {
        // A fresh Envoy each time (the breakers live in its shared data).
        let host = MockHost::new();
        let gw = gateway(&host, json);
        let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"q"}"#);
        let worker = host.request_header(DST_HEADER).unwrap();
        host.set_response(status, b"");
        *host.code_details.borrow_mut() = details.map(String::from);
        f.on_response_headers(&host);
        f.on_log(&host);
        // Is that worker now out of rotation?
        (0..20).all(|_| {
            let (mut g, _) = send(&host, &gw, "/generate", r#"{"text":"r"}"#);
            let other = host.request_header(DST_HEADER).unwrap() != worker;
            g.on_log(&host);
            other
        })
    };
    assert!(!blamed(400, Some("via_upstream")), "a client error is not the worker's failure");
    assert!(!blamed(503, Some("overflow")), "Envoy's own overflow is not the worker's failure");
    assert!(!blamed(503, Some("no_healthy_upstream")));
    assert!(blamed(500, Some("via_upstream")), "a 5xx from the worker is");
    assert!(
        blamed(503, Some("upstream_reset_before_response_started{connection_failure}")),
        "so is a refused connection"
    );
    assert!(blamed(504, Some("upstream_response_timeout")), "and a timeout");
}

#[test]
fn a_client_that_goes_away_is_not_counted_as_a_worker_error() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"q"}"#);
    *host.code_details.borrow_mut() = Some("downstream_remote_disconnect".into());
    f.on_log(&host);
    let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"q"}"#);
    *host.code_details.borrow_mut() = Some("upstream_reset_before_response_started{remote_reset}".into());
    f.on_log(&host);
    let counts = counts(&host, &gw);
    assert_eq!(counts.iter().map(|c| c.finished).sum::<u32>(), 2);
    assert_eq!(counts.iter().map(|c| c.failed).sum::<u32>(), 1, "only the reset counts");
}

#[test]
fn without_configuration_every_request_gets_a_503() {
    let host = MockHost::new();
    host.request("POST", "/generate", &[], b"{}");
    let mut f = RequestFilter::new(None);
    assert_eq!(f.on_request_headers(&host, false), Action::Pause);
    let r = host.reply().unwrap();
    assert_eq!(r.status, 503);
    assert!(r.headers.contains(&("retry-after".into(), "1".into())));
}

// --- PD ---

fn pd_send(host: &MockHost, gw: &Rc<RefCell<Gateway>>, body: &str) -> RequestFilter {
    let (f, action) = send(host, gw, "/generate", body);
    assert_eq!(action, Action::Continue, "{:?}", host.reply());
    f
}

fn callout(host: &MockHost) -> crate::host::mock::SentCallout {
    host.callouts.borrow().last().cloned().expect("a prefill callout")
}

const PREFILL_ANSWER: &str = r#"{"text":"","meta_info":{"input_token_logprobs":[[-0.5,1,null],[-0.25,2,null]]}}"#;
const DECODE_ANSWER: &str = r#"{"text":"ok","meta_info":{"input_token_logprobs":[[-1.0,3,null]]}}"#;

fn answer_prefill(host: &MockHost, f: &mut RequestFilter, status: Option<u16>, body: &str) {
    *host.callout_answer.borrow_mut() = (status, body.as_bytes().to_vec());
    f.on_callout_response(host, callout(host).token, body.len());
}

fn merged_ids(body: &[u8]) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["meta_info"]["input_token_logprobs"].as_array().unwrap().iter().map(|t| t[1].as_u64().unwrap()).collect()
}

#[test]
fn pd_both_legs_get_the_same_rewritten_body_and_the_headers_name_both() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi"}"#);
    let c = callout(&host);
    assert_eq!(c.body, *host.request_body.borrow(), "decode and prefill bodies are identical");
    let v: serde_json::Value = serde_json::from_slice(&c.body).unwrap();
    assert_eq!((v["bootstrap_host"].as_str(), v["bootstrap_port"].as_u64()), (Some("127.0.0.1"), Some(8998)));
    let rid = v["rid"].as_str().expect("the gateway's rid");
    assert!(rid.starts_with("kvmesh-") && rid.len() == 28, "never the client's x-request-id: {rid}");
    assert!(c.headers.contains(&(DST_HEADER.into(), "127.0.0.1:30001".into())));
    assert!(c.headers.contains(&("x-request-id".into(), "rq-7".into())));
    assert_eq!(host.request_header(DST_HEADER).as_deref(), Some("127.0.0.1:30003"));
    assert_eq!(host.request_header("content-length"), Some(c.body.len().to_string()));
    assert_eq!(inflight(&host, &gw), 2);
    answer_prefill(&host, &mut f, Some(200), "{}");
    assert_eq!(inflight(&host, &gw), 1, "the prefill leg is finished when it answers");
    host.set_response(200, b"{}");
    assert_eq!(f.on_response_headers(&host), Action::Continue);
    assert_eq!(host.response_header(PREFILL_HEADER).as_deref(), Some("127.0.0.1:30001"));
    f.on_log(&host);
    assert_eq!(inflight(&host, &gw), 0);
}

#[test]
fn pd_the_prefill_leg_carries_the_clients_end_to_end_headers_only() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let body = r#"{"text":"hi"}"#;
    host.request(
        "POST",
        "/generate",
        &[
            ("authorization", "Bearer sk-1"),
            ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ("connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("x-envoy-original-dst-host", "6.6.6.6:1"),
            ("x-kvmesh-prefill", "6.6.6.6:2"),
            ("x-envoy-internal", "true"),
        ],
        body.as_bytes(),
    );
    let mut f = RequestFilter::new(Some(gw));
    f.on_request_headers(&host, false);
    assert_eq!(f.on_request_body(&host, body.len(), true), Action::Continue);
    let headers = callout(&host).headers;
    let has = |k: &str| headers.iter().any(|(n, _)| n == k);
    assert!(headers.contains(&("authorization".into(), "Bearer sk-1".into())));
    assert!(headers.contains(&("traceparent".into(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into())));
    for k in ["connection", "transfer-encoding", "x-kvmesh-prefill", "x-envoy-internal"] {
        assert!(!has(k), "{k} is not forwarded");
    }
    let dst: Vec<_> = headers.iter().filter(|(n, _)| n == DST_HEADER).collect();
    assert_eq!(dst, vec![&(DST_HEADER.to_string(), "127.0.0.1:30001".to_string())], "only the gateway's choice");
}

/// `worker_api_key`: both legs carry the workers' key in place of the client's credential.
#[test]
fn a_workers_key_replaces_the_clients_authorization_on_both_legs() {
    let host = MockHost::new();
    let gw = gateway(&host, &PD.replacen('{', r#"{"worker_api_key":"wk-1","#, 1));
    let body = r#"{"text":"hi"}"#;
    host.request(
        "POST",
        "/generate",
        &[("authorization", "Bearer client"), ("traceparent", "00-a-b-01")],
        body.as_bytes(),
    );
    let mut f = RequestFilter::new(Some(gw));
    f.on_request_headers(&host, false);
    assert_eq!(f.on_request_body(&host, body.len(), true), Action::Continue);
    assert_eq!(host.request_header("authorization").as_deref(), Some("Bearer wk-1"), "the decode leg");
    let prefill: Vec<_> = callout(&host).headers.into_iter().filter(|(n, _)| n == "authorization").collect();
    assert_eq!(prefill, vec![("authorization".to_string(), "Bearer wk-1".to_string())], "the prefill leg");
    // Without the key, the client's passes.
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001"]}"#);
    host.request("POST", "/generate", &[("authorization", "Bearer client")], body.as_bytes());
    let mut f = RequestFilter::new(Some(gw));
    f.on_request_headers(&host, false);
    f.on_request_body(&host, body.len(), true);
    assert_eq!(host.request_header("authorization").as_deref(), Some("Bearer client"));
}

#[test]
fn pd_a_client_error_from_the_prefill_fails_the_request_but_not_the_worker() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi"}"#);
    answer_prefill(&host, &mut f, Some(400), r#"{"error":"bad sampling params"}"#);
    let r = host.reply().unwrap();
    assert_eq!(r.status, 502);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("bad sampling params"));
    f.on_log(&host);
    assert_eq!(counts(&host, &gw).iter().map(|c| c.failed).sum::<u32>(), 0);
    // cb_failure_threshold is 1 in PD: the prefill worker still gets traffic.
    let _ = pd_send(&host, &gw, r#"{"text":"again"}"#);
}

#[test]
fn pd_client_bootstrap_fields_are_refused() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let body = r#"{"text":"hi","bootstrap_host":"6.6.6.6","bootstrap_room":1}"#;
    let (_, action) = send(&host, &gw, "/generate", body);
    assert_eq!(action, Action::Pause);
    let r = host.reply().unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("bootstrap_host"));
    assert!(host.callouts.borrow().is_empty());
}

#[test]
fn transfer_parameters_from_a_client_are_refused_in_regular_mode_too() {
    let host = MockHost::new();
    let gw = gateway(&host, REGULAR);
    for body in [
        r#"{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"6.6.6.6"}}"#,
        r#"{"text":"hi","bootstrap_host":"6.6.6.6","bootstrap_port":1,"bootstrap_room":7}"#,
    ] {
        let path = if body.contains("prompt") { "/v1/completions" } else { "/generate" };
        let (_, action) = send(&host, &gw, path, body);
        assert_eq!(action, Action::Pause);
        let r = host.reply().unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.json()["error"]["code"], "invalid_field");
        assert!(host.request_header("x-gateway-destination-endpoint").is_none(), "routed nowhere");
    }
    assert_eq!(inflight(&host, &gw), 0);
}

#[test]
fn pd_refused_callout_is_a_502_and_nothing_is_committed() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    host.refuse_dispatch.set(true);
    let text = format!(r#"{{"text":"{}"}}"#, "w".repeat(200));
    let (mut f, action) = send(&host, &gw, "/generate", &text);
    assert_eq!(action, Action::Pause);
    let r = host.reply().unwrap();
    assert_eq!(r.status, 502);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("127.0.0.1:30001"));
    assert_eq!(inflight(&host, &gw), 0);
    assert_eq!(gw.borrow_mut().index_len(), 0);
    f.on_log(&host);
    assert!(counts(&host, &gw).is_empty());
}

/// The orderings of the prefill answer and the decode response, with logprob merging.
#[test]
fn pd_logprobs_merge_whatever_arrives_first() {
    let body = r#"{"text":"hi","return_logprob":true}"#;
    let decode = DECODE_ANSWER.as_bytes();
    // 1. The prefill answers before the decode response starts.
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, body);
    answer_prefill(&host, &mut f, Some(200), PREFILL_ANSWER);
    host.set_response(200, decode);
    assert_eq!(f.on_response_headers(&host), Action::Continue);
    assert!(host.response_header("content-length").is_none(), "the merged body has another length");
    assert_eq!(f.on_response_body(&host, decode.len(), true), Action::Continue);
    assert_eq!(merged_ids(&host.response_body.borrow()), vec![1, 2, 3]);
    // 2. Decode headers first: held, resumed by the prefill answer.
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, body);
    host.set_response(200, decode);
    assert_eq!(f.on_response_headers(&host), Action::Pause);
    answer_prefill(&host, &mut f, Some(200), PREFILL_ANSWER);
    assert_eq!(host.resumed.get(), 1);
    assert_eq!(f.on_response_body(&host, decode.len(), true), Action::Continue);
    assert_eq!(merged_ids(&host.response_body.borrow()), vec![1, 2, 3]);
    // 3. The whole decode body first: merged in place, then resumed.
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, body);
    host.set_response(200, decode);
    assert_eq!(f.on_response_headers(&host), Action::Pause);
    assert_eq!(f.on_response_body(&host, decode.len(), true), Action::Pause);
    answer_prefill(&host, &mut f, Some(200), PREFILL_ANSWER);
    assert_eq!(host.resumed.get(), 1);
    assert_eq!(merged_ids(&host.response_body.borrow()), vec![1, 2, 3]);
    f.on_log(&host);
    assert_eq!(inflight(&host, &gw), 0);
}

/// A JSON decode response held over many chunks (for the prefill, then for its end) is read
/// once by engine feedback and once by the merge, not again on every chunk.
#[test]
fn pd_a_held_response_body_is_read_once() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi","return_logprob":true}"#);
    let decode = format!(r#"{{"text":"{}","meta_info":{{"input_token_logprobs":[[-1.0,3,null]]}}}}"#, "x".repeat(6400));
    host.set_response(200, b"");
    *host.upstream.borrow_mut() = Some("127.0.0.1:30003".into());
    assert_eq!(f.on_response_headers(&host), Action::Pause);
    let chunks: Vec<&[u8]> = decode.as_bytes().chunks(100).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        if i == chunks.len() / 2 {
            answer_prefill(&host, &mut f, Some(200), PREFILL_ANSWER);
        }
        host.response_body.borrow_mut().extend_from_slice(chunk); // Envoy keeps what it held
        let size = host.response_body.borrow().len();
        let end = i + 1 == chunks.len();
        assert_eq!(f.on_response_body(&host, size, end), if end { Action::Continue } else { Action::Pause });
    }
    assert_eq!(merged_ids(&host.response_body.borrow()), vec![1, 2, 3]);
    assert!(host.response_bytes_read.get() <= 2 * decode.len(), "{} bytes read", host.response_bytes_read.get());
    f.on_log(&host);
}

#[test]
fn pd_failed_prefill_before_the_response_is_a_502_naming_it() {
    for (status, why) in [(Some(500), "HTTP 500"), (None, "no response")] {
        let host = MockHost::new();
        let gw = gateway(&host, PD);
        let mut f = pd_send(&host, &gw, r#"{"text":"hi","return_logprob":true}"#);
        host.set_response(200, DECODE_ANSWER.as_bytes());
        assert_eq!(f.on_response_headers(&host), Action::Pause);
        answer_prefill(&host, &mut f, status, "boom");
        let r = host.reply().unwrap();
        assert_eq!(r.status, 502);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("127.0.0.1:30001") && msg.contains(why), "{msg}");
        f.on_log(&host);
        assert_eq!(inflight(&host, &gw), 0);
        let counts = counts(&host, &gw);
        let decode = counts.iter().find(|c| c.worker == 1).unwrap();
        assert_eq!(decode.failed, 0, "the cancelled decode leg is not the decode worker's failure");
    }
}

#[test]
fn pd_a_decode_failure_counts_against_the_decode_worker_only_if_the_prefill_succeeded() {
    // One failure opens a breaker (PD's cb_failure_threshold is 1).
    for (prefill_status, decode_blamed) in [(None, false), (Some(500), false), (Some(200), true)] {
        let host = MockHost::new();
        let gw = gateway(&host, PD);
        let mut f = pd_send(&host, &gw, r#"{"text":"hi"}"#);
        // The decode worker fails first: it could not fetch the KV from the prefill worker.
        host.set_response(500, b"{}");
        *host.code_details.borrow_mut() = Some("via_upstream".into());
        f.on_response_headers(&host);
        answer_prefill(&host, &mut f, prefill_status, "");
        f.on_log(&host);
        let now = Now::from_nanos(host.now_nanos());
        let state = gw.borrow().front().breaker_state(1, now);
        assert_eq!(
            state != kvmesh_core::breaker::BreakerState::Closed,
            decode_blamed,
            "prefill answered {prefill_status:?}: decode breaker {state:?}"
        );
    }
}

#[test]
fn pd_failed_prefill_inside_a_stream_is_an_sse_error_event() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi","stream":true}"#);
    host.set_response(200, b"data: {\"text\":\"a\"}\n\n");
    assert_eq!(f.on_response_headers(&host), Action::Continue);
    assert_eq!(f.on_response_body(&host, 20, false), Action::Continue);
    answer_prefill(&host, &mut f, Some(503), "");
    assert!(host.reply().is_none(), "too late for a local reply");
    *host.response_body.borrow_mut() = b"data: {\"text\":\"b\"}\n\n".to_vec();
    f.on_response_body(&host, 20, false);
    let out = String::from_utf8(host.response_body.borrow().clone()).unwrap();
    assert!(out.starts_with("data: {\"error\"") && out.contains("prefill_failed"), "{out}");
}

#[test]
fn pd_a_prefill_still_out_when_the_stream_ends_is_released() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi"}"#);
    assert_eq!(inflight(&host, &gw), 2);
    let prefill = callout(&host);
    let sent: serde_json::Value = serde_json::from_slice(&prefill.body).unwrap();
    let rid = sent["rid"].as_str().expect("the rid the gateway gave the request").to_string();
    assert_ne!(Some(rid.as_str()), host.request_header("x-request-id").as_deref());
    f.on_log(&host); // the client went away
    assert_eq!(inflight(&host, &gw), 0);
    // The prefill worker is told to stop, by the rid the gateway gave the request.
    let abort = callout(&host);
    assert_ne!(abort.token, prefill.token);
    let header =
        |c: &crate::host::mock::SentCallout, n: &str| c.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    assert_eq!(header(&abort, ":path").as_deref(), Some("/abort_request"));
    assert_eq!(header(&abort, ENDPOINTS_HEADER), header(&prefill, ENDPOINTS_HEADER), "to the prefill worker");
    let body: serde_json::Value = serde_json::from_slice(&abort.body).unwrap();
    assert_eq!(body, serde_json::json!({ "rid": rid }));
    // A late answer to the abandoned callout changes nothing.
    answer_prefill(&host, &mut f, Some(200), "{}");
    assert_eq!(inflight(&host, &gw), 0);
}

#[test]
fn pd_a_prefill_that_answered_is_not_aborted() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi"}"#);
    answer_prefill(&host, &mut f, Some(200), PREFILL_ANSWER);
    let sent = host.callouts.borrow().len();
    f.on_log(&host);
    assert_eq!(host.callouts.borrow().len(), sent, "no abort");
}

#[test]
fn a_vllm_decode_worker_is_not_stalled_while_its_prefill_runs() {
    let host = MockHost::new();
    let json = r#"{"pd_disaggregation":true,"pd_protocol":"vllm","prefill":[["http://127.0.0.1:30001",null]],
        "decode":["http://127.0.0.1:30003","http://127.0.0.1:30004"],"decode_policy":"cache_aware",
        "worker_stall_secs":2}"#;
    let gw = gateway(&host, json);
    let body = format!(r#"{{"model":"m","prompt":"{}","max_tokens":4}}"#, "a long shared prompt ".repeat(20));
    let (mut first, action) = send(&host, &gw, "/v1/completions", &body);
    assert_eq!(action, Action::Pause, "held for its prefill leg");
    let decode = host.request_header(DST_HEADER).unwrap();
    let first_leg = callout(&host).token;
    // The prefill takes longer than the stall window; the decode worker has not been sent
    // anything yet, so the same prompt still goes to it.
    host.advance_ms(2_500);
    let (_second, _) = send(&host, &gw, "/v1/completions", &body);
    assert_eq!(host.request_header(DST_HEADER).unwrap(), decode, "its prompt's decode worker, not stalled");
    let answer = r#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#;
    *host.callout_answer.borrow_mut() = (Some(200), answer.as_bytes().to_vec());
    first.on_callout_response(&host, first_leg, answer.len());
    // Sent now: silent past the window from here, it is passed over.
    host.advance_ms(2_500);
    let (_third, _) = send(&host, &gw, "/v1/completions", &body);
    assert_ne!(host.request_header(DST_HEADER).unwrap(), decode, "stalled once it held the request");
}
