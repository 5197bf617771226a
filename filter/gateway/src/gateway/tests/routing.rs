use super::*;
use crate::shared::fake::FakeStore;
use kvmesh_core::request::MAX_ROUTING_KEY;

fn req(g: &mut Gateway, store: &FakeStore, endpoint: Endpoint, body: &[u8]) -> Outcome {
    g.route_request(
        store,
        endpoint,
        body,
        &RequestInfo { request_id: Some("rq-1"), routing_key: None, headers: None, now: Now::from_secs(1000) },
    )
}

fn plan(o: Outcome) -> Plan {
    match o {
        Outcome::Route(p) => p,
        Outcome::Reply(r) => panic!("expected a route, got {} {}", r.status, String::from_utf8_lossy(&r.body)),
    }
}

/// Decides and commits, as the filter does when applying the plan worked.
fn route(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> Committed {
    let p = plan(req(g, store, Endpoint::Generate, body));
    g.commit(store, p)
}

fn routed(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> Routed {
    let c = route(g, store, body);
    assert!(c.prefill.is_none(), "expected one leg, got a PD split");
    c.main
}

/// Registers `g` as a routing VM and gives it the two heartbeats a second apart after which it
/// knows that it routes alone (at 1 s and 2 s: later clock values in a test build on these).
fn settle_alone(g: &mut Gateway, store: &FakeStore) {
    g.ledger_mut().serve(store, 0);
    g.heartbeat(store, 1_000);
    g.heartbeat(store, 2_000);
}

fn reply(o: Outcome) -> Reply {
    match o {
        Outcome::Reply(r) => r,
        Outcome::Route(p) => panic!("expected a reply, routed to {}", p.addr()),
    }
}

fn gateway(store: &FakeStore, extra: &str) -> Gateway {
    let json = format!(
        r#"{{"worker_urls":["http://127.0.0.1:30001","http://127.0.0.1:30002","http://127.0.0.1:30003"]{extra}}}"#
    );
    let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 42);
    g.publisher().set_reporting(true);
    g
}

fn body(text: &str) -> Vec<u8> {
    format!(r#"{{"text":"{text}"}}"#).into_bytes()
}

#[test]
fn consistent_hashing_keys_come_from_the_headers_then_the_body_field() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","policy":"consistent_hashing","routing_key_body_field":"user""#);
    let hdr = |v: &str| Headers::from_pairs([("X-Session-Id", v.as_bytes())]);
    assert_eq!(g.front().routing_key(&hdr("s1")).as_deref(), Some("s1"), "a default header, any case");
    assert_eq!(g.front().routing_key(&hdr("")), None);
    assert_eq!(g.front().routing_key(&hdr(&"k".repeat(MAX_ROUTING_KEY + 1))), None, "too long");
    let owner = |g: &mut Gateway, key: Option<&str>, body: &[u8]| {
        let info = RequestInfo { request_id: None, routing_key: key, headers: None, now: Now::from_secs(1000) };
        let p = plan(g.route_request(&store, Endpoint::Generate, body, &info));
        g.commit(&store, p).main.addr
    };
    for key in ["alice", "bob", "carol", "dave"] {
        let first = owner(&mut g, Some(key), &body("one prompt"));
        for i in 0..5 {
            assert_eq!(owner(&mut g, Some(key), &body(&format!("other prompt {i}"))), first, "{key}");
        }
        // The same key in the body field when no header gives one.
        let in_body = format!(r#"{{"text":"x","user":"{key}"}}"#);
        assert_eq!(owner(&mut g, None, in_body.as_bytes()), first, "{key} from the body");
    }
    let spread: std::collections::HashSet<String> =
        (0..24).map(|i| owner(&mut g, Some(&format!("user-{i}")), &body("p"))).collect();
    assert_eq!(spread.len(), 3, "keys spread over every worker");
    // No key captured at the headers (the VM did not know yet): the headers are read again.
    let first = owner(&mut g, Some("erin"), &body("p"));
    let fetch = || Headers::from_pairs([("x-smg-routing-key", &b"erin"[..])]);
    for _ in 0..5 {
        let info =
            RequestInfo { request_id: None, routing_key: None, headers: Some(&fetch), now: Now::from_secs(1000) };
        let p = plan(g.route_request(&store, Endpoint::Generate, &body("q"), &info));
        assert_eq!(g.commit(&store, p).main.addr, first);
    }
    // Another policy keeps no key.
    let g = gateway(&store, "");
    assert_eq!(g.front().routing_key(&hdr("s1")), None);
}

#[test]
fn shared_prefix_sticks_and_inflight_is_tracked() {
    let store = FakeStore::default();
    let mut g = gateway(&store, "");
    let prefix = "p".repeat(400);
    settle_alone(&mut g, &store); // registered, and the Envoy's only VM two heartbeats running
    let first = routed(&mut g, &store, &body(&format!("{prefix}a")));
    assert!(first.counted);
    let again = routed(&mut g, &store, &body(&format!("{prefix}b")));
    assert_eq!(again.addr, first.addr);
    assert!(again.matched_bytes >= 384);
    // Alone, a VM writes no shared data per request: its tick writes what it routed.
    assert_eq!(Inflight::read(&store), vec![]);
    let p = plan(req(&mut g, &store, Endpoint::Generate, &body("z")));
    assert_eq!(p.inflight.count(first.worker), 2, "its own requests count as load at once");
    g.write_ended(&store);
    assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
    g.ledger_mut().finish(&store, &first, true);
    g.ledger_mut().finish(&store, &again, false);
    // Ending touches no shared data either: the tick writes the ends with the new requests.
    assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
    let third = routed(&mut g, &store, &body(&format!("{prefix}c")));
    assert_eq!(third.addr, first.addr);
    g.write_ended(&store);
    let c = Inflight::counts(&store);
    assert_eq!((c[0].in_flight, c[0].finished, c[0].failed), (1, 2, 1));
    g.ledger_mut().finish(&store, &third, true);
    g.write_ended(&store);
    assert_eq!(Inflight::read(&store), vec![(first.worker, 0)]);
    // With another VM, a request is counted at its commit; its end goes with the VM's next
    // commit (or tick) while the VM has others in flight — the other VM counts it as load
    // until then — and at once when it was the VM's last.
    let mut other = Gateway::new(g.config().clone(), &store, 7);
    other.ledger_mut().serve(&store, 0);
    other.heartbeat(&store, 1_000);
    g.heartbeat(&store, 3_000);
    let fourth = routed(&mut g, &store, &body(&format!("{prefix}d")));
    let held = routed(&mut g, &store, &body(&format!("{prefix}held")));
    assert_eq!(Inflight::read(&store), vec![(first.worker, 2)], "counted at their commits");
    g.ledger_mut().finish(&store, &fourth, true);
    assert_eq!(Inflight::read(&store), vec![(first.worker, 2)], "its end waits for the next write");
    let p = plan(req(&mut other, &store, Endpoint::Generate, &body(&format!("{prefix}e"))));
    assert_eq!(p.inflight.count(first.worker), 2, "the other VM sees it in flight meanwhile");
    let p = plan(req(&mut g, &store, Endpoint::Generate, &body(&format!("{prefix}e"))));
    assert_eq!(p.inflight.count(first.worker), 1, "its own VM does not");
    let fifth = routed(&mut g, &store, &body(&format!("{prefix}f")));
    assert_eq!(fifth.worker, first.worker);
    let c = Inflight::counts(&store);
    assert_eq!((c[0].in_flight, c[0].finished), (2, 4), "the fifth's commit wrote the fourth's end");
    g.ledger_mut().finish(&store, &fifth, true);
    assert_eq!(Inflight::read(&store), vec![(first.worker, 2)]);
    g.ledger_mut().finish(&store, &held, true);
    assert_eq!(Inflight::read(&store), vec![(first.worker, 0)], "the last one's end: both at once");
}

/// A VM alone writes at once when half a log slot of inserts waits, between ticks: its own
/// requests in flight still count as load in its next decisions.
#[test]
fn a_vm_alone_that_writes_between_ticks_still_counts_its_requests() {
    let store = FakeStore::default();
    let mut g = gateway(&store, "");
    settle_alone(&mut g, &store);
    let mut routed_so_far = 0;
    while Inflight::load(&store).head() == 0 {
        assert!(routed_so_far < 200, "no write after {routed_so_far} long prompts");
        let text: String = (0..8_000).map(|i| format!("{routed_so_far}-{i} ")).collect();
        routed(&mut g, &store, &body(&text));
        routed_so_far += 1;
    }
    let p = plan(req(&mut g, &store, Endpoint::Generate, &body("one more")));
    let total: u32 = g.view.table.workers.iter().map(|w| p.inflight.count(w.id)).sum();
    assert_eq!(total, routed_so_far, "every request in flight counts, written or not");
}

#[test]
fn a_vms_own_ended_requests_count_at_once_in_its_decisions() {
    let store = FakeStore::default();
    let mut g = gateway(&store, "");
    settle_alone(&mut g, &store);
    let held = routed(&mut g, &store, &body(&"x".repeat(400)));
    g.ledger_mut().finish(&store, &held, true);
    let p = plan(req(&mut g, &store, Endpoint::Generate, &body(&"y".repeat(400))));
    assert_eq!(p.inflight.count(held.worker), 0, "not written yet, but not counted as load");
    assert_eq!(Inflight::read(&store), vec![], "nothing written before the tick");
    g.write_ended(&store);
    assert_eq!(Inflight::read(&store), vec![(held.worker, 0)]);
    let counts = Inflight::counts(&store);
    assert_eq!((counts[0].finished, counts[0].failed), (1, 0));
}

#[test]
fn a_plan_that_is_not_committed_leaves_no_trace() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","control_plane_cluster":"cp""#);
    let text = body(&"u".repeat(400));
    let p = plan(req(&mut g, &store, Endpoint::Generate, &text));
    drop(p); // e.g. the destination header could not be set: a local reply instead
    assert_eq!(g.index_len(), 0, "no phantom index entry");
    assert!(Inflight::read(&store).is_empty(), "nothing counted");
    assert_eq!(Inflight::load(&store).head(), 0, "nothing in the delta log for the other VMs");
    assert!(g.take_report(&store, "gw", Now::default()).inserts.is_empty(), "nothing reported");
    let c = route(&mut g, &store, &text);
    assert!(c.main.counted && g.index_len() > 0);
    assert_eq!(g.take_report(&store, "gw", Now::default()).inserts.len(), 1);
}

#[test]
fn the_requests_of_a_vm_that_died_do_not_stay_in_flight() {
    let store = FakeStore::default();
    let mut a = gateway(&store, "");
    // a has been the Envoy's only VM for two heartbeats: it keeps its ends.
    settle_alone(&mut a, &store);
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    b.ledger_mut().serve(&store, 0);
    b.heartbeat(&store, 2_000);
    assert!(a.ledger.alone() && !b.ledger.alone(), "b just came: a learns of it on its next tick");
    let mut on_b = Vec::new();
    for i in 0..3 {
        routed(&mut a, &store, &body(&format!("on a {i}")));
        on_b.push(routed(&mut b, &store, &body(&format!("on b {i}"))));
    }
    let total = |s: &FakeStore| Inflight::counts(s).iter().map(|c| c.in_flight).sum::<u32>();
    assert_eq!(total(&store), 3, "b's, written at once; a writes its own on its tick");
    a.write_ended(&store);
    assert_eq!(total(&store), 6);
    // One more request on a, routed and ended: written (in and out) when a learns of b on its
    // next tick, which also publishes what a has in flight.
    let ended_on_a = routed(&mut a, &store, &body("on a, ended"));
    a.ledger_mut().finish(&store, &ended_on_a, true);
    a.heartbeat(&store, 2_500);
    assert!(!a.ledger.alone());
    b.heartbeat(&store, 2_500);
    assert_eq!(total(&store), 6);
    drop(a); // trapped: its streams never reach on_log
    for t in (3_000..=12_000).step_by(1_000) {
        b.heartbeat(&store, t);
        assert_eq!(total(&store), 6, "not before the heartbeat is stale ({t} ms)");
    }
    b.heartbeat(&store, 13_000);
    assert_eq!(total(&store), 3, "a's three are taken back, b's stay");
    for r in &on_b {
        b.ledger_mut().finish(&store, r, true);
    }
    assert_eq!(total(&store), 0, "b's last end wrote them all");
}

#[test]
fn vms_that_start_together_never_take_themselves_for_alone() {
    let store = FakeStore::default();
    let mut a = gateway(&store, "");
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    a.ledger_mut().serve(&store, 0);
    b.ledger_mut().serve(&store, 0);
    // a registers a moment before b: alone at that check, but not at the next.
    a.heartbeat(&store, 1_000);
    b.heartbeat(&store, 1_001);
    assert!(!a.ledger.alone() && !b.ledger.alone());
    a.heartbeat(&store, 2_000);
    b.heartbeat(&store, 2_001);
    assert!(!a.ledger.alone() && !b.ledger.alone());
    // A VM on its own is, from its second heartbeat.
    // Envoy's main-thread VM ticks too but routes nothing: not counted as another VM.
    let lone_store = FakeStore::default();
    let mut c = gateway(&lone_store, "");
    let mut main = Gateway::new(c.config().clone(), &lone_store, 9);
    c.ledger_mut().serve(&lone_store, 0);
    for t in [1_000, 2_000] {
        main.heartbeat(&lone_store, t);
        c.heartbeat(&lone_store, t + 1);
        assert_eq!(c.ledger.alone(), t == 2_000, "at {t} ms");
    }
    assert!(!main.ledger.alone() && main.ledger().settled());
    // It routes a request (a passthrough path, say): from then on it counts.
    main.ledger_mut().serve(&lone_store, 0);
    c.heartbeat(&lone_store, 2_021);
    assert!(!c.ledger.alone(), "noticed on c's next tick");
}

#[test]
fn another_vm_sees_the_prefix() {
    let store = FakeStore::default();
    let mut a = gateway(&store, "");
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    let prefix = "q".repeat(400);
    let on_a = routed(&mut a, &store, &body(&format!("{prefix}1")));
    assert_eq!(on_a.matched_bytes, 0, "new to a");
    assert_eq!(b.index_len(), 0, "b has not seen it");
    // Both VMs place a new prefix by the same hash, so the worker alone proves nothing: b
    // must know the prefix, from a's insert in the delta log.
    let on_b = routed(&mut b, &store, &body(&format!("{prefix}2")));
    assert!(on_b.matched_bytes >= 384, "b matched {} bytes of a's 400-byte prefix", on_b.matched_bytes);
    assert_eq!(on_a.addr, on_b.addr);
}

/// A VM alone logs its inserts on its tick (one slot for all of them), and the moment it
/// learns of another VM (its heartbeat) it writes what it kept: a VM that joins sees every
/// prefix routed before it, one tick late at most.
#[test]
fn a_vm_alone_logs_its_inserts_on_its_tick_and_when_another_comes() {
    let store = FakeStore::default();
    let mut a = gateway(&store, "");
    settle_alone(&mut a, &store);
    assert!(a.ledger().alone());
    let first = routed(&mut a, &store, &body(&format!("{}1", "q".repeat(400))));
    routed(&mut a, &store, &body(&format!("{}1", "s".repeat(400))));
    assert_eq!(Inflight::load(&store).head(), 0, "nothing logged per request");
    a.write_ended(&store); // its tick
    assert_eq!(Inflight::load(&store).head(), 1, "both requests' inserts in one slot");
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    let on_b = routed(&mut b, &store, &body(&format!("{}2", "q".repeat(400))));
    assert!(on_b.matched_bytes >= 384, "b matched {} bytes", on_b.matched_bytes);
    assert_eq!(on_b.addr, first.addr);
    // b registers; a routes on, alone as far as it knows, until its next heartbeat.
    b.heartbeat(&store, 2_100);
    let before = routed(&mut a, &store, &body(&format!("{}x", "r".repeat(400))));
    assert_eq!(Inflight::load(&store).head(), 2, "b's insert only");
    a.heartbeat(&store, 3_000);
    assert!(!a.ledger().alone());
    let total: u32 = Inflight::counts(&store).iter().map(|c| c.in_flight).sum();
    assert_eq!(total, 4, "a's three requests and b's one, all written");
    let on_b = routed(&mut b, &store, &body(&format!("{}y", "r".repeat(400))));
    assert!(on_b.matched_bytes >= 384, "b matched {} bytes of what a routed alone", on_b.matched_bytes);
    assert_eq!(on_b.addr, before.addr);
}

#[test]
fn bad_requests_get_json_errors_and_do_not_count() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","max_payload_size":64"#);
    let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text": 5}"#));
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("`text`"));
    assert_eq!(reply(req(&mut g, &store, Endpoint::Generate, b"{")).status, 400);
    assert_eq!(reply(req(&mut g, &store, Endpoint::Generate, &[b' '; 100])).status, 413);
    assert_eq!(g.front().check_length(Some(65)).map(|r| r.status), Some(413));
    assert_eq!(g.front().check_length(Some(64)), None);
    assert!(Inflight::read(&store).is_empty());
}

