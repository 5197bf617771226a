//! `cargo xtask bench fairness` (issue 47): one flooding tenant and three interactive ones
//! through one kvmesh gateway whose concurrency limit is the bottleneck. `batch` sends long
//! prompts over ten times the interactive tenants' connections (closed loop); `t1`..`t3` send
//! short ones. Configurations: the interactive tenants alone (their TTFT without the flood),
//! then with the flood: first come, first served (today's queue), fair shares by tenant
//! weight, and fair shares with the interactive tenants' requests in the `interactive` class
//! (two reserved slots) and the flood's in `default`. Reported per tenant: TTFT p99, requests
//! answered and refused, and its share of the generated tokens beside its weight's share.
//!
//! Not yet here: three gateways (shares across gateways are not implemented yet) and SMG 1.13
//! beside it (it has `--priority-scheduler-enabled`).

use std::time::Duration;

use kvmesh_testkit::{Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::addr;
use super::workload::{text, Rng};
use super::Opts;
use crate::loadgen::{self, Load, Stop};
use crate::tools::step;

const SEED: u64 = 20_261_206;
/// Slots of the gateway's concurrency limit (the bottleneck).
const LIMIT: u32 = 8;
const FLOOD_CONNECTIONS: usize = 20;
const INTERACTIVE_CONNECTIONS: usize = 2;
const FLOOD_TOKENS: u32 = 32;
const INTERACTIVE_TOKENS: u32 = 8;
const TENANTS: [&str; 4] = ["batch", "t1", "t2", "t3"];

/// One tenant's request stream (`priority`: its `kvmesh-priority` header, if any).
fn stream(tenant: &str, priority: Option<&str>, n: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    let (chars, tokens) = if tenant == "batch" { (8_000, FLOOD_TOKENS) } else { (400, INTERACTIVE_TOKENS) };
    (0..n)
        .map(|_| {
            let body = json!({"text": text(rng, chars), "sampling_params": {"max_new_tokens": tokens}});
            let mut headers = vec![("kvmesh-tenant", tenant)];
            if let Some(p) = priority {
                headers.push(("kvmesh-priority", p));
            }
            loadgen::post_with("/generate", &body.to_string(), &headers)
        })
        .collect()
}

struct Config {
    name: &'static str,
    flood: bool,
    fair: bool,
    priorities: bool,
}

const CONFIGS: [Config; 4] = [
    Config { name: "interactive alone (FIFO)", flood: false, fair: false, priorities: false },
    Config { name: "flood, FIFO (today)", flood: true, fair: false, priorities: false },
    Config { name: "flood, fair shares", flood: true, fair: true, priorities: false },
    Config { name: "flood, fair shares + priorities", flood: true, fair: true, priorities: true },
];

fn filter(sims: &[Sim], c: &Config) -> Value {
    let mut f = json!({
        "worker_urls": sims.iter().map(Sim::url).collect::<Vec<_>>(),
        "policy": "round_robin",
        "max_concurrent_requests": LIMIT,
        "rate_limit_tokens_per_second": 100_000,
        "queue_size": 1_000,
        "queue_timeout_secs": 120,
        "tenant_header": "kvmesh-tenant",
    });
    if c.fair {
        f["tenant_weight"] = json!(TENANTS.iter().map(|t| format!("{t}=1")).collect::<Vec<_>>());
    }
    if c.priorities {
        f["priority_reserved"] = json!(["interactive=2"]);
    }
    f
}

/// Runs one configuration: each tenant's stream on its own connections, all at once.
fn measure(sims: &[Sim], c: &Config, seconds: f64) -> anyhow::Result<Vec<(&'static str, Load)>> {
    let mut opts = EnvoyOptions::new(filter(sims, c))?;
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts)?;
    let target = [addr(envoy.port)];
    let mut rng = Rng::new(SEED);
    let runs: Vec<_> = TENANTS
        .iter()
        .filter(|t| c.flood || **t != "batch")
        .map(|&t| {
            let priority = match (c.priorities, t) {
                (false, _) => None,
                (true, "batch") => Some("0"),
                (true, _) => Some("1"),
            };
            let (conns, n) = if t == "batch" { (FLOOD_CONNECTIONS, 400) } else { (INTERACTIVE_CONNECTIONS, 200) };
            let requests = stream(t, priority, n, &mut rng);
            std::thread::spawn(move || {
                (t, loadgen::run(t, &target, &requests, conns, Stop::For(Duration::from_secs_f64(seconds))))
            })
        })
        .collect();
    let out = runs.into_iter().filter_map(|h| h.join().ok()).collect();
    drop(envoy);
    Ok(out)
}

