//! `cargo xtask bench fairness` (issue 47): one flooding tenant and three interactive ones
//! through one kvmesh gateway whose concurrency limit is the bottleneck. `batch` sends long
//! prompts over ten times the interactive tenants' connections (closed loop); `t1`..`t3` send
//! short ones. Configurations: the interactive tenants alone (their TTFT without the flood),
//! then with the flood: first come, first served (today's queue), fair shares by tenant
//! weight, and fair shares with the interactive tenants' requests in the `interactive` class
//! and the flood's in `default`, with two reserved slots and with as many as the interactive
//! tenants have connections (running requests are never cut, so short of that an interactive
//! request may wait for a long one to end). The same at three gateways on one kvmesh-cp, the
//! slots shared out. Reported per tenant: TTFT p99, requests answered and refused, and its
//! share of the generated tokens beside its weight's share.
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
    /// Gateways (one Envoy thread each; past one, on one kvmesh-cp) sharing the slots.
    gateways: usize,
    flood: bool,
    fair: bool,
    /// Slots reserved for the `interactive` class at each gateway; 0: no priorities.
    reserved: u32,
}

const CONFIGS: [Config; 9] = [
    Config { name: "interactive alone (FIFO)", gateways: 1, flood: false, fair: false, reserved: 0 },
    Config { name: "flood, FIFO (today)", gateways: 1, flood: true, fair: false, reserved: 0 },
    Config { name: "flood, fair shares", gateways: 1, flood: true, fair: true, reserved: 0 },
    Config { name: "flood, fair shares + priorities (2 reserved)", gateways: 1, flood: true, fair: true, reserved: 2 },
    Config { name: "flood, fair shares + priorities (6 reserved)", gateways: 1, flood: true, fair: true, reserved: 6 },
    Config { name: "3 gateways: interactive alone (FIFO)", gateways: 3, flood: false, fair: false, reserved: 0 },
    Config { name: "3 gateways: flood, FIFO", gateways: 3, flood: true, fair: false, reserved: 0 },
    Config { name: "3 gateways: flood, fair shares", gateways: 3, flood: true, fair: true, reserved: 0 },
    Config {
        name: "3 gateways: flood, fair shares + priorities (2 reserved each)",
        gateways: 3,
        flood: true,
        fair: true,
        reserved: 2,
    },
];

/// The slots of each of `gateways` gateways: the limit shared out.
fn slots(gateways: usize) -> u32 {
    LIMIT.div_ceil(u32::try_from(gateways).unwrap_or(1).max(1))
}

fn filter(c: &Config) -> Value {
    let mut f = json!({
        "policy": "round_robin",
        "max_concurrent_requests": slots(c.gateways),
        "rate_limit_tokens_per_second": 100_000,
        "queue_size": 1_000,
        "queue_timeout_secs": 120,
        "tenant_header": "kvmesh-tenant",
    });
    if c.fair {
        f["tenant_weight"] = json!(TENANTS.iter().map(|t| format!("{t}=1")).collect::<Vec<_>>());
    }
    if c.reserved > 0 {
        f["priority_reserved"] = json!([format!("interactive={}", c.reserved)]);
    }
    f
}

/// `gateways` gateways, each its own Envoy (1 thread) with `filter`; past one, all on one
/// kvmesh-cp that knows the workers (each gateway's first snapshot awaited).
fn gateways(sims: &[Sim], n: usize, mut filter: Value) -> anyhow::Result<(Option<ControlPlane>, Vec<Envoy>)> {
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let cp = if n > 1 {
        let mut args = vec!["--worker-urls"];
        args.extend(urls.iter().map(String::as_str));
        Some(ControlPlane::start(&args)?)
    } else {
        None
    };
    filter["worker_urls"] = if cp.is_some() { json!([]) } else { json!(urls) };
    if cp.is_some() {
        filter["report_interval_ms"] = json!(100);
    }
    let mut envoys = Vec::new();
    for _ in 0..n {
        let mut opts = EnvoyOptions::new(filter.clone())?;
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
    Ok((cp, envoys))
}

/// Runs one configuration: each tenant's stream on its own connections (spread over the
/// gateways), all at once.
fn measure(sims: &[Sim], c: &Config, seconds: f64) -> anyhow::Result<Vec<(&'static str, Load)>> {
    let (cp, envoys) = gateways(sims, c.gateways, filter(c))?;
    let targets: Vec<_> = envoys.iter().map(|e| addr(e.port)).collect();
    let priority = (c.reserved > 0).then_some(("kvmesh-priority", "0", "1"));
    let out = load(&targets, c.flood, priority, seconds);
    drop(envoys);
    drop(cp);
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
    let out = load(&smg.targets[..1], flood, Some(("x-smg-priority", "default", "interactive")), seconds);
    drop(smg);
    Ok(out)
}

/// Each tenant's stream (the flood's only with `flood`) against `targets` (connection `c` to
/// `targets[c % len]`), all at once.
fn load(targets: &[SocketAddr], flood: bool, priority: Priority, seconds: f64) -> Vec<(&'static str, Load)> {
    let mut rng = Rng::new(SEED);
    let runs: Vec<_> = TENANTS
        .iter()
        .enumerate()
        .filter(|(_, t)| flood || **t != "batch")
        .map(|(i, &t)| {
            let priority = priority.map(|(h, f, i)| (h, if t == "batch" { f } else { i }));
            let (conns, n) = if t == "batch" { (FLOOD_CONNECTIONS, 400) } else { (INTERACTIVE_CONNECTIONS, 200) };
            let requests = stream(t, priority, n, &mut rng);
            // Each tenant's connections start at a gateway of their own, so that every
            // gateway sees as many interactive connections as the next.
            let targets: Vec<_> = (0..targets.len()).map(|k| targets[(i + k) % targets.len()]).collect();
            std::thread::spawn(move || {
                (t, loadgen::run(t, &targets, &requests, conns, Stop::For(Duration::from_secs_f64(seconds))))
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
    let weights: Vec<String> = WEIGHTED.iter().map(|(t, w)| format!("{t}={w}")).collect();
    let f = json!({
        "policy": "round_robin",
        "max_concurrent_requests": limit,
        "rate_limit_tokens_per_second": 100_000,
        "queue_size": 1_000,
        "queue_timeout_secs": 120,
        "tenant_weight": weights,
    });
    let (cp, envoys) = self::gateways(sims, gateways, f)?;
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
         With priorities, `t1`..`t3` send `kvmesh-priority: 1` (slots reserved as named), `batch` 0. \
         3 gateways: each its own Envoy (1 thread, {} slots) on one kvmesh-cp, every tenant's connections \
         spread over them. Token shares count answered requests × their \
         `max_new_tokens`; interactive tenants are not backlogged, so their share is below their \
         weight's by design. Backlogged by weight: `w1`..`w3` (weights 1, 2, 3) each over \
         {WEIGHTED_CONNECTIONS} connections of ~25-token prompts and {WEIGHTED_TOKENS} generated tokens, half of a \
         tenant's connections at one gateway, the rest spread; 3 gateways on one kvmesh-cp, each its own \
         Envoy (1 thread) with its share of the slots. SMG 1.13 (with the peers): `--max-concurrent-requests \
         {LIMIT} --priority-scheduler-enabled`, `t1`..`t3` sending `x-smg-priority: interactive`, `batch` \
         `default`.\n\n{}",
        slots(3),
        table(&headers, &rows)
    );
    Ok((json!({"results": results, "seconds": seconds, "limit": LIMIT}), md))
}
