//! Decision records and trace context end to end: real Envoy from the shipped configurations
//! with their access log written to a file, the real filter (the `.wasm`; the native build
//! with `KVMESH_TEST_NATIVE=1`), simulated workers that record the headers they received. The
//! access-log line of each request carries the filter's decision record (the worker that
//! served it, what the index believed it held, both PD legs, a failover), and the client's
//! `traceparent`/`tracestate` reach every worker leg: the regular and decode legs through
//! Envoy's router, SGLang's prefill callout and vLLM's first leg from the filter. And the
//! metrics the shipped Grafana dashboard queries exist on a running stack.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, fast_decode, fast_prefill, gateway, generate, pd_options, sims, sync, FAST};
use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{repo_root, scratch_dir, wait_until, Envoy, EnvoyOptions, Sim};
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
    /// its log every second or so), parsed: the shipped format is one JSON object a line.
    fn line(&self, id: &str) -> Value {
        let mut found = None;
        wait_until(&format!("the access log line of {id}"), Duration::from_secs(15), || {
            found = self.lines().into_iter().find(|l| l["id"] == id);
            found.is_some()
        })
        .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(&self.log).unwrap_or_default()));
        found.unwrap_or_default()
    }

    /// Every line written so far, each of which must be one JSON object.
    fn lines(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let parse =
            |l: &str| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not one JSON object: {e}: {l}"));
        text.lines().map(parse).inspect(|v| assert!(v.is_object(), "{v}")).collect()
    }
}

/// The decision record of an access-log line (`"kvmesh": "k=v;..."`) as a map.
fn record(line: &Value) -> BTreeMap<String, String> {
    let value = line["kvmesh"].as_str().unwrap_or_default();
    assert!(value.starts_with("policy="), "no decision record in: {line}");
    value.split(';').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A field of an access-log line as text (`-` where Envoy had no value).
fn field(line: &Value, key: &str) -> String {
    match &line[key] {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        v => v.to_string(),
    }
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
        assert_eq!((field(&line, "upstream").as_str(), field(&line, "failover").as_str()), (worker, "-"), "{line}");
        assert_eq!(field(&line, "traceparent"), TRACEPARENT, "{line}");
        assert_traced(sim_at(&sims, worker), id);
    }
}

/// A client's trace context and request id reach the access log and the workers only well
/// formed: values built to forge fields (`upstream=`, `kvmesh=`) end as what they are, one
/// JSON string, on every kind of path, and no worker gets a trace context that is not W3C's.
#[test]
fn no_header_a_client_sends_adds_a_field_to_the_access_log_or_reaches_a_worker_malformed() {
    let sims = sims(1, FAST);
    let gw = regular(&sims);
    let forged = format!("{TRACEPARENT} upstream=6.6.6.6:1 kvmesh=\"policy=forged;worker=6.6.6.6:1\"");
    let generate = json!({"text": "forge me", "sampling_params": {"max_new_tokens": 1}});
    let completion = json!({"prompt": "forge me", "max_tokens": 1});
    let cases: [(&str, &str, Option<&Value>); 4] = [
        ("POST", "/generate?case=0", Some(&generate)),
        ("POST", "/v1/completions?case=1", Some(&completion)),
        ("GET", "/health?case=2", None),
        ("GET", "/no/such/path?case=3", None),
    ];
    for (i, (_, path, body)) in cases.iter().enumerate() {
        for (name, value) in [("traceparent", forged.as_str()), ("x-request-id", forged.as_str())] {
            let headers = [(name, value), ("tracestate", TRACESTATE)];
            let url = gw.envoy.url(path);
            let r = match body {
                Some(b) => http::post(&url, b.to_string().as_bytes(), &headers).unwrap(),
                None => http::get_with(&url, &headers).unwrap(),
            };
            assert_eq!(r.status, if i == 3 { 404 } else { 200 }, "{path} {name}: {}", r.text());
        }
    }
    let mut lines = Vec::new();
    wait_until("a line for each request", Duration::from_secs(15), || {
        lines = gw.lines();
        lines.len() >= 2 * cases.len()
    })
    .unwrap();
    assert_eq!(lines.len(), 2 * cases.len(), "{lines:?}");
    for line in &lines {
        assert_ne!(field(line, "upstream"), "6.6.6.6:1", "{line}");
        let path = field(line, "path");
        assert_ne!(field(line, "traceparent"), forged, "{line}");
        assert_ne!(field(line, "id"), forged, "{line}");
        if path.starts_with("/generate") || path.starts_with("/v1/") {
            assert_eq!(record(line)["worker"], sims[0].addr(), "{line}");
        }
    }
    let seen = http::get(&format!("{}/sim/requests", sims[0].url())).unwrap().json().unwrap();
    for r in seen.as_array().unwrap() {
        assert!(!r.to_string().contains("6.6.6.6"), "a worker got a forged header: {r}");
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
    // The rid both legs carry: what an operator aborts the request by (through kvmesh-cp).
    for sim in [&prefill, &decode] {
        assert_eq!(received(sim, "pd-1")["body"]["rid"], rec["rid"].as_str(), "{line}");
    }
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

/// Every metric the shipped Grafana dashboard (docs/grafana/kvmesh.json) queries exists: in
/// kvmesh-cp's `/metrics` or in Envoy's `/stats/prometheus` (the filter's stats and Envoy's
/// own), scraped from a running stack after a request.
#[test]
fn the_grafana_dashboard_queries_metrics_that_exist() {
    let workers = sims(2, FAST);
    let cp = control_plane(&workers, &[]);
    let envoy = gateway(&cp);
    sync(&cp, &envoy);
    assert_eq!(generate(&envoy, "a question for the dashboard").status, 200);
    let path = repo_root().join("docs/grafana/kvmesh.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    assert!(exprs.len() >= 10, "{} queries", exprs.len());
    let scraped = |text: &str| -> HashSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(String::from)
            .collect()
    };
    let mut names = scraped(&cp.metrics());
    // kvmesh-cp's reports reach it at least once a second; scrape until the per-worker failover
    // series (made on the first report) is there.
    wait_until("kvmesh-cp's per-worker series", Duration::from_secs(10), || {
        names = scraped(&cp.metrics());
        names.iter().any(|n| n.starts_with("kvmesh_worker_failovers"))
    })
    .unwrap();
    // The native build's stats scrape as `envoy_wasmcustom_kvmesh_*` (Envoy strips that
    // namespace only where a Wasm filter registered it): the chart's PodMonitor renames them.
    let monitor = std::fs::read_to_string(repo_root().join("deploy/helm/kvmesh/templates/monitoring.yaml")).unwrap();
    assert!(monitor.contains("regex: envoy_wasmcustom_((kvmesh|sgl_router)_.*)"), "the PodMonitor's rename");
    let envoy_names = scraped(&http::get(&envoy.admin_url("/stats/prometheus")).unwrap().text());
    names.extend(envoy_names.iter().map(|n| n.strip_prefix("envoy_wasmcustom_").unwrap_or(n).to_string()));
    for expr in &exprs {
        // Label matchers (`{envoy_cluster_name="..."}`) are not metric names.
        let mut bare = String::new();
        let mut depth = 0;
        for c in expr.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ if depth == 0 => bare.push(c),
                _ => {}
            }
        }
        for name in bare
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("kvmesh_") || w.starts_with("sgl_router_") || w.starts_with("envoy_"))
        {
            assert!(names.contains(name), "the dashboard queries `{name}` ({expr}), which no scrape has");
        }
    }
}
