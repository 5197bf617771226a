//! The overhead suite: workers answer at once (`--time-scale 0`), so what is measured is the
//! proxy. Regular mode: direct to the workers, plain Envoy, kvmesh (Envoy with the filter),
//! SMG, sglang-router, and the mesh path (plain Envoy in front of each peer); Envoy with 1 and
//! 2 worker threads, the peers with their defaults. PD mode: kvmesh (the `.wasm` and the
//! native build), the peers and the mesh path over 2 prefill and 2 decode workers.

use kvmesh_testkit::{free_port, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::{self, Peer, PeerBins, Running, Workers};
use super::Opts;
use crate::loadgen::{self, Load, Stop};
use crate::tools::step;

/// 16 shared system prompts of ~1 KiB, each followed by a distinct question: the request
/// stream every router gets.
pub fn workload() -> Vec<Vec<u8>> {
    (0..4096)
        .map(|i| {
            let group = i % 16;
            let system = format!("System prompt {group}: you are assistant number {group}. ").repeat(20);
            let body = json!({"text": format!("{system}Question {i}: what is {i} squared?"), "sampling_params": {"max_new_tokens": 1}});
            loadgen::post("/generate", &body.to_string())
        })
        .collect()
}

/// One measured configuration.
struct Row {
    mode: &'static str,
    router: &'static str,
    config: String,
    threads: Option<u32>,
    load: Load,
    cpu_us: Option<f64>,
    /// The CPU per request of each round (`--rounds`), in the order they ran.
    cpu_rounds: Vec<f64>,
    /// Each round's seconds to steady throughput (see [`Load::steady_after`]).
    steady: Vec<f64>,
    /// The first round's `(second, req/s)` windows.
    first_rates: Vec<(f64, f64)>,
    /// kvmesh: each round's routing decision inside Envoy, µs `(p50, p99)` (the first
    /// gateway's `kvmesh_route_decision_ns`, every request of the round).
    decision: Vec<(f64, f64)>,
}

/// Rows of the same configuration from several rounds become one: requests, errors and
/// latencies added up (req/s over the time of all rounds), the median round's CPU per
/// request, the median time to steady throughput.
fn merge_rounds(rows: Vec<Row>) -> Vec<Row> {
    let mut out: Vec<Row> = Vec::new();
    for r in rows {
        match out.iter_mut().find(|o| o.mode == r.mode && o.config == r.config) {
            None => out.push(r),
            Some(o) => {
                o.load.sent += r.load.sent;
                o.load.ok += r.load.ok;
                o.load.errors += r.load.errors;
                o.load.elapsed += r.load.elapsed;
                let _ = o.load.latency.add(&r.load.latency);
                let _ = o.load.ttft.add(&r.load.ttft);
                o.steady.extend(r.steady);
                o.cpu_rounds.extend(r.cpu_rounds);
                o.decision.extend(r.decision);
            }
        }
    }
    for o in &mut out {
        o.cpu_us = median(&o.cpu_rounds);
    }
    out
}

fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

impl Row {
    fn json(&self, floor_p50: Option<f64>) -> Value {
        json!({
            "mode": self.mode,
            "router": self.router,
            "config": self.config,
            "envoy_threads": self.threads,
            "requests_ok": self.load.ok,
            "errors": self.load.errors,
            "seconds": self.load.elapsed.as_secs_f64(),
            "rps": self.load.rps(),
            "p50_ms": self.load.ms(0.5),
            "p99_ms": self.load.ms(0.99),
            "added_p50_ms": floor_p50.map(|f| self.load.ms(0.5) - f),
            "proxy_cpu_us_per_request": self.cpu_us,
            "proxy_cpu_us_per_request_rounds": self.cpu_rounds,
            "steady_after_s": median(&self.steady),
            "steady_after_s_rounds": self.steady,
            "decision_p50_us": median(&self.decision.iter().map(|d| d.0).collect::<Vec<_>>()),
            "decision_p99_us": median(&self.decision.iter().map(|d| d.1).collect::<Vec<_>>()),
            // The first round's throughput per second, from the first request (warm-up included).
            "first_round_rps_per_second": self.first_rates.iter().map(|&(t, r)| json!([t, r.round()])).collect::<Vec<_>>(),
        })
    }
}

fn measure(o: &Opts, name: &str, running: &Running, requests: &[Vec<u8>], proxy: bool) -> (Load, Option<f64>) {
    let before = running.cpu();
    let load = loadgen::run(name, &running.targets, requests, o.connections, Stop::For(o.duration()));
    let spent = running.cpu().saturating_sub(before);
    // Over every request sent, the warm-up included, as the CPU was counted.
    let cpu = proxy.then(|| spent.as_secs_f64() * 1e6 / load.sent.max(1) as f64);
    eprintln!(
        "    {name}: {:.0} req/s  p50 {:.3} ms  p99 {:.3} ms  errors {}{}  steady after {}",
        load.rps(),
        load.ms(0.5),
        load.ms(0.99),
        load.errors,
        cpu.map_or(String::new(), |c| format!("  proxy CPU {c:.1} us/req")),
        load.steady_after().map_or("-".into(), |s| format!("{s:.1} s"))
    );
    (load, cpu)
}

/// Profiling only: with `KVMESH_BENCH_ENVOY_STATS=DIR`, every Envoy's `/stats` after its run
/// goes to `DIR/<configuration>.<n>.txt` (connections opened, retries, upstream resets: what
/// Envoy did around the filter).
fn dump_envoy_stats(name: &str, running: &Running) {
    let Some(dir) = std::env::var_os("KVMESH_BENCH_ENVOY_STATS") else { return };
    let dir = std::path::PathBuf::from(dir);
    let _ = std::fs::create_dir_all(&dir);
    let file: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    for (i, admin) in running.admin.iter().enumerate() {
        let url = format!("{}/stats", admin.trim_end_matches('/'));
        match kvmesh_testkit::http::get(&url) {
            Ok(r) => {
                let _ = std::fs::write(dir.join(format!("{file}.{i}.txt")), r.text());
            }
            Err(e) => eprintln!("    cannot read {url}: {e:#}"),
        }
    }
}

/// Starts a configuration, measures it, stops it. A configuration that cannot start is
/// reported as such, never left out silently.
#[allow(clippy::too_many_arguments)]
fn config(
    o: &Opts,
    rows: &mut Vec<Row>,
    failures: &mut Vec<Value>,
    mode: &'static str,
    router: &'static str,
    name: &str,
    threads: Option<u32>,
    requests: &[Vec<u8>],
    start: impl FnOnce() -> anyhow::Result<Running>,
) {
    if !o.wants(name) {
        return;
    }
    step(&format!("overhead {mode}: {name}"));
    let started = start().and_then(|running| {
        if let Some(cpu) = o.pin.then(proxy_cpu) {
            running.pin(&cpu.to_string())?;
        }
        Ok(running)
    });
    match started {
        Ok(running) => {
            let (load, cpu_us) = measure(o, name, &running, requests, router != "direct");
            dump_envoy_stats(name, &running);
            let (cpu_rounds, steady) = (cpu_us.into_iter().collect(), load.steady_after().into_iter().collect());
            let decision: Vec<(f64, f64)> = match (router.starts_with("kvmesh"), running.admin.first()) {
                // Every gateway decides alike; the first one's requests: a share of them.
                (true, Some(admin)) => {
                    let share = load.sent / running.admin.len().max(1) as u64;
                    super::cp::decision_us(admin.trim_end_matches('/'), share * 9 / 10).into_iter().collect()
                }
                _ => Vec::new(),
            };
            if let Some((p50, p99)) = decision.first() {
                eprintln!("    {name}: routing decision inside Envoy p50 {p50:.1} us, p99 {p99:.1} us");
            }
            let first_rates = loadgen::window_rates(&load.timeline, 1.0);
            rows.push(Row {
                mode,
                router,
                config: name.to_string(),
                threads,
                load,
                cpu_us,
                cpu_rounds,
                steady,
                first_rates,
                decision,
            });
        }
        Err(e) => {
            eprintln!("    {name} did not start: {e:#}");
            failures.push(json!({"mode": mode, "router": router, "config": name, "error": format!("{e:#}")}));
        }
    }
}

/// kvmesh's configurations in one mode: 1 and 2 Envoy threads with static workers, the
/// baseline build (`--baseline-wasm`) at 1 and 2 threads, and 2 threads with kvmesh-cp as deployed (its CPU counts
/// too). `tags`: what the names carry after "kvmesh" and after the threads.
fn kvmesh_configs(
    o: &Opts,
    rows: &mut Vec<Row>,
    failures: &mut Vec<Value>,
    mode: &'static str,
    workers: &Workers,
    requests: &[Vec<u8>],
    (mode_tag, policy_tag): (&str, &str),
) {
    for t in [1u32, 2] {
        let name = format!("kvmesh{mode_tag} ({t} thread{}{policy_tag})", if t > 1 { "s" } else { "" });
        config(o, rows, failures, mode, "kvmesh", &name, Some(t), requests, || {
            stack::kvmesh(workers, t, 1, "cache_aware", false)
        });
    }
    if let Some(wasm) = &o.baseline_wasm {
        for t in [1u32, 2] {
            let name =
                format!("kvmesh{mode_tag} baseline .wasm ({t} thread{}{policy_tag})", if t > 1 { "s" } else { "" });
            config(o, rows, failures, mode, "kvmesh-baseline", &name, Some(t), requests, || {
                stack::kvmesh_with(workers, t, 1, "cache_aware", false, Some(wasm))
            });
        }
    }
    // Experiment builds (`--variant-wasm`), 1 thread: named by their file.
    for wasm in &o.variant_wasm {
        let stem = wasm.file_stem().map_or_else(|| wasm.display().to_string(), |s| s.to_string_lossy().into_owned());
        let name = format!("kvmesh{mode_tag} variant {stem} (1 thread{policy_tag})");
        config(o, rows, failures, mode, "kvmesh-baseline", &name, Some(1), requests, || {
            stack::kvmesh_with(workers, 1, 1, "cache_aware", false, Some(wasm))
        });
    }
    let name = format!("kvmesh{mode_tag} (2 threads{policy_tag}, with kvmesh-cp)");
    config(o, rows, failures, mode, "kvmesh", &name, Some(2), requests, || {
        stack::kvmesh(workers, 2, 1, "cache_aware", true)
    });
}

/// `--pin`: the core the proxies get to themselves (the last one).
fn proxy_cpu() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).saturating_sub(1)
}

