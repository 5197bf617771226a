//! The quality suite: how warm each router keeps the workers' KV caches, on seeded workloads
//! over 4 simulated workers with realistic timings. The hit rate is what the workers counted
//! (cached over prompt tokens in `/sim/stats`), not what a router believes; TTFT is the first
//! streamed event; imbalance is max/mean requests per worker. kvmesh runs at 1, 3 and 8
//! gateways sharing one kvmesh-cp, the peers at 1, 3 and 8 replicas (SMG also with its mesh).
//! The `trace` workload (a Mooncake-format trace replayed on its schedule) is in `trace.rs`,
//! the PD decider's (`pd_decider`: llm-d's protocol, prefix decider against always) in
//! `pd_decider.rs`; the workloads where the approximate index is wrong, run against workers
//! publishing KV events (`bypass`, `restart`, `tight_decode`), in `engine_truth.rs`, and the
//! trace against such workers (`trace_events`) in `engine_trace.rs`.

use kvmesh_testkit::{http, Sim};
use serde_json::{json, Value};

use super::models;
use super::report::{f, table};
use super::routers::{delta, start, stats, Config};
use super::stack::{PeerBins, Running, Workers};
use super::workload::{self, Workload};
use super::Opts;
use super::{engine_trace, engine_truth, pd_decider, trace};
use crate::loadgen::{self, Stop};
use crate::tools::step;

/// The seed of every workload.
const SEED: u64 = 20_251_122;
const CONCURRENCY: usize = 16;

/// Policies only kvmesh has (the peers as installed have no such `--policy`).
const KVMESH_ONLY: [&str; 3] = ["prefix_hash", "marginal_utility", "consistent_hashing"];

