//! The quality suite's `two_models` workload: two models behind one router, each on two of the
//! four workers (`kvmesh-sim --served-model-name`, which refuses another model's requests with
//! a 404, so a request routed to the wrong pool is an error here, not a silent success). Both
//! models get the same eight long system prompts: a router that keyed its prefix index by text
//! alone would believe one model's workers hold the other's prompts. kvmesh runs with
//! `--enable-igw` (one and three gateways on one kvmesh-cp), SMG 1.13 in its multi-model mode
//! (`--enable-igw`, which ignores `--worker-urls`: the workers are registered through its
//! `POST /workers`). Hit rates are what each model's workers counted.

use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use kvmesh_testkit::{free_port, http, wait_until, ControlPlane, Envoy, EnvoyOptions, Proc, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::routers::{delta, stats, Config};
use super::stack::{addr, wait_answering, PeerBins};
use super::workload::{text, Rng};
use super::Opts;
use crate::loadgen::{self, Stop};
use crate::tools::step;

const SEED: u64 = 20_261_126;
const MODELS: [&str; 2] = ["alpha", "beta"];
const CONCURRENCY: usize = 16;
/// Each worker's KV cache: room for every prompt of its model.
const KV_CAPACITY: &str = "262144";

/// The request stream: each request names one of the two models (at random), one of eight
/// ~2000-token system prompts (the same eight for both models) and a question of its own.
fn requests(n: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng::new(SEED);
    let systems: Vec<String> = (0..8).map(|i| format!("You are assistant {i}. {}", text(&mut rng, 8000))).collect();
    (0..n)
        .map(|_| {
            let model = MODELS[rng.below(MODELS.len())];
            let s = rng.below(systems.len());
            let body = json!({
                "model": model, "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "system", "content": systems[s]}, {"role": "user", "content": text(&mut rng, 200)}],
            });
            loadgen::post_with("/v1/chat/completions", &body.to_string(), &[])
        })
        .collect()
}

/// Waits until the router on `port` answers a chat request for the first model (a request
/// naming none is refused in multi-model mode).
fn wait_serving(what: &str, port: u16, alive: impl FnMut() -> bool) -> anyhow::Result<()> {
    let body = json!({"model": MODELS[0], "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1});
    wait_answering(what, port, "/v1/chat/completions", &body, alive)
}

/// A router in front of the two models' workers.
struct Router {
    targets: Vec<std::net::SocketAddr>,
    _envoys: Vec<Envoy>,
    _cp: Option<ControlPlane>,
    _procs: Vec<Proc>,
}

fn kvmesh(sims: &[Sim], gateways: usize) -> anyhow::Result<Router> {
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let mut args = vec!["--policy", "cache_aware", "--enable-igw", "--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    let cp = ControlPlane::start(&args)?;
    wait_until("kvmesh-cp to learn every worker's model", Duration::from_secs(30), || {
        sims.iter().all(|s| cp.worker(&s.url())["models"].as_array().is_some_and(|m| !m.is_empty()))
    })?;
    let mut envoys = Vec::new();
    let mut targets = Vec::new();
    for _ in 0..gateways {
        let mut opts = EnvoyOptions::new(json!({"worker_urls": [], "policy": "cache_aware"}))?;
        opts.concurrency = 1;
        opts.use_control_plane(&cp);
        let mut envoy = Envoy::start(&opts)?;
        let port = envoy.port;
        wait_serving("kvmesh", port, || envoy.proc().exited().is_none())?;
        envoy.wait_for_version(cp.settled_version()?);
        targets.push(addr(port));
        envoys.push(envoy);
    }
    Ok(Router { targets, _envoys: envoys, _cp: Some(cp), _procs: Vec::new() })
}

fn smg(bins: &PeerBins, sims: &[Sim], replicas: usize) -> anyhow::Result<Router> {
    let mut procs = Vec::new();
    let mut targets = Vec::new();
    for _ in 0..replicas {
        let port = free_port()?;
        let mut cmd = Command::new(bins.smg.as_ref().context("SMG is not installed")?);
        cmd.args(["launch", "--enable-igw", "--policy", "cache_aware", "--host", "127.0.0.1", "--log-level", "warn"]);
        cmd.args(["--port", &port.to_string(), "--prometheus-host", "127.0.0.1"]);
        cmd.args(["--prometheus-port", &free_port()?.to_string()]);
        let mut p = Proc::spawn("smg", cmd)?;
        let base = format!("http://127.0.0.1:{port}");
        wait_until("SMG to listen", Duration::from_secs(90), || {
            p.exited().is_some() || http::get(&format!("{base}/workers")).is_ok()
        })
        .map_err(|e| e.context(p.log_tail()))?;
        for s in sims {
            let r = http::post(&format!("{base}/workers"), json!({"url": s.url()}).to_string().as_bytes(), &[])?;
            anyhow::ensure!(r.status < 300, "SMG refused worker {}: {} {}", s.url(), r.status, r.text());
        }
        wait_until("SMG to take every worker", Duration::from_secs(60), || {
            http::get(&format!("{base}/workers")).ok().and_then(|r| r.json().ok()).is_some_and(|v: Value| {
                v["workers"].as_array().is_some_and(|ws| {
                    ws.len() == sims.len() && ws.iter().all(|w| w["is_healthy"] == true && w["status"] == "ready")
                })
            })
        })
        .map_err(|e| e.context(p.log_tail()))?;
        wait_serving("smg", port, || p.exited().is_none()).map_err(|e| e.context(p.log_tail()))?;
        targets.push(addr(port));
        procs.push(p);
    }
    Ok(Router { targets, _envoys: Vec::new(), _cp: None, _procs: procs })
}

fn configs(o: &Opts, bins: &PeerBins) -> Vec<Config> {
    let replicas: &[usize] = if o.quick { &[1] } else { &[1, 3] };
    let mut out = Vec::new();
    for &n in replicas {
        out.push(Config { router: "kvmesh", replicas: n, mesh: false, policy: "cache_aware" });
        if bins.smg.is_some() {
            out.push(Config { router: "smg", replicas: n, mesh: false, policy: "cache_aware" });
        }
    }
    out
}

/// Runs the workload for every configuration (`o.rounds` times, interleaved) into `results`
/// (rows as the other workloads', plus each model's hit rate); returns its parameters.
pub fn run(o: &Opts, bins: &PeerBins, results: &mut Vec<Value>, failures: &mut Vec<Value>) -> anyhow::Result<Value> {
    let n = if o.quick { 64 } else { 800 };
    let stream = requests(n);
    step(&format!("quality: two_models ({n} requests; two models on two workers each, the same system prompts)"));
    let sims: Vec<Sim> = MODELS
        .iter()
        .flat_map(|m| [m, m])
        .map(|m| Sim::start(&["--kv-capacity-tokens", KV_CAPACITY, "--max-running", "32", "--served-model-name", m]))
        .collect::<Result<_, _>>()?;
    let configs: Vec<Config> = configs(o, bins).into_iter().filter(|c| o.wants(&c.label())).collect();
    for round in 0..o.rounds {
        for c in &configs {
            let started = match c.router {
                "kvmesh" => kvmesh(&sims, c.replicas),
                _ => smg(bins, &sims, c.replicas),
            };
            match started {
                Ok(router) => {
                    let mut row = measure(c, &sims, &router, &stream);
                    row["round"] = json!(round);
                    results.push(row);
                }
                Err(e) => {
                    eprintln!("    {} did not start: {e:#}", c.label());
                    failures.push(json!({"workload": "two_models", "config": c.label(), "error": format!("{e:#}")}));
                }
            }
        }
    }
    Ok(
        json!({"requests": n, "seed": SEED, "models": MODELS, "workers_per_model": 2, "kv_capacity_tokens": KV_CAPACITY}),
    )
}

fn measure(c: &Config, sims: &[Sim], router: &Router, stream: &[Vec<u8>]) -> Value {
    for s in sims {
        let _ = http::post(&format!("{}/flush_cache", s.url()), b"", &[]);
    }
    let before = stats(sims);
    let load = loadgen::run(&c.label(), &router.targets, stream, CONCURRENCY, Stop::Once);
    let after = stats(sims);
    let (prompt, cached) = (delta(&after, &before, "prompt_tokens"), delta(&after, &before, "cached_tokens"));
    let rate = |range: std::ops::Range<usize>| {
        let p: f64 = prompt[range.clone()].iter().sum();
        if p > 0.0 {
            cached[range].iter().sum::<f64>() / p
        } else {
            0.0
        }
    };
    let per_worker = delta(&after, &before, "requests");
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    json!({
        "workload": "two_models",
        "router": c.router,
        "config": c.label(),
        "replicas": c.replicas,
        "mesh": false,
        "policy": c.policy,
        "requests_ok": load.ok,
        "errors": load.errors,
        "hit_rate": rate(0..sims.len()),
        "hit_rate_alpha": rate(0..2),
        "hit_rate_beta": rate(2..4),
        "ttft_p50_ms": load.ttft_ms(0.5),
        "ttft_p99_ms": load.ttft_ms(0.99),
        "e2e_p50_ms": load.ms(0.5),
        "e2e_p99_ms": load.ms(0.99),
        "imbalance": if mean > 0.0 { per_worker.iter().cloned().fold(0.0, f64::max) / mean } else { 0.0 },
        "requests_per_worker": per_worker,
        "seconds": load.elapsed.as_secs_f64(),
    })
}

/// The workload's table: each model's hit rate and the errors (requests a worker refused as
/// another model's, or that failed), averaged over the rounds.
pub fn markdown(doc: &Value) -> String {
    let rows_of: Vec<&Value> =
        doc["results"].as_array().into_iter().flatten().filter(|r| r["workload"] == "two_models").collect();
    let mut configs: Vec<&str> = rows_of.iter().filter_map(|r| r["config"].as_str()).collect();
    configs.dedup();
    let rows: Vec<Vec<String>> = configs
        .iter()
        .map(|c| {
            let rs: Vec<&&Value> = rows_of.iter().filter(|r| r["config"] == *c).collect();
            let mean = |k: &str| rs.iter().filter_map(|r| r[k].as_f64()).sum::<f64>() / rs.len().max(1) as f64;
            vec![
                c.to_string(),
                f(mean("hit_rate_alpha") * 100.0, 1),
                f(mean("hit_rate_beta") * 100.0, 1),
                f(mean("imbalance"), 2),
                f(mean("errors"), 0),
            ]
        })
        .collect();
    let mut md = format!(
        "### two_models — two models on two workers each, the same eight ~2000-token system prompts for both ({} requests; kvmesh with `--enable-igw`, SMG in its `--enable-igw` mode)\n\n",
        doc["params"]["two_models"]["requests"]
    );
    md.push_str(&table(&["router", "alpha hit %", "beta hit %", "imbalance", "errors (wrong model or failed)"], &rows));
    md.push('\n');
    md
}
