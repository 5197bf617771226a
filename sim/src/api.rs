//! The HTTP API: SGLang's native endpoints and the OpenAI ones, JSON and SSE.

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::join_all;
use futures_util::Stream;
use serde_json::{json, Value};

use crate::bootstrap::{self, RoomKv};
use crate::cli::Role;
use crate::engine::Engine;
use crate::prompt::{Endpoint, Job, Prompt};

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
        .route("/flush_cache", post(flush_cache))
        .route("/abort_request", post(abort_request))
        .route("/sim/stats", get(stats))
        .route("/sim/requests", get(recent))
        .route("/sim/fault", post(fault))
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

async fn generate(State(e): Shared, headers: HeaderMap, body: Bytes) -> Response {
    serve(e, Endpoint::Generate, &headers, body).await
}

async fn completions(State(e): Shared, headers: HeaderMap, body: Bytes) -> Response {
    serve(e, Endpoint::Completions, &headers, body).await
}

async fn chat(State(e): Shared, headers: HeaderMap, body: Bytes) -> Response {
    serve(e, Endpoint::ChatCompletions, &headers, body).await
}

/// One item's result.
struct Done {
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    latency: f64,
    /// `meta_info.input_token_logprobs`, when asked for.
    input_logprobs: Option<Value>,
}

fn token(i: u64) -> String {
    format!(" w{i}")
}

/// How one item is served, decided before any byte of the response is sent.
#[derive(Clone, Copy)]
enum Plan {
    /// Prefill here and decode here (regular worker, or a decode worker given no room).
    Local,
    /// PD prefill: prefill here, publish the KV under the room, answer one token.
    Prefill { room: u64 },
    /// PD decode: the KV came from the prefill worker.
    Decode { tokens: u64 },
}

fn prompt_hash(item: &Prompt) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&item.bytes)
}

/// Input logprobs in SGLang's shape `[logprob, token_id, text]`; the text says which worker
/// computed the entry (`p` prefill, `d` decode, `t` a regular worker), so merged lists can
/// be checked for order.
fn input_logprobs(item: &Prompt, plan: Plan) -> Value {
    let entry = |i: u64, tag: char| json!([-((i % 997) as f64) / 1000.0, 1000 + i, format!("{tag}{i}")]);
    match plan {
        Plan::Prefill { .. } => Value::Array((0..item.tokens).map(|i| entry(i, 'p')).collect()),
        Plan::Decode { .. } => json!([entry(item.tokens - 1, 'd')]),
        Plan::Local => Value::Array((0..item.tokens).map(|i| entry(i, 't')).collect()),
    }
}

/// Works out each item's plan; for a decode worker that means fetching the KV of its room.
async fn plan(e: &Engine, job: &Job) -> Result<Vec<Plan>, (StatusCode, String)> {
    let mut plans = Vec::with_capacity(job.items.len());
    for (item, boot) in job.items.iter().zip(&job.boots) {
        let plan = match (e.args.role, boot.room) {
            (Role::Regular, _) => Plan::Local,
            (Role::Prefill, Some(room)) => Plan::Prefill { room },
            (Role::Prefill, None) => {
                return Err((StatusCode::BAD_REQUEST, "disaggregated prefill request without bootstrap_room".into()))
            }
            (Role::Decode, None) => Plan::Local,
            (Role::Decode, Some(room)) => {
                let Some(host) = &boot.host else {
                    return Err((StatusCode::BAD_REQUEST, format!("bootstrap_room {room} without bootstrap_host")));
                };
                let port = boot.port.flatten().unwrap_or(e.args.default_bootstrap_port);
                let wait = std::time::Duration::from_millis(e.args.bootstrap_timeout_ms);
                let kv = bootstrap::fetch(host, port, room, wait)
                    .await
                    .map_err(|m| (StatusCode::INTERNAL_SERVER_ERROR, m))?;
                if kv.prompt_hash != prompt_hash(item) {
                    return Err((
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("KV of bootstrap_room {room} at {host}:{port} was computed for another prompt"),
                    ));
                }
                Plan::Decode { tokens: kv.tokens }
            }
        };
        plans.push(plan);
    }
    Ok(plans)
}

async fn admit<'a>(e: &'a Engine, item: &Prompt, plan: Plan) -> Option<crate::engine::Run<'a>> {
    let run = match plan {
        Plan::Decode { tokens } => e.admit_transferred(tokens).await,
        _ => e.admit(&item.bytes, item.tokens).await,
    }
    .ok()?;
    if let Plan::Prefill { room } = plan {
        e.rooms.publish(room, RoomKv { prompt_hash: prompt_hash(item), tokens: item.tokens });
    }
    Some(run)
}

