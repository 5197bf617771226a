//! Host calls per request: every one crosses the Wasm boundary, and the ones returning bytes
//! cost about ten times the others (docs/perf-notes.md). These budgets fail on a new one.

use super::*;

/// Every host call crosses the Wasm boundary in Envoy, and the ones that return bytes
/// (headers, bodies, shared data, properties) also allocate in the VM: a routed request
/// makes few, and none it can do without. A regression here is a cost on every request.
#[test]
fn one_request_makes_only_the_host_calls_it_needs() {
    for alone in [true, false] {
        let host = MockHost::new();
        let gw = gateway(&host, REGULAR);
        // Two heartbeats running: the Envoy's only VM, or one of two.
        if !alone {
            crate::shared::VmLedger::register(&host, 7);
        }
        gw.borrow_mut().ledger_mut().serve(&host, 0);
        gw.borrow_mut().heartbeat(&host, 1_000);
        gw.borrow_mut().heartbeat(&host, 2_000);
        assert_eq!(gw.borrow().ledger().alone(), alone);
        for round in 0..3 {
            host.calls.borrow_mut().clear();
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hello there {round}"}}]}}"#);
            let len = body.len().to_string();
            host.request(
                "POST",
                "/v1/chat/completions",
                &[("content-length", &len), ("x-request-id", "r1")],
                body.as_bytes(),
            );
            let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
            assert_eq!(f.on_request_headers(&host, false), Action::Pause);
            assert_eq!(f.on_request_body(&host, body.len(), true), Action::Continue);
            let resp = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}"#;
            host.set_response(200, resp);
            *host.upstream.borrow_mut() = host.request_header(DST_HEADER);
            f.on_response_headers(&host);
            f.on_response_body(&host, resp.len(), true);
            f.on_log(&host);
            let calls = host.calls.borrow();
            let n = |name: &str| calls.iter().filter(|c| **c == name).count();
            // A 2xx from the chosen worker needs no code details from Envoy.
            assert_eq!(n("response_code_details"), 0, "round {round}: {calls:?}");
            // Shared data: a VM alone touches none (its tick writes what it routed); with
            // others, the counts are read once to decide and written at commit (with the log
            // slot of the new blocks, and the ends since the last write), and the end of the
            // stream, the VM's last in flight, is written at once (a read and a
            // compare-and-swap; with others in flight it waits for the next commit). A read
            // costs more than a write: Envoy copies the value into the VM through its
            // allocator.
            let expected = if alone { (0, 0) } else { (2, 3) };
            assert_eq!((n("get"), n("set")), expected, "alone {alone}, round {round}: {calls:?}");
            // Decision, commit, response headers, the end of the body (to time an answer that
            // carries no e2e_latency); not the end of the stream once the worker answered.
            assert_eq!(n("now_nanos"), 4, "round {round}: {calls:?}");
            assert_eq!(n("set_filter_state"), 1, "round {round}: the decision record, once");
            assert!(calls.len() <= 24, "round {round}: {} host calls: {calls:?}", calls.len());
        }
    }
}

/// A PD request (SGLang's protocol, no logprobs to merge): the client's headers are read once
/// (the prefill leg gets them from that read), the body is rewritten once for both legs, and
/// without a control plane to report completion metrics to nothing reads the response body.
#[test]
fn one_pd_request_makes_only_the_host_calls_it_needs() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    gw.borrow_mut().ledger_mut().serve(&host, 0);
    gw.borrow_mut().heartbeat(&host, 1_000);
    gw.borrow_mut().heartbeat(&host, 2_000);
    for round in 0..2 {
        host.calls.borrow_mut().clear();
        let mut f = pd_send(&host, &gw, r#"{"text":"hi there"}"#);
        answer_prefill(&host, &mut f, Some(200), "{}");
        host.set_response(200, DECODE_ANSWER.as_bytes());
        f.on_response_headers(&host);
        f.on_response_body(&host, DECODE_ANSWER.len(), true);
        f.on_log(&host);
        let calls = host.calls.borrow();
        let n = |name: &str| calls.iter().filter(|c| **c == name).count();
        let counts = (n("request_headers"), n("set_request_body"), n("dispatch"), n("response_body"));
        assert_eq!(counts, (1, 1, 1, 0), "round {round}: {calls:?}");
        assert_eq!((n("get"), n("set")), (0, 0), "round {round}: a VM alone: {calls:?}");
    }
    // With a control plane, the decode answer's completion metrics are read for its reports.
    let host = MockHost::new();
    let with_cp = PD.replacen('{', r#"{"control_plane_cluster":"cp","#, 1);
    let gw = gateway(&host, &with_cp);
    let mut f = pd_send(&host, &gw, r#"{"text":"hi there"}"#);
    answer_prefill(&host, &mut f, Some(200), "{}");
    host.set_response(200, DECODE_ANSWER.as_bytes());
    f.on_response_headers(&host);
    host.calls.borrow_mut().clear();
    f.on_response_body(&host, DECODE_ANSWER.len(), true);
    assert_eq!(host.calls.borrow().iter().filter(|c| **c == "response_body").count(), 1);
}

/// With a control plane, Envoy's main-thread VM may hold the streams and publish other
/// gateways' loads and inserts: a VM routing alone still reads them before each decision.
#[test]
fn a_vm_alone_with_a_control_plane_reads_the_shared_view_per_request() {
    let host = MockHost::new();
    let with_cp = REGULAR.replacen('{', r#"{"control_plane_cluster":"cp","#, 1);
    let gw = gateway(&host, &with_cp);
    gw.borrow_mut().ledger_mut().serve(&host, 0);
    gw.borrow_mut().heartbeat(&host, 1_000);
    gw.borrow_mut().heartbeat(&host, 2_000);
    assert!(gw.borrow().ledger().alone());
    host.calls.borrow_mut().clear();
    send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    assert!(host.calls.borrow().contains(&"get"), "{:?}", host.calls.borrow());
}
