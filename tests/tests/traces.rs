//! Decision records and trace context end to end: real Envoy from the shipped configurations
//! with their access log written to a file, the real filter (the `.wasm`; the native build
//! with `KVMESH_TEST_NATIVE=1`), simulated workers that record the headers they received. The
//! access-log line of each request carries the filter's decision record (the worker that
//! served it, what the index believed it held, both PD legs, a failover), and the client's
//! `traceparent`/`tracestate` reach every worker leg: the regular and decode legs through
//! Envoy's router, SGLang's prefill callout and vLLM's first leg from the filter.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use kvmesh_testkit::e2e::{fast_decode, fast_prefill, pd_options, sims, FAST};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{scratch_dir, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "vendor=kvmesh-test";

/// An Envoy whose access log goes to a file of its own.
struct Logged {
    envoy: Envoy,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn start(mut opts: EnvoyOptions) -> Logged {
    let dir = scratch_dir("traces").unwrap();
    let log = dir.path().join("access.log");
    opts.access_log = Some(log.clone());
    Logged { envoy: Envoy::start(&opts).unwrap(), log, _dir: dir }
}

impl Logged {
    /// POSTs `body` to `path` as request `id` with W3C trace context.
    fn send(&self, path: &str, body: &Value, id: &str) -> Response {
        let headers = [("x-request-id", id), ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)];
        http::post(&self.envoy.url(path), body.to_string().as_bytes(), &headers).unwrap()
    }

    /// The access-log line of request `id` (Envoy writes it once the stream ends and flushes
    /// its log every second or so).
    fn line(&self, id: &str) -> String {
        let needle = format!(" id={id} ");
        let mut found = None;
        wait_until(&format!("the access log line of {id}"), Duration::from_secs(15), || {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            found = text.lines().find(|l| l.contains(&needle)).map(String::from);
            found.is_some()
        })
        .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(&self.log).unwrap_or_default()));
        found.unwrap_or_default()
    }
}

/// The decision record of an access-log line (`kvmesh="k=v;..."`) as a map.
fn record(line: &str) -> BTreeMap<String, String> {
    let value = line.split("kvmesh=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or_default();
    assert!(value.starts_with("policy="), "no decision record in: {line}");
    value.split(';').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The value of a `key=value` field of an access-log line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ').find_map(|f| f.strip_prefix(&format!("{key}="))).unwrap_or_default()
}

/// What `sim` recorded of request `id`: its body and the headers it got.
fn received(sim: &Sim, id: &str) -> Value {
    let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    let found = log.as_array().unwrap().iter().rev().find(|r| r["x_request_id"] == id).cloned();
    found.unwrap_or_else(|| panic!("{} saw no request {id}: {log}", sim.addr()))
}

fn assert_traced(sim: &Sim, id: &str) {
    let seen = received(sim, id);
    assert_eq!((seen["traceparent"].as_str(), seen["tracestate"].as_str()), (Some(TRACEPARENT), Some(TRACESTATE)));
}

fn sim_at<'a>(sims: &'a [Sim], addr: &str) -> &'a Sim {
    sims.iter().find(|s| s.addr() == addr).unwrap_or_else(|| panic!("no worker at {addr}"))
}

fn regular(sims: &[Sim]) -> Logged {
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    start(EnvoyOptions::new(json!({"worker_urls": urls, "policy": "cache_aware"})).unwrap())
}

