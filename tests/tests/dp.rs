//! Data-parallel ranks (`--dp-aware`), end to end: real kvmesh-cp learning each worker's
//! `dp_size` from its `/get_server_info` and each rank's load from its `/get_load`, real Envoy
//! with the real filter (the `.wasm`; the native build with `KVMESH_TEST_NATIVE=1`), simulated
//! SGLang workers with two ranks each that record the `data_parallel_rank` every request named
//! (and refuse one out of range).

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_testkit::e2e::{control_plane, gateway, post_in_thread, sync, worker_of, DECODE_20MS, HANG};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{wait_until, ControlPlane, Envoy, Sim};
use serde_json::{json, Value};

/// Two workers with two ranks each (a token every 20 ms), and kvmesh-cp with `flags`.
fn stack(flags: &[&str]) -> (Vec<Sim>, ControlPlane) {
    let args = [DECODE_20MS, &["--dp-size", "2"]].concat();
    let sims: Vec<Sim> = (0..2).map(|_| Sim::start(&args).unwrap()).collect();
    let mut all = vec!["--load-poll-interval-ms", "100", "--cache-threshold", "0.1"];
    all.extend(flags);
    let cp = control_plane(&sims, &all);
    (sims, cp)
}

/// The prompt of `family`'s `turn`: a long shared prefix, then the turn.
fn prompt(family: usize, turn: usize) -> String {
    format!("family-{family} system prompt: {} turn {turn}", "you answer briefly and well. ".repeat(12))
}

/// Sends `family`'s `turn` to the family's endpoint (one of the three: a chat's routing text
/// has its roles, so a family keeps to one endpoint).
fn ask(envoy: &Envoy, family: usize, turn: usize, tokens: u32) -> Response {
    let text = prompt(family, turn);
    let (path, body) = match family % 3 {
        0 => ("/generate", json!({"text": text, "sampling_params": {"max_new_tokens": tokens}})),
        1 => ("/v1/completions", json!({"model": "kvmesh-sim", "prompt": text, "max_tokens": tokens})),
        _ => (
            "/v1/chat/completions",
            json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": text}], "max_tokens": tokens}),
        ),
    };
    http::post(&envoy.url(path), body.to_string().as_bytes(), &[]).unwrap()
}

/// The prompt text of a request a sim recorded.
fn text_of(body: &Value) -> String {
    let t = body.get("text").or_else(|| body.get("prompt")).or_else(|| body["messages"][0].get("content"));
    t.and_then(Value::as_str).unwrap_or_default().to_string()
}

/// `(family, rank named)` of every generation `sim` recorded.
fn seen(sim: &Sim) -> Vec<(usize, Option<u64>)> {
    let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    log.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["path"] != "/abort_request")
        .filter_map(|e| {
            let text = text_of(&e["body"]);
            let family = text.strip_prefix("family-")?.split(' ').next()?.parse().ok()?;
            Some((family, e["body"].get("data_parallel_rank").map(|r| r.as_u64().unwrap_or(u64::MAX))))
        })
        .collect()
}

