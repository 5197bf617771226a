//! The control-plane lease moving between the VMs of one Envoy: the VM that owns the streams
//! to kvmesh-cp stops (the test-crash `.wasm` traps it on request), another takes the lease
//! over and reports, and kvmesh-cp counts every request the gateway served exactly once.

use std::time::Duration;

use kvmesh_testkit::http::{self, Response};
use kvmesh_testkit::{crash_wasm_path, prom, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::json;

const CP_STREAMS: &str = "cluster.kvmesh_control_plane.upstream_rq_total";
const TRAPPED: &str = "test-crash: trapping the lease owner VM";

fn generate(envoy: &Envoy, text: &str) -> Response {
    http::post_json(&envoy.url("/generate"), &json!({"text": text, "sampling_params": {"max_new_tokens": 1}})).unwrap()
}

/// Sends one request; true when a worker served it (200 through the gateway). While a
/// trapped worker-thread VM awaits its reload, its thread answers a JSON 503 that reached no
/// worker, and that is the only other answer allowed.
fn send(envoy: &Envoy, text: &str) -> bool {
    let r = generate(envoy, text);
    match r.status {
        200 => {
            let worker = r.header("x-kvmesh-worker").expect("a served request names its worker");
            assert_eq!(Some(worker), r.header("x-sim-worker"));
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
    let text = http::get(&cp.url("/metrics")).unwrap().text();
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
    prom::value(&http::get(&cp.url("/metrics")).unwrap().text(), "kvmesh_reports_total").unwrap_or(0.0)
}

#[test]
fn a_lease_move_between_vms_counts_every_served_request_once_and_in_flight_returns_to_zero() {
    let sims: Vec<Sim> = (0..3).map(|_| Sim::start(&["--time-scale", "0"]).unwrap()).collect();
    let mut flags = vec!["--worker-urls".to_string()];
    flags.extend(sims.iter().map(Sim::url));
    let cp = ControlPlane::start(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
    opts.use_control_plane(&cp);
    opts.wasm = crash_wasm_path();
    opts.concurrency = 2;
    let mut envoy = Envoy::start(&opts).unwrap();
    wait_until("the first snapshot applied", Duration::from_secs(20), || {
        stat(&envoy, "wasmcustom.kvmesh_snapshot_version") >= 1
    })
    .unwrap();
    // One VM owns the lease: one Watch and one Report stream.
    wait_until("the lease owner's streams", Duration::from_secs(10), || stat(&envoy, CP_STREAMS) >= 2).unwrap();
    let streams_before = stat(&envoy, CP_STREAMS);

    // Before the move: every request served.
    let mut served = 0u64;
    for i in 0..30 {
        assert!(send(&envoy, &format!("before the move {i} {}", "p".repeat(80))), "request {i} before the move");
        served += 1;
    }

    // Two moves: the first owner is usually the main thread's VM (it configures first); the
    // second is then a worker thread's VM, whose thread refuses requests until Envoy reloads it.
    let (mut during, mut refused, mut streams) = (0u64, 0u64, streams_before);
    for mv in 1..=2 {
        // Stop the owner. The order is answered by the filter itself and reaches no worker;
        // the owner traps on its next tick. Nothing else is sent until it did, so no request
        // is in flight on the VM that dies (such a request never reaches `on_log`, so it is
        // never counted as finished; VmLedger only takes back its in-flight count).
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

    // After the move.
    let mut after = 0u64;
    for i in 0..30 {
        if send(&envoy, &format!("after the move {i} {}", "r".repeat(80))) {
            after += 1;
        } else {
            refused += 1;
        }
    }
    served += after;

    // Every served request counted once per worker (what the sims themselves served), and the
    // sum is what the gateway served.
    let per_sim: Vec<u64> = sims.iter().map(|s| s.stats().unwrap()["requests"].as_u64().unwrap()).collect();
    assert_eq!(per_sim.iter().sum::<u64>(), served, "the sims served what the gateway answered 200");
    wait_until("kvmesh-cp to count every served request", Duration::from_secs(15), || {
        cp_counts(&cp, &sims).iter().map(|c| c.0).sum::<u64>() >= served
    })
    .unwrap();
    // A double count would show in a later report: let the new owner report counts twice more
    // (once a second) and check again.
    let reports = cp_reports(&cp);
    wait_until("two more reports", Duration::from_secs(10), || cp_reports(&cp) >= reports + 2.0).unwrap();
    let counted = cp_counts(&cp, &sims);
    eprintln!(
        "served {served} (before 30, during the two moves {during}, after {after}; {refused} refused by a VM \
         awaiting reload); sims {per_sim:?}; kvmesh-cp (requests, in flight) {counted:?}; streams on the \
         control-plane cluster {streams_before} before the moves, {} after; VM reloads {}",
        stat(&envoy, CP_STREAMS),
        stat(&envoy, "wasm.kvmesh.vm_reload_success"),
    );
    assert_eq!(counted.iter().map(|c| c.0).collect::<Vec<_>>(), per_sim, "per worker, counted once");

    // In flight back to 0 everywhere (bounded: a dead VM's count would be taken back after 10 s).
    wait_until("in flight back to 0 in kvmesh-cp and Envoy", Duration::from_secs(30), || {
        cp_counts(&cp, &sims).iter().all(|c| c.1 == 0) && stat(&envoy, "wasmcustom.kvmesh_in_flight") == 0
    })
    .unwrap();
}
