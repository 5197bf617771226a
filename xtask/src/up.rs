//! `cargo xtask up`: the local stack — simulated workers, `kvmesh-cp`, and Envoy with the
//! filter, configured from the control plane.

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvmesh_core::settings::PdProtocol;
use kvmesh_testkit::{repo_root, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::json;

use crate::supervise::Supervised;
use crate::tools::{build, build_native, ensure_envoy, ensure_wasm_target, step};

const GATEWAY_PORT: u16 = 10000;
const ADMIN_PORT: u16 = 9901;
const CP_GRPC_PORT: u16 = 18000;
const CP_HTTP_PORT: u16 = 18001;
const FIRST_SIM_PORT: u16 = 30001;

struct Options {
    gateways: u16,
    pd: bool,
    /// The PD protocol the simulated workers and kvmesh-cp speak (`--pd-protocol`).
    pd_protocol: PdProtocol,
    /// Envoy runs the native build (`libkvmesh_native.so`) in place of the `.wasm`.
    native: bool,
    /// Flags for kvmesh-cp (after `--`).
    cp_args: Vec<String>,
}

fn parse(args: &[String]) -> anyhow::Result<Options> {
    let mut opts =
        Options { gateways: 1, pd: false, pd_protocol: PdProtocol::Sglang, native: false, cp_args: Vec::new() };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--gateways" => {
                let n = it.next().context("--gateways needs a number")?;
                opts.gateways = n
                    .parse()
                    .ok()
                    .filter(|&n| (1..=50).contains(&n))
                    .with_context(|| format!("--gateways {n}: not a number from 1 to 50"))?;
            }
            "--pd" => opts.pd = true,
            "--pd-protocol" => {
                let p = it.next().context("--pd-protocol needs sglang, llm-d or vllm")?;
                opts.pd_protocol = p.parse().map_err(|e: String| anyhow::anyhow!("--pd-protocol: {e}"))?;
                opts.pd = true;
            }
            "--native" => opts.native = true,
            "--" => {
                opts.cp_args = it.by_ref().cloned().collect();
            }
            other => bail!("unknown option `{other}` (kvmesh-cp flags go after `--`)"),
        }
    }
    if opts.cp_args.iter().any(|a| a == "--pd-disaggregation" || a == "--prefill" || a == "--decode") {
        opts.pd = true;
    }
    Ok(opts)
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

fn claim(ports: &[u16]) -> anyhow::Result<()> {
    match ports.iter().find(|&&p| !port_free(p)) {
        Some(p) => bail!("port {p} is in use (another `cargo xtask up`?)"),
        None => Ok(()),
    }
}

/// A simulated worker, and how to start it again.
fn supervised_sim(port: u16, args: &[&str]) -> anyhow::Result<Supervised<Sim>> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let start = move || Sim::start_on(port, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let sim = start.clone()()?;
    Ok(Supervised::new(format!("worker http://127.0.0.1:{port}"), sim, Sim::proc, start))
}