#[test]
fn with_dp_aware_each_prompt_family_keeps_to_one_rank_and_families_spread_over_all_ranks() {
    let (sims, cp) = stack(&["--dp-aware"]);
    let urls: Vec<String> = sims.iter().flat_map(|s| [format!("{}@0", s.url()), format!("{}@1", s.url())]).collect();
    wait_until("kvmesh-cp to register each worker's two ranks", HANG, || {
        urls.iter().all(|u| cp.worker(u)["dp_rank"].is_u64() && cp.worker(u)["healthy"] == true)
    })
    .unwrap();
    let envoy = gateway(&cp);
    sync(&cp, &envoy);

    // Eight families, four turns each, over the three endpoints.
    for turn in 0..4 {
        for family in 0..8 {
            let r = ask(&envoy, family, turn, 1);
            assert_eq!(r.status, 200, "family {family} turn {turn}: {}", r.text());
            worker_of(&r);
        }
    }
    // Every request named a rank, and each family's requests one rank of one worker.
    let mut homes: BTreeMap<usize, BTreeSet<(String, u64)>> = BTreeMap::new();
    for sim in &sims {
        for (family, rank) in seen(sim) {
            let rank = rank.unwrap_or_else(|| panic!("family {family} reached {} without a rank", sim.addr()));
            assert!(rank < 2, "family {family}: rank {rank}");
            homes.entry(family).or_default().insert((sim.addr(), rank));
        }
    }
    assert_eq!(homes.len(), 8);
    for (family, at) in &homes {
        assert_eq!(at.len(), 1, "family {family} moved between ranks: {at:?}");
    }
    let targets: BTreeSet<_> = homes.values().flatten().cloned().collect();
    assert_eq!(targets.len(), 4, "eight families over both ranks of both workers: {targets:?}");
    // Each rank has its own prefix cache: the families' later turns hit it.
    for sim in &sims {
        for rank in sim.stats().unwrap()["ranks"].as_array().unwrap() {
            assert!(rank["cached_tokens"].as_u64() > Some(0), "{}: {rank}", sim.addr());
        }
    }

    // Each rank's load is its own: a long request on family 0's rank shows there alone.
    let (addr, rank) = homes[&0].iter().next().cloned().unwrap();
    let sim = sims.iter().find(|s| s.addr() == addr).unwrap();
    let (busy, idle) = (format!("{}@{rank}", sim.url()), format!("{}@{}", sim.url(), 1 - rank));
    let long = post_in_thread(
        &envoy.url("/generate"),
        json!({"text": prompt(0, 9), "sampling_params": {"max_new_tokens": 100}}),
    );
    wait_until("kvmesh-cp to poll the busy rank's load", HANG, || cp.worker(&busy)["load"] == 1).unwrap();
    assert_eq!(cp.worker(&idle)["load"], 0, "the other rank of the same worker is idle");
    let (r, _) = long.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // A rank out of range is the worker's 400 (a router that named it would be wrong).
    let r = http::post(
        &format!("{}/generate", sim.url()),
        json!({"text": "x", "data_parallel_rank": 2}).to_string().as_bytes(),
        &[],
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn without_dp_aware_a_worker_is_one_target_and_no_rank_is_written() {
    let (sims, cp) = stack(&[]);
    let envoy = gateway(&cp);
    sync(&cp, &envoy);
    for turn in 0..3 {
        for family in 0..4 {
            let r = ask(&envoy, family, turn, 1);
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
    // A client's own rank never reaches a worker whose ranks the gateway does not split:
    // SGLang's DP controller would index its schedulers by it.
    for (family, own) in [(4, json!(7)), (5, json!(-1)), (6, json!(4096)), (7, json!("1"))] {
        let text = prompt(family, 0);
        let (path, body) = match family % 3 {
            0 => (
                "/generate",
                json!({"text": text, "data_parallel_rank": own, "sampling_params": {"max_new_tokens": 1}}),
            ),
            1 => (
                "/v1/completions",
                json!({"model": "kvmesh-sim", "prompt": text, "data_parallel_rank": own, "max_tokens": 1}),
            ),
            _ => (
                "/v1/chat/completions",
                json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": text}], "data_parallel_rank": own, "max_tokens": 1}),
            ),
        };
        let r = http::post(&envoy.url(path), body.to_string().as_bytes(), &[]).unwrap();
        assert_eq!(r.status, 200, "{own}: {}", r.text());
    }
    let urls: Vec<Value> = cp.workers().iter().map(|w| w["url"].clone()).collect();
    assert_eq!(urls, sims.iter().map(|s| Value::from(s.url())).collect::<Vec<_>>(), "no ranks listed");
    let seen: Vec<(usize, Option<u64>)> = sims.iter().flat_map(seen).collect();
    assert_eq!(seen.len(), 16);
    assert!(seen.iter().all(|(_, rank)| rank.is_none()), "a rank reached a worker: {seen:?}");
}
