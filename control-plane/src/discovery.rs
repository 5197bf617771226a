//! Kubernetes discovery: a kube-runtime watcher and reflector over pods, and a pure function
//! from the pods in the store to the workers they call for, reconciled into the registry
//! after every event. Pods that are not Ready, have no IP, are terminating, or stop matching
//! leave the registry; only workers discovery added are ever removed by it.
//!
//! In PD mode a pod's role comes from the role selectors or the role label (`prefill`,
//! `decode`, or `both`: either role, request by request), and its PD protocol from the
//! [`PD_PROTOCOL_ANNOTATION`] when it is not the deployment's `--pd-protocol`.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use kvmesh_core::settings::PdProtocol;
use kvmesh_proto::v1::Role;

pub use crate::settings::{DiscoveryConfig, KvEventEndpoints, ModelIdFrom};
use crate::state::{Source, State};

/// The pod annotation naming the PD protocol a pod speaks (`sglang`, `vllm`, `llm-d`) when
/// it is not the deployment's `--pd-protocol`.
pub const PD_PROTOCOL_ANNOTATION: &str = "kvmesh.io/pd-protocol";

/// The pod annotation naming its engine's KV-event publisher and replay socket,
/// `tcp://{host}:5557[,tcp://{host}:5558]` (`{host}`: the pod's IP), over `--kv-events-endpoint`.
pub const KV_EVENTS_ANNOTATION: &str = "kvmesh.io/kv-events-endpoint";

/// A worker a pod calls for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Desired {
    pub url: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    /// Its PD protocol, when the pod's annotation names one.
    pub pd_protocol: Option<PdProtocol>,
    /// Its own model name (`--model-id-from`), when the pod's metadata gives one.
    pub model_id: Option<String>,
    /// Its engine's KV-event publisher ([`KV_EVENTS_ANNOTATION`]).
    pub kv_events: Option<KvEventEndpoints>,
}

/// [`KV_EVENTS_ANNOTATION`]'s value for a pod at `host`.
fn kv_events_of(value: &str, host: &str) -> Option<KvEventEndpoints> {
    let ok = |e: &str| {
        e.strip_prefix("tcp://")
            .and_then(|r| r.rsplit_once(':'))
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
    };
    let value = value.replace("{host}", host);
    let (publisher, replay) = match value.split_once(',') {
        Some((p, r)) => (p.trim().to_string(), Some(r.trim().to_string())),
        None => (value.trim().to_string(), None),
    };
    (value.len() <= 512 && ok(&publisher) && replay.as_deref().is_none_or(ok))
        .then_some(KvEventEndpoints { publisher, replay })
}

