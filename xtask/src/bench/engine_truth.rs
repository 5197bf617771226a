//! The engines' own truth (issue 46): quality workloads where kvmesh's approximate index is
//! wrong, each run against workers that publish their KV-cache events. kvmesh with events
//! (kvmesh-cp subscribed to every worker), kvmesh without (the gateways' own index, the
//! control plane's capacity model and engine feedback), SMG and sglang-router, each at one
//! gateway or replica and at 3 (8 too in a full run; SMG's replicas with its mesh).
//!
//! - `bypass`: a fifth of the traffic goes straight to the workers (a batch job pinned to
//!   each pod), the rest through the router;
//! - `restart`: halfway, one worker restarts in place (cache empty, event sequence from 0, no
//!   event saying so) and another is flushed (`/flush_cache`: `AllBlocksCleared`);
//! - `tight_decode`: long outputs on tight KV capacity: the engines cache the decoded pages
//!   and evict prefixes for them, which no router sees;
//!
//! The Mooncake trace against the same publishing workers is `engine_trace.rs`.
//!
//! Requests are SGLang's `/generate` (the routing text is the prompt the engine tokenizes;
//! a chat's is not its rendered template), not streamed: each answer's `meta_info` gives its
//! prompt and cached tokens, so the hit rate is of the routed requests only. Fresh workers for
//! every configuration: the same stream on the same empty caches. The prediction error is
//! kvmesh's: the tokens the gateways predicted cached for the chosen worker against the
//! `cached_tokens` it answered, over the compared responses (kvmesh-cp's `/workers`).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvmesh_testkit::{free_port, http, repo_root, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::routers::Config;
use super::stack::{self, PeerBins, Running, Workers};
use super::workload::{text, Rng};
use super::Opts;
use crate::tools::step;

/// The workloads' names (`--workload`).
pub const NAMES: [&str; 3] = ["bypass", "restart", "tight_decode"];
const SEED: u64 = 20_261_206;
const CONCURRENCY: usize = 16;
const WORKERS: usize = 4;
/// The KV events' encodings, one a worker in turn (both engines' wire formats at once).
const ENCODINGS: [&str; 2] = ["vllm-tagged", "sglang"];

/// What happens halfway through the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Midway {
    Nothing,
    /// Worker 0 restarts in place (`/sim/restart`), worker 1 is flushed (`/flush_cache`).
    RestartAndFlush,
}

/// Where a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Router,
    /// Straight to this worker.
    Worker(usize),
}

pub struct Workload {
    pub name: &'static str,
    pub what: &'static str,
    /// `/generate` bodies, in order, with where each goes.
    pub requests: Vec<(Target, Value)>,
    pub kv_capacity_tokens: u64,
    pub midway: Midway,
}

fn generate(prompt: String, max_new_tokens: u64) -> Value {
    json!({"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}})
}

/// `n` requests each (about), from `seed`.
pub fn all(seed: u64, n: usize) -> Vec<Workload> {
    vec![bypass(seed, n), restart(seed, n), tight_decode(seed, n)]
}

/// 48 documents of ~1200 tokens with a ~50-token question each; every fifth request goes
/// straight to worker `document % 4` (a batch job per pod) instead of the router. Capacity
/// 20k tokens a worker: the documents fit once (58k of 80k), not twice.
fn bypass(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 11);
    let docs: Vec<String> = (0..48).map(|i| format!("Document {i}. {}", text(&mut rng, 4800))).collect();
    let requests = (0..n)
        .map(|i| {
            let d = rng.below(docs.len());
            let target = if i % 5 == 4 { Target::Worker(d % WORKERS) } else { Target::Router };
            (target, generate(format!("{}\nQuestion: {}", docs[d], text(&mut rng, 200)), 8))
        })
        .collect();
    Workload {
        name: "bypass",
        what: "48 documents of ~1200 tokens, a fifth of the requests straight to the workers, 20k tokens a worker",
        requests,
        kv_capacity_tokens: 20_480,
        midway: Midway::Nothing,
    }
}

/// 16 system prompts of ~2000 tokens shared by every user, a ~50-token question each; halfway
/// worker 0 restarts and worker 1 is flushed.
fn restart(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 12);
    let systems: Vec<String> = (0..16).map(|i| format!("You are assistant {i}. {}", text(&mut rng, 8000))).collect();
    let requests = (0..n)
        .map(|_| {
            let s = rng.below(systems.len());
            (Target::Router, generate(format!("{}\nUser: {}", systems[s], text(&mut rng, 200)), 8))
        })
        .collect();
    Workload {
        name: "restart",
        what: "16 system prompts of ~2000 tokens; halfway worker 0 restarts in place and worker 1 is flushed",
        requests,
        kv_capacity_tokens: 65_536,
        midway: Midway::RestartAndFlush,
    }
}

