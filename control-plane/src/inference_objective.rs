//! The InferenceObjectives of the `--inference-pool` (`inference.networking.x-k8s.io/v1alpha2`):
//! each one that names the pool in `spec.poolRef` gives its `spec.priority` (0 when unset) to
//! the requests whose `x-gateway-inference-objective` header names it, as GIE's endpoint picker
//! reads them. kvmesh-cp watches them in the pool's namespace and ships `name=N` entries in the
//! routing settings (`priority_objective`, [`crate::state::State::set_objectives`]). Where the
//! resource is not installed the watch retries with backoff and nothing else changes.

use std::sync::Arc;

use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use kvmesh_core::priority::{valid_objective, MAX_OBJECTIVES};

use crate::state::State;

pub const GROUP: &str = "inference.networking.x-k8s.io";
pub const VERSION: &str = "v1alpha2";
pub const KIND: &str = "InferenceObjective";
pub const PLURAL: &str = "inferenceobjectives";

/// The InferenceObjective API resource, for `Api::namespaced_with`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// The `name=N` entries of the objectives among `objects` that name `pool`, by name, at most
/// [`MAX_OBJECTIVES`]; and a line for each one left out (a name or priority kvmesh cannot use).
pub fn entries<'a>(pool: &str, objects: impl IntoIterator<Item = &'a DynamicObject>) -> (Vec<String>, Vec<String>) {
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for obj in objects {
        let name = obj.metadata.name.as_deref().unwrap_or_default();
        let spec = obj.data.get("spec");
        let pool_ref = spec.and_then(|s| s.get("poolRef"));
        if pool_ref.and_then(|r| r.get("name")).and_then(|n| n.as_str()) != Some(pool) {
            continue;
        }
        let kind = pool_ref.and_then(|r| r.get("kind")).and_then(|k| k.as_str()).unwrap_or("InferencePool");
        if kind != "InferencePool" {
            continue;
        }
        let priority = match spec.and_then(|s| s.get("priority")) {
            None | Some(serde_json::Value::Null) => Some(0),
            Some(p) => p.as_i64().filter(|p| p.unsigned_abs() <= 1_000_000),
        };
        match (valid_objective(name), priority) {
            (true, Some(p)) => out.push((name.to_string(), p)),
            (false, _) => skipped.push(format!("InferenceObjective {name:?}: not a name kvmesh can match")),
            (true, None) => {
                skipped.push(format!("InferenceObjective {name}: spec.priority is not an integer within ±1000000"))
            }
        }
    }
    out.sort();
    if out.len() > MAX_OBJECTIVES {
        skipped.push(format!(
            "{} InferenceObjectives name the pool: the first {MAX_OBJECTIVES} by name are used",
            out.len()
        ));
        out.truncate(MAX_OBJECTIVES);
    }
    (out.into_iter().map(|(n, p)| format!("{n}={p}")).collect(), skipped)
}

/// Follows the pool's objectives in `namespace` until the process ends.
pub async fn follow(state: Arc<State>, client: Client, namespace: String, pool: String) {
    tracing::info!(%namespace, %pool, "watching InferenceObjectives {GROUP}/{VERSION}");
    let api: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &api_resource());
    let writer = reflector::store::Writer::new(api_resource());
    let reader = writer.as_reader();
    let events = reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    futures_util::pin_mut!(events);
    let mut failing = false;
    while let Some(event) = events.next().await {
        match event {
            Err(e) => {
                // Once per outage (the resource may simply not be installed).
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(%namespace, "InferenceObjective watch (priorities from objectives wait): {e}");
                }
                continue;
            }
            Ok(watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {}
            Ok(_) => continue, // mid-relist: the set is whole again at InitDone
        }
        failing = false;
        let objects = reader.state();
        let (list, skipped) = entries(&pool, objects.iter().map(|o| o.as_ref()));
        for line in skipped {
            tracing::warn!(%namespace, %pool, "{line}");
        }
        if state.set_objectives(list.clone()) {
            tracing::info!(%namespace, %pool, objectives = ?list, "InferenceObjective priorities");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(name: &str, spec: serde_json::Value) -> DynamicObject {
        let mut obj = DynamicObject::new(name, &api_resource());
        obj.data = serde_json::json!({ "spec": spec });
        obj
    }

    #[test]
    fn the_pools_objectives_give_their_priority_and_others_are_left_out() {
        let objects = [
            objective("sheddable", serde_json::json!({"priority": -1, "poolRef": {"name": "pool"}})),
            objective(
                "critical",
                serde_json::json!({"priority": 2, "poolRef": {"group": GROUP, "kind": "InferencePool", "name": "pool"}}),
            ),
            objective("plain", serde_json::json!({"poolRef": {"name": "pool"}})),
            objective("elsewhere", serde_json::json!({"priority": 5, "poolRef": {"name": "another"}})),
            objective("odd-kind", serde_json::json!({"priority": 5, "poolRef": {"kind": "Service", "name": "pool"}})),
            objective("huge", serde_json::json!({"priority": 1e12, "poolRef": {"name": "pool"}})),
            objective("text", serde_json::json!({"priority": "high", "poolRef": {"name": "pool"}})),
            objective("Bad_Name", serde_json::json!({"priority": 1, "poolRef": {"name": "pool"}})),
            objective("no-spec", serde_json::Value::Null),
        ];
        let (list, skipped) = entries("pool", objects.iter());
        assert_eq!(list, ["critical=2", "plain=0", "sheddable=-1"]);
        assert_eq!(skipped.len(), 3, "{skipped:?}");
        assert!(kvmesh_core::priority::parse_objectives(&list).is_ok(), "what the filters accept");
    }
}
