//! The Istio and Kubernetes install (`istio/`), checked without a cluster:
//!
//! - every YAML document under `istio/` parses, and every kustomization renders with the real
//!   `kubectl kustomize` (installed into `.venv` by `cargo xtask test`);
//! - Istio resources validate against Istio 1.30.3's CRD OpenAPI schemas (`istio/schemas/`);
//! - Kubernetes objects deserialise into `k8s-openapi` types with no field left over;
//! - the names that tie the pieces together agree (clusters, ports, labels, selectors);
//! - the gateway's EnvoyFilters, turned into the Envoy configuration istiod and istio-agent
//!   would hand the proxy (the filter through ECDS, the workers' cluster with override_host),
//!   run in a real Envoy with the real filter, in front of the real `kvmesh-cp` started from the
//!   ConfigMap's configuration and discovering the example Deployment's pods from an
//!   in-process Kubernetes API; the Istio 1.27 and sidecar variants pass `envoy --mode validate`.
//!
//! The schema, type and name checks are `kvmesh_testkit::manifests` (tests/src/manifests.rs),
//! which the Helm chart's tests (helm.rs) share. What needs a cluster (istiod applying the
//! patches, istio-agent pulling the image, mTLS) is listed in docs/istio.md.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvmesh_testkit::kube_fake::{pod, FakeKube};
use kvmesh_testkit::manifests::{
    check, check_ties, core_errors, discovered_role, filter_json_at, find, istio_dir, kustomize, labels, load, name,
    patches, schema_errors, selector, Place, DYNAMIC_MODULE_FILTER, POD_CIDR_PLACEHOLDER, TOKEN_PLACEHOLDER,
};
use kvmesh_testkit::{envoy_bin, free_port, http, repo_root, wait_until, wasm_path, ControlPlane, Proc, Sim};
use serde_json::{json, Value};

const WORKERS_CLUSTER: &str = "outbound|8000||sglang-workers.kvmesh.svc.cluster.local";
const CP_CLUSTER: &str = "outbound|18000||kvmesh-cp.kvmesh.svc.cluster.local";

/// Every `.yaml` file under `istio/`.
fn yaml_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&istio_dir(), &mut out);
    out
}

/// The folders users install with `kubectl kustomize DIR | kubectl apply -f -`.
const KUSTOMIZATIONS: [&str; 9] = [
    "overlays/regular",
    "overlays/native",
    "overlays/multi-model",
    "overlays/pd",
    "overlays/pd-vllm",
    "overlays/pd-llm-d",
    "istio-1.27",
    "examples/sidecar",
    "examples/wasmplugin",
];

/// Every object users can apply: the rendered kustomizations.
fn installable() -> Vec<(String, Vec<Value>)> {
    KUSTOMIZATIONS.iter().map(|d| (d.to_string(), kustomize(d))).collect()
}

#[test]
fn every_manifest_parses_and_every_kustomization_renders() {
    let files = yaml_files();
    assert!(files.len() >= 15, "found only {} YAML files under istio/", files.len());
    for path in &files {
        let docs = load(path);
        assert!(!docs.is_empty(), "{}: no document", path.display());
        for d in &docs {
            assert!(d.get("kind").and_then(Value::as_str).is_some(), "{}: a document without `kind`", path.display());
        }
    }
    for dir in KUSTOMIZATIONS {
        let objs = kustomize(dir);
        let names: HashSet<String> =
            objs.iter().map(|o| format!("{}/{}", name(o), o["metadata"]["namespace"])).collect();
        assert_eq!(names.len(), objs.len(), "istio/{dir} renders an object twice");
    }
}

