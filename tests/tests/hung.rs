//! A worker that hangs under load (SIGSTOP: the kernel still accepts its connections, nothing
//! answers), with the shipped configuration and kvmesh-cp's defaults: real Envoy, the real
//! `.wasm` (and the native build: `cargo xtask test` runs this file again with
//! `KVMESH_TEST_NATIVE=1`), real kvmesh-cp and sims. No request is lost: the ones it holds
//! that have had no answer yet are sent again to another worker by the filter once kvmesh-cp
//! finds the worker unresponsive, and new ones pass it over (Envoy's active health checks,
//! kvmesh-cp's table).

use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{control_plane, sims, sync};
use kvmesh_testkit::{http, wait_until, Envoy, EnvoyOptions, Sim};
use serde_json::json;

/// Open-loop load: one request every `PACE`, `TOTAL` in all (four seconds); the worker freezes
/// once `FREEZE_AT` have been sent.
const TOTAL: usize = 80;
const PACE: Duration = Duration::from_millis(50);
const FREEZE_AT: usize = 10;
/// What a client counts as served in time.
const WITHIN: Duration = Duration::from_secs(5);
/// When a client stops waiting: a request unanswered by then is lost.
const GIVE_UP: Duration = Duration::from_secs(20);

struct Sample {
    latency: Duration,
    /// 0: no answer (a transport error, or nothing within `GIVE_UP`).
    status: u16,
    body: String,
}

#[test]
fn a_frozen_workers_unanswered_requests_move_to_another_worker_and_none_is_lost() {
    let mut sims = sims(4, &["--time-scale", "1"]);
    let cp = control_plane(&sims, &[]);
    let urls: Vec<String> = sims.iter().map(Sim::url).collect();
    let mut opts = EnvoyOptions::new(json!({"worker_urls": urls})).unwrap();
    opts.workers_health_checks = true; // as shipped
    opts.use_control_plane(&cp);
    let envoy = Envoy::start(&opts).unwrap();
    wait_until("Envoy's cluster to list the four workers", Duration::from_secs(20), || {
        envoy.healthy_endpoints().len() == 4
    })
    .unwrap();
    sync(&cp, &envoy);
    let url = envoy.url("/generate");
    let start = Instant::now();
    let mut frozen_at = None;
    let mut clients = Vec::with_capacity(TOTAL);
    for i in 0..TOTAL {
        // Pacing the load (open loop), not waiting for anything.
        let due = start + PACE * i as u32;
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        if i == FREEZE_AT {
            let pid = sims[0].proc().pid().to_string();
            assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
            frozen_at = Some(Instant::now());
        }
        let url = url.clone();
        // A few shared prefixes: cache-aware routing keeps sending some of them to each worker.
        let body = json!({
            "text": format!("conversation {} {} turn {i}", i % 7, "context ".repeat(20)),
            "sampling_params": {"max_new_tokens": 8},
        });
        clients.push(std::thread::spawn(move || {
            let sent = Instant::now();
            match http::post_json_within(&url, &body, GIVE_UP) {
                Ok(r) => {
                    Sample { latency: sent.elapsed(), status: r.status, body: r.text().chars().take(300).collect() }
                }
                Err(e) => Sample { latency: sent.elapsed(), status: 0, body: e.to_string() },
            }
        }));
    }
    let samples: Vec<Sample> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let frozen_for = frozen_at.map(|t| t.elapsed()).unwrap_or_default();
    let in_time = samples.iter().filter(|s| s.status == 200 && s.latency <= WITHIN).count();
    let unanswered = samples.iter().filter(|s| s.status == 0).count();
    let failed: Vec<&Sample> = samples.iter().filter(|s| s.status != 200).collect();
    let slowest = samples.iter().map(|s| s.latency).max().unwrap_or_default();
    let moved = envoy.filter_stat("kvmesh_failovers_total");
    let checks = envoy.stat("cluster.kvmesh_workers.health_check.failure").unwrap().unwrap_or(0);
    eprintln!(
        "hung worker: {TOTAL} requests, {in_time} answered 200 within {WITHIN:?}, {} not 200 ({unanswered} \
         unanswered), slowest {slowest:?}; {moved} sent again to another worker, {checks} failed health \
         checks; the worker was frozen for {frozen_for:?}",
        failed.len(),
    );
    for s in failed.iter().take(5) {
        eprintln!("  not served: {} after {:?}: {}", s.status, s.latency, s.body);
    }
    assert_eq!(unanswered, 0, "every request gets an answer");
    assert!(failed.is_empty(), "no request is lost: {} were not served", failed.len());
    assert!(in_time * 100 >= TOTAL * 95, "only {in_time} of {TOTAL} answered 200 within {WITHIN:?}");
    assert!(moved >= 1, "requests the frozen worker held were sent again to another worker");
}
