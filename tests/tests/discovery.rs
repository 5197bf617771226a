//! Kubernetes discovery end to end: `kvmesh-cp --service-discovery` watching an in-process
//! API server (real list/watch protocol, real Pod objects; nothing here can install a real
//! one), simulated workers on their own loopback addresses as pod IPs, and a real Envoy; and
//! `--inference-pool`, from a real InferencePool object and its InferenceObjectives.

use std::collections::HashSet;
use std::time::Duration;

use kvmesh_testkit::e2e::{generate, served, sync, FAST};
use kvmesh_testkit::kube_fake::{inference_pool, pod, FakeKube};
use kvmesh_testkit::{free_port, http, repo_root, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

fn urls(cp: &ControlPlane) -> HashSet<String> {
    cp.workers().iter().map(|w| w["url"].as_str().unwrap().to_string()).collect()
}

fn wait_for_urls(cp: &ControlPlane, want: &[String]) {
    let want: HashSet<String> = want.iter().cloned().collect();
    wait_until(&format!("the control plane to list {want:?}"), Duration::from_secs(20), || urls(cp) == want)
        .unwrap_or_else(|e| panic!("{e}; it lists {:?}", urls(cp)));
}

fn synced_gateway(cp: &ControlPlane, template: &str, filter: Value) -> Envoy {
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.template = repo_root().join(template);
    opts.use_control_plane(cp);
    let envoy = Envoy::start(&opts).unwrap();
    sync(cp, &envoy);
    envoy
}

/// `kvmesh-cp` discovering `app=sglang` pods (workers on `port`) through `kube`, plus `extra` flags.
fn watching(kube: &FakeKube, port: u16, extra: &[&str]) -> ControlPlane {
    let kubeconfig = kube.kubeconfig().unwrap();
    let port_arg = port.to_string();
    let mut args = vec!["--service-discovery", "--selector", "app=sglang", "--service-discovery-port", &port_arg];
    args.extend_from_slice(extra);
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    ControlPlane::start_with_env(free_port().unwrap(), free_port().unwrap(), &args, &env).unwrap()
}

#[test]
fn ready_matching_pods_become_workers_and_leave_when_deleted() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"];
    let _sims: Vec<Sim> = ips.iter().map(|ip| Sim::start_at(ip, port, FAST).unwrap()).collect();
    let app = [("app", "sglang")];
    kube.apply(pod("default", "w2", ips[0], true, &app, &[]));
    kube.apply(pod("default", "w3", ips[1], true, &app, &[]));
    kube.apply(pod("default", "w4", ips[2], false, &app, &[])); // not Ready yet
    kube.apply(pod("default", "w5", ips[3], true, &[("app", "other")], &[])); // not selected
    kube.apply(pod("elsewhere", "w6", "127.0.0.6", true, &app, &[])); // other namespace

    let cp = watching(&kube, port, &["--service-discovery-namespace", "default"]);
    let url = |ip: &str| format!("http://{ip}:{port}");
    wait_for_urls(&cp, &[url(ips[0]), url(ips[1])]);

    let envoy = synced_gateway(&cp, "envoy/envoy.yaml", json!({"worker_urls": []}));
    let mut seen = HashSet::new();
    for i in 0..8 {
        seen.insert(served(&generate(&envoy, &format!("{i} {}", "prompt ".repeat(30)))));
    }
    let allowed: HashSet<String> = [ips[0], ips[1]].iter().map(|ip| format!("{ip}:{port}")).collect();
    assert!(seen.is_subset(&allowed), "{seen:?}");

    // Becoming Ready brings a pod in; deletion takes one out, and traffic follows.
    kube.apply(pod("default", "w4", ips[2], true, &app, &[]));
    wait_for_urls(&cp, &[url(ips[0]), url(ips[1]), url(ips[2])]);
    kube.delete("default", "w2");
    wait_for_urls(&cp, &[url(ips[1]), url(ips[2])]);
    sync(&cp, &envoy);
    for i in 0..8 {
        let w = served(&generate(&envoy, &format!("after {i} {}", "prompt ".repeat(30))));
        assert_ne!(w, format!("{}:{port}", ips[0]), "a deleted pod gets no traffic");
    }
}

