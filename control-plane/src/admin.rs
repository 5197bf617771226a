//! The HTTP admin API (sglang-router compatible where it overlaps) and `/metrics`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State as Axum};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_proto::v1::Role;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth;
use crate::kv_events::KvEvents;
use crate::settings::KvEventEndpoints;
use crate::state::{role_name, Source, State, WorkerEntry};
use axum::middleware::from_fn_with_state;
use kvmesh_core::settings::PdProtocol;

type Shared = Axum<Arc<State>>;

/// The admin API: endpoints that change workers need an admin API key (when keys are
/// configured), `/match` (it tells which worker holds a text) any key, the other read-only
/// ones any key under `--protect-read-endpoints`; `/health` is open.
pub fn router(state: Arc<State>, metrics: Arc<Metrics>, kv: Arc<KvEvents>) -> Router {
    let admin = Router::new()
        .route("/add_worker", post(add_worker))
        .route("/remove_worker", post(remove_worker))
        .merge(crate::worker_ops::routes())
        .route_layer(from_fn_with_state(state.clone(), auth::admin));
    let read = Router::new()
        .route("/list_workers", get(list_workers))
        .route("/workers", get(workers))
        .route("/snapshot", get(snapshot))
        .route_layer(from_fn_with_state(state.clone(), auth::read));
    let cache = Router::new()
        .route("/match", post(match_text))
        .route_layer(from_fn_with_state(state.clone(), auth::cache_contents));
    admin
        .merge(read)
        .merge(cache)
        .route("/health", get(|| async { "OK" }))
        .with_state(state.clone())
        .layer(axum::Extension(kv))
        .merge(metrics_router(metrics, state))
        .layer(axum::middleware::from_fn(traced))
}

/// Each call in a span (exported when traces are on).
async fn traced(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    let span = tracing::info_span!(target: crate::telemetry::SPANS, "admin",
        http.request.method = %request.method(), url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty);
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}

/// Only `/metrics` (read-only), for `--prometheus-port` too.
pub fn metrics_router(metrics: Arc<Metrics>, state: Arc<State>) -> Router {
    Router::new()
        .route("/metrics", get(self::metrics))
        .with_state(metrics)
        .route_layer(from_fn_with_state(state, auth::read))
}

#[derive(Deserialize)]
struct WorkerQuery {
    url: Option<String>,
    role: Option<String>,
    bootstrap_port: Option<String>,
    /// A model name the worker serves (SMG's `model_id`), besides what its /v1/models lists.
    model_id: Option<String>,
    /// Its engine's KV-event publisher (`tcp://HOST:PORT`), and replay socket.
    kv_events_endpoint: Option<String>,
    kv_events_replay_endpoint: Option<String>,
}

/// The add-worker API's KV-event endpoints, checked.
fn kv_endpoints(q: &WorkerQuery) -> Result<Option<KvEventEndpoints>, String> {
    let ok = |e: &str| {
        e.len() <= 256
            && e.strip_prefix("tcp://")
                .and_then(|r| r.rsplit_once(':'))
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
    };
    match (&q.kv_events_endpoint, &q.kv_events_replay_endpoint) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err("kv_events_replay_endpoint needs kv_events_endpoint".into()),
        (Some(p), r) => {
            if !ok(p) || r.as_deref().is_some_and(|r| !ok(r)) {
                return Err("KV-event endpoints are tcp://HOST:PORT".into());
            }
            Ok(Some(KvEventEndpoints { publisher: p.clone(), replay: r.clone() }))
        }
    }
}