#[test]
fn no_workers_is_503_with_retry_after() {
    let store = FakeStore::default();
    let mut g = Gateway::new(Config::default(), &store, 1);
    let r = reply(req(&mut g, &store, Endpoint::Generate, &body("x")));
    assert_eq!((r.status, r.retry_after), (503, Some(1)));
    assert_eq!(g.route_other(&store, Now::from_secs(0)).map(|r| r.0.addr), Err(Reply::no_worker("worker")));
}

#[test]
fn other_paths_spread_over_the_workers_uncounted() {
    let store = FakeStore::default();
    let mut g = gateway(&store, "");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..60 {
        let (r, fallbacks) = g.route_other(&store, Now::from_secs(0)).unwrap();
        assert!(!r.counted);
        assert_eq!(fallbacks.len(), 2, "the two other workers to fail over to");
        assert!(!fallbacks.contains(&r.addr));
        seen.insert(r.addr);
    }
    let all: std::collections::BTreeSet<String> =
        ["127.0.0.1:30001", "127.0.0.1:30002", "127.0.0.1:30003"].iter().map(|s| s.to_string()).collect();
    assert_eq!(seen, all);
    assert!(Inflight::read(&store).is_empty(), "other paths are not counted");
}

#[test]
fn overloaded_workers_are_passed_over_and_all_overloaded_is_a_503() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","overload_waiting_requests":8,"overload_kv_usage":0.8"#);
    g.view.table.workers[0].waiting = Some(9);
    g.view.table.workers[1].kv_usage = Some(0.95);
    g.view.table.workers[2].waiting = Some(8); // at the threshold, not past it
    for i in 0..20 {
        let r = routed(&mut g, &store, &body(&format!("text {i}")));
        assert_eq!(r.worker, 2, "the only worker with room");
    }
    g.view.table.workers[2].kv_usage = Some(0.81);
    let r = reply(req(&mut g, &store, Endpoint::Generate, &body("one more")));
    assert_eq!((r.status, r.retry_after), (503, Some(1)));
    assert!(String::from_utf8_lossy(&r.body).contains("overloaded"));
    assert!(g.route_other(&store, Now::from_secs(0)).is_ok(), "read-only paths are not shed");
    // Thresholds at 0 are off.
    let mut g = gateway(&store, r#","overload_waiting_requests":0,"overload_kv_usage":0"#);
    g.view.table.workers.iter_mut().for_each(|w| (w.waiting, w.kv_usage) = (Some(1000), Some(1.0)));
    routed(&mut g, &store, &body("fine"));
}

