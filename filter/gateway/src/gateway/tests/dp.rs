//! Data-parallel ranks (`--dp-aware`): each rank of a worker is a routing target of its own
//! (same address, own id, load and prefix index), and the body it gets names the rank.

use super::*;
use crate::gateway::{Outcome, Plan, RequestInfo};
use crate::shared::fake::FakeStore;
use kvmesh_core::Endpoint;
use serde_json::Value;

fn gateway(store: &FakeStore, seed: u64) -> Gateway {
    let json = r#"{"control_plane_cluster":"cp","worker_urls":["http://127.0.0.1:1"],"cache_threshold":0.2,
        "retry_max_retries":3}"#;
    let mut g = Gateway::new(kvmesh_core::Config::from_json(json.as_bytes()).unwrap(), store, seed);
    g.publisher().set_reporting(true);
    g
}

fn rank(id: u32, port: u16, dp_rank: Option<u32>, load: u64) -> proto::Worker {
    proto::Worker { id, url: format!("http://127.0.0.1:{port}"), healthy: true, dp_rank, load, ..Default::default() }
}

/// Two workers (ports 20 and 21) with two ranks each: ids 10, 11 at 20, ids 12, 13 at 21.
fn two_by_two(loads: [u64; 4]) -> proto::Snapshot {
    proto::Snapshot {
        version: 1,
        full: true,
        workers: vec![
            rank(10, 20, Some(0), loads[0]),
            rank(11, 20, Some(1), loads[1]),
            rank(12, 21, Some(0), loads[2]),
            rank(13, 21, Some(1), loads[3]),
        ],
        workers_changed: true,
        ..Default::default()
    }
}

fn plan(g: &mut Gateway, store: &FakeStore, body: &str) -> Plan {
    match g.route_request(store, Endpoint::Generate, body.as_bytes(), &RequestInfo::default()) {
        Outcome::Route(plan) => plan,
        Outcome::Reply(r) => panic!("not routed: {} {}", r.status, String::from_utf8_lossy(&r.body)),
    }
}

/// Routes and commits `body`: the target (address, rank), and the rank the body sent names.
fn route(g: &mut Gateway, store: &FakeStore, body: &str) -> ((String, Option<u32>), Option<Value>) {
    let p = plan(g, store, body);
    let named = p.body().map(|b| serde_json::from_slice::<Value>(b).unwrap()["data_parallel_rank"].clone());
    let main = g.commit(store, p).main;
    crate::shared::Inflight::finish(store, main.worker, false);
    ((main.addr, main.dp_rank), named)
}

fn prompt(family: usize, turn: usize) -> String {
    format!(r#"{{"text":"family {family} shares this long system prompt {} then turn {turn}"}}"#, "x".repeat(200))
}

#[test]
fn a_prompt_family_sticks_to_one_rank_which_the_body_names_and_families_spread_over_ranks() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 7);
    g.apply_snapshot(&store, &two_by_two([0; 4]));
    let mut homes = std::collections::BTreeSet::new();
    for family in 0..8 {
        let (home, named) = route(&mut g, &store, &prompt(family, 0));
        assert_eq!(named, home.1.map(Value::from), "the body names the rank chosen");
        for turn in 1..4 {
            assert_eq!(route(&mut g, &store, &prompt(family, turn)).0, home, "family {family} stays on its rank");
        }
        homes.insert(home);
    }
    assert_eq!(homes.len(), 4, "eight families over both ranks of both workers: {homes:?}");
}

#[test]
fn a_clients_own_rank_is_replaced_and_the_fallbacks_are_the_same_rank_elsewhere() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 3);
    // Rank 1 of the worker at 20 is the least loaded by far: chosen (the system is imbalanced).
    g.apply_snapshot(&store, &two_by_two([500, 0, 500, 500]));
    let p = plan(&mut g, &store, r#"{"data_parallel_rank":0,"text":"hello"}"#);
    assert_eq!((p.addr(), p.main.dp_rank), ("127.0.0.1:20", Some(1)));
    let sent: Value = serde_json::from_slice(p.body().unwrap()).unwrap();
    assert_eq!(sent["data_parallel_rank"], 1, "the gateway's rank, not the client's");
    assert_eq!(p.fallbacks(), ["127.0.0.1:21"], "rank 1 of the other worker only, not rank 0 of its own");
    // The upstream Envoy reports is told apart by the rank the request named.
    assert_eq!(g.front().worker_at("127.0.0.1:21", Some(1)), Some(13));
    assert_eq!(g.front().worker_at("127.0.0.1:21", Some(0)), Some(12));
    assert_eq!(g.front().worker_at("127.0.0.1:21", None), None);
}

#[test]
fn without_ranks_the_body_goes_as_sent_and_a_changed_rank_forgets_the_index() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 5);
    let mut plain = two_by_two([0; 4]);
    plain.workers = vec![rank(10, 20, None, 0), rank(11, 21, None, 0)];
    g.apply_snapshot(&store, &plain);
    // Without --dp-aware the control plane names no rank: the body goes as sent, but for a
    // client's own rank, which is taken out (the worker's DP controller would obey it).
    let p = plan(&mut g, &store, r#"{"text":"hello"}"#);
    assert!(p.body().is_none() && p.main.dp_rank.is_none());
    let p = plan(&mut g, &store, r#"{"data_parallel_rank":1,"text":"hello"}"#);
    assert_eq!(p.body(), Some(&br#"{"text":"hello"}"#[..]));
    assert!(p.main.dp_rank.is_none());
    assert_eq!(g.front().worker_at(p.addr(), None), Some(p.main.worker));
    let (home, _) = route(&mut g, &store, &prompt(0, 0));
    assert_eq!(route(&mut g, &store, &prompt(0, 1)).0, home);
    // The same ids now ranks of one worker: what the index held for them is forgotten.
    let mut ranked = plain.clone();
    ranked.version = 2;
    ranked.workers = vec![rank(10, 20, Some(0), 0), rank(11, 20, Some(1), 0)];
    g.apply_snapshot(&store, &ranked);
    let p = plan(&mut g, &store, &prompt(0, 2));
    assert_eq!(p.main.matched_bytes, 0, "no prefix of the old worker attributed to a rank");
}
