//! An in-process stand-in for the Kubernetes API server: pods and Gateway API Inference
//! Extension InferencePools (`inference.networking.k8s.io/v1`), speaking the real list and
//! watch protocol (`GET .../pods`, `?watch=true&resourceVersion=N` streaming newline-delimited
//! watch events; `labelSelector` and `fieldSelector` equality terms) with real `k8s-openapi`
//! Pod objects and InferencePool objects serialized as the v1 CRD's schema has them. Nothing
//! here can install a real API server; kube-runtime's watcher runs against this unchanged.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use tokio::sync::{oneshot, Notify};

/// The kinds of object the server holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Pod,
    InferencePool,
    InferenceObjective,
}

impl Kind {
    /// The list's `kind` and `apiVersion`.
    fn list(self) -> (&'static str, &'static str) {
        match self {
            Kind::Pod => ("PodList", "v1"),
            Kind::InferencePool => ("InferencePoolList", "inference.networking.k8s.io/v1"),
            Kind::InferenceObjective => ("InferenceObjectiveList", "inference.networking.x-k8s.io/v1alpha2"),
        }
    }
}

/// (kind, namespace, name).
type Key = (Kind, String, String);

mod lease;
pub use lease::Leases;

#[derive(Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// Every change: resource version, event type, kind, object.
    events: Vec<(u64, &'static str, Kind, Value)>,
}

#[derive(Clone, Default)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<Notify>,
}

/// A running fake API server; stops when dropped.
pub struct FakeKube {
    pub port: u16,
    shared: Shared,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Holds the kubeconfig files written for clients; removed with the server.
    dir: tempfile::TempDir,
    /// `coordination.k8s.io/v1` Leases (leader election).
    pub leases: Leases,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    watch: Option<String>,
    resource_version: Option<String>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    timeout_seconds: Option<u64>,
}

/// Whether every `k=v` (or `k==v`; a bare `k`: present) term holds, `value_of` giving a key's value.
fn terms_hold(selector: &Option<String>, value_of: impl Fn(&str) -> Option<String>) -> bool {
    let Some(sel) = selector.as_deref().filter(|s| !s.is_empty()) else { return true };
    sel.split(',').all(|term| match term.split_once('=') {
        Some((k, v)) => value_of(k.trim_end_matches('=')).as_deref() == Some(v.trim_start_matches('=')),
        None => value_of(term).is_some(),
    })
}

fn meta<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj["metadata"][field].as_str()
}

fn selected(obj: &Value, ns: &Option<String>, q: &ListQuery) -> bool {
    ns.as_ref().is_none_or(|ns| meta(obj, "namespace") == Some(ns))
        && terms_hold(&q.label_selector, |k| obj["metadata"]["labels"][k].as_str().map(String::from))
        && terms_hold(&q.field_selector, |k| match k {
            "metadata.name" => meta(obj, "name").map(String::from),
            "metadata.namespace" => meta(obj, "namespace").map(String::from),
            _ => None,
        })
}

