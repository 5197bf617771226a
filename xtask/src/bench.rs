//! `cargo xtask bench`: kvmesh side by side with its baselines, in one run, on the same
//! simulated workers and the same client. Reports ratios; never part of the tests.
//!
//! `overhead`: workers answer at once (`--time-scale 0`), so what is measured is the proxy:
//! direct to the workers (the floor for latency), plain Envoy (no filter), kvmesh, and
//! sglang-router (PyPI) with `--policy cache_aware`.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use kvmesh_testkit::{free_port, http, wait_until, Envoy, EnvoyOptions, Proc, Sim};
use serde_json::json;

use crate::loadgen::{self, Load};
use crate::tools::{build, ensure_envoy, ensure_sglang_router, ensure_wasm_target, step};

struct Opts {
    seconds: u64,
    connections: usize,
    sglang: bool,
    pd: bool,
    cp: bool,
}

fn parse(args: &[String]) -> anyhow::Result<Opts> {
    let mut o = Opts { seconds: 10, connections: 32, sglang: true, pd: false, cp: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> anyhow::Result<u64> {
            let v = it.next().with_context(|| format!("{name} needs a value"))?;
            v.parse().ok().filter(|&n| n > 0).with_context(|| format!("{name} {v}: not a positive number"))
        };
        match a.as_str() {
            "overhead" => {}
            "pd" => o.pd = true,
            "cp" => o.cp = true,
            "--seconds" => o.seconds = num("--seconds")?,
            "--connections" => o.connections = num("--connections")? as usize,
            "--no-sglang" => o.sglang = false,
            other => {
                bail!("unknown bench option `{other}` (overhead | pd | cp, --seconds N, --connections N, --no-sglang)")
            }
        }
    }
    Ok(o)
}

/// 16 shared system prompts of ~1 KiB, each followed by a distinct question.
fn workload() -> Vec<Vec<u8>> {
    (0..4096)
        .map(|i| {
            let group = i % 16;
            let system = format!("System prompt {group}: you are assistant number {group}. ").repeat(20);
            let body = json!({"text": format!("{system}Question {i}: what is {i} squared?"), "sampling_params": {"max_new_tokens": 1}});
            loadgen::post("/generate", &body.to_string())
        })
        .collect()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn measure(name: &str, targets: &[SocketAddr], requests: &[Vec<u8>], o: &Opts) -> Load {
    step(&format!("{name}: {} connections for {} s", o.connections, o.seconds));
    let load = loadgen::run(targets, requests, o.connections, Duration::from_secs(o.seconds));
    eprintln!(
        "    {:>9.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  errors {}",
        load.rps(),
        ms(load.quantile(0.5)),
        ms(load.quantile(0.99)),
        load.errors
    );
    load
}

/// CPU time (user + system) a process has used so far, from `/proc`.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11..13).map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / 100.0)
}

