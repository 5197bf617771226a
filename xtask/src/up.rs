//! `cargo xtask up`: the local stack — simulated workers and Envoy with the filter.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use kvmesh_testkit::{Envoy, EnvoyOptions, Sim};
use serde_json::{json, Map, Value};

use crate::tools::{build, ensure_envoy, ensure_wasm_target, step};

const GATEWAY_PORT: u16 = 10000;
const ADMIN_PORT: u16 = 9901;
const FIRST_SIM_PORT: u16 = 30001;
const SIMS: u16 = 4;

struct Options {
    gateways: u16,
    pd: bool,
    filter: Map<String, Value>,
}

/// Flags of `kvmesh-cp` (sglang-router's) that map onto the filter's configuration.
const NUMERIC: [&str; 11] = [
    "non-cached-tokens",
    "request-timeout-secs",
    "cb-failure-threshold",
    "cb-timeout-duration-secs",
    "cache-threshold",
    "balance-abs-threshold",
    "balance-rel-threshold",
    "eviction-interval-secs",
    "max-tree-size",
    "max-payload-size",
    "block-size",
];

fn parse(args: &[String]) -> anyhow::Result<Options> {
    let mut opts = Options { gateways: 1, pd: false, filter: Map::new() };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--gateways" => {
                let n = it.next().context("--gateways needs a number")?;
                opts.gateways =
                    n.parse().ok().filter(|&n| n >= 1).with_context(|| format!("--gateways {n}: not a number >= 1"))?;
            }
            "--pd" => opts.pd = true,
            "--" => break,
            other => bail!("unknown option `{other}` (router flags go after `--`)"),
        }
    }
    let rest: Vec<&String> = it.collect();
    let mut i = 0;
    while i < rest.len() {
        let flag = rest[i].strip_prefix("--").with_context(|| format!("expected a flag, got `{}`", rest[i]))?;
        i += 1;
        let mut values = Vec::new();
        while i < rest.len() && !rest[i].starts_with("--") {
            values.push(rest[i].clone());
            i += 1;
        }
        let key = flag.replace('-', "_");
        match flag {
            "worker-urls" => {
                opts.filter.insert(key, json!(values));
            }
            "pd-disaggregation" => {
                opts.pd = true;
            }
            "prefill" => {
                let entry = match values.as_slice() {
                    [url] => json!([url, null]),
                    [url, port] if port == "none" => json!([url, null]),
                    [url, port] => json!([
                        url,
                        port.parse::<u16>().with_context(|| format!("--prefill {url} {port}: not a port or `none`"))?
                    ]),
                    _ => bail!("--prefill takes URL [BOOTSTRAP_PORT|none]"),
                };
                push(&mut opts.filter, "prefill", entry);
            }
            "decode" => {
                let [url] = values.as_slice() else { bail!("--decode takes one URL") };
                push(&mut opts.filter, "decode", json!(url));
            }
            "policy" | "prefill-policy" | "decode-policy" | "pd-decider" => {
                let [p] = values.as_slice() else { bail!("--{flag} takes one value") };
                opts.filter.insert(key, json!(p));
            }
            f if NUMERIC.contains(&f) => {
                let [v] = values.as_slice() else { bail!("--{f} takes one value") };
                let n: Value = serde_json::from_str(v)
                    .ok()
                    .filter(Value::is_number)
                    .with_context(|| format!("--{f} {v}: not a number"))?;
                opts.filter.insert(key, n);
            }
            f => bail!("--{f} is a kvmesh-cp flag; the control plane is not part of this build yet"),
        }
    }
    Ok(opts)
}