#[test]
fn istio_resources_match_the_crd_schemas_and_core_objects_their_types() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (source, objs) in installable() {
        for obj in &objs {
            checked += 1;
            for e in check(obj) {
                failures.push(format!("{source}: {}: {e}", name(obj)));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 20, "checked only {checked} objects");
}

#[test]
fn the_checks_catch_mistakes() {
    // A misspelt EnvoyFilter field, a wrong enum value, a misspelt Deployment field: each must
    // be refused, or the checks above prove nothing.
    let envoy_filter = load(&istio_dir().join("base/envoyfilter-gateway.yaml")).remove(0);
    let mut bad = envoy_filter.clone();
    bad["spec"]["configPatch"] = bad["spec"]["configPatches"].clone();
    assert!(!schema_errors(&bad).is_empty(), "a misspelt EnvoyFilter field passed");
    let mut bad = envoy_filter;
    bad["spec"]["configPatches"][0]["patch"]["operation"] = json!("APPEND");
    assert!(!schema_errors(&bad).is_empty(), "an unknown patch operation passed");

    let deployment =
        load(&istio_dir().join("base/control-plane.yaml")).into_iter().find(|o| o["kind"] == "Deployment").unwrap();
    let mut bad = deployment.clone();
    bad["spec"]["replica"] = json!(2);
    let errors = core_errors(&bad);
    assert!(errors.len() == 1 && errors[0].contains("replica"), "{errors:?}");
    let mut bad = deployment;
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = json!(["Always"]);
    assert!(!core_errors(&bad).is_empty(), "a list where a string belongs passed");
}

#[test]
fn the_names_that_tie_the_install_together_agree() {
    for (dir, worker_deployments) in [
        ("overlays/regular", 1),
        ("overlays/native", 1),
        ("overlays/multi-model", 2),
        ("overlays/pd", 2),
        ("overlays/pd-vllm", 2),
        ("overlays/pd-llm-d", 2),
    ] {
        let objs = kustomize(dir);
        let place = Place { namespace: "kvmesh", cluster_domain: "cluster.local", trust_domain: "cluster.local" };
        let (filter, cfg) = check_ties(dir, &objs, &place);
        assert_eq!(filter["upstream_cluster"], WORKERS_CLUSTER, "{dir}");
        assert_eq!(filter["control_plane_cluster"], CP_CLUSTER, "{dir}");
        assert_eq!(filter["control_plane_token"], TOKEN_PLACEHOLDER, "{dir}");
        let policy = find(&objs, "AuthorizationPolicy", "kvmesh-cp");
        assert_eq!(policy["spec"]["rules"][1]["from"], json!([{"source": {"namespaces": ["kvmesh"]}}]), "{dir}");
        // kvmesh-cp takes workers in the pod network only (the placeholder is replaced at
        // install, as the token is).
        assert_eq!(cfg["worker-cidrs"], json!([POD_CIDR_PLACEHOLDER]), "{dir}");
        let workers = find(&objs, "Service", "sglang-workers");
        assert_eq!(workers["spec"]["ports"][0]["port"], 8000);
        let service_selector: BTreeMap<String, String> =
            serde_json::from_value(workers["spec"]["selector"].clone()).unwrap();
        let deployments: Vec<&Value> =
            objs.iter().filter(|o| o["kind"] == "Deployment" && labels(o).contains_key("kvmesh.io/worker")).collect();
        assert_eq!(deployments.len(), worker_deployments, "{dir}: the example workers");
        for d in &deployments {
            let l = labels(d);
            for (k, v) in
                selector(&cfg, "selector").iter().chain(&service_selector.clone().into_iter().collect::<Vec<_>>())
            {
                assert_eq!(l.get(k), Some(v), "{dir}: {} lacks the label {k}={v}", name(d));
            }
            let port = &d["spec"]["template"]["spec"]["containers"][0]["ports"][0];
            assert_eq!(port["containerPort"], 8000, "{dir}: {}", name(d));
        }
        // The filter's plugin JSON is one the filter accepts.
        let plugin = serde_json::to_vec(&filter).unwrap();
        if let Err(e) = kvmesh_core::Config::from_json(&plugin) {
            panic!("{dir}: the filter would refuse its configuration: {e}");
        }
        if dir.starts_with("overlays/pd") {
            // PD on in both (check_ties: with the same protocol), and discovery gives each
            // example Deployment the role its name says.
            assert_eq!(cfg["pd-disaggregation"], true, "{dir}");
            assert_eq!(filter["pd_disaggregation"], true, "{dir}");
            let protocol = cfg["pd-protocol"].as_str().unwrap_or("sglang");
            assert_eq!(filter["pd_protocol"].as_str().unwrap_or("sglang"), protocol, "{dir}");
            let want = match dir {
                "overlays/pd-vllm" => "vllm",
                "overlays/pd-llm-d" => "llm-d",
                _ => "sglang",
            };
            assert_eq!(protocol, want, "{dir}");
            for d in &deployments {
                let role = discovered_role(&cfg, &labels(d));
                let n = d["metadata"]["name"].as_str().unwrap();
                let expected = if n.ends_with("-prefill") { "prefill" } else { "decode" };
                assert_eq!(role, Some(expected), "{dir}: discovery would not make {n} a {expected} worker");
                if protocol != "sglang" {
                    // vLLM's KV transfer is configured on every vLLM container.
                    let containers = d["spec"]["template"]["spec"]["containers"].as_array().unwrap();
                    let vllm = containers.iter().find(|c| c["name"] == "vllm").expect("a vllm container");
                    assert!(vllm["args"].to_string().contains("--kv-transfer-config="), "{dir}: {n}");
                }
            }
        }
        if dir == "overlays/native" {
            native_ties(&objs, &filter);
        }
        if dir == "overlays/multi-model" {
            // Two models behind the one gateway: each model's own Service selects its pods
            // only, and routing by model is on.
            assert_eq!(cfg["enable-igw"], true, "{dir}");
            for model in ["llama", "qwen"] {
                let svc = find(&objs, "Service", model);
                let sel: BTreeMap<String, String> = serde_json::from_value(svc["spec"]["selector"].clone()).unwrap();
                let selected: Vec<String> = deployments
                    .iter()
                    .filter(|d| sel.iter().all(|(k, v)| labels(d).get(k) == Some(v)))
                    .map(|d| name(d))
                    .collect();
                assert_eq!(selected, [format!("Deployment/vllm-{model}")], "{dir}: the {model} Service");
            }
        }
        if dir == "overlays/pd" {
            let role_label = cfg["role-label"].as_str().unwrap();
            let annotation = cfg["bootstrap-port-annotation"].as_str().unwrap();
            let prefill = find(&objs, "Deployment", "sglang-prefill");
            assert_eq!(labels(prefill).get(role_label).map(String::as_str), Some("prefill"));
            let port = prefill["spec"]["template"]["metadata"]["annotations"][annotation].as_str().unwrap();
            let args = prefill["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
            assert!(args.contains(&format!("--disaggregation-bootstrap-port={port}")), "{args}");
            assert_eq!(
                labels(find(&objs, "Deployment", "sglang-decode")).get(role_label).map(String::as_str),
                Some("decode")
            );
        }
    }
    // Every variant of the filter asks for the body, and is told no client picks its worker.
    for (file, doc) in [("istio-1.27/envoyfilter-gateway.yaml", 0), ("examples/sidecar/kvmesh-sidecar.yaml", 0)] {
        let ef = &load(&istio_dir().join(file))[doc];
        let text = serde_json::to_string(ef).unwrap();
        assert!(text.contains("\"allow_on_headers_stop_iteration\":true"), "{file}");
        assert!(
            text.contains("x-gateway-destination-endpoint") && text.contains("x-envoy-original-dst-host"),
            "{file}"
        );
    }
    let plugin = std::fs::read_to_string(istio_dir().join("examples/wasmplugin/kvmesh-wasmplugin.yaml")).unwrap();
    assert!(plugin.starts_with("# NOT ENOUGH ON ITS OWN"), "the WasmPlugin file must state its limitation first");
}

/// The native overlay: the module reaches Envoy where it looks for it, the filter inserted
/// before the router takes the dynamic-modules type, and the module's own control-plane
/// connection goes through the loopback listener to kvmesh-cp's mTLS cluster.
fn native_ties(objs: &[Value], filter: &Value) {
    let gateway = &find(objs, "Deployment", "kvmesh-gateway")["spec"]["template"]["spec"];
    let proxy = gateway["containers"].as_array().unwrap().iter().find(|c| c["name"] == "istio-proxy").unwrap();
    let search = proxy["env"].as_array().unwrap().iter().find(|e| e["name"] == "ENVOY_DYNAMIC_MODULES_SEARCH_PATH");
    let search = search.expect("Envoy's module search path")["value"].as_str().unwrap();
    let mount_of = |mounts: &Value, path: &str| {
        mounts.as_array().unwrap().iter().find(|m| m["mountPath"] == path).map(|m| m["name"].clone())
    };
    let volume = mount_of(&proxy["volumeMounts"], search).expect("the search path is a volume");
    let init = &gateway["initContainers"][0];
    let copied_to = init["command"].as_array().unwrap().last().unwrap().as_str().unwrap();
    let (dir, file) = copied_to.rsplit_once('/').unwrap();
    assert_eq!(file, "libkvmesh_native.so", "Envoy loads lib<name>.so for the name kvmesh_native");
    assert_eq!(mount_of(&init["volumeMounts"], dir), Some(volume.clone()), "the module lands in the proxy's volume");
    assert!(gateway["volumes"].as_array().unwrap().iter().any(|v| v["name"] == volume && v["emptyDir"].is_object()));
    assert!(init["image"].as_str().unwrap().ends_with("-envoy1.39"), "Istio 1.31's Envoy: {}", init["image"]);

    let ef = find(objs, "EnvoyFilter", "kvmesh-gateway");
    let inserted = ef["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["patch"]["value"]["name"] == "kvmesh.filter" && p["applyTo"] == "HTTP_FILTER");
    assert_eq!(inserted.unwrap()["patch"]["value"]["config_discovery"]["type_urls"], json!([DYNAMIC_MODULE_FILTER]));
    let link = find(objs, "EnvoyFilter", "kvmesh-gateway-cp-link");
    let listener = &patches(link, "LISTENER").next().unwrap()["patch"]["value"];
    let socket = &listener["address"]["socket_address"];
    assert_eq!(socket["address"], "127.0.0.1", "the link is the gateway pod's own");
    let address = format!("http://127.0.0.1:{}", socket["port_value"]);
    assert_eq!(filter["control_plane_address"], address, "the module dials the link");
    let proxy = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(proxy["cluster"], CP_CLUSTER, "the link leads to kvmesh-cp over the mesh");
}

// ---- The gateway's Envoy configuration, built from the EnvoyFilters ----

/// Istio's EnvoyFilter MERGE (protobuf merge): messages merge field by field, lists append,
/// everything else is replaced.
fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        a.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => a.extend(b.iter().cloned()),
        (slot, v) => *slot = v.clone(),
    }
}

struct Gateway {
    dir: tempfile::TempDir,
    listener_port: u16,
    admin_port: u16,
    /// Where Envoy fetches a module itself (Istio 1.27's inline filter): URL and sha256.
    /// Without it, the module is given as a local file.
    module_url: Option<(String, String)>,
}

impl Gateway {
    fn new(tag: &str) -> Gateway {
        let dir = kvmesh_testkit::scratch_dir(&format!("istio-{tag}")).unwrap();
        Gateway { dir, listener_port: free_port().unwrap(), admin_port: free_port().unwrap(), module_url: None }
    }

    fn write(&self, file: &str, value: &Value) -> PathBuf {
        let path = self.dir.path().join(file);
        std::fs::write(&path, serde_json::to_string_pretty(value).unwrap()).unwrap();
        path
    }
}

/// What istio-agent does to a remote module once it has pulled it: a local file.
fn fetched_locally(wasm_config: &mut Value) {
    assert!(wasm_config["vm_config"]["code"]["remote"].is_object(), "the module should be remote");
    wasm_config["vm_config"]["code"] = json!({"local": {"filename": wasm_path().display().to_string()}});
}

fn with_token(wasm_config: &mut Value, token: &str) {
    let value = &mut wasm_config["configuration"]["value"];
    let text = value.as_str().unwrap().replace(TOKEN_PLACEHOLDER, token);
    *value = text.into();
}

/// A cluster like the one Istio builds for a Service port, with `endpoints`.
fn service_cluster(name: &str, endpoints: &[(String, u16)], http2: bool) -> Value {
    let lb: Vec<Value> = endpoints
        .iter()
        .map(|(ip, port)| json!({"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}}))
        .collect();
    let mut c = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]},
    });
    if http2 {
        c["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        });
    }
    c
}

/// The patches of `envoy_filters` that match `context`, applied to a listener, its
/// connection manager, a route built from the VirtualService `llm`, and `clusters`.
/// HTTP filters with `config_discovery` are served from a file (ECDS over the filesystem
/// instead of istiod's ADS), with the module fetched as istio-agent would.
fn bootstrap(gw: &Gateway, envoy_filters: &[&Value], vs: &Value, mut clusters: Vec<Value>, token: &str) -> Value {
    let http = &vs["spec"]["http"][0];
    let destination = &http["route"][0]["destination"];
    let route_cluster =
        format!("outbound|{}||{}", destination["port"]["number"], destination["host"].as_str().unwrap());
    // The VirtualService's header matches, as istiod translates them (regex: safe_regex).
    let headers: Vec<Value> = http["match"][0]["headers"]
        .as_object()
        .map(|h| {
            h.iter()
                .map(|(name, m)| json!({"name": name, "string_match": {"safe_regex": {"regex": m["regex"]}}}))
                .collect()
        })
        .unwrap_or_default();
    let mut route = json!({
        "name": http["name"],
        "match": {"prefix": "/", "headers": headers},
        "route": {
            "cluster": route_cluster,
            "timeout": http["timeout"],
            "retry_policy": {
                "retry_on": http["retries"]["retryOn"],
                "num_retries": http["retries"]["attempts"],
            },
        },
    });
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "outbound_0.0.0.0_8080",
        "route_config": {"name": "http.8080", "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": []}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    });
    let mut listener = json!({
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": gw.listener_port}},
    });
    let mut ecds = Vec::new();
    let mut added_listeners = Vec::new();
    for ef in envoy_filters {
        for p in ef["spec"]["configPatches"].as_array().unwrap() {
            let value = &p["patch"]["value"];
            let op = p["patch"]["operation"].as_str().unwrap();
            match (p["applyTo"].as_str().unwrap(), op) {
                ("EXTENSION_CONFIG", "ADD") => {
                    let mut ext = value.clone();
                    ext["@type"] = json!("type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig");
                    if ext["typed_config"]["@type"] != DYNAMIC_MODULE_FILTER {
                        fetched_locally(&mut ext["typed_config"]["config"]);
                    }
                    let settings = filter_json_at(&mut ext["typed_config"]);
                    *settings = settings.as_str().unwrap().replace(TOKEN_PLACEHOLDER, token).into();
                    ecds.push(ext);
                }
                ("HTTP_FILTER", "INSERT_BEFORE") => {
                    assert_eq!(
                        p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
                        "envoy.filters.http.router"
                    );
                    let mut filter = value.clone();
                    if filter.get("config_discovery").is_some() {
                        let source = &mut filter["config_discovery"]["config_source"];
                        assert!(source.get("ads").is_some(), "ECDS from istiod");
                        *source = json!({
                            "path_config_source": {"path": gw.dir.path().join("ecds.json").display().to_string()},
                            "initial_fetch_timeout": source["initial_fetch_timeout"],
                        });
                    }
                    if filter["typed_config"]["@type"] == "type.googleapis.com/udpa.type.v1.TypedStruct" {
                        let wasm_config = &mut filter["typed_config"]["value"]["config"];
                        match &gw.module_url {
                            Some((url, sha256)) => {
                                let remote = &mut wasm_config["vm_config"]["code"]["remote"];
                                remote["http_uri"]["uri"] = json!(url);
                                remote["sha256"] = json!(sha256);
                            }
                            None => fetched_locally(wasm_config),
                        }
                        with_token(&mut filter["typed_config"]["value"]["config"], token);
                    }
                    let filters = hcm["http_filters"].as_array_mut().unwrap();
                    let router = filters.len() - 1;
                    filters.insert(router, filter);
                }
                ("NETWORK_FILTER", "MERGE") => {
                    assert_eq!(value["name"], "envoy.filters.network.http_connection_manager");
                    merge(&mut hcm, &value["typed_config"]);
                }
                ("LISTENER", "MERGE") => merge(&mut listener, value),
                ("LISTENER", "ADD") => added_listeners.push(value.clone()),
                ("HTTP_ROUTE", "MERGE") => {
                    assert_eq!(p["match"]["routeConfiguration"]["vhost"]["route"]["name"], http["name"]);
                    merge(&mut route, value);
                }
                ("VIRTUAL_HOST", "MERGE") => {
                    merge(&mut hcm["route_config"]["virtual_hosts"][0], value);
                }
                ("CLUSTER", "MERGE") => {
                    let target = p["match"]["cluster"]["name"].as_str().unwrap();
                    let cluster = clusters.iter_mut().find(|c| c["name"] == target).expect("the patched cluster");
                    merge(cluster, value);
                }
                ("CLUSTER", "ADD") => clusters.push(value.clone()),
                (what, op) => panic!("{}: the test does not apply {op} on {what} yet", name(ef)),
            }
        }
    }
    // The VirtualService's other entries that answer directly (the `not-routed` catch-all).
    let mut routes = vec![route];
    for other in vs["spec"]["http"].as_array().into_iter().flatten().skip(1) {
        let direct = &other["directResponse"];
        assert!(direct.is_object(), "the test translates only directResponse entries after the first");
        let content_type = &other["headers"]["response"]["set"]["content-type"];
        routes.push(json!({
            "name": other["name"],
            "match": {"prefix": "/"},
            "direct_response": {"status": direct["status"], "body": {"inline_string": direct["body"]["string"]}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type}}],
        }));
    }
    hcm["route_config"]["virtual_hosts"][0]["routes"] = json!(routes);
    listener["filter_chains"] =
        json!([{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]);
    gw.write("ecds.json", &json!({"version_info": "1", "resources": ecds}));
    let listeners = [vec![listener], added_listeners].concat();
    json!({
        "node": {"id": "router~127.0.0.1~kvmesh-gateway.kvmesh~kvmesh.svc.cluster.local", "cluster": "kvmesh-gateway.kvmesh"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": gw.admin_port}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    })
}

fn start_envoy(gw: &Gateway, config: &Path) -> Proc {
    let mut cmd = Command::new(envoy_bin());
    cmd.arg("-c")
        .arg(config)
        .args(["--concurrency", "2", "--disable-hot-restart", "--log-level", "warn"])
        .current_dir(gw.dir.path());
    let mut envoy = Proc::spawn("envoy-istio", cmd).unwrap();
    let ready = format!("http://127.0.0.1:{}/ready", gw.admin_port);
    let waited = wait_until("envoy to become ready", Duration::from_secs(30), || {
        envoy.exited().is_some() || http::get(&ready).map(|r| r.status == 200).unwrap_or(false)
    });
    assert!(envoy.exited().is_none() && waited.is_ok(), "{}", envoy.log_tail());
    envoy
}

#[test]
fn the_gateway_envoyfilters_route_in_a_real_envoy_behind_kvmesh_cp_from_the_configmap() {
    let objs = kustomize("overlays/regular");
    let worker = find(&objs, "Deployment", "sglang-worker");

    // Two "pods" of the example Deployment: its labels, on their own loopback addresses.
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let ips = ["127.0.0.2", "127.0.0.3"];
    let sims: Vec<Sim> = ips.iter().map(|ip| Sim::start_at(ip, port, &["--time-scale", "0"]).unwrap()).collect();
    let pod_labels: Vec<(String, String)> = labels(worker).into_iter().collect();
    let pod_labels: Vec<(&str, &str)> = pod_labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for (i, ip) in ips.iter().enumerate() {
        kube.apply(pod("kvmesh", &format!("sglang-worker-{i}"), ip, true, &pod_labels, &[]));
    }
    kube.apply(pod("kvmesh", "unlabelled", "127.0.0.4", true, &[("app", "other")], &[]));

    // kvmesh-cp with the ConfigMap's file; only what a test must change is overridden on the
    // command line (flags win): loopback, free ports, the sims' port, a token file here, and
    // the pod network (the placeholder; these pods live on 127.0.0.x).
    let gw = Gateway::new("gateway");
    let config = gw.dir.path().join("kvmesh-cp.yaml");
    std::fs::write(&config, find(&objs, "ConfigMap", "kvmesh-cp")["data"]["kvmesh-cp.yaml"].as_str().unwrap()).unwrap();
    let kubeconfig = kube.kubeconfig().unwrap();
    let port_arg = port.to_string();
    let args =
        ["--config", config.to_str().unwrap(), "--service-discovery-port", &port_arg, "--worker-cidrs", "127.0.0.0/8"];
    let cp = ControlPlane::start_with_env(
        free_port().unwrap(),
        free_port().unwrap(),
        &args,
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    )
    .unwrap();
    let want: HashSet<String> = sims.iter().map(|s| format!("http://{}", s.addr())).collect();
    wait_until("kvmesh-cp to discover the two pods", Duration::from_secs(20), || {
        let listed: HashSet<String> = http::get(&cp.url("/workers"))
            .ok()
            .and_then(|r| r.json().ok())
            .and_then(|v: Value| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|w| w["url"].as_str().map(String::from))
            .collect();
        listed == want
    })
    .unwrap();

    // The gateway: Istio's clusters for the two Services, patched by the EnvoyFilters.
    let endpoints: Vec<(String, u16)> = sims.iter().map(|s| (s.host.clone(), s.port)).collect();
    let clusters = vec![
        service_cluster(WORKERS_CLUSTER, &endpoints, false),
        service_cluster(CP_CLUSTER, &[("127.0.0.1".into(), cp.grpc_port)], true),
    ];
    let filters = [
        find(&objs, "EnvoyFilter", "kvmesh-gateway"),
        find(&objs, "EnvoyFilter", "kvmesh-gateway-listener"),
        find(&objs, "EnvoyFilter", "kvmesh-workers-cluster"),
    ];
    let mut config =
        bootstrap(&gw, &filters, find(&objs, "VirtualService", "llm"), clusters, cp.token.as_deref().unwrap());
    // What the gateway pod's bootstrapOverride annotation names, merged as istio-agent does.
    let deployment = find(&objs, "Deployment", "kvmesh-gateway");
    let overrides = deployment["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/bootstrapOverride"]
        .as_str()
        .expect("the gateway pod names its bootstrap override");
    let custom = find(&objs, "ConfigMap", overrides)["data"]["custom_bootstrap.json"].as_str().unwrap();
    merge(&mut config, &serde_json::from_str::<Value>(custom).unwrap());
    assert!(config["overload_manager"]["actions"].as_array().is_some_and(|a| !a.is_empty()));
    let path = gw.write("envoy.json", &config);
    kvmesh_testkit::envoy::validate(&path).unwrap();
    let _envoy = start_envoy(&gw, &path);
    let url = |p: &str| format!("http://127.0.0.1:{}{p}", gw.listener_port);

    // Synced with the control plane (the static configuration has no workers).
    let snapshot = cp.settled_version().unwrap();
    let stat = format!("http://127.0.0.1:{}/stats?filter=^wasmcustom.kvmesh_snapshot_version$", gw.admin_port);
    wait_until("the gateway to apply kvmesh-cp's snapshot", Duration::from_secs(20), || {
        http::get(&stat).ok().and_then(|r| r.text().rsplit(": ").next()?.trim().parse::<u64>().ok()).unwrap_or(0)
            >= snapshot
    })
    .unwrap();

    let addrs: HashSet<String> = sims.iter().map(Sim::addr).collect();
    let mut served = HashSet::new();
    for i in 0..12 {
        let prompt = format!("conversation {} {}", i % 3, "the same long system prompt ".repeat(20));
        let body = json!({"model": "m", "messages": [{"role": "user", "content": prompt}]});
        // A client naming a worker is ignored.
        let spoof = [("x-gateway-destination-endpoint", "127.0.0.9:1"), ("x-envoy-original-dst-host", "127.0.0.9:1")];
        let r = http::post(&url("/v1/chat/completions"), body.to_string().as_bytes(), &spoof).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let picked = r.header("x-kvmesh-worker").expect("x-kvmesh-worker").to_string();
        assert!(addrs.contains(&picked), "{picked}");
        // override_host sent it to the pod the filter picked.
        assert_eq!(r.header("x-sim-worker"), Some(picked.as_str()));
        served.insert((i % 3, picked));
    }
    // cache_aware: each conversation sticks to one worker.
    assert_eq!(served.len(), 3, "{served:?}");

    // Worker administration is never forwarded; errors are the gateway's JSON.
    let r = http::post(&url("/flush_cache"), b"", &[]).unwrap();
    assert_eq!(r.status, 404);
    assert!(r.json().unwrap()["error"]["message"].is_string());
    let r = http::post(&url("/generate"), b"{not json", &[]).unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    // A read-only path goes to a worker.
    assert_eq!(http::get(&url("/v1/models")).unwrap().status, 200);
}

/// The native overlay's gateway configuration, as istiod and istio-agent would hand it to
/// Envoy, is one Envoy takes with the native build (built for this Envoy) loaded: the
/// dynamic-modules filter over ECDS, the loopback link to kvmesh-cp's cluster.
#[test]
fn the_native_overlay_loads_the_module_in_envoy() {
    let objs = kustomize("overlays/native");
    let endpoints = vec![("127.0.0.1".to_string(), free_port().unwrap())];
    let clusters =
        vec![service_cluster(WORKERS_CLUSTER, &endpoints, false), service_cluster(CP_CLUSTER, &endpoints, true)];
    let efs: Vec<&Value> = ["kvmesh-gateway", "kvmesh-gateway-listener", "kvmesh-gateway-cp-link"]
        .iter()
        .map(|n| find(&objs, "EnvoyFilter", n))
        .collect();
    let gw = Gateway::new("native");
    let mut config = bootstrap(&gw, &efs, find(&objs, "VirtualService", "llm"), clusters, "t0ken");
    // The link on a free port here (18000 may be taken on this machine).
    let link = &mut config["static_resources"]["listeners"][1];
    assert_eq!(link["name"], "kvmesh-cp-link");
    link["address"]["socket_address"]["port_value"] = json!(free_port().unwrap());
    // Validation does not fetch ECDS: the served configuration goes inline, so the module loads.
    let ecds: Value = serde_json::from_slice(&std::fs::read(gw.dir.path().join("ecds.json")).unwrap()).unwrap();
    let filters = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"];
    let inserted = filters.as_array_mut().unwrap().iter_mut().find(|f| f["name"] == "kvmesh.filter").unwrap();
    *inserted = json!({"name": "kvmesh.filter", "typed_config": ecds["resources"][0]["typed_config"]});
    let path = gw.write("envoy.json", &config);
    let module = kvmesh_testkit::e2e::native_module();
    kvmesh_testkit::envoy::validate_with_modules(&path, module.parent()).unwrap();
}

#[test]
fn the_istio_1_27_and_sidecar_variants_load_in_envoy() {
    let endpoints = vec![("127.0.0.1".to_string(), free_port().unwrap())];
    let objs = kustomize("overlays/regular");
    let vs = find(&objs, "VirtualService", "llm");

    // 1.27: the inline TypedStruct filter and the clusters the EnvoyFilter adds; Envoy
    // fetches the module itself, through the added cluster, and checks its sha256.
    let module = std::fs::read(wasm_path()).unwrap();
    let server = serve_once_per_request(module.clone());
    let mut gw = Gateway::new("1-27");
    let sha256 = {
        use sha2::Digest;
        sha2::Sha256::digest(&module).iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    gw.module_url =
        Some((format!("http://kvmesh-wasm.kvmesh.svc.cluster.local:{}/kvmesh_filter.wasm", server.0), sha256));
    let old = load(&istio_dir().join("istio-1.27/envoyfilter-gateway.yaml")).remove(0);
    let listener = find(&objs, "EnvoyFilter", "kvmesh-gateway-listener");
    let clusters =
        vec![service_cluster(WORKERS_CLUSTER, &endpoints, false), service_cluster(CP_CLUSTER, &endpoints, true)];
    let mut config = bootstrap(&gw, &[&old, listener], vs, clusters, "t0ken");
    let text = serde_json::to_string(&config).unwrap();
    assert!(text.contains("\"cluster\":\"kvmesh_workers\"") && text.contains("\"use_http_header\":true"));
    // The module server's DNS name stands for this test's loopback server.
    let source = config["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "kvmesh_wasm_source")
        .expect("the EnvoyFilter adds the module's cluster");
    let address =
        &mut source["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    address["address"] = json!("127.0.0.1");
    address["port_value"] = json!(server.0);
    let path = gw.write("envoy.json", &config);
    kvmesh_testkit::envoy::validate(&path).unwrap();
    let envoy = start_envoy(&gw, &path);
    let r = http::post(&format!("http://127.0.0.1:{}/flush_cache", gw.listener_port), b"", &[]).unwrap();
    assert_eq!(r.status, 404, "the fetched filter answers: {}", r.text());
    assert_eq!(r.json().unwrap()["error"]["code"], "not_found");
    assert!(server.1.load(std::sync::atomic::Ordering::SeqCst) >= 1, "Envoy fetched the module");
    drop(envoy);

    // The sidecar: filters disabled by default, enabled on the model's virtual host; the
    // clients' VirtualService.
    let gw = Gateway::new("sidecar");
    let docs = load(&istio_dir().join("examples/sidecar/kvmesh-sidecar.yaml"));
    let ef = docs.iter().find(|d| d["kind"] == "EnvoyFilter").unwrap();
    let vs = docs.iter().find(|d| d["kind"] == "VirtualService").unwrap();
    for p in patches(ef, "HTTP_FILTER") {
        assert_eq!(p["patch"]["value"]["disabled"], true, "a sidecar filter must be off on other services");
    }
    let vhost = &patches(ef, "VIRTUAL_HOST").next().unwrap()["patch"]["value"]["typed_per_filter_config"];
    for p in patches(ef, "HTTP_FILTER") {
        let filter = p["patch"]["value"]["name"].as_str().unwrap();
        assert!(vhost.get(filter).is_some(), "{filter} is never enabled");
    }
    let clusters =
        vec![service_cluster(WORKERS_CLUSTER, &endpoints, false), service_cluster(CP_CLUSTER, &endpoints, true)];
    let mut config = bootstrap(&gw, &[ef], vs, clusters, "t0ken");
    // The clients' outbound listener serves other services on port 8000 too: the model's
    // virtual host (named as Istio names it) and another one.
    let host = vs["spec"]["hosts"][0].as_str().unwrap();
    let vhosts = &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["route_config"]["virtual_hosts"];
    vhosts[0]["name"] = json!(format!("{host}:8000"));
    vhosts[0]["domains"] = json!([host, format!("{host}:8000")]);
    vhosts.as_array_mut().unwrap().push(json!({
        "name": "other.apps.svc.cluster.local:8000",
        "domains": ["*"],
        "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "other"}}}],
    }));
    let path = gw.write("envoy.json", &config);
    kvmesh_testkit::envoy::validate(&path).unwrap();
    // Live: the filter answers on the model's virtual host only.
    let _envoy = start_envoy(&gw, &path);
    let url = format!("http://127.0.0.1:{}/flush_cache", gw.listener_port);
    let other = http::post(&url, b"", &[("host", "other.apps.svc.cluster.local:8000")]).unwrap();
    assert_eq!((other.status, other.text().as_str()), (200, "other"), "another service is untouched");
    let model = http::post(&url, b"", &[("host", host)]).unwrap();
    assert_eq!(model.status, 404, "the filter runs on the model's virtual host: {}", model.text());
    assert_eq!(model.json().unwrap()["error"]["code"], "not_found");
}

/// A loopback HTTP server answering every request with `body` (the module Envoy fetches);
/// returns its port and the number of requests served. It lives as long as the test process.
fn serve_once_per_request(body: Vec<u8>) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(&stream);
            let mut line = String::new();
            // The request's head, up to its blank line (bounded).
            for _ in 0..100 {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
            }
            let mut out = &stream;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
            if out.write_all(head.as_bytes()).and_then(|_| out.write_all(&body)).is_ok() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    (port, served)
}

/// The Dockerfile cannot be built here (no container engine); what it promises the
/// Deployment is checked: the same unprivileged user, the ports, the binary it runs.
#[test]
fn the_dockerfile_makes_the_image_the_deployment_expects() {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let stages = lines.iter().filter(|l| l.starts_with("FROM ")).count();
    assert!(stages >= 2, "a multi-stage build");
    let last_stage: Vec<&str> = lines.iter().rev().take_while(|l| !l.starts_with("FROM ")).copied().collect();
    let user = last_stage.iter().find_map(|l| l.strip_prefix("USER ")).expect("the final stage sets USER");
    let uid: u32 = user.split(':').next().unwrap().parse().expect("a numeric user");
    assert_ne!(uid, 0, "the image runs as root");
    assert!(text.contains("cargo build --release --locked -p kvmesh-cp"));

    let objs = kustomize("overlays/regular");
    let pod = &find(&objs, "Deployment", "kvmesh-cp")["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsUser"], uid);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0];
    let entrypoint = last_stage.iter().find_map(|l| l.strip_prefix("ENTRYPOINT ")).expect("ENTRYPOINT");
    let entrypoint: Vec<String> = serde_json::from_str(entrypoint).unwrap();
    assert!(entrypoint[0].ends_with("/kvmesh-cp"));
    assert_eq!(container["args"][0], "--config", "the Deployment passes flags to the ENTRYPOINT");
    let exposed: HashSet<u64> = last_stage
        .iter()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u64>().unwrap()))
        .collect();
    let ports: HashSet<u64> =
        container["ports"].as_array().unwrap().iter().map(|p| p["containerPort"].as_u64().unwrap()).collect();
    assert_eq!(exposed, ports);
}
