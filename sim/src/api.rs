//! The HTTP API: SGLang's native endpoints and the OpenAI ones, JSON and SSE.

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::join_all;
use futures_util::Stream;
use kvmesh_core::Endpoint;
use serde_json::{json, Value};

use crate::engine::Engine;
use crate::prompt::{Job, Prompt};

type Shared = State<Arc<Engine>>;

pub fn router(engine: Arc<Engine>) -> Router {
    let addr = HeaderValue::from_str(&engine.addr).unwrap_or(HeaderValue::from_static("unknown"));
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/get_load", get(get_load))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/sim/stats", get(stats))
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::map_response(move |mut r: Response| {
            let addr = addr.clone();
            async move {
                // Which process really served: tests compare it with the gateway's claim.
                r.headers_mut().insert("x-sim-worker", addr);
                r
            }
        }))
        .with_state(engine)
}

fn error(status: StatusCode, message: &str) -> Response {
    let kind = if status.is_client_error() { "BadRequestError" } else { "InternalServerError" };
    (status, Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))).into_response()
}

async fn generate(State(e): Shared, body: Bytes) -> Response {
    serve(e, Endpoint::Generate, body).await
}

async fn completions(State(e): Shared, body: Bytes) -> Response {
    serve(e, Endpoint::Completions, body).await
}

async fn chat(State(e): Shared, body: Bytes) -> Response {
    serve(e, Endpoint::ChatCompletions, body).await
}

/// One item's result.
struct Done {
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    latency: f64,
}

fn token(i: u64) -> String {
    format!(" w{i}")
}

async fn run_item(e: &Engine, item: &Prompt, max_tokens: u64) -> Option<Done> {
    let run = e.admit(&item.bytes, item.tokens).await.ok()?;
    let mut text = String::new();
    for i in 0..max_tokens {
        e.decode_step().await;
        text.push_str(&token(i));
    }
    Some(Done {
        text,
        prompt_tokens: item.tokens,
        cached_tokens: run.cached_tokens,
        completion_tokens: max_tokens,
        latency: run.started.elapsed().as_secs_f64(),
    })
}

async fn serve(e: Arc<Engine>, endpoint: Endpoint, body: Bytes) -> Response {
    let job = match Job::parse(endpoint, &body, e.args.default_max_tokens) {
        Ok(j) => j,
        Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
    };
    if e.accept().is_err() {
        return error(StatusCode::INTERNAL_SERVER_ERROR, &format!("injected failure on {}", e.addr));
    }
    if job.stream {
        return Sse::new(stream(e, endpoint, job)).into_response();
    }
    let done: Option<Vec<Done>> =
        join_all(job.items.iter().map(|item| run_item(&e, item, job.max_tokens))).await.into_iter().collect();
    let Some(done) = done else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    };
    let body = match endpoint {
        Endpoint::Generate => {
            let items: Vec<Value> =
                done.iter().enumerate().map(|(i, d)| generate_item(&d.text, &job.rid(i), d, true)).collect();
            if job.batch {
                Value::Array(items)
            } else {
                items.into_iter().next().unwrap_or(Value::Null)
            }
        }
        Endpoint::Completions => openai_body(&e, "text_completion", &done, |d| json!({"text": d.text})),
        Endpoint::ChatCompletions => {
            openai_body(&e, "chat.completion", &done, |d| json!({"message": {"role": "assistant", "content": d.text}}))
        }
    };
    Json(body).into_response()
}

fn meta(rid: &str, d: &Done, finished: bool) -> Value {
    json!({
        "id": rid,
        "finish_reason": if finished { json!({"type": "length", "length": d.completion_tokens}) } else { Value::Null },
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "cached_tokens": d.cached_tokens,
        "e2e_latency": d.latency,
    })
}

fn generate_item(text: &str, rid: &str, d: &Done, finished: bool) -> Value {
    json!({"text": text, "meta_info": meta(rid, d, finished)})
}

fn usage(done: &[Done]) -> Value {
    let prompt: u64 = done.iter().map(|d| d.prompt_tokens).sum();
    let completion: u64 = done.iter().map(|d| d.completion_tokens).sum();
    let cached: u64 = done.iter().map(|d| d.cached_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn created() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn openai_body(e: &Engine, object: &str, done: &[Done], choice: impl Fn(&Done) -> Value) -> Value {
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut c = choice(d);
            c["index"] = json!(i);
            c["finish_reason"] = json!("length");
            c["logprobs"] = Value::Null;
            c
        })
        .collect();
    json!({
        "id": format!("cmpl-{:024x}", fastrand::u128(..)),
        "object": object,
        "created": created(),
        "model": e.args.model,
        "choices": choices,
        "usage": usage(done),
    })
}

