//! Hostile input against the real gateway: real Envoy, the real `.wasm`, real sims. Every class
//! of bad request is followed by good requests on fresh connections (so every Envoy worker
//! thread is exercised); at the end no VM was replaced (no trap), every good request was
//! served, and the in-flight count is back to 0.

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvmesh_testkit::e2e::{fast_decode, fast_prefill, pd_options, sims, DECODE_20MS, FAST};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{crash_wasm_path, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

fn stack(n: usize, filter: Value) -> (Vec<Sim>, Envoy) {
    let sims = sims(n, FAST);
    let mut filter = filter;
    if filter.get("pd_disaggregation").is_none() {
        filter["worker_urls"] = json!(sims.iter().map(Sim::url).collect::<Vec<_>>());
    }
    let envoy = Envoy::start(&EnvoyOptions::new(filter).unwrap()).unwrap();
    (sims, envoy)
}

/// Good requests on fresh connections: all must be served by a worker.
fn assert_still_serving(envoy: &Envoy, class: &str, served: &mut usize) {
    for i in 0..8 {
        let body = json!({"text": format!("good request {i} after {class}"), "sampling_params": {"max_new_tokens": 2}});
        let r = http::post_json(&envoy.url("/generate"), &body).unwrap();
        assert_eq!(r.status, 200, "after {class}: {}", head(&r));
        assert!(r.header("x-kvmesh-worker").is_some());
        *served += 1;
    }
}

/// At most the first 300 characters of a response body, for messages.
fn head(r: &Response) -> String {
    r.text().chars().take(300).collect()
}

fn assert_json_error(r: &Response, status: u16, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", head(r));
    let v = r.json().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(v["error"]["message"].is_string() && v["error"]["code"].is_string(), "{what}: {v}");
}

/// Sends raw bytes on a fresh connection; returns what came back before the gateway closed
/// the connection or `wait` passed (the connection may be cut short on purpose).
fn raw(envoy: &Envoy, bytes: &[u8], close_early: bool, wait: Duration) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    let _ = s.write_all(bytes);
    if close_early {
        return String::new(); // dropped: the client goes away mid-request
    }
    s.set_read_timeout(Some(wait)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(buf.get(..n).unwrap_or_default());
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.len() > 64 {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(raw_response: &str) -> Option<u16> {
    raw_response.split_whitespace().nth(1)?.parse().ok()
}

fn peak_rss_kib(envoy: &mut Envoy) -> u64 {
    let pid = envoy.proc().pid();
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn list_body(field: &str, item: &str, bytes: usize) -> Vec<u8> {
    let mut b = format!("{{\"{field}\":[").into_bytes();
    while b.len() < bytes {
        b.extend_from_slice(item.as_bytes());
        b.push(b',');
    }
    b.extend_from_slice(item.as_bytes());
    b.extend_from_slice(b"]}");
    b
}

#[test]
fn hostile_requests_never_disable_the_gateway() {
    let (_sims, mut envoy) = stack(2, json!({}));
    let url = envoy.url("/generate");
    let (hostile, refused, mut served) = (Cell::new(0usize), Cell::new(0usize), 0usize);
    let sent = |n: usize| hostile.set(hostile.get() + n);
    let expect = |r: anyhow::Result<Response>, status: u16, what: &str| {
        let r = r.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_json_error(&r, status, what);
        sent(1);
        refused.set(refused.get() + 1);
    };

    // Bodies shaped to exhaust memory: answered within seconds, refused or routed.
    let shapes: Vec<(&str, Vec<u8>, u16)> = vec![
        ("a 60 MB list of short texts", list_body("text", "\"a\"", 60 << 20), 400),
        ("a 60 MB list of token lists", list_body("input_ids", "[1]", 60 << 20), 400),
        ("a 200 MB list of short texts", list_body("text", "\"a\"", 200 << 20), 400),
        (
            "a million keys",
            {
                let mut b = b"{".to_vec();
                for i in 0..1_000_000 {
                    b.extend_from_slice(format!("\"k{i}\":0,").as_bytes());
                }
                b.extend_from_slice(b"\"x\":1}");
                b
            },
            400,
        ),
        ("deep nesting", format!("{{\"text\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), 400),
        ("a batch one item over the limit", json!({"text": vec!["a"; 4097]}).to_string().into_bytes(), 400),
    ];
    for (what, body, status) in &shapes {
        let started = std::time::Instant::now();
        expect(http::post(&url, body, &[]), *status, what);
        eprintln!("{what}: {} bytes answered in {:?}", body.len(), started.elapsed());
    }
    // Deep nesting in a field the gateway skips: skipped without recursion, then either routed
    // (the worker judges it) or refused — never a gateway failure.
    let nested = format!("{{\"text\":\"a\",\"x\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let r = http::post(&url, nested.as_bytes(), &[]).unwrap();
    assert!((200..500).contains(&r.status), "nested unknown field: {} {}", r.status, head(&r));
    sent(1);
    let rss_after_shapes = peak_rss_kib(&mut envoy);
    assert_still_serving(&envoy, "memory-shaped bodies", &mut served);

    // Routed, not refused: a huge single prompt and a long token list (the routing text is
    // capped; the worker gets the body unchanged).
    for body in [
        json!({"text": "p".repeat(8 << 20), "sampling_params": {"max_new_tokens": 1}}),
        json!({"input_ids": vec![7u32; 2_000_000], "sampling_params": {"max_new_tokens": 1}}),
    ] {
        let r = http::post_json(&url, &body).unwrap();
        assert_eq!(r.status, 200, "{}", head(&r));
        sent(1);
    }

    // Numbers, encodings and duplicate keys.
    let bad_bodies: [&[u8]; 12] = [
        br#"{"input_ids":[99999999999]}"#,
        br#"{"input_ids":[-1]}"#,
        br#"{"input_ids":[1.5]}"#,
        br#"{"input_ids":[1e400]}"#,
        br#"{"text":"\ud800"}"#,
        b"{\"text\":\"\xff\xfe\"}",
        br#"{"text":"a","text":"b"}"#,
        br#"{"text":"a","stream":"yes"}"#,
        br#"{"text":[]}"#,
        br#"{"text":[1,2]}"#,
        br#"{"input_ids":[[1],[2,"x"]]}"#,
        br#"{"text":["a","b"],"sampling_params":[{}]}"#,
    ];
    for body in bad_bodies {
        expect(http::post(&url, body, &[]), 400, &String::from_utf8_lossy(body));
    }
    for (path, body) in [
        ("/v1/chat/completions", r#"{"messages":[{"role":"user","content":{"x":1}}]}"#),
        ("/v1/chat/completions", r#"{"messages":[]}"#),
        ("/v1/completions", r#"{"prompt":{}}"#),
        ("/v1/completions", "[1,2,3]"),
        ("/generate", "{"),
        ("/generate", ""),
    ] {
        expect(http::post(&envoy.url(path), body.as_bytes(), &[]), 400, body);
    }
    assert_still_serving(&envoy, "bad numbers and encodings", &mut served);

    // Headers: oversized, many, and a 59 KB request id (replaced, not copied per item).
    let big = "h".repeat(70_000);
    expect(http::post(&url, br#"{"text":"a"}"#, &[("x-big", &big)]), 431, "70 KB header");
    let long_id = "i".repeat(59_000);
    let batch = json!({"text": vec!["short"; 4000], "sampling_params": {"max_new_tokens": 1}});
    let r = http::post(&url, batch.to_string().as_bytes(), &[("x-request-id", &long_id)]).unwrap();
    assert_eq!(r.status, 200, "{}", head(&r));
    sent(1);
    assert_still_serving(&envoy, "header sizes", &mut served);

    // Every truncation and every single-byte corruption of a valid body: a JSON 400, or
    // routed when the result is still a valid request — never a gateway failure.
    let valid = br#"{"text":"hello","sampling_params":{"max_new_tokens":1},"stream":false}"#;
    for cut in 0..valid.len() {
        let body = valid.get(..cut).unwrap_or_default();
        expect(http::post(&url, body, &[]), 400, &format!("truncated at {cut}"));
    }
    for at in 0..valid.len() {
        let mut body = valid.to_vec();
        if let Some(b) = body.get_mut(at) {
            *b = 0xff;
        }
        let r = http::post(&url, &body, &[]).unwrap();
        assert!(r.status == 400 || r.status == 200, "corrupted at {at}: {} {}", r.status, head(&r));
        sent(1);
    }
    assert_still_serving(&envoy, "truncated and corrupted bodies", &mut served);

    // Methods, paths and worker admin operations.
    for path in ["/generate", "/v1/chat/completions", "/v1/completions"] {
        for method in ["PUT", "DELETE", "PATCH", "GET"] {
            let r = ureq::request(method, &envoy.url(path)).send_string("{\"text\":\"a\"}");
            let r = match r {
                Ok(r) | Err(ureq::Error::Status(_, r)) => r,
                Err(e) => panic!("{method}: {e}"),
            };
            assert_eq!(r.status(), 405, "{method} {path}");
            assert_eq!(r.header("allow"), Some("POST"));
            sent(1);
            refused.set(refused.get() + 1);
        }
    }
    for path in [
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/abort_request",
        "/start_profile",
        "/stop_profile",
        "/sleep",
        "/wake_up",
        "/configure_logging",
        "/generate/../flush_cache",
        "/v1/models/../flush_cache",
    ] {
        expect(http::post(&envoy.url(path), b"{}", &[]), 404, path);
        expect(http::get(&envoy.url(path)), 404, path);
    }
    expect(http::post(&envoy.url("/a%2Fb"), b"{}", &[]), 400, "escaped slash");
    // Normalised, then parsed and routed like /generate (never forwarded unparsed).
    for path in ["//generate", "/%67enerate", "/./generate"] {
        expect(http::post(&envoy.url(path), br#"{"text":5}"#, &[]), 400, path);
    }
    assert_eq!(http::get(&envoy.url("/v1/models")).unwrap().status, 200, "read-only paths still pass");
    assert_still_serving(&envoy, "methods and paths", &mut served);

    // Header values that are not UTF-8 (HTTP allows bytes above 0x7f): the SDK's own header
    // decoder would panic on them and kill the VM. Routed like any request; a routing header
    // with such a value is still removed (the worker answers, not the one it names).
    let body = br#"{"text":"latin-1 headers","sampling_params":{"max_new_tokens":2}}"#;
    for (path, extra) in [
        ("/generate", &b"x-note: caf\xe9\r\nx-request-id: \xff\xfe\r\n"[..]),
        ("/generate", b"x-gateway-destination-endpoint: 127.0.0.9:1\xff\r\nuser-agent: \xc3\x28\r\n"),
        ("/v1/models", b"accept-language: d\xe9\r\n"),
    ] {
        let method = if path == "/generate" { "POST" } else { "GET" };
        let length = if method == "POST" { body.len() } else { 0 };
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n").into_bytes();
        req.extend_from_slice(extra);
        req.extend_from_slice(b"connection: close\r\n\r\n");
        if method == "POST" {
            req.extend_from_slice(body);
        }
        let answer = raw(&envoy, &req, false, Duration::from_secs(10));
        assert_eq!(status_of(&answer), Some(200), "{path} with {:?}: {answer}", String::from_utf8_lossy(extra));
        assert!(answer.to_ascii_lowercase().contains("x-kvmesh-worker: 127.0.0.1:"), "{answer}");
        sent(1);
    }
    assert_still_serving(&envoy, "header values that are not UTF-8", &mut served);

    // Clients that reset mid-stream, trailers, and headers then silence.
    let body = br#"{"text":"reset me","sampling_params":{"max_new_tokens":64}}"#;
    for _ in 0..20 {
        let head = format!("POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", body.len() + 100);
        raw(&envoy, &[head.as_bytes(), body].concat(), true, Duration::ZERO);
        let full = format!("POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", body.len());
        raw(&envoy, &[full.as_bytes(), body].concat(), true, Duration::ZERO);
        sent(2);
    }
    let chunked = b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntrailer: x-t\r\n\r\n\
                    c\r\n{\"text\":\"t\"}\r\n0\r\nx-t: 1\r\n\r\n";
    assert_eq!(status_of(&raw(&envoy, chunked, false, Duration::from_secs(10))), Some(200), "trailers");
    let silent = raw(&envoy, b"POST /generate HTTP/1.1\r\nhost: x\r\n", false, Duration::from_secs(15));
    assert_eq!(status_of(&silent), Some(408), "headers then silence: {silent}");
    assert!(silent.contains("request_header_timeout"), "{silent}");
    sent(2);
    assert_still_serving(&envoy, "resets, trailers and silence", &mut served);

    // No VM was replaced, and nothing is left in flight.
    assert_eq!(envoy.stat("wasm.kvmesh.vm_reload").unwrap().unwrap_or(0), 0, "a VM trapped");
    wait_until("in-flight back to 0", Duration::from_secs(20), || envoy.in_flight() == Some(0)).unwrap();
    let peak = peak_rss_kib(&mut envoy);
    eprintln!(
        "hostile requests: {} sent, {} answered 4xx by the gateway; VM traps: 0; good requests served \
         after them: {served}; Envoy peak RSS {} MiB ({} MiB after the memory-shaped bodies)",
        hostile.get(),
        refused.get(),
        peak / 1024,
        rss_after_shapes / 1024
    );
}

#[test]
fn a_trapped_vm_is_reloaded_and_requests_are_served_again() {
    let sims = sims(2, FAST);
    let mut opts = EnvoyOptions::new(json!({"worker_urls": sims.iter().map(Sim::url).collect::<Vec<_>>()})).unwrap();
    opts.wasm = crash_wasm_path();
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let body = json!({"text": "hello", "sampling_params": {"max_new_tokens": 1}});
    assert_eq!(http::post_json(&url, &body).unwrap().status, 200);
    let crash = http::post(&url, body.to_string().as_bytes(), &[("x-test-crash-vm", "1")]).unwrap();
    assert!(crash.status >= 500, "the trapped request fails: {}", crash.status);
    assert!(crash.json().is_ok(), "even that failure is JSON: {}", crash.text());
    // Envoy replaces a dead VM on a request its thread gets once the reload backoff (10 ms)
    // has passed; until then that thread answers a JSON 503. Fresh connections land on both
    // threads: keep sending until 40 in a row were served (bounded), after a reload.
    let (mut in_a_row, mut failed, mut sent) = (0, 0, 0);
    while in_a_row < 40 {
        assert!(sent < 2_000, "never served again: {failed} of {sent} failed");
        let body = json!({"text": format!("after the crash {sent}"), "sampling_params": {"max_new_tokens": 1}});
        let r = http::post_json(&url, &body).unwrap();
        sent += 1;
        if r.status == 200 {
            in_a_row += 1;
        } else {
            assert_eq!(r.status, 503, "{}", head(&r));
            assert!(r.json().is_ok(), "the failure is JSON: {}", head(&r));
            failed += 1;
            in_a_row = 0;
        }
    }
    eprintln!("after the trap: {failed} of {sent} requests answered 503 before the VM was reloaded");
    wait_until("the VM was reloaded", Duration::from_secs(20), || {
        envoy.stat("wasm.kvmesh.vm_reload_success").ok().flatten().unwrap_or(0) >= 1
    })
    .unwrap();
    assert_eq!(envoy.stat("wasm.kvmesh.vm_reload_failure").unwrap().unwrap_or(0), 0);
}

#[test]
fn no_decode_worker_sees_a_bootstrap_field_the_gateway_did_not_write() {
    let (prefill, decode) = (fast_prefill(), fast_decode(None));
    let prefills = json!([[prefill.url(), prefill.bootstrap_port]]);
    let filter = json!({"pd_disaggregation": true, "prefill": prefills, "decode": [decode.url()]});
    let envoy = Envoy::start(&pd_options(filter, false)).unwrap();
    let evil = json!({"text": "smuggle", "bootstrap_host": "6.6.6.6", "bootstrap_port": 1, "bootstrap_room": 7});
    for path in ["/generate", "//generate", "/%67enerate", "/generate?x=1"] {
        let r = http::post_json(&envoy.url(path), &evil).unwrap();
        assert_json_error(&r, 400, path);
    }
    for method in ["PUT", "PATCH"] {
        let r = ureq::request(method, &envoy.url("/generate")).send_string(&evil.to_string());
        let status = match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r.status(),
            Err(e) => panic!("{e}"),
        };
        assert_eq!(status, 405);
    }
    for path in ["/flush_cache", "/generate_raw", "/v1/models/../../generate"] {
        let r = http::post_json(&envoy.url(path), &evil).unwrap();
        assert!(r.status == 404 || r.status == 400, "{path}: {}", r.status);
    }
    let ok = http::post_json(&envoy.url("/generate"), &json!({"text": "fine"})).unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
    for sim in [&prefill, &decode] {
        let seen = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
        let bodies = seen.as_array().cloned().unwrap_or_default();
        assert!(!bodies.is_empty(), "the good request arrived");
        for b in bodies {
            let text = b.to_string();
            assert!(
                !text.contains("6.6.6.6") && !text.contains("smuggle"),
                "a smuggled request reached a worker: {text}"
            );
        }
    }
}

/// Regular mode too: a vLLM worker launched with a KV connector would act on a client's
/// `kv_transfer_params` (pull KV from the host they name, and serve it to later prefixes).
#[test]
fn no_regular_worker_sees_transfer_parameters_from_a_client() {
    let sim = Sim::start(&["--engine", "vllm", "--time-scale", "0"]).unwrap();
    let envoy = Envoy::start(&EnvoyOptions::new(json!({"worker_urls": [sim.url()]})).unwrap()).unwrap();
    let params = json!({"do_remote_prefill": true, "remote_host": "6.6.6.6", "remote_port": 1});
    let evil = json!({"model": "kvmesh-sim", "prompt": "smuggle", "max_tokens": 1, "kv_transfer_params": params});
    let refused = http::post_json(&envoy.url("/v1/completions"), &evil).unwrap();
    assert_json_error(&refused, 400, "kv_transfer_params");
    assert_eq!(refused.json().unwrap()["error"]["code"], "invalid_field", "the gateway's answer, not the worker's");
    let ok = json!({"model": "kvmesh-sim", "prompt": "fine", "max_tokens": 1});
    assert_eq!(http::post_json(&envoy.url("/v1/completions"), &ok).unwrap().status, 200);
    let seen = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    let bodies = seen.as_array().cloned().unwrap_or_default();
    assert_eq!(bodies.len(), 1, "the good request alone: {bodies:?}");
    assert!(!bodies[0].to_string().contains("6.6.6.6"));
}

#[test]
fn without_the_wasm_filter_a_client_still_cannot_pick_the_destination() {
    let sim = Sim::start(FAST).unwrap();
    let start = |remove: &[&str]| {
        let mut opts = EnvoyOptions::new(json!({"worker_urls": [sim.url()]})).unwrap();
        opts.remove_http_filters = remove.iter().map(|s| s.to_string()).collect();
        Envoy::start(&opts).unwrap()
    };
    let steer = |envoy: &Envoy| {
        let body = br#"{"text":"steered","sampling_params":{"max_new_tokens":1}}"#;
        let addr = sim.addr();
        let headers = [("x-envoy-original-dst-host", addr.as_str()), ("x-gateway-destination-endpoint", addr.as_str())];
        http::post(&envoy.url("/generate"), body, &headers).unwrap()
    };
    // As shipped, minus the kvmesh filter (what a filter failing open would leave): Envoy's
    // own early header mutation still removes the client's routing headers, so the request
    // matches no route to the workers and nothing reaches one.
    let fail_open = start(&["envoy.filters.http.wasm"]);
    let r = steer(&fail_open);
    assert_eq!(r.status, 503, "the request reached a worker: {}", r.text());
    assert_eq!(r.json().unwrap()["error"]["code"], "not_routed", "{}", r.text());
    // Control: without the scrubbing filter too, the same request does reach the worker —
    // so the assertion above is what the early header mutation buys.
    let neither = start(&["envoy.filters.http.wasm", "envoy.http.early_header_mutation.header_mutation"]);
    assert_eq!(steer(&neither).status, 200);
    let seen = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    assert_eq!(seen.as_array().map(Vec::len), Some(1), "only the control request arrived: {seen}");
}

#[test]
fn the_requests_of_a_trapped_vm_do_not_stay_in_flight() {
    // One worker thread, so the slow request and the trap share a VM.
    let sim = Sim::start(DECODE_20MS).unwrap();
    let mut opts = EnvoyOptions::new(json!({"worker_urls": [sim.url()]})).unwrap();
    opts.wasm = crash_wasm_path();
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let slow = {
        let url = url.clone();
        std::thread::spawn(move || {
            let body = json!({"text": "a long one", "sampling_params": {"max_new_tokens": 1000}});
            http::post_json(&url, &body).map(|r| r.status)
        })
    };
    wait_until("the slow request in flight", Duration::from_secs(10), || envoy.in_flight() == Some(1)).unwrap();
    let crash = http::post(&url, br#"{"text":"x"}"#, &[("x-test-crash-vm", "1")]).unwrap();
    assert!(crash.status >= 500);
    // The dead VM's streams never reach on_log; the VMs that live on take its count back once
    // its heartbeat is stale (10 s).
    wait_until("the reloaded VM serves", Duration::from_secs(10), || {
        http::post_json(&url, &json!({"text": "ping", "sampling_params": {"max_new_tokens": 1}}))
            .is_ok_and(|r| r.status == 200)
    })
    .unwrap();
    wait_until("in flight back to 0", Duration::from_secs(25), || envoy.in_flight() == Some(0)).unwrap();
    let _ = slow.join();
}

/// A body that stops half way (or trickles in) holds its stream and its buffer only until the
/// listener's `request_timeout`: then the client gets the JSON 408, the stream is freed, and
/// no worker ever saw the request; other clients are served meanwhile.
#[test]
fn a_stalled_upload_gets_a_json_408_and_the_others_are_served() {
    let sims = sims(2, FAST);
    let filter = json!({"worker_urls": sims.iter().map(Sim::url).collect::<Vec<_>>()});
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.request_timeout = Some(Duration::from_secs(2));
    let envoy = Envoy::start(&opts).unwrap();
    // Headers promising 1 MiB, then 16 bytes of it, then silence.
    let head =
        "POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n";
    let mut stalled = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    stalled.write_all(head.as_bytes()).unwrap();
    stalled.write_all(br#"{"text": "stall"#).unwrap();
    // Meanwhile the gateway serves everyone else.
    let mut served = 0;
    assert_still_serving(&envoy, "a stalled upload", &mut served);
    stalled.set_read_timeout(Some(kvmesh_testkit::e2e::HANG)).unwrap();
    let mut answer = Vec::new();
    let _ = stalled.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status_of(&answer), Some(408), "the stalled upload is timed out: {answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("a JSON body ({e}): {answer}"));
    assert!(v["error"]["message"].is_string() && v["error"]["code"].is_string(), "{v}");
    for sim in &sims {
        let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
        let stalled_seen = log.as_array().unwrap().iter().any(|r| r["body"]["text"] == "stall");
        assert!(!stalled_seen, "{} never saw the stalled request", sim.addr());
    }
    assert_eq!(envoy.stat("http.kvmesh.downstream_rq_timeout").unwrap(), Some(1), "counted as a request timeout");
}

/// Uploads that fill the gateway's memory and then stall: the shipped overload manager (here
/// with a 192 MiB heap budget instead of 2 GiB) scales idle timeouts down while the heap is
/// past 80 % of it, so stalled uploads are cut (a JSON 408) long before the 300 s request
/// timeout — as many as it takes to bring memory back under 80 %, not necessarily all; new
/// requests meanwhile get a JSON 503 (`overload`) rather than more memory, and once memory is
/// back the gateway serves again, its VMs untouched.
#[test]
fn uploads_that_fill_memory_and_stall_are_shed_and_the_gateway_serves_again() {
    let sims = sims(2, FAST);
    let filter = json!({"worker_urls": sims.iter().map(Sim::url).collect::<Vec<_>>()});
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.heap_budget = Some((192 << 20, Duration::from_secs(1)));
    let envoy = Envoy::start(&opts).unwrap();
    let head =
        "POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n";
    let chunk = vec![b'a'; 1 << 20];
    let started = std::time::Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
        // 56 MiB each, then silence (a write fails once Envoy sheds the connection).
        let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(br#"{"text": ""#));
        for _ in 0..56 {
            if s.write_all(&chunk).is_err() {
                break;
            }
        }
        stalled.push(s);
    }
    let cut = |e: &Envoy| e.stat("http.kvmesh.downstream_rq_idle_timeout").ok().flatten().unwrap_or(0);
    wait_until("a stalled upload cut by its scaled-down idle timeout", Duration::from_secs(15), || cut(&envoy) >= 1)
        .unwrap();
    let took = started.elapsed();
    // What each stalled connection got: a 408 once cut, or nothing yet (still held, under budget).
    let statuses: Vec<Option<u16>> = stalled
        .into_iter()
        .map(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut answer = Vec::new();
            let _ = s.read_to_end(&mut answer);
            status_of(&String::from_utf8_lossy(&answer))
        })
        .collect();
    eprintln!("stalled uploads: {} cut after {took:?}; answers {statuses:?}", cut(&envoy));
    assert!(statuses.contains(&Some(408)), "a cut upload gets the JSON 408: {statuses:?}");
    assert!(statuses.iter().all(|s| matches!(s, None | Some(408) | Some(503))), "{statuses:?}");
    wait_until("the heap to come back under 80 % of its budget", Duration::from_secs(30), || {
        envoy.stat("overload.envoy.resource_monitors.fixed_heap.pressure").ok().flatten().is_some_and(|p| p < 80)
    })
    .unwrap();
    let mut served = 0;
    assert_still_serving(&envoy, "memory pressure", &mut served);
    for sim in &sims {
        let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
        assert!(log.as_array().unwrap().iter().all(|r| r["body"]["text"] != ""), "no worker saw a stalled upload");
    }
}