#[test]
fn loaded_workers_are_avoided() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","balance_abs_threshold":2"#);
    let prefix = "z".repeat(400);
    let first = routed(&mut g, &store, &body(&format!("{prefix}0")));
    for i in 1..3 {
        let r = routed(&mut g, &store, &body(&format!("{prefix}{i}")));
        assert_eq!(r.worker, first.worker);
    }
    // Three in flight on one worker, none elsewhere: imbalanced past abs threshold 2.
    let r = routed(&mut g, &store, &body(&format!("{prefix}3")));
    assert_ne!(r.worker, first.worker);
}

#[test]
fn eviction_runs_on_its_interval() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10"#);
    routed(&mut g, &store, &body(&"e".repeat(320)));
    assert_eq!(g.index_len(), 20);
    assert_eq!(g.tick(&store, 100), None);
    assert_eq!(g.tick(&store, 105), None);
    assert_eq!(g.tick(&store, 110), Some(16));
    assert_eq!(g.index_len(), 4);
}

#[test]
fn with_a_control_plane_local_eviction_is_only_a_cap() {
    let store = FakeStore::default();
    let mut g = gateway(
        &store,
        r#","max_tree_size":64,"block_size":16,"eviction_interval_secs":10,"control_plane_cluster":"cp""#,
    );
    routed(&mut g, &store, &body(&"e".repeat(320)));
    g.tick(&store, 100);
    assert_eq!(g.tick(&store, 110), Some(12), "down to 2 x max_tree_size, not to it");
    assert_eq!(g.index_len(), 8);
}

