//! Tenants and priorities (issue 47) through the real Envoy and the real filter (`.wasm`, or
//! the native build with `KVMESH_TEST_NATIVE=1`): priority classes with reserved slots under
//! the concurrency limit, a higher class going ahead of waiting lower ones, and sheddable
//! requests refused (never queued) when no slot is free; fair shares by tenant, at one
//! gateway and across two on one kvmesh-cp; per-tenant limits, also across two.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{control_plane, gateway_with, DECODE_20MS, FAST};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::mtls::CLIENT_SPIFFE_ID;
use kvmesh_testkit::{free_port, scratch_dir, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

fn body(text: &str, tokens: u32) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": tokens}})
}

/// POSTs `body` with `headers` on its own thread; the response and when it came.
fn post_in_thread(url: &str, body: Value, headers: &[(&str, &str)]) -> JoinHandle<(Response, Instant)> {
    let url = url.to_string();
    let headers: Vec<(String, String)> = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    std::thread::spawn(move || {
        let bytes = serde_json::to_vec(&body).unwrap();
        let mut all: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        all.push(("content-type", "application/json"));
        let r = http::post(&url, &bytes, &all).unwrap();
        (r, Instant::now())
    })
}

/// The filter's labelled counter `name{label="value"}` in Envoy's `/stats/prometheus` (0
/// while absent; the native build's names keep their `envoy_wasmcustom_` prefix there).
fn labelled(envoy: &Envoy, name: &str, label: &str, value: &str) -> u64 {
    let text = http::get(&envoy.admin_url("/stats/prometheus")).map(|r| r.text()).unwrap_or_default();
    let (series, tag) = (format!("{name}{{"), format!("{label}=\"{value}\""));
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(&series) && l.contains(&tag))
        .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
        .sum()
}

