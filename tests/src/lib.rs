//! Starts the parts of a kvmesh stack as real processes on 127.0.0.1: simulated workers
//! (`kvmesh-sim`) and Envoy running the real filter `.wasm` with a configuration derived from
//! the shipped `envoy/envoy.yaml`. Every process is killed when its handle is dropped.
//!
//! Binaries are found through `KVMESH_SIM_BIN`, `KVMESH_WASM` and `ENVOY_BIN`, else at their
//! build locations under `target/` and `.venv/` (`cargo xtask test` builds them first).

pub mod e2e;
pub mod envoy;
pub mod http;
pub mod kube_fake;
pub mod manifests;
pub mod mtls;
pub mod proc;
pub mod prom;

use std::path::PathBuf;

pub use envoy::{Envoy, EnvoyOptions};
pub use proc::{free_port, wait_until, Proc};

/// A fresh directory under the system's temporary directory, removed with everything in it
/// when dropped: keep it alive as long as a process reads from it.
pub fn scratch_dir(tag: &str) -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix(&format!("kvmesh-{tag}-")).tempdir()?)
}

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

/// The test build of the `.wasm` (feature `test-crash`: a request header traps the VM).
pub fn crash_wasm_path() -> PathBuf {
    bin_from_env("KVMESH_CRASH_WASM", repo_root().join("target/crash/wasm32-wasip1/release/kvmesh_filter.wasm"))
}

/// The control plane binary.
pub fn cp_bin() -> PathBuf {
    bin_from_env("KVMESH_CP_BIN", repo_root().join("target/release/kvmesh-cp"))
}

/// A secret of 32 hex digits (for tests and the local stack; not a cryptographic generator's,
/// but unpredictable enough to stand for one).
pub fn random_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    let part = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(salt);
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
        h.write_u32(std::process::id());
        h.finish()
    };
    format!("{:016x}{:016x}", part(1), part(2))
}

/// A running `kvmesh-cp` on free ports. Unless its flags name their own, it runs with a
/// generated gRPC token (`--grpc-token-file`) and admin API key, which [`ControlPlane::post`]
/// and Envoys configured with [`EnvoyOptions::use_control_plane`] present.
pub struct ControlPlane {
    pub grpc_port: u16,
    pub http_port: u16,
    /// The bearer token the filters present (None: the flags gave none and none was made).
    pub token: Option<String>,
    /// An admin API key.
    pub api_key: Option<String>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    proc: Proc,
}

impl ControlPlane {
    /// Starts `kvmesh-cp` with `args` and waits until its HTTP API answers.
    pub fn start(args: &[&str]) -> anyhow::Result<ControlPlane> {
        Self::start_on(free_port()?, free_port()?, args)
    }

    /// Starts `kvmesh-cp` on the given ports.
    pub fn start_on(grpc_port: u16, http_port: u16, args: &[&str]) -> anyhow::Result<ControlPlane> {
        Self::start_with_env(grpc_port, http_port, args, &[])
    }

    /// Starts `kvmesh-cp` with extra environment variables (e.g. `KUBECONFIG`).
    pub fn start_with_env(
        grpc_port: u16,
        http_port: u16,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<ControlPlane> {
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let value_after =
            |args: &[String], flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
        let given_token = value_after(&args, "--grpc-token-file");
        let given_keys = value_after(&args, "--control-plane-api-keys");
        let token = match given_token {
            Some(path) => Some(std::fs::read_to_string(path)?.trim().to_string()),
            None => {
                let token = random_secret();
                let dir = std::env::temp_dir().join("kvmesh-tokens");
                std::fs::create_dir_all(&dir)?;
                let path = dir.join(format!("cp-{}-{grpc_port}.token", std::process::id()));
                std::fs::write(&path, &token)?;
                args.extend(["--grpc-token-file".to_string(), path.display().to_string()]);
                Some(token)
            }
        };
        let api_key = match given_keys {
            Some(entry) => Some(entry.rsplit(':').next().unwrap_or(&entry).to_string()),
            None => {
                let key = random_secret();
                args.extend(["--control-plane-api-keys".to_string(), format!("admin:kvmesh:admin:{key}")]);
                Some(key)
            }
        };
        let proc = Self::launch(grpc_port, http_port, &args, &env)?;
        let mut cp = ControlPlane { grpc_port, http_port, token, api_key, args, env, proc };
        cp.wait_ready()?;
        Ok(cp)
    }

    /// The flags it runs with, including the generated token file and API key: starting
    /// another one with them keeps the credentials the filters already hold.
    pub fn args(&self) -> &[String] {
        &self.args
    }

    fn launch(grpc_port: u16, http_port: u16, args: &[String], env: &[(String, String)]) -> anyhow::Result<Proc> {
        let mut cmd = std::process::Command::new(cp_bin());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.args(["--host", "127.0.0.1", "--grpc-port", &grpc_port.to_string(), "--http-port", &http_port.to_string()])
            .args(args);
        Proc::spawn("kvmesh-cp", cmd)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let url = self.url("/health");
        let mut exited = None;
        let waited = wait_until("kvmesh-cp to serve", std::time::Duration::from_secs(15), || {
            exited = self.proc.exited();
            exited.is_some() || http::get(&url).map(|r| r.status == 200).unwrap_or(false)
        });
        if let Some(status) = exited {
            anyhow::bail!("kvmesh-cp exited ({status}):\n{}", self.proc.log_tail());
        }
        waited.map_err(|e| e.context(self.proc.log_tail()))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http_port)
    }