fn pd_gateway(store: &FakeStore, extra: &str) -> Gateway {
    let json = format!(
        r#"{{"pd_disaggregation":true,"prefill":[["http://127.0.0.1:30001",8998],["http://127.0.0.1:30002","none"]],
            "decode":["http://127.0.0.1:30003","http://127.0.0.1:30004"],"cb_failure_threshold":1{extra}}}"#
    );
    Gateway::new(Config::from_json(json.as_bytes()).unwrap(), store, 5)
}

/// A PD split, committed: the legs and the body both receive.
fn split(g: &mut Gateway, store: &FakeStore, body: &[u8]) -> (Committed, Vec<u8>) {
    let p = plan(req(g, store, Endpoint::Generate, body));
    let sent = match p.pd().and_then(|pd| pd.leg.callout_body()) {
        Some(body) => body.to_vec(),
        None => panic!("a PD split with a callout, got {:?}", p.pd()),
    };
    let c = g.commit(store, p);
    assert!(c.prefill.is_some());
    (c, sent)
}

/// llm-d's protocol: a split names the prefill pod for the decode pod's sidecar and leaves the
/// body alone; only the decode leg is counted in flight (the gateway never sees the prefill
/// end), but the prefill pod's prefix is indexed; the prefix decider's decode-alone requests
/// name no prefill pod.
#[test]
fn llm_d_splits_name_the_prefill_pod_and_count_only_the_decode_leg() {
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, r#","pd_protocol":"llm-d""#);
    let body = br#"{"text":"a long enough prompt for a few blocks of the index, and then some"}"#;
    let p = plan(req(&mut g, &store, Endpoint::Generate, body));
    let pd = p.pd().expect("a split");
    assert_eq!(pd.leg.protocol().name(), "llm-d");
    assert!(pd.leg.callout_body().is_none() && pd.leg.decode_body().is_none(), "no callout, no body rewrite");
    assert!(pd.leg.decode_header().is_some() && !pd.leg.sent_by_gateway() && pd.leg.rid().is_none());
    let (prefill, decode) = (pd.prefill.worker, p.main.worker);
    let c = g.commit(&store, p);
    assert!(c.main.counted, "the decode leg is counted");
    assert!(c.prefill.as_ref().is_some_and(|p| !p.counted), "the sidecar's prefill is not");
    let counts: std::collections::HashMap<WorkerId, u32> = Inflight::read(&store).into_iter().collect();
    assert_eq!(counts.get(&decode), Some(&1));
    assert_eq!(counts.get(&prefill).copied().unwrap_or(0), 0, "nothing in flight on the prefill pod");
    // Its prefix was indexed for the prefill pod: the next request with it goes there again.
    let again = plan(req(&mut g, &store, Endpoint::Generate, body));
    let next = again.pd().expect("a split").prefill.clone();
    assert_eq!(next.worker, prefill);
    assert!(next.matched_bytes > 0, "the prefill pod is known to hold the prefix");

    // The prefix decider keeps a request whose prompt the decode pod holds on it alone.
    let mut g = pd_gateway(&store, r#","pd_protocol":"llm-d","pd_decider":"prefix","non_cached_tokens":1000"#);
    let p = plan(req(&mut g, &store, Endpoint::Generate, body));
    assert!(p.pd().is_none(), "a short uncached suffix runs on the decode pod alone");
}

#[test]
fn pd_split_injects_bootstrap_and_counts_both_legs() {
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "");
    let (c, sent) = split(&mut g, &store, br#"{"text":["a","b","c"],"return_logprob":true}"#);
    let prefill = c.prefill.unwrap();
    assert!(prefill.addr.ends_with(":30001") || prefill.addr.ends_with(":30002"));
    assert!(c.main.addr.ends_with(":30003") || c.main.addr.ends_with(":30004"));
    assert!(c.merge_logprobs && !c.stream);
    let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    let rooms = v["bootstrap_room"].as_array().unwrap();
    assert_eq!(rooms.len(), 3);
    assert!(rooms[0] != rooms[1] && rooms[1] != rooms[2]);
    assert_eq!(v["bootstrap_host"][2], "127.0.0.1");
    let expected_port =
        if prefill.addr.ends_with(":30001") { serde_json::json!(8998) } else { serde_json::Value::Null };
    assert_eq!(v["bootstrap_port"][0], expected_port);
    // The gateway's own rids (never the client's x-request-id), one per item, one length.
    let rids: Vec<&str> = v["rid"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert_eq!(rids.len(), 3);
    let base = rids[0].strip_suffix("-0000").expect("item 0");
    assert!(base.starts_with("kvmesh-") && !base.contains("rq-1"), "{base}");
    assert_eq!(rids[1..], [format!("{base}-0001"), format!("{base}-0002")]);
    let mut counts = Inflight::read(&store);
    counts.sort();
    let mut expected = vec![(prefill.worker, 1), (c.main.worker, 1)];
    expected.sort();
    assert_eq!(counts, expected);
}

/// Decides at `now` (seconds) and commits: the worker, or the status of the local reply.
fn route_at(g: &mut Gateway, store: &FakeStore, text: &str, now: u64) -> Result<Routed, u16> {
    let info = RequestInfo { request_id: None, routing_key: None, headers: None, now: Now::from_secs(now) };
    match g.route_request(store, Endpoint::Generate, &body(text), &info) {
        Outcome::Route(p) => Ok(g.commit(store, p).main),
        Outcome::Reply(r) => Err(r.status),
    }
}

#[test]
fn a_failing_worker_is_opened_probed_and_closed_on_every_vm() {
    let store = FakeStore::default();
    let cb =
        r#","policy":"round_robin","cb_failure_threshold":3,"cb_success_threshold":2,"cb_timeout_duration_secs":5"#;
    let mut a = gateway(&store, cb);
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    let bad = routed(&mut a, &store, &body("x"));
    // Three failures, seen on two VMs, open it for both.
    a.outcomes().record(&store, bad.worker, false, Now::from_secs(100));
    b.outcomes().record(&store, bad.worker, false, Now::from_secs(100));
    assert_eq!(a.front().breaker_state(bad.worker, Now::from_secs(100)), BreakerState::Closed);
    b.outcomes().record(&store, bad.worker, false, Now::from_secs(101));
    assert_eq!(b.front().breaker_state(bad.worker, Now::from_secs(101)), BreakerState::Open);
    a.tick(&store, 101);
    for g in [&mut a, &mut b] {
        for i in 0..12 {
            assert_ne!(route_at(g, &store, &format!("q{i}"), 105).unwrap().worker, bad.worker, "open until 106");
        }
    }
    // Half-open: exactly one request, on one VM, probes it.
    let mut probes = Vec::new();
    for i in 0..12 {
        for g in [&mut a, &mut b] {
            let r = route_at(g, &store, &format!("p{i}"), 106).unwrap();
            if r.worker == bad.worker {
                probes.push(r);
            }
        }
    }
    assert_eq!(probes.len(), 1, "one probe at a time across the VMs");
    assert_eq!(
        a.route_other(&store, Now::from_secs(106)).map(|r| r.0.worker == bad.worker),
        Ok(false),
        "other paths never probe"
    );
    // It answers: the slot is free again; a second success closes it.
    a.outcomes().record(&store, probes[0].worker, true, Now::from_secs(107));
    b.tick(&store, 107);
    let second =
        (0..6).find_map(|i| route_at(&mut b, &store, &format!("s{i}"), 107).ok().filter(|r| r.worker == bad.worker));
    let second = second.expect("a second probe");
    b.outcomes().record(&store, second.worker, true, Now::from_secs(108));
    assert_eq!(b.front().breaker_state(bad.worker, Now::from_secs(108)), BreakerState::Closed);
    a.tick(&store, 108);
    let back = (0..9).filter(|i| route_at(&mut a, &store, &format!("c{i}"), 108).unwrap().worker == bad.worker).count();
    assert_eq!(back, 3, "round robin over all three again");
}

#[test]
fn a_failed_probe_opens_it_again() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","cb_failure_threshold":1,"cb_timeout_duration_secs":5"#);
    let bad = routed(&mut g, &store, &body("x"));
    g.outcomes().record(&store, bad.worker, false, Now::from_secs(100));
    let probe =
        (0..30).find_map(|i| route_at(&mut g, &store, &format!("p{i}"), 105).ok().filter(|r| r.worker == bad.worker));
    g.outcomes().record(&store, probe.expect("a probe").worker, false, Now::from_secs(106));
    assert_eq!(
        g.front().breaker_state(bad.worker, Now::from_secs(110)),
        BreakerState::Open,
        "for another 5 s from 106"
    );
    assert_eq!(g.front().breaker_state(bad.worker, Now::from_secs(111)), BreakerState::HalfOpen);
}

#[test]
fn breakers_keep_time_to_the_millisecond() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","cb_failure_threshold":1,"cb_timeout_duration_secs":5"#);
    let w = routed(&mut g, &store, &body("x"));
    g.outcomes().record(&store, w.worker, false, Now::from_ms(100_900));
    assert_eq!(g.front().breaker_state(w.worker, Now::from_ms(105_899)), BreakerState::Open);
    assert_eq!(g.front().breaker_state(w.worker, Now::from_ms(105_900)), BreakerState::HalfOpen);
    assert_eq!(Now::from_nanos(1_234_567_890).ms(), 1_234);
}