fn event(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// The SSE stream of a request: SGLang's cumulative-text events for `/generate`, OpenAI
/// chunks otherwise, then `data: [DONE]`.
fn stream(e: Arc<Engine>, endpoint: Endpoint, job: Job) -> impl Stream<Item = Result<Event, Infallible>> {
    async_stream::stream! {
        let id = format!("cmpl-{:024x}", fastrand::u128(..));
        let object = if endpoint == Endpoint::ChatCompletions { "chat.completion.chunk" } else { "text_completion" };
        let mut all = Vec::new();
        for (index, item) in job.items.iter().enumerate() {
            let rid = job.rid(index);
            let Ok(run) = e.admit(&item.bytes, item.tokens).await else { break };
            if endpoint == Endpoint::ChatCompletions {
                yield event(&chunk(&e, &id, object, index, json!({"delta": {"role": "assistant", "content": ""}}), None));
            }
            let mut text = String::new();
            for i in 0..job.max_tokens {
                e.decode_step().await;
                let piece = token(i);
                text.push_str(&piece);
                let last = i + 1 == job.max_tokens;
                let finish = last.then_some("length");
                let v = match endpoint {
                    Endpoint::Generate => {
                        let d = Done { text: String::new(), prompt_tokens: item.tokens, cached_tokens: run.cached_tokens, completion_tokens: i + 1, latency: run.started.elapsed().as_secs_f64() };
                        let mut v = generate_item(&text, &rid, &d, last);
                        v["index"] = json!(index);
                        v
                    }
                    Endpoint::Completions => chunk(&e, &id, object, index, json!({"text": piece}), finish),
                    Endpoint::ChatCompletions => chunk(&e, &id, object, index, json!({"delta": {"content": piece}}), finish),
                };
                yield event(&v);
            }
            all.push(Done { text, prompt_tokens: item.tokens, cached_tokens: run.cached_tokens, completion_tokens: job.max_tokens, latency: run.started.elapsed().as_secs_f64() });
        }
        if job.include_usage && endpoint != Endpoint::Generate {
            yield event(&json!({"id": id, "object": object, "created": created(), "model": e.args.model, "choices": [], "usage": usage(&all)}));
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}

fn chunk(e: &Engine, id: &str, object: &str, index: usize, mut choice: Value, finish: Option<&str>) -> Value {
    choice["index"] = json!(index);
    choice["finish_reason"] = json!(finish);
    json!({"id": id, "object": object, "created": created(), "model": e.args.model, "choices": [choice]})
}

async fn health() -> &'static str {
    ""
}

/// SGLang's current `/get_load` shape: one object per data-parallel rank.
async fn get_load(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    let (running, waiting) = (c.running.load(Relaxed), c.waiting.load(Relaxed));
    let (used, _) = e.cache_usage();
    Json(json!([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": used}]))
}

async fn metrics(State(e): Shared) -> impl IntoResponse {
    let c = &e.counters;
    let (used, cap) = e.cache_usage();
    let lines = [
        ("sglang:num_running_reqs", "gauge", c.running.load(Relaxed) as f64),
        ("sglang:num_queue_reqs", "gauge", c.waiting.load(Relaxed) as f64),
        ("sglang:token_usage", "gauge", used as f64 / cap.max(1) as f64),
        ("sglang:cache_hit_rate", "gauge", e.hit_rate()),
        ("sglang:prompt_tokens_total", "counter", c.prompt_tokens.load(Relaxed) as f64),
        ("sglang:generation_tokens_total", "counter", c.completion_tokens.load(Relaxed) as f64),
        ("kvmesh_sim_cached_tokens_total", "counter", c.cached_tokens.load(Relaxed) as f64),
        ("kvmesh_sim_requests_total", "counter", c.requests.load(Relaxed) as f64),
        ("kvmesh_sim_failures_total", "counter", c.failures.load(Relaxed) as f64),
    ];
    let mut out = String::new();
    for (name, kind, value) in lines {
        out.push_str(&format!("# TYPE {name} {kind}\n{name}{{model_name=\"{}\"}} {value}\n", e.args.model));
    }
    ([("content-type", "text/plain; version=0.0.4")], out)
}

async fn models(State(e): Shared) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": e.args.model, "object": "model", "created": created(), "owned_by": "kvmesh-sim"}]}),
    )
}

async fn model_info(State(e): Shared) -> Json<Value> {
    Json(json!({"model_path": e.args.model, "tokenizer_path": e.args.model, "is_generation": true}))
}

async fn server_info(State(e): Shared) -> Json<Value> {
    Json(
        json!({"model_path": e.args.model, "port": e.args.port, "disaggregation_mode": format!("{:?}", e.args.role).to_lowercase(), "max_running_requests": e.args.max_running}),
    )
}

/// The simulator's own view, for tests and benchmarks.
async fn stats(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    Json(json!({
        "addr": e.addr,
        "requests": c.requests.load(Relaxed),
        "failures": c.failures.load(Relaxed),
        "prompt_tokens": c.prompt_tokens.load(Relaxed),
        "cached_tokens": c.cached_tokens.load(Relaxed),
        "completion_tokens": c.completion_tokens.load(Relaxed),
        "running": c.running.load(Relaxed),
        "waiting": c.waiting.load(Relaxed),
        "cache_hit_rate": e.hit_rate(),
    }))
}
