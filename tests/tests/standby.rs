//! Two kvmesh-cp replicas with `--leader-elect` on a `coordination.k8s.io/v1` Lease of the
//! in-process API server (get, create, and replace guarded by resourceVersion), both
//! discovering the workers from its pods; one Envoy whose control-plane cluster lists both
//! and health-checks their `/ready`, as a Service with kvmesh-cp's readiness probe would.
//! The leader serves the gateway, the standby refuses it and is not ready; the leader is
//! SIGKILLed under load: the standby takes the Lease over within the lease duration, the
//! gateway reconnects to it and re-reports its index, and no request fails meanwhile. The
//! killed replica comes back as the standby and the leader gets SIGTERM: it releases the
//! Lease and exits 0, and the standby takes over at once. Last, the Lease is handed to the
//! standby behind the live leader's back: the leader steps down without exiting, and the
//! gateway's streams move all the same. `cargo xtask test` runs it on the native build too
//! (its own connection, through a loopback link into Envoy's control-plane cluster).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{generate, served, sync, FAST};
use kvmesh_testkit::kube_fake::{pod, FakeKube};
use kvmesh_testkit::{free_port, http, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::json;

const NS: &str = "default";
const LEASE: &str = "kvmesh-cp";
/// The Lease's timings: a standby takes over 2 s after it last saw the leader renew.
const LEASE_SECS: f64 = 2.0;

fn replica(kube: &FakeKube, port: u16, identity: &str, like: Option<&ControlPlane>) -> ControlPlane {
    let kubeconfig = kube.kubeconfig().unwrap();
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    let args: Vec<String> = match like {
        // The first replica's flags, its credentials included, under another identity.
        Some(cp) => {
            let mut args = cp.args().to_vec();
            let at = args.iter().position(|a| a == "--leader-elect-identity").unwrap() + 1;
            args[at] = identity.to_string();
            args
        }
        None => {
            let port = port.to_string();
            let lease = LEASE_SECS.to_string();
            [
                "--service-discovery",
                "--service-discovery-namespace",
                NS,
                "--selector",
                "app=sglang",
                "--service-discovery-port",
                &port,
                "--leader-elect",
                "--leader-elect-identity",
                identity,
                "--leader-elect-lease-duration-secs",
                &lease,
                "--leader-elect-renew-deadline-secs",
                "1.5",
                "--leader-elect-retry-period-secs",
                "0.25",
            ]
            .map(String::from)
            .to_vec()
        }
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ControlPlane::start_with_env(free_port().unwrap(), free_port().unwrap(), &args, &env).unwrap()
}

/// `/ready`'s status (0: no answer).
fn ready(cp: &ControlPlane) -> u16 {
    http::get(&cp.url("/ready")).map(|r| r.status).unwrap_or(0)
}

fn reports(cp: &ControlPlane) -> f64 {
    cp.metric("kvmesh_reports_total").unwrap_or(0.0)
}

/// What the load saw: `(when, status or 0 for no answer, worker)`.
type Seen = Arc<Mutex<Vec<(Instant, u16, String)>>>;

fn load(envoy: &Envoy, texts: &[String], stop: &Arc<AtomicBool>, seen: &Seen) -> Vec<std::thread::JoinHandle<()>> {
    (0..3)
        .map(|t| {
            let (url, texts, stop, seen) = (envoy.url("/generate"), texts.to_vec(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut n = t;
                while !stop.load(Ordering::Relaxed) {
                    let text = format!("{} load {n}", texts[n % texts.len()]);
                    let body = json!({"text": text, "sampling_params": {"max_new_tokens": 1}});
                    let (status, worker) = match http::post_json(&url, &body) {
                        Ok(r) => (r.status, r.header("x-kvmesh-worker").unwrap_or_default().to_string()),
                        Err(_) => (0, String::new()),
                    };
                    seen.lock().unwrap().push((Instant::now(), status, worker));
                    n += 3;
                }
            })
        })
        .collect()
}

/// `texts` routed to `first` (workers) are where `cp` says they are: the gateway reported them.
fn knows(cp: &ControlPlane, texts: &[String], first: &[String]) -> bool {
    texts.iter().zip(first).all(|(t, w)| cp.holder(t).as_deref() == Some(&format!("http://{w}")))
}

#[test]
fn the_standby_takes_over_a_killed_or_terminated_leader_under_load_and_no_request_fails() {
    let kube = FakeKube::start().unwrap();
    let port = free_port().unwrap();
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let _sims: Vec<Sim> = ips.iter().map(|ip| Sim::start_at(ip, port, FAST).unwrap()).collect();
    for (i, ip) in ips.iter().enumerate() {
        kube.apply(pod(NS, &format!("w{i}"), ip, true, &[("app", "sglang")], &[]));
    }
    let mut a = replica(&kube, port, "cp-a", None);
    wait_until("cp-a to hold the Lease", Duration::from_secs(10), || {
        kube.leases.holder(NS, LEASE).as_deref() == Some("cp-a")
    })
    .unwrap();
    let mut b = replica(&kube, port, "cp-b", Some(&a));
    wait_until("both replicas to discover the three workers", Duration::from_secs(10), || {
        a.workers().len() == 3 && b.workers().len() == 3
    })
    .unwrap();
    assert_eq!((ready(&a), ready(&b)), (200, 503), "the leader is ready, the standby is not");

    let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
    opts.use_control_plane_replicas(&[&a, &b]);
    let envoy = Envoy::start(&opts).unwrap();
    sync(&a, &envoy);

    // Prefixes routed and reported to the leader before the kill.
    let texts: Vec<String> = (0..8).map(|i| format!("conversation {i}: {}", "shared context ".repeat(40))).collect();
    let first: Vec<String> = texts.iter().map(|t| served(&generate(&envoy, t))).collect();
    wait_until("the leader to learn the prefixes", Duration::from_secs(10), || knows(&a, &texts, &first)).unwrap();
    assert_eq!(reports(&b), 0.0, "the standby refuses the gateway's streams");
    assert_eq!(kube.leases.holder(NS, LEASE).as_deref(), Some("cp-a"));

    let stop = Arc::new(AtomicBool::new(false));
    let seen: Seen = Arc::default();
    let threads = load(&envoy, &texts, &stop, &seen);
    let count = |seen: &Seen| seen.lock().unwrap().len();
    wait_until("load before the kill", Duration::from_secs(10), || count(&seen) >= 30).unwrap();

    // SIGKILL: the Lease runs out, the standby takes it over.
    a.kill();
    let killed = Instant::now();
    wait_until("the standby to lead", Duration::from_secs_f64(LEASE_SECS + 3.0), || ready(&b) == 200).unwrap();
    let took_over = killed.elapsed();
    assert_eq!(kube.leases.holder(NS, LEASE).as_deref(), Some("cp-b"));
    // The full report on reconnect: the new leader knows where the old prefixes are. The
    // filter reconnects after its backoff (up to 1 s; a cold CI run once needed more than 10 s
    // when it was 5 s).
    wait_until("the gateway's index on the new leader", Duration::from_secs(20), || knows(&b, &texts, &first)).unwrap();
    let reported = killed.elapsed();

    // The killed replica comes back as the standby; then SIGTERM on the leader: it stops
    // serving, gives the Lease up and exits 0, and the standby takes over on its next round
    // instead of after the lease duration.
    a.restart().unwrap();
    wait_until("the restarted replica to stand by with the workers", Duration::from_secs(10), || {
        a.workers().len() == 3 && ready(&a) == 503
    })
    .unwrap();
    let after = count(&seen);
    wait_until("load before the SIGTERM", Duration::from_secs(10), || count(&seen) >= after + 30).unwrap();
    let terminated = Instant::now();
    let status = b.proc().terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "kvmesh-cp exits 0 on SIGTERM: {status}");
    assert!(b.proc().log_text().contains("released the Lease"), "{}", b.proc().log_tail());
    wait_until("the standby to lead after the release", Duration::from_secs_f64(LEASE_SECS), || ready(&a) == 200)
        .unwrap();
    let handed_over = terminated.elapsed();
    assert_eq!(kube.leases.holder(NS, LEASE).as_deref(), Some("cp-a"));
    wait_until("the gateway's index on cp-a again", Duration::from_secs(10), || knows(&a, &texts, &first)).unwrap();
    let re_reported = terminated.elapsed();

    // A leader that loses the Lease without exiting (it could not renew: here the Lease is
    // handed to the standby) stops serving but keeps its connections: the gateway's streams
    // must move to the new leader all the same (the native build opens a new connection).
    b.restart().unwrap();
    wait_until("cp-b to stand by again", Duration::from_secs(10), || b.workers().len() == 3 && ready(&b) == 503)
        .unwrap();
    kube.leases.hand_to(NS, LEASE, "cp-b");
    let handed = Instant::now();
    wait_until("cp-a to step down", Duration::from_secs(5), || ready(&a) == 503 && ready(&b) == 200).unwrap();
    wait_until("the gateway's index on cp-b", Duration::from_secs(10), || knows(&b, &texts, &first)).unwrap();
    let stepped_down = handed.elapsed();

    let after = count(&seen);
    wait_until("load after the takeovers", Duration::from_secs(10), || count(&seen) >= after + 30).unwrap();
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().unwrap());

    let seen = seen.lock().unwrap();
    let failed: Vec<_> = seen.iter().filter(|(_, status, _)| *status != 200).collect();
    let during = seen.iter().filter(|(at, ..)| *at >= killed && *at <= killed + took_over).count();
    eprintln!(
        "SIGKILL: the standby led {:.2} s after the kill (lease {LEASE_SECS} s) and held the gateway's index at \
         {:.2} s; SIGTERM: the standby led {:.2} s after it and held the index at {:.2} s; a leader that \
         lost the Lease alive: the index on the new one at {:.2} s; {} requests, {during} while no replica \
         led, {} failed",
        took_over.as_secs_f64(),
        reported.as_secs_f64(),
        handed_over.as_secs_f64(),
        re_reported.as_secs_f64(),
        stepped_down.as_secs_f64(),
        seen.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "{} requests failed: {:?}", failed.len(), &failed[..failed.len().min(5)]);
    assert!(during > 0, "requests were served while no replica led");
    // Released, the Lease went from cp-b to nobody to cp-a: the standby took the released
    // record (that it takes one at once, not when it would have run out, is elector.rs's
    // `a_released_lease_is_taken_at_once`).
    let holders = kube.leases.holders(NS, LEASE);
    assert!(holders.windows(3).any(|w| w == ["cp-b", "", "cp-a"]), "the Lease's holders: {holders:?}");
    drop(seen);

    // Every prefix routed before the kill still goes where it went.
    sync(&b, &envoy);
    for (t, w) in texts.iter().zip(&first) {
        assert_eq!(&served(&generate(&envoy, t)), w, "{t:.20}… moved");
    }
}
