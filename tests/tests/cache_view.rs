//! The cache view under pressure, end to end (real kvmesh-cp, Envoy with the real filter,
//! sims): the index's part of a worker stays within the KV capacity the worker reports, and
//! a prefix the worker evicted behind the gateway's back stops attracting traffic once a
//! response shows it, with hit-prediction accuracy in kvmesh-cp's `/workers` and `/metrics`
//! and in Envoy's stats; three gateways on a tight workload keep one gateway's hit rate and
//! each prompt's place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, gateway, generate_tokens, served, sims, FAST};
use kvmesh_testkit::http;
use kvmesh_testkit::{prom, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

/// The real-time measurement runs alone: the binary's other tests share the machine's cores
/// and would slow the deltas it measures (CI has 2 cores); they take it shared.
static MACHINE: RwLock<()> = RwLock::new(());

/// Sends a generation through the gateway; returns the worker that served it.
fn generate(envoy: &Envoy, text: &str) -> String {
    served(&kvmesh_testkit::e2e::generate(envoy, text))
}

/// Index blocks the control plane believes `url` holds of `text`.
fn held(cp: &ControlPlane, url: &str, text: &str) -> u64 {
    let m = cp.match_text(text.as_bytes()).unwrap();
    m.as_array().unwrap().iter().find(|e| e["url"] == url).map_or(0, |e| e["blocks"].as_u64().unwrap())
}

#[test]
fn a_workers_part_of_the_index_stays_within_the_kv_capacity_it_reports() {
    let _shared = MACHINE.read().unwrap_or_else(|e| e.into_inner());
    // 512 tokens: 32 pages of 16 tokens; 2048 bytes of prompt at 4 bytes a token, 64 blocks.
    let sim = Sim::start(&[FAST, &["--kv-capacity-tokens", "512"]].concat()).unwrap();
    // No periodic eviction within the test: only the capacity model can bound the index.
    let cp = control_plane(std::slice::from_ref(&sim), &["--eviction-interval-secs", "3600"]);
    wait_until("kvmesh-cp to learn the worker's KV capacity", Duration::from_secs(15), || {
        cp.worker(&sim.url())["kv_capacity_tokens"] == 512
    })
    .unwrap();
    let envoy = gateway(&cp);
    // 20 prompts of 256 bytes (64 tokens, 8 blocks each): 1280 tokens, 2.5 times the capacity.
    let prompts: Vec<String> = (0..20).map(|i| format!("{i:03} {}", "p".repeat(252))).collect();
    for p in &prompts {
        generate(&envoy, p);
        let w = cp.worker(&sim.url());
        let tokens = w["index_tokens"].as_u64().unwrap();
        assert!(tokens <= 512, "the index claims {tokens} tokens of a worker that holds 512: {w}");
    }
    // Everything reported: 160 blocks routed, 64 kept.
    wait_until("kvmesh-cp to evict the worker's least recently used blocks", Duration::from_secs(15), || {
        cp.metric("kvmesh_evicted_blocks_total") >= Some(96.0)
    })
    .unwrap();
    let w = cp.worker(&sim.url());
    assert_eq!((w["index_entries"].as_u64(), w["index_tokens"].as_u64()), (Some(64), Some(512)), "{w}");
    assert_eq!(cp.metric("kvmesh_worker_kv_capacity_tokens"), Some(512.0));
    assert_eq!(cp.metric("kvmesh_worker_index_tokens"), Some(512.0));
    // The same prefixes as the worker's own LRU: the last 8 prompts, not the first ones.
    for (i, p) in prompts.iter().enumerate() {
        let want = if i >= 12 { 8 } else { 0 };
        assert_eq!(held(&cp, &sim.url(), p), want, "prompt {i}");
    }
    // And the worker agrees: the oldest prompt is a miss there, the newest a hit.
    let cached = |text: &str| {
        let r = http::post_json(&format!("{}/generate", sim.url()), &json!({"text": text})).unwrap();
        r.json().unwrap()["meta_info"]["cached_tokens"].as_u64().unwrap()
    };
    assert_eq!(cached(&prompts[19]), 64);
    assert_eq!(cached(&prompts[0]), 0);
}

#[test]
fn a_prefix_the_worker_evicted_stops_attracting_traffic_and_accuracy_is_exported() {
    let _shared = MACHINE.read().unwrap_or_else(|e| e.into_inner());
    let sims = sims(2, FAST);
    let cp = control_plane(&sims, &[]);
    let envoy = gateway(&cp);
    let stat = |name: &str| envoy.filter_stat(name);
    let prompt = format!("system prompt: {}", "s".repeat(625)); // 640 bytes: 160 tokens, 20 blocks
    let first = generate(&envoy, &prompt); // predicted 0, found 0
    let sim = sims.iter().find(|s| s.addr() == first).unwrap();
    // Another prompt as long goes to the other worker, the emptiest: from now on that one's
    // index is the larger.
    assert_ne!(generate(&envoy, &format!("other prompt: {}", "o".repeat(626))), first);
    assert_eq!(generate(&envoy, &prompt), first, "predicted 160 tokens, found 160");
    assert_eq!(stat("kvmesh_cache_hits_total"), 1);
    // The worker loses its cache behind the gateway's back (a restart, another router's traffic).
    assert_eq!(http::post(&format!("{}/flush_cache", sim.url()), b"", &[]).unwrap().status, 200);
    assert_eq!(generate(&envoy, &prompt), first, "the index still believes it: predicted 160, found 0");
    assert_eq!(stat("kvmesh_cache_hits_total"), 2);
    wait_until("the gateway to judge the four responses", Duration::from_secs(10), || {
        stat("kvmesh_predictions_total") == 4
    })
    .unwrap();
    assert_eq!((stat("kvmesh_predictions_accurate_total"), stat("kvmesh_predictions_over_total")), (3, 1));
    // Every gateway learns: kvmesh-cp drops the prefix for that worker.
    wait_until("kvmesh-cp to drop the stale prefix", Duration::from_secs(10), || held(&cp, &sim.url(), &prompt) == 0)
        .unwrap();
    // The next request with that prefix is no cache hit: placed as a new prefix, on the
    // emptiest index, this worker's again. Predicted 0 tokens, it finds the 160 the last
    // request cached again.
    assert_eq!(generate(&envoy, &prompt), first);
    assert_eq!(stat("kvmesh_cache_hits_total"), 2, "the stale prefix attracts no traffic");
    // Accuracy per worker in /workers and /metrics, matching what the sim reported (once
    // kvmesh-cp has summed every response the sim served: a report can trail a response).
    let sim_cached = sim.stats().unwrap()["cached_tokens"].as_u64().unwrap();
    let settled = wait_until("kvmesh-cp to sum the gateway's feedback", Duration::from_secs(10), || {
        let p = &cp.worker(&sim.url())["prediction"];
        p["predictions"].as_u64() == Some(4) && p["cached_tokens"].as_u64() == Some(sim_cached)
    });
    let w = cp.worker(&sim.url());
    assert!(settled.is_ok(), "4 predictions, {sim_cached} cached tokens never matched: {w}");
    let p = &w["prediction"];
    let verdicts = (p["accurate"].as_u64(), p["over"].as_u64(), p["under"].as_u64());
    assert_eq!(verdicts, (Some(2), Some(1), Some(1)), "{w}");
    assert_eq!(p["predicted_tokens"].as_u64(), Some(320), "{w}");
    assert_eq!(p["accuracy"].as_f64(), Some(0.5), "{w}");
    let metrics = cp.metrics();
    let series = |name: &str| format!("{name}{{worker=\"{}\",role=\"regular\"}}", sim.url());
    assert_eq!(prom::value(&metrics, &series("kvmesh_worker_prediction_accuracy")), Some(0.5), "{metrics}");
    assert!(metrics.contains(&format!("{} 1", series("kvmesh_worker_predictions_over_total"))), "{metrics}");
    assert!(prom::value(&metrics, "kvmesh_stale_blocks_total") >= Some(20.0), "{metrics}");
}

/// Agents (system prompts of ~2000 tokens) in the tight workload: 24 of them on 4 workers
/// holding 16384 tokens (8 prompts) each fit only if each prompt stays on one worker.
const AGENTS: usize = 24;

/// The tight workload through `gateways` Envoys sharing one fresh kvmesh-cp (see
/// [`tight_run_on`]).
fn tight_run(sims: &[Sim], gateways: usize, burst: bool, tokens: u32) -> (f64, f64) {
    flush(sims);
    let cp = control_plane(sims, &[]);
    for sim in sims {
        wait_until("kvmesh-cp to learn the KV capacity", Duration::from_secs(15), || {
            cp.worker(&sim.url())["kv_capacity_tokens"] == 16384
        })
        .unwrap();
    }
    let envoys: Vec<Envoy> = (0..gateways).map(|_| gateway(&cp)).collect();
    tight_run_on(sims, &envoys, burst, tokens)
}

fn flush(sims: &[Sim]) {
    for sim in sims {
        assert_eq!(http::post(&format!("{}/flush_cache", sim.url()), b"", &[]).unwrap().status, 200);
    }
}

/// The tight workload through `envoys`: 12 rounds over the agents in a scrambled order, 6
/// requests in flight, `tokens` generated each; with `burst`, the first three rounds are
/// replaced by each agent's first request sent to every gateway at the same moment
/// (concurrent first requests for a new prefix), one agent after another. Returns the hit
/// rate the sims counted and the workers per agent.
fn tight_run_on(sims: &[Sim], envoys: &[Envoy], burst: bool, tokens: u32) -> (f64, f64) {
    let gateways = envoys.len();
    let prompts: Vec<String> =
        (0..AGENTS).map(|a| format!("agent {a:02} instructions: {}", "follow the rules below. ".repeat(333))).collect();
    let rounds = |from: usize| (from..12).flat_map(|r| (0..AGENTS).map(move |k| (k * 7 + r * 5) % AGENTS));
    let order: Vec<usize> = rounds(if burst { 3 } else { 0 }).collect();
    let before: Vec<Value> = sims.iter().map(|s| s.stats().unwrap()).collect();
    let served: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
    let send = |envoy: &Envoy, agent: usize, i: usize| {
        let text = format!("{} question {i}?", prompts[agent]);
        let worker = kvmesh_testkit::e2e::served(&generate_tokens(envoy, &text, tokens));
        served.lock().unwrap().push((agent, worker));
    };
    if burst {
        let base = order.len();
        for k in 0..AGENTS {
            std::thread::scope(|scope| {
                for (g, envoy) in envoys.iter().enumerate() {
                    scope.spawn(move || send(envoy, k * 7 % AGENTS, base + k * gateways + g));
                }
            });
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..6 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&agent) = order.get(i) else { break };
                send(&envoys[i % gateways], agent, i);
            });
        }
    });
    let after: Vec<Value> = sims.iter().map(|s| s.stats().unwrap()).collect();
    let sum = |key: &str| -> f64 {
        after.iter().zip(&before).map(|(a, b)| a[key].as_f64().unwrap() - b[key].as_f64().unwrap()).sum()
    };
    let mut pairs = served.into_inner().unwrap();
    assert_eq!(pairs.len(), order.len() + if burst { AGENTS * gateways } else { 0 });
    pairs.sort();
    pairs.dedup();
    (sum("cached_tokens") / sum("prompt_tokens"), pairs.len() as f64 / AGENTS as f64)
}