pub fn run(o: &Opts, bins: &PeerBins) -> anyhow::Result<(Value, String)> {
    if o.pin {
        let cpu = proxy_cpu();
        anyhow::ensure!(cpu > 0, "--pin needs at least 2 CPUs");
        // This process (the load generator) and every worker it starts stay off the proxy's core.
        let others = (0..cpu).map(|c| c.to_string()).collect::<Vec<_>>().join(",");
        stack::pin(std::process::id(), &others)?;
        step(&format!("--pin: proxies on CPU {cpu}, the load generator and the workers on CPU {others}"));
    }
    let requests = workload();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let peers: Vec<Peer> = [Peer::Smg, Peer::SglangRouter]
        .into_iter()
        .filter(|p| match p {
            Peer::Smg => bins.smg.is_some(),
            Peer::SglangRouter => bins.sglang_python.is_some(),
        })
        .collect();
    let threads = [1u32, 2];

    {
        step("starting 4 simulated workers (--time-scale 0)");
        let sims: Vec<Sim> =
            (0..4).map(|_| Sim::start(&["--time-scale", "0", "--max-running", "4096"])).collect::<Result<_, _>>()?;
        let urls: Vec<String> = sims.iter().map(Sim::url).collect();
        let addrs: Vec<String> = sims.iter().map(Sim::addr).collect();
        let workers = Workers::Regular(urls.clone());
        let m = "regular";
        for round in 0..o.rounds {
            if o.rounds > 1 {
                step(&format!("regular mode, round {} of {}", round + 1, o.rounds));
            }
            config(o, &mut rows, &mut failures, m, "direct", "direct to workers", None, &requests, || {
                Ok(stack::direct(&urls))
            });
            for t in threads {
                let name = format!("plain Envoy ({t} thread{})", if t > 1 { "s" } else { "" });
                config(o, &mut rows, &mut failures, m, "plain-envoy", &name, Some(t), &requests, || {
                    stack::plain_envoy(&addrs, t)
                });
            }
            for t in threads {
                let name = format!("naive body filter ({t} thread{})", if t > 1 { "s" } else { "" });
                config(o, &mut rows, &mut failures, m, "naive-filter", &name, Some(t), &requests, || {
                    stack::naive_filter(&urls, t)
                });
            }
            for t in threads {
                let name = format!("naive filter, native ({t} thread{})", if t > 1 { "s" } else { "" });
                config(o, &mut rows, &mut failures, m, "naive-module", &name, Some(t), &requests, || {
                    stack::naive_module(&urls, t)
                });
            }
            kvmesh_configs(o, &mut rows, &mut failures, m, &workers, &requests, ("", ", cache_aware"));
            for t in threads {
                let name = format!("kvmesh, native build ({t} thread{}, cache_aware)", if t > 1 { "s" } else { "" });
                config(o, &mut rows, &mut failures, m, "kvmesh-native", &name, Some(t), &requests, || {
                    stack::kvmesh_native(&urls, t)
                });
            }
            for &p in &peers {
                let name = format!("{} (cache_aware)", p.label());
                config(o, &mut rows, &mut failures, m, p.name(), &name, None, &requests, || {
                    stack::peer(bins, p, &workers, 1, false, "cache_aware")
                });
                for t in threads {
                    let name = format!("plain Envoy ({t}t) -> {}", p.label());
                    let router: &'static str = match p {
                        Peer::Smg => "envoy+smg",
                        Peer::SglangRouter => "envoy+sglang-router",
                    };
                    config(o, &mut rows, &mut failures, m, router, &name, Some(t), &requests, || {
                        stack::mesh_path(stack::peer(bins, p, &workers, 1, false, "cache_aware")?, t)
                    });
                }
            }
        }
    }

    if o.pd {
        step("starting 2 prefill and 2 decode simulated workers (--time-scale 0)");
        let mut prefill = Vec::new();
        for _ in 0..2 {
            let boot = free_port()?;
            let args = ["--role", "prefill", "--bootstrap-port", &boot.to_string(), "--time-scale", "0"];
            prefill.push((Sim::start(&[&args[..], &["--max-running", "4096"]].concat())?, boot));
        }
        let decode: Vec<Sim> = (0..2)
            .map(|_| Sim::start(&["--role", "decode", "--time-scale", "0", "--max-running", "4096"]))
            .collect::<Result<_, _>>()?;
        let prefill_urls: Vec<(String, u16)> = prefill.iter().map(|(s, b)| (s.url(), *b)).collect();
        let decode_urls: Vec<String> = decode.iter().map(Sim::url).collect();
        let workers = Workers::Pd { prefill: prefill_urls.clone(), decode: decode_urls.clone() };
        let m = "pd";
        for round in 0..o.rounds {
            if o.rounds > 1 {
                step(&format!("PD mode, round {} of {}", round + 1, o.rounds));
            }
            kvmesh_configs(o, &mut rows, &mut failures, m, &workers, &requests, (" PD", ""));
            for t in threads {
                let name = format!("kvmesh PD, native build ({t} thread{})", if t > 1 { "s" } else { "" });
                config(o, &mut rows, &mut failures, m, "kvmesh-native", &name, Some(t), &requests, || {
                    stack::kvmesh_native_pd(&prefill_urls, &decode_urls, t)
                });
            }
            for &p in &peers {
                let name = format!("{} PD", p.label());
                config(o, &mut rows, &mut failures, m, p.name(), &name, None, &requests, || {
                    stack::peer(bins, p, &workers, 1, false, "cache_aware")
                });
                let name = format!("plain Envoy (1t) -> {} PD", p.label());
                let router: &'static str = match p {
                    Peer::Smg => "envoy+smg",
                    Peer::SglangRouter => "envoy+sglang-router",
                };
                config(o, &mut rows, &mut failures, m, router, &name, Some(1), &requests, || {
                    stack::mesh_path(stack::peer(bins, p, &workers, 1, false, "cache_aware")?, 1)
                });
            }
        }
    }
    let rows = merge_rounds(rows);

    // The floor of added latency: straight to the workers (regular mode only).
    let floor = rows.iter().find(|r| r.router == "direct").map(|r| r.load.ms(0.5));
    let results: Vec<Value> = rows.iter().map(|r| r.json(if r.mode == "regular" { floor } else { None })).collect();
    let ratios = ratios(&rows, floor);
    let doc = json!({
        "suite": "overhead",
        "params": {"seconds": o.seconds, "rounds": o.rounds, "connections": o.connections, "pinned": o.pin, "workers": 4, "pd_workers": "2 prefill + 2 decode",
                   "sim": "--time-scale 0 --max-running 4096", "requests": "16 shared ~1 KiB system prompts, 4096 distinct questions, /generate, max_new_tokens 1"},
        "results": results,
        "ratios": ratios,
        "failed_to_start": failures,
    });
    let md = markdown(&rows, floor, &doc, o);
    Ok((doc, md))
}

