//! The worker's state and the simulator's controls, as the engines serve them: health, load,
//! `/metrics`, the models and LoRA adapters, model and server info, the cache flush; and
//! `/sim/fault`, `/sim/stats`, `/sim/requests`.

use std::sync::atomic::Ordering::Relaxed;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{created, error, Shared};
use crate::cli::EngineKind;

/// The last requests this worker received (generations and `/abort_request`s), oldest first
/// (`/sim/requests`).
pub(super) async fn recent(State(e): Shared) -> Json<Value> {
    Json(Value::Array(e.recent.lock().map(|r| r.iter().cloned().collect()).unwrap_or_default()))
}

pub(super) async fn health() -> &'static str {
    ""
}

/// SGLang's current `/get_load` shape: one object per data-parallel rank.
pub(super) async fn get_load(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    let (running, waiting) = (c.running.load(Relaxed), c.waiting.load(Relaxed));
    let (used, _) = e.kv_usage();
    Json(e.ranks.get_load(waiting, used, running))
}

pub(super) async fn metrics(State(e): Shared) -> impl IntoResponse {
    let c = &e.counters;
    let (used, cap) = e.kv_usage();
    let common = [
        ("kvmesh_sim_cached_tokens_total", "counter", c.cached_tokens.load(Relaxed) as f64),
        ("kvmesh_sim_requests_total", "counter", c.requests.load(Relaxed) as f64),
        ("kvmesh_sim_failures_total", "counter", c.failures.load(Relaxed) as f64),
    ];
    let model = e.models.first();
    if e.args.engine == EngineKind::Vllm {
        // vLLM's names and labels; `kv_cache_usage_perc` is a fraction (0..1) despite its name.
        let lines = [
            ("vllm:num_requests_running", "gauge", c.running.load(Relaxed) as f64),
            ("vllm:num_requests_waiting", "gauge", c.waiting.load(Relaxed) as f64),
            ("vllm:kv_cache_usage_perc", "gauge", used as f64 / cap.max(1) as f64),
            ("vllm:prefix_cache_queries_total", "counter", c.prompt_tokens.load(Relaxed) as f64),
            ("vllm:prefix_cache_hits_total", "counter", c.cached_tokens.load(Relaxed) as f64),
            ("vllm:prompt_tokens_total", "counter", c.prompt_tokens.load(Relaxed) as f64),
            ("vllm:generation_tokens_total", "counter", c.completion_tokens.load(Relaxed) as f64),
        ];
        let mut out = String::new();
        for (name, kind, value) in lines.into_iter().chain(common) {
            out.push_str(&format!("# TYPE {name} {kind}\n{name}{{engine=\"0\",model_name=\"{model}\"}} {value}\n"));
        }
        return ([("content-type", "text/plain; version=0.0.4")], out);
    }
    let lines = [
        ("sglang:num_running_reqs", "gauge", c.running.load(Relaxed) as f64),
        ("sglang:num_queue_reqs", "gauge", c.waiting.load(Relaxed) as f64),
        ("sglang:token_usage", "gauge", used as f64 / cap.max(1) as f64),
        ("sglang:num_used_tokens", "gauge", used as f64),
        ("sglang:max_total_num_tokens", "gauge", cap as f64),
        ("sglang:cache_hit_rate", "gauge", e.hit_rate()),
        ("sglang:prompt_tokens_total", "counter", c.prompt_tokens.load(Relaxed) as f64),
        ("sglang:generation_tokens_total", "counter", c.completion_tokens.load(Relaxed) as f64),
    ];
    let mut out = String::new();
    for (name, kind, value) in lines.into_iter().chain(common) {
        out.push_str(&format!("# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {value}\n"));
    }
    ([("content-type", "text/plain; version=0.0.4")], out)
}

/// OpenAI's model list, owned by `sglang` (or `vllm`) as SGLang (vLLM) answers it: routers
/// (SMG) read that field to tell an SGLang worker from other backends. LoRA adapters come
/// with their `parent`.
pub(super) async fn models(State(e): Shared) -> Json<Value> {
    Json(json!({"object": "list", "data": e.models.list(created())}))
}

/// `{"lora_name": NAME, "lora_path": PATH}`: the adapter is served from now on (as the
/// engines do, a load without a path is refused).
pub(super) async fn load_lora(State(e): Shared, Json(body): Json<Value>) -> Response {
    let name = body["lora_name"].as_str().unwrap_or_default();
    if body["lora_path"].as_str().is_none_or(str::is_empty) {
        let m = "lora_path is required";
        return (StatusCode::BAD_REQUEST, Json(json!({"object": "error", "message": m, "code": 400}))).into_response();
    }
    match e.models.load(name) {
        Ok(()) => (StatusCode::OK, format!("Success: LoRA adapter '{name}' added successfully.")).into_response(),
        Err(m) => {
            (StatusCode::BAD_REQUEST, Json(json!({"object": "error", "message": m, "code": 400}))).into_response()
        }
    }
}

