//! Starting what is compared: the floors (direct, plain Envoy), kvmesh (Envoy with the filter,
//! one or several gateways sharing one kvmesh-cp), the peers (SMG, sglang-router; one or
//! several replicas) and the mesh path (plain Envoy in front of a peer). Every process is a
//! [`Proc`] or owns one, so everything stops when a [`Running`] is dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use kvmesh_testkit::{free_port, http, repo_root, wait_until, ControlPlane, Envoy, EnvoyOptions, Proc};
use serde_json::{json, Value};

/// In PD mode every router picks the decode worker with power-of-two choices (kvmesh's
/// default; the peers would otherwise use `--policy` for both legs).
pub const PD_DECODE_POLICY: &str = "power_of_two";

/// The workers a router is given.
#[derive(Clone, Debug)]
pub enum Workers {
    Regular(Vec<String>),
    /// Prefill workers with their bootstrap ports, decode workers.
    Pd {
        prefill: Vec<(String, u16)>,
        decode: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Smg,
    SglangRouter,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::Smg => "smg",
            Peer::SglangRouter => "sglang-router",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Peer::Smg => "SMG 1.13.0",
            Peer::SglangRouter => "sglang-router 0.3.2",
        }
    }
}

/// How to start the peers: `smg` (SMG's launcher) and a python with `sglang_router`.
#[derive(Clone, Debug, Default)]
pub struct PeerBins {
    pub smg: Option<PathBuf>,
    pub sglang_python: Option<PathBuf>,
}

/// A started router: where clients send requests, and the processes whose CPU is the proxy's.
pub struct Running {
    pub targets: Vec<SocketAddr>,
    pids: Vec<u32>,
    _envoys: Vec<Envoy>,
    _procs: Vec<Proc>,
    _cp: Option<ControlPlane>,
    /// Envoy admin URLs of the kvmesh gateways (for their statistics).
    pub admin: Vec<String>,
}

impl Running {
    fn new(targets: Vec<SocketAddr>) -> Self {
        Self { targets, pids: Vec::new(), _envoys: Vec::new(), _procs: Vec::new(), _cp: None, admin: Vec::new() }
    }

    fn envoy(&mut self, mut envoy: Envoy) {
        self.pids.push(envoy.proc().pid());
        self.admin.push(envoy.admin_url(""));
        self._envoys.push(envoy);
    }

    fn proc(&mut self, p: Proc) {
        self.pids.push(p.pid());
        self._procs.push(p);
    }

    /// CPU time (user + system) the proxy processes have used so far.
    pub fn cpu(&self) -> Duration {
        self.pids.iter().map(|&p| cpu_time(p)).sum()
    }

    /// Moves every thread of the proxy processes to `cpus` (`--pin`; threads they start
    /// later inherit it).
    pub fn pin(&self, cpus: &str) -> anyhow::Result<()> {
        for &pid in &self.pids {
            pin(pid, cpus)?;
        }
        Ok(())
    }

    /// The control plane the kvmesh gateways share, if any.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self._cp.as_ref()
    }

    /// Takes over another router's processes (the mesh path: Envoy in front of a peer).
    fn absorb(&mut self, other: Running) {
        self.pids.extend(other.pids);
        self._envoys.extend(other._envoys);
        self._procs.extend(other._procs);
    }
}

/// Moves every thread of process `pid` to the CPUs `cpus` (a list: `1`, `0,1`; util-linux
/// `taskset`).
pub fn pin(pid: u32, cpus: &str) -> anyhow::Result<()> {
    let out = Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", cpus, &pid.to_string()])
        .output()
        .context("--pin needs `taskset` (util-linux)")?;
    anyhow::ensure!(
        out.status.success(),
        "taskset could not move process {pid} to CPU {cpus}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// CPU time (user + system) a process has used so far, from `/proc`.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11..13).map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / 100.0)
}

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").trim_end_matches('/').to_string()
}

/// Waits until `POST /generate` through `port` answers 200 (the router knows its workers).
pub(super) fn wait_serving(what: &str, port: u16, alive: impl FnMut() -> bool) -> anyhow::Result<()> {
    let body = json!({"text": "warm up", "sampling_params": {"max_new_tokens": 1}});
    wait_answering(what, port, "/generate", &body, alive)
}