#[test]
fn client_errors_and_disabled_breakers_never_take_a_worker_out() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","cb_failure_threshold":1"#);
    let w = routed(&mut g, &store, &body("x"));
    // The filter reports a 4xx as a success (the worker answered).
    for t in 0..100 {
        g.outcomes().record(&store, w.worker, true, Now::from_secs(t));
    }
    assert_eq!(g.front().breaker_state(w.worker, Now::from_secs(100)), BreakerState::Closed);
    let mut off = gateway(&store, r#","cb_failure_threshold":1,"disable_circuit_breaker":true"#);
    for t in 0..100 {
        off.outcomes().record(&store, w.worker, false, Now::from_secs(t));
    }
    assert!((0..30).any(|i| route_at(&mut off, &store, &format!("d{i}"), 100).unwrap().worker == w.worker));
}

#[test]
fn when_every_worker_is_open_the_answer_is_503() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","cb_failure_threshold":1"#);
    for port in 1..=3 {
        let w = g.view.table.workers.iter().find(|w| w.addr.ends_with(&format!(":3000{port}"))).unwrap().id;
        g.outcomes().record(&store, w, false, Now::from_secs(100));
    }
    assert_eq!(route_at(&mut g, &store, "x", 101).unwrap_err(), 503);
    assert_eq!(g.route_other(&store, Now::from_secs(101)).unwrap_err().status, 503);
}