/// kvmesh against every peer and the mesh path, same mode and same Envoy threads where
/// threads apply: throughput, added p50 latency, proxy CPU per request.
fn ratios(rows: &[Row], floor: Option<f64>) -> Vec<Value> {
    let mut out = Vec::new();
    // kvmesh's `.wasm` against everything; its native build against the peers only.
    let versus = |k: &Row, p: &Row| match k.router {
        "kvmesh" => p.router != "kvmesh" && p.router != "direct",
        _ => matches!(p.router, "smg" | "sglang-router"),
    };
    for k in rows.iter().filter(|r| matches!(r.router, "kvmesh" | "kvmesh-native")) {
        for p in rows.iter().filter(|r| r.mode == k.mode && versus(k, r)) {
            // Envoy-based floors compare at equal worker threads.
            if matches!(p.router, "plain-envoy" | "naive-filter" | "naive-module" | "kvmesh-native" | "kvmesh-baseline")
                && p.threads != k.threads
            {
                continue;
            }
            let added = |r: &Row| floor.filter(|_| r.mode == "regular").map(|f| (r.load.ms(0.5) - f).max(1e-3));
            out.push(json!({
                "mode": k.mode,
                "kvmesh": k.config,
                "versus": p.config,
                "versus_router": p.router,
                "rps_ratio": k.load.rps() / p.load.rps().max(1e-9),
                "p50_ratio": k.load.ms(0.5) / p.load.ms(0.5).max(1e-9),
                "added_p50_ratio": added(k).zip(added(p)).map(|(a, b)| a / b),
                "cpu_per_request_ratio": k.cpu_us.zip(p.cpu_us).map(|(a, b)| a / b.max(1e-9)),
                "cpu_added_us": k.cpu_us.zip(p.cpu_us).map(|(a, b)| a - b),
            }));
        }
    }
    out
}

