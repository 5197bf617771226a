use super::*;
use crate::host::mock::MockHost;
use crate::link::LEASE_MS;
use crate::request::RequestFilter;
use kvmesh_proto::v1::{self as proto, ReportBatch};
use kvmesh_proto::Message;

const CONFIG: &str = r#"{"control_plane_cluster":"kvmesh_cp","report_interval_ms":20}"#;

fn plugin(host: &MockHost, seed: u64) -> Plugin {
    let mut p = Plugin::default();
    p.configure(host, CONFIG.as_bytes(), seed).unwrap();
    p
}

#[test]
fn each_vm_records_its_memory_once_a_second() {
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    host.now_ms.set(5_000);
    for step in 0..150 {
        host.now_ms.set(5_000 + step * 20); // 3 s of 20 ms ticks
        p.on_tick(&host);
    }
    assert_eq!(host.metrics.borrow().get(&Metric::VmMemory).cloned(), Some(vec![1 << 20; 3]));
}

fn snapshot(version: u64, ports: &[u16]) -> Vec<u8> {
    let workers = ports
        .iter()
        .enumerate()
        .map(|(i, port)| proto::Worker {
            id: i as u32,
            url: format!("http://127.0.0.1:{port}"),
            healthy: true,
            ..Default::default()
        })
        .collect();
    proto::Snapshot { version, full: true, workers, workers_changed: true, ..Default::default() }.encode_to_vec()
}

fn deliver(host: &MockHost, p: &mut Plugin, token: u32, message: &[u8]) {
    *host.grpc_inbox.borrow_mut() = message.to_vec();
    p.on_grpc_message(host, token, message.len());
}

fn reports(host: &MockHost, token: u32) -> Vec<ReportBatch> {
    host.grpc_sent
        .borrow()
        .iter()
        .filter(|(t, _)| *t == token)
        .map(|(_, m)| ReportBatch::decode(m.as_slice()).unwrap())
        .collect()
}

fn route(host: &MockHost, p: &Plugin, text: &str) -> Option<String> {
    let body = format!(r#"{{"text":"{text}"}}"#);
    host.request("POST", "/generate", &[], body.as_bytes());
    let mut f = RequestFilter::new(p.gateway());
    f.on_request_headers(host, false);
    f.on_request_body(host, body.len(), true);
    let dst = host.request_header(crate::request::DST_HEADER);
    f.on_log(host);
    dst
}

#[test]
fn a_bad_configuration_is_refused_with_the_field_named() {
    let host = MockHost::new();
    let e = Plugin::default().configure(&host, br#"{"cache_threshold":2}"#, 1).unwrap_err();
    assert!(e.contains("`cache_threshold`"), "{e}");
}

/// The native build's worker threads: never the lease holder, never a stream, no index
/// gauge of their own; they route on the table the stream owner shares.
#[test]
fn a_follower_routes_on_the_owners_table_and_never_holds_the_streams() {
    let owner_host = MockHost::new();
    let mut owner = plugin(&owner_host, 1);
    owner.on_tick(&owner_host);
    let watch = owner_host.grpc_opened.borrow()[0].0;
    deliver(&owner_host, &mut owner, watch, &snapshot(4, &[30001]));
    let host = owner_host.vm();
    let mut follower = plugin(&host, 2);
    follower.follow();
    for _ in 0..200 {
        host.advance_ms(20); // 4 s: past the owner's lease, which nobody renews meanwhile
        follower.on_tick(&host);
    }
    assert!(host.grpc_opened.borrow().is_empty() && host.grpc_attempts.get() == 0, "no stream");
    assert_eq!(crate::shared::Lease::owner(host.store.as_ref()), Some(owner_vm(&owner)), "the lease untouched");
    assert_eq!(route(&host, &follower, &"r".repeat(100)).as_deref(), Some("127.0.0.1:30001"));
    assert!(!host.metrics.borrow().contains_key(&Metric::IndexBlocks), "the owner's gauge alone");
}

fn owner_vm(p: &Plugin) -> u32 {
    p.gateway().unwrap().borrow().ledger().vm()
}

#[test]
fn the_lease_holder_connects_routes_on_snapshots_and_reports() {
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    assert_eq!(route(&host, &p, "x"), None, "no workers before the first snapshot");
    p.on_tick(&host);
    let opened = host.grpc_opened.borrow().clone();
    assert_eq!(opened.iter().map(|(_, m)| m.as_str()).collect::<Vec<_>>(), vec!["kvmesh_cp/Watch", "kvmesh_cp/Report"]);
    let (watch, report) = (opened[0].0, opened[1].0);
    let watch_request = proto::WatchRequest::decode(host.grpc_sent.borrow()[0].1.as_slice()).unwrap();
    assert!(watch_request.gateway_id.starts_with("test-node/"), "{}", watch_request.gateway_id);
    assert!(reports(&host, report).is_empty(), "nothing reported before the table arrives");
    deliver(&host, &mut p, watch, &snapshot(4, &[30001]));
    assert_eq!(reports(&host, report).len(), 1, "the full report follows the first snapshot");
    assert_eq!(host.metrics.borrow()[&Metric::SnapshotVersion], vec![4]);
    assert_eq!(route(&host, &p, &"r".repeat(100)).as_deref(), Some("127.0.0.1:30001"));
    host.advance_ms(20);
    p.on_tick(&host);
    let sent = reports(&host, report);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].inserts.len(), 1, "the routed prefix is reported");
    assert_eq!(sent[1].inserts[0].hashes.len(), 4);
    host.advance_ms(20);
    p.on_tick(&host);
    assert_eq!(reports(&host, report).len(), 2, "nothing new: no report until counts are due");
    host.advance_ms(1_000);
    p.on_tick(&host);
    let last = reports(&host, report).pop().unwrap();
    assert!(last.inserts.is_empty() && last.counts.len() == 1, "counts at least once a second");
}