/// 24 system prompts of ~1500 tokens, a ~50-token question and 128 output tokens each, on
/// workers holding 12k tokens: each answer's decoded pages are cached and evict prefixes.
fn tight_decode(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 13);
    let systems: Vec<String> = (0..24).map(|i| format!("You are agent {i}. {}", text(&mut rng, 6000))).collect();
    let requests = (0..n)
        .map(|_| {
            let s = rng.below(systems.len());
            (Target::Router, generate(format!("{}\nUser: {}", systems[s], text(&mut rng, 200)), 128))
        })
        .collect();
    Workload {
        name: "tight_decode",
        what: "24 system prompts of ~1500 tokens, 128 output tokens each, on workers holding 12k tokens",
        requests,
        kv_capacity_tokens: 12_288,
        midway: Midway::Nothing,
    }
}

/// A router to compare: a quality configuration, kvmesh's with or without the events.
pub(super) struct Row {
    pub config: Config,
    pub events: bool,
}

impl Row {
    pub fn label(&self) -> String {
        let l = self.config.label();
        if self.events {
            l.replacen("kvmesh", "kvmesh +events", 1)
        } else {
            l
        }
    }
}

/// kvmesh with and without events, SMG and sglang-router, at 1 gateway or replica and at 3
/// (8 too in a full run); SMG's replicas with its mesh, as in the trace workload.
pub(super) fn rows(o: &Opts, bins: &PeerBins) -> Vec<Row> {
    let c = |router, replicas, mesh| Config { router, replicas, mesh, policy: "cache_aware" };
    let mut out = Vec::new();
    for &n in if o.quick { &[1, 3][..] } else { &[1, 3, 8][..] } {
        out.push(Row { config: c("kvmesh", n, false), events: true });
        out.push(Row { config: c("kvmesh", n, false), events: false });
        if bins.smg.is_some() {
            out.push(Row { config: c("smg", n, n > 1), events: false });
        }
        if bins.sglang_python.is_some() {
            out.push(Row { config: c("sglang-router", n, false), events: false });
        }
    }
    out
}

/// Four workers publishing their KV events (the encodings in turn), with their endpoints.
pub(super) struct Publishers {
    pub sims: Vec<Sim>,
    /// `URL=tcp://PUB,tcp://REPLAY` per worker (kvmesh-cp's `--kv-events-worker`).
    flags: Vec<String>,
}

fn tokenizer() -> String {
    repo_root().join("sim/data/tokenizer.json").to_string_lossy().into_owned()
}

/// The publishing workers, each of `capacity` KV tokens running `max_running` at once.
pub(super) fn publishers(capacity: u64, max_running: u32) -> anyhow::Result<Publishers> {
    let (mut sims, mut flags) = (Vec::new(), Vec::new());
    let (cap, tok, running) = (capacity.to_string(), tokenizer(), max_running.to_string());
    for i in 0..WORKERS {
        let (p, r) = (free_port()?.to_string(), free_port()?.to_string());
        let args = [
            "--kv-capacity-tokens",
            &cap,
            "--max-running",
            &running,
            "--tokenizer",
            &tok,
            "--kv-events-port",
            &p,
            "--kv-events-replay-port",
            &r,
            "--kv-events-encoding",
            ENCODINGS[i % ENCODINGS.len()],
        ];
        let sim = Sim::start(&args)?;
        flags.push(format!("{}=tcp://127.0.0.1:{p},tcp://127.0.0.1:{r}", sim.url()));
        sims.push(sim);
    }
    Ok(Publishers { sims, flags })
}