#[test]
fn reports_carry_breaker_states_and_failovers() {
    let store = FakeStore::default();
    let mut g = gateway(&store, r#","cb_failure_threshold":1,"control_plane_cluster":"cp""#);
    let w = routed(&mut g, &store, &body("x"));
    g.outcomes().failover(&store, w.worker);
    g.outcomes().failover(&store, w.worker);
    g.outcomes().record(&store, w.worker, false, Now::from_secs(100));
    let other = g.view.table.workers.iter().map(|w| w.id).find(|&id| id != w.worker).unwrap();
    g.outcomes().failover(&store, other); // a worker with no request counts yet
    g.outcomes().failover(&store, 99); // not in the table: not reported
    let report = g.take_report(&store, "gw", Now::from_ms(100_500));
    let c = report.counts.iter().find(|c| c.worker == w.worker).unwrap();
    assert_eq!((c.breaker(), c.failovers, c.in_flight), (kvmesh_proto::v1::BreakerState::Open, 2, 1));
    let o = report.counts.iter().find(|c| c.worker == other).unwrap();
    assert_eq!((o.breaker(), o.failovers, o.requests), (kvmesh_proto::v1::BreakerState::Closed, 1, 0));
    assert!(report.counts.iter().all(|c| c.worker != 99));
    let later = g.take_report(&store, "gw", Now::from_ms(200_000));
    let c = later.counts.iter().find(|c| c.worker == w.worker).unwrap();
    assert_eq!(c.breaker(), kvmesh_proto::v1::BreakerState::HalfOpen);
}

#[test]
fn pd_failed_prefill_is_avoided_next_time() {
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "");
    let text = format!(r#"{{"text":"{}"}}"#, "s".repeat(300));
    let (first, _) = split(&mut g, &store, text.as_bytes());
    let failed = first.prefill.unwrap();
    g.outcomes().record(&store, failed.worker, false, Now::from_secs(1000));
    for _ in 0..10 {
        let (next, _) = split(&mut g, &store, text.as_bytes());
        assert_ne!(next.prefill.unwrap().worker, failed.worker, "the failed prefill worker is out of rotation");
    }
}

#[test]
fn pd_without_decode_workers_is_503_naming_the_role() {
    let store = FakeStore::default();
    let json = r#"{"pd_disaggregation":true,"prefill":["http://127.0.0.1:1"]}"#;
    let mut g = Gateway::new(Config::from_json(json.as_bytes()).unwrap(), &store, 1);
    let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text":"x"}"#));
    assert_eq!(r.status, 503);
    assert!(String::from_utf8_lossy(&r.body).contains("decode worker"));
    assert!(Inflight::read(&store).is_empty());
}

#[test]
fn pd_other_paths_go_to_decode_workers() {
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "");
    for _ in 0..10 {
        let (r, fallbacks) = g.route_other(&store, Now::from_secs(0)).unwrap();
        assert!(r.addr.ends_with(":30003") || r.addr.ends_with(":30004"));
        assert_eq!(fallbacks.len(), 1, "the other decode worker, never a prefill worker");
        assert!(fallbacks.iter().all(|a| (a.ends_with(":30003") || a.ends_with(":30004")) && *a != r.addr));
    }
}

