//! The simulator over HTTP: real sims on free loopback ports inside the test process,
//! answering at `--time-scale 0`, talked to with the simulator's own client.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use serde_json::{json, Value};

use crate::cli::Args;
use crate::client;
use crate::engine::Engine;

const WAIT: Duration = Duration::from_secs(20);

struct Sim {
    port: u16,
}

impl Sim {
    async fn start(args: &[&str]) -> Sim {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let port_text = port.to_string();
        let mut all = vec!["kvmesh-sim", "--host", "127.0.0.1", "--port", &port_text, "--time-scale", "0"];
        all.extend(args);
        let args = Args::parse_from(all);
        args.validate().unwrap();
        let router = crate::api::router(Arc::new(Engine::new(args)));
        tokio::spawn(async move { axum::serve(listener, router).await });
        Sim { port }
    }

    fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> client::Answer {
        client::request(method, "127.0.0.1", self.port, path, headers, body, WAIT).await.unwrap()
    }

    async fn get(&self, path: &str) -> client::Answer {
        self.call("GET", path, &[], b"").await
    }

    async fn json(&self, path: &str) -> Value {
        serde_json::from_slice(&self.get(path).await.body).unwrap()
    }

    /// POSTs `body`: the status, and the JSON answer (or the text as a JSON string).
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
        let a = self.call("POST", path, headers, body.to_string().as_bytes()).await;
        let v = serde_json::from_slice(&a.body).unwrap_or_else(|_| Value::String(a.text()));
        (a.status, v)
    }

    async fn stats(&self) -> Value {
        self.json("/sim/stats").await
    }

    /// The last request this sim recorded.
    async fn last_request(&self) -> Value {
        self.json("/sim/requests").await.as_array().unwrap().last().cloned().unwrap()
    }
}

/// The `data:` payloads of an SSE answer.
fn sse(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
}

fn chat(content: &str) -> Value {
    json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 4})
}

/// What the gateway (or llm-d's sidecar) sends a vLLM prefill.
fn prefill_leg(body: &Value) -> Value {
    crate::vllm::prefill_body(body)
}

fn with_params(body: &Value, params: &Value) -> Value {
    let mut b = body.clone();
    b["kv_transfer_params"] = params.clone();
    b
}

#[tokio::test]
async fn vllm_serves_the_openai_endpoints_only_with_vllms_names() {
    let sim = Sim::start(&["--engine", "vllm"]).await;
    for path in ["/generate", "/get_load", "/get_model_info", "/flush_cache"] {
        let method = if path == "/get_load" || path == "/get_model_info" { "GET" } else { "POST" };
        let a = sim.call(method, path, &[], br#"{"text":"x"}"#).await;
        assert_eq!((a.status, a.text()), (404, r#"{"detail":"Not Found"}"#.to_string()), "{path}");
    }
    assert_eq!(sim.get("/health").await.status, 200);
    let models = sim.json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "kvmesh-sim");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    let prompt = json!({"prompt": "The same long prompt. ".repeat(20), "max_tokens": 3});
    let (status, first) = sim.post("/v1/completions", &[("x-request-id", "abc")], &prompt).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["id"], "cmpl-abc");
    assert_eq!(first["kv_transfer_params"], Value::Null);
    assert_eq!(first["choices"][0]["stop_reason"], Value::Null);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = sim.post("/v1/completions", &[], &prompt).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 96 && cached <= second["usage"]["prompt_tokens"].as_u64().unwrap(), "{second}");
    let metrics = sim.get("/metrics").await.text();
    for name in ["vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{"] {
        assert!(metrics.contains(name), "{name} missing from {metrics}");
    }
    assert!(!metrics.contains("sglang:"), "{metrics}");
    let stats = sim.stats().await;
    assert_eq!((stats["engine"].as_str(), stats["local_prefills"].as_u64()), (Some("vllm"), Some(2)));
}

