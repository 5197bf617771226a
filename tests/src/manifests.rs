//! The Kubernetes install, read without a cluster: the kustomize tree under `istio/` rendered
//! by the real `kubectl kustomize`, the Helm chart under `deploy/helm/kvmesh` rendered by Helm's
//! own engine (PyPI `helm-python-sdk`), and the checks both must pass: Istio and Prometheus
//! Operator resources against their CRD schemas (`istio/schemas/`), Kubernetes objects against
//! their `k8s-openapi` types (unknown fields are errors), and the names that tie an install
//! together. Used by `tests/tests/istio.rs` and `tests/tests/helm.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use crate::repo_root;

/// The gRPC token's placeholder in the kustomize tree (replaced at install).
pub const TOKEN_PLACEHOLDER: &str = "KVMESH_GRPC_TOKEN";
/// The pod network's placeholder in the kustomize tree (replaced at install).
pub const POD_CIDR_PLACEHOLDER: &str = "KVMESH_POD_CIDR";

pub fn istio_dir() -> PathBuf {
    repo_root().join("istio")
}

pub fn chart_dir() -> PathBuf {
    repo_root().join("deploy/helm/kvmesh")
}

/// The documents of a YAML stream, as JSON values (empty documents dropped).
pub fn documents(text: &str, what: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap_or_else(|e| panic!("{what}: not YAML: {e}"));
        if !v.is_null() {
            out.push(v);
        }
    }
    out
}

pub fn load(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    documents(&text, &path.display().to_string())
}

/// `kubectl` for `kubectl kustomize`: `KVMESH_KUBECTL` (set by `cargo xtask test`, which
/// installs it), else `.venv/bin/kubectl`, else on the PATH. No cluster is contacted.
pub fn kubectl() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_KUBECTL") {
        let p = PathBuf::from(p);
        assert!(p.exists(), "KVMESH_KUBECTL names {}, which does not exist", p.display());
        return p;
    }
    let venv = repo_root().join(".venv/bin/kubectl");
    if venv.exists() {
        return venv;
    }
    let on_path = Command::new("kubectl").args(["version", "--client"]).output().is_ok_and(|o| o.status.success());
    assert!(on_path, "kubectl is needed to render istio/ (`cargo xtask test` installs it into .venv)");
    "kubectl".into()
}

/// `kubectl kustomize istio/DIR`.
pub fn kustomize(dir: &str) -> Vec<Value> {
    let out = Command::new(kubectl()).arg("kustomize").arg(istio_dir().join(dir)).output().unwrap();
    assert!(out.status.success(), "kubectl kustomize istio/{dir}: {}", String::from_utf8_lossy(&out.stderr));
    documents(&String::from_utf8_lossy(&out.stdout), &format!("kubectl kustomize istio/{dir}"))
}

/// A python that imports `helm_python` (PyPI `helm-python-sdk`): `KVMESH_HELM_PYTHON` (set by
/// `cargo xtask test`, which installs it), else `.venv/bin/python`.
pub fn helm_python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_HELM_PYTHON") {
        return PathBuf::from(p);
    }
    let python = repo_root().join(".venv/bin/python");
    let ok = Command::new(&python).args(["-c", "import helm_python"]).output().is_ok_and(|o| o.status.success());
    assert!(ok, "{} cannot import helm_python (`cargo xtask test` installs helm-python-sdk)", python.display());
    python
}

/// The chart rendered as `helm template` would, into `namespace`, with the values files
/// (relative to the chart) and then `values` merged over its defaults; the error is Helm's.
pub fn helm_template(namespace: &str, values_files: &[&str], values: &Value) -> Result<Vec<Value>, String> {
    let mut cmd = Command::new(helm_python());
    cmd.arg(repo_root().join("tests/helm/render.py")).arg(chart_dir()).arg(namespace);
    for f in values_files {
        cmd.arg("--values").arg(chart_dir().join(f));
    }
    let out = cmd.arg("--json").arg(values.to_string()).output().unwrap();
    if !out.status.success() {
        // Helm's loader logs each link it follows under files/ (INFO): not the error.
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(stderr.lines().filter(|l| !l.contains(" INFO ")).collect::<Vec<_>>().join("\n"));
    }
    Ok(documents(&String::from_utf8_lossy(&out.stdout), &format!("the chart with {values_files:?} {values}")))
}

