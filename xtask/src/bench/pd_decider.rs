//! The quality suite's `pd_decider` workload: llm-d's PD protocol on the multi-turn chats, the
//! prefix decider (`--pd-decider prefix --non-cached-tokens N`) against always-disaggregate.
//! Two vLLM prefill pods and two vLLM decode pods running as llm-d's routing sidecar
//! (`kvmesh-sim --engine vllm --llm-d-sidecar`, the real-time latency model), one kvmesh
//! gateway, the cache-aware policy for both legs; fresh pods for every configuration. The
//! prefill legs are what the decode pods' sidecars ran (`sidecar_prefills`), the requests
//! they computed alone `local_prefills` (with their cache hit rate); TTFT is the first
//! streamed event.

use std::time::Duration;

use kvmesh_testkit::{http, repo_root, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::routers::{delta, stats};
use super::stack::addr;
use super::workload;
use crate::loadgen::{self, Stop};
use crate::tools::step;

/// The workload's name for `--workload`.
pub const NAME: &str = "pd_decider";
const SEED: u64 = 20_251_127;
const CONCURRENCY: usize = 16;
const PODS: usize = 2;

/// The deciders compared: (label, `pd_decider`, `non_cached_tokens`).
const DECIDERS: [(&str, &str, u64); 3] =
    [("always", "always", 0), ("prefix, 128 tokens", "prefix", 128), ("prefix, 512 tokens", "prefix", 512)];

/// Starts `n` vLLM pods of `role` (decode pods with llm-d's sidecar).
fn pods(role: &str, n: usize) -> anyhow::Result<Vec<Sim>> {
    let mut args = vec!["--engine", "vllm", "--role", role, "--kv-capacity-tokens", "262144", "--max-running", "32"];
    if role == "decode" {
        args.push("--llm-d-sidecar");
    }
    (0..n).map(|_| Sim::start(&args)).collect()
}

fn gateway(prefill: &[Sim], decode: &[Sim], decider: &str, non_cached: u64) -> anyhow::Result<Envoy> {
    let filter = json!({
        "pd_disaggregation": true,
        "pd_protocol": "llm-d",
        "pd_decider": decider,
        "non_cached_tokens": non_cached,
        "prefill_policy": "cache_aware",
        "decode_policy": "cache_aware",
        "prefill": prefill.iter().map(|s| json!([s.url(), "none"])).collect::<Vec<_>>(),
        "decode": decode.iter().map(Sim::url).collect::<Vec<_>>(),
    });
    let mut opts = EnvoyOptions::new(filter)?;
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    opts.concurrency = 1;
    let mut envoy = Envoy::start(&opts)?;
    // vLLM pods serve no /generate: the gateway is up once a completion goes through.
    let probe = envoy.url("/v1/completions");
    let body = json!({"model": "kvmesh-sim", "prompt": "warm up", "max_tokens": 1});
    wait_until("the PD gateway to serve", Duration::from_secs(90), || {
        envoy.proc().exited().is_none() && http::post_json(&probe, &body).is_ok_and(|r| r.status == 200)
    })?;
    Ok(envoy)
}

/// Runs the workload once per decider: one row each.
pub fn run(quick: bool) -> anyhow::Result<Value> {
    let n = if quick { 64 } else { 320 };
    let w = workload::multi_turn(SEED, n);
    step(&format!(
        "quality: {NAME} ({} requests of {}; llm-d, {PODS} prefill + {PODS} decode pods)",
        w.requests.len(),
        w.name
    ));
    let mut rows = Vec::new();
    for (label, decider, non_cached) in DECIDERS {
        let (prefill, decode) = (pods("prefill", PODS)?, pods("decode", PODS)?);
        let envoy = gateway(&prefill, &decode, decider, non_cached)?;
        let before = stats(&decode);
        let load = loadgen::run(label, &[addr(envoy.port)], &w.requests, CONCURRENCY, Stop::Once);
        let after = stats(&decode);
        let sum = |key: &str| delta(&after, &before, key).iter().sum::<f64>();
        let (legs, alone) = (sum("sidecar_prefills"), sum("local_prefills"));
        let (prompt, cached) = (sum("prompt_tokens"), sum("cached_tokens"));
        eprintln!(
            "    {label}: {legs} prefill legs, {alone} alone, TTFT p50 {:.1} ms p90 {:.1} ms, errors {}",
            load.ttft_ms(0.5),
            load.ttft_ms(0.9),
            load.errors
        );
        rows.push(json!({
            "decider": label,
            "pd_decider": decider,
            "non_cached_tokens": non_cached,
            "requests_ok": load.ok,
            "errors": load.errors,
            "prefill_legs": legs,
            "decode_alone": alone,
            "decode_hit_rate": if prompt > 0.0 { cached / prompt } else { 0.0 },
            "ttft_p50_ms": load.ttft_ms(0.5),
            "ttft_p90_ms": load.ttft_ms(0.9),
            "ttft_p99_ms": load.ttft_ms(0.99),
            "e2e_p50_ms": load.ms(0.5),
            "seconds": load.elapsed.as_secs_f64(),
        }));
    }
    Ok(json!({"requests": w.requests.len(), "seed": SEED, "concurrency": CONCURRENCY, "pods": PODS, "rows": rows}))
}

/// The section of the report: legs saved against always-disaggregate, TTFT.
pub fn markdown(pd: &Value) -> String {
    let rows = pd["rows"].as_array().cloned().unwrap_or_default();
    let always = rows.first().and_then(|r| r["prefill_legs"].as_f64()).unwrap_or(f64::NAN);
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let v = |k: &str, d: usize| r[k].as_f64().map_or("-".into(), |x| f(x, d));
            let legs = r["prefill_legs"].as_f64().unwrap_or(f64::NAN);
            vec![
                r["decider"].as_str().unwrap_or("").to_string(),
                v("prefill_legs", 0),
                f(always - legs, 0),
                v("decode_alone", 0),
                // The pods count what they computed: a pulled KV is neither a hit nor a miss.
                r["decode_hit_rate"]
                    .as_f64()
                    .filter(|_| r["decode_alone"].as_f64() > Some(0.0))
                    .map_or("-".into(), |x| f(x * 100.0, 1)),
                v("ttft_p50_ms", 1),
                v("ttft_p90_ms", 1),
                v("ttft_p99_ms", 1),
                v("e2e_p50_ms", 1),
                r["errors"].to_string(),
            ]
        })
        .collect();
    let mut md = format!(
        "### {NAME} — llm-d's protocol on {} multi-turn chat requests, {} prefill + {} decode pods, {} streams\n\n",
        pd["requests"], pd["pods"], pd["pods"], pd["concurrency"]
    );
    md.push_str(&table(
        &[
            "decider",
            "prefill legs",
            "legs saved",
            "decode alone",
            "decode-alone hit %",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            "e2e p50 ms",
            "errors",
        ],
        &body,
    ));
    md.push('\n');
    md
}