/// Waits until `POST path` with `body` through `port` answers 200, or `alive` says the router
/// exited.
pub(super) fn wait_answering(
    what: &str,
    port: u16,
    path: &str,
    body: &Value,
    mut alive: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let probe = format!("http://127.0.0.1:{port}{path}");
    let mut dead = false;
    wait_until(&format!("{what} to serve"), Duration::from_secs(90), || {
        dead = !alive();
        dead || http::post_json(&probe, body).map(|r| r.status == 200).unwrap_or(false)
    })?;
    anyhow::ensure!(!dead, "{what} exited");
    Ok(())
}

/// Straight to the workers: the floor.
pub fn direct(workers: &[String]) -> Running {
    Running::new(workers.iter().filter_map(|u| host_port(u).parse::<SocketAddr>().ok()).collect())
}

/// Envoy without the filter, round robin over `upstreams` (`ip:port`).
pub fn plain_envoy(upstreams: &[String], threads: u32) -> anyhow::Result<Running> {
    let mut opts = EnvoyOptions::new(json!({"worker_urls": []}))?;
    opts.concurrency = threads;
    opts.plain_upstreams = Some(upstreams.to_vec());
    let envoy = Envoy::start(&opts)?;
    let mut r = Running::new(vec![addr(envoy.port)]);
    r.envoy(envoy);
    Ok(r)
}

/// The reference body-routing filter (`xtask/naive-filter`): Envoy with kvmesh's
/// configuration and static workers, the filter swapped for one that only buffers the body,
/// parses it whole and sets the destination. What any body-routing Wasm filter costs at least.
pub fn naive_filter(urls: &[String], threads: u32) -> anyhow::Result<Running> {
    let mut opts = EnvoyOptions::new(json!({"worker_urls": urls, "probe": naive_probe()}))?;
    opts.concurrency = threads;
    opts.wasm = repo_root().join("target/wasm32-wasip1/release/kvmesh_naive_filter.wasm");
    let mut envoy = Envoy::start(&opts)?;
    let port = envoy.port;
    wait_serving("the naive filter", port, || envoy.proc().exited().is_none())?;
    let mut r = Running::new(vec![addr(port)]);
    r.envoy(envoy);
    Ok(r)
}

/// Profiling only: KVMESH_BENCH_NAIVE_PROBE='{"shared_get": 10}' adds that many host calls of
/// a kind to every request of the naive `.wasm` (xtask/naive-filter's `Probe`), to price each
/// kind (overhead and instructions suites).
pub fn naive_probe() -> Value {
    std::env::var("KVMESH_BENCH_NAIVE_PROBE").ok().and_then(|p| serde_json::from_str(&p).ok()).unwrap_or(Value::Null)
}

/// The same reference filter built natively, as an Envoy dynamic module
/// (`target/release/libkvmesh_naive_filter.so`): what the filter costs without the Wasm VM.
pub fn naive_module(urls: &[String], threads: u32) -> anyhow::Result<Running> {
    native(naive_module_path(), json!({"worker_urls": urls}), threads, false)
}

/// Envoy with a native filter (`module`, a dynamic module) in the Wasm filter's place; `pd`:
/// Envoy's PD template (the prefill callout's cluster).
fn native(module: PathBuf, filter: Value, threads: u32, pd: bool) -> anyhow::Result<Running> {
    let what = module.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut opts = EnvoyOptions::new(filter)?;
    opts.concurrency = threads;
    opts.native_module = Some(module);
    if pd {
        opts.template = repo_root().join("envoy/envoy-pd.yaml");
    }
    let mut envoy = Envoy::start(&opts)?;
    let port = envoy.port;
    wait_serving(&what, port, || envoy.proc().exited().is_none())?;
    let mut r = Running::new(vec![addr(port)]);
    r.envoy(envoy);
    Ok(r)
}

/// Where `cargo xtask bench` builds the native naive filter.
pub fn naive_module_path() -> PathBuf {
    repo_root().join("target/release/libkvmesh_naive_filter.so")
}

/// kvmesh's native build (`kvmesh_module_path`) on static workers, cache_aware: the
/// same filter and configuration as [`kvmesh`] without a control plane, with no Wasm VM.
pub fn kvmesh_native(urls: &[String], threads: u32) -> anyhow::Result<Running> {
    native(kvmesh_module_path(), json!({"worker_urls": urls, "policy": "cache_aware"}), threads, false)
}

