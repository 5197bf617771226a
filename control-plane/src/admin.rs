//! The HTTP admin API (sglang-router compatible where it overlaps) and `/metrics`.

use std::sync::Arc;

use axum::extract::{Query, State as Axum};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_proto::v1::Role;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::state::{role_name, Source, State};

type Shared = Axum<Arc<State>>;

pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/add_worker", post(add_worker))
        .route("/remove_worker", post(remove_worker))
        .route("/list_workers", get(list_workers))
        .route("/workers", get(workers))
        .route("/snapshot", get(snapshot))
        .route("/match", post(match_text))
        .route("/health", get(|| async { "OK" }))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Only `/metrics`, for `--prometheus-port`.
pub fn metrics_router(state: Arc<State>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(state)
}

#[derive(Deserialize)]
struct WorkerQuery {
    url: Option<String>,
    role: Option<String>,
    bootstrap_port: Option<String>,
}

async fn add_worker(Axum(state): Shared, Query(q): Query<WorkerQuery>) -> (StatusCode, String) {
    let Some(url) = q.url else { return (StatusCode::BAD_REQUEST, "missing `url` query parameter".into()) };
    let role = match q.role.as_deref() {
        None | Some("regular") if !state.settings.pd => Role::Regular,
        None | Some("decode") if state.settings.pd => Role::Decode,
        Some("prefill") if state.settings.pd => Role::Prefill,
        Some(r) => return (StatusCode::BAD_REQUEST, format!("role `{r}` does not fit this control plane's mode")),
        None => Role::Regular,
    };
    let port = match q.bootstrap_port.as_deref() {
        None | Some("none") => None,
        Some(p) => match p.parse::<u16>() {
            Ok(p) => Some(p),
            Err(_) => return (StatusCode::BAD_REQUEST, format!("bootstrap_port `{p}` is not a port or `none`")),
        },
    };
    match state.add_worker(&url, role, port, Source::Api) {
        Ok(_) => (StatusCode::OK, format!("Successfully added worker: {url}")),
        Err(e) => (StatusCode::BAD_REQUEST, format!("Failed to add worker {url}: {e}")),
    }
}

async fn remove_worker(Axum(state): Shared, Query(q): Query<WorkerQuery>) -> (StatusCode, String) {
    let Some(url) = q.url else { return (StatusCode::BAD_REQUEST, "missing `url` query parameter".into()) };
    if state.remove_worker(&url) {
        (StatusCode::OK, format!("Successfully removed worker: {url}"))
    } else {
        (StatusCode::NOT_FOUND, format!("Worker {url} not found"))
    }
}

async fn list_workers(Axum(state): Shared) -> Json<Value> {
    Json(json!({"urls": state.workers().iter().map(|w| w.url.clone()).collect::<Vec<_>>()}))
}

async fn workers(Axum(state): Shared) -> Json<Value> {
    let list: Vec<Value> = state
        .workers()
        .iter()
        .map(|w| {
            json!({
                "id": w.id,
                "url": w.url,
                "role": role_name(w.role),
                "bootstrap_port": w.bootstrap_port,
                "healthy": w.healthy,
                "load": w.load(),
                "in_flight": w.inflight_total(),
                "requests": w.requests,
                "errors": w.errors,
                "index_entries": state.index_size_of(w.id),
                "cache_hit_rate": w.cache_hit_rate,
            })
        })
        .collect();
    Json(Value::Array(list))
}

/// `POST /match` with a routing text as the body: which workers hold how many of its
/// leading blocks (a debugging view of the global index).
async fn match_text(Axum(state): Shared, body: axum::body::Bytes) -> Json<Value> {
    let matches: Vec<Value> =
        state.match_text(&body).into_iter().map(|(url, blocks)| json!({"url": url, "blocks": blocks})).collect();
    Json(Value::Array(matches))
}

async fn snapshot(Axum(state): Shared) -> Json<Value> {
    Json(state.describe())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
    role: String,
}

async fn metrics(Axum(state): Shared) -> impl IntoResponse {
    let mut registry = Registry::default();
    let healthy = Family::<WorkerLabels, Gauge>::default();
    let load = Family::<WorkerLabels, Gauge>::default();
    let inflight = Family::<WorkerLabels, Gauge>::default();
    for w in state.workers() {
        let labels = WorkerLabels { worker: w.url.clone(), role: role_name(w.role).into() };
        healthy.get_or_create(&labels).set(i64::from(w.healthy));
        load.get_or_create(&labels).set(w.load() as i64);
        inflight.get_or_create(&labels).set(w.inflight_total() as i64);
    }
    registry.register("sgl_router_worker_health", "Worker health (1 healthy)", healthy);
    registry.register("sgl_router_worker_load", "Worker load (running + queued requests)", load);
    registry.register("kvmesh_worker_in_flight", "In-flight requests reported by the gateways", inflight);
    let requests = Family::<WorkerLabels, prometheus_client::metrics::counter::Counter>::default();
    let errors = Family::<WorkerLabels, prometheus_client::metrics::counter::Counter>::default();
    for w in state.workers() {
        let labels = WorkerLabels { worker: w.url.clone(), role: role_name(w.role).into() };
        requests.get_or_create(&labels).inc_by(w.requests);
        errors.get_or_create(&labels).inc_by(w.errors);
    }
    registry.register("sgl_router_requests", "Requests finished, per worker, over all gateways", requests);
    registry.register("sgl_router_request_errors", "Requests that failed (no answer or 5xx), per worker", errors);
    let (blocks, entries) = state.index_stats();
    let c = state.counters();
    let gauges: [(&str, &str, i64); 6] = [
        ("kvmesh_index_blocks", "Distinct blocks in the global prefix index", blocks as i64),
        ("kvmesh_index_entries", "Worker-block entries in the global prefix index", entries as i64),
        ("kvmesh_reports", "Gateway report batches merged", c.reports as i64),
        ("kvmesh_bad_reports", "Report entries or streams rejected", c.bad_reports as i64),
        ("kvmesh_evicted_blocks", "Blocks evicted from the global index", c.evicted_blocks as i64),
        ("kvmesh_snapshot_deltas", "Snapshot deltas pushed", c.deltas as i64),
    ];
    for (name, help, value) in gauges {
        let g = Gauge::<i64>::default();
        g.set(value);
        registry.register(name, help, g);
    }
    let mut out = String::new();
    let _ = encode(&mut out, &registry);
    ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], out)
}