fn output_tokens(plan: Plan, max_tokens: u64) -> u64 {
    // A prefill worker produces the first token only; the decode worker does the rest.
    if matches!(plan, Plan::Prefill { .. }) {
        1
    } else {
        max_tokens
    }
}

async fn run_item(e: &Engine, item: &Prompt, plan: Plan, logprobs: bool, max_tokens: u64) -> Option<Done> {
    let run = admit(e, item, plan).await?;
    let n = output_tokens(plan, max_tokens);
    let mut text = String::new();
    for i in 0..n {
        e.decode_step().await;
        text.push_str(&token(i));
    }
    Some(Done {
        text,
        prompt_tokens: item.tokens,
        cached_tokens: run.cached_tokens,
        completion_tokens: n,
        latency: run.started.elapsed().as_secs_f64(),
        input_logprobs: logprobs.then(|| input_logprobs(item, plan)),
    })
}

/// Counts a request in `in_progress` until it is answered or its client goes away (the
/// server drops the handler then).
struct InProgress(Arc<Engine>);

impl InProgress {
    fn new(e: &Arc<Engine>) -> Self {
        e.counters.in_progress.fetch_add(1, Relaxed);
        Self(Arc::clone(e))
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.counters.in_progress.fetch_sub(1, Relaxed);
    }
}

async fn serve(e: Arc<Engine>, endpoint: Endpoint, headers: &HeaderMap, body: Bytes) -> Response {
    let _counted = InProgress::new(&e);
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(String::from);
    if let Some(session) = headers.get("x-session-id").and_then(|v| v.to_str().ok()) {
        e.record_session(session);
    }
    let recorded = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    e.record(json!({"path": endpoint_path(endpoint), "x_request_id": request_id, "body": recorded}));
    let job = match Job::parse(endpoint, &body, e.args.default_max_tokens) {
        Ok(j) => j,
        Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
    };
    if e.accept().is_err() {
        return error(StatusCode::INTERNAL_SERVER_ERROR, &format!("injected failure on {}", e.addr));
    }
    let abortable = e.abortable(job.given_rids());
    tokio::select! {
        r = serve_job(e, endpoint, job) => r,
        () = abortable.aborted() => error(StatusCode::BAD_REQUEST, "aborted by /abort_request"),
    }
}

/// `POST /abort_request {"rid": ...}`, as SGLang: the request with that rid stops (its
/// computation and, for a PD prefill, the KV it would publish). Streams already answering are
/// not stopped.
async fn abort_request(State(e): Shared, body: Bytes) -> Response {
    let recorded = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    let rid = recorded["rid"].as_str().map(String::from);
    e.counters.abort_requests.fetch_add(1, Relaxed);
    e.record(json!({"path": "/abort_request", "x_request_id": null, "body": recorded}));
    let Some(rid) = rid else { return error(StatusCode::BAD_REQUEST, "`rid` (a string) is required") };
    Json(json!({"rid": rid, "aborted": e.abort(&rid)})).into_response()
}

async fn serve_job(e: Arc<Engine>, endpoint: Endpoint, job: Job) -> Response {
    let plans = match plan(&e, &job).await {
        Ok(p) => p,
        Err((status, msg)) => return error(status, &msg),
    };
    if job.stream {
        return Sse::new(stream(e, endpoint, job, plans)).into_response();
    }
    let runs = job
        .items
        .iter()
        .zip(&plans)
        .zip(&job.logprobs)
        .map(|((item, &plan), &lp)| run_item(&e, item, plan, lp, job.max_tokens));
    let done: Option<Vec<Done>> = join_all(runs).await.into_iter().collect();
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

fn endpoint_path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Generate => "/generate",
        Endpoint::Completions => "/v1/completions",
        Endpoint::ChatCompletions => "/v1/chat/completions",
    }
}

