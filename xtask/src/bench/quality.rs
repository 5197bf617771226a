//! The quality suite: how warm each router keeps the workers' KV caches, on seeded workloads
//! over 4 simulated workers with realistic timings. The hit rate is what the workers counted
//! (cached over prompt tokens in `/sim/stats`), not what a router believes; TTFT is the first
//! streamed event; imbalance is max/mean requests per worker. kvmesh runs at 1, 3 and 8
//! gateways sharing one kvmesh-cp, the peers at 1, 3 and 8 replicas (SMG also with its mesh).

use kvmesh_testkit::{http, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::{self, Peer, PeerBins, Running, Workers};
use super::workload::{self, Workload};
use super::Opts;
use crate::loadgen::{self, Stop};
use crate::tools::step;

/// The seed of every workload.
const SEED: u64 = 20_251_122;
const CONCURRENCY: usize = 16;

#[derive(Clone, Debug)]
struct Config {
    router: &'static str,
    replicas: usize,
    mesh: bool,
    policy: &'static str,
}

impl Config {
    fn label(&self) -> String {
        let (what, unit) = match self.router {
            "kvmesh" => ("kvmesh", "gateway"),
            "smg" => ("SMG 1.13.0", "replica"),
            _ => ("sglang-router 0.3.2", "replica"),
        };
        let mesh = if self.mesh { " +mesh" } else { "" };
        let s = if self.replicas > 1 { "s" } else { "" };
        format!("{what} ×{} {unit}{s}{mesh} ({})", self.replicas, self.policy)
    }
}

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

fn start(bins: &PeerBins, c: &Config, workers: &Workers) -> anyhow::Result<Running> {
    match c.router {
        // One Envoy worker thread per gateway: eight gateways share two cores.
        "kvmesh" => stack::kvmesh(workers, 1, c.replicas, c.policy, true),
        "smg" => stack::peer(bins, Peer::Smg, workers, c.replicas, c.mesh, c.policy),
        _ => stack::peer(bins, Peer::SglangRouter, workers, c.replicas, false, c.policy),
    }
}

fn stats(sims: &[Sim]) -> Vec<Value> {
    sims.iter().map(|s| s.stats().unwrap_or(Value::Null)).collect()
}

fn delta(after: &[Value], before: &[Value], key: &str) -> Vec<f64> {
    after.iter().zip(before).map(|(a, b)| a[key].as_f64().unwrap_or(0.0) - b[key].as_f64().unwrap_or(0.0)).collect()
}

/// The kvmesh gateways' engine-feedback counters, summed: (compared, accurate).
fn predictions(running: &Running) -> (f64, f64) {
    let read = |admin: &str, name: &str| -> f64 {
        let text =
            http::get(&format!("{admin}/stats?filter=^wasmcustom.{name}$")).map(|r| r.text()).unwrap_or_default();
        text.lines().filter_map(|l| l.split_once(": ")).filter_map(|(_, v)| v.trim().parse::<f64>().ok()).sum()
    };
    running.admin.iter().fold((0.0, 0.0), |(n, ok), a| {
        (n + read(a, "kvmesh_predictions_total"), ok + read(a, "kvmesh_predictions_accurate_total"))
    })
}

fn measure(w: &Workload, c: &Config, sims: &[Sim], running: &Running) -> Value {
    for s in sims {
        let _ = http::post(&format!("{}/flush_cache", s.url()), b"", &[]);
    }
    let before = stats(sims);
    let predicted_before = predictions(running);
    let load = loadgen::run(&c.label(), &running.targets, &w.requests, CONCURRENCY, Stop::Once);
    let after = stats(sims);
    let predicted_after = predictions(running);
    let compared = predicted_after.0 - predicted_before.0;
    // kvmesh only: the share of responses whose cached prefix the gateway predicted within one
    // index block (null for the peers, which publish no such figure).
    let accuracy = (compared > 0.0).then(|| (predicted_after.1 - predicted_before.1) / compared);
    let prompt: f64 = delta(&after, &before, "prompt_tokens").iter().sum();
    let cached: f64 = delta(&after, &before, "cached_tokens").iter().sum();
    let per_worker = delta(&after, &before, "requests");
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let max = per_worker.iter().cloned().fold(0.0, f64::max);
    let hit = if prompt > 0.0 { cached / prompt } else { 0.0 };
    eprintln!(
        "    {}: hit {:.1}%  TTFT p50 {:.1} ms p99 {:.1} ms  e2e p50 {:.1} ms  imbalance {:.2}  errors {}",
        c.label(),
        hit * 100.0,
        load.ttft_ms(0.5),
        load.ttft_ms(0.99),
        load.ms(0.5),
        if mean > 0.0 { max / mean } else { 0.0 },
        load.errors
    );
    if let Some(a) = accuracy {
        eprintln!("      hit-prediction accuracy {:.1}% over {compared} responses", a * 100.0);
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
        "requests_per_worker": per_worker,
        "seconds": load.elapsed.as_secs_f64(),
    })
}

