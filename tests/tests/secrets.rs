//! What a client can read through the gateway, and what a worker can write into kvmesh-cp's
//! metrics, as configured in the README and the Helm chart: kvmesh-cp holds the workers' key
//! (`KVMESH_WORKER_API_KEY`) and ships it to the gateways, which send it to the workers; real
//! kvmesh-cp, real Envoy with the real filter (the `.wasm`; the native build with
//! `KVMESH_TEST_NATIVE=1`), simulated SGLang workers that answer `/get_server_info` with their
//! server arguments, `api_key` included, as SGLang does.

use std::time::Duration;

use kvmesh_testkit::e2e::{gateway, sync};
use kvmesh_testkit::http;
use kvmesh_testkit::prom::samples;
use kvmesh_testkit::{free_port, wait_until, ControlPlane, Sim};
use serde_json::Value;

/// A model name built to end its label value and the line, and add a series of its own.
const HOSTILE_MODEL: &str = "evil\"} 1\nkvmesh_injected_total{a=\"b\"} 1\n# \\";

#[test]
fn no_client_reads_the_workers_key_and_no_worker_adds_a_series() {
    let key = format!("sk-workers-{}", kvmesh_testkit::random_secret());
    let sims = [
        Sim::start(&["--time-scale", "0", "--api-key", &key]).unwrap(),
        Sim::start(&["--time-scale", "0", "--api-key", &key, "--served-model-name", HOSTILE_MODEL]).unwrap(),
    ];
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let mut args = vec!["--health-check-interval-secs", "1", "--worker-urls"];
    args.extend(urls.iter().map(String::as_str));
    let env = [("KVMESH_WORKER_API_KEY", key.as_str())];
    let cp = ControlPlane::start_with_env(free_port().unwrap(), free_port().unwrap(), &args, &env).unwrap();
    for sim in &sims {
        wait_until("kvmesh-cp to learn what each worker serves", Duration::from_secs(20), || {
            cp.worker(&sim.url())["models"].as_array().is_some_and(|m| m.len() == 1)
        })
        .unwrap();
    }
    let envoy = gateway(&cp);
    sync(&cp, &envoy);

    // The passthrough paths answer, with the key nowhere in them.
    for _ in 0..8 {
        let r = http::get(&envoy.url("/get_server_info")).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(!r.text().contains(&key), "the workers' key reached a client: {}", r.text());
        let info: Value = r.json().unwrap();
        assert_eq!(info["api_key"], "<redacted>", "{info}");
        assert!(info["model_path"].is_string() && info["max_total_num_tokens"].is_u64(), "{info}");
    }
    for path in ["/get_model_info", "/health", "/v1/models"] {
        let r = http::get(&envoy.url(path)).unwrap();
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert!(!r.text().contains(&key), "{path}: {}", r.text());
    }
    // Straight from a worker the key is there: the gateway took it out.
    let direct =
        http::get_with(&format!("{}/get_server_info", sims[0].url()), &[("authorization", &format!("Bearer {key}"))]);
    assert!(direct.unwrap().text().contains(&key));

    // kvmesh-cp's /metrics: every line one sample, the hostile name inside its label.
    let text = http::get(&cp.url("/metrics")).unwrap().text();
    let all = samples(&text).unwrap_or_else(|line| panic!("a scraper rejects the page at: {line}\n{text}"));
    assert!(all.iter().all(|s| !s.name.contains("injected")), "a worker added a series:\n{text}");
    let labelled =
        |name: &str| all.iter().filter(|s| s.name == name).flat_map(|s| s.labels.clone()).collect::<Vec<_>>();
    assert!(labelled("kvmesh_worker_model").contains(&("model".to_string(), HOSTILE_MODEL.to_string())), "{text}");
}

/// kvmesh-cp's read endpoints (workers, snapshot, metrics, `/match`, a cache side channel)
/// answer only with the key once `--protect-read-endpoints` is set; `/health` stays open.
#[test]
fn read_endpoints_can_be_protected_too() {
    let cp = ControlPlane::start(&["--protect-read-endpoints"]).unwrap();
    for path in ["/workers", "/list_workers", "/snapshot", "/metrics"] {
        assert_eq!(http::get(&cp.url(path)).unwrap().status, 401, "{path}");
    }
    assert_eq!(http::post(&cp.url("/match"), b"text", &[]).unwrap().status, 401);
    assert_eq!(http::get(&cp.url("/health")).unwrap().status, 200, "/health stays open");
    let auth = format!("Bearer {}", cp.api_key.as_deref().unwrap());
    let r = http::post(&cp.url("/match"), b"text", &[("authorization", &auth)]).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}