#[test]
fn pd_roles_and_bootstrap_ports_come_from_labels_and_annotations() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let boot = free_port().unwrap();
    let boot_arg = boot.to_string();
    let (prefill_ip, decode_ip) = ("127.0.0.7", "127.0.0.8");
    let _prefill =
        Sim::start_at(prefill_ip, port, &[FAST, &["--role", "prefill", "--bootstrap-port", &boot_arg]].concat())
            .unwrap();
    let _decode = Sim::start_at(decode_ip, port, &[FAST, &["--role", "decode"]].concat()).unwrap();
    kube.apply(pod(
        "default",
        "p",
        prefill_ip,
        true,
        &[("app", "sglang"), ("llm-d.ai/role", "prefill")],
        &[("sglang.ai/bootstrap-port", &boot_arg)],
    ));
    kube.apply(pod("default", "d", decode_ip, true, &[("app", "sglang"), ("llm-d.ai/role", "decode")], &[]));

    let cp = watching(&kube, port, &["--pd-disaggregation"]);
    wait_for_urls(&cp, &[format!("http://{prefill_ip}:{port}"), format!("http://{decode_ip}:{port}")]);
    let listed = cp.workers();
    let prefill = listed.iter().find(|w| w["role"] == "prefill").expect("a prefill worker");
    assert_eq!(prefill["bootstrap_port"], boot);
    assert!(listed.iter().any(|w| w["role"] == "decode"));

    // And requests are served through the discovered pair.
    let envoy = synced_gateway(&cp, "envoy/envoy-pd.yaml", json!({"prefill": [], "decode": []}));
    let r = generate(&envoy, "discovered PD");
    assert_eq!(served(&r), format!("{decode_ip}:{port}"));
    assert_eq!(r.header("x-kvmesh-prefill"), Some(format!("{prefill_ip}:{port}").as_str()));
}

/// Per-pod PD protocols: in an SGLang deployment (`--pd-protocol sglang`), a vLLM prefill pod
/// and a vLLM decode pod annotated `kvmesh.io/pd-protocol: vllm` form a second kind of pair.
/// Every request goes to a pair of one protocol, run in it (the vLLM decode pulls its KV from
/// the vLLM prefill, which fails the request otherwise); `/workers` says who speaks what; a
/// `llm-d.ai/role: both` pod is listed as either role.
#[test]
fn a_pods_annotation_sets_its_pd_protocol_and_pairs_speak_one() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let boot = free_port().unwrap();
    let boot_arg = boot.to_string();
    let (sp, sd, vp, vd, both) = ("127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14", "127.0.0.15");
    let vllm = ["--engine", "vllm"];
    let _sims = [
        Sim::start_at(sp, port, &[FAST, &["--role", "prefill", "--bootstrap-port", &boot_arg]].concat()).unwrap(),
        Sim::start_at(sd, port, &[FAST, &["--role", "decode"]].concat()).unwrap(),
        Sim::start_at(vp, port, &[FAST, &vllm, &["--role", "prefill"]].concat()).unwrap(),
        Sim::start_at(vd, port, &[FAST, &vllm, &["--role", "decode"]].concat()).unwrap(),
    ];
    let role = |r: &'static str| [("app", "sglang"), ("llm-d.ai/role", r)];
    let speaks_vllm = [("kvmesh.io/pd-protocol", "vllm")];
    kube.apply(pod("default", "sp", sp, true, &role("prefill"), &[("sglang.ai/bootstrap-port", &boot_arg)]));
    kube.apply(pod("default", "sd", sd, true, &role("decode"), &[]));
    kube.apply(pod("default", "vp", vp, true, &role("prefill"), &speaks_vllm));
    kube.apply(pod("default", "vd", vd, true, &role("decode"), &speaks_vllm));

    let cp =
        watching(&kube, port, &["--pd-disaggregation", "--pd-protocol", "sglang", "--decode-policy", "round_robin"]);
    let url = |ip: &str| format!("http://{ip}:{port}");
    wait_for_urls(&cp, &[url(sp), url(sd), url(vp), url(vd)]);
    for (ip, protocol) in [(sp, "sglang"), (sd, "sglang"), (vp, "vllm"), (vd, "vllm")] {
        assert_eq!(cp.worker(&url(ip))["pd_protocol"], protocol, "{ip}");
    }

    let envoy = synced_gateway(&cp, "envoy/envoy-pd.yaml", json!({"prefill": [], "decode": []}));
    let mut pairs = HashSet::new();
    let mut to_vd = 0;
    for i in 0..8 {
        let body =
            json!({"model": "kvmesh-sim", "prompt": format!("{i} {}", "mixed fleet ".repeat(40)), "max_tokens": 2});
        let r = kvmesh_testkit::http::post_json(&envoy.url("/v1/completions"), &body).unwrap();
        let decode = served(&r);
        let prefill = r.header("x-kvmesh-prefill").unwrap_or_else(|| panic!("request {i} split: {:?}", r.headers));
        to_vd += u64::from(decode == format!("{vd}:{port}"));
        pairs.insert((decode, prefill.to_string()));
    }
    let pair = |p: &str, d: &str| (format!("{d}:{port}"), format!("{p}:{port}"));
    assert_eq!(pairs, HashSet::from([pair(sp, sd), pair(vp, vd)]), "one protocol per pair, both pairs used");
    let stats = |ip: &str| kvmesh_testkit::http::get(&format!("{}/sim/stats", url(ip))).unwrap().json().unwrap();
    assert_eq!(stats(vd)["kv_transfers_ok"], to_vd, "every vLLM decode pulled its vLLM prefill's KV");
    assert_eq!(stats(vd)["kv_transfers_failed"], 0);

    // A pod of role `both` is listed as such (either leg), in the deployment's protocol.
    kube.apply(pod("default", "b", both, true, &role("both"), &[]));
    wait_for_urls(&cp, &[url(sp), url(sd), url(vp), url(vd), url(both)]);
    assert_eq!(cp.worker(&url(both))["role"], "both");
    assert_eq!(cp.worker(&url(both))["pd_protocol"], "sglang");
}

