//! llm-d's PD protocol end to end (`"pd_protocol": "llm-d"`): real Envoy with
//! `envoy/envoy-pd.yaml`, the real filter (the `.wasm`, and the native build), simulated vLLM
//! prefill pods and decode pods running as llm-d's routing sidecar (`--llm-d-sidecar`): a
//! decode pod that gets `x-prefiller-host-port` runs the prefill there itself and pulls the
//! KV, so a wrong or forged prefill pod fails the request visibly.

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{repo_root, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

struct LlmD {
    prefill: Vec<Sim>,
    decode: Vec<Sim>,
    envoy: Envoy,
}

fn stack(prefills: usize, decodes: usize, filter: Value, native: bool) -> LlmD {
    stack_on(prefills, decodes, filter, native, None)
}

/// [`stack`] on an Envoy with `concurrency` worker threads (its default when none).
fn stack_on(prefills: usize, decodes: usize, filter: Value, native: bool, concurrency: Option<u32>) -> LlmD {
    let vllm = ["--engine", "vllm", "--time-scale", "0"];
    let prefill: Vec<Sim> =
        (0..prefills).map(|_| Sim::start(&[&vllm[..], &["--role", "prefill"]].concat()).unwrap()).collect();
    let decode: Vec<Sim> = (0..decodes)
        .map(|_| Sim::start(&[&vllm[..], &["--role", "decode", "--llm-d-sidecar"]].concat()).unwrap())
        .collect();
    let mut filter = filter;
    filter["pd_disaggregation"] = json!(true);
    filter["pd_protocol"] = json!("llm-d");
    filter["prefill"] = json!(prefill.iter().map(|s| json!([s.url(), "none"])).collect::<Vec<_>>());
    filter["decode"] = json!(decode.iter().map(Sim::url).collect::<Vec<_>>());
    let mut opts = EnvoyOptions::new(filter).unwrap();
    opts.template = repo_root().join("envoy/envoy-pd.yaml");
    if native {
        opts.native_module = Some(repo_root().join("target/release/libkvmesh_native.so"));
    }
    if let Some(n) = concurrency {
        opts.concurrency = n;
    }
    let envoy = Envoy::start(&opts).unwrap();
    LlmD { prefill, decode, envoy }
}

impl LlmD {
    fn sim(&self, addr: &str) -> &Sim {
        self.prefill.iter().chain(&self.decode).find(|s| s.addr() == addr).expect("a known pod")
    }

    /// What pod `addr` recorded of request `id`: its body and the prefill header it carried.
    fn received(&self, addr: &str, id: &str) -> Option<Value> {
        let log = http::get(&format!("{}/sim/requests", self.sim(addr).url())).unwrap().json().unwrap();
        log.as_array().unwrap().iter().rev().find(|r| r["x_request_id"] == id).cloned()
    }

    fn stat(&self, sims: &[Sim], field: &str) -> u64 {
        sims.iter().map(|s| s.stats().unwrap()[field].as_u64().unwrap_or(0)).sum()
    }
}

fn send(s: &LlmD, path: &str, body: &Value, id: &str, extra: &[(&str, &str)]) -> Response {
    let mut headers = vec![("x-request-id", id)];
    headers.extend_from_slice(extra);
    http::post(&s.envoy.url(path), body.to_string().as_bytes(), &headers).unwrap()
}

fn completion(prompt: &str) -> Value {
    json!({"model": "kvmesh-sim", "prompt": prompt, "max_tokens": 4})
}

/// Every split request reaches exactly one decode pod, which carries the gateway's
/// `x-prefiller-host-port` (never the client's) naming the prefill pod that then computed the
/// prompt; the response names both; streaming and chat too.
fn splits_name_the_prefill_pod(native: bool) {
    let s = stack(2, 2, json!({}), native);
    let forged = "127.0.0.1:9";
    for (i, (path, body)) in [
        ("/v1/completions", completion(&"Explain disaggregated serving. ".repeat(40))),
        ("/v1/chat/completions", json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": "hello ".repeat(200)}], "max_tokens": 3})),
        ("/v1/completions", json!({"model": "kvmesh-sim", "prompt": "stream me ".repeat(150), "max_tokens": 5, "stream": true})),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("llmd-{native}-{i}");
        let r = send(&s, path, &body, &id, &[("x-prefiller-host-port", forged)]);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let decode = r.header("x-kvmesh-worker").expect("x-kvmesh-worker").to_string();
        let prefill = r.header("x-kvmesh-prefill").expect("x-kvmesh-prefill: a split").to_string();
        assert!(s.decode.iter().any(|d| d.addr() == decode), "{decode} is a decode pod");
        assert!(s.prefill.iter().any(|p| p.addr() == prefill), "{prefill} is a prefill pod");
        let seen = s.received(&decode, &id).unwrap_or_else(|| panic!("{decode} saw no request {id}"));
        assert_eq!(seen["x_prefiller_host_port"], prefill.as_str(), "the gateway's header, not the client's");
        assert_eq!(seen["body"], body, "the client's body reaches the decode pod unchanged");
        let prefilled = s.received(&prefill, &id).unwrap_or_else(|| panic!("{prefill} ran no prefill for {id}"));
        assert_eq!(prefilled["body"]["kv_transfer_params"]["do_remote_decode"], true, "the sidecar's prefill call");
        if body["stream"] == true {
            assert!(r.text().trim_end().ends_with("data: [DONE]"), "streamed to the end: {}", r.text());
        }
    }
    assert_eq!(s.stat(&s.decode, "sidecar_prefills"), 3, "one prefill per request, by the sidecars");
    assert_eq!(s.stat(&s.decode, "kv_transfers_ok"), 3, "every decode pulled the KV its prefill computed");
    assert_eq!(s.stat(&s.decode, "kv_transfers_failed"), 0);
    // The sidecar's prefill is not the gateway's leg: only the decode legs count.
    assert_eq!(s.envoy.stat("wasmcustom.kvmesh_requests_total").unwrap(), Some(3));
}

#[test]
fn splits_name_the_prefill_pod_and_never_the_clients() {
    splits_name_the_prefill_pod(false);
}

#[test]
fn the_native_build_splits_the_same_way() {
    splits_name_the_prefill_pod(true);
}

/// The prefix decider: a request whose prompt the decode pod already holds runs there alone
/// (no header, no prefill), one it does not hold is split; a client's header never reaches a
/// pod that runs a request alone.
#[test]
fn the_prefix_decider_splits_only_what_the_decode_pod_lacks() {
    let s = stack(1, 1, json!({"pd_decider": "prefix", "non_cached_tokens": 64}), false);
    let (decode, prefill) = (s.decode[0].addr(), s.prefill[0].addr());
    let prompt = "A long shared context for every turn of this conversation. ".repeat(30);
    let first = send(&s, "/v1/completions", &completion(&prompt), "turn-1", &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-kvmesh-prefill"), Some(prefill.as_str()), "nothing cached yet: split");
    // The same prompt and a short question: the decode pod holds all but a few tokens.
    let next = completion(&format!("{prompt}And now?"));
    let second = send(&s, "/v1/completions", &next, "turn-2", &[("x-prefiller-host-port", "127.0.0.1:9")]);
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.header("x-kvmesh-prefill"), None, "decode alone: {:?}", second.headers);
    let seen = s.received(&decode, "turn-2").expect("the decode pod ran it");
    assert_eq!(seen["x_prefiller_host_port"], Value::Null, "no header, the client's neither");
    assert!(s.received(&prefill, "turn-2").is_none(), "the prefill pod never saw it");
    assert_eq!(s.stat(&s.decode, "sidecar_prefills"), 1, "one split of two");
    assert_eq!(s.stat(&s.decode, "local_prefills"), 1, "the decode pod computed the second itself");
}

/// The decode pod that gets a request is the one the decode policy picked: with
/// `round_robin` on one Envoy thread, six requests cycle through the three decode pods in one
/// order, each received (with the gateway's header) by exactly the pod the response names and
/// by no other.
#[test]
fn the_decode_pod_is_the_one_the_decode_policy_picks() {
    let filter = json!({"decode_policy": "round_robin"});
    let s = stack_on(1, 3, filter, false, Some(1));
    let prefill = s.prefill[0].addr();
    let mut order = Vec::new();
    for i in 0..6 {
        let id = format!("rr-{i}");
        let r = send(&s, "/v1/completions", &completion(&format!("{i}: {}", "round and round ".repeat(30))), &id, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        let decode = r.header("x-kvmesh-worker").expect("x-kvmesh-worker").to_string();
        for pod in &s.decode {
            let seen = s.received(&pod.addr(), &id);
            if pod.addr() == decode {
                let seen = seen.unwrap_or_else(|| panic!("{decode} never got {id}"));
                assert_eq!(seen["x_prefiller_host_port"], prefill.as_str());
            } else {
                assert!(seen.is_none(), "{id} reached {} too", pod.addr());
            }
        }
        order.push(decode);
    }
    let first: std::collections::HashSet<&String> = order[..3].iter().collect();
    assert_eq!(first.len(), 3, "round robin visits every decode pod: {order:?}");
    assert_eq!(order[..3], order[3..], "and again in the same order");
}