    /// `/snapshot` (version, workers, index size).
    pub fn snapshot(&self) -> anyhow::Result<serde_json::Value> {
        http::get(&self.url("/snapshot"))?.json()
    }

    /// The snapshot version once every change made so far has been pushed.
    pub fn settled_version(&self) -> anyhow::Result<u64> {
        let mut version = 0;
        wait_until("kvmesh-cp to push its pending changes", std::time::Duration::from_secs(10), || {
            match self.snapshot() {
                Ok(s) if s["pending"] == false => {
                    version = s["version"].as_u64().unwrap_or(0);
                    true
                }
                _ => false,
            }
        })?;
        Ok(version)
    }

    /// POSTs with the admin API key.
    pub fn post(&self, path_and_query: &str) -> anyhow::Result<http::Response> {
        self.post_body(path_and_query, b"")
    }

    /// POSTs `body` with the admin API key.
    pub fn post_body(&self, path_and_query: &str, body: &[u8]) -> anyhow::Result<http::Response> {
        let auth = self.api_key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
        http::post(&self.url(path_and_query), body, &headers)
    }

    /// `POST /match` with `text` (with the API key, which it needs): which workers hold how
    /// many of its leading blocks.
    pub fn match_text(&self, text: &[u8]) -> anyhow::Result<serde_json::Value> {
        self.match_model(text, None)
    }

    /// `/match` within the pool of `model` (`?model=`).
    pub fn match_model(&self, text: &[u8], model: Option<&str>) -> anyhow::Result<serde_json::Value> {
        let auth = self.api_key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let path = model.map_or("/match".to_string(), |m| format!("/match?model={m}"));
        http::post(&self.url(&path), text, &headers)?.json()
    }

    /// The process's resident memory (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.proc.pid())).ok()?;
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
    }

    /// Kills the process (the ports stay reserved for [`restart`](Self::restart)).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts it again on the same ports with the same flags.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.proc.kill();
        self.proc = Self::launch(self.grpc_port, self.http_port, &self.args, &self.env)?;
        self.wait_ready()
    }

    pub fn proc(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

/// The Envoy binary.
pub fn envoy_bin() -> PathBuf {
    bin_from_env("ENVOY_BIN", repo_root().join(".venv/bin/envoy"))
}

/// A running simulated worker.
pub struct Sim {
    pub host: String,
    pub port: u16,
    /// A prefill worker's bootstrap port, when [`Sim::prefill`] chose it.
    pub bootstrap_port: Option<u16>,
    proc: Proc,
}

impl Sim {
    /// Starts `kvmesh-sim` on a free port with `args` and waits until it answers `/health`.
    pub fn start(args: &[&str]) -> anyhow::Result<Sim> {
        let port = free_port()?;
        Self::start_on(port, args)
    }

    pub fn start_on(port: u16, args: &[&str]) -> anyhow::Result<Sim> {
        Self::start_at("127.0.0.1", port, args)
    }

    /// Starts a sim on another loopback address (127.0.0.x), like a pod with its own IP.
    pub fn start_at(host: &str, port: u16, args: &[&str]) -> anyhow::Result<Sim> {
        let mut cmd = std::process::Command::new(sim_bin());
        cmd.args(["--host", host, "--port", &port.to_string()]).args(args);
        let proc = Proc::spawn(&format!("sim-{host}-{port}"), cmd)?;
        let sim = Sim { host: host.to_string(), port, bootstrap_port: None, proc };
        let url = format!("{}/health", sim.url());
        wait_until(&format!("kvmesh-sim on port {port}"), std::time::Duration::from_secs(10), || {
            http::get(&url).map(|r| r.status == 200).unwrap_or(false)
        })
        .map_err(|e| e.context(sim.proc.log_tail()))?;
        Ok(sim)
    }

    /// `http://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    /// `host:port`, as `x-kvmesh-worker` names it.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The simulator's own counters (`/sim/stats`).
    pub fn stats(&self) -> anyhow::Result<serde_json::Value> {
        http::get(&format!("{}/sim/stats", self.url()))?.json()
    }

    pub fn proc(&mut self) -> &mut Proc {
        &mut self.proc
    }
}