/// `helm lint --strict`'s findings (errors and warnings; info left out) with `values`.
pub fn helm_lint(values: &Value) -> Vec<String> {
    let out = Command::new(helm_python())
        .arg(repo_root().join("tests/helm/render.py"))
        .arg(chart_dir())
        .arg("kvmesh")
        .arg("--json")
        .arg(values.to_string())
        .arg("--lint")
        .output()
        .unwrap();
    assert!(out.status.success(), "helm lint: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut found: Vec<String> = report["errors"].as_array().into_iter().flatten().map(|e| e.to_string()).collect();
    // Helm's severities: 1 info, 2 warning, 4 error.
    found.extend(
        report["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["severity"].as_u64() > Some(1))
            .map(|m| m.to_string()),
    );
    found
}

pub fn kind(v: &Value) -> (&str, &str) {
    (v["apiVersion"].as_str().unwrap_or(""), v["kind"].as_str().unwrap_or(""))
}

pub fn name(v: &Value) -> String {
    format!("{}/{}", v["kind"].as_str().unwrap_or("?"), v["metadata"]["name"].as_str().unwrap_or("?"))
}

/// The CRD schema file of a custom resource (Istio's, Prometheus Operator's), if it is one.
pub fn crd_schema(api_version: &str, kind: &str) -> Option<PathBuf> {
    let (group, version) = api_version.split_once('/')?;
    (group.ends_with("istio.io") || group == "monitoring.coreos.com")
        .then(|| istio_dir().join("schemas").join(format!("{}.{group}.{version}.schema.json", kind.to_lowercase())))
}

/// Schema errors of a custom resource.
pub fn schema_errors(obj: &Value) -> Vec<String> {
    let (api_version, kind) = kind(obj);
    let path = crd_schema(api_version, kind).unwrap_or_else(|| panic!("{} is not a custom resource", name(obj)));
    assert!(
        path.exists(),
        "{}: no schema {} (add it from the CRDs, see istio/schemas/SOURCE.txt)",
        name(obj),
        path.display()
    );
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let validator = jsonschema::draft4::new(&schema).unwrap();
    let mut errors: Vec<String> =
        validator.iter_errors(obj).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    // The API server prunes fields a structural schema does not declare, and kubectl (strict
    // field validation, its default) refuses them: so does this check. `metadata` is not in
    // the CRD schemas; it is an ObjectMeta.
    if let Some(spec) = obj.get("spec") {
        undeclared(&schema["properties"]["spec"], spec, "spec", &mut errors);
    }
    for top in obj.as_object().into_iter().flat_map(|o| o.keys()) {
        if !["apiVersion", "kind", "metadata", "spec"].contains(&top.as_str()) {
            errors.push(format!("unknown field `{top}`"));
        }
    }
    match unknown_fields::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>(&obj["metadata"]) {
        Ok(unknown) => errors.extend(unknown.into_iter().map(|f| format!("unknown field `metadata.{f}`"))),
        Err(e) => errors.push(format!("metadata: {e}")),
    }
    errors
}

/// Fields of `value` that `schema` (a structural schema) does not declare.
fn undeclared(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    if schema["x-kubernetes-preserve-unknown-fields"] == true {
        return;
    }
    match value {
        Value::Object(map) => {
            let props = schema["properties"].as_object();
            for (k, v) in map {
                let sub = format!("{path}.{k}");
                match (props.and_then(|p| p.get(k)), &schema["additionalProperties"]) {
                    (Some(s), _) => undeclared(s, v, &sub, errors),
                    (None, extra @ Value::Object(_)) => undeclared(extra, v, &sub, errors),
                    (None, Value::Bool(true)) => {}
                    (None, _) => errors.push(format!("unknown field `{sub}`")),
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                undeclared(&schema["items"], v, &format!("{path}[{i}]"), errors);
            }
        }
        _ => {}
    }
}

/// Deserialises `obj` as `T`; returns the fields `T` does not have.
fn unknown_fields<T: serde::de::DeserializeOwned>(obj: &Value) -> Result<Vec<String>, String> {
    let mut unknown = Vec::new();
    serde_ignored::deserialize::<_, _, T>(obj.clone(), |path| unknown.push(path.to_string()))
        .map_err(|e| e.to_string())?;
    Ok(unknown)
}

/// Checks a Kubernetes core object against its `k8s-openapi` type.
pub fn core_errors(obj: &Value) -> Vec<String> {
    use k8s_openapi::api::{apps::v1 as apps, core::v1 as core, policy::v1 as policy, rbac::v1 as rbac};
    let result = match kind(obj) {
        ("v1", "Namespace") => unknown_fields::<core::Namespace>(obj),
        ("v1", "ServiceAccount") => unknown_fields::<core::ServiceAccount>(obj),
        ("v1", "ConfigMap") => unknown_fields::<core::ConfigMap>(obj),
        ("v1", "Secret") => unknown_fields::<core::Secret>(obj),
        ("v1", "Service") => unknown_fields::<core::Service>(obj),
        ("apps/v1", "Deployment") => unknown_fields::<apps::Deployment>(obj),
        ("policy/v1", "PodDisruptionBudget") => unknown_fields::<policy::PodDisruptionBudget>(obj),
        ("rbac.authorization.k8s.io/v1", "Role") => unknown_fields::<rbac::Role>(obj),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => unknown_fields::<rbac::RoleBinding>(obj),
        (api, k) => return vec![format!("{api} {k}: no typed check for this kind (add it to core_errors)")],
    };
    match result {
        Ok(unknown) => unknown.into_iter().map(|f| format!("unknown field `{f}`")).collect(),
        Err(e) => vec![e],
    }
}

/// Every error of one object: its CRD schema, or its Kubernetes type.
pub fn check(obj: &Value) -> Vec<String> {
    let (api_version, kind) = kind(obj);
    if crd_schema(api_version, kind).is_some() {
        schema_errors(obj)
    } else {
        core_errors(obj)
    }
}

pub fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

/// The kvmesh-cp configuration of an install, as YAML.
pub fn cp_config(objs: &[Value]) -> Value {
    let text = find(objs, "ConfigMap", "kvmesh-cp")["data"]["kvmesh-cp.yaml"].as_str().unwrap().to_string();
    documents(&text, "the kvmesh-cp ConfigMap").remove(0)
}

pub fn patches<'a>(envoy_filter: &'a Value, apply_to: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    envoy_filter["spec"]["configPatches"].as_array().unwrap().iter().filter(move |p| p["applyTo"] == apply_to)
}

pub fn extension_config(envoy_filter: &Value) -> &Value {
    &patches(envoy_filter, "EXTENSION_CONFIG").next().expect("an EXTENSION_CONFIG patch")["patch"]["value"]
}

/// The type of the dynamic-modules HTTP filter's configuration (the native build's).
pub const DYNAMIC_MODULE_FILTER: &str =
    "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter";

/// Where an extension configuration (`typed_config`) holds the filter's plugin JSON string:
/// the Wasm filter's `config.configuration`, or the native build's `filter_config`.
pub fn filter_json_at(typed_config: &mut Value) -> &mut Value {
    if typed_config["@type"] == DYNAMIC_MODULE_FILTER {
        &mut typed_config["filter_config"]["value"]
    } else {
        &mut typed_config["config"]["configuration"]["value"]
    }
}

/// The filter's plugin configuration (JSON) in an EnvoyFilter's EXTENSION_CONFIG patch, the
/// `.wasm`'s or the native build's.
pub fn filter_json(envoy_filter: &Value) -> Value {
    let typed = &extension_config(envoy_filter)["typed_config"];
    if typed["@type"] == DYNAMIC_MODULE_FILTER {
        let module = &typed["dynamic_module_config"];
        assert_eq!(module["name"], "kvmesh_native", "{}: Envoy loads lib<name>.so", name(envoy_filter));
        assert_eq!(typed["filter_name"], "kvmesh_native", "{}", name(envoy_filter));
        // The .wasm's stat names, so that dashboards and alerts fit either build.
        assert_eq!(module["metrics_namespace"], "wasmcustom", "{}", name(envoy_filter));
        return serde_json::from_str(typed["filter_config"]["value"].as_str().unwrap()).unwrap();
    }
    let wasm = &typed["config"];
    assert_eq!(wasm["allow_on_headers_stop_iteration"], true, "{}: LLM requests would hang", name(envoy_filter));
    assert_eq!(wasm["failure_policy"], "FAIL_RELOAD", "{}", name(envoy_filter));
    serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap()
}

/// A Deployment's pod labels.
pub fn labels(obj: &Value) -> BTreeMap<String, String> {
    serde_json::from_value(obj["spec"]["template"]["metadata"]["labels"].clone()).unwrap_or_default()
}

/// `k=v` selectors of the control plane's configuration.
pub fn selector(cfg: &Value, key: &str) -> Vec<(String, String)> {
    cfg[key]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str()?.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect())
        .unwrap_or_default()
}

/// The PD role kvmesh-cp's discovery gives a pod with `labels` (control-plane/src/discovery.rs:
/// the prefill selector, then the decode selector, then the role label; `both` is a decode).
pub fn discovered_role(cfg: &Value, labels: &BTreeMap<String, String>) -> Option<&'static str> {
    let matches = |key: &str| {
        let s = selector(cfg, key);
        !s.is_empty() && s.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    if matches("prefill-selector") {
        return Some("prefill");
    }
    if matches("decode-selector") {
        return Some("decode");
    }
    match labels.get(cfg["role-label"].as_str().unwrap_or("llm-d.ai/role")).map(String::as_str) {
        Some("prefill") => Some("prefill"),
        Some("decode" | "both") => Some("decode"),
        _ => None,
    }
}

/// Where an install lives: its namespace, the cluster's DNS domain, the mesh's trust domain.
pub struct Place<'a> {
    pub namespace: &'a str,
    pub cluster_domain: &'a str,
    pub trust_domain: &'a str,
}