/// Starts simulated workers and returns the kvmesh-cp flags naming them.
fn start_sims(pd: Option<PdProtocol>, sims: &mut Vec<Supervised<Sim>>) -> anyhow::Result<Vec<String>> {
    let mut flags = Vec::new();
    if let Some(protocol @ (PdProtocol::LlmD | PdProtocol::Vllm)) = pd {
        let llm_d = protocol == PdProtocol::LlmD;
        let decode = if llm_d { "decode pods with llm-d's sidecar" } else { "decode workers" };
        step(&format!("starting 2 simulated vLLM prefill workers (30001, 30002) and 2 {decode} (30003, 30004)"));
        flags.extend(["--pd-disaggregation", "--pd-protocol", protocol.name()].map(String::from));
        for port in [30001u16, 30002] {
            claim(&[port])?;
            sims.push(supervised_sim(port, &["--engine", "vllm", "--role", "prefill", "--time-scale", "1"])?);
            flags.extend(["--prefill".into(), format!("http://127.0.0.1:{port}"), "none".into()]);
        }
        for port in [30003u16, 30004] {
            claim(&[port])?;
            let sidecar: &[&str] = if llm_d { &["--llm-d-sidecar"] } else { &[] };
            let args = [&["--engine", "vllm", "--role", "decode", "--time-scale", "1"], sidecar].concat();
            sims.push(supervised_sim(port, &args)?);
            flags.extend(["--decode".into(), format!("http://127.0.0.1:{port}")]);
        }
    } else if pd.is_some() {
        step("starting 2 simulated prefill workers (30001, 30002; bootstrap 8998, 8999) and 2 decode workers (30003, 30004)");
        flags.push("--pd-disaggregation".to_string());
        for (port, boot) in [(30001u16, 8998u16), (30002, 8999)] {
            claim(&[port, boot])?;
            let boot_arg = boot.to_string();
            sims.push(supervised_sim(
                port,
                &["--role", "prefill", "--bootstrap-port", &boot_arg, "--time-scale", "1"],
            )?);
            flags.extend(["--prefill".into(), format!("http://127.0.0.1:{port}"), boot_arg]);
        }
        for port in [30003u16, 30004] {
            claim(&[port])?;
            sims.push(supervised_sim(port, &["--role", "decode", "--time-scale", "1"])?);
            flags.extend(["--decode".into(), format!("http://127.0.0.1:{port}")]);
        }
    } else {
        step(&format!("starting 4 simulated workers on ports {FIRST_SIM_PORT}-{}", FIRST_SIM_PORT + 3));
        flags.push("--worker-urls".to_string());
        for port in FIRST_SIM_PORT..FIRST_SIM_PORT + 4 {
            claim(&[port])?;
            sims.push(supervised_sim(port, &["--time-scale", "1"])?);
            flags.push(format!("http://127.0.0.1:{port}"));
        }
    }
    Ok(flags)
}

/// Whether the flags after `--` name the workers (then no simulated ones are started).
fn names_workers(cp_args: &[String]) -> bool {
    cp_args.iter().any(|a| ["--worker-urls", "--prefill", "--decode", "--config"].contains(&a.as_str()))
}

/// The repository's ignored folder for the local stack's state.
const STATE_DIR: &str = ".kvmesh-state";

/// Where kvmesh-cp keeps its state in the local stack: one file per mode (a PD stack's
/// workers have roles a regular kvmesh-cp would not take).
fn state_file(pd: bool) -> PathBuf {
    repo_root().join(STATE_DIR).join(if pd { "kvmesh-cp-pd.json" } else { "kvmesh-cp.json" })
}

/// Whether the flags after `--` give kvmesh-cp a state file: `--state-file`, or a `--config`
/// file with a top-level `state-file` (or `state_file`) key.
fn names_state_file(cp_args: &[String]) -> bool {
    let key_in = |text: &str| {
        text.lines().any(|line| {
            let line = line.strip_prefix(['"', '\'']).unwrap_or(line);
            ["state-file", "state_file"].iter().any(|k| {
                line.strip_prefix(k)
                    .is_some_and(|rest| rest.trim_start_matches(['"', '\'']).trim_start().starts_with(':'))
            })
        })
    };
    let mut it = cp_args.iter();
    while let Some(a) = it.next() {
        if a == "--state-file" || a.starts_with("--state-file=") {
            return true;
        }
        let config = if a == "--config" { it.next().cloned() } else { a.strip_prefix("--config=").map(String::from) };
        if config.and_then(|path| std::fs::read_to_string(path).ok()).is_some_and(|text| key_in(&text)) {
            return true;
        }
    }
    false
}

