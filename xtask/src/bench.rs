//! `cargo xtask bench`: kvmesh side by side with the routers a user would otherwise pick (SMG
//! 1.13.0, sglang-router 0.3.2, both from PyPI), the floors (direct to the workers, plain
//! Envoy) and the path a mesh user has today (plain Envoy in front of a peer), in one run, on
//! the same simulated workers and the same load generator. Never part of the tests' timings.
//!
//! Suites: `overhead` (the proxy's cost), `quality` (how warm the routers keep the KV caches),
//! `scale` (micro-benchmarks, control-plane memory, propagation between gateways), and on
//! request only `instructions` (the proxy's instructions per request under valgrind). Each
//! writes `target/bench/<suite>.json`, a markdown table and PNG charts.

pub(crate) mod charts;
mod cp;
mod engine_trace;
mod engine_truth;
mod fairness;
mod instructions;
mod models;
mod overhead;
mod pd_decider;
mod quality;
mod report;
mod routers;
mod scale;
mod stack;
mod trace;
mod workload;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::tools::{build, ensure_envoy, ensure_sglang_router, ensure_smg, ensure_wasm_target, step};
use stack::PeerBins;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    Overhead,
    Quality,
    Scale,
    Instructions,
    Fairness,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::Overhead => "overhead",
            Suite::Quality => "quality",
            Suite::Scale => "scale",
            Suite::Instructions => "instructions",
            Suite::Fairness => "fairness",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Opts {
    pub suites: Vec<Suite>,
    pub quick: bool,
    /// Overhead: seconds measured per configuration.
    pub seconds: f64,
    /// Overhead: connections (the fixed concurrency).
    pub connections: usize,
    /// Overhead: also the PD path.
    pub pd: bool,
    /// Run the peers (off: kvmesh and the floors only).
    pub peers: bool,
    pub out: PathBuf,
    /// Quality: only these workloads (empty: all).
    pub workloads: Vec<String>,
    /// Overhead and quality: only the configurations whose name contains one of these (empty: all).
    pub only: Vec<String>,
    /// Overhead and quality: every configuration is measured this many times, the rounds
    /// interleaved (overhead: the median round's CPU per request; quality: means with a 95 %
    /// confidence interval).
    pub rounds: usize,
    /// Overhead: another build of the filter measured beside this one (1 Envoy thread), for a
    /// before/after in one run.
    pub baseline_wasm: Option<PathBuf>,
    /// Instructions: another build of the native module counted beside this one.
    pub baseline_native: Option<PathBuf>,
    /// Overhead: the proxies on a core of their own (the last one), the load generator and
    /// the workers on the first: CPU per request without the other processes' cache traffic
    /// and preemption in it (for 1-thread comparisons; 2-thread setups then share one core).
    pub pin: bool,
    /// Overhead: experiment builds of the filter, each measured beside this one (1 Envoy
    /// thread), named by their file.
    pub variant_wasm: Vec<PathBuf>,
    /// Instructions: Envoy worker threads (and connections); quality: each kvmesh gateway's.
    pub threads: u32,
    /// Instructions: requests sent before counting.
    pub warmup: usize,
    /// Instructions: requests counted.
    pub requests: usize,
    /// Quality's `trace` workload: the Mooncake-format trace replayed (None: the default file).
    pub trace: Option<PathBuf>,
    /// Quality's `trace` workload: only its first N requests (None: the default size; 0: all).
    pub trace_requests: Option<usize>,
    /// Quality's `trace` workload: the trace's times are divided by this (None: the default).
    pub speed_up: Option<f64>,
    /// Quality's `trace` workload: each worker's KV capacity in tokens (None: the default).
    pub kv_capacity: Option<u64>,
}

impl Opts {
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.seconds)
    }

    /// What `--quick` chooses, before any explicit flag.
    pub fn new(quick: bool) -> Self {
        Self {
            suites: Vec::new(),
            quick,
            seconds: if quick { 1.5 } else { 10.0 },
            connections: 32,
            pd: true,
            peers: true,
            out: report::default_dir(),
            workloads: Vec::new(),
            only: Vec::new(),
            rounds: 1,
            baseline_wasm: None,
            baseline_native: None,
            pin: false,
            variant_wasm: Vec::new(),
            threads: 1,
            warmup: if quick { 30 } else { 300 },
            requests: if quick { 100 } else { 1000 },
            trace: None,
            trace_requests: None,
            speed_up: None,
            kv_capacity: None,
        }
    }

    /// Whether the overhead configuration `name` is measured (`--only`).
    pub fn wants(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| name.contains(o.as_str()))
    }
}

