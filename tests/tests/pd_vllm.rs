//! vLLM's PD protocol end to end (`"pd_protocol": "vllm"`): real Envoy with
//! `envoy/envoy-pd.yaml`, the real filter (the `.wasm`, and the native build), simulated vLLM
//! prefill and decode workers (`kvmesh-sim --engine vllm`). The gateway runs the prefill leg
//! first and hands its `kv_transfer_params` to the decode leg; a decode worker pulls the KV
//! from the prefill that computed it and fails the request when the parameters are wrong or
//! made up, so a bad hand-over is a visible error.

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{repo_root, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

struct Vllm {
    prefill: Vec<Sim>,
    decode: Vec<Sim>,
    envoy: Envoy,
}

fn stack(prefill_args: &[&str], decodes: usize, native: bool, fallback: bool) -> Vllm {
    let vllm = ["--engine", "vllm", "--time-scale", "0"];
    let prefill = vec![Sim::start(&[&vllm[..], &["--role", "prefill"], prefill_args].concat()).unwrap()];
    let decode: Vec<Sim> =
        (0..decodes).map(|_| Sim::start(&[&vllm[..], &["--role", "decode"]].concat()).unwrap()).collect();
    let filter = json!({
        "pd_disaggregation": true,
        "pd_protocol": "vllm",
        "pd_prefill_fallback": fallback,
        "prefill": prefill.iter().map(|s| json!([s.url(), "none"])).collect::<Vec<_>>(),
        "decode": decode.iter().map(Sim::url).collect::<Vec<_>>(),
    });
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    if native {
        opts.native_module = Some(repo_root().join("target/release/libkvmesh_native.so"));
    }
    let envoy = Envoy::start(&opts).unwrap();
    Vllm { prefill, decode, envoy }
}

impl Vllm {
    /// What worker `sim` recorded of request `id` (its body and headers), if it saw it.
    fn received(sim: &Sim, id: &str) -> Option<Value> {
        let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
        log.as_array().unwrap().iter().rev().find(|r| r["x_request_id"] == id).cloned()
    }

    fn stat(&self, sims: &[Sim], field: &str) -> u64 {
        sims.iter().map(|s| s.stats().unwrap()[field].as_u64().unwrap_or(0)).sum()
    }

    fn send(&self, path: &str, body: &Value, id: &str) -> Response {
        http::post(&self.envoy.url(path), body.to_string().as_bytes(), &[("x-request-id", id)]).unwrap()
    }
}

/// Each request reaches the prefill worker once (one token, no stream, asking for a remote
/// decode) and then one decode worker with the client's own body plus the prefill's
/// `kv_transfer_params`, under the same request id; the decode pulls that KV; streaming and
/// chat too.
fn legs_run_in_turn(native: bool) {
    let s = stack(&[], 2, native, true);
    let engine = s.prefill[0].stats().unwrap()["engine_id"].clone();
    let cases = [
        ("/v1/completions", json!({"model": "kvmesh-sim", "prompt": "Explain NIXL. ".repeat(60), "max_tokens": 5})),
        (
            "/v1/completions",
            json!({"model": "kvmesh-sim", "prompt": "stream me ".repeat(80), "max_tokens": 4, "stream": true,
                   "stream_options": {"include_usage": true}, "min_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": "hello ".repeat(90)}],
                   "max_completion_tokens": 3}),
        ),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let id = format!("vllm-{native}-{i}");
        let r = s.send(path, body, &id);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let decode = r.header("x-kvmesh-worker").expect("x-kvmesh-worker").to_string();
        assert_eq!(r.header("x-kvmesh-prefill"), Some(s.prefill[0].addr().as_str()), "the prefill named");
        let d = s.decode.iter().find(|d| d.addr() == decode).expect("a decode worker answered");
        let seen = Vllm::received(d, &id).expect("the decode worker saw the request");
        let params = &seen["body"]["kv_transfer_params"];
        assert_eq!(params["remote_engine_id"], engine, "the prefill's own parameters: {params}");
        let mut client = seen["body"].clone();
        client.as_object_mut().unwrap().remove("kv_transfer_params");
        assert_eq!(&client, body, "the decode leg gets the client's body untouched");
        let p = Vllm::received(&s.prefill[0], &id).expect("the prefill worker saw the request, same id");
        assert_eq!(p["body"]["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!((p["body"]["stream"].clone(), p["body"]["max_tokens"].clone()), (json!(false), json!(1)));
        for gone in ["stream_options", "min_tokens"] {
            assert!(p["body"].get(gone).is_none(), "{gone} reached the prefill: {}", p["body"]);
        }
        if body["stream"] == true {
            assert!(r.text().trim_end().ends_with("data: [DONE]"), "streamed to its end: {}", r.text());
        }
    }
    assert_eq!(s.stat(&s.decode, "kv_transfers_ok"), 3, "every decode pulled its prefill's KV");
    assert_eq!(s.stat(&s.decode, "kv_transfers_failed") + s.stat(&s.decode, "local_prefills"), 0);
    // Both legs are the gateway's: counted (and their worker in flight) for each request.
    assert_eq!(s.envoy.stat("wasmcustom.kvmesh_requests_total").unwrap(), Some(6));
}

#[test]
fn the_prefill_runs_first_and_hands_its_kv_to_the_decode() {
    legs_run_in_turn(false);
}

#[test]
fn the_native_build_runs_the_legs_in_turn_too() {
    legs_run_in_turn(true);
}

/// A client's own `kv_transfer_params` (which could send a decode worker to any host) is a
/// 400 that reaches no worker; a prefill that fails loses no request: the decode worker runs
/// it alone, and the gateway counts the fallback.
#[test]
fn forged_parameters_are_refused_and_a_failed_prefill_falls_back_to_the_decode() {
    let s = stack(&["--fail-rate", "1"], 1, false, true);
    let forged = json!({"model": "kvmesh-sim", "prompt": "x", "kv_transfer_params":
        {"do_remote_prefill": true, "remote_host": "10.6.6.6", "remote_port": 1, "remote_block_ids": [1]}});
    let r = s.send("/v1/completions", &forged, "forged");
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("kv_transfer_params"), "{}", r.text());
    assert!(Vllm::received(&s.decode[0], "forged").is_none() && Vllm::received(&s.prefill[0], "forged").is_none());

    let body = json!({"model": "kvmesh-sim", "prompt": "fall back ".repeat(50), "max_tokens": 3});
    let r = s.send("/v1/completions", &body, "fallback");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvmesh-prefill"), None, "no prefill's KV was used");
    let seen = Vllm::received(&s.decode[0], "fallback").expect("the decode worker ran it");
    assert_eq!(seen["body"], body, "as the client sent it");
    assert_eq!(s.stat(&s.decode, "local_prefills"), 1);
    assert_eq!(s.envoy.stat("wasmcustom.kvmesh_prefill_fallbacks_total").unwrap(), Some(1));
}

/// With `pd_prefill_fallback: false` a failed prefill fails the request with a JSON 502 naming
/// the prefill worker, and the decode worker never sees it.
#[test]
fn without_the_fallback_a_failed_prefill_is_a_502_naming_it() {
    let s = stack(&["--fail-rate", "1"], 1, false, false);
    let body = json!({"model": "kvmesh-sim", "prompt": "no fallback ".repeat(50), "max_tokens": 3});
    let r = s.send("/v1/completions", &body, "no-fallback");
    assert_eq!(r.status, 502, "{}", r.text());
    let error = r.json().unwrap()["error"].clone();
    assert_eq!(error["code"], "prefill_failed");
    assert!(error["message"].as_str().unwrap().contains(&s.prefill[0].addr()), "{error}");
    assert!(Vllm::received(&s.decode[0], "no-fallback").is_none(), "the decode worker never saw it");
    assert_eq!(s.envoy.stat("wasmcustom.kvmesh_prefill_fallbacks_total").unwrap().unwrap_or(0), 0);
}
