//! The HTTP API: SGLang's native endpoints and the OpenAI ones, JSON and SSE; with
//! `--engine vllm`, vLLM's (the OpenAI ones only, vLLM's metric names, PD through
//! `kv_transfer_params`, optionally llm-d's decode sidecar).

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::join_all;
use futures_util::Stream;
use serde_json::{json, Value};

use crate::bootstrap::{self, RoomKv};
use crate::cli::{EngineKind, Role};
use crate::engine::Engine;
use crate::models::Target;
use crate::prompt::{Endpoint, Job, Prompt};
use crate::vllm::{self, Kv, Remote, Transfer};

mod info;

use info::{
    fault, flush_cache, get_load, health, load_lora, metrics, model_info, models, recent, server_info, stats,
    unload_lora,
};

type Shared = State<Arc<Engine>>;

pub fn router(engine: Arc<Engine>) -> Router {
    let addr = HeaderValue::from_str(&engine.addr).unwrap_or(HeaderValue::from_static("unknown"));
    let common = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
        .route("/unload_lora_adapter", post(unload_lora))
        .route("/sim/stats", get(stats))
        .route("/sim/requests", get(recent))
        .route("/sim/fault", post(fault));
    let common = common.merge(crate::admin::routes(engine.args.engine));
    let app = match engine.args.engine {
        EngineKind::Sglang => common
            .route("/generate", post(generate))
            .route("/health_generate", get(health))
            .route("/get_load", get(get_load))
            .route("/get_model_info", get(model_info))
            .route("/get_server_info", get(server_info))
            .route("/flush_cache", post(flush_cache))
            .route("/abort_request", post(abort_request)),
        // vLLM serves no SGLang endpoint (`/generate` included): FastAPI's 404.
        EngineKind::Vllm => common
            .route("/sim/kv/pull", post(vllm::pull_handler).with_state(Arc::clone(&engine.transfers)))
            .fallback(not_found),
    };
    let app = match engine.args.api_key.clone() {
        Some(key) => {
            let engine_kind = engine.args.engine;
            app.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
                let allowed = !needs_key(engine_kind, req.uri().path())
                    || req.headers().get("authorization").and_then(|v| v.to_str().ok())
                        == Some(format!("Bearer {key}").as_str());
                async move {
                    match allowed {
                        true => next.run(req).await,
                        false => (StatusCode::UNAUTHORIZED, Json(json!({"error": "Unauthorized"}))).into_response(),
                    }
                }
            }))
        }
        None => app,
    };
    app.layer(DefaultBodyLimit::disable())
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

/// Whether `--api-key` guards `path`, as the engine does: SGLang every path but its health and
/// metrics, vLLM its OpenAI API; never the simulator's own controls.
fn needs_key(engine: EngineKind, path: &str) -> bool {
    match engine {
        _ if path.starts_with("/sim/") => false,
        EngineKind::Sglang => !path.starts_with("/health") && path != "/metrics",
        EngineKind::Vllm => path.starts_with("/v1"),
    }
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
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
    /// vLLM PD prefill: prefill here, answer as asked, and keep the KV for a decode to pull.
    Handover,
    /// vLLM PD decode: the KV was pulled from the prefill worker.
    Pulled,
}

/// What a request is served as, beyond its items.
struct Ctx {
    /// The model it runs on.
    target: Target,
    /// vLLM: its KV transfer.
    transfer: Transfer,
    /// The OpenAI answer's id (vLLM: `cmpl-`/`chatcmpl-` and the request's `x-request-id`).
    id: String,
    vllm: bool,
    /// The data-parallel rank it runs on (`--dp-size`).
    rank: usize,
}

impl Ctx {
    /// The id vLLM gives the request inside its engine (`remote_request_id`).
    fn engine_request_id(&self, endpoint: Endpoint) -> String {
        match endpoint {
            Endpoint::ChatCompletions => self.id.clone(),
            _ => format!("{}-0", self.id),
        }
    }
}