/// Runs `measure` and reports the CPU the proxy process spent per successful request.
fn measure_cpu(name: &str, pid: u32, targets: &[SocketAddr], requests: &[Vec<u8>], o: &Opts) -> (Load, f64) {
    let before = cpu_time(pid);
    let load = measure(name, targets, requests, o);
    let spent = cpu_time(pid).saturating_sub(before);
    // Includes the warm-up requests, which `load.ok` does not count: an upper bound.
    let per_request = spent.as_secs_f64() * 1e6 / (load.ok as f64 * 1.1).max(1.0);
    eprintln!("    proxy CPU {per_request:.1} us/request");
    (load, per_request)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `P50`/`P99` of a histogram line in Envoy's `/stats` (cumulative values).
fn histogram(envoy: &Envoy, name: &str) -> String {
    let text = http::get(&envoy.admin_url(&format!("/stats?filter={name}"))).map(|r| r.text()).unwrap_or_default();
    let line = text.lines().find(|l| l.contains(name) && l.contains("P50")).unwrap_or("");
    let pick = |q: &str| {
        line.split_whitespace()
            .find(|p| p.starts_with(&format!("{q}(")))
            .and_then(|p| p.trim_end_matches(')').rsplit(',').next().map(String::from))
            .unwrap_or_else(|| "?".into())
    };
    format!("p50 {} ns, p90 {} ns, p99 {} ns", pick("P50"), pick("P90"), pick("P99"))
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let o = parse(args)?;
    if o.cp {
        build()?;
        return crate::bench_cp::run();
    }
    ensure_wasm_target()?;
    std::env::set_var("ENVOY_BIN", ensure_envoy()?);
    let python = if o.sglang { Some(ensure_sglang_router()?) } else { None };
    build()?;
    if o.pd {
        return pd(&o, python);
    }

    step("starting 4 simulated workers (--time-scale 0)");
    let sims: Vec<Sim> =
        (0..4).map(|_| Sim::start(&["--time-scale", "0", "--max-running", "4096"])).collect::<Result<_, _>>()?;
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let requests = workload();
    let mut rows: Vec<(String, Load, Option<f64>)> = Vec::new();

    let direct: Vec<SocketAddr> = sims.iter().map(|s| addr(s.port)).collect();
    rows.push(("direct to workers".into(), measure("direct to workers", &direct, &requests, &o), None));

    let mut plain_opts = EnvoyOptions::new(json!({"worker_urls": urls}))?;
    plain_opts.concurrency = 1;
    plain_opts.plain_upstreams = Some(sims.iter().map(Sim::addr).collect());
    let mut plain = Envoy::start(&plain_opts)?;
    let (load, cpu) = measure_cpu("plain Envoy", plain.proc().pid(), &[addr(plain.port)], &requests, &o);
    rows.push(("plain Envoy (1 thread)".into(), load, Some(cpu)));
    drop(plain);

    let policy = std::env::var("KVMESH_BENCH_POLICY").unwrap_or_else(|_| "cache_aware".into());
    let mut kv_opts = EnvoyOptions::new(json!({"worker_urls": urls, "policy": policy}))?;
    kv_opts.concurrency = 1;
    let mut kvmesh = Envoy::start(&kv_opts)?;
    let (load, cpu) = measure_cpu("kvmesh", kvmesh.proc().pid(), &[addr(kvmesh.port)], &requests, &o);
    rows.push((format!("kvmesh (1 thread, {policy})"), load, Some(cpu)));
    let decision = histogram(&kvmesh, "kvmesh_route_decision_ns");
    drop(kvmesh);

    if let Some(python) = python {
        let mut args = vec!["--policy".to_string(), "cache_aware".into(), "--worker-urls".into()];
        args.extend(urls.iter().cloned());
        let (router, port) = start_sglang_router(&python, &args)?;
        let (load, cpu) = measure_cpu("sglang-router", router.pid(), &[addr(port)], &requests, &o);
        rows.push(("sglang-router 0.3.2 (cache_aware)".into(), load, Some(cpu)));
    }

    let floor = rows[0].1.quantile(0.5);
    println!(
        "\n## kvmesh overhead benchmark ({} s, {} connections, 4 workers at --time-scale 0)\n",
        o.seconds, o.connections
    );
    println!("| setup | req/s | p50 ms | p99 ms | added p50 ms | proxy CPU us/req | errors |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, l, cpu) in &rows {
        let added = ms(l.quantile(0.5)) - ms(floor);
        let cpu = cpu.map_or("-".to_string(), |c| format!("{c:.1}"));
        println!(
            "| {name} | {:.0} | {:.3} | {:.3} | {:.3} | {cpu} | {} |",
            l.rps(),
            ms(l.quantile(0.5)),
            ms(l.quantile(0.99)),
            added,
            l.errors
        );
    }
    let find =
        |prefix: &str| rows.iter().find(|(n, _, _)| n.starts_with(prefix)).map(|(_, l, c)| (l, c.unwrap_or(0.0)));
    println!();
    if let (Some((k, kc)), Some((p, pc))) = (find("kvmesh"), find("plain")) {
        println!(
            "- kvmesh / plain Envoy throughput: {:.2}; filter CPU per request: {:.1} us",
            k.rps() / p.rps(),
            kc - pc
        );
    }
    if let (Some((k, _)), Some((s, _))) = (find("kvmesh"), find("sglang")) {
        let added = |l: &Load| (ms(l.quantile(0.5)) - ms(floor)).max(1e-6);
        println!("- kvmesh / sglang-router throughput: {:.2} (target >= 2.0)", k.rps() / s.rps());
        println!("- kvmesh / sglang-router added p50 latency: {:.2} (target <= 0.5)", added(k) / added(s));
    }
    println!("- filter routing decision inside Envoy (kvmesh_route_decision_ns): {decision}");
    Ok(())
}

/// Starts sglang-router with `args` and waits until it serves `/generate`.
fn start_sglang_router(python: &std::path::Path, args: &[String]) -> anyhow::Result<(Proc, u16)> {
    let port = free_port()?;
    let mut cmd = Command::new(python);
    cmd.args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &port.to_string()]).args(args);
    let mut router = Proc::spawn("sglang-router", cmd)?;
    let probe = format!("http://127.0.0.1:{port}/generate");
    wait_until("sglang-router to serve", Duration::from_secs(90), || {
        router.exited().is_some()
            || http::post_json(&probe, &json!({"text": "warm up"})).map(|r| r.status == 200).unwrap_or(false)
    })
    .map_err(|e| e.context(router.log_tail()))?;
    Ok((router, port))
}

