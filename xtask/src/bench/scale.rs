//! The scale suite: criterion micro-benchmarks (routing decision with 8/64/256 workers over
//! 10^4/10^6 indexed blocks, index insert and eviction, snapshot encode and apply), kvmesh-cp's
//! memory and full-snapshot size at 10^6 index entries, and how long a prefix routed through
//! one gateway takes to reach another (through kvmesh-cp), p50/p99.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvmesh_testkit::{http, repo_root, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::{self, Workers};
use super::workload::Rng;
use super::Opts;
use crate::tools::{run as run_cmd, step};

/// Runs one criterion bench target; returns `(id, median ns)` of each benchmark.
fn criterion(o: &Opts, package: &str, bench: &str) -> anyhow::Result<Vec<(String, f64)>> {
    step(&format!("criterion: {package} --bench {bench}"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["bench", "-p", package, "--bench", bench, "--", "--noplot"]);
    if o.quick {
        cmd.args(["--warm-up-time", "0.3", "--measurement-time", "1", "--sample-size", "10"]);
    }
    run_cmd(&mut cmd)?;
    let root = repo_root().join("target/criterion");
    let mut out = Vec::new();
    collect(&root, &root, &mut out);
    Ok(out)
}

/// Every `new/estimates.json` under `dir`: the benchmark's id and its median.
fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, f64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && p.file_name().is_some_and(|n| n != "report" && n != "base") {
            let est = p.join("new/estimates.json");
            if let Ok(text) = std::fs::read_to_string(&est) {
                let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                if let Some(ns) = v["median"]["point_estimate"].as_f64() {
                    let id = p.strip_prefix(root).map(|r| r.display().to_string()).unwrap_or_default();
                    out.retain(|(i, _)| *i != id);
                    out.push((id, ns));
                }
            } else {
                collect(root, &p, out);
            }
        }
    }
}

fn index_blocks(admin: &str) -> Option<u64> {
    let text = http::get(&format!("{admin}/stats?filter=kvmesh_index_blocks")).ok()?.text();
    text.lines()
        .find_map(|l| l.split_once(": ").filter(|(n, _)| n.ends_with("kvmesh_index_blocks"))?.1.trim().parse().ok())
}

