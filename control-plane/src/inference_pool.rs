//! `--inference-pool NAME`: the workers of a Gateway API Inference Extension InferencePool
//! (`inference.networking.k8s.io/v1`). kvmesh-cp watches the one pool by name (kube-runtime's
//! `watch_object` over a `DynamicObject`), reads its `spec.selector.matchLabels` and
//! `spec.targetPorts[].number`, and watches the pods of the pool's namespace that the selector
//! matches, one worker per pod and target port (as GIE's endpoint picker counts them). A
//! changed selector or port list restarts the pod watch, whose first full list reconciles
//! the registry to the new pods; a deleted pool, or one whose spec names no pods, takes every
//! discovered worker out (a warning says why): the pool is the declaration of which pods
//! serve, and GIE gateways stop routing to a pool that is gone too. While the API server
//! cannot be reached the last known pool stays in force (the watches retry with backoff).
//!
//! The pool's InferenceObjectives give request priorities ([`crate::inference_objective`]).
//!
//! In PD mode the pool is one set of pods (GIE has no roles); each pod's role comes from the
//! role label or the role selectors within the pool, as with `--selector`.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::watch_object;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::sync::watch;

use crate::discovery::{reconcile, watch_pods, DiscoveryConfig};
use crate::state::State;

/// The InferencePool resource: group, version, kind and plural.
pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";
pub const PLURAL: &str = "inferencepools";

/// What a pool's spec says about its workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolTarget {
    /// `spec.selector.matchLabels`: the pods of the pool, in its namespace.
    pub selector: BTreeMap<String, String>,
    /// `spec.targetPorts[].number`: each is a worker on every pod.
    pub ports: Vec<u16>,
}

/// Why a pool's spec names no workers.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("spec is not an InferencePool v1 spec: {0}")]
    Spec(#[from] serde_json::Error),
    #[error("spec.selector.matchLabels is empty (it would select every pod in the namespace)")]
    EmptySelector,
    #[error("spec.targetPorts is empty")]
    NoPorts,
    #[error("spec.targetPorts: {0} is not a port number (1 to 65535)")]
    BadPort(i64),
}

/// The part of the v1 spec kvmesh reads (`appProtocol` and `endpointPickerRef` are the
/// gateway's business, and kvmesh is the endpoint picker).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    selector: Selector,
    #[serde(default)]
    target_ports: Vec<Port>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
struct Port {
    number: i64,
}

/// The InferencePool API resource, for `Api::namespaced_with`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// The selector and ports a pool's spec gives.
pub fn target(pool: &DynamicObject) -> Result<PoolTarget, PoolError> {
    let spec: Spec = serde_json::from_value(pool.data.get("spec").cloned().unwrap_or_default())?;
    if spec.selector.match_labels.is_empty() {
        return Err(PoolError::EmptySelector);
    }
    let mut ports = Vec::new();
    for p in &spec.target_ports {
        let port = u16::try_from(p.number).ok().filter(|n| *n > 0).ok_or(PoolError::BadPort(p.number))?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    if ports.is_empty() {
        return Err(PoolError::NoPorts);
    }
    Ok(PoolTarget { selector: spec.selector.match_labels, ports })
}

/// What is known of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pool {
    /// Not heard from the API server yet: the registry is left as it is.
    Unknown,
    /// Absent, deleted, or naming no workers: no discovered workers.
    Gone,
    Serving(PoolTarget),
}

/// Follows the pool and its pods until the process ends (the watches retry with backoff).
pub async fn run(state: Arc<State>, cfg: DiscoveryConfig, name: String) -> anyhow::Result<()> {
    let client = Client::try_default().await.map_err(|e| anyhow::anyhow!("cannot reach the Kubernetes API: {e}"))?;
    // A pool selects pods in its own namespace only.
    let namespace = cfg.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &api_resource());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let (tx, mut rx) = watch::channel(Pool::Unknown);
    let follow = tokio::spawn(follow_pool(pools, name.clone(), namespace.clone(), tx));
    let objectives =
        tokio::spawn(crate::inference_objective::follow(state.clone(), client, namespace.clone(), name.clone()));
    let cfg = DiscoveryConfig { namespace: Some(namespace), ..cfg };
    loop {
        let pool = rx.borrow_and_update().clone();
        let serve = async {
            match pool {
                Pool::Unknown => {}
                Pool::Gone => reconcile(&state, &[]),
                Pool::Serving(t) => {
                    let cfg = DiscoveryConfig { selector: t.selector, ports: t.ports, ..cfg.clone() };
                    watch_pods(&state, pods.clone(), &cfg).await;
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { break },
            () = serve => {}
        }
    }
    follow.abort();
    objectives.abort();
    anyhow::bail!("the watch of InferencePool {name} ended")
}

/// Sends what the pool says each time it changes.
async fn follow_pool(api: Api<DynamicObject>, name: String, namespace: String, tx: watch::Sender<Pool>) {
    tracing::info!(%namespace, pool = %name, "watching InferencePool {GROUP}/{VERSION}");
    let events = watch_object(api, &name).default_backoff();
    futures_util::pin_mut!(events);
    while let Some(event) = events.next().await {
        let pool = match event {
            Ok(Some(pool)) => match target(&pool) {
                Ok(t) => Pool::Serving(t),
                Err(e) => {
                    tracing::warn!(%namespace, pool = %name, "InferencePool names no workers, none are used: {e}");
                    Pool::Gone
                }
            },
            Ok(None) => {
                tracing::warn!(%namespace, pool = %name, "InferencePool not found (or deleted): no discovered workers");
                Pool::Gone
            }
            Err(e) => {
                tracing::warn!(pool = %name, "InferencePool watch: {e}");
                continue;
            }
        };
        tx.send_if_modified(|current| {
            if *current == pool {
                return false;
            }
            if let Pool::Serving(t) = &pool {
                tracing::info!(pool = %name, selector = ?t.selector, ports = ?t.ports, "InferencePool selects workers");
            }
            *current = pool;
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(spec: serde_json::Value) -> DynamicObject {
        let mut obj = DynamicObject::new("p", &api_resource());
        obj.data = serde_json::json!({"spec": spec});
        obj
    }

    #[test]
    fn the_spec_gives_the_selector_and_ports() {
        let t = target(&pool(serde_json::json!({
            "selector": {"matchLabels": {"app": "vllm-llama3-8b-instruct"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}, {"number": 8000}],
            "appProtocol": "http",
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"},
        })))
        .unwrap();
        assert_eq!(t.selector, [("app".to_string(), "vllm-llama3-8b-instruct".to_string())].into());
        assert_eq!(t.ports, [8000, 8001]);
        let bad = |spec| target(&pool(spec)).unwrap_err().to_string();
        let ports = serde_json::json!([{"number": 8000}]);
        assert!(bad(serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": ports})).contains("matchLabels"));
        assert!(bad(serde_json::json!({"selector": {"matchLabels": {"a": "b"}}})).contains("targetPorts is empty"));
        let port0 = serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]});
        assert!(bad(port0).contains("not a port"));
        assert!(bad(serde_json::json!({"targetPorts": ports})).contains("not an InferencePool v1 spec"));
        assert!(target(&DynamicObject::new("p", &api_resource())).is_err(), "no spec");
    }
}
