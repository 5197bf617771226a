//! The seeds' other policies end to end (real kvmesh-cp, Envoy with the real filter, sims):
//! `prefix_hash` keeps shared-prefix sessions on one worker and spreads distinct ones,
//! `marginal_utility` moves new traffic off a worker made slow and back when it recovers,
//! `consistent_hashing` keeps a key on one worker and moves only the removed worker's keys.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, gateway, generate_tokens, served, sims, sync, FAST};
use kvmesh_testkit::http;
use kvmesh_testkit::{wait_until, ControlPlane, Envoy, Sim};
use serde_json::json;

/// kvmesh-cp over `workers` with `flags`, and one Envoy that has applied its first snapshot.
fn stack(workers: &[Sim], flags: &[&str]) -> (ControlPlane, Envoy) {
    let cp = control_plane(workers, flags);
    let envoy = gateway(&cp);
    (cp, envoy)
}

fn generate(envoy: &Envoy, text: &str, tokens: u32) -> String {
    served(&generate_tokens(envoy, text, tokens))
}

#[test]
fn prefix_hash_keeps_shared_prefix_sessions_together_and_spreads_distinct_ones() {
    let workers = sims(4, FAST);
    let (cp, envoy) = stack(&workers, &["--policy", "prefix_hash"]);
    // 12 sessions, each with its own long system prompt (distinct from the first byte), asked
    // 5 questions in turn, interleaved with the other sessions.
    let prompt = |s: usize| format!("Session {s:02}: you are assistant number {s}. {}", "Be brief. ".repeat(150));
    let mut home: HashMap<usize, String> = HashMap::new();
    for turn in 0..5 {
        for s in 0..12 {
            let w = generate(&envoy, &format!("{}Question {turn}?", prompt(s)), 1);
            let first = home.entry(s).or_insert_with(|| w.clone());
            assert_eq!(*first, w, "session {s}, turn {turn}: the shared prefix sticks");
        }
    }
    let used: HashSet<&String> = home.values().collect();
    assert!(used.len() >= 3, "distinct prefixes spread over the workers: {used:?}");
    // The workers agree: every session's turns after the first hit their cache.
    let cached: u64 = workers.iter().map(|w| w.stats().unwrap()["cached_tokens"].as_u64().unwrap()).sum();
    assert!(cached >= 12 * 4 * 1000 / 4, "the repeated prefixes were served from cache ({cached} tokens)");
    // Only the blocks prefix_hash considers (256 tokens: 32 blocks of 32 bytes) are indexed,
    // in the control plane too.
    wait_until("kvmesh-cp to merge the gateway's inserts", Duration::from_secs(10), || {
        let m = cp.match_text(prompt(0).as_bytes()).unwrap();
        m.as_array().unwrap().iter().any(|e| e["url"] == format!("http://{}", home[&0]) && e["blocks"] == 32)
    })
    .unwrap();
}

/// Shares of the workers over `n` requests sent by `clients` concurrent clients.
fn shares(envoy: &Envoy, clients: usize, n: usize, tokens: u32) -> HashMap<String, usize> {
    let counts = Mutex::new(HashMap::new());
    let sent = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for c in 0..clients {
            let (counts, sent) = (&counts, &sent);
            scope.spawn(move || {
                while sent.fetch_add(1, Ordering::SeqCst) < n {
                    let w = generate(envoy, &format!("client {c} asks something distinct"), tokens);
                    *counts.lock().unwrap().entry(w).or_insert(0) += 1;
                }
            });
        }
    });
    counts.into_inner().unwrap()
}

