//! What the end-to-end tests share: requests through a gateway and the worker that served
//! them, control planes over simulated workers and gateways on them, and the PD and native
//! variants of both.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::{self, Response};
use crate::{free_port, repo_root, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};

/// Simulator flags: answer as fast as possible.
pub const FAST: &[&str] = &["--time-scale", "0"];

/// Simulator flags: a token every 20 ms in real time whatever the batch, so that
/// `max_new_tokens` sets how long a request holds its place.
pub const DECODE_20MS: &[&str] = &["--time-scale", "1", "--decode-ms-per-token", "20", "--batch-slowdown", "0"];

/// A bound for something that takes well under a second, so wide that only a hang exceeds it:
/// tests that use it make the wait they rule out (a worker's or a queue's timeout) longer.
pub const HANG: Duration = Duration::from_secs(20);

/// `POST /generate` of `text` for one new token.
pub fn generate(envoy: &Envoy, text: &str) -> Response {
    generate_tokens(envoy, text, 1)
}

/// `POST /generate` of `text` for `tokens` new tokens.
pub fn generate_tokens(envoy: &Envoy, text: &str, tokens: u32) -> Response {
    let body = json!({"text": text, "sampling_params": {"max_new_tokens": tokens}});
    http::post_json(&envoy.url("/generate"), &body).unwrap()
}

/// The worker that answered `r`, whatever the status: the gateway's `x-kvmesh-worker` must
/// name the worker the simulator says it is (`x-sim-worker`).
pub fn worker_of(r: &Response) -> String {
    let w = r.header("x-kvmesh-worker").unwrap_or_else(|| panic!("no worker header: {} {}", r.status, r.text()));
    assert_eq!(Some(w), r.header("x-sim-worker"), "the gateway names the worker that answered");
    w.to_string()
}

/// The worker that served `r`, a 200 (see [`worker_of`]).
pub fn served(r: &Response) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    worker_of(r)
}

/// POSTs `body` to `url` in a thread; returns the response and when it was complete.
pub fn post_in_thread(url: &str, body: Value) -> std::thread::JoinHandle<(Response, Instant)> {
    let url = url.to_string();
    std::thread::spawn(move || {
        let r = http::post_json(&url, &body).unwrap();
        (r, Instant::now())
    })
}

/// `n` simulated workers started with `args`.
pub fn sims(n: usize, args: &[&str]) -> Vec<Sim> {
    (0..n).map(|_| Sim::start(args).unwrap()).collect()
}

/// `kvmesh-cp` over `sims` (`--worker-urls`), with `flags`.
pub fn control_plane(sims: &[Sim], flags: &[&str]) -> ControlPlane {
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let mut args = vec!["--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    args.extend(flags);
    ControlPlane::start(&args).unwrap()
}

/// An Envoy whose filter has no static workers (everything comes from `cp`), once it has
/// applied a first snapshot.
pub fn gateway(cp: &ControlPlane) -> Envoy {
    gateway_with(cp, EnvoyOptions::new(json!({"worker_urls": []})).unwrap())
}

/// An Envoy started with `opts` on `cp`, once it has applied a first snapshot.
pub fn gateway_with(cp: &ControlPlane, mut opts: EnvoyOptions) -> Envoy {
    opts.use_control_plane(cp);
    let envoy = Envoy::start(&opts).unwrap();
    envoy.wait_for_version(1);
    envoy
}

/// Waits until `envoy` has applied everything `cp` has pushed so far.
pub fn sync(cp: &ControlPlane, envoy: &Envoy) {
    envoy.wait_for_version(cp.settled_version().unwrap());
}

/// kvmesh's native build (`target/release/libkvmesh_native.so`), or `KVMESH_NATIVE_MODULE`
/// (`cargo xtask matrix`: the build for another Envoy release's ABI).
pub fn native_module() -> PathBuf {
    match std::env::var_os("KVMESH_NATIVE_MODULE").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => repo_root().join("target/release/libkvmesh_native.so"),
    }
}

/// Options for the shipped PD configuration (`envoy/envoy-pd.yaml`) with `filter` settings,
/// on the native build when `native`.
pub fn pd_options(filter: Value, native: bool) -> EnvoyOptions {
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    if native {
        opts.native_module = Some(native_module());
    }
    opts
}