#[test]
fn a_closed_stream_is_reopened_after_backoff() {
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    p.on_tick(&host);
    let (watch, report) = (host.grpc_opened.borrow()[0].0, host.grpc_opened.borrow()[1].0);
    p.on_grpc_close(&host, watch, 14);
    assert_eq!(*host.grpc_cancelled.borrow(), vec![report]);
    host.advance_ms(99);
    p.on_tick(&host);
    assert_eq!(host.grpc_opened.borrow().len(), 2, "waits for the backoff");
    host.advance_ms(1);
    p.on_tick(&host);
    assert_eq!(host.grpc_opened.borrow().len(), 4, "reconnected");
}

#[test]
fn an_unreachable_control_plane_is_retried_with_backoff() {
    let host = MockHost::new();
    host.refuse_grpc.set(true);
    let mut p = plugin(&host, 1);
    // 8 s of 20 ms ticks: attempts at 0, 100, 300, 700 and 1500 ms, then every second (the
    // cap) to 7500 ms.
    for _ in 0..400 {
        p.on_tick(&host);
        host.advance_ms(20);
    }
    assert_eq!(host.grpc_attempts.get(), 11);
    assert!(host.grpc_opened.borrow().is_empty());
    host.refuse_grpc.set(false);
    host.advance_ms(1_000);
    p.on_tick(&host);
    assert_eq!(host.grpc_opened.borrow().len(), 2, "connects once the control plane is back");
}

#[test]
fn one_vm_holds_the_streams_and_another_takes_over_when_it_stops_ticking() {
    let a_host = MockHost::new();
    let b_host = a_host.vm();
    let mut a = plugin(&a_host, 1);
    let mut b = plugin(&b_host, 2);
    a.on_tick(&a_host);
    b.on_tick(&b_host);
    assert_eq!(a_host.grpc_opened.borrow().len(), 2);
    assert!(b_host.grpc_opened.borrow().is_empty(), "the lease is a's");
    a.on_tick(&a_host);
    b.on_tick(&b_host);
    assert!(a_host.metric_count(Metric::IndexBlocks) > 0, "the owner shows its index size");
    // Only the owner queues inserts for reports: b's queue would never be sent.
    let a_watch = a_host.grpc_opened.borrow()[0].0;
    deliver(&a_host, &mut a, a_watch, &snapshot(1, &[30001]));
    b.on_tick(&b_host);
    for i in 0..5 {
        assert!(route(&b_host, &b, &format!("routed on b {i} {}", "x".repeat(64))).is_some());
    }
    assert_eq!(b.gateway().unwrap().borrow_mut().publisher().unreported_hashes(), 0, "a standby VM queues nothing");
    a_host.advance_ms(20);
    b_host.advance_ms(20);
    a.on_tick(&a_host);
    let a_report = a_host.grpc_opened.borrow()[1].0;
    let reported: usize = reports(&a_host, a_report).iter().flat_map(|r| &r.inserts).map(|i| i.hashes.len()).sum();
    assert!(reported >= 15, "the owner reports b's inserts from the delta log: {reported}");
    assert_eq!(b_host.metric_count(Metric::IndexBlocks), 0, "an idle VM's stale size is never shown");
    // a stops ticking (stuck, or replaced); the lease lapses.
    b_host.advance_ms(LEASE_MS);
    b.on_tick(&b_host);
    assert_eq!(b_host.grpc_opened.borrow().len(), 2, "b took over");
    // a comes back: it has lost the lease and closes its streams.
    a_host.advance_ms(LEASE_MS + 20);
    a.on_tick(&a_host);
    assert_eq!(a_host.grpc_cancelled.borrow().len(), 2);
}