/// The prompt's identity as a KV transfer carries it (the model's seed included; seed 0
/// hashes as before).
fn prompt_hash(item: &Prompt, seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&item.bytes, seed)
}

/// Input logprobs in SGLang's shape `[logprob, token_id, text]`; the text says which worker
/// computed the entry (`p` prefill, `d` decode, `t` a regular worker), so merged lists can
/// be checked for order.
fn input_logprobs(item: &Prompt, plan: Plan) -> Value {
    let entry = |i: u64, tag: char| json!([-((i % 997) as f64) / 1000.0, 1000 + i, format!("{tag}{i}")]);
    match plan {
        Plan::Prefill { .. } | Plan::Handover => Value::Array((0..item.tokens).map(|i| entry(i, 'p')).collect()),
        Plan::Decode { .. } | Plan::Pulled => json!([entry(item.tokens - 1, 'd')]),
        Plan::Local => Value::Array((0..item.tokens).map(|i| entry(i, 't')).collect()),
    }
}

/// Works out each item's plan; for a decode worker that means fetching the KV of its room.
async fn plan(e: &Engine, job: &Job, ctx: &Ctx) -> Result<Vec<Plan>, (StatusCode, String)> {
    if ctx.vllm {
        let plan = vllm_plan(e, job, ctx).await;
        let counter = match (&ctx.transfer, &plan) {
            (Transfer::None, _) => Some(&e.counters.local_prefills),
            (Transfer::Produce, Ok(_)) => None, // counted when the KV is handed over
            (Transfer::Consume(_), Ok(_)) => Some(&e.counters.kv_transfers_ok),
            (_, Err(_)) => Some(&e.counters.kv_transfers_failed),
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Relaxed);
        }
        return plan.map(|p| vec![p; job.items.len()]);
    }
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
                if kv.prompt_hash != prompt_hash(item, ctx.target.seed) {
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

/// A vLLM request's plan (one for all its items): computed here, handed over to a decode, or
/// pulled from a prefill.
async fn vllm_plan(e: &Engine, job: &Job, ctx: &Ctx) -> Result<Plan, (StatusCode, String)> {
    let bad = |msg: String| Err((StatusCode::BAD_REQUEST, msg));
    let role = format!("{:?}", e.args.role).to_lowercase();
    let (remote, wanted) = match &ctx.transfer {
        Transfer::None => return Ok(Plan::Local),
        Transfer::Produce => (None, Role::Prefill),
        Transfer::Consume(r) => (Some(r), Role::Decode),
    };
    if e.args.role != wanted {
        let asked = if remote.is_some() { "do_remote_prefill" } else { "do_remote_decode" };
        let wanted = format!("{wanted:?}").to_lowercase();
        return bad(format!("kv_transfer_params.{asked} sent to a {role} worker (only a {wanted} worker takes it)"));
    }
    if job.items.len() != 1 {
        return bad("a KV transfer takes one prompt, not a batch".into());
    }
    let Some(remote) = remote else {
        if job.stream {
            return bad("kv_transfer_params.do_remote_decode needs \"stream\": false (the parameters for the decode come in the JSON answer)".into());
        }
        return Ok(Plan::Handover);
    };
    let kv = pull(e, remote).await.map_err(|m| (StatusCode::INTERNAL_SERVER_ERROR, m))?;
    let item = &job.items[0];
    if kv != (Kv { prompt_hash: prompt_hash(item, ctx.target.seed), tokens: item.tokens }) {
        let at = crate::client::authority(&remote.host, remote.port);
        return Err((
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the KV pulled from engine `{}` at {at} was computed for another prompt", remote.engine_id),
        ));
    }
    Ok(Plan::Pulled)
}

async fn pull(e: &Engine, remote: &Remote) -> Result<Kv, String> {
    vllm::pull(remote, std::time::Duration::from_millis(e.args.bootstrap_timeout_ms)).await
}

async fn admit<'a>(e: &'a Engine, item: &Prompt, plan: Plan, seed: u64) -> Option<crate::engine::Run<'a>> {
    let run = match plan {
        Plan::Decode { tokens } => e.admit_transferred(tokens).await,
        Plan::Pulled => e.admit_pulled(&item.bytes, item.tokens, seed).await,
        _ => e.admit(&item.bytes, item.tokens, seed).await,
    }
    .ok()?;
    if let Plan::Prefill { room } = plan {
        e.rooms.publish(room, RoomKv { prompt_hash: prompt_hash(item, seed), tokens: item.tokens });
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

async fn run_item(e: &Engine, item: &Prompt, plan: Plan, logprobs: bool, max_tokens: u64, seed: u64) -> Option<Done> {
    let run = admit(e, item, plan, seed).await?;
    let n = output_tokens(plan, max_tokens);
    let mut text = String::new();
    for i in 0..n {
        e.decode_step().await;
        text.push_str(&token(i));
    }
    if matches!(plan, Plan::Local) {
        e.finished(&item.bytes, &text, seed);
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

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

async fn serve(e: Arc<Engine>, endpoint: Endpoint, headers: &HeaderMap, body: Bytes) -> Response {
    let _counted = InProgress::new(&e);
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(String::from);
    let prefiller = header(headers, "x-prefiller-host-port");
    if let Some(session) = headers.get("x-session-id").and_then(|v| v.to_str().ok()) {
        e.record_session(session);
    }
    let recorded = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    // W3C trace context as received: tests check that every leg carries the client's.
    e.record(json!({"path": endpoint_path(endpoint), "x_request_id": request_id,
                    "x_prefiller_host_port": prefiller, "traceparent": header(headers, "traceparent"),
                    "tracestate": header(headers, "tracestate"), "body": recorded}));
    let job = match Job::parse(endpoint, &body, e.args.default_max_tokens) {
        Ok(j) => j,
        Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
    };
    let target = match e.models.resolve(if endpoint == Endpoint::Generate { &Value::Null } else { &recorded }) {
        Ok(t) => t,
        Err((status, kind, msg)) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
            let body = json!({"error": {"message": msg, "type": kind, "param": "model", "code": status.as_u16()}});
            return (status, Json(body)).into_response();
        }
    };
    let rank = match e.ranks.pick(&recorded) {
        Ok(r) => r,
        Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
    };
    let mut target = target;
    if e.args.role == Role::Regular {
        target.seed = e.ranks.seed(target.seed, rank);
    }
    let vllm = e.args.engine == EngineKind::Vllm;
    let mut transfer = Transfer::None;
    if vllm {
        match vllm::transfer_of(&recorded) {
            Ok(t) => transfer = t,
            Err(msg) => {
                e.counters.kv_transfers_failed.fetch_add(1, Relaxed);
                return error(StatusCode::BAD_REQUEST, &msg);
            }
        }
    }
    if e.accept().is_err() {
        return error(StatusCode::INTERNAL_SERVER_ERROR, &format!("injected failure on {}", e.addr));
    }
    if let (true, Some(host_port)) = (e.args.llm_d_sidecar, &prefiller) {
        match sidecar(&e, endpoint, host_port, &recorded, request_id.as_deref()).await {
            Ok(remote) => transfer = Transfer::Consume(remote),
            Err(response) => return response,
        }
    }
    let id = if vllm {
        let prefix = if endpoint == Endpoint::ChatCompletions { "chatcmpl" } else { "cmpl" };
        format!("{prefix}-{}", request_id.unwrap_or_else(|| format!("{:032x}", fastrand::u128(..))))
    } else {
        format!("cmpl-{:024x}", fastrand::u128(..))
    };
    let ctx = Ctx { target, transfer, id, vllm, rank };
    let abortable = e.abortable(job.given_rids());
    tokio::select! {
        r = serve_job(e, endpoint, job, ctx) => r,
        () = abortable.aborted() => error(StatusCode::BAD_REQUEST, "aborted by /abort_request"),
    }
}

/// llm-d's decode sidecar (`--llm-d-sidecar`): sends the prefill request to the worker that
/// `x-prefiller-host-port` names and returns where the KV it computed is.
async fn sidecar(
    e: &Engine,
    endpoint: Endpoint,
    host_port: &str,
    body: &Value,
    request_id: Option<&str>,
) -> Result<Remote, Response> {
    let (host, port) = vllm::parse_host_port(host_port).map_err(|m| error(StatusCode::BAD_REQUEST, &m))?;
    e.counters.sidecar_prefills.fetch_add(1, Relaxed);
    let timeout = std::time::Duration::from_millis(e.args.sidecar_prefill_timeout_ms);
    let prefill_body = vllm::prefill_body(body);
    let answered =
        vllm::sidecar_prefill((&host, port), endpoint_path(endpoint), &prefill_body, request_id, timeout).await;
    let remote = answered.and_then(|params| match vllm::transfer_of(&json!({"kv_transfer_params": params})) {
        Ok(Transfer::Consume(r)) => Ok(r),
        Ok(_) => Err(format!("prefill at {host_port} answered kv_transfer_params without do_remote_prefill")),
        Err(m) => Err(format!("prefill at {host_port} answered unusable kv_transfer_params: {m}")),
    });
    remote.map_err(|m| {
        e.counters.kv_transfers_failed.fetch_add(1, Relaxed);
        error(StatusCode::BAD_GATEWAY, &m)
    })
}

/// `POST /abort_request {"rid": ...}` (or `{"abort_all": true}`), as SGLang: a rid it knows
/// stops the requests whose rid starts with it (their computation and, for a PD prefill, the
/// KV it would publish); anything else stops nothing, and is still a 200. Streams already
/// answering are not stopped.
async fn abort_request(State(e): Shared, body: Bytes) -> Response {
    let recorded = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    e.counters.abort_requests.fetch_add(1, Relaxed);
    e.record(json!({"path": "/abort_request", "x_request_id": null, "body": recorded}));
    let aborted = match (recorded["abort_all"] == true, recorded["rid"].as_str()) {
        (true, _) => e.abort(None),
        (false, Some(rid)) => e.abort(Some(rid)),
        (false, None) => false,
    };
    Json(json!({"rid": recorded["rid"], "aborted": aborted})).into_response()
}

async fn serve_job(e: Arc<Engine>, endpoint: Endpoint, job: Job, ctx: Ctx) -> Response {
    let on_rank = crate::dp::OnRank::new(&e.ranks, ctx.rank);
    let plans = match plan(&e, &job, &ctx).await {
        Ok(p) => p,
        Err((status, msg)) => return error(status, &msg),
    };
    if job.stream {
        return Sse::new(stream(e, endpoint, job, plans, ctx, on_rank)).into_response();
    }
    let seed = ctx.target.seed;
    let runs = job
        .items
        .iter()
        .zip(&plans)
        .zip(&job.logprobs)
        .map(|((item, &plan), &lp)| run_item(&e, item, plan, lp, job.max_tokens, seed));
    let done: Option<Vec<Done>> = join_all(runs).await.into_iter().collect();
    let Some(done) = done else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    };
    on_rank.tokens(done.iter().map(|d| d.prompt_tokens).sum(), done.iter().map(|d| d.cached_tokens).sum());
    // A vLLM prefill keeps the KV for the decode, and says where it is.
    let handover = match (plans.first(), job.items.first()) {
        (Some(Plan::Handover), Some(item)) => {
            let kv = Kv { prompt_hash: prompt_hash(item, seed), tokens: item.tokens };
            e.counters.kv_transfers_published.fetch_add(1, Relaxed);
            Some(e.transfers.publish(kv, &ctx.engine_request_id(endpoint)))
        }
        _ => None,
    };
    let out = Out { ctx: &ctx, kv_transfer_params: handover };
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
        Endpoint::Completions => openai_body(&out, "text_completion", &done, |d| json!({"text": d.text})),
        Endpoint::ChatCompletions => openai_body(
            &out,
            "chat.completion",
            &done,
            |d| json!({"message": {"role": "assistant", "content": d.text}}),
        ),
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

/// What an OpenAI answer says besides its choices.
struct Out<'a> {
    ctx: &'a Ctx,
    /// vLLM prefill: where the decode pulls the KV.
    kv_transfer_params: Option<Value>,
}

fn openai_body(out: &Out, object: &str, done: &[Done], choice: impl Fn(&Done) -> Value) -> Value {
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut c = choice(d);
            c["index"] = json!(i);
            c["finish_reason"] = json!("length");
            c["logprobs"] = Value::Null;
            if out.ctx.vllm {
                c["stop_reason"] = Value::Null;
            }
            c
        })
        .collect();
    let mut body = json!({
        "id": out.ctx.id,
        "object": object,
        "created": created(),
        "model": out.ctx.target.name,
        "choices": choices,
        "usage": usage(done),
    });
    if out.ctx.vllm {
        body["kv_transfer_params"] = out.kv_transfer_params.clone().unwrap_or(Value::Null);
    }
    body
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
    ctx: Ctx,
    on_rank: crate::dp::OnRank,
) -> impl Stream<Item = Result<Event, Infallible>> {
    async_stream::stream! {
        let id = ctx.id.clone();
        let seed = ctx.target.seed;
        let object = if endpoint == Endpoint::ChatCompletions { "chat.completion.chunk" } else { "text_completion" };
        let mut all = Vec::new();
        for (index, item) in job.items.iter().enumerate() {
            let rid = job.rid(index);
            let plan = plans.get(index).copied().unwrap_or(Plan::Local);
            let lp = job.logprobs.get(index).copied().unwrap_or(false).then(|| input_logprobs(item, plan));
            let Some(run) = admit(&e, item, plan, seed).await else { break };
            if endpoint == Endpoint::ChatCompletions {
                yield event(&chunk(&ctx, object, index, json!({"delta": {"role": "assistant", "content": ""}}), None));
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
                    Endpoint::Completions => chunk(&ctx, object, index, json!({"text": piece}), finish),
                    Endpoint::ChatCompletions => chunk(&ctx, object, index, json!({"delta": {"content": piece}}), finish),
                };
                yield event(&v);
            }
            if matches!(plan, Plan::Local) {
                e.finished(&item.bytes, &text, seed);
            }
            all.push(Done { text, prompt_tokens: item.tokens, cached_tokens: run.cached_tokens, completion_tokens: n, latency: run.started.elapsed().as_secs_f64(), input_logprobs: None });
        }
        on_rank.tokens(all.iter().map(|d| d.prompt_tokens).sum(), all.iter().map(|d| d.cached_tokens).sum());
        if job.include_usage && endpoint != Endpoint::Generate {
            yield event(&json!({"id": id, "object": object, "created": created(), "model": ctx.target.name, "choices": [], "usage": usage(&all)}));
        }
        yield Ok(Event::default().data("[DONE]"));
    }
}

fn chunk(ctx: &Ctx, object: &str, index: usize, mut choice: Value, finish: Option<&str>) -> Value {
    choice["index"] = json!(index);
    choice["finish_reason"] = json!(finish);
    if ctx.vllm {
        choice["logprobs"] = Value::Null;
        choice["stop_reason"] = Value::Null;
    }
    json!({"id": ctx.id, "object": object, "created": created(), "model": ctx.target.name, "choices": [choice]})
}