fn matches(labels: &BTreeMap<String, String>, selector: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The role of a pod, if it is a worker at all.
fn role_of(pod_labels: &BTreeMap<String, String>, cfg: &DiscoveryConfig) -> Option<Role> {
    if !matches(pod_labels, &cfg.selector) {
        return None;
    }
    if !cfg.pd {
        return Some(Role::Regular);
    }
    if !cfg.prefill_selector.is_empty() && matches(pod_labels, &cfg.prefill_selector) {
        return Some(Role::Prefill);
    }
    if !cfg.decode_selector.is_empty() && matches(pod_labels, &cfg.decode_selector) {
        return Some(Role::Decode);
    }
    match pod_labels.get(&cfg.role_label).map(String::as_str) {
        Some("prefill") => Some(Role::Prefill),
        Some("decode") => Some(Role::Decode),
        // Either role, request by request (a prefill worker for one, a decode worker for
        // another, alone when it has no partner).
        Some("both") => Some(Role::Both),
        _ => None,
    }
}

/// The workers the pods call for.
pub fn desired<'a>(pods: impl IntoIterator<Item = &'a Pod>, cfg: &DiscoveryConfig) -> Vec<Desired> {
    let mut out = Vec::new();
    for pod in pods {
        if pod.metadata.deletion_timestamp.is_some() || !ready(pod) {
            continue;
        }
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()).filter(|ip| !ip.is_empty()) else {
            continue;
        };
        let empty = BTreeMap::new();
        let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
        let Some(role) = role_of(labels, cfg) else { continue };
        let annotation = |key: &str| pod.metadata.annotations.as_ref().and_then(|a| a.get(key));
        let bootstrap_port = matches!(role, Role::Prefill | Role::Both)
            .then(|| annotation(&cfg.bootstrap_annotation)?.parse::<u16>().ok())
            .flatten();
        let pd_protocol = match annotation(PD_PROTOCOL_ANNOTATION).filter(|_| cfg.pd) {
            None => None,
            Some(name) => match name.parse::<PdProtocol>() {
                Ok(p) => Some(p),
                Err(e) => {
                    // Routed in another protocol than it speaks, every request would fail.
                    let name = pod.metadata.name.as_deref().unwrap_or("?");
                    tracing::warn!(pod = name, "pod left out: {PD_PROTOCOL_ANNOTATION}: {e}");
                    continue;
                }
            },
        };
        let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
        let model_id = match &cfg.model_id_from {
            None => None,
            Some(ModelIdFrom::Namespace) => pod.metadata.namespace.clone(),
            Some(ModelIdFrom::Label(key)) => labels.get(key).cloned(),
            Some(ModelIdFrom::Annotation(key)) => annotation(key).cloned(),
        }
        .filter(|m| !m.is_empty() && m.len() <= kvmesh_core::models::MAX_MODEL_NAME);
        let kv_events = annotation(KV_EVENTS_ANNOTATION).and_then(|v| kv_events_of(v, &host));
        // One worker per port (an InferencePool's target ports are each an endpoint).
        for port in &cfg.ports {
            // Spelled as the registry keeps it, so that reconciling compares like with like.
            let url = format!("http://{host}:{port}");
            let url = crate::urls::canonical(&url).unwrap_or(url);
            let kv_events = kv_events.clone();
            out.push(Desired { url, role, bootstrap_port, pd_protocol, model_id: model_id.clone(), kv_events });
        }
    }
    out.sort_by(|a, b| a.url.cmp(&b.url));
    out
}

/// Makes the registry's discovered workers equal to `want`.
pub fn reconcile(state: &State, want: &[Desired]) {
    let span = tracing::info_span!(target: crate::telemetry::SPANS, "discovery.reconcile", wanted = want.len(),
                                   workers = tracing::field::Empty);
    let _in = span.enter();
    let wanted: HashSet<&Desired> = want.iter().collect();
    let current = state.workers();
    for w in current.iter().filter(|w| w.source == Source::Discovery) {
        // A changed model name is set in place (the worker keeps its id and index).
        let wanted_one = want.iter().find(|d| d.url == w.url);
        let same = Desired {
            url: w.url.clone(),
            role: w.role,
            bootstrap_port: w.bootstrap_port,
            pd_protocol: w.pd_protocol,
            model_id: wanted_one.and_then(|d| d.model_id.clone()),
            kv_events: wanted_one.and_then(|d| d.kv_events.clone()),
        };
        if !wanted.contains(&same) {
            state.remove_worker(&w.url);
        }
    }
    let have: HashSet<String> = state.workers().into_iter().map(|w| w.url).collect();
    for d in want.iter().filter(|d| !have.contains(&d.url)) {
        if let Err(e) = state.add_pd_worker(&d.url, d.role, d.bootstrap_port, d.pd_protocol, Source::Discovery) {
            tracing::warn!(url = %d.url, "discovered worker not added: {e}");
        }
    }
    for w in state.workers().into_iter().filter(|w| w.source == Source::Discovery) {
        let wanted_one = want.iter().find(|d| d.url == w.url);
        state.set_model_id(w.id, wanted_one.and_then(|d| d.model_id.clone()));
        state.set_kv_events(w.id, wanted_one.and_then(|d| d.kv_events.clone()));
    }
    span.record("workers", state.workers().len());
}