fn markdown(rows: &[Row], floor: Option<f64>, doc: &Value, o: &Opts) -> String {
    let mut md = format!(
        "## Overhead ({} s per configuration after a {:.1} s warm-up{}, {} connections, workers at --time-scale 0{})\n\n",
        o.seconds,
        o.seconds / 10.0,
        if o.rounds > 1 { format!(", {} interleaved rounds (CPU: the median round)", o.rounds) } else { String::new() },
        o.connections,
        if o.pin { "; proxies pinned to a core of their own (`--pin`)" } else { "" }
    );
    for mode in ["regular", "pd"] {
        let these: Vec<&Row> = rows.iter().filter(|r| r.mode == mode).collect();
        if these.is_empty() {
            continue;
        }
        md.push_str(&format!(
            "### {}\n\n",
            if mode == "regular" { "Regular (4 workers)" } else { "PD (2 prefill + 2 decode workers)" }
        ));
        let body: Vec<Vec<String>> = these
            .iter()
            .map(|r| {
                vec![
                    r.config.clone(),
                    f(r.load.rps(), 0),
                    f(r.load.ms(0.5), 3),
                    f(r.load.ms(0.99), 3),
                    floor.filter(|_| mode == "regular").map_or("-".into(), |fl| f(r.load.ms(0.5) - fl, 3)),
                    r.cpu_us.map_or("-".into(), |c| f(c, 1)),
                    median(&r.steady).map_or("-".into(), |s| f(s, 1)),
                    r.load.errors.to_string(),
                ]
            })
            .collect();
        md.push_str(&table(
            &["setup", "req/s", "p50 ms", "p99 ms", "added p50 ms", "proxy CPU µs/req", "steady after s", "errors"],
            &body,
        ));
        md.push('\n');
        let decided: Vec<Vec<String>> = these
            .iter()
            .filter(|r| !r.decision.is_empty())
            .map(|r| {
                let p =
                    |i: usize| median(&r.decision.iter().map(|d| if i == 0 { d.0 } else { d.1 }).collect::<Vec<_>>());
                vec![r.config.clone(), p(0).map_or("-".into(), |v| f(v, 1)), p(1).map_or("-".into(), |v| f(v, 1))]
            })
            .collect();
        if !decided.is_empty() {
            md.push_str("Routing decision inside Envoy (the filter's `kvmesh_route_decision_ns`: parse, catching up with the table and the other VMs' inserts, the policy; µs, median round):\n\n");
            md.push_str(&table(&["setup", "decision p50 µs", "decision p99 µs"], &decided));
            md.push('\n');
        }
    }
    md.push_str("### kvmesh / other, same run\n\n");
    let body: Vec<Vec<String>> = doc["ratios"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let v = |k: &str| r[k].as_f64().map_or("-".into(), |x| f(x, 2));
            vec![
                r["kvmesh"].as_str().unwrap_or("").to_string(),
                r["versus"].as_str().unwrap_or("").to_string(),
                v("rps_ratio"),
                v("added_p50_ratio"),
                v("cpu_per_request_ratio"),
                r["cpu_added_us"].as_f64().map_or("-".into(), |x| f(x, 1)),
            ]
        })
        .collect();
    md.push_str(&table(
        &["kvmesh", "versus", "req/s ratio", "added p50 ratio", "CPU/req ratio", "CPU added µs/req"],
        &body,
    ));
    if let Some(f) = doc["failed_to_start"].as_array().filter(|a| !a.is_empty()) {
        md.push_str("\nConfigurations that did not start:\n\n");
        for x in f {
            md.push_str(&format!("- {}: {}\n", x["config"].as_str().unwrap_or(""), x["error"].as_str().unwrap_or("")));
        }
    }
    md
}