#[test]
fn the_token_goes_out_as_authorization_metadata_on_both_streams() {
    let host = MockHost::new();
    let mut p = Plugin::default();
    let config = r#"{"control_plane_cluster":"kvmesh_cp","control_plane_token":"tok-123"}"#;
    p.configure(&host, config.as_bytes(), 1).unwrap();
    p.on_tick(&host);
    let metadata = host.grpc_metadata.borrow().clone();
    assert_eq!(metadata.len(), 2, "watch and report");
    for (_, m) in &metadata {
        assert_eq!(m, &vec![("authorization".to_string(), b"Bearer tok-123".to_vec())]);
    }
    // Without a token, no credential is sent.
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    p.on_tick(&host);
    assert!(host.grpc_metadata.borrow().iter().all(|(_, m)| m.is_empty()));
}

/// The counts of an Envoy are cumulative in shared data; whichever VM holds the stream
/// reports them under the one id of the Envoy, so the control plane (which adds the
/// differences per id) counts each request once when the lease moves.
#[test]
fn one_id_per_envoy_across_a_lease_move_so_counts_are_never_doubled() {
    let a_host = MockHost::new();
    let b_host = a_host.vm();
    let mut a = plugin(&a_host, 1);
    let mut b = plugin(&b_host, 2);
    a.on_tick(&a_host);
    b.on_tick(&b_host);
    let (a_watch, a_report) = (a_host.grpc_opened.borrow()[0].0, a_host.grpc_opened.borrow()[1].0);
    deliver(&a_host, &mut a, a_watch, &snapshot(1, &[30001]));
    for i in 0..3 {
        assert!(route(&a_host, &a, &format!("request {i}")).is_some());
    }
    a_host.advance_ms(1_000);
    a.on_tick(&a_host);
    let from_a = reports(&a_host, a_report).pop().unwrap();
    // a stops ticking; b takes the lease and reconnects.
    b_host.advance_ms(LEASE_MS + 1_000);
    b.on_tick(&b_host);
    let (b_watch, b_report) = (b_host.grpc_opened.borrow()[0].0, b_host.grpc_opened.borrow()[1].0);
    deliver(&b_host, &mut b, b_watch, &snapshot(1, &[30001]));
    for i in 0..2 {
        assert!(route(&b_host, &b, &format!("more {i}")).is_some());
    }
    b_host.advance_ms(1_000);
    b.on_tick(&b_host);
    let from_b = reports(&b_host, b_report).pop().unwrap();
    let watch_id = |host: &MockHost| proto::WatchRequest::decode(host.grpc_sent.borrow()[0].1.as_slice()).unwrap();
    assert_eq!(watch_id(&a_host).gateway_id, watch_id(&b_host).gateway_id, "one id per Envoy");
    assert_eq!(from_a.gateway_id, from_b.gateway_id);
    let requests = |r: &ReportBatch| r.counts.iter().map(|c| c.requests).sum::<u32>();
    let in_flight = |r: &ReportBatch| r.counts.iter().map(|c| c.in_flight).sum::<u32>();
    assert_eq!((requests(&from_a), in_flight(&from_a)), (3, 0));
    assert_eq!((requests(&from_b), in_flight(&from_b)), (5, 0), "cumulative over the Envoy, not per VM");
}

