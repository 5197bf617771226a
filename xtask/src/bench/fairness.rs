//! `cargo xtask bench fairness` (issue 47): one flooding tenant and three interactive ones
//! through one kvmesh gateway whose concurrency limit is the bottleneck. `batch` sends long
//! prompts over ten times the interactive tenants' connections (closed loop); `t1`..`t3` send
//! short ones. Configurations: the interactive tenants alone (their TTFT without the flood),
//! then with the flood: first come, first served (today's queue), fair shares by tenant
//! weight, and fair shares with the interactive tenants' requests in the `interactive` class
//! (two reserved slots) and the flood's in `default`. Reported per tenant: TTFT p99, requests
//! answered and refused, and its share of the generated tokens beside its weight's share.
//!
//! Then shares by weight: three backlogged tenants of weights 1, 2 and 3 (identical requests,
//! each tenant's connections over every gateway, most of them at one of its own), at one
//! gateway and at three on one kvmesh-cp (the fair pick counting the fleet's usage, shipped in
//! its snapshots); reported: each one's share of the generated tokens beside its weight's.
//!
//! With the peers, SMG 1.13's priority scheduler beside it: `smg launch` with the same
//! concurrency limit, `--priority-scheduler-enabled` (its built-in classes; any tenant may
//! claim `interactive`), the interactive tenants sending `x-smg-priority: interactive`, the
//! flood `default`; alone and under the flood.

