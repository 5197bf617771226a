//! The Helm chart (`deploy/helm/kvmesh`), rendered without a cluster by Helm's own engine
//! (Helm v4's Go SDK, PyPI `helm-python-sdk`, installed into `.venv` by `cargo xtask test`;
//! `tests/helm/render.py` drives it as `helm template` would):
//!
//! - one source of truth with the kustomize tree: rendered with `ci/<overlay>-values.yaml`, the
//!   chart gives exactly the objects `kubectl kustomize istio/overlays/<overlay>` gives (less
//!   the example model servers), field for field once Helm's own labels and checksum
//!   annotations are set aside; its three EnvoyFilters are istio/base's files, read as data
//!   through `files/` links, and its dashboard is docs/grafana/kvmesh.json;
//! - every object of every values set below validates: Istio and Prometheus Operator
//!   resources against their CRD schemas, Kubernetes objects against `k8s-openapi` types
//!   (unknown fields are errors), and `helm lint --strict` is clean;
//! - the names that tie an install together agree in any namespace, cluster domain, trust
//!   domain, port and selector, in every mode;
//! - values that could not work are refused at render time.

use std::collections::{BTreeMap, HashSet};

use base64::Engine as _;
use kvmesh_testkit::manifests::{
    check, check_ties, cp_config, documents, extension_config, filter_json, filter_json_at, find, helm_lint,
    helm_template, kustomize, labels, name, Place,
};
use kvmesh_testkit::repo_root;
use serde_json::{json, Value};

/// The overlays the chart reproduces, each with `ci/<overlay>-values.yaml`.
const OVERLAYS: [&str; 6] = ["regular", "pd", "pd-vllm", "pd-llm-d", "multi-model", "native"];

/// Labels Helm's templates add to every object's metadata (the kustomize tree has none).
const HELM_LABELS: [&str; 4] =
    ["helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"];

fn render(values_files: &[&str], values: Value) -> Vec<Value> {
    helm_template("kvmesh", values_files, &values).unwrap_or_else(|e| panic!("{values_files:?} {values}: {e}"))
}

/// An overlay's example model servers: the Deployments of worker pods and the per-model
/// Services. The chart installs kvmesh, not the models.
fn is_example(o: &Value) -> bool {
    (o["kind"] == "Deployment" && labels(o).contains_key("kvmesh.io/worker"))
        || (o["kind"] == "Service" && o["spec"]["selector"].get("kvmesh.io/model").is_some())
}

/// An object as compared: Helm's labels and checksum annotations dropped, kvmesh-cp's
/// configuration file and the filter's configuration string parsed (their text differs in
/// comments, key order and layout, not in meaning).
fn normalized(o: &Value) -> Value {
    let mut o = o.clone();
    fn drop_keys(map: &mut Value, drop: impl Fn(&str) -> bool) {
        if let Some(m) = map.as_object_mut() {
            m.retain(|k, _| !drop(k));
        }
    }
    let meta = &mut o["metadata"];
    drop_keys(&mut meta["labels"], |k| HELM_LABELS.contains(&k));
    if meta["labels"].as_object().is_some_and(|m| m.is_empty()) {
        meta.as_object_mut().unwrap().remove("labels");
    }
    if o["kind"] == "Deployment" {
        let tmeta = &mut o["spec"]["template"]["metadata"];
        drop_keys(&mut tmeta["annotations"], |k| k.starts_with("checksum/"));
        if tmeta["annotations"].as_object().is_some_and(|m| m.is_empty()) {
            tmeta.as_object_mut().unwrap().remove("annotations");
        }
    }
    if o["kind"] == "ConfigMap" && o["metadata"]["name"] == "kvmesh-cp" {
        let cfg = cp_config(std::slice::from_ref(&o));
        o["data"]["kvmesh-cp.yaml"] = cfg;
    }
    if o["kind"] == "EnvoyFilter" && o["metadata"]["name"] == "kvmesh-gateway" {
        let parsed = filter_json(&o);
        let patch =
            o["spec"]["configPatches"].as_array_mut().unwrap().iter_mut().find(|p| p["applyTo"] == "EXTENSION_CONFIG");
        *filter_json_at(&mut patch.unwrap()["patch"]["value"]["typed_config"]) = parsed;
    }
    o
}