impl Sim {
    /// A prefill worker whose bootstrap server listens on a free port
    /// ([`bootstrap_port`](Sim::bootstrap_port)), started with `args` after its role.
    pub fn prefill(args: &[&str]) -> anyhow::Result<Sim> {
        let boot = free_port()?;
        let mut sim = Sim::start(&[&["--role", "prefill", "--bootstrap-port", &boot.to_string()], args].concat())?;
        sim.bootstrap_port = Some(boot);
        Ok(sim)
    }

    /// A decode worker started with `args` after its role.
    pub fn decode(args: &[&str]) -> anyhow::Result<Sim> {
        Sim::start(&[&["--role", "decode"], args].concat())
    }
}

/// A prefill worker at time scale 0.
pub fn fast_prefill() -> Sim {
    Sim::prefill(FAST).unwrap()
}

/// A decode worker at time scale 0 that waits at most 3 s for a KV, fetched from `default`'s
/// bootstrap server when a request names no port.
pub fn fast_decode(default: Option<&Sim>) -> Sim {
    let boot = default.and_then(|p| p.bootstrap_port).map(|p| p.to_string());
    let mut args = vec!["--time-scale", "0", "--bootstrap-timeout-ms", "3000"];
    if let Some(boot) = &boot {
        args.extend(["--default-bootstrap-port", boot]);
    }
    Sim::decode(&args).unwrap()
}

impl ControlPlane {
    /// `GET /workers`.
    pub fn workers(&self) -> Vec<Value> {
        http::get(&self.url("/workers")).unwrap().json().unwrap().as_array().cloned().unwrap_or_default()
    }

    /// The `/workers` entry of the worker at `url` (null when it is not listed).
    pub fn worker(&self, url: &str) -> Value {
        self.workers().into_iter().find(|w| w["url"] == url).unwrap_or(Value::Null)
    }

    /// `GET /metrics`.
    pub fn metrics(&self) -> String {
        http::get(&self.url("/metrics")).unwrap().text()
    }

    /// The first sample named `name` in `/metrics` (see [`crate::prom::value`]).
    pub fn metric(&self, name: &str) -> Option<f64> {
        crate::prom::value(&self.metrics(), name)
    }

    /// The sample of the per-worker series `name` for the worker at `url`.
    pub fn worker_metric(&self, name: &str, url: &str) -> Option<f64> {
        let prefix = format!("{name}{{worker=\"{url}\"");
        self.metrics().lines().find(|l| l.starts_with(&prefix))?.rsplit(' ').next()?.parse().ok()
    }

    /// The URL of the worker `/match` finds holding the most of `text`.
    pub fn holder(&self, text: &str) -> Option<String> {
        let m = self.match_text(text.as_bytes()).unwrap();
        m[0]["url"].as_str().map(String::from)
    }
}

impl Envoy {
    /// A filter statistic (`wasmcustom.<name>`; 0 when absent).
    pub fn filter_stat(&self, name: &str) -> u64 {
        self.stat(&format!("wasmcustom.{name}")).unwrap().unwrap_or(0)
    }

    /// The control-plane snapshot version the filter has applied (0: none).
    pub fn version(&self) -> u64 {
        self.filter_stat("kvmesh_snapshot_version")
    }

    /// Waits until the filter has applied snapshot version `v` or later.
    pub fn wait_for_version(&self, v: u64) {
        wait_until(&format!("envoy to apply snapshot version {v}"), Duration::from_secs(20), || self.version() >= v)
            .unwrap();
    }

    /// Requests in flight through this Envoy (`kvmesh_in_flight`, all VMs); None while its
    /// admin endpoint does not answer.
    pub fn in_flight(&self) -> Option<u64> {
        self.stat("wasmcustom.kvmesh_in_flight").ok().flatten()
    }

    /// Waits until `n` requests wait in the filter's admission queue (`kvmesh_queued`, all
    /// VMs).
    pub fn wait_for_queued(&self, n: u64) {
        wait_until(&format!("{n} request(s) in the queue"), Duration::from_secs(10), || {
            self.stat("wasmcustom.kvmesh_queued").ok().flatten() == Some(n)
        })
        .unwrap();
    }

    /// The `ip:port`s of the workers' cluster that Envoy lists healthy (`/clusters`).
    pub fn healthy_endpoints(&self) -> Vec<String> {
        let text = http::get(&self.admin_url("/clusters")).map(|r| r.text()).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.strip_prefix("kvmesh_workers::")?.strip_suffix("::health_flags::healthy"))
            .map(String::from)
            .collect()
    }

    /// Filter cache hits so far.
    pub fn cache_hits(&self) -> u64 {
        self.filter_stat("kvmesh_cache_hits_total")
    }
}
