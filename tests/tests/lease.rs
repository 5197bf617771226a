//! The control-plane lease moving between the VMs of one Envoy: the VM that owns the streams
//! to kvmesh-cp stops (the test-crash `.wasm` traps it on request), another takes the lease
//! over and reports, and kvmesh-cp counts every request the gateway served exactly once. A
//! request in flight on the VM that dies never reaches that VM's `on_log`: it is not counted
//! as finished, and its in-flight count is taken back by a surviving VM (`VmLedger`).

use std::collections::HashMap;
use std::time::Duration;

use kvmesh_testkit::e2e::{control_plane, gateway_with, generate, sims, worker_of};
use kvmesh_testkit::http;
use kvmesh_testkit::{crash_wasm_path, prom, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::json;

const CP_STREAMS: &str = "cluster.kvmesh_control_plane.upstream_rq_total";
const TRAPPED: &str = "test-crash: trapping the lease owner VM";
/// What a surviving VM logs when it takes back a dead VM's in-flight requests.
const TAKEN_BACK: &str = "a VM that died had ";
/// Slow requests in flight when the third owner traps.
const SLOW: usize = 6;

/// Sends one request; true when a worker served it (200 through the gateway). While a
/// trapped worker-thread VM awaits its reload, its thread answers a JSON 503 that reached no
/// worker, and that is the only other answer allowed.
fn send(envoy: &Envoy, text: &str) -> bool {
    let r = generate(envoy, text);
    match r.status {
        200 => {
            worker_of(&r);
            true
        }
        503 => {
            assert!(r.json().is_ok(), "the failure is JSON: {}", r.text());
            false
        }
        s => panic!("unexpected status {s}: {}", r.text()),
    }
}

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).ok().flatten().unwrap_or(0)
}

