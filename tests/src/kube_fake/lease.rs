//! `coordination.k8s.io/v1` Leases for the fake API server: get, create, and replace with
//! the API server's optimistic concurrency (a PUT whose `metadata.resourceVersion` is not the
//! stored one is a 409 Conflict; a create of an existing name is a 409 AlreadyExists), which
//! is all that leader election relies on.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use k8s_openapi::api::coordination::v1::Lease;

const BASE: &str = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases";

#[derive(Default)]
struct Store {
    rv: u64,
    leases: BTreeMap<(String, String), Lease>,
    /// Writes refused with 409.
    conflicts: u64,
    /// Every stored write, in order: the Lease's key and its holder after the write.
    holders: Vec<((String, String), String)>,
}

impl Store {
    fn record(&mut self, key: &(String, String), lease: &Lease) {
        let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();
        self.holders.push((key.clone(), holder));
    }
}

/// The Leases the fake serves.
#[derive(Clone, Default)]
pub struct Leases(Arc<Mutex<Store>>);

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    (code, Json(body)).into_response()
}

fn stored(mut lease: Lease, ns: &str, name: &str, rv: u64) -> Lease {
    lease.metadata.namespace = Some(ns.to_string());
    lease.metadata.name = Some(name.to_string());
    lease.metadata.resource_version = Some(rv.to_string());
    lease
}

async fn read(State(leases): State<Leases>, UrlPath((ns, name)): UrlPath<(String, String)>) -> Response {
    let store = leases.0.lock().unwrap_or_else(|p| p.into_inner());
    match store.leases.get(&(ns, name.clone())) {
        Some(l) => Json(l.clone()).into_response(),
        None => status(StatusCode::NOT_FOUND, "NotFound", format!("leases.coordination.k8s.io \"{name}\" not found")),
    }
}

async fn create(State(leases): State<Leases>, UrlPath(ns): UrlPath<String>, Json(lease): Json<Lease>) -> Response {
    let name = lease.metadata.name.clone().unwrap_or_default();
    let mut store = leases.0.lock().unwrap_or_else(|p| p.into_inner());
    let key = (ns.clone(), name.clone());
    if store.leases.contains_key(&key) {
        store.conflicts += 1;
        return status(StatusCode::CONFLICT, "AlreadyExists", format!("leases \"{name}\" already exists"));
    }
    store.rv += 1;
    let lease = stored(lease, &ns, &name, store.rv);
    store.record(&key, &lease);
    store.leases.insert(key, lease.clone());
    (StatusCode::CREATED, Json(lease)).into_response()
}

async fn replace(
    State(leases): State<Leases>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    Json(lease): Json<Lease>,
) -> Response {
    let mut store = leases.0.lock().unwrap_or_else(|p| p.into_inner());
    let key = (ns.clone(), name.clone());
    let Some(current) = store.leases.get(&key) else {
        return status(StatusCode::NOT_FOUND, "NotFound", format!("leases.coordination.k8s.io \"{name}\" not found"));
    };
    if lease.metadata.resource_version != current.metadata.resource_version {
        store.conflicts += 1;
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified"
            ),
        );
    }
    store.rv += 1;
    let lease = stored(lease, &ns, &name, store.rv);
    store.record(&key, &lease);
    store.leases.insert(key, lease.clone());
    Json(lease).into_response()
}

impl Leases {
    /// The routes, for the fake's router.
    pub fn router(&self) -> Router {
        Router::new()
            .route(BASE, post(create))
            .route(&format!("{BASE}/{{name}}"), get(read).put(replace))
            .with_state(self.clone())
    }

    /// The Lease `ns/name` as stored.
    pub fn get(&self, ns: &str, name: &str) -> Option<Lease> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).leases.get(&(ns.to_string(), name.to_string())).cloned()
    }

    /// Who holds the Lease `ns/name`, if anyone.
    pub fn holder(&self, ns: &str, name: &str) -> Option<String> {
        self.get(ns, name).and_then(|l| l.spec?.holder_identity).filter(|h| !h.is_empty())
    }

    /// Makes `holder` the holder of the Lease `ns/name`, renewed now, as its own write would
    /// (a new resourceVersion): the replica that held it finds it held by another at its next
    /// renewal, while `holder` finds it its own.
    pub fn hand_to(&self, ns: &str, name: &str, holder: &str) {
        let mut store = self.0.lock().unwrap_or_else(|p| p.into_inner());
        store.rv += 1;
        let rv = store.rv;
        if let Some(lease) = store.leases.get_mut(&(ns.to_string(), name.to_string())) {
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.holder_identity = Some(holder.to_string());
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            spec.renew_time = k8s_openapi::jiff::Timestamp::from_millisecond(now_ms)
                .ok()
                .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime);
            lease.metadata.resource_version = Some(rv.to_string());
            let lease = lease.clone();
            store.record(&(ns.to_string(), name.to_string()), &lease);
        }
    }

    /// The holders of the Lease `ns/name` write after write, a run of renewals by one holder
    /// counted once ("" where it was released).
    pub fn holders(&self, ns: &str, name: &str) -> Vec<String> {
        let store = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let key = (ns.to_string(), name.to_string());
        let mut out: Vec<String> = Vec::new();
        for (k, h) in &store.holders {
            if *k == key && out.last() != Some(h) {
                out.push(h.clone());
            }
        }
        out
    }

    /// Writes refused with 409 so far.
    pub fn conflicts(&self) -> u64 {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).conflicts
    }
}