#[test]
fn each_access_log_line_carries_the_decision_and_the_worker_its_trace_context() {
    let sims = sims(2, FAST);
    let gw = regular(&sims);
    let body = json!({"text": "a system prompt every request of this test shares. ".repeat(20),
                      "sampling_params": {"max_new_tokens": 1}});
    for (i, id) in ["trace-1", "trace-2"].into_iter().enumerate() {
        let r = gw.send("/generate", &body, id);
        assert_eq!(r.status, 200, "{}", r.text());
        let worker = r.header("x-kvmesh-worker").unwrap();
        let line = gw.line(id);
        let rec = record(&line);
        assert_eq!((rec["policy"].as_str(), rec["worker"].as_str()), ("cache_aware", worker), "{line}");
        let cached: usize = rec["cached_bytes"].parse().unwrap();
        // The second time the index believes the worker holds the prompt.
        assert_eq!(cached > 0, i == 1, "{line}");
        assert_eq!((field(&line, "upstream"), field(&line, "failover")), (worker, "-"), "{line}");
        assert_eq!(field(&line, "traceparent"), TRACEPARENT, "{line}");
        assert_traced(sim_at(&sims, worker), id);
    }
}

#[test]
fn a_request_failed_over_names_both_workers_on_its_line() {
    let sims = vec![Sim::start(FAST).unwrap(), Sim::start(&[FAST, &["--fail-rate", "1"]].concat()).unwrap()];
    let gw = regular(&sims);
    let (good, bad) = (sims[0].addr(), sims[1].addr());
    // The prompt's rendezvous hash picks the worker on an empty index: some prompts go to the
    // failing one first, and Envoy fails them over.
    let mut seen = None;
    for i in 0..24 {
        let id = format!("failover-{i}");
        let r = gw.send("/generate", &json!({"text": format!("prompt number {i}"), "sampling_params": {}}), &id);
        assert_eq!(r.status, 200, "{}", r.text());
        let line = gw.line(&id);
        if record(&line)["worker"] == bad {
            seen = Some(line);
            break;
        }
    }
    let line = seen.expect("no prompt went to the failing worker first");
    assert_eq!(field(&line, "failover"), good, "{line}");
    assert_eq!(field(&line, "upstream"), good, "{line}");
}

#[test]
fn sglang_pd_records_both_legs_and_both_workers_get_the_trace_context() {
    let prefill = fast_prefill();
    let decode = fast_decode(Some(&prefill));
    let filter = json!({"prefill": [[prefill.url(), null]], "decode": [decode.url()]});
    let gw = start(pd_options(filter, false));
    let r =
        gw.send("/generate", &json!({"text": "hello ".repeat(40), "sampling_params": {"max_new_tokens": 1}}), "pd-1");
    assert_eq!(r.status, 200, "{}", r.text());
    let line = gw.line("pd-1");
    let rec = record(&line);
    assert_eq!(rec["worker"], decode.addr(), "{line}");
    assert_eq!((rec["decider"].as_str(), rec["prefill"].as_str()), ("split", prefill.addr().as_str()), "{line}");
    assert_eq!(rec["prefill_policy"], "cache_aware", "{line}");
    assert_traced(&prefill, "pd-1");
    assert_traced(&decode, "pd-1");
}

#[test]
fn vllm_pd_sends_the_trace_context_on_the_first_leg_and_the_decode_leg() {
    let vllm = ["--engine", "vllm", "--time-scale", "0"];
    let prefill = Sim::start(&[&vllm[..], &["--role", "prefill"]].concat()).unwrap();
    let decode = Sim::start(&[&vllm[..], &["--role", "decode"]].concat()).unwrap();
    let filter = json!({"pd_protocol": "vllm", "prefill": [[prefill.url(), "none"]], "decode": [decode.url()]});
    let gw = start(pd_options(filter, false));
    let body = json!({"model": "kvmesh-sim", "prompt": "Explain NIXL. ".repeat(30), "max_tokens": 2});
    let r = gw.send("/v1/completions", &body, "vllm-1");
    assert_eq!(r.status, 200, "{}", r.text());
    let rec = record(&gw.line("vllm-1"));
    assert_eq!((rec["decider"].as_str(), rec["prefill"].as_str()), ("split", prefill.addr().as_str()));
    assert_eq!(rec["worker"], decode.addr());
    assert_traced(&prefill, "vllm-1");
    assert_traced(&decode, "vllm-1");
}
