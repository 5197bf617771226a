//! `cargo xtask test`: every test, in the order CI runs them, after installing what is missing.

use anyhow::bail;

use crate::tools::{
    build, build_crash_wasm, build_naive_filter, build_slow_tick_wasm, cargo, ensure_envoy, ensure_font, ensure_helm,
    ensure_kubectl, ensure_node, ensure_sglang_router, ensure_smg, ensure_valgrind, ensure_wasm_target, lint,
    native_conformance, run_tests, stack_env, step, Totals,
};

/// `cargo xtask test`.
pub fn test(args: &[String]) -> anyhow::Result<()> {
    if let Some(a) = args.first() {
        bail!("`cargo xtask test` takes no arguments (got `{a}`)");
    }
    ensure_wasm_target()?;
    ensure_node()?;
    ensure_valgrind()?;
    ensure_font()?;
    let envoy = ensure_envoy()?;
    let sglang_router = ensure_sglang_router()?;
    let smg = ensure_smg()?;
    let kubectl = ensure_kubectl()?;
    let helm_python = ensure_helm()?;
    lint()?;
    build()?;
    build_naive_filter()?;
    build_crash_wasm()?;
    build_slow_tick_wasm()?;

    step("native tests: core, filter logic, simulator, end to end with real Envoy");
    let mut totals = Totals::default();
    let mut native = cargo();
    native.args(["test", "--workspace"]);
    stack_env(&mut native, &envoy);
    native.env("SGLANG_ROUTER_PYTHON", &sglang_router).env("KVMESH_KUBECTL", &kubectl).env("KVMESH_SMG_BIN", &smg);
    native.env("KVMESH_HELM_PYTHON", &helm_python);
    run_tests(&mut native, &mut totals)?;

    step("the native build's conformance: the end-to-end suites where its host differs from the .wasm's");
    native_conformance(&envoy, &mut totals)?;

    crate::matrix::older_release(&mut totals)?;

    step("routing core tests compiled to wasm32-wasip1 (run under Node's WASI)");
    run_tests(cargo().args(["test", "-p", "kvmesh-core", "--lib", "--target", "wasm32-wasip1"]), &mut totals)?;
    if totals.passed() == 0 {
        bail!("no test ran");
    }
    step("all tests passed");
    // The plain closing line CI reads.
    println!("kvmesh: {} passed, {} failed, {} skipped", totals.passed(), totals.failed(), totals.ignored());
    Ok(())
}
