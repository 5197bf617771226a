//! The decision record in the request's filter state (`gateway/record.rs`): written once as a
//! decision commits, never for a request answered locally or one whose decision could not be
//! applied; a failover names the worker that answered under a key of its own. And W3C trace
//! context on every leg the gateway sends itself.

use super::*;
use crate::host::mock::MockHost;
use kvmesh_core::Config;
use kvmesh_proto::v1 as proto;

fn gateway(host: &MockHost, json: &str) -> Rc<RefCell<Gateway>> {
    Rc::new(RefCell::new(Gateway::new(Config::from_json(json.as_bytes()).unwrap(), host, 9)))
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Runs the request side of a POST (with trace context) through a fresh filter.
fn send(host: &MockHost, gw: &Rc<RefCell<Gateway>>, path: &str, body: &str) -> (RequestFilter, Action) {
    let len = body.len().to_string();
    let headers = [("content-length", len.as_str()), ("traceparent", TRACEPARENT), ("tracestate", "k=v")];
    host.request("POST", path, &headers, body.as_bytes());
    let mut f = RequestFilter::new(Some(Rc::clone(gw)));
    assert_eq!(f.on_request_headers(host, false), Action::Pause);
    let action = f.on_request_body(host, body.len(), true);
    (f, action)
}

fn record(host: &MockHost) -> String {
    host.filter_state(DECISION_KEY).expect("a decision record")
}

fn writes(host: &MockHost) -> usize {
    host.calls.borrow().iter().filter(|c| **c == "set_filter_state").count()
}

#[test]
fn a_routed_request_records_its_decision_once() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"]}"#);
    let body = format!(r#"{{"text":"{}"}}"#, "a prompt long enough to fill a few index blocks ".repeat(8));
    let (mut f, _) = send(&host, &gw, "/generate", &body);
    let worker = host.request_header(DST_HEADER).unwrap();
    assert_eq!(record(&host), format!("policy=cache_aware;worker={worker};cached_bytes=0"));
    assert_eq!(writes(&host), 1);
    host.set_response(200, b"{}");
    *host.upstream.borrow_mut() = Some(worker.clone());
    f.on_response_headers(&host);
    f.on_log(&host);
    assert_eq!(writes(&host), 1, "nothing more for a request its worker answered");
    assert_eq!(host.filter_state(FAILOVER_KEY), None);
    // The same prompt again: the same worker, believed to hold all of it.
    send(&host, &gw, "/generate", &body);
    let again = record(&host);
    assert!(again.starts_with(&format!("policy=cache_aware;worker={worker};cached_bytes=")), "{again}");
    let cached: usize = again.rsplit('=').next().unwrap().parse().unwrap();
    assert!(cached >= body.len() - 20, "{again}");
}

#[test]
fn a_failover_names_the_worker_that_answered_and_keeps_the_decision() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002"]}"#);
    let (mut f, _) = send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    let chosen = host.request_header(DST_HEADER).unwrap();
    let other = host.request_header(ENDPOINTS_HEADER).unwrap().split(',').nth(1).unwrap().to_string();
    host.set_response(200, b"{}");
    *host.upstream.borrow_mut() = Some(other.clone());
    f.on_response_headers(&host);
    assert_eq!(host.filter_state(FAILOVER_KEY), Some(other));
    assert!(record(&host).contains(&format!(";worker={chosen};")), "the filter's choice stays on record");
    assert_eq!(writes(&host), 2);
}

#[test]
fn no_record_for_a_local_reply_or_a_decision_that_could_not_be_applied() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"worker_urls":["http://127.0.0.1:30001"]}"#);
    send(&host, &gw, "/generate", "{not json");
    assert_eq!(host.reply().map(|r| r.status), Some(400));
    host.refuse_headers.set(true);
    send(&host, &gw, "/generate", r#"{"text":"hello"}"#);
    assert_eq!(host.reply().map(|r| r.status), Some(500));
    assert_eq!(writes(&host), 0);
}

#[test]
fn a_pd_split_records_both_workers_and_the_deciders_outcome() {
    let host = MockHost::new();
    let pd = r#"{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998]],
        "decode":["http://127.0.0.1:30003"]}"#;
    let gw = gateway(&host, pd);
    send(&host, &gw, "/generate", r#"{"text":"hi"}"#);
    // The rid both legs carry: what kvmesh-cp's `/abort_request` can stop it by.
    let sent: serde_json::Value = serde_json::from_slice(&host.callouts.borrow().last().unwrap().body).unwrap();
    assert_eq!(
        record(&host),
        format!(
            "policy=power_of_two;worker=127.0.0.1:30003;cached_bytes=0;decider=split;prefill=127.0.0.1:30001;\
             prefill_policy=cache_aware;prefill_cached_bytes=0;rid={}",
            sent["rid"].as_str().unwrap()
        )
    );
    // The prefill callout carries the client's trace context (the decode leg goes through
    // Envoy's router with the request's own headers).
    let headers = host.callouts.borrow().last().unwrap().headers.clone();
    assert!(headers.contains(&("traceparent".into(), TRACEPARENT.into())), "{headers:?}");
    assert!(headers.contains(&("tracestate".into(), "k=v".into())), "{headers:?}");
    assert_eq!(writes(&host), 1);
}

#[test]
fn a_vllm_first_leg_carries_the_trace_context_and_the_decode_leg_keeps_it() {
    let host = MockHost::new();
    let json = r#"{"pd_disaggregation":true,"pd_protocol":"vllm","prefill":[["http://127.0.0.1:30001",null]],
        "decode":["http://127.0.0.1:30003"]}"#;
    let gw = gateway(&host, json);
    let body = r#"{"model":"m","prompt":"hello","max_tokens":4}"#;
    let (mut f, action) = send(&host, &gw, "/v1/completions", body);
    assert_eq!(action, Action::Pause, "held for its prefill leg");
    assert!(record(&host).contains(";decider=split;prefill=127.0.0.1:30001;"), "{}", record(&host));
    let leg = host.callouts.borrow().last().unwrap().clone();
    assert!(leg.headers.contains(&("traceparent".into(), TRACEPARENT.into())), "{:?}", leg.headers);
    let answer = r#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#;
    *host.callout_answer.borrow_mut() = (Some(200), answer.as_bytes().to_vec());
    f.on_callout_response(&host, leg.token, answer.len());
    assert_eq!(host.request_header("traceparent").as_deref(), Some(TRACEPARENT), "the decode leg's own");
    assert_eq!(writes(&host), 1);
}

#[test]
fn the_record_names_the_model_pool() {
    let host = MockHost::new();
    let gw = gateway(&host, r#"{"control_plane_cluster":"cp","worker_urls":["http://127.0.0.1:1"]}"#);
    let served = |id: &str| proto::ServedModel { id: id.into(), parent: String::new(), owned_by: "vllm".into() };
    let worker = |id: u32, port: u16, model: &str| proto::Worker {
        id,
        url: format!("http://127.0.0.1:{port}"),
        healthy: true,
        models: vec![served(model)],
        ..Default::default()
    };
    let snapshot = proto::Snapshot {
        version: 1,
        full: true,
        workers: vec![worker(10, 20, "a"), worker(11, 21, "b")],
        workers_changed: true,
        ..Default::default()
    };
    gw.borrow_mut().apply_snapshot(&host, &snapshot);
    send(&host, &gw, "/v1/chat/completions", r#"{"model":"b","messages":[{"role":"user","content":"x"}]}"#);
    assert_eq!(record(&host), "policy=cache_aware;worker=127.0.0.1:21;cached_bytes=0;model=b");
}