/// Two slots, one reserved for the interactive class. A default request runs; a second one
/// waits (the free slot is reserved) while an interactive one takes it at once; a sheddable
/// one is refused at once with a JSON 503 and `retry-after`; an interactive one that arrives
/// after the waiting default one still runs before it.
#[test]
fn classes_reserve_slots_go_ahead_of_lower_ones_and_sheddable_requests_are_refused() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let filter = json!({
        "worker_urls": [sim.url()],
        "max_concurrent_requests": 2,
        "rate_limit_tokens_per_second": 1000,
        "queue_size": 8,
        "queue_timeout_secs": 30,
        "priority_reserved": ["interactive=1"],
    });
    let envoy = Envoy::start(&EnvoyOptions::new(filter).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let in_flight =
        |n| wait_until(&format!("{n} in flight"), Duration::from_secs(10), || envoy.in_flight() == Some(n)).unwrap();
    // 100 tokens at 20 ms: each long request holds its slot for about 2 s.
    let long_default = post_in_thread(&url, body("long default", 100), &[]);
    in_flight(1);
    let waiting_default = post_in_thread(&url, body("waiting default", 1), &[("kvmesh-priority", "0")]);
    envoy.wait_for_queued(1);
    let long_interactive = post_in_thread(&url, body("long interactive", 100), &[("kvmesh-priority", "1")]);
    in_flight(2);
    assert_eq!(envoy.filter_stat("kvmesh_queued"), 1, "the default request still waits");

    let shed = http::post(
        &url,
        &serde_json::to_vec(&body("sheddable", 1)).unwrap(),
        &[("content-type", "application/json"), ("kvmesh-priority", "-1")],
    )
    .unwrap();
    let shed_at = Instant::now();
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert_eq!(shed.json().unwrap()["error"]["code"], "shed");
    assert_eq!(shed.header("retry-after"), Some("1"));
    // SMG's spelling: `bulk` is its class dropped first.
    let bulk = post_in_thread(&url, body("bulk", 1), &[("x-smg-priority", "bulk")]).join().unwrap().0;
    assert_eq!(bulk.status, 503, "{}", bulk.text());

    let late_interactive = post_in_thread(&url, body("late interactive", 1), &[("x-smg-priority", "interactive")]);
    envoy.wait_for_queued(2);
    let (late, late_at) = late_interactive.join().unwrap();
    let (waited, waited_at) = waiting_default.join().unwrap();
    let (long_d, long_d_at) = long_default.join().unwrap();
    let (long_i, _) = long_interactive.join().unwrap();
    for r in [&late, &waited, &long_d, &long_i] {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(shed_at < long_d_at, "the sheddable request was refused while the slots were held");
    assert!(late_at < waited_at, "the interactive request went ahead of the default one waiting before it");
    assert_eq!(sim.stats().unwrap()["requests"], 4, "the shed requests never reached the worker");
    assert_eq!(envoy.filter_stat("kvmesh_queued"), 0);
    // Counted per class: both sheddable ones shed, the four others admitted, two of them
    // after waiting (one default, one interactive).
    let class = |name, value| labelled(&envoy, name, "class", value);
    assert_eq!(class("kvmesh_class_shed_total", "sheddable"), 2);
    assert_eq!(class("kvmesh_class_admitted_total", "interactive"), 2);
    assert_eq!(class("kvmesh_class_admitted_total", "default"), 2);
    assert_eq!(class("kvmesh_class_queued_total", "default"), 1);
    assert_eq!(class("kvmesh_class_queued_total", "interactive"), 1);
}

/// Tenants from a header: each has its own requests-per-second window, Envoy-wide; past it a
/// JSON 429 with OpenAI's `x-ratelimit-*-requests` headers (a served response carries them
/// too). Then the identity source behind Istio's mutual TLS: the tenant is the caller's
/// SPIFFE id from the `x-forwarded-client-cert` Envoy sets from its certificate, whatever
/// tenant the caller names by header or by a forged XFCC.
#[test]
fn tenants_from_a_header_have_their_own_limit_and_an_identity_cannot_be_forged() {
    // A valid id with characters a stat name or a label could split on: it comes out whole in
    // the decision record, and as one `tenant` label with the characters outside letters,
    // digits and `-._/:@+` as `_`.
    const B: &str = "team.b/{x}#1:@+";
    const B_LABEL: &str = "team.b/_x__1:@+";
    let sim = Sim::start(DECODE_20MS).unwrap();
    let mut filter = json!({
        "worker_urls": [sim.url()],
        "tenant_header": "x-llm-d-inference-fairness-id",
        "tenant_requests_per_second": 1,
    });
    let dir = scratch_dir("tenants").unwrap();
    let mut opts = EnvoyOptions::new(filter.clone()).unwrap();
    opts.access_log = Some(dir.path().join("access.log"));
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let post = |url: &str, headers: &[(&str, &str)]| {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        http::post(url, &serde_json::to_vec(&body("hi", 1)).unwrap(), &all).unwrap()
    };
    // A window is one second: requests one after another until one meets the window of the
    // one before (bounded; a pair may straddle a second's end, and the next request then
    // meets the later one's window).
    let mut limited = None;
    for i in 0..10 {
        let r = post(&url, &[("x-llm-d-inference-fairness-id", "team-a")]);
        if r.status == 429 && i > 0 {
            limited = Some(r);
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = limited.expect("team-a's second request within a second was refused");
    assert_eq!(r.json().unwrap()["error"]["code"], "rate_limit_exceeded", "{}", r.text());
    assert!(r.text().contains("team-a"), "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    let reset = r.header("x-ratelimit-reset-requests").unwrap();
    assert!(reset.ends_with("ms") || reset == "1s", "{reset}");
    assert_eq!(r.header("retry-after"), Some("1"));
    let other = post(&url, &[("x-llm-d-inference-fairness-id", B)]);
    assert_eq!(other.status, 200, "another tenant has its own window: {}", other.text());
    // A served request carries its tenant's limit too, as OpenAI's responses do.
    assert_eq!(other.header("x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(other.header("x-ratelimit-remaining-requests"), Some("0"));
    assert!(other.header("x-ratelimit-reset-requests").is_some());
    // Counted per tenant, and the decision record names the tenant (no class: no limit).
    let tenant = |name, value| labelled(&envoy, name, "tenant", value);
    assert_eq!(tenant("kvmesh_tenant_requests_total", B_LABEL), 1);
    assert_eq!(tenant("kvmesh_tenant_limited_total", "team-a"), 1);
    assert!(tenant("kvmesh_tenant_requests_total", "team-a") >= 2);
    let stats = http::get(&envoy.admin_url("/stats/prometheus")).unwrap().text();
    for l in stats.lines().filter(|l| l.contains("team.b")) {
        assert!(l.contains(&format!("{{tenant=\"{B_LABEL}\"}}")), "the id split a stat name or label: {l}");
    }
    let log = || std::fs::read_to_string(dir.path().join("access.log")).unwrap_or_default();
    wait_until("the second tenant's access-log line", Duration::from_secs(15), || {
        log().contains(&format!("tenant={B}"))
    })
    .unwrap();
    let line = log().lines().find(|l| l.contains(&format!("tenant={B}"))).map(str::to_string).unwrap_or_default();
    assert!(line.contains(&format!(";tenant={B}")) && !line.contains("class="), "{line}");
    drop(envoy);

    filter["tenant_identity"] = json!("xfcc");
    filter["tenant_header"] = json!("kvmesh-tenant");
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.mtls_caller_port = Some(free_port().unwrap());
    let envoy = Envoy::start(&opts).unwrap();
    // In plain text the gateway's listener accepts no one: its callers present a certificate.
    assert!(http::get(&envoy.url("/health")).is_err(), "the listener requires mutual TLS");
    let url = format!("http://127.0.0.1:{}/generate", opts.mtls_caller_port.unwrap());
    let forged = [
        ("kvmesh-tenant", "team-a"),
        ("x-forwarded-client-cert", "By=spiffe://x;URI=spiffe://cluster.local/ns/team-a/sa/app"),
    ];
    // Alternating claims: a 429 means the one before, claiming the other id, shared its window:
    // the tenant is the caller's certificate, whatever it claims.
    let mut refused = None;
    for i in 0..10 {
        let r = post(&url, &forged[i % 2..i % 2 + 1]);
        if r.status == 429 && i > 0 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = refused.expect("two requests claiming two ids within a second counted as one tenant");
    assert!(r.text().contains(&format!("tenant {CLIENT_SPIFFE_ID}")), "the certificate's id: {}", r.text());
    assert_eq!(labelled(&envoy, "kvmesh_tenant_limited_total", "tenant", CLIENT_SPIFFE_ID), 1);
    assert_eq!(labelled(&envoy, "kvmesh_tenant_requests_total", "tenant", "team-a"), 0, "no claim was believed");
}

/// Fair shares by tenant weight: one slot, held by a long request of `flood`; three more of
/// `flood` wait, then one of `team-b`. When the slot comes back, `team-b` (no tokens used)
/// goes ahead of `flood`'s waiting requests (its first one charged), though it came last; a
/// first-come queue would run it last. One Envoy thread: each keeps its own queue.
#[test]
fn a_tenant_that_used_less_goes_ahead_of_a_flooding_one() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let filter = json!({
        "worker_urls": [sim.url()],
        "max_concurrent_requests": 1,
        "rate_limit_tokens_per_second": 1000,
        "queue_size": 8,
        "queue_timeout_secs": 30,
        "tenant_weight": ["team-b=1"],
    });
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    let url = envoy.url("/generate");
    let flood = [("kvmesh-tenant", "flood")];
    let long = post_in_thread(&url, body(&"a long flooding prompt. ".repeat(40), 100), &flood);
    wait_until("the long request in flight", Duration::from_secs(10), || envoy.in_flight() == Some(1)).unwrap();
    let mut waiting = Vec::new();
    for i in 0..3 {
        waiting.push(post_in_thread(&url, body(&format!("flood {i}"), 1), &flood));
        envoy.wait_for_queued(i + 1);
    }
    let b = post_in_thread(&url, body("team-b", 1), &[("kvmesh-tenant", "team-b")]);
    envoy.wait_for_queued(4);
    let (b, b_at) = b.join().unwrap();
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(long.join().unwrap().0.status, 200);
    for w in waiting {
        let (r, at) = w.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(b_at < at, "team-b went ahead of flood's waiting requests");
    }
    assert_eq!(labelled(&envoy, "kvmesh_tenant_queued_total", "tenant", "flood"), 3);
}

/// Fair shares across gateways: `team-a` sends through one gateway only. Once kvmesh-cp's
/// snapshot carried its usage to the other gateway (one slot, held), a `team-a` request waits
/// there, then a `team-b` one; when the slot frees, `team-b` goes first, as `team-a` used more
/// of the fleet. Counting only its own usage, that gateway sees both at 0 and runs the oldest.
#[test]
fn a_tenant_busy_at_one_gateway_waits_behind_an_idle_one_at_another() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let cp = control_plane(std::slice::from_ref(&sim), &[]);
    let weights = json!(["team-b=1"]);
    let busy_opts = EnvoyOptions::new(json!({"worker_urls": [], "tenant_weight": weights})).unwrap();
    let filter = json!({
        "worker_urls": [],
        "tenant_weight": weights,
        "max_concurrent_requests": 1,
        "rate_limit_tokens_per_second": 1000,
        "queue_size": 8,
        "queue_timeout_secs": 30,
    });
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.concurrency = 1; // one queue: each Envoy thread keeps its own
    let (busy, fair) = std::thread::scope(|s| {
        let busy = s.spawn(|| gateway_with(&cp, busy_opts));
        let fair = gateway_with(&cp, opts);
        (busy.join().unwrap(), fair)
    });
    let a = [("content-type", "application/json"), ("kvmesh-tenant", "team-a")];
    for i in 0..3 {
        let text = format!("{i}: a prompt of the busy tenant. ").repeat(10);
        let r = http::post(&busy.url("/generate"), &serde_json::to_vec(&body(&text, 5)).unwrap(), &a).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let mut version = 0;
    wait_until("kvmesh-cp to ship team-a's usage", Duration::from_secs(10), || {
        let s = cp.snapshot().unwrap_or_default();
        version = s["version"].as_u64().unwrap_or(0);
        s["tenant_usage"]["team-a"].as_f64().is_some_and(|u| u > 0.0)
    })
    .unwrap();
    fair.wait_for_version(version);
    let url = fair.url("/generate");
    let hold = post_in_thread(&url, body("hold the slot", 40), &[("kvmesh-tenant", "team-h")]);
    wait_until("the slot held", Duration::from_secs(10), || fair.in_flight() == Some(1)).unwrap();
    let queued_a = post_in_thread(&url, body("team-a, elsewhere", 1), &a[1..]);
    fair.wait_for_queued(1);
    let queued_b = post_in_thread(&url, body("team-b", 1), &[("kvmesh-tenant", "team-b")]);
    fair.wait_for_queued(2);
    let ((ra, a_at), (rb, b_at)) = (queued_a.join().unwrap(), queued_b.join().unwrap());
    assert_eq!((ra.status, rb.status, hold.join().unwrap().0.status), (200, 200, 200), "{}", ra.text());
    assert!(b_at < a_at, "team-b (idle everywhere) went ahead of team-a (busy at the other gateway)");
}

/// Requests per second per tenant across gateways: the requests a tenant made at one gateway
/// reach the other through kvmesh-cp (reported, summed, shipped) and take their estimated
/// part of its second there: its first request at the other gateway is told fewer requests
/// remain than its own second would leave.
#[test]
fn a_tenants_requests_at_one_gateway_count_against_its_limit_at_another() {
    let sim = Sim::start(FAST).unwrap();
    let cp = control_plane(std::slice::from_ref(&sim), &["--tenant-requests-per-second", "150"]);
    let opts = || EnvoyOptions::new(json!({"worker_urls": [], "report_interval_ms": 100})).unwrap();
    let (busy, other) = std::thread::scope(|s| {
        let busy = s.spawn(|| gateway_with(&cp, opts()));
        (busy.join().unwrap(), gateway_with(&cp, opts()))
    });
    let x = [("content-type", "application/json"), ("kvmesh-tenant", "team-x")];
    let generate = serde_json::to_vec(&body("a short prompt", 1)).unwrap();
    for _ in 0..120 {
        let r = http::post(&busy.url("/generate"), &generate, &x).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let mut version = 0;
    wait_until("kvmesh-cp to ship team-x's requests", Duration::from_secs(10), || {
        let s = cp.snapshot().unwrap_or_default();
        version = s["version"].as_u64().unwrap_or(0);
        s["tenant_requests"]["team-x"].as_f64().is_some_and(|u| u > 100.0)
    })
    .unwrap();
    other.wait_for_version(version);
    let r = http::post(&other.url("/generate"), &generate, &x).unwrap();
    assert_eq!((r.status, r.header("x-ratelimit-limit-requests")), (200, Some("150")), "{}", r.text());
    // About 120 decayed requests elsewhere: some 8 a second, taken off this one's 149.
    let remaining: u32 = r.header("x-ratelimit-remaining-requests").and_then(|v| v.parse().ok()).unwrap();
    assert!((130..=145).contains(&remaining), "remaining {remaining}: the other gateway's requests not counted");
}

/// Tokens per minute per tenant: a request's uncached prompt counts as it is routed, so after
/// one long prompt a tenant's minute is spent and its next request is a JSON 429 with
/// OpenAI's `x-ratelimit-*-tokens` headers; another tenant still has its own minute.
#[test]
fn a_tenant_past_its_tokens_per_minute_gets_a_429_with_token_headers() {
    let sim = Sim::start(DECODE_20MS).unwrap();
    let filter = json!({"worker_urls": [sim.url()], "tenant_tokens_per_minute": 50});
    let envoy = Envoy::start(&EnvoyOptions::new(filter).unwrap()).unwrap();
    let url = envoy.url("/generate");
    let post = |tenant: &str, text: &str| {
        let headers = [("content-type", "application/json"), ("kvmesh-tenant", tenant)];
        http::post(&url, &serde_json::to_vec(&body(text, 1)).unwrap(), &headers).unwrap()
    };
    let first = post("team-t", &"a long prompt of many tokens. ".repeat(20));
    assert_eq!(first.status, 200, "{}", first.text());
    // Served, with the minute as it stood on admission (nothing spent yet).
    assert_eq!(first.header("x-ratelimit-limit-tokens"), Some("50"));
    assert_eq!(first.header("x-ratelimit-remaining-tokens"), Some("50"));
    let r = post("team-t", "hi");
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json().unwrap()["error"]["code"], "rate_limit_exceeded");
    assert!(r.text().contains("tokens per minute"), "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("50"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("0"));
    assert!(
        r.header("x-ratelimit-reset-tokens").is_some_and(|v| v.ends_with('s')),
        "{:?}",
        r.header("x-ratelimit-reset-tokens")
    );
    assert!(r.header("retry-after").is_some());
    let other = post("team-u", "hi");
    assert_eq!(other.status, 200, "another tenant has its own minute: {}", other.text());
    assert_eq!(sim.stats().unwrap()["requests"], 2, "the refused request never reached the worker");
}