/// After a control-plane restart the ids may name other workers: the filter re-reports its
/// index only once the new table is applied, so no prefix is credited to the wrong worker.
#[test]
fn a_reconnecting_filter_reports_its_index_under_the_new_tables_ids() {
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    p.on_tick(&host);
    let watch = host.grpc_opened.borrow()[0].0;
    deliver(&host, &mut p, watch, &snapshot(1, &[30001]));
    let text = "a prompt long enough for blocks ".repeat(4);
    assert_eq!(route(&host, &p, &text).as_deref(), Some("127.0.0.1:30001"));
    // The control plane restarts: the streams close and the filter reconnects.
    p.on_grpc_close(&host, watch, 14);
    host.advance_ms(100);
    p.on_tick(&host);
    let (watch, report) = (host.grpc_opened.borrow()[2].0, host.grpc_opened.borrow()[3].0);
    for _ in 0..5 {
        host.advance_ms(1_000);
        p.on_tick(&host);
    }
    assert!(reports(&host, report).is_empty(), "no report before the new table");
    // The restarted control plane gives id 0 to another worker (and 30001 id 1).
    deliver(&host, &mut p, watch, &snapshot(1, &[30009, 30001]));
    let full = reports(&host, report);
    assert_eq!(full.len(), 1);
    assert!(full[0].inserts.iter().all(|i| i.worker != 0), "nothing under id 0, now 30009: {:?}", full[0].inserts);
    host.advance_ms(1_000);
    p.on_tick(&host);
    assert_eq!(reports(&host, report).len(), 2, "reports resume after the full report");
}

#[test]
fn the_table_reaches_the_vm_without_the_stream() {
    let a_host = MockHost::new();
    let b_host = a_host.vm();
    let mut a = plugin(&a_host, 1);
    let mut b = plugin(&b_host, 2);
    a.on_tick(&a_host);
    let watch = a_host.grpc_opened.borrow()[0].0;
    deliver(&a_host, &mut a, watch, &snapshot(1, &[30007]));
    b.on_tick(&b_host);
    assert_eq!(route(&b_host, &b, "y").as_deref(), Some("127.0.0.1:30007"));
}

#[test]
fn garbage_on_the_watch_stream_is_ignored() {
    let host = MockHost::new();
    let mut p = plugin(&host, 1);
    p.on_tick(&host);
    let watch = host.grpc_opened.borrow()[0].0;
    deliver(&host, &mut p, watch, b"\xff\xff\xff not protobuf");
    deliver(&host, &mut p, 999, &snapshot(9, &[30001]));
    assert!(host.metrics.borrow().get(&Metric::SnapshotVersion).is_none());
    assert_eq!(route(&host, &p, "z"), None);
}