/// kvmesh's native build in PD mode on static workers: the filter configuration and the
/// Envoy template [`kvmesh`] uses for PD without a control plane.
pub fn kvmesh_native_pd(prefill: &[(String, u16)], decode: &[String], threads: u32) -> anyhow::Result<Running> {
    native(kvmesh_module_path(), pd_filter(prefill, decode, "cache_aware"), threads, true)
}

/// The filter configuration of PD mode on static workers (SGLang's protocol).
fn pd_filter(prefill: &[(String, u16)], decode: &[String], policy: &str) -> Value {
    json!({
        "pd_disaggregation": true,
        "prefill": prefill.iter().map(|(u, b)| json!([u, b])).collect::<Vec<_>>(),
        "decode": decode,
        "prefill_policy": policy,
        "decode_policy": PD_DECODE_POLICY,
    })
}

/// Where `cargo xtask bench` builds kvmesh's native module (`filter/native`): the filter
/// as an Envoy dynamic module, regular mode on static workers.
pub fn kvmesh_module_path() -> PathBuf {
    repo_root().join("target/release/libkvmesh_native.so")
}

/// kvmesh: `gateways` Envoys with the filter. With a control plane (always when more than one
/// gateway) they share one kvmesh-cp, whose CPU counts too; without, static workers.
pub fn kvmesh(
    workers: &Workers,
    threads: u32,
    gateways: usize,
    policy: &str,
    control_plane: bool,
) -> anyhow::Result<Running> {
    kvmesh_with(workers, threads, gateways, policy, control_plane, None)
}

/// [`kvmesh`] with another build of the filter (`wasm`; None: the one just built).
pub fn kvmesh_with(
    workers: &Workers,
    threads: u32,
    gateways: usize,
    policy: &str,
    control_plane: bool,
    wasm: Option<&std::path::Path>,
) -> anyhow::Result<Running> {
    kvmesh_full(workers, threads, gateways, policy, control_plane, wasm, &[])
}

/// [`kvmesh`] with a control plane given `cp_args` besides the workers (the KV events'
/// subscriptions).
pub fn kvmesh_cp_args(
    workers: &Workers,
    threads: u32,
    gateways: usize,
    policy: &str,
    cp_args: &[String],
) -> anyhow::Result<Running> {
    kvmesh_full(workers, threads, gateways, policy, true, None, cp_args)
}