pub(super) fn start(bins: &PeerBins, row: &Row, p: &Publishers, threads: u32) -> anyhow::Result<Running> {
    let workers = Workers::Regular(p.sims.iter().map(Sim::url).collect());
    if row.config.router != "kvmesh" {
        return super::routers::start(bins, &row.config, &workers, threads);
    }
    let mut args = Vec::new();
    if row.events {
        for flag in &p.flags {
            args.extend(["--kv-events-worker".to_string(), flag.clone()]);
        }
        args.extend(["--kv-events-tokenizer".to_string(), tokenizer()]);
    }
    stack::kvmesh_cp_args(&workers, threads.max(1), row.config.replicas, "cache_aware", &args)
}

/// What the routed requests' answers said, summed.
#[derive(Default)]
struct Tally {
    ok: u64,
    errors: u64,
    prompt: f64,
    cached: f64,
    direct_prompt: f64,
    direct_cached: f64,
    ms: Vec<f64>,
    first_error: Option<String>,
}

/// Sends `requests` over [`CONCURRENCY`] connections, in order (whichever is free takes the
/// next); a routed request `i` goes to `targets[i % len]`.
fn send(requests: &[(Target, Value)], targets: &[String], workers: &[String]) -> Tally {
    let next = AtomicUsize::new(0);
    let tally = Mutex::new(Tally::default());
    std::thread::scope(|s| {
        for _ in 0..CONCURRENCY {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Relaxed);
                let Some((target, body)) = requests.get(i) else { break };
                let base = match target {
                    Target::Router => &targets[i % targets.len()],
                    Target::Worker(w) => &workers[*w % workers.len()],
                };
                let began = Instant::now();
                let answer = match http::post_json(&format!("{base}/generate"), body) {
                    Ok(r) if r.status == 200 => r.json().map_err(|e| format!("{e:#}")),
                    Ok(r) => Err(format!("status {}: {}", r.status, r.text().chars().take(200).collect::<String>())),
                    Err(e) => Err(format!("{e:#}")),
                };
                let ms = began.elapsed().as_secs_f64() * 1e3;
                let Ok(mut t) = tally.lock() else { break };
                let meta = match &answer {
                    Ok(a) => &a["meta_info"],
                    Err(e) => {
                        t.errors += 1;
                        t.first_error.get_or_insert_with(|| e.clone());
                        continue;
                    }
                };
                let (prompt, cached) =
                    (meta["prompt_tokens"].as_f64().unwrap_or(0.0), meta["cached_tokens"].as_f64().unwrap_or(0.0));
                if *target == Target::Router {
                    t.ok += 1;
                    t.prompt += prompt;
                    t.cached += cached;
                    t.ms.push(ms);
                } else {
                    t.direct_prompt += prompt;
                    t.direct_cached += cached;
                }
            });
        }
    });
    tally.into_inner().unwrap_or_default()
}

/// kvmesh-cp's engine-feedback totals over every worker: (compared, accurate, predicted
/// tokens, cached tokens).
pub(super) fn feedback(running: &Running) -> Option<[f64; 4]> {
    let cp = running.control_plane()?;
    let workers = http::get(&format!("http://127.0.0.1:{}/workers", cp.http_port)).ok()?.json().ok()?;
    let mut sum = [0.0; 4];
    for w in workers.as_array()? {
        let p = &w["prediction"];
        for (s, k) in sum.iter_mut().zip(["predictions", "accurate", "predicted_tokens", "cached_tokens"]) {
            *s += p[k].as_f64().unwrap_or(0.0);
        }
    }
    Some(sum)
}

/// The feedback once the gateways' reports of the last responses arrived (the counts stop
/// moving), at most a few seconds on.
pub(super) fn settled_feedback(running: &Running) -> Option<[f64; 4]> {
    let mut last = feedback(running)?;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(500));
        let now = feedback(running)?;
        if now == last {
            return Some(now);
        }
        last = now;
    }
    Some(last)
}