/// Starts a request on `p` as context `ctx`; returns its filter and what the body callback
/// said.
fn start(host: &MockHost, p: &Plugin, ctx: u32, text: &str) -> (Rc<RefCell<RequestFilter>>, crate::host::Action) {
    let body = format!(r#"{{"text":"{text}"}}"#);
    host.request("POST", "/generate", &[], body.as_bytes());
    let f = p.new_request(ctx);
    f.borrow_mut().on_request_headers(host, false);
    let action = f.borrow_mut().on_request_body(host, body.len(), true);
    (f, action)
}

fn limited(queue_timeout_secs: u64) -> (MockHost, Plugin) {
    let host = MockHost::new();
    let mut p = Plugin::default();
    let config = format!(
        r#"{{"worker_urls":["http://127.0.0.1:30001"],"max_concurrent_requests":1,"queue_size":1,"queue_timeout_secs":{queue_timeout_secs}}}"#
    );
    p.configure(&host, config.as_bytes(), 1).unwrap();
    p.set_context_id(1);
    (host, p)
}

#[test]
fn past_the_limit_a_request_waits_and_the_tick_routes_it_when_a_token_comes_back() {
    use crate::host::Action;
    let (host, mut p) = limited(60);
    let (first, action) = start(&host, &p, 10, "a");
    assert_eq!(action, Action::Continue);
    let (_second, action) = start(&host, &p, 11, "b");
    assert_eq!(action, Action::Pause, "no token: it waits");
    assert_eq!(host.request_header(crate::request::ENDPOINTS_HEADER), None, "not routed while waiting");
    let (_third, _) = start(&host, &p, 12, "c");
    let reply = host.reply().expect("the queue (1) is full");
    assert_eq!((reply.status, reply.json()["error"]["code"].as_str()), (429, Some("too_many_requests")));

    p.on_tick(&host);
    assert_eq!(host.resumed_requests.get(), 0, "still no token");
    first.borrow_mut().on_log(&host);
    // The tick enters the waiting request's context: its body is "the" body again.
    host.request("POST", "/generate", &[], br#"{"text":"b"}"#);
    p.on_tick(&host);
    assert_eq!(*host.entered.borrow(), vec![11, 1], "the request's context, then back to the root's");
    assert_eq!(host.resumed_requests.get(), 1);
    assert!(host.request_header(crate::request::ENDPOINTS_HEADER).is_some(), "routed from the tick");
    assert_eq!(host.metrics.borrow().get(&Metric::Queued).and_then(|v| v.last().copied()), Some(0));
}

#[test]
fn a_request_waiting_past_the_queue_timeout_gets_a_408() {
    let (host, mut p) = limited(1);
    let (_first, _) = start(&host, &p, 10, "a");
    let (_second, _) = start(&host, &p, 11, "b");
    host.advance_ms(999);
    p.on_tick(&host);
    assert!(host.reply().is_none());
    host.advance_ms(1);
    p.on_tick(&host);
    let reply = host.reply().expect("408");
    assert_eq!((reply.status, reply.json()["error"]["code"].as_str()), (408, Some("queue_timeout")));
    assert_eq!(host.resumed_requests.get(), 0);
}

#[test]
fn a_waiting_request_that_goes_away_leaves_the_queue() {
    use crate::host::Action;
    let (host, mut p) = limited(60);
    let (first, _) = start(&host, &p, 10, "a");
    let (second, _) = start(&host, &p, 11, "b");
    second.borrow_mut().on_log(&host);
    drop(second);
    p.on_tick(&host);
    let (_third, action) = start(&host, &p, 12, "c");
    assert_eq!(action, Action::Pause, "room in the queue again");
    first.borrow_mut().on_log(&host);
    p.on_tick(&host);
    assert_eq!(*host.entered.borrow(), vec![12, 1], "the one that left is not woken");
}

#[test]
fn a_pacer_allows_one_tick_per_period_unless_told_to() {
    let mut pacer = Pacer::default();
    assert!(pacer.due(1_000, 20, false), "the first tick is due");
    assert!(!pacer.due(1_019, 20, false));
    assert!(pacer.due(1_019, 20, true), "a wake-up ticks at once");
    assert!(!pacer.due(1_038, 20, false), "and counts as the period's tick");
    assert!(pacer.due(1_039, 20, false));
    assert!(!pacer.due(0, 20, false), "a clock that went back waits");
}

#[test]
fn a_host_with_its_own_link_needs_the_address_beside_the_cluster() {
    let config = |json: &str| Config::from_json(json.as_bytes()).unwrap();
    assert_eq!(own_link_address(&config("{}")), Ok(None));
    let both = config(r#"{"control_plane_cluster":"cp","control_plane_address":"http://127.0.0.1:1"}"#);
    assert_eq!(own_link_address(&both), Ok(Some("http://127.0.0.1:1")));
    let err = own_link_address(&config(r#"{"control_plane_cluster":"cp"}"#)).unwrap_err();
    assert!(err.contains("control_plane_address"), "{err}");
}

#[test]
fn the_last_streams_end_flushes_what_the_tick_keeps() {
    let host = MockHost::new();
    let mut p = Plugin::default();
    p.configure(&host, br#"{"worker_urls":["http://127.0.0.1:1"]}"#, 1).unwrap();
    let gateway = p.gateway().unwrap();
    let worker = gateway.borrow().front().worker_at("127.0.0.1:1", None).unwrap();
    gateway
        .borrow_mut()
        .feedback()
        .count(worker, &kvmesh_core::usage::Usage { completion_tokens: Some(3), ..Default::default() });
    p.on_stream_end(&host, 1);
    assert!(crate::shared::feedback::read(&host).is_empty(), "another stream is live: the tick will write it");
    p.on_stream_end(&host, 0);
    assert_eq!(crate::shared::feedback::read(&host).len(), 1, "the last stream's end wrote it");
}

/// A plugin with `config` on two workers, twenty requests routed over them, the first answered
/// one of those on the first worker, then kvmesh-cp finding the first worker hung. Returns the
/// requests on it that wait (context ids) and the filters with their bodies.
type Started = Vec<(u32, Rc<RefCell<RequestFilter>>, String)>;
fn hung_first_worker(config: &str) -> (MockHost, Plugin, Vec<u32>, Started) {
    let host = MockHost::new();
    let mut p = Plugin::default();
    p.configure(&host, config.as_bytes(), 1).unwrap();
    p.set_context_id(1);
    p.on_tick(&host);
    let watch = host.grpc_opened.borrow()[0].0;
    deliver(&host, &mut p, watch, &snapshot(1, &[30001, 30002]));
    let mut on_first = Vec::new();
    let mut filters = Vec::new();
    for ctx in 10..30 {
        let text = format!("prompt {ctx} {}", "x".repeat(64));
        let (f, _) = start(&host, &p, ctx, &text);
        if host.request_header(crate::request::DST_HEADER).as_deref() == Some("127.0.0.1:30001") {
            on_first.push(ctx);
        }
        filters.push((ctx, f, format!(r#"{{"text":"{text}"}}"#)));
    }
    assert!(on_first.len() > 1 && on_first.len() < 20, "both workers used: {on_first:?}");
    // One request on the first worker got its answer's headers already: it is never touched.
    let answered = on_first.remove(0);
    host.set_response(200, b"");
    *host.upstream.borrow_mut() = Some("127.0.0.1:30001".into());
    filters.iter().find(|(c, _, _)| *c == answered).unwrap().1.borrow_mut().on_response_headers(&host);
    p.on_tick(&host);
    assert!(host.replies.borrow().is_empty() && host.callouts.borrow().is_empty(), "nobody hung yet");
    let mut hung = proto::Snapshot::decode(snapshot(2, &[30001, 30002]).as_slice()).unwrap();
    hung.workers[0].healthy = false;
    hung.workers[0].unresponsive = true;
    deliver(&host, &mut p, watch, &hung.encode_to_vec());
    host.entered.borrow_mut().clear();
    (host, p, on_first, filters)
}

fn assert_503s(host: &MockHost, n: usize) {
    let replies = host.replies.borrow();
    assert_eq!(replies.len(), n, "each waiting request on it, once");
    for r in replies.iter() {
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (503, Some("worker_unresponsive")));
    }
}

/// Without fallbacks (`disable_retries`) there is nowhere to send them: a 503 each, once.
#[test]
fn requests_waiting_on_a_worker_found_hung_with_nowhere_to_go_get_a_503() {
    let config = r#"{"control_plane_cluster":"kvmesh_cp","report_interval_ms":20,"disable_retries":true}"#;
    let (host, mut p, waiting, _filters) = hung_first_worker(config);
    p.on_tick(&host);
    assert_503s(&host, waiting.len());
    assert!(host.callouts.borrow().is_empty());
    let entered = host.entered.borrow().clone();
    assert!(waiting.iter().all(|c| entered.contains(c)), "each in its own context");
    assert_eq!(entered.last(), Some(&1), "then back to the root");
    p.on_tick(&host);
    assert_503s(&host, waiting.len());
}

/// With a fallback, each is sent again to it (the same body, the same path), and its answer
/// is the client's, naming the worker that gave it; the hung worker's other requests too.
#[test]
fn requests_waiting_on_a_hung_worker_are_sent_again_and_answered_by_another() {
    let (host, mut p, waiting, filters) = hung_first_worker(CONFIG);
    p.on_tick(&host);
    assert!(host.replies.borrow().is_empty(), "no 503");
    let sent = host.callouts.borrow().clone();
    assert_eq!(sent.len(), waiting.len(), "one callout each");
    let mut bodies: Vec<&[u8]> = sent.iter().map(|c| c.body.as_slice()).collect();
    let mut expected: Vec<&[u8]> =
        filters.iter().filter(|(c, _, _)| waiting.contains(c)).map(|(_, _, b)| b.as_bytes()).collect();
    bodies.sort();
    expected.sort();
    assert_eq!(bodies, expected, "the bodies the hung worker got");
    for c in &sent {
        let header = |n: &str| c.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(header(crate::request::ENDPOINTS_HEADER), Some("127.0.0.1:30002"));
        assert_eq!(header(":path"), Some("/generate"));
    }
    p.on_tick(&host);
    assert_eq!(host.callouts.borrow().len(), waiting.len(), "not again");
    // The second worker answers each: the root hands each answer on to its request.
    *host.callout_answer.borrow_mut() = (Some(200), br#"{"text":"ok"}"#.to_vec());
    for c in &sent {
        p.on_callout_response(&host, c.token, 13);
    }
    assert_eq!(host.metric_sum(Metric::Failovers), waiting.len() as u64, "each a failover");
    let replies = host.replies.borrow();
    assert_eq!(replies.len(), waiting.len());
    for r in replies.iter() {
        assert_eq!((r.status, r.body.as_slice()), (200, br#"{"text":"ok"}"#.as_slice()));
        assert!(r.headers.iter().any(|(k, v)| k == "x-kvmesh-worker" && v == "127.0.0.1:30002"), "{r:?}");
    }
}

/// A fallback that gives no answer either: the 503 after all.
#[test]
fn a_request_sent_again_that_gets_no_answer_gets_the_503() {
    let (host, mut p, waiting, _filters) = hung_first_worker(CONFIG);
    p.on_tick(&host);
    let sent = host.callouts.borrow().clone();
    *host.callout_answer.borrow_mut() = (None, Vec::new());
    for c in &sent {
        p.on_callout_response(&host, c.token, 0);
    }
    assert_503s(&host, waiting.len());
}

/// The hung worker answers after all before the request sent again does: its response goes on,
/// and the late answer is dropped.
#[test]
fn a_hung_worker_that_answers_first_keeps_its_response() {
    let (host, mut p, waiting, filters) = hung_first_worker(CONFIG);
    p.on_tick(&host);
    let sent = host.callouts.borrow().clone();
    let ctx = waiting[0];
    let filter = &filters.iter().find(|(c, _, _)| *c == ctx).unwrap().1;
    host.set_response(200, b"");
    *host.upstream.borrow_mut() = Some("127.0.0.1:30001".into());
    filter.borrow_mut().on_response_headers(&host);
    let token = filter.borrow().callout_token().unwrap();
    *host.callout_answer.borrow_mut() = (Some(200), br#"{"text":"late"}"#.to_vec());
    p.on_callout_response(&host, token, 15);
    assert!(host.replies.borrow().is_empty(), "no local reply over a response under way");
    assert!(sent.iter().any(|c| c.token == token));
}

#[test]
fn a_named_inference_objective_gives_the_class_unless_a_priority_header_does() {
    use crate::host::Action;
    let host = MockHost::new();
    let mut p = Plugin::default();
    let config = r#"{"worker_urls":["http://127.0.0.1:30001"],"max_concurrent_requests":1,"queue_size":4,
        "priority_objective":["batch=-1","chat=1"]}"#;
    p.configure(&host, config.as_bytes(), 1).unwrap();
    p.set_context_id(1);
    let send = |ctx: u32, headers: &[(&str, &str)]| {
        let body = br#"{"text":"x"}"#;
        host.request("POST", "/generate", headers, body);
        let f = p.new_request(ctx);
        f.borrow_mut().on_request_headers(&host, false);
        let action = f.borrow_mut().on_request_body(&host, body.len(), true);
        (f, action)
    };
    let (_holder, action) = send(10, &[]);
    assert_eq!(action, Action::Continue, "the one slot");
    // `batch` is priority -1: sheddable, refused at once while no slot is free.
    let (_shed, _) = send(11, &[(OBJECTIVE, "batch")]);
    let reply = host.reply().expect("a sheddable objective is refused under overload");
    assert_eq!((reply.status, reply.json()["error"]["code"].as_str()), (503, Some("shed")));
    // A priority header wins over the objective; an unknown objective says nothing.
    for (ctx, headers) in [(12, vec![(OBJECTIVE, "batch"), ("kvmesh-priority", "0")]), (13, vec![(OBJECTIVE, "nope")])]
    {
        let (_waiting, action) = send(ctx, &headers);
        assert_eq!((action, host.reply().map(|r| r.status)), (Action::Pause, None), "{headers:?} waits");
    }
}

const OBJECTIVE: &str = kvmesh_core::priority::OBJECTIVE_HEADER;