async fn add_worker(Axum(state): Shared, Query(q): Query<WorkerQuery>) -> (StatusCode, String) {
    let endpoints = match kv_endpoints(&q) {
        Ok(e) => e,
        Err(e) => return (StatusCode::BAD_REQUEST, e),
    };
    let Some(url) = q.url else { return (StatusCode::BAD_REQUEST, "missing `url` query parameter".into()) };
    let role = match q.role.as_deref() {
        None | Some("regular") if !state.settings.pd => Role::Regular,
        None | Some("decode") if state.settings.pd => Role::Decode,
        Some("prefill") if state.settings.pd => Role::Prefill,
        Some("both") if state.settings.pd => Role::Both,
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
    if let Some(m) = q.model_id.as_deref().filter(|m| m.is_empty() || m.len() > kvmesh_core::models::MAX_MODEL_NAME) {
        return (StatusCode::BAD_REQUEST, format!("model_id must be 1 to 256 bytes (got {})", m.len()));
    }
    match state.add_worker(&url, role, port, Source::Api) {
        Ok(id) => {
            state.set_model_id(id, q.model_id);
            state.set_kv_events(id, endpoints);
            // Unhealthy until probed: probe it now rather than at the next interval.
            if state.settings.health_checks {
                tokio::spawn(crate::probe::check_one(state.clone(), id));
            }
            (StatusCode::OK, format!("Successfully added worker: {url} (routed once its health check passes)"))
        }
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
    Json(json!({"urls": state.workers().iter().map(WorkerEntry::name).collect::<Vec<_>>()}))
}

async fn workers(Axum(state): Shared) -> Json<Value> {
    // PD workers: the protocol each speaks (its own, else the deployment's).
    let default = state.settings.routing.pd_protocol.unwrap_or(PdProtocol::Sglang);
    let protocol = |w: &WorkerEntry| state.settings.pd.then(|| w.pd_protocol.unwrap_or(default).to_string());
    let list: Vec<Value> = state
        .workers()
        .iter()
        .map(|w| {
            json!({
                "id": w.id,
                "url": w.name(),
                "dp_rank": w.dp_rank,
                "role": role_name(w.role),
                "bootstrap_port": w.bootstrap_port,
                "pd_protocol": protocol(w),
                "healthy": w.healthy,
                "load": w.load(),
                "in_flight": w.inflight_total(),
                "requests": w.requests,
                "errors": w.errors,
                "failovers": w.failovers,
                "circuit_breaker": w.circuit_breaker(),
                "index_entries": state.index_size_of(w.id),
                "index_tokens": state.index_tokens_of(w.id),
                "kv_capacity_tokens": state.kv_capacity(w),
                "prediction": w.feedback.json(),
                "cache_hit_rate": w.cache_hit_rate,
                "waiting": w.pressure.waiting,
                "kv_usage": w.pressure.kv_usage,
                "utility": w.utility,
                "utility_window": w.window.len(),
                "models": w.served().iter().map(|m| json!({"id": m.id, "parent": m.parent})).collect::<Vec<_>>(),
                "model_id": w.model_id,
            })
        })
        .collect();
    Json(Value::Array(list))
}

/// `POST /match` with a routing text as the body: which workers hold how many of its
/// leading blocks (a debugging view of the global index). Whoever may ask learns whether
/// someone sent a text (a cache side channel), so it always needs a key when there are keys.
/// `?model=NAME` asks within that model's pool (default: the one model served, if one is).
async fn match_text(
    Axum(state): Shared,
    axum::Extension(kv): axum::Extension<Arc<KvEvents>>,
    Query(q): Query<MatchQuery>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, (StatusCode, Json<Value>)> {
    let matches = state.match_text(&body, q.model.as_deref()).map_err(|e| {
        let status = match e {
            kvmesh_core::models::ModelError::Unknown(_) => StatusCode::NOT_FOUND,
            kvmesh_core::models::ModelError::Required(_) => StatusCode::BAD_REQUEST,
        };
        (status, Json(json!({"error": e.to_string()})))
    })?;
    // The source of the deepest block: the engine's events, else the gateways' routing.
    let source = |id: u32, deepest: u64| if kv.holds(id, deepest) { "kv-events" } else { "routed" };
    Ok(Json(Value::Array(
        matches
            .into_iter()
            .map(|(id, url, blocks, deepest)| json!({"url": url, "blocks": blocks, "source": source(id, deepest)}))
            .collect(),
    )))
}

#[derive(serde::Deserialize)]
struct MatchQuery {
    model: Option<String>,
}

async fn snapshot(Axum(state): Shared) -> Json<Value> {
    Json(state.describe())
}

use crate::feedback::WorkerLabels;
use crate::label::LabelValue;

/// The `/metrics` registry, built once at startup. The control plane's own counters are the
/// state's handles; the per-worker families and the index gauges are brought up to date on
/// each scrape (series of workers that left are removed).
pub struct Metrics {
    state: Arc<State>,
    registry: Registry,
    healthy: Family<WorkerLabels, Gauge>,
    load: Family<WorkerLabels, Gauge>,
    inflight: Family<WorkerLabels, Gauge>,
    requests: Family<WorkerLabels, Counter>,
    errors: Family<WorkerLabels, Counter>,
    failovers: Family<WorkerLabels, Counter>,
    breakers_open: Family<WorkerLabels, Gauge>,
    /// marginal_utility's score, while the worker has one.
    utility: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// 1 for each model name a worker serves (join on `worker` to read any series by model).
    models: Family<ModelLabels, Gauge>,
    cache: crate::feedback::CacheMetrics,
    index_blocks: Gauge,
    index_entries: Gauge,
    /// The label sets of the workers at the last scrape.
    known: Mutex<HashSet<WorkerLabels>>,
    /// The worker-model pairs at the last scrape.
    known_models: Mutex<HashSet<ModelLabels>>,
}

/// A model a worker serves, as `kvmesh_worker_model` labels it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ModelLabels {
    worker: LabelValue,
    model: LabelValue,
    /// A LoRA adapter's base model (empty for a base model).
    parent: LabelValue,
}

impl Metrics {
    pub fn new(state: Arc<State>, kv: &KvEvents) -> Arc<Self> {
        let mut registry = Registry::default();
        let m = Self {
            registry: Registry::default(),
            healthy: Family::default(),
            load: Family::default(),
            inflight: Family::default(),
            requests: Family::default(),
            errors: Family::default(),
            failovers: Family::default(),
            breakers_open: Family::default(),
            utility: Family::default(),
            models: Family::default(),
            cache: Default::default(),
            index_blocks: Gauge::default(),
            index_entries: Gauge::default(),
            known: Mutex::default(),
            known_models: Mutex::default(),
            state,
        };
        registry.register("sgl_router_worker_health", "Worker health (1 healthy)", m.healthy.clone());
        registry.register("sgl_router_worker_load", "Worker load (running + queued requests)", m.load.clone());
        registry.register("kvmesh_worker_in_flight", "In-flight requests reported by the gateways", m.inflight.clone());
        // Counters: the exposition adds `_total`.
        registry.register(
            "sgl_router_requests",
            "Requests finished, per worker, over all gateways",
            m.requests.clone(),
        );
        registry.register(
            "sgl_router_request_errors",
            "Requests that failed (no answer or 5xx), per worker",
            m.errors.clone(),
        );
        registry.register(
            "kvmesh_worker_failovers",
            "Requests a worker failed that a gateway sent again to another worker",
            m.failovers.clone(),
        );
        registry.register(
            "kvmesh_worker_circuit_breaker_open",
            "Gateways (with a live report stream) whose circuit breaker for the worker is open",
            m.breakers_open.clone(),
        );
        registry.register(
            "kvmesh_worker_utility",
            "marginal_utility: the worker's score (z-scored throughput and latency trends), while it has one",
            m.utility.clone(),
        );
        registry.register(
            "kvmesh_worker_model",
            "1 for each model name a worker serves (its /v1/models, LoRA adapters with their parent)",
            m.models.clone(),
        );
        m.cache.register(&mut registry);
        kv.metrics.register(&mut registry);
        registry.register("kvmesh_index_blocks", "Distinct blocks in the global prefix index", m.index_blocks.clone());
        registry.register(
            "kvmesh_index_entries",
            "Worker-block entries in the global prefix index",
            m.index_entries.clone(),
        );
        let c = &m.state.counters;
        registry.register("kvmesh_reports", "Gateway report batches merged", c.reports.clone());
        registry.register(
            "kvmesh_tables_held_for_endpoints",
            "Worker tables a gateway's stream holds until Envoy's endpoints (EDS) list their healthy workers",
            c.tables_held.clone(),
        );
        registry.register("kvmesh_bad_reports", "Report entries or streams rejected", c.bad_reports.clone());
        registry.register("kvmesh_evicted_blocks", "Blocks evicted from the global index", c.evicted_blocks.clone());
        registry.register(
            "kvmesh_stale_blocks",
            "Blocks dropped from the global index because a worker's response showed it no longer held them",
            c.stale_blocks.clone(),
        );
        registry.register("kvmesh_snapshot_deltas", "Snapshot deltas pushed", c.deltas.clone());
        registry.register(
            "kvmesh_auth_failures",
            "gRPC streams and admin requests refused for a missing or wrong credential",
            c.auth_failures.clone(),
        );
        registry.register(
            "kvmesh_dropped_inserts",
            "Reported index hashes dropped by the per-report and per-gateway rate limits",
            c.dropped_inserts.clone(),
        );
        registry.register("kvmesh_adapter_loads", "LoRA adapters loaded for --lora-adapter", c.adapter_loads.clone());
        registry.register(
            "kvmesh_adapter_load_failures",
            "Failed --lora-adapter loads (each retried after 5 s)",
            c.adapter_load_failures.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Brings the per-worker series up to date and encodes the registry.
    pub fn encode(&self) -> String {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let mut known_models = self.known_models.lock().unwrap_or_else(|p| p.into_inner());
        let mut now = HashSet::new();
        let mut now_models = HashSet::new();
        for w in self.state.workers() {
            for m in w.served() {
                let labels = ModelLabels {
                    worker: w.name().into(),
                    model: m.id.into(),
                    parent: m.parent.unwrap_or_default().into(),
                };
                self.models.get_or_create(&labels).set(1);
                now_models.insert(labels);
            }
            let labels = WorkerLabels { worker: w.name().into(), role: role_name(w.role).into() };
            self.healthy.get_or_create(&labels).set(i64::from(w.healthy));
            self.load.get_or_create(&labels).set(w.load() as i64);
            self.inflight.get_or_create(&labels).set(w.inflight_total() as i64);
            self.breakers_open.get_or_create(&labels).set(w.breakers_open() as i64);
            match w.utility {
                Some(u) => {
                    self.utility.get_or_create(&labels).set(u);
                }
                None => {
                    self.utility.remove(&labels);
                }
            }
            self.cache.update(&labels, self.state.kv_capacity(&w), self.state.index_tokens_of(w.id), &w.feedback);
            // The state's totals only grow (for one registration of a worker).
            for (family, total) in
                [(&self.requests, w.requests), (&self.errors, w.errors), (&self.failovers, w.failovers)]
            {
                let counter = family.get_or_create(&labels);
                counter.inc_by(total.saturating_sub(counter.get()));
            }
            now.insert(labels);
        }
        for gone in known.difference(&now) {
            self.healthy.remove(gone);
            self.utility.remove(gone);
            self.load.remove(gone);
            self.inflight.remove(gone);
            self.requests.remove(gone);
            self.errors.remove(gone);
            self.failovers.remove(gone);
            self.breakers_open.remove(gone);
            self.cache.remove(gone);
        }
        *known = now;
        for gone in known_models.difference(&now_models) {
            self.models.remove(gone);
        }
        *known_models = now_models;
        let (blocks, entries) = self.state.index_stats();
        self.index_blocks.set(blocks as i64);
        self.index_entries.set(entries as i64);
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

async fn metrics(Axum(metrics): Axum<Arc<Metrics>>) -> impl IntoResponse {
    ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], metrics.encode())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_state as state;
    use kvmesh_testkit::http;

    /// Serves `s`'s admin API on a free loopback port, for as long as the runtime lives.
    fn serve(s: Arc<State>) -> (tokio::runtime::Runtime, String) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let kv = KvEvents::new(&Default::default(), 16).unwrap();
        let app = router(s.clone(), Metrics::new(s, &kv), kv);
        rt.spawn(async move { axum::serve(listener, app).await });
        (rt, base)
    }

    #[test]
    fn a_worker_is_one_worker_under_every_spelling_of_its_url() {
        let (_rt, base) = serve(state(&["--disable-health-check"]));
        let post = |path: &str| http::post(&format!("{base}{path}"), b"", &[]).unwrap();
        let urls = || http::get(&format!("{base}/list_workers")).unwrap().json().unwrap()["urls"].clone();
        assert_eq!(post("/add_worker?url=http://127.0.0.1:30001").status, 200);
        for other in ["http://127.0.0.1:030001/", "http://LOCALHOST:30001", "HTTP://localhost:30001/"] {
            let r = post(&format!("/add_worker?url={other}"));
            assert_eq!(r.status, 400, "{other}: {}", r.text());
            assert!(r.text().contains("already registered"), "{other}: {}", r.text());
        }
        assert_eq!(urls(), json!(["http://127.0.0.1:30001"]));
        let r = post("/remove_worker?url=http://localhost:030001/");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(urls(), json!([]));
        // A path, a query, a fragment or user info is no spelling of a worker.
        for bad in ["http://127.0.0.1:30001/v1", "http://127.0.0.1:30001/?a=b", "http://u@127.0.0.1:30001"] {
            let r = post(&format!("/add_worker?url={}", bad.replace('?', "%3F").replace('&', "%26")));
            assert_eq!(r.status, 400, "{bad}: {}", r.text());
        }
        assert_eq!(urls(), json!([]));
    }

    #[test]
    fn match_needs_a_key_once_keys_are_configured() {
        let s = state(&["--control-plane-api-keys", "ops:o:admin:admin-secret", "dash:d:reader:reader-secret"]);
        let (_rt, base) = serve(s);
        let post = |auth: &[(&str, &str)]| http::post(&format!("{base}/match"), b"a prompt", auth).unwrap().status;
        assert_eq!(post(&[]), 401, "the global index is no open prompt-prefix oracle");
        assert_eq!(post(&[("authorization", "Bearer wrong")]), 401);
        assert_eq!(post(&[("authorization", "Bearer reader-secret")]), 200, "a read key will do");
        assert_eq!(post(&[("authorization", "Bearer admin-secret")]), 200);
        for path in ["/health", "/metrics", "/list_workers", "/workers", "/snapshot"] {
            assert_eq!(http::get(&format!("{base}{path}")).unwrap().status, 200, "{path} stays open");
        }
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn control_plane_totals_are_counters_in_one_registry() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let m = Metrics::new(s.clone(), &KvEvents::new(&Default::default(), 16).unwrap());
        s.report(kvmesh_proto::v1::ReportBatch { gateway_id: "a".into(), ..Default::default() });
        s.bad_report();
        s.publish();
        let text = m.encode();
        for name in ["kvmesh_reports", "kvmesh_bad_reports", "kvmesh_evicted_blocks", "kvmesh_snapshot_deltas"] {
            assert!(text.contains(&format!("# TYPE {name} counter")), "{name}: {text}");
        }
        assert_eq!(value(&text, "kvmesh_reports_total"), Some(1.0));
        assert_eq!(value(&text, "kvmesh_bad_reports_total"), Some(1.0));
        assert_eq!(value(&text, "kvmesh_snapshot_deltas_total"), Some(1.0));
        assert!(text.contains("# TYPE sgl_router_requests counter"));
        // Scrapes update, never duplicate; a worker that left loses its series.
        s.report(kvmesh_proto::v1::ReportBatch {
            gateway_id: "a".into(),
            counts: vec![kvmesh_proto::v1::WorkerCounts { worker: 0, requests: 5, ..Default::default() }],
            ..Default::default()
        });
        let text = m.encode();
        assert_eq!(text.matches("# TYPE kvmesh_reports counter").count(), 1);
        assert_eq!(value(&text, "kvmesh_reports_total"), Some(2.0));
        assert_eq!(value(&text, r#"sgl_router_requests_total{worker="http://127.0.0.1:1",role="regular"}"#), Some(5.0));
        let mut open = kvmesh_proto::v1::WorkerCounts { worker: 0, requests: 5, failovers: 3, ..Default::default() };
        open.set_breaker(kvmesh_proto::v1::BreakerState::Open);
        s.report(kvmesh_proto::v1::ReportBatch { gateway_id: "a".into(), counts: vec![open], ..Default::default() });
        let text = m.encode();
        let series = |name: &str, port: u16| format!(r#"{name}{{worker="http://127.0.0.1:{port}",role="regular"}}"#);
        assert_eq!(value(&text, &series("kvmesh_worker_circuit_breaker_open", 1)), Some(1.0), "{text}");
        assert_eq!(value(&text, &series("kvmesh_worker_circuit_breaker_open", 2)), Some(0.0));
        assert_eq!(value(&text, &series("kvmesh_worker_failovers_total", 1)), Some(3.0));
        assert!(text.contains("# TYPE kvmesh_worker_failovers counter"));
        assert!(s.remove_worker("http://127.0.0.1:1"));
        let text = m.encode();
        assert!(!text.contains("127.0.0.1:1\""), "{text}");
        assert!(text.contains(r#"sgl_router_worker_health{worker="http://127.0.0.1:2",role="regular"} 1"#), "{text}");
    }
}