fn meta(rid: &str, d: &Done, finished: bool) -> Value {
    let mut m = json!({
        "id": rid,
        "finish_reason": if finished { json!({"type": "length", "length": d.completion_tokens}) } else { Value::Null },
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "cached_tokens": d.cached_tokens,
        "e2e_latency": d.latency,
    });
    if let Some(lp) = &d.input_logprobs {
        m["input_token_logprobs"] = lp.clone();
        m["output_token_logprobs"] =
            Value::Array((0..d.completion_tokens).map(|i| json!([-0.25, 2000 + i, Value::Null])).collect());
    }
    m
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
fn stream(
    e: Arc<Engine>,
    endpoint: Endpoint,
    job: Job,
    plans: Vec<Plan>,
) -> impl Stream<Item = Result<Event, Infallible>> {
    async_stream::stream! {
        let id = format!("cmpl-{:024x}", fastrand::u128(..));
        let object = if endpoint == Endpoint::ChatCompletions { "chat.completion.chunk" } else { "text_completion" };
        let mut all = Vec::new();
        for (index, item) in job.items.iter().enumerate() {
            let rid = job.rid(index);
            let plan = plans.get(index).copied().unwrap_or(Plan::Local);
            let lp = job.logprobs.get(index).copied().unwrap_or(false).then(|| input_logprobs(item, plan));
            let Some(run) = admit(&e, item, plan).await else { break };
            if endpoint == Endpoint::ChatCompletions {
                yield event(&chunk(&e, &id, object, index, json!({"delta": {"role": "assistant", "content": ""}}), None));
            }
            let n = output_tokens(plan, job.max_tokens);
            let mut text = String::new();
            for i in 0..n {
                e.decode_step().await;
                let piece = token(i);
                text.push_str(&piece);
                let last = i + 1 == n;
                let finish = last.then_some("length");
                let v = match endpoint {
                    Endpoint::Generate => {
                        let d = Done { text: String::new(), prompt_tokens: item.tokens, cached_tokens: run.cached_tokens, completion_tokens: i + 1, latency: run.started.elapsed().as_secs_f64(), input_logprobs: lp.clone() };
                        let mut v = generate_item(&text, &rid, &d, last);
                        v["index"] = json!(index);
                        v
                    }
                    Endpoint::Completions => chunk(&e, &id, object, index, json!({"text": piece}), finish),
                    Endpoint::ChatCompletions => chunk(&e, &id, object, index, json!({"delta": {"content": piece}}), finish),
                };
                yield event(&v);
            }
            all.push(Done { text, prompt_tokens: item.tokens, cached_tokens: run.cached_tokens, completion_tokens: n, latency: run.started.elapsed().as_secs_f64(), input_logprobs: None });
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

/// The last requests this worker received (generations and `/abort_request`s), oldest first
/// (`/sim/requests`).
async fn recent(State(e): Shared) -> Json<Value> {
    Json(Value::Array(e.recent.lock().map(|r| r.iter().cloned().collect()).unwrap_or_default()))
}

async fn health() -> &'static str {
    ""
}

/// SGLang's current `/get_load` shape: one object per data-parallel rank.
async fn get_load(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    let (running, waiting) = (c.running.load(Relaxed), c.waiting.load(Relaxed));
    let (used, _) = e.kv_usage();
    Json(json!([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": used}]))
}

async fn metrics(State(e): Shared) -> impl IntoResponse {
    let c = &e.counters;
    let (used, cap) = e.kv_usage();
    let lines = [
        ("sglang:num_running_reqs", "gauge", c.running.load(Relaxed) as f64),
        ("sglang:num_queue_reqs", "gauge", c.waiting.load(Relaxed) as f64),
        ("sglang:token_usage", "gauge", used as f64 / cap.max(1) as f64),
        ("sglang:num_used_tokens", "gauge", used as f64),
        ("sglang:max_total_num_tokens", "gauge", cap as f64),
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

/// OpenAI's model list, owned by `sglang` as SGLang answers it: routers (SMG) read that
/// field to tell an SGLang worker from other backends.
async fn models(State(e): Shared) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": e.args.model, "object": "model", "created": created(), "owned_by": "sglang"}]}),
    )
}

async fn model_info(State(e): Shared) -> Json<Value> {
    Json(json!({"model_path": e.args.model, "tokenizer_path": e.args.model, "is_generation": true}))
}

/// SGLang's server info: `max_total_num_tokens` is the KV pool's size in tokens (here the
/// prefix cache's capacity, `--kv-capacity-tokens` rounded down to whole pages).
async fn server_info(State(e): Shared) -> Json<Value> {
    let (_, cap) = e.cache_usage();
    Json(
        json!({"model_path": e.args.model, "port": e.args.port, "disaggregation_mode": format!("{:?}", e.args.role).to_lowercase(), "max_running_requests": e.args.max_running, "max_total_num_tokens": cap}),
    )
}

/// The simulator's own view, for tests and benchmarks.
/// SGLang's cache flush: empties the prefix KV cache.
async fn flush_cache(State(e): Shared) -> &'static str {
    e.flush_cache();
    "Cache flushed.\n"
}

/// `POST /sim/fault?fail_rate=P&slowdown=F`: fault injection changed at run time (tests turn
/// a worker's failures or slowness on and off); either parameter or both. Answers what is in
/// force.
async fn fault(State(e): Shared, RawQuery(query): RawQuery) -> Response {
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

async fn stats(State(e): Shared) -> Json<Value> {
    let c = &e.counters;
    Json(json!({
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
    }))
}