async fn list_or_watch(shared: Shared, kind: Kind, ns: Option<String>, q: ListQuery) -> Response {
    let watch = matches!(q.watch.as_deref(), Some("true" | "1"));
    if !watch {
        let inner = shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        let items: Vec<&Value> =
            inner.objects.iter().filter(|((k, _, _), o)| *k == kind && selected(o, &ns, &q)).map(|(_, o)| o).collect();
        let (list_kind, api_version) = kind.list();
        let list = serde_json::json!({
            "kind": list_kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": items,
        });
        return ([("content-type", "application/json")], list.to_string()).into_response();
    }
    let mut since: u64 = q.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
    let timeout = Duration::from_secs(q.timeout_seconds.unwrap_or(290).min(290));
    let stream = async_stream::stream! {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = shared.changed.notified();
            let lines: Vec<String> = {
                let inner = shared.inner.lock().unwrap_or_else(|p| p.into_inner());
                let fresh: Vec<String> = inner
                    .events
                    .iter()
                    .filter(|(rv, _, k, obj)| *rv > since && *k == kind && selected(obj, &ns, &q))
                    .map(|(_, event, _, obj)| format!("{}\n", serde_json::json!({"type": event, "object": obj})))
                    .collect();
                since = inner.rv;
                fresh
            };
            for line in lines {
                yield Ok::<_, std::convert::Infallible>(line);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
    };
    ([("content-type", "application/json")], Body::from_stream(stream)).into_response()
}

async fn all_pods(State(shared): State<Shared>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(shared, Kind::Pod, None, q).await
}

async fn ns_pods(State(shared): State<Shared>, UrlPath(ns): UrlPath<String>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(shared, Kind::Pod, Some(ns), q).await
}

async fn all_pools(State(shared): State<Shared>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(shared, Kind::InferencePool, None, q).await
}

async fn ns_pools(State(shared): State<Shared>, UrlPath(ns): UrlPath<String>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(shared, Kind::InferencePool, Some(ns), q).await
}

async fn ns_objectives(
    State(shared): State<Shared>,
    UrlPath(ns): UrlPath<String>,
    Query(q): Query<ListQuery>,
) -> Response {
    list_or_watch(shared, Kind::InferenceObjective, Some(ns), q).await
}

impl FakeKube {
    pub fn start() -> anyhow::Result<FakeKube> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let shared = Shared::default();
        let leases = Leases::default();
        let app = Router::new()
            .route("/api/v1/pods", get(all_pods))
            .route("/api/v1/namespaces/{ns}/pods", get(ns_pods))
            .route("/apis/inference.networking.k8s.io/v1/inferencepools", get(all_pools))
            .route("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", get(ns_pools))
            .route(
                "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives",
                get(ns_objectives),
            )
            .with_state(shared.clone())
            .merge(leases.router());
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        Ok(FakeKube { port, shared, stop: Some(stop), thread: Some(thread), dir: crate::scratch_dir("kube")?, leases })
    }

    fn record(&self, event: &'static str, kind: Kind, mut obj: Value) {
        let mut inner = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        let key = (
            kind,
            meta(&obj, "namespace").unwrap_or_default().to_string(),
            meta(&obj, "name").unwrap_or_default().to_string(),
        );
        if event == "DELETED" {
            inner.objects.remove(&key);
        } else {
            inner.objects.insert(key, obj.clone());
        }
        inner.events.push((rv, event, kind, obj));
        drop(inner);
        self.shared.changed.notify_waiters();
    }

    fn put(&self, kind: Kind, obj: Value) {
        let key = (
            kind,
            meta(&obj, "namespace").unwrap_or_default().to_string(),
            meta(&obj, "name").unwrap_or_default().to_string(),
        );
        let exists = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).objects.contains_key(&key);
        self.record(if exists { "MODIFIED" } else { "ADDED" }, kind, obj);
    }

    fn remove(&self, kind: Kind, namespace: &str, name: &str) {
        let key = (kind, namespace.to_string(), name.to_string());
        let obj = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).objects.get(&key).cloned();
        if let Some(obj) = obj {
            self.record("DELETED", kind, obj);
        }
    }

    /// Creates or updates a pod (ADDED or MODIFIED to watchers).
    pub fn apply(&self, pod: Pod) {
        self.put(Kind::Pod, serde_json::to_value(pod).expect("a Pod serializes"));
    }

    /// Deletes a pod (DELETED to watchers).
    pub fn delete(&self, namespace: &str, name: &str) {
        self.remove(Kind::Pod, namespace, name);
    }

    /// Creates or updates an InferencePool (ADDED or MODIFIED to watchers).
    pub fn apply_pool(&self, pool: &InferencePool) {
        self.put(Kind::InferencePool, serde_json::to_value(pool).expect("an InferencePool serializes"));
    }

    /// Deletes an InferencePool (DELETED to watchers).
    pub fn delete_pool(&self, namespace: &str, name: &str) {
        self.remove(Kind::InferencePool, namespace, name);
    }

    /// Creates or updates an InferenceObjective (`inference.networking.x-k8s.io/v1alpha2`) of
    /// `pool` with `priority` (ADDED or MODIFIED to watchers).
    pub fn apply_objective(&self, namespace: &str, name: &str, pool: &str, priority: i64) {
        self.put(
            Kind::InferenceObjective,
            serde_json::json!({
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                "kind": "InferenceObjective",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"priority": priority, "poolRef": {"group": "inference.networking.k8s.io", "name": pool}},
            }),
        );
    }

    /// A kubeconfig file pointing at this server.
    pub fn kubeconfig(&self) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{}\nusers:\n- name: fake\n  user:\n    token: fake\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n",
            self.port
        );
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // Watch streams end at their own deadline; do not wait for them.
        self.thread.take();
    }
}

/// A pod as a worker Deployment would create it.
pub fn pod(
    namespace: &str,
    name: &str,
    ip: &str,
    ready: bool,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            annotations: Some(annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        },
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: (!ip.is_empty()).then(|| ip.to_string()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A Gateway API Inference Extension `InferencePool` (`inference.networking.k8s.io/v1`), as
/// its CRD's schema has it (`istio/schemas/inferencepool.inference.networking.k8s.io.v1.schema.json`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePool {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: InferencePoolSpec,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// `matchLabels` only: v1's selector has nothing else.
    pub selector: PoolSelector,
    pub target_ports: Vec<PoolPort>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PoolPort {
    pub number: i32,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

/// An InferencePool as a GIE install has it: selecting `labels`, on `ports`, its endpoint
/// picker the Service `{name}-epp` on port 9002.
pub fn inference_pool(namespace: &str, name: &str, labels: &[(&str, &str)], ports: &[u16]) -> InferencePool {
    InferencePool {
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(namespace.into()), ..Default::default() },
        spec: InferencePoolSpec {
            selector: PoolSelector {
                match_labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            },
            target_ports: ports.iter().map(|p| PoolPort { number: i32::from(*p) }).collect(),
            app_protocol: Some("http".into()),
            endpoint_picker_ref: Some(EndpointPickerRef {
                name: format!("{name}-epp"),
                kind: Some("Service".into()),
                port: Some(PoolPort { number: 9002 }),
                failure_mode: Some("FailClose".into()),
            }),
        },
    }
}