fn configs(o: &Opts, bins: &PeerBins) -> Vec<Config> {
    let policies: &[&'static str] =
        if o.quick { &["cache_aware"] } else { &["cache_aware", "power_of_two", "round_robin", "random"] };
    let replicas: &[usize] = if o.quick { &[3] } else { &[3, 8] };
    let mut routers = vec!["kvmesh"];
    if bins.smg.is_some() {
        routers.push("smg");
    }
    if bins.sglang_python.is_some() {
        routers.push("sglang-router");
    }
    let mut out = Vec::new();
    for &policy in policies {
        for &router in &routers {
            out.push(Config { router, replicas: 1, mesh: false, policy });
        }
    }
    if !o.quick {
        // With a control plane: marginal_utility's windows live there.
        for policy in KVMESH_ONLY {
            out.push(Config { router: "kvmesh", replicas: 1, mesh: false, policy });
        }
    }
    // Several replicas matter for the policy that keeps state: cache_aware.
    for &n in replicas {
        for &router in &routers {
            out.push(Config { router, replicas: n, mesh: false, policy: "cache_aware" });
            if router == "smg" {
                out.push(Config { router, replicas: n, mesh: true, policy: "cache_aware" });
            }
        }
    }
    out
}

/// A filter counter summed over the kvmesh gateways (0 for the peers, which have no admin).
fn counter(running: &Running, name: &str) -> f64 {
    running
        .admin
        .iter()
        .map(|admin| {
            let text =
                http::get(&format!("{admin}/stats?filter=^wasmcustom.{name}$")).map(|r| r.text()).unwrap_or_default();
            text.lines()
                .filter_map(|l| l.split_once(": "))
                .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum()
}

/// The kvmesh gateways' counters this suite reads, summed: requests routed, requests routed
/// to a worker whose index matched part of the prompt, responses whose cached prefix was
/// compared with the prediction, and those predicted within one block.
#[derive(Clone, Copy, Default)]
struct Counters {
    requests: f64,
    matched: f64,
    compared: f64,
    accurate: f64,
}

impl Counters {
    fn read(running: &Running) -> Self {
        Self {
            requests: counter(running, "kvmesh_requests_total"),
            matched: counter(running, "kvmesh_cache_hits_total"),
            compared: counter(running, "kvmesh_predictions_total"),
            accurate: counter(running, "kvmesh_predictions_accurate_total"),
        }
    }

    fn since(self, before: Self) -> Self {
        Self {
            requests: self.requests - before.requests,
            matched: self.matched - before.matched,
            compared: self.compared - before.compared,
            accurate: self.accurate - before.accurate,
        }
    }
}

fn measure(w: &Workload, c: &Config, sims: &[Sim], running: &Running) -> Value {
    for s in sims {
        let _ = http::post(&format!("{}/flush_cache", s.url()), b"", &[]);
    }
    let before = stats(sims);
    let counters_before = Counters::read(running);
    let load = loadgen::run(&c.label(), &running.targets, &w.requests, CONCURRENCY, Stop::Once);
    let after = stats(sims);
    let counted = Counters::read(running).since(counters_before);
    let compared = counted.compared;
    // kvmesh only: the share of responses whose cached prefix the gateway predicted within one
    // index block (null for the peers, which publish no such figure).
    let accuracy = (compared > 0.0).then(|| counted.accurate / compared);
    // kvmesh only: requests placed with no prefix match (a new prefix, or one the index lost).
    let unmatched = (counted.requests > 0.0).then_some(counted.requests - counted.matched);
    let prompt: f64 = delta(&after, &before, "prompt_tokens").iter().sum();
    let cached: f64 = delta(&after, &before, "cached_tokens").iter().sum();
    let per_worker = delta(&after, &before, "requests");
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let max = per_worker.iter().cloned().fold(0.0, f64::max);
    let hit = if prompt > 0.0 { cached / prompt } else { 0.0 };
    // Workers per session: 1.0 when every session stays where it started (null when the
    // router does not pass `x-session-id` on to the workers).
    let reached: f64 = after.iter().filter_map(|s| s["sessions"].as_f64()).sum();
    let copies = (reached > 0.0).then(|| reached / w.sessions().max(1) as f64);
    eprintln!(
        "    {}: hit {:.1}%  TTFT p50 {:.1} ms p99 {:.1} ms  e2e p50 {:.1} ms  imbalance {:.2}  workers per session {}  errors {}",
        c.label(),
        hit * 100.0,
        load.ttft_ms(0.5),
        load.ttft_ms(0.99),
        load.ms(0.5),
        if mean > 0.0 { max / mean } else { 0.0 },
        copies.map_or("-".into(), |c| format!("{c:.2}")),
        load.errors
    );
    if let (Some(a), Some(u)) = (accuracy, unmatched) {
        eprintln!(
            "      hit-prediction accuracy {:.1}% over {compared} responses; {u} requests placed with no match",
            a * 100.0
        );
    }
    json!({
        "workload": w.name,
        "router": c.router,
        "config": c.label(),
        "replicas": c.replicas,
        "mesh": c.mesh,
        "policy": c.policy,
        "requests_ok": load.ok,
        "errors": load.errors,
        "hit_rate": hit,
        "ttft_p50_ms": load.ttft_ms(0.5),
        "ttft_p99_ms": load.ttft_ms(0.99),
        "e2e_p50_ms": load.ms(0.5),
        "e2e_p99_ms": load.ms(0.99),
        "imbalance": if mean > 0.0 { max / mean } else { 0.0 },
        "prediction_accuracy": accuracy,
        "predictions_compared": compared,
        "placed_without_match": unmatched,
        "workers_per_session": copies,
        "requests_per_worker": per_worker,
        "seconds": load.elapsed.as_secs_f64(),
    })
}

pub fn run(o: &Opts, bins: &PeerBins) -> anyhow::Result<(Value, String)> {
    let n = if o.quick { 64 } else { 1200 };
    let mut workloads = workload::all(SEED, n);
    // The trace: when named, or in a full run of every workload when the default file is there
    // (`--quick` leaves it out: a few minutes more).
    let with_trace = if o.workloads.is_empty() {
        let there = trace::default_file().is_file();
        if !there && !o.quick {
            step(&format!("quality: no trace workload ({} is absent)", trace::default_file().display()));
        }
        there && !o.quick
    } else {
        let mut known: Vec<&str> = workloads.iter().map(|w| w.name).collect();
        known.extend(["trace", "two_models", pd_decider::NAME]);
        known.extend(engine_truth::NAMES);
        known.push(engine_trace::NAME);
        if let Some(bad) = o.workloads.iter().find(|n| !known.contains(&n.as_str())) {
            anyhow::bail!("--workload {bad}: unknown (one of {})", known.join(", "));
        }
        workloads.retain(|w| o.workloads.iter().any(|n| n == w.name));
        o.workloads.iter().any(|n| n == "trace")
    };
    // The PD decider's: when named, or in a full run of every workload.
    let with_pd = if o.workloads.is_empty() { !o.quick } else { o.workloads.iter().any(|n| n == pd_decider::NAME) };
    let configs: Vec<Config> = configs(o, bins).into_iter().filter(|c| o.wants(&c.label())).collect();
    anyhow::ensure!(
        workloads.is_empty() || !configs.is_empty(),
        "--only {:?}: no quality configuration is named so",
        o.only
    );
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for w in &workloads {
        step(&format!("quality: {} ({} requests; {})", w.name, w.requests.len(), w.what));
        let cap = w.kv_capacity_tokens.to_string();
        let slow = w.slow_worker.map(|f| f.to_string());
        let sims: Vec<Sim> = (0..4)
            .map(|i| {
                let mut args = vec!["--kv-capacity-tokens", &cap, "--max-running", "32"];
                if let (0, Some(f)) = (i, &slow) {
                    args.extend(["--slowdown", f.as_str()]);
                }
                Sim::start(&args)
            })
            .collect::<Result<_, _>>()?;
        let workers = Workers::Regular(sims.iter().map(Sim::url).collect());
        // Rounds interleaved: a slow minute of the machine spreads over every configuration.
        for round in 0..o.rounds {
            if o.rounds > 1 {
                step(&format!("quality: {} round {} of {}", w.name, round + 1, o.rounds));
            }
            for c in &configs {
                match start(bins, c, &workers, o.threads) {
                    Ok(running) => {
                        let mut r = measure(w, c, &sims, &running);
                        r["round"] = json!(round);
                        results.push(r);
                    }
                    Err(e) => {
                        eprintln!("    {} did not start: {e:#}", c.label());
                        failures.push(json!({"workload": w.name, "config": c.label(), "error": format!("{e:#}")}));
                    }
                }
            }
        }
    }
    let engine_truth = engine_truth::run(o, bins, &mut results, &mut failures)?;
    let trace_events = engine_trace::run(o, bins, &mut results, &mut failures)?;
    let trace = if with_trace { Some(trace::run(o, bins, &mut results, &mut failures)?) } else { None };
    // Two models behind one router: in a full run, or when named.
    let with_models = if o.workloads.is_empty() { !o.quick } else { o.workloads.iter().any(|n| n == "two_models") };
    let two_models = if with_models { Some(models::run(o, bins, &mut results, &mut failures)?) } else { None };
    let pd = if with_pd { Some(pd_decider::run(o.quick)?) } else { None };
    let summaries = summarise(&results);
    let ratios = ratios(&summaries);
    let doc = json!({
        "suite": "quality",
        "params": {
            "seed": SEED, "requests_per_workload": n, "concurrency": CONCURRENCY, "workers": 4,
            "sim": "real-time latency model (--time-scale 1), --max-running 32, KV capacity per workload",
            "kvmesh_envoy_threads": o.threads.max(1),
            "rounds": o.rounds,
            "workloads": workloads.iter().map(|w| json!({"name": w.name, "what": w.what, "kv_capacity_tokens": w.kv_capacity_tokens})).collect::<Vec<_>>(),
            "trace": trace,
            "two_models": two_models,
            "engine_truth": engine_truth,
            "trace_events": trace_events,
        },
        "pd_decider": pd,
        "results": results,
        "summaries": summaries,
        "ratios": ratios,
        "failed_to_start": failures,
    });
    let md = markdown(&doc, &workloads);
    Ok((doc, md))
}

/// The two-sided 95 % quantile of Student's t with `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const T: [f64; 10] = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23];
    match df {
        0 => f64::NAN,
        1..=10 => T[df - 1],
        11..=20 => 2.09,
        21..=30 => 2.04,
        _ => 1.96,
    }
}

/// Mean and the half-width of its 95 % confidence interval (NaN with one value).
pub fn mean_ci(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t95(n - 1) * (var / n as f64).sqrt())
}

/// One row per workload and configuration over its rounds: the means (with the hit rate's
/// 95 % confidence interval, minimum and maximum).
fn summarise(results: &[Value]) -> Vec<Value> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in results {
        let k = (r["workload"].as_str().unwrap_or("").to_string(), r["config"].as_str().unwrap_or("").to_string());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.iter()
        .filter_map(|(w, c)| {
            let rows: Vec<&Value> =
                results.iter().filter(|r| r["workload"] == w.as_str() && r["config"] == c.as_str()).collect();
            let first = rows.first()?;
            let values = |key: &str| -> Vec<f64> { rows.iter().filter_map(|r| r[key].as_f64()).collect() };
            let mean = |key: &str| -> Option<f64> { Some(mean_ci(&values(key)).0).filter(|m| m.is_finite()) };
            let hits = values("hit_rate");
            let (hit, ci) = mean_ci(&hits);
            Some(json!({
                "workload": w,
                "config": c,
                "router": first["router"],
                "replicas": first["replicas"],
                "mesh": first["mesh"],
                "policy": first["policy"],
                "rounds": rows.len(),
                "hit_rate": hit,
                "hit_rate_ci95": Some(ci).filter(|c| c.is_finite()),
                "hit_rate_min": hits.iter().cloned().fold(f64::INFINITY, f64::min),
                "hit_rate_max": hits.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                "ttft_p50_ms": mean("ttft_p50_ms"),
                "ttft_p99_ms": mean("ttft_p99_ms"),
                "e2e_p50_ms": mean("e2e_p50_ms"),
                "e2e_p99_ms": mean("e2e_p99_ms"),
                "imbalance": mean("imbalance"),
                "prediction_accuracy": mean("prediction_accuracy"),
                "placed_without_match": mean("placed_without_match"),
                "workers_per_session": mean("workers_per_session"),
                "lateness_p50_ms": mean("lateness_p50_ms"),
                "lateness_p99_ms": mean("lateness_p99_ms"),
                "errors": values("errors").iter().sum::<f64>(),
            }))
        })
        .collect()
}

/// kvmesh against each peer on the same workload, policy and number of replicas (SMG with
/// and without its mesh): hit-rate difference in points, TTFT p50 ratio.
fn ratios(results: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for k in results.iter().filter(|r| r["router"] == "kvmesh") {
        for p in results.iter().filter(|r| {
            !r["router"].as_str().unwrap_or("").starts_with("kvmesh")
                && r["workload"] == k["workload"]
                && r["policy"] == k["policy"]
                && r["replicas"] == k["replicas"]
        }) {
            let v = |r: &Value, key: &str| r[key].as_f64().unwrap_or(f64::NAN);
            out.push(json!({
                "workload": k["workload"],
                "policy": k["policy"],
                "replicas": k["replicas"],
                "versus": p["config"],
                "hit_rate_points": (v(k, "hit_rate") - v(p, "hit_rate")) * 100.0,
                "ttft_p50_ratio": v(k, "ttft_p50_ms") / v(p, "ttft_p50_ms"),
                "e2e_p50_ratio": v(k, "e2e_p50_ms") / v(p, "e2e_p50_ms"),
            }));
        }
    }
    out
}

fn markdown(doc: &Value, workloads: &[Workload]) -> String {
    let p = &doc["params"];
    let mut md = if workloads.is_empty() {
        "## Quality (4 workers with the real-time latency model)\n\n".to_string()
    } else {
        format!(
            "## Quality ({} requests per workload, seed {}, {} concurrent streams, 4 workers with the real-time latency model)\n\n",
            p["requests_per_workload"], p["seed"], p["concurrency"]
        )
    };
    let rows_of = doc["summaries"].as_array().cloned().unwrap_or_default();
    let rounds = p["rounds"].as_u64().unwrap_or(1);
    if rounds > 1 {
        md.push_str(&format!(
            "Every configuration ran {rounds} times, the rounds interleaved; each figure is the mean over the rounds, the hit rate with the half-width of its 95 % confidence interval (Student's t) and the lowest and highest round.\n\n"
        ));
    }
    for w in workloads {
        md.push_str(&format!("### {} — {}\n\n", w.name, w.what));
        let rows: Vec<Vec<String>> = rows_of
            .iter()
            .filter(|r| r["workload"] == w.name)
            .map(|r| {
                let v = |k: &str, d: usize| r[k].as_f64().map_or("-".into(), |x| f(x, d));
                let pct = |k: &str| r[k].as_f64().map_or("-".into(), |x| f(x * 100.0, 1));
                let hit = match r["hit_rate_ci95"].as_f64() {
                    Some(ci) => format!("{} ± {}", pct("hit_rate"), f(ci * 100.0, 1)),
                    None => pct("hit_rate"),
                };
                let mut row = vec![r["config"].as_str().unwrap_or("").to_string(), hit];
                if rounds > 1 {
                    row.push(format!("{}–{}", pct("hit_rate_min"), pct("hit_rate_max")));
                }
                row.extend([
                    v("ttft_p50_ms", 1),
                    v("ttft_p99_ms", 1),
                    v("e2e_p50_ms", 1),
                    v("e2e_p99_ms", 1),
                    v("imbalance", 2),
                    pct("prediction_accuracy"),
                    v("placed_without_match", 0),
                    v("workers_per_session", 2),
                    r["errors"].to_string(),
                ]);
                row
            })
            .collect();
        let mut header = vec!["router", "hit %"];
        if rounds > 1 {
            header.push("hit % range");
        }
        header.extend([
            "TTFT p50 ms",
            "TTFT p99 ms",
            "e2e p50 ms",
            "e2e p99 ms",
            "imbalance",
            "hit prediction %",
            "placed with no match",
            "workers per session",
            "errors",
        ]);
        md.push_str(&table(&header, &rows));
        md.push('\n');
    }
    if !p["engine_truth"].is_null() {
        md.push_str(&engine_truth::markdown(doc));
    }
    if !p["trace_events"].is_null() {
        md.push_str(&engine_trace::markdown(doc));
    }
    if !p["trace"].is_null() {
        md.push_str(&trace::markdown(doc));
    }
    if !p["two_models"].is_null() {
        md.push_str(&models::markdown(doc));
    }
    if !doc["pd_decider"].is_null() {
        md.push_str(&pd_decider::markdown(&doc["pd_decider"]));
    }
    md.push_str("### kvmesh − peer, same workload, policy and replica count\n\n");
    let rows: Vec<Vec<String>> = doc["ratios"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            vec![
                r["workload"].as_str().unwrap_or("").to_string(),
                format!("{} ×{}", r["policy"].as_str().unwrap_or(""), r["replicas"]),
                r["versus"].as_str().unwrap_or("").to_string(),
                r["hit_rate_points"].as_f64().map_or("-".into(), |x| format!("{x:+.1}")),
                r["ttft_p50_ratio"].as_f64().map_or("-".into(), |x| f(x, 2)),
            ]
        })
        .collect();
    md.push_str(&table(&["workload", "policy ×n", "versus", "hit points (kvmesh − peer)", "TTFT p50 ratio"], &rows));
    if let Some(f) = doc["failed_to_start"].as_array().filter(|a| !a.is_empty()) {
        md.push_str("\nConfigurations that did not start:\n\n");
        for x in f {
            md.push_str(&format!(
                "- {} on {}: {}\n",
                x["config"].as_str().unwrap_or(""),
                x["workload"].as_str().unwrap_or(""),
                x["error"].as_str().unwrap_or("")
            ));
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_run_compares_every_kvmesh_policy_and_the_peers_only_on_theirs() {
        let bins = PeerBins { smg: Some("smg".into()), sglang_python: Some("python".into()) };
        let all = configs(&Opts::new(false), &bins);
        let kvmesh: Vec<&str> =
            all.iter().filter(|c| c.router == "kvmesh" && c.replicas == 1).map(|c| c.policy).collect();
        for p in [
            "cache_aware",
            "power_of_two",
            "round_robin",
            "random",
            "prefix_hash",
            "marginal_utility",
            "consistent_hashing",
        ] {
            assert!(kvmesh.contains(&p), "{p}: {kvmesh:?}");
        }
        assert!(all.iter().filter(|c| c.router != "kvmesh").all(|c| !KVMESH_ONLY.contains(&c.policy)));
        let quick = configs(&Opts::new(true), &bins);
        assert!(quick.iter().all(|c| c.policy == "cache_aware"), "--quick stays short");
    }
}