#[test]
fn three_gateways_on_a_tight_workload_keep_one_gateways_hit_rate_and_each_prompts_place() {
    let _alone = MACHINE.write().unwrap_or_else(|e| e.into_inner());
    // Real-time sims (a miss costs ~80 ms of prefill, 8 tokens ~70 ms of decode): a request
    // rate at which kvmesh-cp's deltas reach every gateway before an agent comes round again.
    let sims = sims(4, &["--time-scale", "1", "--kv-capacity-tokens", "16384"]);
    let (hit_one, spread_one) = tight_run(&sims, 1, false, 8);
    let (hit_three, spread_three) = tight_run(&sims, 3, false, 8);
    eprintln!("hit rate x1 {hit_one:.3} ({spread_one:.2} workers per agent), x3 {hit_three:.3} ({spread_three:.2})");
    // 24 first requests of 288 are misses: about 91.3 % at best.
    assert!(hit_one > 0.88, "one gateway: {hit_one:.3}");
    assert!(hit_three >= 0.97 * hit_one, "three gateways {hit_three:.3} against one {hit_one:.3}");
    assert!(spread_one <= 1.1, "one gateway moved prompts: {spread_one:.2} workers per agent");
    assert!(spread_three <= 1.2, "three gateways split prompts: {spread_three:.2} workers per agent");
}