#[tokio::test]
async fn vllm_streams_end_with_done_and_carry_usage_only_when_asked() {
    let sim = Sim::start(&["--engine", "vllm"]).await;
    let mut body = chat("stream me");
    body["stream"] = json!(true);
    let plain = sim.call("POST", "/v1/chat/completions", &[("x-request-id", "s1")], body.to_string().as_bytes()).await;
    assert_eq!(plain.status, 200);
    let events = sse(&plain.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks.len(), 5, "a role chunk and 4 tokens: {events:?}");
    assert!(chunks.iter().all(|c| c["id"] == "chatcmpl-s1" && c["object"] == "chat.completion.chunk"));
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    body["stream_options"] = json!({"include_usage": true});
    let with_usage = sim
        .call(
            "POST",
            "/v1/completions",
            &[],
            json!({"prompt": "p", "stream": true, "max_tokens": 2,
        "stream_options": {"include_usage": true}})
            .to_string()
            .as_bytes(),
        )
        .await;
    let events = sse(&with_usage.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 2);
    assert!(last["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(), "{last}");
}

#[tokio::test]
async fn sglang_stays_as_it_was_by_default() {
    let sim = Sim::start(&[]).await;
    let models = sim.json("/v1/models").await;
    let card = models["data"][0].as_object().unwrap();
    let keys: Vec<&str> = card.keys().map(String::as_str).collect();
    assert_eq!(keys, vec!["created", "id", "object", "owned_by"]);
    assert_eq!((card["id"].as_str(), card["owned_by"].as_str()), (Some("kvmesh-sim"), Some("sglang")));
    assert_eq!(sim.post("/generate", &[], &json!({"text": "x"})).await.0, 200);
    // SGLang ignores fields it does not know, kv_transfer_params and unknown models included.
    let (status, v) =
        sim.post("/v1/completions", &[], &json!({"prompt": "x", "model": "other", "kv_transfer_params": 3})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "kvmesh-sim");
    assert!(v.get("kv_transfer_params").is_none() && v["choices"][0].get("stop_reason").is_none());
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    let stats = sim.stats().await;
    assert!(stats.get("kv_transfers_ok").is_none() && stats.get("engine").is_none(), "{stats}");
    assert!(sim.get("/metrics").await.text().contains("sglang:num_running_reqs{model_name=\"kvmesh-sim\"}"));
}

#[tokio::test]
async fn requests_record_their_routing_headers() {
    let sim = Sim::start(&[]).await;
    let body = json!({"text": "hi"});
    let headers = [
        ("x-request-id", "r-1"),
        ("x-prefiller-host-port", "10.0.0.1:8000"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("tracestate", "k=v"),
    ];
    sim.post("/generate", &headers, &body).await;
    let seen = sim.last_request().await;
    assert_eq!(
        seen,
        json!({"path": "/generate", "x_request_id": "r-1", "x_prefiller_host_port": "10.0.0.1:8000",
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v",
               "body": body})
    );
    sim.post("/generate", &[], &body).await;
    let seen = sim.last_request().await;
    let absent = ["x_request_id", "x_prefiller_host_port", "traceparent", "tracestate"].map(|k| seen[k].clone());
    assert_eq!(absent, [Value::Null, Value::Null, Value::Null, Value::Null]);
}

#[tokio::test]
async fn a_vllm_decode_pulls_the_kv_its_prefill_computed_for_this_prompt_and_nothing_else() {
    let prefill = Sim::start(&["--engine", "vllm", "--role", "prefill", "--engine-id", "p-1"]).await;
    let decode = Sim::start(&["--engine", "vllm", "--role", "decode"]).await;
    let client_body = chat(&"A question worth a few pages. ".repeat(10));
    let (status, answer) =
        prefill.post("/v1/chat/completions", &[("x-request-id", "rq")], &prefill_leg(&client_body)).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();
    let tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert_eq!(blocks, tokens.div_ceil(16));
    assert_eq!(
        (params["do_remote_prefill"].clone(), params["do_remote_decode"].clone(), params["remote_engine_id"].clone()),
        (json!(true), json!(false), json!("p-1"))
    );
    assert_eq!(
        (params["remote_host"].as_str(), params["remote_port"].as_u64()),
        (Some("127.0.0.1"), Some(prefill.port as u64))
    );
    assert_eq!(params["remote_request_id"], "chatcmpl-rq");
    assert_eq!(prefill.stats().await["kv_transfers_published"], 1);
    assert_eq!(prefill.stats().await["kv_transfers_held"], 1);

    // The decode with the prefill's parameters: pulled, counted, and the KV stays cached.
    let mut decode_body = with_params(&client_body, &params);
    decode_body["stream"] = json!(true);
    let a = decode.call("POST", "/v1/chat/completions", &[], decode_body.to_string().as_bytes()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(sse(&a.text()).last().map(String::as_str), Some("[DONE]"));
    let stats = decode.stats().await;
    assert_eq!((stats["kv_transfers_ok"].as_u64(), stats["transferred_tokens"].as_u64()), (Some(1), Some(tokens)));
    assert_eq!(prefill.stats().await["kv_transfers_held"], 0, "a pulled transfer is freed");
    let (_, local) = decode.post("/v1/chat/completions", &[], &client_body).await;
    assert!(local["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{local}");
    assert_eq!(decode.stats().await["local_prefills"], 1);

    // The same parameters again, another prompt's, or made-up ones: errors, counted.
    let (status, err) = decode.post("/v1/chat/completions", &[], &decode_body).await;
    assert_eq!(status, 500);
    assert!(err["error"]["message"].as_str().unwrap().contains("already pulled"), "{err}");
    let (_, other) = prefill.post("/v1/chat/completions", &[], &prefill_leg(&chat("another prompt"))).await;
    let (status, err) =
        decode.post("/v1/chat/completions", &[], &with_params(&client_body, &other["kv_transfer_params"])).await;
    assert_eq!(status, 500);
    assert!(err["error"]["message"].as_str().unwrap().contains("another prompt"), "{err}");
    let mut made_up = other["kv_transfer_params"].clone();
    made_up["remote_engine_id"] = json!("someone-else");
    let (status, err) = decode.post("/v1/chat/completions", &[], &with_params(&client_body, &made_up)).await;
    assert_eq!(status, 500);
    assert!(err["error"]["message"].as_str().unwrap().contains("not this worker"), "{err}");
    let mut elsewhere = params.clone();
    elsewhere["remote_port"] = json!(decode.port);
    assert_eq!(decode.post("/v1/chat/completions", &[], &with_params(&client_body, &elsewhere)).await.0, 500);
    let (status, err) = decode.post("/v1/chat/completions", &[], &with_params(&client_body, &json!("params"))).await;
    assert_eq!(status, 400);
    assert!(err["error"]["message"].as_str().unwrap().contains("must be an object"), "{err}");
    assert_eq!(decode.stats().await["kv_transfers_failed"], 5);
    assert_eq!(decode.stats().await["kv_transfers_ok"], 1);

    // The wrong side of the transfer, a streamed handover, a batch: refused.
    let (status, err) = prefill.post("/v1/chat/completions", &[], &decode_body).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(decode.post("/v1/chat/completions", &[], &prefill_leg(&client_body)).await.0, 400);
    let mut streamed = prefill_leg(&client_body);
    streamed["stream"] = json!(true);
    assert_eq!(prefill.post("/v1/chat/completions", &[], &streamed).await.0, 400);
    let batch = prefill_leg(&json!({"prompt": ["a", "b"]}));
    assert_eq!(prefill.post("/v1/completions", &[], &batch).await.0, 400);
    // Without do_remote_decode a prefill is a plain vLLM worker.
    let (status, plain) = prefill.post("/v1/completions", &[], &json!({"prompt": "p", "max_tokens": 3})).await;
    assert_eq!((status, plain["usage"]["completion_tokens"].as_u64()), (200, Some(3)));
    assert_eq!(plain["kv_transfer_params"], Value::Null);
}

#[tokio::test]
async fn the_llm_d_sidecar_runs_the_prefill_named_by_its_header_first() {
    let prefill = Sim::start(&["--engine", "vllm", "--role", "prefill"]).await;
    let decode = Sim::start(&["--engine", "vllm", "--role", "decode", "--llm-d-sidecar"]).await;
    let mut body = chat(&"Split me between two workers. ".repeat(8));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["min_tokens"] = json!(2);
    let header = prefill.host_port();
    let headers = [("x-prefiller-host-port", header.as_str()), ("x-request-id", "side-1")];
    let a = decode.call("POST", "/v1/chat/completions", &headers, body.to_string().as_bytes()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let events = sse(&a.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);

    let seen = prefill.last_request().await;
    assert_eq!((seen["path"].as_str(), seen["x_request_id"].as_str()), (Some("/v1/chat/completions"), Some("side-1")));
    let sent = &seen["body"];
    assert_eq!(sent["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!((sent["stream"].clone(), sent["max_tokens"].clone()), (json!(false), json!(1)));
    assert!(sent.get("stream_options").is_none() && sent.get("min_tokens").is_none(), "{sent}");
    assert_eq!(sent["messages"], body["messages"]);
    assert_eq!(decode.last_request().await["x_prefiller_host_port"], header);
    let stats = decode.stats().await;
    assert_eq!(
        (stats["sidecar_prefills"].as_u64(), stats["kv_transfers_ok"].as_u64(), stats["local_prefills"].as_u64()),
        (Some(1), Some(1), Some(0))
    );
    assert_eq!(prefill.stats().await["kv_transfers_published"], 1);

    // Without the header the decode runs alone; a malformed one is refused before any call; a
    // prefill that is not there is a 502 naming it.
    assert_eq!(decode.post("/v1/chat/completions", &[], &chat("alone")).await.0, 200);
    assert_eq!(decode.stats().await["local_prefills"], 1);
    for bad in ["not a host", "h:0", &format!("{}:80", "h".repeat(300))] {
        let (status, err) = decode.post("/v1/chat/completions", &[("x-prefiller-host-port", bad)], &chat("x")).await;
        assert_eq!(status, 400, "{bad}: {err}");
    }
    assert_eq!(decode.stats().await["sidecar_prefills"], 1);
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone_at = gone.local_addr().unwrap().to_string();
    drop(gone);
    let (status, err) = decode.post("/v1/chat/completions", &[("x-prefiller-host-port", &gone_at)], &chat("x")).await;
    assert_eq!(status, 502, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains(&gone_at), "{err}");
    assert_eq!(decode.stats().await["kv_transfers_failed"], 1);
}

#[tokio::test]
async fn served_names_and_adapters_pick_the_model_and_unknown_ones_are_404() {
    let sim = Sim::start(&["--engine", "vllm", "--served-model-name", "base", "alias", "--lora", "sql"]).await;
    let ids: Vec<Value> =
        sim.json("/v1/models").await["data"].as_array().unwrap().iter().map(|c| c["id"].clone()).collect();
    assert_eq!(ids, vec![json!("base"), json!("alias"), json!("sql")]);
    let (status, err) = sim.post("/v1/completions", &[], &json!({"model": "kvmesh-sim", "prompt": "p"})).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["message"], "The model `kvmesh-sim` does not exist.");
    let prompt = "One prompt for two models. ".repeat(10);
    let (_, a) = sim.post("/v1/completions", &[], &json!({"model": "alias", "prompt": prompt})).await;
    assert_eq!(a["model"], "base");
    let (_, b) = sim.post("/v1/completions", &[], &json!({"model": "sql", "prompt": prompt})).await;
    assert_eq!(b["model"], "sql");
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "the adapter does not hit the base's cache");
    let (_, c) = sim.post("/v1/completions", &[], &json!({"model": "base", "prompt": prompt})).await;
    assert!(c["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{c}");
}

#[test]
fn the_sidecar_flag_needs_a_vllm_decode() {
    let parse =
        |extra: &[&str]| Args::parse_from(std::iter::once("kvmesh-sim").chain(extra.iter().copied())).validate();
    assert!(parse(&["--llm-d-sidecar"]).is_err());
    assert!(parse(&["--llm-d-sidecar", "--engine", "vllm"]).is_err());
    assert!(parse(&["--llm-d-sidecar", "--engine", "vllm", "--role", "decode"]).is_ok());
    assert!(parse(&["--lora", "kvmesh-sim"]).unwrap_err().contains("twice"));
    assert!(parse(&["--served-model-name", ""]).is_err());
}

/// `--api-key`, as each engine checks it: SGLang everything but health and metrics, vLLM its
/// OpenAI API; the simulator's own controls never.
#[tokio::test]
async fn an_api_key_guards_what_each_engine_guards() {
    let bearer = [("authorization", "Bearer k1")];
    let sglang = Sim::start(&["--api-key", "k1"]).await;
    for path in ["/health", "/health_generate", "/metrics", "/sim/stats"] {
        assert_eq!(sglang.get(path).await.status, 200, "{path}");
    }
    for path in ["/get_load", "/get_model_info", "/v1/models"] {
        assert_eq!(sglang.get(path).await.status, 401, "{path}");
        assert_eq!(sglang.call("GET", path, &bearer, b"").await.status, 200, "{path}");
    }
    let wrong = [("authorization", "Bearer k2")];
    assert_eq!(sglang.call("GET", "/get_load", &wrong, b"").await.status, 401);
    let vllm = Sim::start(&["--engine", "vllm", "--api-key", "k1"]).await;
    assert_eq!(vllm.get("/v1/models").await.status, 401);
    assert_eq!(vllm.call("GET", "/v1/models", &bearer, b"").await.status, 200);
    assert_eq!(vllm.get("/health").await.status, 200);
    assert_eq!(vllm.get("/metrics").await.status, 200);
}