const OPTIONS: &str =
    "overhead | quality | scale (default: all) | instructions (only when named; needs valgrind) | fairness (only when named: tenants and priorities), --quick, --seconds N, --connections N, --no-pd, --no-peers, --out DIR, --workload NAME (quality; repeatable), --only TEXT (overhead, quality: configurations named with it; scale: its parts micro, control-plane, propagation; repeatable), --rounds N (overhead, quality, scale's gateway at 10^6 blocks: each configuration N times, interleaved), --baseline-wasm FILE (overhead, instructions, scale's gateway at 10^6 blocks: that filter build beside this one), --baseline-native FILE (instructions: that native module beside this one), --variant-wasm FILE (overhead, repeatable: an experiment build beside this one, 1 thread), --pin (overhead: the proxy on the last core, everything else on the first), --threads N (instructions, quality: Envoy threads; instructions: as many connections), --warmup N, --requests N (instructions: requests before and while counting), --trace FILE (quality: replay that Mooncake-format trace; implies --workload trace), --trace-requests N (its first N requests; 0: all), --speed-up X (the trace's times divided by X), --kv-capacity TOKENS (each worker's KV cache in the trace workload)";

fn parse(args: &[String]) -> anyhow::Result<Opts> {
    let mut o = Opts::new(args.iter().any(|a| a == "--quick"));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> anyhow::Result<String> {
            it.next().cloned().with_context(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "overhead" => o.suites.push(Suite::Overhead),
            "quality" => o.suites.push(Suite::Quality),
            "scale" | "cp" => o.suites.push(Suite::Scale),
            "instructions" => o.suites.push(Suite::Instructions),
            "fairness" => o.suites.push(Suite::Fairness),
            "pd" => o.suites.push(Suite::Overhead),
            "--quick" => {}
            "--seconds" => {
                let v = value("--seconds")?;
                o.seconds = v
                    .parse()
                    .ok()
                    .filter(|&s: &f64| s > 0.0)
                    .with_context(|| format!("--seconds {v}: not a positive number"))?;
            }
            "--connections" => {
                let v = value("--connections")?;
                o.connections = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .with_context(|| format!("--connections {v}: not a positive number"))?;
            }
            "--no-pd" => o.pd = false,
            "--no-peers" | "--no-sglang" => o.peers = false,
            "--out" => o.out = PathBuf::from(value("--out")?),
            "--workload" => o.workloads.push(value("--workload")?),
            "--only" => o.only.push(value("--only")?),
            "--pin" => o.pin = true,
            "--variant-wasm" => {
                let v = PathBuf::from(value("--variant-wasm")?);
                anyhow::ensure!(v.is_file(), "--variant-wasm {}: no such file", v.display());
                o.variant_wasm.push(v);
            }
            "--baseline-native" => {
                let v = PathBuf::from(value("--baseline-native")?);
                anyhow::ensure!(v.is_file(), "--baseline-native {}: no such file", v.display());
                o.baseline_native = Some(v);
            }
            "--baseline-wasm" => {
                let v = PathBuf::from(value("--baseline-wasm")?);
                anyhow::ensure!(v.is_file(), "--baseline-wasm {}: no such file", v.display());
                o.baseline_wasm = Some(v);
            }
            "--threads" | "--warmup" | "--requests" => {
                let v = value(a)?;
                let n: usize =
                    v.parse().ok().filter(|&n| n > 0).with_context(|| format!("{a} {v}: not a positive number"))?;
                match a.as_str() {
                    "--threads" => o.threads = u32::try_from(n.min(64)).unwrap_or(1),
                    "--warmup" => o.warmup = n,
                    _ => o.requests = n,
                }
            }
            "--trace" => {
                let v = PathBuf::from(value("--trace")?);
                anyhow::ensure!(v.is_file(), "--trace {}: no such file", v.display());
                o.trace = Some(v);
                if !o.workloads.iter().any(|w| w == "trace") {
                    o.workloads.push("trace".into());
                }
            }
            "--trace-requests" => {
                let v = value(a)?;
                o.trace_requests = Some(v.parse().with_context(|| format!("{a} {v}: not a number (0: all)"))?);
            }
            "--speed-up" => {
                let v = value(a)?;
                o.speed_up = Some(
                    v.parse()
                        .ok()
                        .filter(|&s: &f64| s > 0.0 && s.is_finite())
                        .with_context(|| format!("{a} {v}: not a positive number"))?,
                );
            }
            "--kv-capacity" => {
                let v = value(a)?;
                o.kv_capacity =
                    Some(v.parse().ok().filter(|&n| n > 0).with_context(|| format!("{a} {v}: not a positive number"))?);
            }
            "--rounds" => {
                let v = value("--rounds")?;
                o.rounds = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .with_context(|| format!("--rounds {v}: not a positive number"))?;
            }
            other => bail!("unknown bench option `{other}` ({OPTIONS})"),
        }
    }
    if o.suites.is_empty() {
        // A trace to replay and no suite named: the quality suite alone.
        o.suites =
            if o.trace.is_some() { vec![Suite::Quality] } else { vec![Suite::Overhead, Suite::Quality, Suite::Scale] };
    }
    o.suites.dedup();
    Ok(o)
}