/// kvmesh-cp's per-worker `(requests, in flight)` from `/metrics`, in `sims` order.
fn cp_counts(cp: &ControlPlane, sims: &[Sim]) -> Vec<(u64, u64)> {
    let text = cp.metrics();
    sims.iter()
        .map(|s| {
            let labels = format!(r#"{{worker="{}",role="regular"}}"#, s.url());
            let requests = prom::value(&text, &format!("sgl_router_requests_total{labels}")).unwrap_or(0.0);
            let in_flight = prom::value(&text, &format!("kvmesh_worker_in_flight{labels}")).unwrap_or(0.0);
            (requests as u64, in_flight as u64)
        })
        .collect()
}

fn cp_reports(cp: &ControlPlane) -> f64 {
    cp.metric("kvmesh_reports_total").unwrap_or(0.0)
}

#[test]
fn a_lease_move_between_vms_counts_every_served_request_once_and_in_flight_returns_to_zero() {
    // Real time scale: one output token takes ~10 ms, 600 take seconds.
    let sims = sims(3, &[]);
    let cp = control_plane(&sims, &[]);
    let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
    opts.wasm = crash_wasm_path();
    opts.concurrency = 2;
    let mut envoy = gateway_with(&cp, opts);
    // One VM owns the lease: one Watch and one Report stream.
    wait_until("the lease owner's streams", Duration::from_secs(10), || stat(&envoy, CP_STREAMS) >= 2).unwrap();
    let streams_before = stat(&envoy, CP_STREAMS);

    // Before the move: every request served.
    let mut served = 0u64;
    for i in 0..30 {
        assert!(send(&envoy, &format!("before the move {i} {}", "p".repeat(80))), "request {i} before the move");
        served += 1;
    }

    // Three moves: the first owner is usually the main thread's VM (it configures first); the
    // second is then a worker thread's VM, whose thread reloads it on its next request. The
    // third owner is stopped with slow requests in flight, some usually on its own thread.
    let (mut during, mut refused, mut streams) = (0u64, 0u64, streams_before);
    let mut slow = Vec::new();
    for mv in 1..=3 {
        if mv == 3 {
            // Fresh connections land on both worker threads.
            slow = (0..SLOW)
                .map(|i| {
                    let url = envoy.url("/generate");
                    let body = json!({"text": format!("slow {i}"), "sampling_params": {"max_new_tokens": 600}});
                    std::thread::spawn(move || http::post_json(&url, &body).map(|r| r.status))
                })
                .collect();
            wait_until("the slow requests in flight", Duration::from_secs(10), || {
                stat(&envoy, "wasmcustom.kvmesh_in_flight") == SLOW as u64
            })
            .unwrap();
        }
        // Stop the owner. The order is answered by the filter itself and reaches no worker;
        // the owner traps on its next tick. In moves 1 and 2 nothing else is in flight, so
        // every request the VM that dies handled reached `on_log` and was counted.
        let order =
            http::post(&envoy.url("/generate"), br#"{"text":"stop"}"#, &[("x-test-stop-lease-owner", "1")]).unwrap();
        assert_eq!(order.status, 200, "{}", order.text());
        assert!(order.header("x-kvmesh-worker").is_none());
        wait_until(&format!("lease owner {mv} to trap"), Duration::from_secs(10), || {
            envoy.proc().log_text().matches(TRAPPED).count() >= mv
        })
        .unwrap();
        let reports_at_trap = cp_reports(&cp);
        // While the lease lapses (3 s), before another VM takes it over and reconnects.
        for i in 0..50 {
            if stat(&envoy, CP_STREAMS) >= streams + 2 {
                break;
            }
            if send(&envoy, &format!("during move {mv}: {i} {}", "q".repeat(80))) {
                during += 1;
            } else {
                refused += 1;
            }
        }
        wait_until(&format!("a new owner after move {mv}"), Duration::from_secs(15), || {
            stat(&envoy, CP_STREAMS) >= streams + 2
        })
        .unwrap();
        streams = stat(&envoy, CP_STREAMS);
        // The new owner reports: kvmesh-cp merges reports again.
        wait_until("the new owner to report", Duration::from_secs(10), || cp_reports(&cp) > reports_at_trap + 1.0)
            .unwrap();
    }
    served += during;
    // A slow request on the VM that died may still be answered (Envoy passes the response
    // through the failed VM's filter), but it never reaches that VM's `on_log`.
    let slow_status: Vec<String> =
        slow.into_iter().map(|t| format!("{:?}", t.join().unwrap().map_err(|e| e.to_string()))).collect();

    // After the moves.
    let mut after = 0u64;
    for i in 0..30 {
        if send(&envoy, &format!("after the move {i} {}", "r".repeat(80))) {
            after += 1;
        } else {
            refused += 1;
        }
    }
    served += after;

    // In flight back to 0 everywhere: a dead VM's requests are taken back by a surviving VM once
    // its heartbeat is 10 s stale.
    let last = std::cell::RefCell::new(String::new());
    wait_until("in flight back to 0 in kvmesh-cp and Envoy", Duration::from_secs(30), || {
        let (cp_now, envoy_now) = (cp_counts(&cp, &sims), stat(&envoy, "wasmcustom.kvmesh_in_flight"));
        *last.borrow_mut() = format!("kvmesh-cp {cp_now:?}, Envoy {envoy_now}");
        cp_now.iter().all(|c| c.1 == 0) && envoy_now == 0
    })
    .unwrap_or_else(|e| panic!("{e}: last seen {}", last.borrow()));
    // Every request a worker served was counted once, per worker, except those in flight on a
    // VM that died (taken back, never finished); the fast ones answered 200 are all counted.
    let per_sim: Vec<u64> = sims.iter().map(|s| s.stats().unwrap()["requests"].as_u64().unwrap()).collect();
    assert_eq!(per_sim.iter().sum::<u64>(), served + SLOW as u64, "the sims served the 200s and the slow ones");
    wait_until("kvmesh-cp to count every served request", Duration::from_secs(15), || {
        cp_counts(&cp, &sims).iter().map(|c| c.0).sum::<u64>() >= served
    })
    .unwrap();
    // A double count would show in a later report: let the owner report counts twice more
    // (once a second) and check again.
    let reports = cp_reports(&cp);
    wait_until("two more reports", Duration::from_secs(10), || cp_reports(&cp) >= reports + 2.0).unwrap();
    let counted = cp_counts(&cp, &sims);
    let ids: HashMap<u64, String> =
        cp.workers().iter().map(|w| (w["id"].as_u64().unwrap(), w["url"].as_str().unwrap().to_string())).collect();
    // Per worker: what the sim served less what was taken back (Envoy's log is read until it
    // shows as much, in case its last lines are not written yet).
    let expected = |taken_back: &HashMap<String, u64>| -> Vec<u64> {
        sims.iter()
            .zip(&per_sim)
            .map(|(s, n)| n.saturating_sub(taken_back.get(&s.url()).copied().unwrap_or(0)))
            .collect()
    };
    let mut taken_back = HashMap::new();
    let _ = wait_until("Envoy's log to account for every request not counted", Duration::from_secs(10), || {
        taken_back = taken_back_per_worker(&envoy.proc().log_text(), &ids);
        expected(&taken_back) == counted.iter().map(|c| c.0).collect::<Vec<_>>()
    });
    let lost: u64 = taken_back.values().sum();
    eprintln!(
        "served {served} fast requests (before 30, during the three moves {during}, after {after}; {refused} \
         refused by a VM awaiting reload) and {SLOW} slow ones ({slow_status:?}); in flight on the VM that died \
         {lost} {taken_back:?}; sims {per_sim:?}; kvmesh-cp (requests, in flight) {counted:?}; streams on the \
         control-plane cluster {streams_before} before the moves, {} after; VM reloads {}",
        stat(&envoy, CP_STREAMS),
        stat(&envoy, "wasm.kvmesh.vm_reload_success"),
    );
    assert!(lost <= SLOW as u64, "only the slow requests were in flight when an owner trapped");
    assert_eq!(counted.iter().map(|c| c.0).collect::<Vec<_>>(), expected(&taken_back), "per worker, counted once");
    assert_eq!(cp_counts(&cp, &sims), counted, "and no later report changed them");
}

/// The in-flight requests surviving VMs took back from VMs that died, per worker url, from
/// Envoy's log.
fn taken_back_per_worker(log: &str, ids: &HashMap<u64, String>) -> HashMap<String, u64> {
    let mut out: HashMap<String, u64> = HashMap::new();
    for line in log.lines() {
        let Some((_, rest)) = line.split_once(TAKEN_BACK) else { continue };
        let (n, rest) = rest.split_once(" requests in flight to worker ").unwrap();
        let worker: u64 = rest.split(':').next().unwrap().parse().unwrap();
        *out.entry(ids[&worker].clone()).or_default() += n.parse::<u64>().unwrap();
    }
    out
}