/// The flags kvmesh-cp runs with: the user's (after `--`), then `sim_flags`, the simulated
/// workers', then `--state-file` under [`STATE_DIR`] unless the user's flags name one, so
/// that a kvmesh-cp the supervisor restarts still has the workers added through its API (as
/// the cluster manifests keep it on a volume).
fn cp_flags(opts: &Options, sim_flags: Vec<String>) -> Vec<String> {
    let mut flags = opts.cp_args.clone();
    flags.extend(sim_flags);
    if !names_state_file(&opts.cp_args) {
        flags.extend(["--state-file".to_string(), state_file(opts.pd).display().to_string()]);
    }
    flags
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let opts = parse(args)?;
    kvmesh_testkit::proc::keep_logs();
    ensure_wasm_target()?;
    let envoy_bin = ensure_envoy()?;
    std::env::set_var("ENVOY_BIN", &envoy_bin);
    build()?;
    let native = opts.native.then(|| repo_root().join("target/release/libkvmesh_native.so"));
    if native.is_some() {
        build_native()?;
    }

    let mut sims = Vec::new();
    let sim_flags = if names_workers(&opts.cp_args) {
        Vec::new()
    } else {
        start_sims(opts.pd.then_some(opts.pd_protocol), &mut sims)?
    };
    let cp_args = cp_flags(&opts, sim_flags);
    let state = (!names_state_file(&opts.cp_args)).then(|| state_file(opts.pd));
    if let Some(dir) = state.as_ref().and_then(|s| s.parent()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    claim(&[CP_GRPC_PORT, CP_HTTP_PORT])?;
    step(&format!("starting kvmesh-cp (gRPC :{CP_GRPC_PORT}, HTTP :{CP_HTTP_PORT}) {}", cp_args.join(" ")));
    let first =
        ControlPlane::start_on(CP_GRPC_PORT, CP_HTTP_PORT, &cp_args.iter().map(String::as_str).collect::<Vec<_>>())?;
    // A restart keeps the generated token and API key (the filters hold the token).
    let restart_cp = {
        let args = first.args().to_vec();
        move || ControlPlane::start_on(CP_GRPC_PORT, CP_HTTP_PORT, &args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let mut cp = Supervised::new("kvmesh-cp", first, ControlPlane::proc, restart_cp);

    let template = if opts.pd { "envoy/envoy-pd.yaml" } else { "envoy/envoy.yaml" };
    // Workers come from the control plane: no static ones that could disagree with it.
    let filter = if opts.pd { json!({"prefill": [], "decode": []}) } else { json!({"worker_urls": []}) };
    let mut gateways = Vec::new();
    for i in 0..opts.gateways {
        let (port, admin) = (GATEWAY_PORT + i, ADMIN_PORT + i);
        claim(&[port, admin])?;
        let what = if native.is_some() { "native build" } else { "filter" };
        step(&format!("starting Envoy with the kvmesh {what} on :{port} (admin :{admin})"));
        let mut o = EnvoyOptions::new(filter.clone())?;
        o.native_module = native.clone();
        o.template = repo_root().join(template);
        o.listener_port = port;
        o.admin_port = admin;
        // The filter presents the control plane's generated token.
        o.use_control_plane(cp.item.as_ref().context("kvmesh-cp is not running")?);
        let envoy = Envoy::start(&o)?;
        wait_until("Envoy to receive the control plane's snapshot", Duration::from_secs(20), || {
            envoy.stat("wasmcustom.kvmesh_snapshot_version").ok().flatten().unwrap_or(0) >= 1
        })?;
        gateways.push(Supervised::new(format!("Envoy :{port}"), envoy, Envoy::proc, move || Envoy::start(&o)));
    }

    println!("\nkvmesh is up.");
    for g in gateways.iter().filter_map(|g| g.item.as_ref()) {
        println!("  gateway        {}    admin {}", g.url(""), g.admin_url(""));
    }
    let cp_now = cp.item.as_ref().context("kvmesh-cp is not running")?;
    println!("  control plane  {}  (/workers, /snapshot, /metrics, POST /add_worker?url=…)", cp_now.url(""));
    if let Some(key) = &cp_now.api_key {
        println!("  admin API key  {key}   (gRPC streams: a generated token, already in every filter's configuration)");
    }
    for w in cp_now.snapshot()?["workers"].as_array().cloned().unwrap_or_default() {
        println!("  worker         {} ({})", w["url"].as_str().unwrap_or("?"), w["role"].as_str().unwrap_or("?"));
    }
    if let Some(state) = &state {
        println!(
            "  state          {}  (the API's workers, kept across restarts; delete it to start over)",
            state.display()
        );
    }
    let url = format!("http://127.0.0.1:{GATEWAY_PORT}");
    println!("\nTry:\n  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\");
    println!(
        "    -d '{{\"model\": \"kvmesh-sim\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}' -i"
    );
    if opts.pd && opts.pd_protocol != PdProtocol::Sglang {
        // vLLM workers serve the OpenAI endpoints only.
        println!("  curl -sN {url}/v1/completions -H 'content-type: application/json' \\");
        println!("    -d '{{\"model\": \"kvmesh-sim\", \"prompt\": \"Once upon a time\", \"stream\": true}}'");
    } else {
        println!("  curl -sN {url}/generate -d '{{\"text\": \"Once upon a time\", \"stream\": true}}'");
    }
    if let Some(key) = &cp_now.api_key {
        println!("\nThe admin API takes the key (reads are open, but for POST /match):");
        println!(
            "  curl -s -X POST -H 'authorization: Bearer {key}' '{}'",
            cp_now.url("/remove_worker?url=http://127.0.0.1:30004")
        );
        println!("  curl -s {}", cp_now.url("/workers"));
    }
    println!("\nA worker, kvmesh-cp or Envoy that exits is restarted, as a Deployment would; Ctrl-C stops everything.");

    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("cannot install the Ctrl-C handler")?;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        let events = sims
            .iter_mut()
            .filter_map(|s| s.check(now))
            .chain(cp.check(now))
            .chain(gateways.iter_mut().filter_map(|g| g.check(now)));
        for event in events.collect::<Vec<_>>() {
            eprintln!("xtask up: {event}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("\nstopping");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    /// The value of `flag` in `flags`, and how many times it is given.
    fn value_of(flags: &[String], flag: &str) -> (Option<String>, usize) {
        let given = flags.iter().filter(|f| *f == flag || f.starts_with(&format!("{flag}="))).count();
        let value = flags.iter().position(|f| f == flag).and_then(|i| flags.get(i + 1)).cloned();
        (value, given)
    }

    #[test]
    fn kvmesh_cp_keeps_its_state_in_the_repository_unless_told_otherwise() {
        let sims = args(&["--worker-urls", "http://127.0.0.1:30001"]);
        let state = |file: &str| repo_root().join(".kvmesh-state").join(file).display().to_string();
        let flags = cp_flags(&parse(&[]).unwrap(), sims.clone());
        assert_eq!(value_of(&flags, "--state-file"), (Some(state("kvmesh-cp.json")), 1), "{flags:?}");
        assert!(flags.ends_with(&sims) || flags.starts_with(&sims), "{flags:?}");
        // PD mode keeps its own (its workers have roles a regular kvmesh-cp has not).
        let flags = cp_flags(&parse(&args(&["--pd"])).unwrap(), Vec::new());
        assert_eq!(value_of(&flags, "--state-file"), (Some(state("kvmesh-cp-pd.json")), 1), "{flags:?}");
        // The user's own state file wins, however it is given.
        let flags = cp_flags(&parse(&args(&["--", "--state-file", "/tmp/mine.json"])).unwrap(), sims.clone());
        assert_eq!(value_of(&flags, "--state-file"), (Some("/tmp/mine.json".into()), 1), "{flags:?}");
        let flags = cp_flags(&parse(&args(&["--", "--state-file=/tmp/mine.json"])).unwrap(), sims.clone());
        assert_eq!(value_of(&flags, "--state-file"), (None, 1), "{flags:?}");
        // ... also in a --config file.
        let dir = std::env::temp_dir().join(format!("xtask-up-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("cp.yaml");
        for (text, ours) in [("policy: random\nstate_file: /tmp/kept.json\n", false), ("policy: random\n", true)] {
            std::fs::write(&config, text).unwrap();
            let flags = cp_flags(&parse(&args(&["--", "--config", config.to_str().unwrap()])).unwrap(), Vec::new());
            assert_eq!(value_of(&flags, "--state-file").1, usize::from(ours), "{text}: {flags:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
