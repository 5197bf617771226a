//! Starts the parts of a kvmesh stack as real processes on 127.0.0.1: simulated workers
//! (`kvmesh-sim`) and Envoy running the real filter `.wasm` with a configuration derived from
//! the shipped `envoy/envoy.yaml`. Every process is killed when its handle is dropped.
//!
//! Binaries are found through `KVMESH_SIM_BIN`, `KVMESH_WASM` and `ENVOY_BIN`, else at their
//! build locations under `target/` and `.venv/` (`cargo xtask test` builds them first).

pub mod envoy;
pub mod http;
pub mod proc;

use std::path::PathBuf;

pub use envoy::{Envoy, EnvoyOptions};
pub use proc::{free_port, wait_until, Proc};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

fn bin_from_env(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

/// The simulated worker binary.
pub fn sim_bin() -> PathBuf {
    bin_from_env("KVMESH_SIM_BIN", repo_root().join("target/release/kvmesh-sim"))
}

/// The filter's `.wasm`.
pub fn wasm_path() -> PathBuf {
    bin_from_env("KVMESH_WASM", repo_root().join("target/wasm32-wasip1/release/kvmesh_filter.wasm"))
}

/// The Envoy binary.
pub fn envoy_bin() -> PathBuf {
    bin_from_env("ENVOY_BIN", repo_root().join(".venv/bin/envoy"))
}

/// A running simulated worker.
pub struct Sim {
    pub port: u16,
    proc: Proc,
}

impl Sim {
    /// Starts `kvmesh-sim` on a free port with `args` and waits until it answers `/health`.
    pub fn start(args: &[&str]) -> anyhow::Result<Sim> {
        let port = free_port()?;
        Self::start_on(port, args)
    }

    pub fn start_on(port: u16, args: &[&str]) -> anyhow::Result<Sim> {
        let mut cmd = std::process::Command::new(sim_bin());
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]).args(args);
        let proc = Proc::spawn(&format!("sim-{port}"), cmd)?;
        let sim = Sim { port, proc };
        let url = format!("{}/health", sim.url());
        wait_until(&format!("kvmesh-sim on port {port}"), std::time::Duration::from_secs(10), || {
            http::get(&url).map(|r| r.status == 200).unwrap_or(false)
        })
        .map_err(|e| e.context(sim.proc.log_tail()))?;
        Ok(sim)
    }

    /// `http://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:port`, as `x-kvmesh-worker` names it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The simulator's own counters (`/sim/stats`).
    pub fn stats(&self) -> anyhow::Result<serde_json::Value> {
        http::get(&format!("{}/sim/stats", self.url()))?.json()
    }

    pub fn proc(&mut self) -> &mut Proc {
        &mut self.proc
    }
}