/// Where `a` and `b` differ, as paths with both sides.
fn differences(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                differences(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &format!("{path}.{k}"),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(p, q, &format!("{path}[{i}]"), out);
            }
        }
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => {}
        _ if a != b => out.push(format!("{path}: chart {a} / kustomize {b}")),
        _ => {}
    }
}

/// Every difference between the chart's objects and the kustomize objects (examples aside).
fn drift(chart: &[Value], kustomized: &[Value]) -> Vec<String> {
    let by_name = |objs: &[Value]| -> BTreeMap<String, Value> {
        objs.iter().filter(|o| !is_example(o)).map(|o| (name(o), normalized(o))).collect()
    };
    let (chart, kustomized) = (by_name(chart), by_name(kustomized));
    let mut out = Vec::new();
    for n in chart.keys().filter(|n| !kustomized.contains_key(*n)) {
        out.push(format!("{n}: only in the chart"));
    }
    for (n, k) in &kustomized {
        match chart.get(n) {
            None => out.push(format!("{n}: only in the kustomize tree")),
            Some(c) => differences(c, k, n, &mut out),
        }
    }
    out
}

#[test]
fn the_chart_renders_what_each_kustomize_overlay_installs() {
    let mut failures = Vec::new();
    for overlay in OVERLAYS {
        let chart = render(&[&format!("ci/{overlay}-values.yaml")], json!({}));
        let kustomized = kustomize(&format!("overlays/{overlay}"));
        assert!(kustomized.iter().filter(|o| !is_example(o)).count() >= 17, "{overlay}: too few objects");
        failures.extend(drift(&chart, &kustomized).into_iter().map(|d| format!("{overlay}: {d}")));
    }
    assert!(failures.is_empty(), "the chart and the kustomize tree drifted apart:\n{}", failures.join("\n"));
}

#[test]
fn the_drift_check_sees_a_change() {
    // One field changed, one object more, one less: each is reported, or the test above
    // proves nothing.
    let chart = render(&["ci/regular-values.yaml"], json!({}));
    let kustomized = kustomize("overlays/regular");
    assert_eq!(drift(&chart, &kustomized), Vec::<String>::new());
    let mut changed = chart.clone();
    let listener = changed.iter_mut().find(|o| o["metadata"]["name"] == "kvmesh-gateway-listener").unwrap();
    listener["spec"]["configPatches"][1]["patch"]["value"]["per_connection_buffer_limit_bytes"] = json!(1024);
    let found = drift(&changed, &kustomized);
    assert!(found.len() == 1 && found[0].contains("per_connection_buffer_limit_bytes"), "{found:?}");
    let mut extra = chart.clone();
    extra.push(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "kvmesh"}}));
    assert_eq!(drift(&extra, &kustomized), ["ConfigMap/x: only in the chart"]);
    let fewer: Vec<Value> = chart.into_iter().filter(|o| o["kind"] != "Gateway").collect();
    assert_eq!(drift(&fewer, &kustomized), ["Gateway/kvmesh-gateway: only in the kustomize tree"]);
    // The filter's configuration is compared by meaning, not text.
    let other = render(&["ci/regular-values.yaml"], json!({"policy": "round_robin"}));
    assert!(drift(&other, &kustomized).iter().any(|d| d.contains("configuration.value.policy")));
}

/// Values that switch on everything the chart has, somewhere else than `kvmesh`.
fn everything() -> Value {
    json!({
        "workerCidrs": ["10.244.0.0/16", "fd00::/48"],
        "clusterDomain": "corp.local",
        "trustDomain": "corp.example",
        "namespace": {"create": true},
        "workers": {"port": 9000, "selector": {"app": "model-server", "tier": "gpu"}, "apiKey": "wk-7f3a"},
        "mode": "pd",
        "pd": {"protocol": "llm-d"},
        "multiModel": {"enabled": true, "aliases": ["small=Qwen/Qwen2.5-0.5B-Instruct"]},
        "controlPlane": {
            "image": {"repository": "example.org/kvmesh-cp", "tag": "1.2.3", "pullPolicy": "IfNotPresent"},
            "extraConfig": {"max-index-entries": 100000, "state-file": "/tmp/state.json"},
            "nodeSelector": {"pool": "system"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}},
            "podAnnotations": {"example.org/owner": "ml-platform"},
            "podDisruptionBudget": {"enabled": true},
        },
        "gateway": {
            "replicas": 3,
            "service": {"type": "ClusterIP", "port": 8080, "annotations": {"example.org/lb": "internal"}},
            "hosts": ["llm.example.org"],
            "podDisruptionBudget": {"minAvailable": 2},
        },
        "filter": {"module": {"uri": "oci://example.org/kvmesh-filter:1.2.3", "sha256": "ab".repeat(32)}},
        "metrics": {"scrapeNamespaces": ["monitoring"], "serviceMonitor": {"enabled": true, "labels": {"release": "prom"}}},
        "kvEvents": {"enabled": true, "replayEndpoint": "tcp://{host}:5558", "topic": "kv@", "tokenizerConfigMap": "model-tokenizer"},
    })
}