/// A fresh prefix sent through gateway A; the time until gateway B's index shows it.
fn propagation(samples: usize) -> anyhow::Result<Value> {
    step(&format!("prefix propagation between 2 gateways sharing kvmesh-cp ({samples} prefixes)"));
    let sims: Vec<Sim> = (0..4).map(|_| Sim::start(&["--time-scale", "0"])).collect::<Result<_, _>>()?;
    let workers = Workers::Regular(sims.iter().map(Sim::url).collect());
    let running = stack::kvmesh(&workers, 1, 2, "cache_aware", true)?;
    let (a, b) = (running.targets[0], &running.admin[1]);
    let mut rng = Rng::new(42);
    let mut times = Vec::new();
    let mut lost = 0;
    for i in 0..samples {
        let before = index_blocks(b).unwrap_or(0);
        let text = format!("propagation {i} {}", (0..64).map(|_| format!("{:x}", rng.next())).collect::<String>());
        let started = Instant::now();
        let r = http::post_json(
            &format!("http://{a}/generate"),
            &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}),
        )?;
        anyhow::ensure!(r.status == 200, "gateway A answered {}", r.status);
        let mut seen = None;
        while started.elapsed() < Duration::from_secs(2) {
            if index_blocks(b).unwrap_or(0) > before {
                seen = Some(started.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        match seen {
            Some(t) => times.push(t.as_secs_f64() * 1e3),
            None => lost += 1,
        }
    }
    times.sort_by(f64::total_cmp);
    let q = |p: f64| times.get(((times.len().max(1) - 1) as f64 * p).round() as usize).copied();
    Ok(
        json!({"samples": samples, "not_seen_within_2s": lost, "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": times.last()}),
    )
}

pub fn run(o: &Opts) -> anyhow::Result<(Value, String)> {
    let mut micro = Vec::new();
    if o.wants("micro") {
        micro = criterion(o, "kvmesh-core", "routing")?;
        micro.extend(criterion(o, "kvmesh-proto", "snapshot")?);
        micro.retain(|(id, _)| {
            ["decision/", "decision_policies/", "index/", "snapshot/"].iter().any(|p| id.starts_with(p))
        });
        micro.sort_by(|a, b| a.0.cmp(&b.0));
        micro.dedup_by(|a, b| a.0 == b.0);
    }
    let cp = if o.wants("control-plane") { super::cp::run(o)? } else { Value::Null };
    let prop = if o.wants("propagation") { propagation(if o.quick { 30 } else { 300 })? } else { Value::Null };
    let doc = json!({
        "suite": "scale",
        "micro_ns_median": micro.iter().map(|(id, ns)| json!({"benchmark": id, "median_ns": ns})).collect::<Vec<_>>(),
        "control_plane": cp,
        "propagation": prop,
        "targets": {"decision_p99_us_64_workers_1e6_blocks": 50, "cp_rss_mib_1e6_entries": 200, "propagation_p99_ms": 100, "filter_mib_per_vm_1e6_blocks": 64},
    });
    let mut md = String::from("## Scale\n\n");
    if !micro.is_empty() {
        md.push_str("### Micro-benchmarks (criterion, median)\n\n");
        let rows: Vec<Vec<String>> = micro
            .iter()
            .map(|(id, ns)| {
                vec![
                    id.clone(),
                    if *ns < 1e6 { format!("{} µs", f(ns / 1e3, 2)) } else { format!("{} ms", f(ns / 1e6, 1)) },
                ]
            })
            .collect();
        md.push_str(&table(&["benchmark", "median"], &rows));
        md.push_str("\n`decision/<blocks>_blocks/<workers>`: one cache-aware decision (a 4 KiB routing text, half of it indexed for one worker); `decision_policies/<policy>`: the same with 64 workers over 10^6 blocks for kvmesh's other policies.\n\n");
    }
    if doc["control_plane"].is_object() {
        md.push_str("### kvmesh-cp at 10^6 index entries (64 workers)\n\n");
        let c = &doc["control_plane"];
        md.push_str(&table(
            &["measure", "value"],
            &[
                vec!["index entries".into(), c["index_entries"].to_string()],
                vec!["RSS before".into(), format!("{} MiB", f(c["rss_before_mib"].as_f64().unwrap_or(0.0), 1))],
                vec![
                    "RSS after (target < 200 MiB)".into(),
                    format!("{} MiB", f(c["rss_after_mib"].as_f64().unwrap_or(0.0), 1)),
                ],
                vec![
                    "full snapshot on connect".into(),
                    format!("{} MiB", f(c["snapshot_mib"].as_f64().unwrap_or(0.0), 1)),
                ],
                vec![
                    "snapshot built and received".into(),
                    format!("{} ms", f(c["snapshot_ms"].as_f64().unwrap_or(0.0), 0)),
                ],
            ],
        ));
        let g = &c["gateway"];
        let mib_of = |v: &Value, k: &str| v[k].as_f64().map_or("-".into(), |x| format!("{} MiB", f(x, 1)));
        let mib = |k: &str| mib_of(g, k);
        let us = |k: &str| g[k].as_f64().map_or("-".into(), |x| format!("{} µs", f(x, 1)));
        md.push_str(&format!(
            "\n### A gateway on that control plane (Envoy, {} worker thread)\n\n",
            g["envoy_threads"].as_u64().unwrap_or(1)
        ));
        md.push_str(&table(
            &["measure", "value"],
            &[
                vec!["blocks in the filter's index".into(), g["index_blocks"].to_string()],
                vec!["Envoy RSS, the same gateway on an empty control plane".into(), mib("rss_empty_index_mib")],
                vec!["Envoy RSS with the full index".into(), mib("rss_full_index_mib")],
                vec!["largest Wasm VM, empty index".into(), mib("largest_vm_empty_index_mib")],
                vec!["largest Wasm VM, full index (target < 64 MB)".into(), mib("largest_vm_full_index_mib")],
                vec!["routing decision inside Envoy, p50".into(), us("decision_p50_us")],
                vec!["routing decision inside Envoy, p99 (target ≤ 50 µs)".into(), us("decision_p99_us")],
                vec!["routing decision inside Envoy, p99.9".into(), us("decision_p999_us")],
                vec!["routing decision inside Envoy, max (goal < 1 ms)".into(), us("decision_max_us")],
            ],
        ));
        let b = &c["baseline_gateway"];
        if b.is_object() {
            let us = |v: &Value, k: &str| v[k].as_f64().map_or("-".into(), |x| format!("{} µs", f(x, 1)));
            let rows: Vec<Vec<String>> = [("this build", g), ("baseline .wasm", b)]
                .iter()
                .map(|(name, v)| {
                    vec![
                        name.to_string(),
                        us(v, "decision_p50_us"),
                        us(v, "decision_p99_us"),
                        mib_of(v, "largest_vm_full_index_mib"),
                    ]
                })
                .collect();
            md.push_str(&format!(
                "\nThe same against `{}`, medians of {} interleaved rounds:\n\n",
                c["baseline_wasm"].as_str().unwrap_or("-"),
                o.rounds
            ));
            md.push_str(&table(&["build", "decision p50", "decision p99", "largest VM, full index"], &rows));
        }
        md.push_str(&format!(
            "\n{} requests of 4 KiB whose first half is indexed, each decided among the 64 workers; the filter's `kvmesh_route_decision_ns` histogram (parse, index look-up, policy; Envoy's computed quantiles). The workers are absent (their 502s come after the decision). A VM's memory is its Wasm linear memory (the filter's `kvmesh_vm_memory_bytes`, which each VM records once a second; Envoy runs one VM on its main thread and one per worker thread); the RSS growth also holds Envoy's shared data (the delta log's slots through which the snapshot reached the other VM) and V8's own structures.\n",
            g["requests"]
        ));
    }
    if doc["propagation"].is_object() {
        let p = &doc["propagation"];
        md.push_str(&format!(
            "\n### Prefix propagation, gateway A → kvmesh-cp → gateway B\n\n{} prefixes: p50 {} ms, p99 {} ms (target p99 ≤ 100 ms), {} not seen within 2 s. Measured from the client's request to A until B's `kvmesh_index_blocks` grows (B records it when it applies the control plane's delta).\n",
            p["samples"],
            p["p50_ms"].as_f64().map_or("-".into(), |x| f(x, 1)),
            p["p99_ms"].as_f64().map_or("-".into(), |x| f(x, 1)),
            p["not_seen_within_2s"]
        ));
    }
    Ok((doc, md))
}