/// `bench pd`: the latency the PD path adds over the regular path on the same workers.
fn pd(o: &Opts, python: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    step("starting 2 prefill and 2 decode simulated workers (--time-scale 0)");
    let mut prefill = Vec::new();
    for _ in 0..2 {
        let boot = free_port()?;
        prefill.push((
            Sim::start(&[
                "--role",
                "prefill",
                "--bootstrap-port",
                &boot.to_string(),
                "--time-scale",
                "0",
                "--max-running",
                "4096",
            ])?,
            boot,
        ));
    }
    let decode: Vec<Sim> = (0..2)
        .map(|_| Sim::start(&["--role", "decode", "--time-scale", "0", "--max-running", "4096"]))
        .collect::<Result<_, _>>()?;
    let decode_urls: Vec<String> = decode.iter().map(Sim::url).collect();
    let requests = workload();
    let mut rows: Vec<(String, Load)> = Vec::new();

    let mut regular = EnvoyOptions::new(json!({"worker_urls": decode_urls}))?;
    regular.concurrency = 1;
    let envoy = Envoy::start(&regular)?;
    rows.push((
        "kvmesh regular path (decode workers only)".into(),
        measure("kvmesh regular", &[addr(envoy.port)], &requests, o),
    ));
    drop(envoy);

    let filter = json!({
        "pd_disaggregation": true,
        "prefill": prefill.iter().map(|(s, b)| json!([s.url(), b])).collect::<Vec<_>>(),
        "decode": decode_urls,
    });
    let mut pd_opts = EnvoyOptions::new(filter)?;
    pd_opts.template = kvmesh_testkit::repo_root().join("envoy/envoy-pd.yaml");
    pd_opts.concurrency = 1;
    let envoy = Envoy::start(&pd_opts)?;
    rows.push((
        "kvmesh PD path (prefill callout + decode)".into(),
        measure("kvmesh PD", &[addr(envoy.port)], &requests, o),
    ));
    let decision = histogram(&envoy, "kvmesh_route_decision_ns");
    drop(envoy);

    if let Some(python) = python {
        let mut args = vec!["--pd-disaggregation".to_string(), "--policy".into(), "cache_aware".into()];
        for (s, b) in &prefill {
            args.extend(["--prefill".into(), s.url(), b.to_string()]);
        }
        for u in &decode_urls {
            args.extend(["--decode".into(), u.clone()]);
        }
        let (_router, port) = start_sglang_router(&python, &args)?;
        rows.push(("sglang-router 0.3.2 PD".into(), measure("sglang-router PD", &[addr(port)], &requests, o)));
    }

    println!(
        "\n## kvmesh PD benchmark ({} s, {} connections, 2 prefill + 2 decode workers at --time-scale 0)\n",
        o.seconds, o.connections
    );
    println!("| setup | req/s | p50 ms | p99 ms | errors |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (name, l) in &rows {
        println!(
            "| {name} | {:.0} | {:.3} | {:.3} | {} |",
            l.rps(),
            ms(l.quantile(0.5)),
            ms(l.quantile(0.99)),
            l.errors
        );
    }
    let (regular, pd) = (&rows[0].1, &rows[1].1);
    println!(
        "\n- PD path adds {:.3} ms at p50 ({:.2}x the regular path's throughput)",
        ms(pd.quantile(0.5)) - ms(regular.quantile(0.5)),
        pd.rps() / regular.rps()
    );
    if let Some((_, s)) = rows.get(2) {
        println!(
            "- kvmesh PD / sglang-router PD throughput: {:.2}; p50 {:.3} vs {:.3} ms",
            pd.rps() / s.rps(),
            ms(pd.quantile(0.5)),
            ms(s.quantile(0.5))
        );
    }
    println!("- filter routing decision inside Envoy (PD, kvmesh_route_decision_ns): {decision}");
    Ok(())
}