pub fn run(o: &Opts) -> anyhow::Result<(Value, String)> {
    let seconds = if o.quick { 6.0 } else { o.seconds.max(20.0) };
    let sim_args = ["--time-scale", "1", "--decode-ms-per-token", "5", "--batch-slowdown", "0"];
    let sims = vec![Sim::start(&sim_args)?, Sim::start(&sim_args)?];
    let mut results = Vec::new();
    let mut rows = Vec::new();
    let mut alone_p99 = None;
    for c in &CONFIGS {
        step(&format!("fairness: {}", c.name));
        let loads = measure(&sims, c, seconds)?;
        let tokens =
            |t: &str, l: &Load| l.ok as f64 * f64::from(if t == "batch" { FLOOD_TOKENS } else { INTERACTIVE_TOKENS });
        let total: f64 = loads.iter().map(|(t, l)| tokens(t, l)).sum();
        let interactive_p99 =
            loads.iter().filter(|(t, _)| *t != "batch").map(|(_, l)| l.ttft_ms(0.99)).fold(0.0f64, f64::max);
        if !c.flood {
            alone_p99 = Some(interactive_p99);
        }
        for (t, l) in &loads {
            let share = tokens(t, l) / total.max(1.0);
            let ideal = 1.0 / loads.len() as f64;
            results.push(json!({
                "config": c.name, "tenant": t, "ok": l.ok, "errors": l.errors,
                "ttft_p99_ms": l.ttft_ms(0.99), "ttft_p50_ms": l.ttft_ms(0.5),
                "token_share": share, "weight_share": ideal,
            }));
            rows.push(vec![
                c.name.to_string(),
                t.to_string(),
                l.ok.to_string(),
                l.errors.to_string(),
                f(l.ttft_ms(0.5), 0),
                f(l.ttft_ms(0.99), 0),
                f(100.0 * share, 1),
                f(100.0 * ideal, 1),
            ]);
        }
        rows.push(vec![
            c.name.to_string(),
            "**interactive p99 / alone**".into(),
            String::new(),
            String::new(),
            String::new(),
            f(interactive_p99, 0),
            alone_p99.map_or(String::new(), |a| format!("{}×", f(interactive_p99 / a.max(1e-9), 2))),
            String::new(),
        ]);
    }
    let headers = [
        "configuration",
        "tenant",
        "answered",
        "refused",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "token share %",
        "weight share %",
    ];
    let md = format!(
        "One gateway (1 Envoy thread), {LIMIT} slots, 2 simulated workers (5 ms/token), {seconds} s per \
         configuration: `batch` {FLOOD_CONNECTIONS} connections of ~2000-token prompts, `t1`..`t3` \
         {INTERACTIVE_CONNECTIONS} each of ~100-token prompts. Refused: requests answered with an error. \
         With priorities, `t1`..`t3` send `kvmesh-priority: 1` (two slots reserved), `batch` 0. Token shares count answered requests × their \
         `max_new_tokens`; interactive tenants are not backlogged, so their share is below their \
         weight's by design.\n\n{}",
        table(&headers, &rows)
    );
    Ok((json!({"results": results, "seconds": seconds, "limit": LIMIT}), md))
}
