//! What a client or a worker wrote, kept from the next reader: trace context and request ids
//! on every path, secrets in passthrough answers.

use super::*;

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const FORGED: &str = "x upstream=6.6.6.6:1 kvmesh=\"policy=forged\"";

#[test]
fn a_malformed_trace_context_or_request_id_goes_nowhere_on_any_path() {
    let host = MockHost::new();
    let gw = gateway(&host, PD);
    for (method, path) in [("POST", "/generate"), ("GET", "/health"), ("GET", "/nowhere")] {
        let body = r#"{"text":"hi"}"#;
        host.request(
            method,
            path,
            &[("traceparent", FORGED), ("tracestate", "a=b"), ("x-request-id", FORGED)],
            body.as_bytes(),
        );
        let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
        f.on_request_headers(&host, method != "POST");
        assert_eq!((host.request_header("traceparent"), host.request_header("tracestate")), (None, None), "{path}");
        let id = host.request_header("x-request-id").unwrap_or_default();
        assert_eq!(id.len(), 32, "{path}: {id}");
        if method == "POST" {
            assert_eq!(f.on_request_body(&host, body.len(), true), Action::Continue);
            let headers = callout(&host).headers;
            assert!(!headers.iter().any(|(n, _)| n == "traceparent" || n == "tracestate"), "{headers:?}");
            assert!(headers.contains(&("x-request-id".into(), id)));
        }
        f.on_log(&host);
    }
    // Well formed: left alone. Sent twice: neither is believed.
    host.request("GET", "/health", &[("traceparent", TP), ("x-request-id", "mine-1")], b"");
    RequestFilter::new(Some(Rc::clone(&gw))).on_request_headers(&host, true);
    assert_eq!(host.request_header("traceparent").as_deref(), Some(TP));
    assert_eq!(host.request_header("x-request-id").as_deref(), Some("mine-1"));
    host.request(
        "GET",
        "/health",
        &[("traceparent", TP), ("traceparent", TP), ("x-request-id", "a"), ("x-request-id", "b")],
        b"",
    );
    RequestFilter::new(Some(Rc::clone(&gw))).on_request_headers(&host, true);
    assert_eq!(host.request_header("traceparent"), None);
    assert_eq!(host.request_header("x-request-id").map(|id| id.len()), Some(32));
}

#[test]
fn a_passthrough_answer_loses_its_secrets_and_the_workers_key() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001"],"worker_api_key":"sk-w"}"#);
    host.request("GET", "/get_server_info", &[], b"");
    let mut f = RequestFilter::new(Some(Rc::clone(&gw)));
    assert_eq!(f.on_request_headers(&host, true), Action::Continue);
    let answer = br#"{"api_key":"sk-w","admin_api_key":"adm","model_path":"m","note":"started with --api-key sk-w"}"#;
    host.set_response(200, answer);
    host.set_response_header("content-length", Some(&answer.len().to_string())).unwrap();
    assert_eq!(f.on_response_headers(&host), Action::Continue);
    assert_eq!(host.response_header("content-length"), None, "the answer may change length");
    assert_eq!(f.on_response_body(&host, 10, false), Action::Pause, "read through whole");
    assert_eq!(f.on_response_body(&host, answer.len(), true), Action::Continue);
    let out: serde_json::Value = serde_json::from_slice(&host.response_body.borrow()).unwrap();
    assert_eq!(out["api_key"], "<redacted>");
    assert_eq!(out["admin_api_key"], "<redacted>");
    assert_eq!(out["note"], "started with --api-key <redacted>");
    assert_eq!(out["model_path"], "m");
    f.on_log(&host);
}

#[test]
fn a_clients_rank_reaches_no_worker_in_any_mode() {
    let host = MockHost::new();
    for config in [REGULAR, PD] {
        let gw = gateway(&host, config);
        let body = r#"{"text":"hi","data_parallel_rank":3}"#;
        let (mut f, action) = send(&host, &gw, "/generate", body);
        assert_eq!(action, Action::Continue, "{config}");
        let sent = host.request_body.borrow().clone();
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!((v.get("data_parallel_rank"), v["text"].as_str()), (None, Some("hi")), "{config}");
        assert_eq!(host.request_header("content-length"), Some(sent.len().to_string()));
        if config == PD {
            let leg: serde_json::Value = serde_json::from_slice(&callout(&host).body).unwrap();
            assert_eq!(leg.get("data_parallel_rank"), None);
        }
        f.on_log(&host);
    }
}
