//! Worker administration fans out from kvmesh-cp (the gateway never forwards it): the
//! engines' own admin endpoints on every worker, or on those `url=` / `role=` select, with the
//! caller's body and query, behind the admin key; an op that empties a worker's KV cache
//! empties its part of the prefix index too.

use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, gateway, sims, FAST};
use kvmesh_testkit::{http, wait_until, Sim};
use serde_json::{json, Value};

/// The calls of `path` a simulated worker recorded.
fn seen(sim: &Sim, path: &str) -> Vec<Value> {
    let log = http::get(&format!("{}/sim/requests", sim.url())).unwrap().json().unwrap();
    log.as_array().unwrap().iter().filter(|r| r["path"] == path).cloned().collect()
}

#[test]
fn worker_admin_reaches_the_selected_workers_with_what_the_caller_sent() {
    let mut workers = sims(2, FAST);
    workers.push(Sim::start(&["--engine", "vllm", "--time-scale", "0"]).unwrap());
    let cp = control_plane(&workers, &[]);
    let index = || cp.snapshot().unwrap()["index_entries"].as_u64().unwrap_or(0);
    let envoy = gateway(&cp);
    let r = http::post_json(&envoy.url("/v1/completions"), &json!({"prompt": "words ".repeat(200), "max_tokens": 1}))
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let holder = r.header("x-kvmesh-worker").unwrap().to_string();
    wait_until("the control plane to index the prompt", Duration::from_secs(10), || index() > 0).unwrap();

    // Every worker, the body as sent; nothing without the admin key.
    let profile = json!({"output_dir": "/tmp/trace", "num_steps": 3});
    let anonymous = http::post(&cp.url("/start_profile"), profile.to_string().as_bytes(), &[]).unwrap();
    assert_eq!(anonymous.status, 401, "{}", anonymous.text());
    assert!(workers.iter().all(|w| seen(w, "/start_profile").is_empty()), "an unauthenticated call reached a worker");
    let r = cp.post_body("/start_profile", profile.to_string().as_bytes()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json().unwrap()["workers"].as_array().map(Vec::len), Some(3));
    for w in &workers {
        let calls = seen(w, "/start_profile");
        assert_eq!(calls.len(), 1, "{}: {calls:?}", w.addr());
        assert_eq!(calls[0]["body"], profile);
    }
    assert!(index() > 0, "profiling keeps the KV caches, and so the index");

    // A weight update empties the KV cache: the index forgets that worker's part, only.
    let other = workers[..2].iter().find(|w| w.addr() != holder).unwrap();
    let update = json!({"model_path": "/models/v2"});
    let on = |op: &str, w: &Sim| cp.post_body(&format!("{op}?url={}", w.url()), update.to_string().as_bytes()).unwrap();
    assert_eq!(on("/update_weights_from_disk", other).status, 200);
    assert_eq!(seen(other, "/update_weights_from_disk")[0]["body"], update);
    assert!(workers
        .iter()
        .filter(|w| w.addr() != other.addr())
        .all(|w| seen(w, "/update_weights_from_disk").is_empty()));
    assert!(index() > 0, "another worker's update leaves the holder's entries");
    let holder = workers.iter().find(|w| w.addr() == holder).unwrap();
    // vLLM has no weight update from disk; its prefix-cache reset empties the cache as well.
    let op = if holder.addr() == workers[2].addr() { "/reset_prefix_cache" } else { "/update_weights_from_disk" };
    assert_eq!(on(op, holder).status, 200);
    assert_eq!(index(), 0, "the index forgot the cache {op} emptied");

    // One worker by its URL, the rest of the query passed on (vLLM's `/sleep?level=1`).
    let vllm = &workers[2];
    let r = cp.post_body(&format!("/sleep?url={}&level=1", vllm.url()), b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(seen(vllm, "/sleep")[0]["query"], "level=1");
    let r = cp.post_body("/stop_profile?role=regular", b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(workers.iter().all(|w| seen(w, "/stop_profile").len() == 1), "every regular worker");
    // An op some workers' engine lacks: 502, saying which.
    let r = cp.post_body("/reset_prefix_cache", b"").unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    let body = r.json().unwrap();
    let failed: Vec<&Value> = body["workers"].as_array().unwrap().iter().filter(|w| w["ok"] == false).collect();
    assert_eq!(failed.len(), 2, "the SGLang workers have no /reset_prefix_cache: {body}");
    assert!(failed.iter().all(|w| w["status"] == 404), "{body}");
    // Refused before any worker sees it: a body over 64 KiB (a million-item list too), one that
    // is no JSON object, an unknown worker, a role this mode has not.
    let huge = format!(r#"{{"pad":"{}"}}"#, "x".repeat(65 * 1024));
    let flood = format!("[{}]", vec!["0"; 1_000_000].join(","));
    for (path, bad, status) in [
        ("/wake_up", huge.as_bytes(), 413),
        ("/wake_up", flood.as_bytes(), 413),
        ("/wake_up", &b"[1]"[..], 400),
        ("/wake_up?url=http://127.0.0.1:1", b"", 404),
        ("/wake_up?role=prefill", b"", 400),
    ] {
        assert_eq!(cp.post_body(path, bad).unwrap().status, status, "{path}");
    }
    assert!(seen(vllm, "/wake_up").is_empty(), "a refused call reached a worker");
    // The other side of the bound: a body of exactly 64 KiB goes through.
    let pad = 64 * 1024 - r#"{"pad":""}"#.len();
    let at_limit = format!(r#"{{"pad":"{}"}}"#, "x".repeat(pad));
    assert_eq!(at_limit.len(), 64 * 1024);
    let r = cp.post_body(&format!("/wake_up?url={}", vllm.url()), at_limit.as_bytes()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(seen(vllm, "/wake_up").len(), 1);
}

/// A worker that hangs (SIGSTOP) holds a fan-out only as long as the op's timeout, which the
/// caller can shorten (`timeout_secs`, kvmesh-cp's own parameter, not passed on): the others'
/// answers come back with the hung one's as unknown, and the call ends.
#[test]
fn a_hung_worker_holds_worker_administration_only_until_its_timeout() {
    let mut workers = sims(2, FAST);
    let cp = control_plane(&workers, &[]);
    let hung = workers[1].url();
    let pid = workers[1].proc().pid().to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let r = cp.post("/start_profile?timeout_secs=1&num_steps=2");
    assert!(std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    let r = r.unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    let answers = r.json().unwrap()["workers"].as_array().cloned().unwrap_or_default();
    let ok_of = |url: &str| answers.iter().find(|w| w["url"] == url).map(|w| w["ok"].clone());
    assert_eq!((ok_of(&workers[0].url()), ok_of(&hung)), (Some(json!(true)), Some(json!(false))), "{answers:?}");
    let calls = seen(&workers[0], "/start_profile");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(!calls[0].to_string().contains("timeout_secs"), "kvmesh-cp's own parameter went on: {calls:?}");
    let refused = cp.post("/start_profile?timeout_secs=0").unwrap();
    assert_eq!(refused.status, 400, "{}", refused.text());
}