/// The names that tie kvmesh's own objects together (the example model servers aside): the
/// Services behind the clusters the filter names, the route, the workers' cluster patch, the
/// AuthorizationPolicy's identities, and kvmesh-cp's discovery of the Service's pods. Returns
/// the filter's and kvmesh-cp's configurations for the caller's further checks.
pub fn check_ties(what: &str, objs: &[Value], at: &Place) -> (Value, Value) {
    let ns = at.namespace;
    let svc = |name: &str| format!("{name}.{ns}.svc.{}", at.cluster_domain);
    let workers = find(objs, "Service", "sglang-workers");
    let port = workers["spec"]["ports"][0]["port"].as_u64().unwrap();
    let workers_cluster = format!("outbound|{port}||{}", svc("sglang-workers"));
    let cp_cluster = format!("outbound|18000||{}", svc("kvmesh-cp"));
    for o in objs.iter().filter(|o| o["kind"] != "Namespace") {
        assert_eq!(o["metadata"]["namespace"], ns, "{what}: {} is in another namespace", name(o));
    }
    let cp = find(objs, "Service", "kvmesh-cp");
    let grpc = cp["spec"]["ports"].as_array().unwrap().iter().find(|p| p["port"] == 18000).expect("port 18000");
    assert!(
        grpc["name"].as_str().unwrap().starts_with("grpc") || grpc["appProtocol"] == "grpc",
        "{what}: Istio builds an HTTP/2 cluster only for a port named grpc* or appProtocol grpc"
    );
    let filter = filter_json(find(objs, "EnvoyFilter", "kvmesh-gateway"));
    assert_eq!(filter["upstream_cluster"], workers_cluster, "{what}");
    assert_eq!(filter["control_plane_cluster"], cp_cluster, "{what}");
    let cluster_patch = find(objs, "EnvoyFilter", "kvmesh-workers-cluster");
    assert_eq!(
        patches(cluster_patch, "CLUSTER").next().unwrap()["match"]["cluster"]["name"],
        workers_cluster,
        "{what}"
    );
    let vs = find(objs, "VirtualService", "llm");
    assert_eq!(vs["spec"]["http"][0]["route"][0]["destination"]["host"], svc("sglang-workers"), "{what}");
    assert_eq!(vs["spec"]["http"][0]["route"][0]["destination"]["port"]["number"], port, "{what}");

    // kvmesh-cp's ports are open only to those that need them: the gRPC port to the
    // gateway's identity, the admin port to the gateway's namespace and kvmesh-cp's own.
    let policy = find(objs, "AuthorizationPolicy", "kvmesh-cp");
    assert_eq!(policy["spec"]["action"], "ALLOW", "{what}");
    let rules = policy["spec"]["rules"].as_array().unwrap();
    let rule_for = |port: &str| {
        rules
            .iter()
            .find(|r| r["to"].as_array().into_iter().flatten().any(|t| t["operation"]["ports"] == json!([port])))
            .unwrap_or_else(|| panic!("{what}: no rule for port {port}"))
    };
    for rule in rules {
        assert!(rule["from"].as_array().is_some_and(|f| !f.is_empty()), "{what}: a rule open to every source: {rule}");
    }
    let gateway = find(objs, "Deployment", "kvmesh-gateway");
    let gateway_sa = gateway["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap();
    let gateway_ns = gateway["metadata"]["namespace"].as_str().unwrap();
    let principal = format!("{}/ns/{gateway_ns}/sa/{gateway_sa}", at.trust_domain);
    assert_eq!(rule_for("18000")["from"], json!([{"source": {"principals": [principal]}}]), "{what}");
    let cp_ns = find(objs, "Deployment", "kvmesh-cp")["metadata"]["namespace"].as_str().unwrap();
    let admin_from = &rule_for("18001")["from"][0]["source"]["namespaces"];
    for n in [gateway_ns, cp_ns] {
        assert!(admin_from.as_array().unwrap().iter().any(|x| x == n), "{what}: the admin port is closed to {n}");
    }
    // The gateway pods are the ones the EnvoyFilters and the Gateway select.
    let gateway_labels = labels(gateway);
    for o in objs.iter().filter(|o| o["kind"] == "EnvoyFilter") {
        let sel: BTreeMap<String, String> =
            serde_json::from_value(o["spec"]["workloadSelector"]["labels"].clone()).unwrap();
        assert!(sel.iter().all(|(k, v)| gateway_labels.get(k) == Some(v)), "{what}: {} selects no gateway", name(o));
    }

    // kvmesh-cp finds the pods the Service selects, on the Service's port, in this namespace.
    let cfg = cp_config(objs);
    assert_eq!(cfg["service-discovery"], true, "{what}");
    assert_eq!(cfg["service-discovery-port"], port, "{what}");
    assert_eq!(cfg["service-discovery-namespace"], ns, "{what}");
    let service_selector: BTreeMap<String, String> =
        serde_json::from_value(workers["spec"]["selector"].clone()).unwrap();
    let discovery: BTreeMap<String, String> = selector(&cfg, "selector").into_iter().collect();
    assert_eq!(discovery, service_selector, "{what}: discovery and the Service select different pods");
    // Both agree on PD mode and its protocol (the filter's value counts until the first snapshot).
    assert_eq!(
        cfg["pd-disaggregation"].as_bool().unwrap_or(false),
        filter["pd_disaggregation"].as_bool().unwrap_or(false)
    );
    assert_eq!(
        cfg["pd-protocol"].as_str().unwrap_or("sglang"),
        filter["pd_protocol"].as_str().unwrap_or("sglang"),
        "{what}"
    );
    (filter, cfg)
}
