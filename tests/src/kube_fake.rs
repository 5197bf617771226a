//! An in-process stand-in for the Kubernetes API server: pods only, speaking the real
//! list and watch protocol (`GET .../pods`, `?watch=true&resourceVersion=N` streaming
//! newline-delimited watch events) with real `k8s-openapi` Pod objects. Nothing here can
//! install a real API server; kube-runtime's watcher runs against this unchanged.

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
use tokio::sync::{oneshot, Notify};

#[derive(Default)]
struct Inner {
    rv: u64,
    pods: BTreeMap<(String, String), Pod>,
    /// Every change: resource version, event type, object.
    events: Vec<(u64, &'static str, Pod)>,
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
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    watch: Option<String>,
    resource_version: Option<String>,
    label_selector: Option<String>,
    timeout_seconds: Option<u64>,
}

fn selected(pod: &Pod, selector: &Option<String>) -> bool {
    let Some(sel) = selector.as_deref().filter(|s| !s.is_empty()) else { return true };
    let empty = BTreeMap::new();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    sel.split(',').all(|term| match term.split_once('=') {
        Some((k, v)) => labels.get(k.trim_end_matches('=')) == Some(&v.trim_start_matches('=').to_string()),
        None => labels.contains_key(term),
    })
}

fn in_namespace(pod: &Pod, ns: &Option<String>) -> bool {
    ns.as_ref().is_none_or(|ns| pod.metadata.namespace.as_deref() == Some(ns))
}

async fn pods(State(shared): State<Shared>, ns: Option<String>, q: ListQuery) -> Response {
    let watch = matches!(q.watch.as_deref(), Some("true" | "1"));
    if !watch {
        let inner = shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        let items: Vec<&Pod> =
            inner.pods.values().filter(|p| in_namespace(p, &ns) && selected(p, &q.label_selector)).collect();
        let list = serde_json::json!({
            "kind": "PodList",
            "apiVersion": "v1",
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
                    .filter(|(rv, _, pod)| *rv > since && in_namespace(pod, &ns) && selected(pod, &q.label_selector))
                    .map(|(_, kind, pod)| format!("{}\n", serde_json::json!({"type": kind, "object": pod})))
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

async fn all_pods(state: State<Shared>, Query(q): Query<ListQuery>) -> Response {
    pods(state, None, q).await
}

async fn ns_pods(state: State<Shared>, UrlPath(ns): UrlPath<String>, Query(q): Query<ListQuery>) -> Response {
    pods(state, Some(ns), q).await
}

impl FakeKube {
    pub fn start() -> anyhow::Result<FakeKube> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let shared = Shared::default();
        let app = Router::new()
            .route("/api/v1/pods", get(all_pods))
            .route("/api/v1/namespaces/{ns}/pods", get(ns_pods))
            .with_state(shared.clone());
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
        Ok(FakeKube { port, shared, stop: Some(stop), thread: Some(thread), dir: crate::scratch_dir("kube")? })
    }

    fn record(&self, kind: &'static str, mut pod: Pod) {
        let mut inner = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.rv += 1;
        let rv = inner.rv;
        pod.metadata.resource_version = Some(rv.to_string());
        let key = (pod.metadata.namespace.clone().unwrap_or_default(), pod.metadata.name.clone().unwrap_or_default());
        if kind == "DELETED" {
            inner.pods.remove(&key);
        } else {
            inner.pods.insert(key, pod.clone());
        }
        inner.events.push((rv, kind, pod));
        drop(inner);
        self.shared.changed.notify_waiters();
    }

    /// Creates or updates a pod (ADDED or MODIFIED to watchers).
    pub fn apply(&self, pod: Pod) {
        let key = (pod.metadata.namespace.clone().unwrap_or_default(), pod.metadata.name.clone().unwrap_or_default());
        let exists = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).pods.contains_key(&key);
        self.record(if exists { "MODIFIED" } else { "ADDED" }, pod);
    }

    /// Deletes a pod (DELETED to watchers).
    pub fn delete(&self, namespace: &str, name: &str) {
        let pod = self
            .shared
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned();
        if let Some(pod) = pod {
            self.record("DELETED", pod);
        }
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