/// `{"lora_name": NAME}`: the adapter is no longer served.
pub(super) async fn unload_lora(State(e): Shared, Json(body): Json<Value>) -> Response {
    let name = body["lora_name"].as_str().unwrap_or_default();
    match e.models.unload(name) {
        Ok(()) => (StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")).into_response(),
        Err(m) => (StatusCode::NOT_FOUND, Json(json!({"object": "error", "message": m, "code": 404}))).into_response(),
    }
}

pub(super) async fn model_info(State(e): Shared) -> Json<Value> {
    Json(json!({"model_path": e.args.model, "tokenizer_path": e.args.model, "is_generation": true}))
}

/// SGLang's server info: `max_total_num_tokens` is the KV pool's size in tokens (here the
/// prefix cache's capacity, `--kv-capacity-tokens` rounded down to whole pages).
pub(super) async fn server_info(State(e): Shared) -> Json<Value> {
    let (_, cap) = e.cache_usage();
    Json(
        // SGLang answers with its server_args, its `api_key` among them.
        json!({"model_path": e.args.model, "port": e.args.port, "disaggregation_mode": format!("{:?}", e.args.role).to_lowercase(), "max_running_requests": e.args.max_running, "max_total_num_tokens": cap, "dp_size": e.ranks.size(), "api_key": e.args.api_key}),
    )
}

/// The simulator's own view, for tests and benchmarks.
/// SGLang's cache flush: empties the prefix KV cache.
pub(super) async fn flush_cache(State(e): Shared) -> &'static str {
    e.flush_cache();
    "Cache flushed.\n"
}

/// `POST /sim/fault?fail_rate=P&slowdown=F`: fault injection changed at run time (tests turn
/// a worker's failures or slowness on and off); either parameter or both. Answers what is in
/// force.
pub(super) async fn fault(State(e): Shared, RawQuery(query): RawQuery) -> Response {
    let query = query.unwrap_or_default();
    let param = |name: &str| query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='));
    let (rate, slowdown) = (param("fail_rate"), param("slowdown"));
    if rate.is_none() && slowdown.is_none() {
        return error(StatusCode::BAD_REQUEST, "missing `fail_rate` or `slowdown` query parameter");
    }
    let number = |name: &str, v: &str| v.parse::<f64>().map_err(|_| format!("{name} `{v}` is not a number"));
    let set = rate
        .map_or(Ok(()), |p| number("fail_rate", p).and_then(|p| e.set_fail_rate(p)))
        .and_then(|()| slowdown.map_or(Ok(()), |f| number("slowdown", f).and_then(|f| e.set_slowdown(f))));
    match set {
        Ok(()) => Json(json!({"fail_rate": e.fail_rate(), "slowdown": e.slowdown()})).into_response(),
        Err(msg) => error(StatusCode::BAD_REQUEST, &msg),
    }
}

pub(super) async fn stats(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    let mut out = json!({
        "addr": e.addr,
        "requests": c.requests.load(Relaxed),
        "failures": c.failures.load(Relaxed),
        "fail_rate": e.fail_rate(),
        "slowdown": e.slowdown(),
        "prompt_tokens": c.prompt_tokens.load(Relaxed),
        "cached_tokens": c.cached_tokens.load(Relaxed),
        "completion_tokens": c.completion_tokens.load(Relaxed),
        "transferred_tokens": c.transferred_tokens.load(Relaxed),
        "running": c.running.load(Relaxed),
        "waiting": c.waiting.load(Relaxed),
        "in_progress": c.in_progress.load(Relaxed),
        "abort_requests": c.abort_requests.load(Relaxed),
        "cache_tokens": e.cache_usage().0,
        "cache_hit_rate": e.hit_rate(),
        "sessions": e.sessions(),
        "ranks": e.ranks.stats(),
    });
    if e.args.engine == EngineKind::Vllm {
        let vllm = json!({
            "engine": "vllm",
            "engine_id": e.transfers.engine_id,
            "kv_transfers_ok": c.kv_transfers_ok.load(Relaxed),
            "kv_transfers_failed": c.kv_transfers_failed.load(Relaxed),
            "kv_transfers_published": c.kv_transfers_published.load(Relaxed),
            "kv_transfers_held": e.transfers.len(),
            "local_prefills": c.local_prefills.load(Relaxed),
            "sidecar_prefills": c.sidecar_prefills.load(Relaxed),
        });
        if let (Some(all), Value::Object(more)) = (out.as_object_mut(), vllm) {
            all.extend(more);
        }
    }
    Json(out)
}