fn selector_string(selector: &BTreeMap<String, String>) -> String {
    selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Watches pods until the process ends (the watcher retries with backoff on errors).
pub async fn run(state: Arc<State>, cfg: DiscoveryConfig) -> anyhow::Result<()> {
    let client = Client::try_default().await.map_err(|e| anyhow::anyhow!("cannot reach the Kubernetes API: {e}"))?;
    let api: Api<Pod> = match &cfg.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    watch_pods(&state, api, &cfg).await;
    Ok(())
}

/// Watches `api`'s pods matching `cfg.selector`, reconciling the registry after every event,
/// until the stream ends (the watcher retries with backoff on errors).
pub async fn watch_pods(state: &State, api: Api<Pod>, cfg: &DiscoveryConfig) {
    // The base selector narrows the watch; role selectors are applied to what it returns.
    let mut wc = watcher::Config::default();
    if !cfg.selector.is_empty() {
        wc = wc.labels(&selector_string(&cfg.selector));
    }
    let (reader, writer) = reflector::store();
    let events = reflector(writer, watcher(api, wc)).default_backoff();
    tracing::info!(namespace = ?cfg.namespace, selector = %selector_string(&cfg.selector), ports = ?cfg.ports, "watching pods");
    futures_util::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::InitApply(_) | watcher::Event::Init) => {}
            Ok(_) => {
                let pods = reader.state();
                reconcile(state, &desired(pods.iter().map(|p| p.as_ref()), cfg));
            }
            Err(e) => tracing::warn!("pod watch: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: bool, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        kvmesh_testkit::kube_fake::pod("default", name, ip, ready, labels, annotations)
    }

    fn cfg(pd: bool) -> DiscoveryConfig {
        DiscoveryConfig {
            selector: [("app".to_string(), "sglang".to_string())].into(),
            ports: vec![8000],
            bootstrap_annotation: "sglang.ai/bootstrap-port".into(),
            role_label: "llm-d.ai/role".into(),
            pd,
            ..Default::default()
        }
    }

    #[test]
    fn ready_matching_pods_with_an_ip_are_workers() {
        let pods = [
            pod("a", "10.0.0.1", true, &[("app", "sglang")], &[]),
            pod("b", "10.0.0.2", false, &[("app", "sglang")], &[]),
            pod("c", "", true, &[("app", "sglang")], &[]),
            pod("d", "10.0.0.4", true, &[("app", "other")], &[]),
            pod("e", "fd00::5", true, &[("app", "sglang")], &[]),
        ];
        let want = desired(&pods, &cfg(false));
        let urls: Vec<&str> = want.iter().map(|d| d.url.as_str()).collect();
        assert_eq!(urls, vec!["http://10.0.0.1:8000", "http://[fd00::5]:8000"]);
        assert!(want.iter().all(|d| d.role == Role::Regular));
    }

    #[test]
    fn a_pod_is_a_worker_on_each_port() {
        let pods = [
            pod("a", "10.0.0.1", true, &[("app", "sglang")], &[]),
            pod("b", "10.0.0.2", true, &[("app", "sglang")], &[]),
        ];
        let mut c = cfg(false);
        c.ports = vec![8000, 8001];
        let urls: Vec<String> = desired(&pods, &c).into_iter().map(|d| d.url).collect();
        assert_eq!(
            urls,
            ["http://10.0.0.1:8000", "http://10.0.0.1:8001", "http://10.0.0.2:8000", "http://10.0.0.2:8001"]
        );
    }

    #[test]
    fn discovered_urls_are_spelled_as_the_registry_keeps_them() {
        let pods = [
            pod("a", "FD00:0:0::7", true, &[("app", "sglang")], &[]),
            pod("b", "::ffff:10.0.0.8", true, &[("app", "sglang")], &[]),
        ];
        let want = desired(&pods, &cfg(false));
        let urls: Vec<&str> = want.iter().map(|d| d.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.8:8000", "http://[fd00::7]:8000"]);
        // Reconciling again changes nothing: no worker is removed and added back.
        let s = crate::state::test_state(&["--disable-health-check"]);
        reconcile(&s, &want);
        let ids: Vec<u32> = s.workers().iter().map(|w| w.id).collect();
        reconcile(&s, &desired(&pods, &cfg(false)));
        assert_eq!(s.workers().iter().map(|w| w.id).collect::<Vec<_>>(), ids);
    }

    #[test]
    fn pd_roles_from_selectors_or_the_role_label() {
        let pods = [
            pod(
                "p",
                "10.0.0.1",
                true,
                &[("app", "sglang"), ("llm-d.ai/role", "prefill")],
                &[("sglang.ai/bootstrap-port", "8998")],
            ),
            pod("d", "10.0.0.2", true, &[("app", "sglang"), ("llm-d.ai/role", "decode")], &[]),
            pod("b", "10.0.0.3", true, &[("app", "sglang"), ("llm-d.ai/role", "both")], &[]),
            pod("n", "10.0.0.4", true, &[("app", "sglang")], &[]),
        ];
        let want = desired(&pods, &cfg(true));
        assert_eq!(want.len(), 3);
        assert_eq!((want[0].role, want[0].bootstrap_port), (Role::Prefill, Some(8998)));
        assert_eq!(want[1].role, Role::Decode);
        assert_eq!(want[2].role, Role::Both, "either role, not decode only");
        let mut c = cfg(true);
        c.prefill_selector = [("tier".to_string(), "p".to_string())].into();
        let pods = [pod("x", "10.0.0.9", true, &[("app", "sglang"), ("tier", "p")], &[])];
        assert_eq!(desired(&pods, &c)[0].role, Role::Prefill);
    }

    #[test]
    fn a_pods_annotation_names_its_kv_event_publisher() {
        let pods = [
            pod(
                "a",
                "10.0.0.1",
                true,
                &[("app", "sglang")],
                &[(KV_EVENTS_ANNOTATION, "tcp://{host}:5557,tcp://{host}:5558")],
            ),
            pod("b", "10.0.0.2", true, &[("app", "sglang")], &[(KV_EVENTS_ANNOTATION, "zmq://nonsense")]),
            pod("c", "10.0.0.3", true, &[("app", "sglang")], &[]),
        ];
        let want = desired(&pods, &cfg(false));
        assert_eq!(
            want[0].kv_events,
            Some(KvEventEndpoints {
                publisher: "tcp://10.0.0.1:5557".into(),
                replay: Some("tcp://10.0.0.1:5558".into())
            })
        );
        assert_eq!(want[1].kv_events, None, "a bad value is ignored");
        assert_eq!(want[2].kv_events, None);
    }

    #[test]
    fn a_pods_annotation_names_its_pd_protocol() {
        let pd = |name: &str, ip: &str, role: &str, annotations: &[(&str, &str)]| {
            pod(name, ip, true, &[("app", "sglang"), ("llm-d.ai/role", role)], annotations)
        };
        let pods = [
            pd("a", "10.0.0.1", "prefill", &[]),
            pd("b", "10.0.0.2", "decode", &[(PD_PROTOCOL_ANNOTATION, "vllm")]),
            pd("c", "10.0.0.3", "both", &[(PD_PROTOCOL_ANNOTATION, "llm-d"), ("sglang.ai/bootstrap-port", "8998")]),
            pd("d", "10.0.0.4", "decode", &[(PD_PROTOCOL_ANNOTATION, "nixl")]),
        ];
        let want = desired(&pods, &cfg(true));
        let got: Vec<_> = want.iter().map(|d| (d.url.as_str(), d.role, d.bootstrap_port, d.pd_protocol)).collect();
        assert_eq!(
            got,
            [
                ("http://10.0.0.1:8000", Role::Prefill, None, None),
                ("http://10.0.0.2:8000", Role::Decode, None, Some(PdProtocol::Vllm)),
                ("http://10.0.0.3:8000", Role::Both, Some(8998), Some(PdProtocol::LlmD)),
            ],
            "a protocol kvmesh does not know leaves the pod out"
        );
        // Outside PD mode the annotation means nothing.
        let regular = [pod("r", "10.0.0.5", true, &[("app", "sglang")], &[(PD_PROTOCOL_ANNOTATION, "nixl")])];
        assert_eq!(desired(&regular, &cfg(false))[0].pd_protocol, None);

        // The registry keeps it, and a changed annotation replaces the worker.
        let s = crate::state::test_state(&["--disable-health-check"]);
        reconcile(&s, &want);
        let of = |url: &str| s.workers().into_iter().find(|w| w.url == url).map(|w| (w.id, w.role, w.pd_protocol));
        assert_eq!(of("http://10.0.0.3:8000").map(|w| (w.1, w.2)), Some((Role::Both, Some(PdProtocol::LlmD))));
        let before = of("http://10.0.0.2:8000").map(|w| w.0);
        let pods = [pd("b", "10.0.0.2", "decode", &[(PD_PROTOCOL_ANNOTATION, "sglang")])];
        reconcile(&s, &desired(&pods, &cfg(true)));
        let after = of("http://10.0.0.2:8000");
        assert_eq!(after.map(|w| w.2), Some(Some(PdProtocol::Sglang)));
        assert_ne!(after.map(|w| w.0), before, "a new worker, under a new id");
    }

    #[test]
    fn a_pods_metadata_names_its_model_and_a_new_name_keeps_the_worker() {
        let model = |name: &str, ip: &str, m: &str| {
            pod(name, ip, true, &[("app", "sglang"), ("kvmesh.io/model", m)], &[("model", &format!("{m}-a"))])
        };
        let pods = [model("a", "10.0.0.1", "llama"), model("b", "10.0.0.2", ""), model("c", "10.0.0.3", "qwen")];
        let mut c = cfg(false);
        let ids = |c: &DiscoveryConfig| desired(&pods, c).into_iter().map(|d| d.model_id).collect::<Vec<_>>();
        assert_eq!(ids(&c), [None, None, None], "without --model-id-from");
        c.model_id_from = Some("label:kvmesh.io/model".parse().unwrap());
        assert_eq!(ids(&c), [Some("llama".into()), None, Some("qwen".into())], "an empty label names nothing");
        c.model_id_from = Some("annotation:model".parse().unwrap());
        assert_eq!(ids(&c)[0].as_deref(), Some("llama-a"));
        c.model_id_from = Some("namespace".parse().unwrap());
        assert_eq!(ids(&c)[2].as_deref(), Some("default"));
        for bad in ["label:", "annotations:x", "pod", ""] {
            assert!(bad.parse::<ModelIdFrom>().is_err(), "{bad}");
        }

        // The registry serves the name first; a new name is set in place (same id, same index).
        c.model_id_from = Some("label:kvmesh.io/model".parse().unwrap());
        let s = crate::state::test_state(&["--disable-health-check"]);
        reconcile(&s, &desired(&pods, &c));
        let first = |url: &str| s.workers().into_iter().find(|w| w.url == url).map(|w| (w.id, w.served()));
        let (id, served) = first("http://10.0.0.1:8000").unwrap();
        assert_eq!(served[0].id, "llama");
        let pods = [model("a", "10.0.0.1", "llama-3")];
        reconcile(&s, &desired(&pods, &c));
        let (again, served) = first("http://10.0.0.1:8000").unwrap();
        assert_eq!((again, served[0].id.as_str()), (id, "llama-3"));
    }
}