/// The peers' launchers, installed when missing.
pub fn peer_bins(peers: bool) -> anyhow::Result<PeerBins> {
    if !peers {
        return Ok(PeerBins::default());
    }
    Ok(PeerBins { smg: Some(ensure_smg()?), sglang_python: Some(ensure_sglang_router()?) })
}

/// The context every suite's JSON starts with.
fn context(o: &Opts, suite: Suite) -> Value {
    json!({
        "suite": suite.name(),
        "command": format!("cargo xtask bench {}", std::env::args().skip(2).collect::<Vec<_>>().join(" ")),
        "commit": report::commit(),
        "quick": o.quick,
        "machine": report::machine(),
        "started_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "peers": {"smg": "1.13.0", "sglang-router": "0.3.2"},
    })
}

/// Runs `suites` into `o.out` (the tests call this with a tiny configuration).
pub fn run_suites(o: &Opts, bins: &PeerBins) -> anyhow::Result<()> {
    for &suite in &o.suites {
        let started = std::time::Instant::now();
        let ctx = context(o, suite);
        let (mut doc, md) = match suite {
            Suite::Overhead => overhead::run(o, bins)?,
            Suite::Quality => quality::run(o, bins)?,
            Suite::Scale => scale::run(o)?,
            Suite::Instructions => instructions::run(o)?,
            Suite::Fairness => fairness::run(o, bins)?,
        };
        if let (Some(d), Some(c)) = (doc.as_object_mut(), ctx.as_object()) {
            for (k, v) in c {
                d.insert(k.clone(), v.clone());
            }
            d.insert("wall_seconds".into(), json!(started.elapsed().as_secs_f64()));
        }
        report::finish(&o.out, suite.name(), &doc, &md)?;
    }
    Ok(())
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let o = parse(args)?;
    let started = std::time::Instant::now();
    ensure_wasm_target()?;
    std::env::set_var("ENVOY_BIN", ensure_envoy()?);
    let bins = peer_bins(o.peers)?;
    build()?;
    crate::tools::build_naive_filter()?;
    if o.suites.contains(&Suite::Instructions) {
        crate::tools::build_slow_tick_wasm()?;
    }
    run_suites(&o, &bins)?;
    step(&format!("benchmarks done in {:.0} s; reports in {}", started.elapsed().as_secs_f64(), o.out.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratios_of(doc: &Value) -> Vec<Value> {
        doc["ratios"].as_array().cloned().unwrap_or_default()
    }

    #[test]
    fn the_trace_options_are_read_and_checked() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let file = kvmesh_testkit::repo_root().join("Cargo.toml");
        let o =
            parse(&args(&format!("--trace {} --trace-requests 50 --speed-up 4 --kv-capacity 65536", file.display())))
                .unwrap();
        assert_eq!(o.suites, [Suite::Quality], "a trace and no suite: quality alone");
        assert_eq!(o.workloads, ["trace"]);
        assert_eq!(
            (o.trace, o.trace_requests, o.speed_up, o.kv_capacity),
            (Some(file), Some(50), Some(4.0), Some(65536))
        );
        assert_eq!(parse(&args("quality --workload trace --trace-requests 0")).unwrap().trace_requests, Some(0));
        for bad in
            ["--speed-up 0", "--speed-up x", "--kv-capacity 0", "--trace /no/such/trace.jsonl", "--trace-requests -1"]
        {
            assert!(parse(&args(&format!("quality {bad}"))).is_err(), "{bad}");
        }
    }

    /// The harness cannot rot: the quick overhead suite at a tiny size (both modes, every
    /// router) runs and writes its JSON with both peers and the ratios. Timings are not checked.
    /// Needs what `cargo xtask test` installs and builds (Envoy, the .wasm, the sims, both peers).
    #[test]
    fn the_quick_overhead_suite_runs_every_router_and_writes_its_json() {
        let root = kvmesh_testkit::repo_root();
        let smg = std::env::var_os("KVMESH_SMG_BIN").map_or(root.join(".venv/smg/bin/smg"), PathBuf::from);
        let python = std::env::var_os("SGLANG_ROUTER_PYTHON").map_or(root.join(".venv/bin/python"), PathBuf::from);
        let bins = PeerBins { smg: Some(smg), sglang_python: Some(python) };
        let out = std::env::temp_dir().join(format!("kvmesh-bench-test-{}", std::process::id()));
        let o =
            Opts { suites: vec![Suite::Overhead], seconds: 0.3, connections: 4, out: out.clone(), ..Opts::new(true) };
        run_suites(&o, &bins).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(out.join("overhead.json")).unwrap()).unwrap();
        let results = doc["results"].as_array().unwrap();
        for mode in ["regular", "pd"] {
            for router in ["kvmesh", "smg", "sglang-router", "envoy+smg", "envoy+sglang-router"] {
                let row = results.iter().find(|r| r["mode"] == mode && r["router"] == router);
                let row = row.unwrap_or_else(|| panic!("no {router} in {mode} mode: {doc:#}"));
                assert!(row["requests_ok"].as_u64().unwrap() > 0, "{row}");
            }
        }
        for router in ["direct", "plain-envoy", "naive-filter", "naive-module", "kvmesh-native"] {
            let row = results.iter().find(|r| r["router"] == router);
            assert!(row.unwrap_or_else(|| panic!("no {router}"))["requests_ok"].as_u64().unwrap() > 0, "{router}");
        }
        // The native build in PD mode too, compared with the peers.
        let native_pd = results.iter().find(|r| r["mode"] == "pd" && r["router"] == "kvmesh-native");
        assert!(native_pd.is_some_and(|r| r["requests_ok"].as_u64().unwrap() > 0), "no native PD row: {doc:#}");
        assert!(ratios_of(&doc).iter().any(|r| r["mode"] == "pd"
            && r["kvmesh"].as_str().is_some_and(|k| k.contains("native"))
            && r["versus_router"] == "sglang-router"));
        // The floors' ratios carry the CPU kvmesh adds over them.
        assert!(ratios_of(&doc).iter().any(|r| r["versus_router"] == "naive-filter" && r["cpu_added_us"].is_number()));
        let ratios = doc["ratios"].as_array().unwrap();
        for peer in ["smg", "sglang-router"] {
            assert!(ratios.iter().any(|r| r["versus_router"] == peer && r["rps_ratio"].as_f64().unwrap() > 0.0));
        }
        assert_eq!(doc["failed_to_start"].as_array().unwrap().len(), 0);
        assert!(doc["commit"].is_string() && doc["machine"]["cores"].as_u64().unwrap() > 0);
        assert!(std::fs::read_to_string(out.join("overhead.md")).unwrap().contains("| kvmesh (1 thread"));
        let _ = std::fs::remove_dir_all(&out);
    }

    /// The instructions suite's harness runs: kvmesh's slow-tick build under callgrind, a few
    /// requests counted, in regular and PD mode. The count must be one request's worth (hundreds of thousands of
    /// instructions): not zero (nothing counted), not Envoy's start-up (billions, when the
    /// counters were not zeroed). Needs valgrind and what `cargo xtask test` builds.
    #[test]
    fn the_instructions_suite_counts_requests_under_callgrind() {
        let out = kvmesh_testkit::scratch_dir("bench-instructions").unwrap();
        let o = Opts {
            suites: vec![Suite::Instructions],
            only: vec!["kvmesh".into()],
            warmup: 5,
            requests: 10,
            out: out.path().to_path_buf(),
            ..Opts::new(true)
        };
        run_suites(&o, &PeerBins::default()).unwrap();
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("instructions.json")).unwrap()).unwrap();
        let results = doc["results"].as_array().unwrap();
        let configs: Vec<&str> = results.iter().map(|r| r["config"].as_str().unwrap()).collect();
        assert_eq!(configs, ["kvmesh", "kvmesh PD"], "{doc:#}");
        for r in results {
            let per_request = r["instructions_per_request"].as_f64().unwrap();
            assert!((100e3..5e6).contains(&per_request), "{}: {per_request} instructions a request", r["config"]);
        }
        let md = std::fs::read_to_string(out.path().join("instructions.md")).unwrap();
        assert!(md.contains("### PD mode") && md.contains("| kvmesh PD |"), "{md}");
    }
}