/// The per-worker series `name` of kvmesh-cp for the worker at `url` (0 when absent).
fn cp_metric(running: &Running, name: &str, url: &str) -> Option<f64> {
    let cp = running.control_plane()?;
    let text = http::get(&format!("http://127.0.0.1:{}/metrics", cp.http_port)).ok()?.text();
    let prefix = format!("{name}{{worker=\"{url}\"");
    Some(text.lines().find(|l| l.starts_with(&prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0.0))
}

/// Polls `done` every 10 ms for at most 5 s: the milliseconds it took (None: not within).
fn time_until(mut done: impl FnMut() -> bool) -> Option<f64> {
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(5) {
        if done() {
            return Some(began.elapsed().as_secs_f64() * 1e3);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// kvmesh-cp's index entries for the worker at `url`.
fn cp_entries(running: &Running, url: &str) -> Option<f64> {
    let cp = running.control_plane()?;
    let workers = http::get(&format!("http://127.0.0.1:{}/workers", cp.http_port)).ok()?.json().ok()?;
    workers.as_array()?.iter().find(|w| w["url"] == url)?["index_entries"].as_f64()
}

/// Halfway: worker 0 restarts in place (no event says so: kvmesh-cp sees it at its next
/// batch, or when an idle reconnect finds its replay buffer empty), worker 1 is flushed
/// (`AllBlocksCleared`), then the rest of the stream. With events: the milliseconds from the
/// flush until kvmesh-cp held none of worker 1's entries (waited for before the stream goes
/// on), and from the restart until it counted worker 0's restart (the gateways have the
/// evictions within `--push-interval-ms` more).
fn restart_and_flush(
    sims: &[Sim],
    running: &Running,
    events: bool,
    rest: impl FnOnce() -> Tally,
) -> (Tally, Option<f64>, Option<f64>) {
    let (restarted, flushed) = (sims[0].url(), sims[1].url());
    let seen = || cp_metric(running, "kvmesh_kv_events_restarts_total", &restarted).is_some_and(|n| n >= 1.0);
    std::thread::scope(|s| {
        let _ = http::post(&format!("{restarted}/sim/restart"), b"{}", &[]);
        let watch = events.then(|| s.spawn(|| time_until(seen)));
        let before = cp_entries(running, &flushed);
        let _ = http::post(&format!("{flushed}/flush_cache"), b"{}", &[]);
        let flush_ms = if events && before.is_some_and(|b| b > 0.0) {
            time_until(|| cp_entries(running, &flushed) == Some(0.0))
        } else {
            None
        };
        if events {
            eprintln!(
                "      worker 1's entries in kvmesh-cp: {} before the flush, {} after",
                before.map_or("-".into(), |b| b.to_string()),
                cp_entries(running, &flushed).map_or("-".into(), |b| b.to_string())
            );
        }
        let tally = rest();
        let restart_ms = watch.and_then(|h| h.join().ok()).flatten();
        (tally, flush_ms, restart_ms)
    })
}

fn measure(w: &Workload, row: &Row, p: &Publishers, running: &Running) -> Value {
    let targets: Vec<String> = running.targets.iter().map(|a| format!("http://{a}")).collect();
    let workers: Vec<String> = p.sims.iter().map(Sim::url).collect();
    let before = feedback(running);
    let half = if w.midway == Midway::Nothing { w.requests.len() } else { w.requests.len() / 2 };
    let began = Instant::now();
    let mut t = send(&w.requests[..half], &targets, &workers);
    let (mut flush_ms, mut restart_ms) = (None, None);
    if half < w.requests.len() {
        let (rest, f, r) =
            restart_and_flush(&p.sims, running, row.events, || send(&w.requests[half..], &targets, &workers));
        (flush_ms, restart_ms) = (f, r);
        t.ok += rest.ok;
        t.errors += rest.errors;
        t.prompt += rest.prompt;
        t.cached += rest.cached;
        t.direct_prompt += rest.direct_prompt;
        t.direct_cached += rest.direct_cached;
        t.ms.extend(rest.ms);
        t.first_error = t.first_error.or(rest.first_error);
    }
    if let Some(e) = &t.first_error {
        eprintln!("      the first error of {}: {e}", t.errors);
    }
    let seconds = began.elapsed().as_secs_f64();
    let fb = match (before, settled_feedback(running)) {
        (Some(b), Some(a)) => Some([a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3]]),
        _ => None,
    };
    let hit = if t.prompt > 0.0 { t.cached / t.prompt } else { 0.0 };
    t.ms.sort_by(f64::total_cmp);
    let p50 = t.ms.get(t.ms.len() / 2).copied().unwrap_or(f64::NAN);
    // Signed: (predicted − cached) / cached over the compared responses.
    let error = fb.filter(|f| f[3] > 0.0).map(|f| (f[2] - f[3]) / f[3]);
    let accurate = fb.filter(|f| f[0] > 0.0).map(|f| f[1] / f[0]);
    eprintln!(
        "    {}: hit {:.1}%  prediction error {}  within a block {}  e2e p50 {p50:.0} ms  errors {}{}",
        row.label(),
        hit * 100.0,
        error.map_or("-".into(), |e| format!("{:+.2}%", e * 100.0)),
        accurate.map_or("-".into(), |a| format!("{:.1}%", a * 100.0)),
        t.errors,
        match (flush_ms, restart_ms) {
            (None, None) => String::new(),
            (f, r) => format!(
                "  flush dropped in {} ms, restart seen in {} ms",
                f.map_or("-".into(), |x| format!("{x:.0}")),
                r.map_or("-".into(), |x| format!("{x:.0}"))
            ),
        }
    );
    json!({
        "workload": w.name,
        "router": if row.events { "kvmesh-events" } else { row.config.router },
        "config": row.label(),
        "replicas": row.config.replicas,
        "mesh": row.config.mesh,
        "policy": row.config.policy,
        "requests_ok": t.ok,
        "errors": t.errors,
        "hit_rate": hit,
        "direct_hit_rate": (t.direct_prompt > 0.0).then(|| t.direct_cached / t.direct_prompt),
        "e2e_p50_ms": p50,
        "predictions_compared": fb.map(|f| f[0]),
        "predicted_tokens": fb.map(|f| f[2]),
        "reported_cached_tokens": fb.map(|f| f[3]),
        "prediction_error": error,
        "prediction_accuracy": accurate,
        "flush_dropped_ms": flush_ms,
        "restart_seen_ms": restart_ms,
        "seconds": seconds,
    })
}

/// Runs the workloads named in `--workload` (all of them in a full run); their rows go into
/// `results`. Returns the parameters for the report (None: none to run).
pub fn run(
    o: &Opts,
    bins: &PeerBins,
    results: &mut Vec<Value>,
    failures: &mut Vec<Value>,
) -> anyhow::Result<Option<Value>> {
    let n = if o.quick { 400 } else { 1200 };
    let named = |w: &Workload| if o.workloads.is_empty() { !o.quick } else { o.workloads.iter().any(|n| n == w.name) };
    let workloads: Vec<Workload> = all(SEED, n).into_iter().filter(named).collect();
    if workloads.is_empty() {
        return Ok(None);
    }
    let rows: Vec<Row> = rows(o, bins).into_iter().filter(|r| o.wants(&r.label())).collect();
    for w in &workloads {
        step(&format!("quality: {} ({} requests; {})", w.name, w.requests.len(), w.what));
        for row in &rows {
            let p = publishers(w.kv_capacity_tokens, 32)?;
            match start(bins, row, &p, o.threads) {
                Ok(running) => results.push(measure(w, row, &p, &running)),
                Err(e) => {
                    eprintln!("    {} did not start: {e:#}", row.label());
                    failures.push(json!({"workload": w.name, "config": row.label(), "error": format!("{e:#}")}));
                }
            }
        }
    }
    Ok(Some(json!({
        "seed": SEED,
        "requests_per_workload": n,
        "concurrency": CONCURRENCY,
        "workloads": workloads.iter().map(|w| json!({"name": w.name, "what": w.what, "kv_capacity_tokens": w.kv_capacity_tokens})).collect::<Vec<_>>(),
    })))
}

/// The rows of every engine-truth workload, one table each.
pub fn markdown(doc: &Value) -> String {
    let p = &doc["params"]["engine_truth"];
    let mut md = format!(
        "### The engines' own truth ({} requests per workload, seed {}, {} concurrent, 4 workers publishing KV events)\n\n\
         Hit rate: cached over prompt tokens of the routed requests, as the workers answered. Prediction error: \
         (tokens kvmesh predicted cached for the chosen worker − `cached_tokens` it answered) / `cached_tokens`, \
         summed over the compared responses; within a block: the share of responses predicted within one index block.\n\n",
        p["requests_per_workload"], p["seed"], p["concurrency"]
    );
    for w in p["workloads"].as_array().into_iter().flatten() {
        let name = w["name"].as_str().unwrap_or("");
        md.push_str(&format!("#### {name} — {}\n\n", w["what"].as_str().unwrap_or("")));
        let rows: Vec<Vec<String>> = doc["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["workload"] == name)
            .map(|r| {
                let ms = |k: &str| r[k].as_f64().map_or("-".into(), |x| f(x, 0));
                let mut row = prediction_cells(r);
                row.extend([ms("e2e_p50_ms"), ms("flush_dropped_ms"), ms("restart_seen_ms"), r["errors"].to_string()]);
                row
            })
            .collect();
        md.push_str(&table(
            &[
                "router",
                "hit %",
                "prediction error %",
                "within a block %",
                "e2e p50 ms",
                "flush → cp dropped, ms",
                "restart → cp saw it, ms",
                "errors",
            ],
            &rows,
        ));
        md.push('\n');
    }
    md
}

/// A result row's first report cells, as every engine-truth table starts: the router, its
/// hit %, kvmesh's prediction error % and share within a block % ("-" where absent).
pub(super) fn prediction_cells(r: &Value) -> Vec<String> {
    let pct = |k: &str| r[k].as_f64().map_or("-".into(), |x| f(x * 100.0, 1));
    vec![
        r["config"].as_str().unwrap_or("").to_string(),
        pct("hit_rate"),
        r["prediction_error"].as_f64().map_or("-".into(), |x| format!("{:+.2}", x * 100.0)),
        pct("prediction_accuracy"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workloads_send_a_fifth_around_the_router_and_restart_halfway() {
        let all = all(7, 100);
        let names: Vec<&str> = all.iter().map(|w| w.name).collect();
        assert_eq!(names, NAMES);
        for w in &all {
            assert_eq!(w.requests.len(), 100, "{}", w.name);
            assert!(w.requests.iter().all(|(_, b)| b["text"].as_str().is_some_and(|t| t.len() > 4000)), "{}", w.name);
        }
        let direct: Vec<usize> = all[0]
            .requests
            .iter()
            .filter_map(|(t, _)| if let Target::Worker(w) = t { Some(*w) } else { None })
            .collect();
        assert_eq!(direct.len(), 20, "a fifth straight to the workers");
        assert!(direct.iter().all(|&w| w < WORKERS));
        assert!(all[1..].iter().all(|w| w.requests.iter().all(|(t, _)| *t == Target::Router)));
        assert_eq!(
            all.iter().map(|w| w.midway).collect::<Vec<_>>(),
            [Midway::Nothing, Midway::RestartAndFlush, Midway::Nothing]
        );
        assert_eq!(all[2].requests[0].1["sampling_params"]["max_new_tokens"], 128, "decode growth");
    }

    #[test]
    fn every_router_runs_at_one_and_three_gateways_and_eight_in_a_full_run() {
        let bins = PeerBins { smg: Some("smg".into()), sglang_python: Some("python".into()) };
        let labels: Vec<String> = rows(&Opts::new(true), &bins).iter().map(Row::label).collect();
        assert_eq!(labels.len(), 8, "{labels:?}");
        for l in [
            "kvmesh +events ×1 gateway (cache_aware)",
            "kvmesh ×3 gateways (cache_aware)",
            "SMG 1.13.0 ×1 replica (cache_aware)",
            "SMG 1.13.0 ×3 replicas +mesh (cache_aware)",
            "sglang-router 0.3.2 ×3 replicas (cache_aware)",
        ] {
            assert!(labels.iter().any(|x| x == l), "{l}: {labels:?}");
        }
        assert_eq!(rows(&Opts::new(false), &bins).len(), 12, "8 gateways and replicas too in a full run");
        assert_eq!(rows(&Opts::new(true), &PeerBins::default()).len(), 4, "--no-peers: kvmesh only");
    }
}