#[test]
fn marginal_utility_moves_new_traffic_off_a_slow_worker_and_back_when_it_recovers() {
    // Real time: a request decodes 8 tokens in about 70 ms.
    let workers = sims(3, &["--time-scale", "1"]);
    // Loads polled once an hour: the load term is the gateway's own in-flight count, weighted
    // double to spread six clients as the polled loads did (which would show whichever worker
    // served last as busy, and one client's requests would alternate between it and the next).
    let flags = ["--policy", "marginal_utility", "--load-poll-interval-ms", "3600000", "--utility-load-weight", "2"];
    let (cp, envoy) = stack(&workers, &flags);
    let slow = workers[0].addr();
    let fault = |f: f64| {
        let r = http::post(&format!("{}/sim/fault?slowdown={f}", workers[0].url()), b"", &[]).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    };
    // Warm up with background traffic until kvmesh-cp has a trend for every worker.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for c in 0..4 {
            let (envoy, stop) = (&envoy, &stop);
            scope.spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    generate(envoy, &format!("warm-up {c}"), 8);
                }
            });
        }
        let scored =
            wait_until("kvmesh-cp to score every worker", Duration::from_secs(30), || workers_scored(&cp) == 3);
        stop.store(true, Ordering::SeqCst);
        scored.unwrap();
    });
    let count = |m: &HashMap<String, usize>| *m.get(&slow).unwrap_or(&0);
    // Shares under load (6 clients): a worker that gets 15 or fewer of 90 (a sixth) is starved;
    // at a fair third each, that would happen by chance with probability
    // P(Binomial(90, 1/3) <= 15) = 3.2e-4 (and 20 or fewer of 120: 3.4e-5).
    let before = shares(&envoy, 6, 90, 8);
    assert!(count(&before) > 15, "balanced before: {before:?}");

    // Eight times slower: its latency trend sinks its score. New requests (six clients) until
    // kvmesh-cp scores it lowest, and the gateway has that score.
    fault(8.0);
    let utility = |w: &Sim| cp.worker(&w.url())["utility"].as_f64().unwrap_or(0.0);
    wait_until("kvmesh-cp to score the slow worker lowest", Duration::from_secs(30), || {
        shares(&envoy, 6, 6, 8);
        let (u, others) = (utility(&workers[0]), [utility(&workers[1]), utility(&workers[2])]);
        u < 0.0 && others.iter().all(|&o| u < o)
    })
    .unwrap();
    sync(&cp, &envoy);
    // Then one client at a time, so that no request is in flight when the next is routed:
    // the load term (fewest outstanding, marginal_utility's fallback without trends) sees
    // equal loads and cannot tell the slow worker apart; only its score can. Round robin would
    // send it 30 of these 90, random routing 13 or fewer with probability
    // P(Binomial(90, 1/3) <= 13) = 4.2e-5.
    let during = shares(&envoy, 1, 90, 8);
    assert!(count(&during) <= 13, "the slow worker {slow} still gets {during:?}");

    // Recovered: its share comes back.
    fault(1.0);
    shares(&envoy, 6, 60, 8);
    let after = shares(&envoy, 6, 120, 8);
    assert!(count(&after) > 20, "the recovered worker {slow} gets {after:?}");
    eprintln!("slow worker {slow}: before {before:?}, slow {during:?}, recovered {after:?}");
    // The scores reached the gateway through the snapshots (kvmesh-cp shows what it sent).
    assert!(workers_scored(&cp) >= 2, "{:?}", cp.workers());
    let metrics = cp.metrics();
    let gauges = metrics.lines().filter(|l| l.starts_with("kvmesh_worker_utility{")).count();
    assert!(gauges >= 2, "the scores are in /metrics too: {gauges}");
}

/// Workers kvmesh-cp has a marginal_utility score for.
fn workers_scored(cp: &ControlPlane) -> usize {
    cp.workers().iter().filter(|w| w["utility"].is_number()).count()
}

#[test]
fn consistent_hashing_keeps_a_key_on_one_worker_and_moves_only_a_removed_workers_keys() {
    let workers = sims(4, FAST);
    let (cp, envoy) = stack(&workers, &["--policy", "consistent_hashing", "--routing-key-body-field", "user"]);
    let keyed = |key: &str, i: usize| {
        let r = http::post(
            &envoy.url("/generate"),
            json!({"text": format!("prompt {i} of {key}"), "sampling_params": {"max_new_tokens": 1}})
                .to_string()
                .as_bytes(),
            &[("content-type", "application/json"), ("x-session-id", key)],
        )
        .unwrap();
        served(&r)
    };
    let keys: Vec<String> = (0..40).map(|i| format!("session-{i}")).collect();
    let owner: HashMap<&String, String> = keys.iter().map(|k| (k, keyed(k, 0))).collect();
    for (i, k) in keys.iter().enumerate() {
        for turn in 1..3 {
            assert_eq!(keyed(k, turn * 100 + i), owner[k], "{k} moved");
        }
    }
    let per_worker: HashSet<&String> = owner.values().collect();
    assert_eq!(per_worker.len(), 4, "keys spread over every worker");
    // The same key in the body (an OpenAI `user`) lands on the same worker.
    for k in keys.iter().take(5) {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "user": k, "max_tokens": 1});
        assert_eq!(served(&http::post_json(&envoy.url("/v1/chat/completions"), &body).unwrap()), owner[k], "{k}");
    }

    // One worker leaves: only its keys move, each to one new worker.
    let gone = workers[1].addr();
    let r = cp.post(&format!("/remove_worker?url={}", workers[1].url())).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    sync(&cp, &envoy);
    let mut moved = 0;
    for (i, k) in keys.iter().enumerate() {
        let now = keyed(k, 1000 + i);
        assert_ne!(now, gone);
        if owner[k] == gone {
            moved += 1;
            assert_eq!(keyed(k, 2000 + i), now, "{k} sticks to its new worker");
        } else {
            assert_eq!(now, owner[k], "{k} moved although its worker stayed");
        }
    }
    // Exactly the removed worker's keys moved (how many it had is the hash's draw: 10 of 40
    // on average, 20 or more in about 1 run in 2,000).
    let had = owner.values().filter(|w| **w == gone).count();
    assert!(had > 0, "the removed worker owned keys");
    assert_eq!(moved, had);
}
