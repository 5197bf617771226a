//! Many models behind one gateway, end to end: real kvmesh-cp learning each worker's names
//! from its `/v1/models`, real Envoy with the real filter (the `.wasm`; the native build with
//! `KVMESH_TEST_NATIVE=1`), simulated vLLM workers that refuse a model they do not serve (so a
//! request sent to the wrong pool is a visible 404 from the worker, not a silent success).

use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, gateway, gateway_with, pd_options, sync};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{free_port, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

/// `llama` on two workers (the second with adapter `sql` loaded), `qwen` on a third.
struct Stack {
    /// `llama`, `llama` with `sql`, `qwen`.
    sims: Vec<Sim>,
    cp: ControlPlane,
    envoy: Envoy,
}

fn vllm(extra: &[&str]) -> Sim {
    Sim::start(&[&["--engine", "vllm", "--time-scale", "0"][..], extra].concat()).unwrap()
}

fn stack() -> Stack {
    let sims = vec![
        vllm(&["--served-model-name", "llama"]),
        vllm(&["--served-model-name", "llama", "--lora", "sql"]),
        vllm(&["--served-model-name", "qwen"]),
    ];
    let cp = control_plane(&sims, &["--health-check-interval-secs", "1", "--cache-threshold", "0.1"]);
    for (sim, n) in sims.iter().zip([1, 2, 1]) {
        wait_until("kvmesh-cp to learn the served models", Duration::from_secs(20), || {
            cp.worker(&sim.url())["models"].as_array().is_some_and(|m| m.len() == n)
        })
        .unwrap();
    }
    let envoy = gateway(&cp);
    sync(&cp, &envoy);
    Stack { sims, cp, envoy }
}

fn ask(envoy: &Envoy, path: &str, model: &str, text: &str) -> Response {
    let body = if path == "/v1/chat/completions" {
        json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    } else {
        json!({"model": model, "prompt": text, "max_tokens": 2})
    };
    http::post(&envoy.url(path), body.to_string().as_bytes(), &[]).unwrap()
}

fn requests_seen(sims: &[&Sim]) -> u64 {
    sims.iter().map(|s| s.stats().unwrap()["requests"].as_u64().unwrap_or(0)).sum()
}

#[test]
fn each_request_reaches_a_worker_serving_its_model_and_unknown_models_reach_none() {
    let s = stack();
    let (l0, l1, q) = (s.sims[0].addr(), s.sims[1].addr(), s.sims[2].addr());
    let mut mismatches = Vec::new();
    for i in 0..36 {
        let path = ["/v1/completions", "/v1/chat/completions"][i % 2];
        let model = ["llama", "qwen", "sql"][i % 3];
        let r = ask(&s.envoy, path, model, &format!("request {i} for {model}: {}", "context ".repeat(40)));
        let worker = r.header("x-kvmesh-worker").unwrap_or("none").to_string();
        let answered = r.json().ok().and_then(|v| v["model"].as_str().map(str::to_string));
        let right = match model {
            "llama" => worker == l0 || worker == l1,
            "qwen" => worker == q,
            _ => worker == l1,
        };
        if r.status != 200 || !right || answered.as_deref() != Some(model) {
            mismatches.push(format!("{model} {path}: {} from {worker} ({answered:?})", r.status));
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:?}");
    // Envoy's per-model counters, labelled by model (12 requests each).
    let counted = |model: &str| {
        let text = http::get(&s.envoy.admin_url("/stats/prometheus")).map(|r| r.text()).unwrap_or_default();
        text.lines()
            .filter(|l| l.contains("kvmesh_model_requests_total{") && l.contains(&format!("model=\"{model}\"")))
            .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    wait_until("Envoy to count the requests per model", Duration::from_secs(10), || {
        ["llama", "qwen", "sql"].iter().all(|m| counted(m) == 12)
    })
    .unwrap_or_else(|e| panic!("{e}: llama {} qwen {} sql {}", counted("llama"), counted("qwen"), counted("sql")));

    // An unknown model is the gateway's 404 and reaches no worker.
    let sims: Vec<&Sim> = s.sims.iter().collect();
    let before = requests_seen(&sims);
    let r = ask(&s.envoy, "/v1/completions", "gpt-4", "hello");
    assert_eq!(r.status, 404, "{}", r.text());
    let err = r.json().unwrap();
    assert_eq!(err["error"]["code"], "model_not_found");
    assert!(err["error"]["message"].as_str().unwrap().contains("gpt-4"));
    let r =
        http::post(&s.envoy.url("/v1/completions"), json!({"prompt": "no model"}).to_string().as_bytes(), &[]).unwrap();
    assert_eq!(r.status, 400, "several models and none named: {}", r.text());
    assert_eq!(requests_seen(&sims), before, "refused requests reached a worker");

    // The gateway's own list: the union, the adapter with its parent.
    let list: Value = http::get(&s.envoy.url("/v1/models")).unwrap().json().unwrap();
    let mut cards: Vec<(String, Value)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap().to_string(), c["parent"].clone()))
        .collect();
    cards.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        cards,
        vec![("llama".into(), Value::Null), ("qwen".into(), Value::Null), ("sql".into(), json!("llama"))]
    );
    assert_eq!(requests_seen(&sims), before, "/v1/models is answered by the gateway");
    // kvmesh-cp's /metrics names each worker's models, adapters with their parent.
    let metrics = s.cp.metrics();
    let adapter = format!(r#"kvmesh_worker_model{{worker="{}",model="sql",parent="llama"}} 1"#, s.sims[1].url());
    assert!(metrics.contains(&adapter), "{adapter} not in {metrics}");
    let card: Value = http::get(&s.envoy.url("/v1/models/sql")).unwrap().json().unwrap();
    assert_eq!(card["parent"], "llama");
    assert_eq!(http::get(&s.envoy.url("/v1/models/gpt-4")).unwrap().status, 404);
}

#[test]
fn the_index_keeps_each_models_prompts_apart_and_adapters_loaded_later_are_routed() {
    let s = stack();
    let prompt = format!("a system prompt both the base model and its adapter get: {}", "rules ".repeat(80));
    let held = |model: &str| -> u64 {
        let m = s.cp.match_model(prompt.as_bytes(), Some(model)).unwrap();
        m.as_array().unwrap().iter().map(|e| e["blocks"].as_u64().unwrap()).max().unwrap_or(0)
    };
    assert_eq!(ask(&s.envoy, "/v1/completions", "llama", &prompt).status, 200);
    wait_until("the llama prompt in the global index", Duration::from_secs(10), || held("llama") > 0).unwrap();
    assert_eq!(held("sql"), 0, "the adapter's pool never saw the prompt");
    // The adapter's worker computes the prompt afresh (its cache is keyed by adapter too).
    let r = ask(&s.envoy, "/v1/completions", "sql", &prompt);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // An adapter loaded on qwen's worker at run time: unknown until the next poll, then routed.
    assert_eq!(ask(&s.envoy, "/v1/completions", "late", "x").status, 404);
    let load = json!({"lora_name": "late", "lora_path": "/adapters/late"});
    let r = http::post(&format!("{}/v1/load_lora_adapter", s.sims[2].url()), load.to_string().as_bytes(), &[]).unwrap();
    assert_eq!(r.status, 200);
    wait_until("kvmesh-cp to see the loaded adapter", Duration::from_secs(10), || {
        s.cp.worker(&s.sims[2].url())["models"].as_array().is_some_and(|m| m.len() == 2)
    })
    .unwrap();
    sync(&s.cp, &s.envoy);
    for i in 0..4 {
        let r = ask(&s.envoy, "/v1/chat/completions", "late", &format!("late {i}"));
        assert_eq!((r.status, r.header("x-kvmesh-worker")), (200, Some(s.sims[2].addr().as_str())), "{}", r.text());
    }

    // A worker added through the API with a model name of its own (SMG's `model_id`): an
    // SGLang worker answering to any name, routed for that name only.
    let sglang = Sim::start(&["--time-scale", "0"]).unwrap();
    let add = format!("/add_worker?url={}&model_id=mistral", sglang.url());
    assert_eq!(s.cp.post(&add).unwrap().status, 200);
    wait_until("kvmesh-cp to list mistral", Duration::from_secs(10), || {
        s.cp.worker(&sglang.url())["models"].as_array().is_some_and(|m| m.first().is_some_and(|m| m["id"] == "mistral"))
    })
    .unwrap();
    sync(&s.cp, &s.envoy);
    let r = ask(&s.envoy, "/v1/completions", "mistral", "bonjour");
    assert_eq!((r.status, r.header("x-kvmesh-worker")), (200, Some(sglang.addr().as_str())), "{}", r.text());
    for i in 0..6 {
        let r = ask(&s.envoy, "/v1/completions", "llama", &format!("still llama {i}"));
        assert_ne!(r.header("x-kvmesh-worker"), Some(sglang.addr().as_str()), "llama went to mistral's worker");
    }
}

/// vLLM PD behind one gateway for two models: a prefill and a decode worker each. Every
/// request's two legs go to workers serving its model (each sim refuses another model's
/// requests, and a decode pulls the KV from the prefill its parameters name).
#[test]
fn both_pd_legs_come_from_the_requests_model_pool() {
    let pd = |role: &str, model: &str| vllm(&["--role", role, "--served-model-name", model]);
    let sims = [pd("prefill", "llama"), pd("prefill", "qwen"), pd("decode", "llama"), pd("decode", "qwen")];
    let (p, d) = (&sims[..2], &sims[2..]);
    let cp = ControlPlane::start(&[
        "--pd-disaggregation",
        "--pd-protocol",
        "vllm",
        "--health-check-interval-secs",
        "1",
        "--prefill",
        &p[0].url(),
        "none",
        "--prefill",
        &p[1].url(),
        "none",
        "--decode",
        &d[0].url(),
        "--decode",
        &d[1].url(),
    ])
    .unwrap();
    for sim in &sims {
        wait_until("kvmesh-cp to learn the served models", Duration::from_secs(20), || {
            cp.worker(&sim.url())["models"].as_array().is_some_and(|m| m.len() == 1)
        })
        .unwrap();
    }
    let envoy = gateway_with(&cp, pd_options(json!({"worker_urls": []}), false));
    sync(&cp, &envoy);
    for i in 0..12 {
        let (model, k) = if i % 2 == 0 { ("llama", 0) } else { ("qwen", 1) };
        let path = ["/v1/completions", "/v1/chat/completions"][i / 2 % 2];
        let r = ask(&envoy, path, model, &format!("pd request {i}: {}", "long context ".repeat(30)));
        assert_eq!(r.status, 200, "{model} {path}: {}", r.text());
        assert_eq!(r.header("x-kvmesh-prefill"), Some(p[k].addr().as_str()), "{model}'s prefill");
        assert_eq!(r.header("x-kvmesh-worker"), Some(d[k].addr().as_str()), "{model}'s decode");
        assert_eq!(r.json().unwrap()["model"], model);
    }
    let transfers: u64 = d.iter().map(|s| s.stats().unwrap()["kv_transfers_ok"].as_u64().unwrap()).sum();
    assert_eq!(transfers, 12, "every decode pulled the KV its model's prefill computed");
    assert_eq!(ask(&envoy, "/v1/completions", "mistral", "x").status, 404);
}

/// `--lora-adapter`: kvmesh-cp loads an adapter no worker serves on the least-loaded worker of
/// its base model, requests for it go there, and when it is unloaded behind kvmesh-cp's back
/// it is loaded again.
#[test]
fn a_configured_adapter_is_loaded_where_its_base_runs_and_again_when_lost() {
    let sims = [vllm(&["--served-model-name", "llama"]), vllm(&["--served-model-name", "llama"])];
    let cp = control_plane(&sims, &["--health-check-interval-secs", "1", "--lora-adapter", "sql@llama=/adapters/sql"]);
    let holder = || {
        sims.iter()
            .find(|s| cp.worker(&s.url())["models"].as_array().is_some_and(|m| m.iter().any(|c| c["id"] == "sql")))
    };
    wait_until("kvmesh-cp to load the adapter", Duration::from_secs(20), || holder().is_some()).unwrap();
    let first = holder().unwrap();
    let envoy = gateway(&cp);
    sync(&cp, &envoy);
    let r = ask(&envoy, "/v1/completions", "sql", "select the rows");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvmesh-worker"), Some(first.addr().as_str()));
    assert_eq!(r.json().unwrap()["model"], "sql");
    // Unloaded on the worker: kvmesh-cp sees it gone at the next health check and loads it again.
    let unload = json!({"lora_name": "sql"}).to_string();
    let r = http::post(&format!("{}/v1/unload_lora_adapter", first.url()), unload.as_bytes(), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    wait_until("kvmesh-cp to load it again", Duration::from_secs(20), || {
        cp.metrics().lines().any(|l| l.starts_with("kvmesh_adapter_loads_total 2"))
    })
    .unwrap();
    assert!(holder().is_some());
    assert!(cp.metrics().lines().any(|l| l.starts_with("kvmesh_adapter_load_failures_total 0")));
}

/// vLLM serving one model under two names (`--served-model-name llama chat`: one engine, one
/// KV cache): a prompt cached under one name is a hit under the other, so it goes back to the
/// worker that holds it, and the global index answers for either name.
#[test]
fn names_one_engine_serves_share_its_cache() {
    let sims: Vec<Sim> = (0..3).map(|_| vllm(&["--served-model-name", "llama", "chat"])).collect();
    let cp = control_plane(&sims, &["--health-check-interval-secs", "1", "--cache-threshold", "0.1"]);
    for sim in &sims {
        wait_until("kvmesh-cp to learn the served names", Duration::from_secs(20), || {
            cp.worker(&sim.url())["models"].as_array().is_some_and(|m| m.len() == 2)
        })
        .unwrap();
    }
    let envoy = gateway(&cp);
    sync(&cp, &envoy);
    let cached = |r: &Response| r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    for i in 0..8 {
        let prompt = format!("conversation {i} about {}", format!("topic {i} ").repeat(60));
        let first = ask(&envoy, "/v1/completions", "llama", &prompt);
        assert_eq!((first.status, cached(&first)), (200, Some(0)), "{}", first.text());
        let again = ask(&envoy, "/v1/completions", "chat", &prompt);
        assert_eq!(again.status, 200, "{}", again.text());
        assert_eq!(again.header("x-kvmesh-worker"), first.header("x-kvmesh-worker"), "prompt {i}: back to its worker");
        assert!(cached(&again).is_some_and(|n| n > 0), "prompt {i}: a hit under the other name: {}", again.text());
    }
    // A prompt only ever sent as `llama` is found asking for `chat`.
    let prompt = format!("sent once {}", "as llama ".repeat(60));
    assert_eq!(ask(&envoy, "/v1/completions", "llama", &prompt).status, 200);
    wait_until("the prompt in the global index under the other name", Duration::from_secs(10), || {
        let held = cp.match_model(prompt.as_bytes(), Some("chat")).unwrap();
        held.as_array().unwrap().iter().any(|e| e["blocks"].as_u64() > Some(0))
    })
    .unwrap();
}

/// Workers launched with `--api-key` (vLLM guards its `/v1/*`): kvmesh-cp learns what each
/// serves only with its key (`--api-key`, here KVMESH_WORKER_API_KEY), and ships the key to the gateways, which send it to the
/// workers in place of the client's credential (over the filter's own `worker_api_key`).
#[test]
fn the_workers_api_key_reaches_them_from_kvmesh_cp_and_through_the_gateways() {
    let key = "sk-worker-7f3a";
    let sims = vec![
        vllm(&["--served-model-name", "llama", "--api-key", key]),
        vllm(&["--served-model-name", "qwen", "--api-key", key]),
    ];
    // Through the environment, as the Helm chart passes it (off the command line).
    let mut args = vec!["--health-check-interval-secs", "1", "--worker-urls"];
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    args.extend(urls.iter().map(String::as_str));
    let cp = ControlPlane::start_with_env(
        free_port().unwrap(),
        free_port().unwrap(),
        &args,
        &[("KVMESH_WORKER_API_KEY", key)],
    )
    .unwrap();
    for sim in &sims {
        wait_until("kvmesh-cp to learn the served model through the key", Duration::from_secs(20), || {
            cp.worker(&sim.url())["models"].as_array().is_some_and(|m| m.len() == 1)
        })
        .unwrap();
    }
    let shipped = gateway(&cp);
    let stale = gateway_with(&cp, EnvoyOptions::new(json!({"worker_urls": [], "worker_api_key": "old-key"})).unwrap());
    let post = |envoy: &Envoy, model: &str, auth: Option<&str>| {
        let body = json!({"model": model, "prompt": "hello", "max_tokens": 2}).to_string();
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
        http::post(&envoy.url("/v1/completions"), body.as_bytes(), &headers).unwrap()
    };
    for envoy in [&shipped, &stale] {
        sync(&cp, envoy);
        for (model, sim) in [("llama", &sims[0]), ("qwen", &sims[1])] {
            for auth in [None, Some("Bearer the-clients-own")] {
                let r = post(envoy, model, auth);
                assert_eq!((r.status, r.header("x-kvmesh-worker")), (200, Some(sim.addr().as_str())), "{}", r.text());
            }
        }
    }
}