fn kvmesh_full(
    workers: &Workers,
    threads: u32,
    gateways: usize,
    policy: &str,
    control_plane: bool,
    wasm: Option<&std::path::Path>,
    cp_args: &[String],
) -> anyhow::Result<Running> {
    let mut r = Running::new(Vec::new());
    let pd_template = repo_root().join("envoy/envoy-pd.yaml");
    let cp = if control_plane || gateways > 1 {
        let mut args: Vec<String> = cp_args.to_vec();
        if matches!(workers, Workers::Regular(_)) {
            args.extend(["--policy".into(), policy.into()]);
        }
        match workers {
            Workers::Regular(urls) => {
                args.push("--worker-urls".into());
                args.extend(urls.iter().cloned());
            }
            Workers::Pd { prefill, decode } => {
                args.extend(["--pd-disaggregation".into(), "--prefill-policy".into(), policy.into()]);
                args.extend(["--decode-policy".into(), PD_DECODE_POLICY.into()]);
                for (u, b) in prefill {
                    args.extend(["--prefill".into(), u.clone(), b.to_string()]);
                }
                for u in decode {
                    args.extend(["--decode".into(), u.clone()]);
                }
            }
        }
        let mut cp = ControlPlane::start(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        r.pids.push(cp.proc().pid());
        Some(cp)
    } else {
        None
    };
    for _ in 0..gateways {
        let mut filter = match (workers, &cp) {
            (_, Some(_)) => json!({"worker_urls": [], "policy": policy}),
            (Workers::Regular(urls), None) => json!({"worker_urls": urls, "policy": policy}),
            (Workers::Pd { prefill, decode }, None) => pd_filter(prefill, decode, policy),
        };
        if wasm.is_some() {
            // Another build (a baseline from before the keys existed would refuse them): the
            // filter asks Envoy which worker answered and writes both destination headers,
            // as it did before the keys.
            filter["route_sets_worker_header"] = serde_json::Value::Null;
            filter["original_dst_header"] = serde_json::Value::Null;
        }
        let mut opts = EnvoyOptions::new(filter)?;
        opts.concurrency = threads;
        if let Some(wasm) = wasm {
            opts.wasm = wasm.to_path_buf();
        }
        if matches!(workers, Workers::Pd { .. }) {
            opts.template = pd_template.clone();
        }
        if let Some(cp) = &cp {
            opts.use_control_plane(cp);
        }
        let mut envoy = Envoy::start(&opts)?;
        let port = envoy.port;
        wait_serving("kvmesh", port, || envoy.proc().exited().is_none())?;
        r.targets.push(addr(port));
        r.envoy(envoy);
    }
    r._cp = cp;
    Ok(r)
}

/// `replicas` instances of a peer router over the same workers, each on its own port. SMG's
/// replicas gossip their trees when `mesh` is set (`--enable-mesh --mesh-peer-urls`).
pub fn peer(
    bins: &PeerBins,
    which: Peer,
    workers: &Workers,
    replicas: usize,
    mesh: bool,
    policy: &str,
) -> anyhow::Result<Running> {
    peer_with(bins, which, workers, replicas, mesh, policy, &[])
}

/// As [`peer`], each replica with the flags `extra` too.
pub fn peer_with(
    bins: &PeerBins,
    which: Peer,
    workers: &Workers,
    replicas: usize,
    mesh: bool,
    policy: &str,
    extra: &[&str],
) -> anyhow::Result<Running> {
    let mut r = Running::new(Vec::new());
    let mesh_ports: Vec<u16> = (0..replicas).map(|_| free_port()).collect::<Result<_, _>>()?;
    for i in 0..replicas {
        let port = free_port()?;
        let mut cmd = match which {
            Peer::Smg => {
                let mut c = Command::new(bins.smg.as_ref().context("SMG is not installed")?);
                c.arg("launch");
                c
            }
            Peer::SglangRouter => {
                let mut c = Command::new(bins.sglang_python.as_ref().context("sglang-router is not installed")?);
                c.args(["-m", "sglang_router.launch_router"]);
                c
            }
        };
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--log-level", "warn"]);
        // Every replica needs its own metrics port (both default to 29000).
        cmd.args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port()?.to_string()]);
        match workers {
            Workers::Regular(urls) => {
                cmd.args(["--policy", policy, "--worker-urls"]).args(urls);
            }
            Workers::Pd { prefill, decode } => {
                cmd.args(["--pd-disaggregation", "--prefill-policy", policy, "--decode-policy", PD_DECODE_POLICY]);
                for (u, b) in prefill {
                    cmd.args(["--prefill", u, &b.to_string()]);
                }
                for u in decode {
                    cmd.args(["--decode", u]);
                }
            }
        }
        cmd.args(extra);
        if mesh && which == Peer::Smg && replicas > 1 {
            cmd.args(["--enable-mesh", "--mesh-host", "127.0.0.1", "--mesh-advertise-host", "127.0.0.1"]);
            cmd.args(["--mesh-port", &mesh_ports[i].to_string(), "--mesh-server-name", &format!("smg-{i}")]);
            cmd.arg("--mesh-peer-urls");
            cmd.args(mesh_ports.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, p)| format!("127.0.0.1:{p}")));
        }
        let mut p = Proc::spawn(which.name(), cmd)?;
        wait_serving(which.name(), port, || p.exited().is_none()).map_err(|e| e.context(p.log_tail()))?;
        r.targets.push(addr(port));
        r.proc(p);
    }
    Ok(r)
}

/// The path a mesh user has today: a plain Envoy (ingress) in front of a router.
pub fn mesh_path(router: Running, threads: u32) -> anyhow::Result<Running> {
    let upstreams: Vec<String> = router.targets.iter().map(|a| a.to_string()).collect();
    let mut r = plain_envoy(&upstreams, threads)?;
    wait_serving("Envoy in front of the peer", r.targets[0].port(), || true)?;
    r.absorb(router);
    Ok(r)
}