/// `--state-file` with discovered workers: a restarted control plane finds the same pods under
/// the same ids (not renumbered from 0 in discovery order), and a prefix routed before the
/// restart goes to the same worker after it.
#[test]
fn a_restarted_control_plane_keeps_discovered_workers_ids_and_their_prefixes() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let _sims: Vec<Sim> = ips.iter().map(|ip| Sim::start_at(ip, port, FAST).unwrap()).collect();
    let app = [("app", "sglang")];
    let dir = kvmesh_testkit::scratch_dir("discovery-state").unwrap();
    let file = dir.path().join("state.json");
    let file_arg = file.to_str().unwrap().to_string();
    let url = |ip: &str| format!("http://{ip}:{port}");
    // Ids 0, 1, then 2; the first pod leaves: the workers left have ids 1 and 2.
    kube.apply(pod("default", "w2", ips[0], true, &app, &[]));
    let mut cp = watching(&kube, port, &["--state-file", &file_arg]);
    wait_for_urls(&cp, &[url(ips[0])]);
    kube.apply(pod("default", "w3", ips[1], true, &app, &[]));
    wait_for_urls(&cp, &[url(ips[0]), url(ips[1])]);
    kube.apply(pod("default", "w4", ips[2], true, &app, &[]));
    wait_for_urls(&cp, &[url(ips[0]), url(ips[1]), url(ips[2])]);
    kube.delete("default", "w2");
    wait_for_urls(&cp, &[url(ips[1]), url(ips[2])]);
    let ids = |cp: &ControlPlane| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> =
            cp.workers().iter().map(|w| (w["url"].as_str().unwrap().to_string(), w["id"].as_u64().unwrap())).collect();
        v.sort();
        v
    };
    let before = ids(&cp);
    assert_eq!(before.iter().map(|(_, id)| *id).collect::<Vec<_>>(), vec![1, 2], "{before:?}");

    let envoy = synced_gateway(&cp, "envoy/envoy.yaml", json!({"worker_urls": []}));
    let prefix = "a conversation with a long shared history ".repeat(12);
    let ask = |tail: &str| served(&generate(&envoy, &format!("{prefix}{tail}")));
    let home = ask("before");
    let home_url = Some(format!("http://{home}"));
    wait_until("the control plane to learn the prefix", Duration::from_secs(10), || cp.holder(&prefix) == home_url)
        .unwrap();

    cp.restart().unwrap();
    wait_until(
        "the restarted control plane to list the same workers under the same ids",
        Duration::from_secs(20),
        || ids(&cp) == before,
    )
    .unwrap_or_else(|e| panic!("{e}: {:?} (before: {before:?})", ids(&cp)));
    // The gateway reconnects and re-reports its index under the ids of the table it got.
    wait_until("the gateway to re-report the prefix", Duration::from_secs(20), || cp.holder(&prefix) == home_url)
        .unwrap();
    sync(&cp, &envoy);
    // Found in the gateway's index under the same worker id: a cache hit at the same worker
    // (a fresh placement would choose between the two by the prefix's hash alone).
    let hits = envoy.cache_hits();
    assert_eq!(ask("after the restart"), home, "the prefix stays with its worker");
    assert_eq!(envoy.cache_hits(), hits + 1, "the prefix is a cache hit after the restart");
}