#[test]
fn concurrent_first_requests_for_new_prompts_on_three_gateways_do_not_scatter_them() {
    let _shared = MACHINE.read().unwrap_or_else(|e| e.into_inner());
    // Sims that answer at once and every agent's first request on the three gateways at the
    // same moment: faster than any delta can travel, so only the placement rule itself (the
    // prompt's rendezvous hash among the emptiest workers) keeps the gateways agreeing. With
    // a random tie-break each prompt went to 3 of the 4 workers here and the hit rate fell
    // to 0.42-0.44. (Not covered: requests for *other* new prompts racing on the gateways,
    // which makes their views differ by what each placed last; see docs/benchmarks.md.)
    let sims = sims(4, &["--time-scale", "0", "--kv-capacity-tokens", "16384"]);
    let (hit, spread) = tight_run(&sims, 3, true, 1);
    eprintln!("x3 with bursts: hit rate {hit:.3} ({spread:.2} workers per agent)");
    // One gateway reaches about 0.91 on this stream (288 requests, 24 first ones).
    assert!(hit > 0.88, "three gateways under bursts: {hit:.3}");
    assert!(spread <= 1.1, "prompts scattered: {spread:.2} workers per agent");
}

/// One gateway of four worker threads (four VMs) without kvmesh-cp, requests faster than a
/// tick: a prompt one VM placed is where the others send it next. (An experiment in which VMs
/// that were not alone read and wrote shared data only on their tick sent each prompt to up
/// to 2 workers here: hit rate 0.59-0.82 against 0.913.)
#[test]
fn the_threads_of_one_gateway_agree_on_where_each_prompt_went() {
    let _shared = MACHINE.read().unwrap_or_else(|e| e.into_inner());
    let sims = sims(4, &["--time-scale", "0", "--kv-capacity-tokens", "16384"]);
    flush(&sims);
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut opts = EnvoyOptions::new(json!({"worker_urls": urls, "policy": "cache_aware"})).unwrap();
    opts.concurrency = 4;
    let envoy = Envoy::start(&opts).unwrap();
    let (hit, spread) = tight_run_on(&sims, std::slice::from_ref(&envoy), false, 1);
    eprintln!("one gateway, 4 threads: hit rate {hit:.3} ({spread:.2} workers per agent)");
    assert!(hit > 0.88, "four threads: {hit:.3}");
    assert!(spread <= 1.1, "prompts scattered over the threads: {spread:.2} workers per agent");
}