fn push(filter: &mut Map<String, Value>, key: &str, entry: Value) {
    if let Value::Array(list) = filter.entry(key).or_insert_with(|| json!([])) {
        list.push(entry);
    }
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let opts = parse(args)?;
    ensure_wasm_target()?;
    let envoy_bin = ensure_envoy()?;
    std::env::set_var("ENVOY_BIN", &envoy_bin);
    build()?;

    let mut filter = opts.filter;
    let mut sims = Vec::new();
    let own_workers = ["worker_urls", "prefill", "decode"].iter().any(|k| filter.contains_key(*k));
    if opts.pd {
        filter.insert("pd_disaggregation".into(), json!(true));
    }
    if !own_workers && opts.pd {
        step("starting 2 simulated prefill workers (30001, 30002; bootstrap 8998, 8999) and 2 decode workers (30003, 30004)");
        let mut prefill = Vec::new();
        for (port, boot) in [(30001u16, 8998u16), (30002, 8999)] {
            for p in [port, boot] {
                if !port_free(p) {
                    bail!("port {p} is in use (another `cargo xtask up`?)");
                }
            }
            sims.push(Sim::start_on(
                port,
                &["--role", "prefill", "--bootstrap-port", &boot.to_string(), "--time-scale", "1"],
            )?);
            prefill.push(json!([format!("http://127.0.0.1:{port}"), boot]));
        }
        let mut decode = Vec::new();
        for port in [30003u16, 30004] {
            if !port_free(port) {
                bail!("port {port} is in use (another `cargo xtask up`?)");
            }
            sims.push(Sim::start_on(port, &["--role", "decode", "--time-scale", "1"])?);
            decode.push(json!(format!("http://127.0.0.1:{port}")));
        }
        filter.insert("prefill".into(), json!(prefill));
        filter.insert("decode".into(), json!(decode));
    } else if !own_workers {
        step(&format!("starting {SIMS} simulated workers on ports {FIRST_SIM_PORT}-{}", FIRST_SIM_PORT + SIMS - 1));
        for port in FIRST_SIM_PORT..FIRST_SIM_PORT + SIMS {
            if !port_free(port) {
                bail!("port {port} is in use (another `cargo xtask up`?)");
            }
            sims.push(Sim::start_on(port, &["--time-scale", "1"])?);
        }
        filter.insert("worker_urls".into(), json!(sims.iter().map(Sim::url).collect::<Vec<_>>()));
    }
    let template = if opts.pd { "envoy/envoy-pd.yaml" } else { "envoy/envoy.yaml" };
    let workers_line = ["worker_urls", "prefill", "decode"]
        .iter()
        .filter_map(|k| filter.get(*k).map(|v| format!("{k}: {v}")))
        .collect::<Vec<_>>()
        .join("\n           ");
    let filter = Value::Object(filter);

    let mut gateways = Vec::new();
    for i in 0..opts.gateways {
        let (port, admin) = (GATEWAY_PORT + i, ADMIN_PORT + i);
        for p in [port, admin] {
            if !port_free(p) {
                bail!("port {p} is in use (another Envoy?)");
            }
        }
        step(&format!("starting Envoy with the kvmesh filter on :{port} (admin :{admin})"));
        let mut o = EnvoyOptions::new(filter.clone())?;
        o.template = kvmesh_testkit::repo_root().join(template);
        o.listener_port = port;
        o.admin_port = admin;
        gateways.push(Envoy::start(&o)?);
    }

    println!("\nkvmesh is up.");
    for g in &gateways {
        println!("  gateway  {}    admin {}    config {}", g.url(""), g.admin_url(""), g.config_path.display());
    }
    println!("  workers  {workers_line}");
    if opts.gateways > 1 {
        println!("  note: without the control plane each gateway keeps its own prefix index");
    }
    println!("\nTry:\n  curl -s {}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"kvmesh-sim\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}' -i", gateways[0].url(""));
    println!("  curl -sN {}/generate -d '{{\"text\": \"Once upon a time\", \"stream\": true}}'", gateways[0].url(""));
    println!("\nCtrl-C stops everything.");

    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("cannot install the Ctrl-C handler")?;
    while !stop.load(Ordering::SeqCst) {
        for sim in &mut sims {
            if let Some(status) = sim.proc().exited() {
                bail!("worker {} exited ({status}); stopping\n{}", sim.url(), sim.proc().log_tail());
            }
        }
        for g in &mut gateways {
            if let Some(status) = g.proc().exited() {
                bail!("Envoy exited ({status}); stopping\n{}", g.proc().log_tail());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("\nstopping");
    Ok(())
}