/// `kvmesh-cp --inference-pool NAME`: the workers are the pods a Gateway API Inference
/// Extension InferencePool (`inference.networking.k8s.io/v1`, a real object served by the API
/// server) selects, on each of its target ports, and follow the pool's edits and deletion.
#[test]
fn an_inference_pools_selector_and_target_ports_choose_the_workers_and_are_followed() {
    let kube = FakeKube::start().unwrap();
    let (p1, p2) = (free_port().unwrap(), free_port().unwrap());
    let (a1, a2, b1) = ("127.0.0.21", "127.0.0.22", "127.0.0.23");
    let _sims: Vec<Sim> = [(a1, p1), (a2, p1), (b1, p1), (a1, p2), (a2, p2)]
        .iter()
        .map(|(ip, p)| Sim::start_at(ip, *p, FAST).unwrap())
        .collect();
    let (vllm_a, vllm_b) = ([("app", "vllm-a")], [("app", "vllm-b")]);
    kube.apply(pod("default", "a1", a1, true, &vllm_a, &[]));
    kube.apply(pod("default", "a2", a2, true, &vllm_a, &[]));
    kube.apply(pod("default", "b1", b1, true, &vllm_b, &[]));
    kube.apply(pod("other", "a3", "127.0.0.24", true, &vllm_a, &[])); // a pool selects in its namespace
    kube.apply_pool(&inference_pool("default", "pool", &vllm_a, &[p1]));
    kube.apply_pool(&inference_pool("default", "another-pool", &vllm_b, &[p1]));
    // The pool's InferenceObjectives give priorities (another pool's does not).
    kube.apply_objective("default", "batch", "pool", -1);
    kube.apply_objective("default", "chat", "another-pool", 2);

    // The namespace is the kubeconfig context's (`default`), as for any namespaced client.
    let kubeconfig = kube.kubeconfig().unwrap();
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    let args = ["--inference-pool", "pool", "--max-concurrent-requests", "64"];
    let cp = ControlPlane::start_with_env(free_port().unwrap(), free_port().unwrap(), &args, &env).unwrap();
    let url = |ip: &str, port: u16| format!("http://{ip}:{port}");
    wait_for_urls(&cp, &[url(a1, p1), url(a2, p1)]);
    let objectives = || cp.snapshot().map(|s| s["settings"]["priority_objective"].clone()).unwrap_or_default();
    wait_until("kvmesh-cp to ship the pool's objectives", Duration::from_secs(20), || {
        objectives() == json!(["batch=-1"])
    })
    .unwrap_or_else(|e| panic!("{e}; it ships {}", objectives()));
    let envoy = synced_gateway(&cp, "envoy/envoy.yaml", json!({"worker_urls": []}));
    let seen: HashSet<String> =
        (0..6).map(|i| served(&generate(&envoy, &format!("{i} {}", "pooled ".repeat(30))))).collect();
    let pool_a: HashSet<String> = [a1, a2].iter().map(|ip| format!("{ip}:{p1}")).collect();
    assert!(seen.is_subset(&pool_a), "{seen:?}");
    // A request naming the objective is of its class (sheddable, admitted while slots are free).
    let sheddable = || {
        let text = http::get(&envoy.admin_url("/stats/prometheus")).map(|r| r.text()).unwrap_or_default();
        text.lines().any(|l| l.contains("kvmesh_class_admitted_total{") && l.contains("class=\"sheddable\""))
    };
    assert!(!sheddable());
    let headers = [("content-type", "application/json"), ("x-gateway-inference-objective", "batch")];
    let r = http::post(&envoy.url("/generate"), br#"{"text":"a batch job"}"#, &headers).unwrap();
    served(&r);
    assert!(sheddable(), "the objective's priority -1 made the request sheddable");

    // A second target port: every pod is a worker on each.
    kube.apply_pool(&inference_pool("default", "pool", &vllm_a, &[p1, p2]));
    wait_for_urls(&cp, &[url(a1, p1), url(a2, p1), url(a1, p2), url(a2, p2)]);
    // A new selector re-selects the pods; traffic follows.
    kube.apply_pool(&inference_pool("default", "pool", &vllm_b, &[p1]));
    wait_for_urls(&cp, &[url(b1, p1)]);
    sync(&cp, &envoy);
    // kvmesh-cp sent the new table once Envoy's endpoints listed the new pod: the first
    // request after the sync goes there (it once went to a deselected pod, through the
    // cluster's fallback load balancer, when the table beat the endpoints).
    assert_eq!(served(&generate(&envoy, "after the selector changed")), format!("{b1}:{p1}"));
    // A deleted pool takes its workers out; created again, they come back.
    kube.delete_pool("default", "pool");
    wait_for_urls(&cp, &[]);
    kube.apply_pool(&inference_pool("default", "pool", &vllm_a, &[p2]));
    wait_for_urls(&cp, &[url(a1, p2), url(a2, p2)]);
}

/// `--model-id-from label:KEY` (SMG's flag): discovered pods serve the model their label
/// names, the gateway routes that model to them, and a relabelled pod serves its new name
/// under the same worker id.
#[test]
fn a_pods_label_names_its_model_and_a_relabel_renames_it_in_place() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let (llama, qwen) = ("127.0.0.31", "127.0.0.32");
    let _sims: Vec<Sim> = [llama, qwen].iter().map(|ip| Sim::start_at(ip, port, FAST).unwrap()).collect();
    let labelled = |model: &'static str| [("app", "sglang"), ("kvmesh.io/model", model)];
    kube.apply(pod("default", "llama", llama, true, &labelled("llama"), &[]));
    kube.apply(pod("default", "qwen", qwen, true, &labelled("qwen"), &[]));
    let cp = watching(&kube, port, &["--model-id-from", "label:kvmesh.io/model"]);
    let url = |ip: &str| format!("http://{ip}:{port}");
    let model_of = |ip: &str| cp.worker(&url(ip))["model_id"].as_str().map(String::from);
    let wait_for_model = |ip: &str, model: &str| {
        wait_until(&format!("{ip} to serve {model}"), Duration::from_secs(20), || {
            model_of(ip).as_deref() == Some(model)
        })
        .unwrap_or_else(|e| panic!("{e}: {:?}", cp.workers()));
    };
    wait_for_model(llama, "llama");
    wait_for_model(qwen, "qwen");
    let served_names = |ip: &str| cp.worker(&url(ip))["models"].as_array().cloned().unwrap_or_default();
    assert!(served_names(llama).iter().any(|m| m["id"] == "llama"), "{:?}", served_names(llama));

    let envoy = synced_gateway(&cp, "envoy/envoy.yaml", json!({"worker_urls": []}));
    let ask = |model: &str, prompt: &str| {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
        kvmesh_testkit::http::post_json(&envoy.url("/v1/completions"), &body).unwrap()
    };
    for i in 0..4 {
        assert_eq!(served(&ask("llama", &format!("llama {i}"))), format!("{llama}:{port}"));
        assert_eq!(served(&ask("qwen", &format!("qwen {i}"))), format!("{qwen}:{port}"));
    }

    let id = cp.worker(&url(llama))["id"].clone();
    kube.apply(pod("default", "llama", llama, true, &labelled("llama-3"), &[]));
    wait_for_model(llama, "llama-3");
    assert_eq!(cp.worker(&url(llama))["id"], id, "the same worker, renamed in place");
    sync(&cp, &envoy);
    assert_eq!(served(&ask("llama-3", "renamed")), format!("{llama}:{port}"));
    assert_eq!(ask("llama", "the old name").status, 404, "no worker serves the old name");
}