pub fn run(o: &Opts, bins: &PeerBins) -> anyhow::Result<(Value, String)> {
    let n = if o.quick { 64 } else { 1200 };
    let mut workloads = workload::all(SEED, n);
    if !o.workloads.is_empty() {
        let known: Vec<&str> = workloads.iter().map(|w| w.name).collect();
        if let Some(bad) = o.workloads.iter().find(|n| !known.contains(&n.as_str())) {
            anyhow::bail!("--workload {bad}: unknown (one of {})", known.join(", "));
        }
        workloads.retain(|w| o.workloads.iter().any(|n| n == w.name));
    }
    let configs = configs(o, bins);
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
        for c in &configs {
            match start(bins, c, &workers) {
                Ok(running) => results.push(measure(w, c, &sims, &running)),
                Err(e) => {
                    eprintln!("    {} did not start: {e:#}", c.label());
                    failures.push(json!({"workload": w.name, "config": c.label(), "error": format!("{e:#}")}));
                }
            }
        }
    }
    let ratios = ratios(&results);
    let doc = json!({
        "suite": "quality",
        "params": {
            "seed": SEED, "requests_per_workload": n, "concurrency": CONCURRENCY, "workers": 4,
            "sim": "real-time latency model (--time-scale 1), --max-running 32, KV capacity per workload",
            "kvmesh_envoy_threads": 1,
            "workloads": workloads.iter().map(|w| json!({"name": w.name, "what": w.what, "kv_capacity_tokens": w.kv_capacity_tokens})).collect::<Vec<_>>(),
        },
        "results": results,
        "ratios": ratios,
        "failed_to_start": failures,
    });
    let md = markdown(&doc, &workloads);
    Ok((doc, md))
}

/// kvmesh against each peer on the same workload, policy and number of replicas (SMG with
/// and without its mesh): hit-rate difference in points, TTFT p50 ratio.
fn ratios(results: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for k in results.iter().filter(|r| r["router"] == "kvmesh") {
        for p in results.iter().filter(|r| {
            r["router"] != "kvmesh"
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
    let mut md = format!(
        "## Quality ({} requests per workload, seed {}, {} concurrent streams, 4 workers with the real-time latency model)\n\n",
        p["requests_per_workload"], p["seed"], p["concurrency"]
    );
    let results = doc["results"].as_array().cloned().unwrap_or_default();
    for w in workloads {
        md.push_str(&format!("### {} — {}\n\n", w.name, w.what));
        let rows: Vec<Vec<String>> = results
            .iter()
            .filter(|r| r["workload"] == w.name)
            .map(|r| {
                let v = |k: &str, d: usize| r[k].as_f64().map_or("-".into(), |x| f(x, d));
                vec![
                    r["config"].as_str().unwrap_or("").to_string(),
                    r["hit_rate"].as_f64().map_or("-".into(), |x| f(x * 100.0, 1)),
                    v("ttft_p50_ms", 1),
                    v("ttft_p99_ms", 1),
                    v("e2e_p50_ms", 1),
                    v("e2e_p99_ms", 1),
                    v("imbalance", 2),
                    r["prediction_accuracy"].as_f64().map_or("-".into(), |x| f(x * 100.0, 1)),
                    r["errors"].to_string(),
                ]
            })
            .collect();
        md.push_str(&table(
            &[
                "router",
                "hit %",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "e2e p50 ms",
                "e2e p99 ms",
                "imbalance",
                "hit prediction %",
                "errors",
            ],
            &rows,
        ));
        md.push('\n');
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