use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_testkit::{wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::{self, addr, Peer, PeerBins, Workers};
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

/// The priority header requests send and its value for the flood and for the interactive
/// tenants (none: no priorities).
type Priority = Option<(&'static str, &'static str, &'static str)>;

/// One tenant's request stream (`priority`: its priority header and value, if any).
fn stream(tenant: &str, priority: Option<(&str, &str)>, n: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    let (chars, tokens) = if tenant == "batch" { (8_000, FLOOD_TOKENS) } else { (400, INTERACTIVE_TOKENS) };
    (0..n)
        .map(|_| {
            let body = json!({"text": text(rng, chars), "sampling_params": {"max_new_tokens": tokens}});
            let mut headers = vec![("kvmesh-tenant", tenant)];
            if let Some(p) = priority {
                headers.push(p);
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
    let out = load(addr(envoy.port), c.flood, c.priorities.then_some(("kvmesh-priority", "0", "1")), seconds);
    drop(envoy);
    Ok(out)
}

/// The same through SMG 1.13 with its priority scheduler (see the module's doc).
fn measure_smg(bins: &PeerBins, sims: &[Sim], flood: bool, seconds: f64) -> anyhow::Result<Vec<(&'static str, Load)>> {
    let urls = Workers::Regular(sims.iter().map(Sim::url).collect());
    let limit = LIMIT.to_string();
    let extra = [
        "--max-concurrent-requests",
        &limit,
        "--queue-size",
        "1000",
        "--queue-timeout-secs",
        "120",
        "--priority-scheduler-enabled",
        "--priority-scheduler-default-max-class",
        "interactive",
        "--trust-tenant-header",
        "--tenant-header-name",
        "kvmesh-tenant",
    ];
    let smg = stack::peer_with(bins, Peer::Smg, &urls, 1, false, "round_robin", &extra)?;
    let out = load(smg.targets[0], flood, Some(("x-smg-priority", "default", "interactive")), seconds);
    drop(smg);
    Ok(out)
}

/// Each tenant's stream (the flood's only with `flood`) against `target`, all at once.
fn load(target: SocketAddr, flood: bool, priority: Priority, seconds: f64) -> Vec<(&'static str, Load)> {
    let target = [target];
    let mut rng = Rng::new(SEED);
    let runs: Vec<_> = TENANTS
        .iter()
        .filter(|t| flood || **t != "batch")
        .map(|&t| {
            let priority = priority.map(|(h, f, i)| (h, if t == "batch" { f } else { i }));
            let (conns, n) = if t == "batch" { (FLOOD_CONNECTIONS, 400) } else { (INTERACTIVE_CONNECTIONS, 200) };
            let requests = stream(t, priority, n, &mut rng);
            std::thread::spawn(move || {
                (t, loadgen::run(t, &target, &requests, conns, Stop::For(Duration::from_secs_f64(seconds))))
            })
        })
        .collect();
    runs.into_iter().filter_map(|h| h.join().ok()).collect()
}

/// Backlogged tenants and their weights (shares by weight).
const WEIGHTED: [(&str, u32); 3] = [("w1", 1), ("w2", 2), ("w3", 3)];
/// Each weighted tenant's connections, spread over the gateways.
const WEIGHTED_CONNECTIONS: usize = 12;
const WEIGHTED_TOKENS: u32 = 16;

/// The weighted tenants through `gateways` gateways (on one kvmesh-cp past one) with `limit`
/// slots each; each tenant's connections go half to "its" gateway, the rest round the others.
fn measure_weighted(
    sims: &[Sim],
    gateways: usize,
    limit: u32,
    seconds: f64,
) -> anyhow::Result<Vec<(&'static str, Load)>> {
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let cp = if gateways > 1 {
        let mut args = vec!["--worker-urls"];
        args.extend(urls.iter().map(String::as_str));
        Some(ControlPlane::start(&args)?)
    } else {
        None
    };
    let weights: Vec<String> = WEIGHTED.iter().map(|(t, w)| format!("{t}={w}")).collect();
    let mut envoys = Vec::new();
    for _ in 0..gateways {
        let mut f = json!({
            "worker_urls": if cp.is_some() { json!([]) } else { json!(urls) },
            "policy": "round_robin",
            "max_concurrent_requests": limit,
            "rate_limit_tokens_per_second": 100_000,
            "queue_size": 1_000,
            "queue_timeout_secs": 120,
            "tenant_weight": weights,
        });
        if cp.is_some() {
            f["report_interval_ms"] = json!(100);
        }
        let mut opts = EnvoyOptions::new(f)?;
        opts.concurrency = 1;
        if let Some(cp) = &cp {
            opts.use_control_plane(cp);
        }
        let envoy = Envoy::start(&opts)?;
        if cp.is_some() {
            wait_until("the gateway's first snapshot", Duration::from_secs(30), || envoy.version() > 0)?;
        }
        envoys.push(envoy);
    }
    let ports: Vec<_> = envoys.iter().map(|e| addr(e.port)).collect();
    let mut rng = Rng::new(SEED);
    let runs: Vec<_> = WEIGHTED
        .iter()
        .enumerate()
        .map(|(i, &(t, _))| {
            let body = |rng: &mut Rng| {
                let body = json!({"text": text(rng, 100), "sampling_params": {"max_new_tokens": WEIGHTED_TOKENS}});
                loadgen::post_with("/generate", &body.to_string(), &[("kvmesh-tenant", t)])
            };
            let requests: Vec<Vec<u8>> = (0..2_000).map(|_| body(&mut rng)).collect();
            // Connection c goes to targets[c % len]: half to gateway i, the rest round all.
            let n = ports.len();
            let mut targets: Vec<_> = (0..n).map(|k| ports[(i + k) % n]).collect();
            targets.extend(std::iter::repeat_n(ports[i % n], n.saturating_sub(1)));
            std::thread::spawn(move || {
                (
                    t,
                    loadgen::run(
                        t,
                        &targets,
                        &requests,
                        WEIGHTED_CONNECTIONS,
                        Stop::For(Duration::from_secs_f64(seconds)),
                    ),
                )
            })
        })
        .collect();
    let out = runs.into_iter().filter_map(|h| h.join().ok()).collect();
    drop(envoys);
    drop(cp);
    Ok(out)
}

/// Shares by weight at 1 and 3 gateways: rows, JSON results and the largest deviation.
fn weighted(sims: &[Sim], seconds: f64, rows: &mut Vec<Vec<String>>, results: &mut Vec<Value>) -> anyhow::Result<()> {
    let total_weight: u32 = WEIGHTED.iter().map(|(_, w)| w).sum();
    for (gateways, limit) in [(1usize, LIMIT), (3, LIMIT.div_ceil(3))] {
        let name = format!("backlogged by weight, {gateways} gateway(s) × {limit} slots");
        step(&format!("fairness: {name}"));
        let loads = measure_weighted(sims, gateways, limit, seconds)?;
        let total: u64 = loads.iter().map(|(_, l)| l.ok).sum();
        let mut worst = 0.0f64;
        for (t, l) in &loads {
            let w = WEIGHTED.iter().find(|(n, _)| n == t).map_or(1, |(_, w)| *w);
            let share = l.ok as f64 / total.max(1) as f64;
            let ideal = f64::from(w) / f64::from(total_weight);
            let off = (share - ideal) / ideal;
            worst = worst.max(off.abs());
            results.push(json!({
                "config": name, "tenant": t, "weight": w, "ok": l.ok, "errors": l.errors,
                "ttft_p99_ms": l.ttft_ms(0.99), "token_share": share, "weight_share": ideal,
            }));
            rows.push(vec![
                name.clone(),
                format!("{t} (weight {w})"),
                l.ok.to_string(),
                l.errors.to_string(),
                f(l.ttft_ms(0.5), 0),
                f(l.ttft_ms(0.99), 0),
                format!("{} ({:+}%)", f(100.0 * share, 1), f(100.0 * off, 0)),
                f(100.0 * ideal, 1),
            ]);
        }
        rows.push(vec![
            name.clone(),
            "**largest deviation from the weight's share**".into(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            format!("{}%", f(100.0 * worst, 1)),
            String::new(),
        ]);
    }
    Ok(())
}

/// One configuration's rows (and JSON results): per tenant, then the interactive tenants'
/// TTFT p99 beside `alone_p99`; returns that p99.
fn flood_rows(
    name: &str,
    loads: &[(&'static str, Load)],
    alone_p99: Option<f64>,
    rows: &mut Vec<Vec<String>>,
    results: &mut Vec<Value>,
) -> f64 {
    let tokens =
        |t: &str, l: &Load| l.ok as f64 * f64::from(if t == "batch" { FLOOD_TOKENS } else { INTERACTIVE_TOKENS });
    let total: f64 = loads.iter().map(|(t, l)| tokens(t, l)).sum();
    let interactive_p99 =
        loads.iter().filter(|(t, _)| *t != "batch").map(|(_, l)| l.ttft_ms(0.99)).fold(0.0f64, f64::max);
    for (t, l) in loads {
        let share = tokens(t, l) / total.max(1.0);
        let ideal = 1.0 / loads.len() as f64;
        results.push(json!({
            "config": name, "tenant": t, "ok": l.ok, "errors": l.errors,
            "ttft_p99_ms": l.ttft_ms(0.99), "ttft_p50_ms": l.ttft_ms(0.5),
            "token_share": share, "weight_share": ideal,
        }));
        rows.push(vec![
            name.to_string(),
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
        name.to_string(),
        "**interactive p99 / alone**".into(),
        String::new(),
        String::new(),
        String::new(),
        f(interactive_p99, 0),
        format!("{}×", f(interactive_p99 / alone_p99.unwrap_or(interactive_p99).max(1e-9), 2)),
        String::new(),
    ]);
    interactive_p99
}

pub fn run(o: &Opts, bins: &PeerBins) -> anyhow::Result<(Value, String)> {
    let seconds = if o.quick { 6.0 } else { o.seconds.max(20.0) };
    let sim_args = ["--time-scale", "1", "--decode-ms-per-token", "5", "--batch-slowdown", "0"];
    let sims = vec![Sim::start(&sim_args)?, Sim::start(&sim_args)?];
    let mut results = Vec::new();
    let mut rows = Vec::new();
    let mut alone_p99 = None;
    for c in &CONFIGS {
        step(&format!("fairness: {}", c.name));
        let loads = measure(&sims, c, seconds)?;
        let p99 = flood_rows(c.name, &loads, alone_p99, &mut rows, &mut results);
        if !c.flood {
            alone_p99 = Some(p99);
        }
    }
    if bins.smg.is_some() {
        let mut smg_alone = None;
        for (name, flood) in
            [("SMG 1.13 priority scheduler, interactive alone", false), ("SMG 1.13 priority scheduler, flood", true)]
        {
            step(&format!("fairness: {name}"));
            let loads = measure_smg(bins, &sims, flood, seconds)?;
            let p99 = flood_rows(name, &loads, smg_alone, &mut rows, &mut results);
            if !flood {
                smg_alone = Some(p99);
            }
        }
    }
    weighted(&sims, seconds, &mut rows, &mut results)?;
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
         weight's by design. Backlogged by weight: `w1`..`w3` (weights 1, 2, 3) each over \
         {WEIGHTED_CONNECTIONS} connections of ~25-token prompts and {WEIGHTED_TOKENS} generated tokens, half of a \
         tenant's connections at one gateway, the rest spread; 3 gateways on one kvmesh-cp, each its own \
         Envoy (1 thread) with its share of the slots. SMG 1.13 (with the peers): `--max-concurrent-requests \
         {LIMIT} --priority-scheduler-enabled`, `t1`..`t3` sending `x-smg-priority: interactive`, `batch` \
         `default`.\n\n{}",
        table(&headers, &rows)
    );
    Ok((json!({"results": results, "seconds": seconds, "limit": LIMIT}), md))
}