#[test]
fn pd_bad_batches_are_refused_before_anything_is_counted() {
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "");
    let r = reply(req(&mut g, &store, Endpoint::Generate, br#"{"text":["a","b"],"sampling_params":[{}]}"#));
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("`sampling_params`"));
    assert!(Inflight::read(&store).is_empty());
    assert_eq!(g.index_len(), 0);
}

/// A VM is registered from its first request: the others' next heartbeat must not take it for
/// a dead one before it has published its own (VMs alone would then go on deciding alone).
#[test]
fn a_vm_that_just_started_routing_is_not_taken_for_dead() {
    let store = FakeStore::default();
    let mut a = gateway(&store, "");
    a.ledger_mut().serve(&store, 50_000);
    a.heartbeat(&store, 50_000);
    a.heartbeat(&store, 51_000);
    assert!(a.ledger().alone());
    let mut b = Gateway::new(a.config().clone(), &store, 7);
    b.ledger_mut().serve(&store, 51_500);
    a.heartbeat(&store, 52_000);
    a.heartbeat(&store, 53_000);
    assert_eq!(crate::shared::VmLedger::registered(&store).len(), 2, "b was reaped before its first heartbeat");
    assert!(!a.ledger().alone(), "a went on deciding alone");
}

/// A host whose plugins tick only on their streams' hooks (the native build) writes each end
/// at once when other VMs route: its next hook may be long in coming.
#[test]
fn without_a_timer_each_end_is_written_at_once() {
    let store = FakeStore::default();
    let mut g = gateway(&store, "");
    g.ledger_mut().write_ends_at_once();
    g.ledger_mut().serve(&store, 0);
    crate::shared::VmLedger::register(&store, 7);
    let (one, two) = (routed(&mut g, &store, &body("one")), routed(&mut g, &store, &body("two")));
    g.ledger_mut().finish(&store, &one, true);
    assert_eq!(Inflight::read(&store).iter().map(|&(_, n)| n).sum::<u32>(), 1, "with another in flight");
    g.ledger_mut().finish(&store, &two, true);
    assert_eq!(Inflight::read(&store).iter().map(|&(_, n)| n).sum::<u32>(), 0);
}