/// Every values set the tests render: the defaults (plus the one required value), each
/// overlay's, and everything switched on.
fn values_sets() -> Vec<(Vec<String>, Value)> {
    let mut sets = vec![(vec![], json!({"workerCidrs": ["10.0.0.0/8"]}))];
    sets.extend(OVERLAYS.iter().map(|o| (vec![format!("ci/{o}-values.yaml")], json!({}))));
    sets.push((vec![], everything()));
    sets
}

#[test]
fn every_object_the_chart_renders_matches_its_schema_and_lint_is_clean() {
    let mut failures = Vec::new();
    let mut kinds = HashSet::new();
    for (files, values) in values_sets() {
        let files: Vec<&str> = files.iter().map(String::as_str).collect();
        let objs = render(&files, values.clone());
        let names: HashSet<String> = objs.iter().map(name).collect();
        assert_eq!(names.len(), objs.len(), "{files:?}: an object twice");
        for obj in &objs {
            kinds.insert(obj["kind"].as_str().unwrap().to_string());
            failures.extend(check(obj).into_iter().map(|e| format!("{files:?}: {}: {e}", name(obj))));
        }
        // Lint with the same values (the files' own, then the JSON's).
        let mut lint_values = json!({});
        for f in &files {
            let text = std::fs::read_to_string(kvmesh_testkit::manifests::chart_dir().join(f)).unwrap();
            lint_values = documents(&text, f).remove(0);
        }
        lint_values.as_object_mut().unwrap().extend(values.as_object().unwrap().clone());
        failures.extend(helm_lint(&lint_values).into_iter().map(|e| format!("helm lint {files:?} {values}: {e}")));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Each kind the chart can render was checked at least once.
    for kind in ["Namespace", "Secret", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "EnvoyFilter", "Gateway"]
    {
        assert!(kinds.contains(kind), "no {kind} was rendered");
    }
}

#[test]
fn the_names_tie_together_wherever_and_however_it_is_installed() {
    let base = everything();
    for (mode, protocol, multi) in [
        ("regular", "sglang", false),
        ("regular", "sglang", true),
        ("pd", "sglang", false),
        ("pd", "vllm", false),
        ("pd", "llm-d", true),
    ] {
        let mut values = base.clone();
        values["mode"] = json!(mode);
        values["pd"]["protocol"] = json!(protocol);
        values["multiModel"]["enabled"] = json!(multi);
        let what = format!("{mode} {protocol} multi-model={multi}");
        let objs = helm_template("llm-serving", &[], &values).unwrap_or_else(|e| panic!("{what}: {e}"));
        let place = Place { namespace: "llm-serving", cluster_domain: "corp.local", trust_domain: "corp.example" };
        let (filter, cfg) = check_ties(&what, &objs, &place);
        if let Err(e) = kvmesh_core::Config::from_json(&serde_json::to_vec(&filter).unwrap()) {
            panic!("{what}: the filter would refuse its configuration: {e}");
        }
        assert_eq!(cfg["worker-cidrs"], base["workerCidrs"], "{what}");
        assert_eq!(cfg["max-index-entries"], 100000, "{what}: extraConfig");
        assert_eq!(cfg["enable-igw"].as_bool().unwrap_or(false), multi, "{what}");
        assert_eq!(cfg["pd-disaggregation"].as_bool().unwrap_or(false), mode == "pd", "{what}");
        if mode == "pd" {
            let s = &documents(
                &std::fs::read_to_string(kvmesh_testkit::manifests::chart_dir().join("values.yaml")).unwrap(),
                "values.yaml",
            )[0]["pd"][protocol];
            assert_eq!(cfg["prefill-policy"], s["prefillPolicy"], "{what}");
            assert_eq!(filter["prefill_policy"], s["prefillPolicy"], "{what}");
            assert_eq!(filter["decode_policy"], s["decodePolicy"], "{what}");
        } else {
            assert_eq!(cfg["policy"], filter["policy"], "{what}");
        }

        // The token: the Secret's (created, random) is the filter's.
        let secret = find(&objs, "Secret", "kvmesh-cp-auth");
        let b64 = |k: &str| {
            let raw = base64::engine::general_purpose::STANDARD.decode(secret["data"][k].as_str().unwrap()).unwrap();
            String::from_utf8(raw).unwrap()
        };
        assert_eq!(filter["control_plane_token"], b64("grpc-token"), "{what}");
        assert!(filter["control_plane_token"].as_str().unwrap().len() >= 32, "{what}: a short token");
        assert!(b64("api-keys").starts_with("ops:ops:admin:"), "{what}");
        // kvmesh-cp reads that Secret and its ConfigMap where its configuration says.
        let cp = find(&objs, "Deployment", "kvmesh-cp");
        let pod = &cp["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        assert_eq!(
            container["env"][0]["valueFrom"]["secretKeyRef"],
            json!({"name": "kvmesh-cp-auth", "key": "api-keys"})
        );
        let volume = |n: &str| pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == n).unwrap().clone();
        let mount = |n: &str| {
            container["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == n).unwrap()["mountPath"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(volume("auth")["secret"]["secretName"], "kvmesh-cp-auth");
        let token_path =
            format!("{}/{}", mount("auth"), volume("auth")["secret"]["items"][0]["path"].as_str().unwrap());
        assert_eq!(cfg["grpc-token-file"], token_path, "{what}");
        assert_eq!(volume("config")["configMap"]["name"], "kvmesh-cp");
        // The engines' KV events: the tokenizer (and chat template) ConfigMap where the
        // configuration reads it.
        assert_eq!(volume("tokenizer")["configMap"]["name"], "model-tokenizer");
        assert_eq!(cfg["kv-events-tokenizer"], format!("{}/tokenizer.json", mount("tokenizer")), "{what}");
        assert_eq!(
            (&cfg["kv-events-replay-endpoint"], &cfg["kv-events-topic"]),
            (&json!("tcp://{host}:5558"), &json!("kv@"))
        );
        // The workers' key: from its Secret into kvmesh-cp's environment, never on its
        // command line, nor in the filter's configuration (kvmesh-cp ships it to the gateways).
        let config = format!("{}/kvmesh-cp.yaml", mount("config"));
        assert_eq!(container["args"], json!(["--config", config]), "{what}");
        assert_eq!(
            container["env"][1],
            json!({"name": "KVMESH_WORKER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "kvmesh-cp-auth", "key": "worker-api-key", "optional": true}}}),
            "{what}"
        );
        assert_eq!(b64("worker-api-key"), "wk-7f3a", "{what}");
        assert!(
            filter.get("worker_api_key").is_none(),
            "{what}: the workers' key is not for the plugin's configuration"
        );
        assert_eq!(container["image"], "example.org/kvmesh-cp:1.2.3");

        // The module, the gateway's Service and routes, the monitors.
        let remote = &extension_config(find(&objs, "EnvoyFilter", "kvmesh-gateway"))["typed_config"]["config"]
            ["vm_config"]["code"]["remote"];
        assert_eq!(remote["http_uri"]["uri"], "oci://example.org/kvmesh-filter:1.2.3");
        assert_eq!(remote["sha256"], "ab".repeat(32));
        let gateway = find(&objs, "Deployment", "kvmesh-gateway");
        assert_eq!(gateway["spec"]["replicas"], 3);
        let svc = find(&objs, "Service", "kvmesh-gateway");
        let server = &find(&objs, "Gateway", "kvmesh-gateway")["spec"]["servers"][0];
        assert_eq!(
            server["port"]["number"], svc["spec"]["ports"][0]["port"],
            "{what}: the Gateway's port is the Service's"
        );
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], 8080, "{what}: the EnvoyFilters patch the 8080 listener");
        assert_eq!(find(&objs, "VirtualService", "llm")["spec"]["hosts"], json!(["llm.example.org"]));
        let policy = find(&objs, "AuthorizationPolicy", "kvmesh-cp");
        assert_eq!(policy["spec"]["rules"][1]["from"][0]["source"]["namespaces"], json!(["llm-serving", "monitoring"]));
        let gw_labels = labels(gateway);
        let pdb = find(&objs, "PodDisruptionBudget", "kvmesh-gateway");
        let sel: BTreeMap<String, String> =
            serde_json::from_value(pdb["spec"]["selector"]["matchLabels"].clone()).unwrap();
        assert!(sel.iter().all(|(k, v)| gw_labels.get(k) == Some(v)), "{what}: the PDB selects no gateway pod");
        let pod_monitor = find(&objs, "PodMonitor", "kvmesh-gateway");
        let sel: BTreeMap<String, String> =
            serde_json::from_value(pod_monitor["spec"]["selector"]["matchLabels"].clone()).unwrap();
        assert!(sel.iter().all(|(k, v)| gw_labels.get(k) == Some(v)), "{what}: the PodMonitor selects no gateway pod");
        let monitor = find(&objs, "ServiceMonitor", "kvmesh-cp");
        let cp_svc = find(&objs, "Service", "kvmesh-cp");
        let port = monitor["spec"]["endpoints"][0]["port"].as_str().unwrap();
        assert!(
            cp_svc["spec"]["ports"].as_array().unwrap().iter().any(|p| p["name"] == port),
            "{what}: no port {port}"
        );
        assert_eq!(monitor["spec"]["selector"]["matchLabels"], cp_svc["spec"]["selector"]);
    }
}

#[test]
fn the_dashboard_configmap_is_the_repository_dashboard() {
    let objs = render(&[], json!({"workerCidrs": ["10.0.0.0/8"]}));
    let cm = find(&objs, "ConfigMap", "kvmesh-grafana-dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let file = std::fs::read_to_string(repo_root().join("docs/grafana/kvmesh.json")).unwrap();
    let shipped: Value = serde_json::from_str(cm["data"]["kvmesh.json"].as_str().unwrap()).unwrap();
    assert_eq!(shipped, serde_json::from_str::<Value>(&file).unwrap());
}

#[test]
fn values_that_cannot_work_are_refused() {
    let refused = |values: Value, why: &str| {
        let err = helm_template("kvmesh", &[], &values).expect_err(&format!("{values} rendered"));
        assert!(err.contains(why), "{values}: {err}");
    };
    refused(json!({}), "workerCidrs");
    let ok = json!({"workerCidrs": ["10.0.0.0/8"]});
    let with = |extra: Value| {
        let mut v = ok.clone();
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    };
    refused(with(json!({"mode": "disaggregated"})), "mode");
    refused(with(json!({"mode": "pd", "pd": {"protocol": "triton"}})), "protocol");
    refused(with(json!({"workerCIDRs": ["10.0.0.0/8"]})), "workerCIDRs");
    refused(with(json!({"kvEvents": {"enabled": true}})), "kvEvents.tokenizerConfigMap");
    // An existing Secret's token cannot be read without a cluster: say so, never render a
    // filter with a wrong token.
    refused(with(json!({"auth": {"existingSecret": "mine"}})), "auth.existingSecret");
    let objs = render(&[], with(json!({"auth": {"existingSecret": "mine", "grpcToken": "t0ken"}})));
    assert!(objs.iter().all(|o| o["kind"] != "Secret"), "an existing Secret is not created again");
    assert_eq!(filter_json(find(&objs, "EnvoyFilter", "kvmesh-gateway"))["control_plane_token"], "t0ken");
    let pod = &find(&objs, "Deployment", "kvmesh-cp")["spec"]["template"]["spec"];
    assert_eq!(pod["volumes"][1]["secret"]["secretName"], "mine");
    // The workers' key comes from that Secret too, when it holds one (read at start, not at
    // render time, so `helm template` cannot lose it); the chart never writes it there.
    assert_eq!(pod["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]["name"], "mine");
    let mine = json!({"existingSecret": "mine", "grpcToken": "t0ken"});
    refused(with(json!({"auth": mine, "workers": {"apiKey": "k"}})), "worker-api-key");
}
