//! Issue 46's workload (d): the Mooncake-format trace (`trace.rs`'s replay: the same prompts,
//! schedule and follow-up order) against workers that publish their KV-cache events, as in
//! `engine_truth.rs`: kvmesh with events, kvmesh without, SMG and sglang-router, at 1 and 3
//! gateways or replicas (8 too in a full run). Fresh publishing workers for every router; the
//! hit rate is what they counted (their event block cache answers `cached_tokens`), the
//! prediction error kvmesh-cp's engine feedback over the run.

use std::path::Path;

use kvmesh_testkit::Sim;
use serde_json::{json, Value};

use super::engine_truth::{self, Publishers, Row};
use super::report::{f, table};
use super::routers::{delta, stats};
use super::stack::{PeerBins, Running};
use super::trace::{self, Replay, Settings};
use super::Opts;
use crate::loadgen;
use crate::tools::step;

/// The workload's name (`--workload`).
pub const NAME: &str = "trace_events";
/// Requests in flight at most, as in the trace workload without events.
const CONCURRENCY: usize = 128;
/// Requests each worker runs at once, as in the trace workload without events.
const MAX_RUNNING: u32 = 64;

fn measure(r: &Replay, row: &Row, p: &Publishers, running: &Running) -> Value {
    let sims: &[Sim] = &p.sims;
    let before = stats(sims);
    let fb_before = engine_truth::feedback(running);
    let run = loadgen::replay(&row.label(), &running.targets, &r.requests, CONCURRENCY);
    let after = stats(sims);
    let fb = match (fb_before, engine_truth::settled_feedback(running)) {
        (Some(b), Some(a)) => Some([a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3]]),
        _ => None,
    };
    let prompt: f64 = delta(&after, &before, "prompt_tokens").iter().sum();
    let cached: f64 = delta(&after, &before, "cached_tokens").iter().sum();
    let per_worker = delta(&after, &before, "requests");
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let imbalance = if mean > 0.0 { per_worker.iter().cloned().fold(0.0, f64::max) / mean } else { 0.0 };
    let hit = if prompt > 0.0 { cached / prompt } else { 0.0 };
    // Signed: (predicted − cached) / cached over the compared responses.
    let error = fb.filter(|f| f[3] > 0.0).map(|f| (f[2] - f[3]) / f[3]);
    let accurate = fb.filter(|f| f[0] > 0.0).map(|f| f[1] / f[0]);
    let load = &run.load;
    eprintln!(
        "    {}: hit {:.1}%  prediction error {}  within a block {}  TTFT p50 {:.1} ms  imbalance {imbalance:.2}  late p99 {:.1} ms  {:.1} s  errors {}",
        row.label(),
        hit * 100.0,
        error.map_or("-".into(), |e| format!("{:+.2}%", e * 100.0)),
        accurate.map_or("-".into(), |a| format!("{:.1}%", a * 100.0)),
        load.ttft_ms(0.5),
        run.late_ms(0.99),
        load.elapsed.as_secs_f64(),
        load.errors
    );
    json!({
        "workload": NAME,
        "router": if row.events { "kvmesh-events" } else { row.config.router },
        "config": row.label(),
        "replicas": row.config.replicas,
        "mesh": row.config.mesh,
        "policy": row.config.policy,
        "requests_ok": load.ok,
        "errors": load.errors,
        "hit_rate": hit,
        "ttft_p50_ms": load.ttft_ms(0.5),
        "ttft_p99_ms": load.ttft_ms(0.99),
        "e2e_p50_ms": load.ms(0.5),
        "imbalance": imbalance,
        "requests_per_worker": per_worker,
        "lateness_p99_ms": run.late_ms(0.99),
        "predictions_compared": fb.map(|f| f[0]),
        "predicted_tokens": fb.map(|f| f[2]),
        "reported_cached_tokens": fb.map(|f| f[3]),
        "prediction_error": error,
        "prediction_accuracy": accurate,
        "seconds": load.elapsed.as_secs_f64(),
    })
}

/// Replays the trace (`--trace`, `--trace-requests`, `--speed-up`, `--kv-capacity` as for
/// `trace`) against every row when `--workload trace_events` is named; rows into `results`.
pub fn run(
    o: &Opts,
    bins: &PeerBins,
    results: &mut Vec<Value>,
    failures: &mut Vec<Value>,
) -> anyhow::Result<Option<Value>> {
    if !o.workloads.iter().any(|n| n == NAME) {
        return Ok(None);
    }
    let s = Settings::of(o);
    let entries = trace::load(&s.path, s.requests)?;
    let r = trace::replay(&entries, s.speed_up, s.kv_capacity)?;
    step(&format!(
        "quality: {NAME} ({} requests of {}, {:.0} s of trace in {:.0} s, 4 workers publishing KV events)",
        entries.len(),
        s.path.display(),
        r.summary["trace_span_s"].as_f64().unwrap_or(0.0),
        r.summary["replay_span_s"].as_f64().unwrap_or(0.0),
    ));
    for row in engine_truth::rows(o, bins).into_iter().filter(|r| o.wants(&r.label())) {
        let p = engine_truth::publishers(s.kv_capacity, MAX_RUNNING)?;
        match engine_truth::start(bins, &row, &p, o.threads) {
            Ok(running) => results.push(measure(&r, &row, &p, &running)),
            Err(e) => {
                eprintln!("    {} did not start: {e:#}", row.label());
                failures.push(json!({"workload": NAME, "config": row.label(), "error": format!("{e:#}")}));
            }
        }
    }
    let mut params = r.summary;
    params["file"] = json!(s.path.display().to_string());
    params["speed_up"] = json!(s.speed_up);
    params["kv_capacity_tokens"] = json!(s.kv_capacity);
    params["max_running"] = json!(MAX_RUNNING);
    params["concurrency"] = json!(CONCURRENCY);
    Ok(Some(params))
}

/// The section of the quality report: one row per router.
pub fn markdown(doc: &Value) -> String {
    let t = &doc["params"]["trace_events"];
    let file = t["file"].as_str().unwrap_or("");
    let mut md = format!(
        "### {NAME} — {} requests of `{}` ({:.0} s of trace replayed {}× faster), 4 workers of {}k KV tokens publishing KV events, at most {} requests in flight\n\n",
        t["requests"],
        Path::new(file).file_name().map_or(file.into(), |n| n.to_string_lossy()),
        t["trace_span_s"].as_f64().unwrap_or(f64::NAN),
        t["speed_up"],
        t["kv_capacity_tokens"].as_u64().unwrap_or(0) / 1024,
        t["concurrency"],
    );
    let rows: Vec<Vec<String>> = doc["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["workload"] == NAME)
        .map(|r| {
            let v = |k: &str, d: usize| r[k].as_f64().map_or("-".into(), |x| f(x, d));
            let mut row = engine_truth::prediction_cells(r);
            row.extend([v("ttft_p50_ms", 1), v("imbalance", 2), v("lateness_p99_ms", 0), r["errors"].to_string()]);
            row
        })
        .collect();
    md.push_str(&table(
        &[
            "router",
            "hit %",
            "prediction error %",
            "within a block %",
            "TTFT p50 ms",
            "imbalance",
            "late p99 ms",
            "errors",
        ],
        &rows,
    ));
    let pct = |k: &str| t["references"][k].as_f64().map_or("-".into(), |x| f(x * 100.0, 1));
    md.push_str(&format!(
        "\nReferences (block granularity, requests in trace order): infinite cache {} %, pooled LRU {} %, one worker {} %.\n\n",
        pct("ideal"),
        pct("pooled_lru"),
        pct("one_worker")
    ));
    md
}
