//! The control plane end to end: real `kvmesh-cp`, real Envoys running the filter, real sims.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvmesh_testkit::e2e::{control_plane, gateway, generate, served, sims, sync, FAST};
use kvmesh_testkit::http;
use kvmesh_testkit::{cp_bin, wait_until, ControlPlane, Envoy, EnvoyOptions, Sim};
use serde_json::{json, Value};

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[test]
fn a_prefix_routed_through_one_gateway_sticks_through_the_others() {
    let workers = sims(4, FAST);
    let cp = control_plane(&workers, &[]);
    let (a, b, c) = (gateway(&cp), gateway(&cp), gateway(&cp));
    let mut delays = Vec::new();
    for i in 0..20 {
        let prefix = format!("Conversation {i}. The user is asking about topic {i}. ").repeat(25);
        let first = served(&generate(&a, &format!("{prefix}First question?")));
        let sent = Instant::now();
        // The report reaches the control plane, which pushes a new version to every gateway.
        wait_until("the control plane to merge the insert", Duration::from_secs(10), || {
            cp.holder(&prefix) == Some(format!("http://{first}"))
        })
        .unwrap();
        let v = cp.settled_version().unwrap();
        b.wait_for_version(v);
        c.wait_for_version(v);
        delays.push(sent.elapsed());
        // A fresh prefix lands on the same worker in every gateway by its rendezvous hash alone;
        // a cache hit is what only the shared index gives.
        for (name, g, question) in [("B", &b, "Second"), ("C", &c, "Third")] {
            let hits = g.cache_hits();
            assert_eq!(served(&generate(g, &format!("{prefix}{question} question?"))), first, "gateway {name}, {i}");
            assert_eq!(g.cache_hits(), hits + 1, "gateway {name} found prefix {i} in its index");
        }
    }
    delays.sort();
    eprintln!(
        "propagation gateway A -> control plane -> gateways B and C over {} prefixes: p50 {:?}, p99 {:?}, max {:?}",
        delays.len(),
        quantile(&delays, 0.5),
        quantile(&delays, 0.99),
        delays.last().unwrap()
    );
}

/// The control plane's routing settings, here from its `--config` file, reach the filter as
/// the typed `Snapshot.settings` and win over the plugin configuration's.
#[test]
fn routing_settings_from_the_control_plane_config_file_win_in_the_filter() {
    let workers = sims(3, FAST);
    let dir = kvmesh_testkit::scratch_dir("cp-settings").unwrap();
    let file = dir.path().join("cp.yaml");
    let urls: Vec<String> = workers.iter().map(Sim::url).collect();
    std::fs::write(&file, format!("worker_urls: [{}]\npolicy: round_robin\n", urls.join(", "))).unwrap();
    let cp = ControlPlane::start(&["--config", file.to_str().unwrap()]).unwrap();
    assert_eq!(cp.snapshot().unwrap()["settings"]["policy"], "round_robin");
    // The plugin says cache_aware; one worker thread, so one round-robin counter.
    let mut opts = EnvoyOptions::new(json!({"worker_urls": [], "policy": "cache_aware"})).unwrap();
    opts.use_control_plane(&cp);
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    envoy.wait_for_version(1);
    // Under cache_aware the same long prompt would stick to one worker.
    let text = "The same long prompt, again and again. ".repeat(20);
    let used: HashSet<String> = (0..3).map(|_| served(&generate(&envoy, &text))).collect();
    assert_eq!(used.len(), 3, "round robin from the control plane: {used:?}");
}

/// A prompt of about 1 kB (31 blocks): ten of them make a worker's index far larger than
/// that of a worker that has seen only a few short prompts.
fn long_prompt(tag: &str, i: usize) -> String {
    format!("{tag} {i} {}", "x".repeat(1000))
}

/// A prompt of about 120 bytes (3 blocks).
fn short_prompt(tag: &str, i: usize) -> String {
    format!("{tag} {i} {}", "y".repeat(100))
}

/// How many fresh prompts must all go to the worker with the empty index: by chance, with
/// two workers, they would with probability 2^-14 ≈ 6.1e-5 (the other one holds over 300
/// blocks; 14 short prompts put about 50 on the empty one, which stays the emptiest).
const TO_THE_EMPTIEST: usize = 14;

#[test]
fn remove_worker_and_add_worker_change_where_traffic_goes() {
    let workers = sims(2, FAST);
    let cp = control_plane(&workers, &[]);
    let envoy = gateway(&cp);
    let gone = &workers[0];
    let r = cp.post(&format!("/remove_worker?url={}", gone.url())).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("Successfully removed worker"));
    sync(&cp, &envoy);
    for i in 0..10 {
        assert_ne!(served(&generate(&envoy, &long_prompt("while removed", i))), gone.addr());
    }
    assert_eq!(gone.stats().unwrap()["requests"], 0);

    let r = cp.post(&format!("/add_worker?url={}", gone.url())).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // A worker added through the API is routed once its first health check passed.
    wait_until("the added worker to pass its first health check", Duration::from_secs(10), || {
        cp.worker(&gone.url())["healthy"] == true
    })
    .unwrap();
    // kvmesh-cp sends the table naming it healthy once Envoy's endpoints list it: routable
    // from the first request after the sync.
    sync(&cp, &envoy);
    // Its index is empty, so the next new prefixes go to it.
    for i in 0..TO_THE_EMPTIEST {
        assert_eq!(served(&generate(&envoy, &short_prompt("fresh prompt", i))), gone.addr(), "fresh prompt {i}");
    }
    // Every finished request is counted once, per worker, from the gateway's reports.
    let total = || -> u64 { cp.workers().iter().map(|w| w["requests"].as_u64().unwrap_or(0)).sum() };
    let sent = 10 + TO_THE_EMPTIEST as u64;
    wait_until("the control plane to count every request", Duration::from_secs(10), || total() == sent).unwrap();
    assert!(cp.metrics().contains("sgl_router_requests_total{"));
    let listed = http::get(&cp.url("/list_workers")).unwrap().json().unwrap();
    assert_eq!(listed["urls"].as_array().unwrap().len(), 2);
    assert_eq!(cp.post("/remove_worker?url=http://127.0.0.1:1").unwrap().status, 404);
    assert_eq!(cp.post("/add_worker?url=not-a-url").unwrap().status, 400);
}

#[test]
fn an_unhealthy_worker_leaves_the_snapshot_and_returns() {
    let mut workers = sims(2, FAST);
    let health = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"];
    let cp = control_plane(&workers, &[&health[..], &["--health-success-threshold", "1"]].concat());
    let envoy = gateway(&cp);
    let port = workers[0].port;
    let (addr, url) = (workers[0].addr(), workers[0].url());
    workers[0].proc().kill();
    let healthy = |want: bool| cp.worker(&url)["healthy"] == want;
    wait_until("the control plane to mark the worker unhealthy", Duration::from_secs(15), || healthy(false)).unwrap();
    sync(&cp, &envoy);
    for i in 0..8 {
        assert_ne!(served(&generate(&envoy, &long_prompt("while down", i))), addr);
    }
    workers[0] = Sim::start_on(port, FAST).unwrap();
    wait_until("the control plane to mark the worker healthy again", Duration::from_secs(15), || healthy(true))
        .unwrap();
    sync(&cp, &envoy);
    // Back with an empty index: the fresh prompts go to it.
    for i in 0..TO_THE_EMPTIEST {
        assert_eq!(served(&generate(&envoy, &short_prompt("after", i))), addr, "fresh prompt {i}");
    }
}

#[test]
fn routing_survives_a_control_plane_restart_and_reconverges() {
    let workers = sims(2, FAST);
    let mut cp = control_plane(&workers, &[]);
    let envoy = gateway(&cp);
    let prefix = "A system prompt the gateway has seen before the restart. ".repeat(20);
    let home = served(&generate(&envoy, &format!("{prefix}one")));
    let home_url = Some(format!("http://{home}"));
    wait_until("the control plane to learn the prefix", Duration::from_secs(10), || cp.holder(&prefix) == home_url)
        .unwrap();

    cp.kill();
    // No static workers: only the last snapshot can route these, and its index finds them.
    let hits = envoy.cache_hits();
    for i in 0..6 {
        let w = served(&generate(&envoy, &format!("{prefix}while the control plane is down {i}")));
        assert_eq!(w, home, "the prefix still sticks");
    }
    assert_eq!(envoy.cache_hits(), hits + 6, "each one a cache hit");
    cp.restart().unwrap();
    // The filter reconnects and re-reports what it knows: the fresh control plane learns it.
    wait_until("the gateway to re-report the prefix to the restarted control plane", Duration::from_secs(20), || {
        cp.holder(&prefix) == home_url
    })
    .unwrap();
    envoy.wait_for_version(cp.settled_version().unwrap().max(1));
    // Still in the gateway's index after the new control plane's first snapshot: a cache hit.
    let hits = envoy.cache_hits();
    assert_eq!(served(&generate(&envoy, &format!("{prefix}after the restart"))), home);
    assert_eq!(envoy.cache_hits(), hits + 1, "the prefix is still a cache hit after the restart");
}

/// With a control plane, a filter does not evict on its own (short of a safety cap at twice
/// `max_tree_size`): its index shrinks only by the evictions the control plane pushes.
#[test]
fn eviction_bounds_the_index_in_the_control_plane_and_the_filters() {
    const BLOCK: usize = 32;
    // Blocks per worker: --max-tree-size 320 at 32-byte blocks. One worker, so that the
    // filter's index gauge (all workers' blocks) is that worker's.
    const MAX: u64 = 10;
    let workers = sims(1, FAST);
    let cp =
        control_plane(&workers, &["--max-tree-size", "320", "--block-size", "32", "--eviction-interval-secs", "2"]);
    let envoy = gateway(&cp);
    let filter_blocks = || envoy.filter_stat("kvmesh_index_blocks");
    let evicted = || {
        let metrics = cp.metrics();
        assert!(metrics.contains("# TYPE kvmesh_evicted_blocks counter"), "{metrics}");
        kvmesh_testkit::prom::value(&metrics, "kvmesh_evicted_blocks_total")
            .unwrap_or_else(|| panic!("no kvmesh_evicted_blocks_total: {metrics}"))
    };

    // Fresh prompts of 8 whole blocks each. The first round indexes 16 blocks (over MAX,
    // under the filter's cap of 2 x MAX); should the control plane evict before the filter's
    // peak is seen, a later round adds 8 to the MAX it kept.
    let mut prompts = Vec::new();
    let mut peak = None;
    for round in 0..4 {
        let before = evicted();
        for i in 0..if round == 0 { 2 } else { 1 } {
            let head = format!("round {round} prompt {i}: ");
            prompts.push(format!("{head}{}", "x".repeat(8 * BLOCK - head.len())));
            served(&generate(&envoy, prompts.last().unwrap()));
        }
        wait_until("the filter to index the round, or the control plane to evict", Duration::from_secs(15), || {
            let n = filter_blocks();
            if n > MAX {
                peak = Some(n);
            }
            n > MAX || evicted() > before
        })
        .unwrap();
        if peak.is_some() {
            break;
        }
    }
    let peak = peak.expect("the filter's index grew past max_tree_size before the control plane evicted it");
    assert!(peak <= 2 * MAX, "the filter holds at most its safety cap: {peak}");
    // The newest prompt is a cache hit (and stays the most recently used).
    let before = envoy.cache_hits();
    served(&generate(&envoy, prompts.last().unwrap()));
    assert_eq!(envoy.cache_hits(), before + 1, "a prompt the filter holds is a cache hit");

    wait_until("the control plane to evict down to max_tree_size", Duration::from_secs(15), || {
        cp.snapshot().map(|s| s["index_entries"].as_u64().unwrap_or(u64::MAX) <= MAX).unwrap_or(false)
    })
    .unwrap();
    sync(&cp, &envoy);
    // Each VM writes the gauge with its own index size, so a VM that routed nothing can show a
    // small value too; the routing check below is what shows the evictions were applied.
    wait_until("the control plane's evictions to shrink the filter's index", Duration::from_secs(15), || {
        filter_blocks() <= MAX
    })
    .unwrap_or_else(|e| panic!("{e}: the filter still holds {} blocks", filter_blocks()));
    let n = evicted();
    assert!(n >= (peak - MAX) as f64, "the control plane counted its evictions: {n} (the filter's peak was {peak})");
    // Routing agrees: the least recently used blocks, the oldest prompt's deeper ones, are
    // gone from the filter, so that prompt (at most 2 of its 8 blocks left) is no cache hit.
    let before = envoy.cache_hits();
    served(&generate(&envoy, &prompts[0]));
    assert_eq!(envoy.cache_hits(), before, "the oldest prompt was evicted from the filter's index");
}

#[test]
fn bad_flags_and_config_are_one_line_errors_with_exit_code_2() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(cp_bin()).args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["--cache-threshold", "2"]);
    assert_eq!(code, Some(2));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--cache-threshold"), "{err}");
    let (code, err) = run(&["--policy", "fastest"]);
    assert_eq!((code, err.contains("--policy")), (Some(2), true), "{err}");
    let (code, err) = run(&["--no-such-flag"]);
    assert_eq!((code, err.contains("--no-such-flag")), (Some(2), true), "{err}");
    // Off loopback without a token and API keys: refused before listening.
    let (code, err) = run(&["--host", "0.0.0.0"]);
    assert_eq!((code, err.trim().lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("not a loopback address") && err.contains("--allow-insecure"), "{err}");

    let dir = kvmesh_testkit::scratch_dir("cp-test").unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "worker-urls: [http://127.0.0.1:1]\nbalance-abs-threshold: lots\n").unwrap();
    let (code, err) = run(&["--config", file.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--config") && err.contains("balance-abs-threshold"), "{err}");
    std::fs::write(&file, ": not yaml [").unwrap();
    let (code, err) = run(&["--config", file.to_str().unwrap()]);
    assert_eq!((code, err.trim().lines().count()), (Some(2), 1), "{err}");
    std::fs::write(&file, "polcy: random\n").unwrap();
    let (code, err) = run(&["--config", file.to_str().unwrap()]);
    assert_eq!((code, err.trim().lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("unknown key `polcy`"), "{err}");
    // sglang-router flags kvmesh must refuse name what to use instead.
    let (code, err) = run(&["--jwt-issuer", "https://idp"]);
    assert_eq!((code, err.trim().lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("--jwt-issuer") && err.contains("--control-plane-api-keys"), "{err}");
}

/// A command line written for sglang-router starts kvmesh-cp; the flags that have no effect
/// in kvmesh are named in warnings.
#[test]
fn sglang_router_flags_with_no_effect_start_with_a_warning_each() {
    let workers = sims(1, FAST);
    let flags = ["--port", "30000", "--model-path", "org/model", "--mini-lb", "--retry-jitter-factor", "0.3"];
    let mut cp = control_plane(&workers, &flags);
    wait_until("kvmesh-cp to log its warnings", Duration::from_secs(10), || {
        let log = cp.proc().log_text();
        [
            "--port: No effect",
            "--model-path: No effect",
            "--mini-lb: No effect",
            "--retry-jitter-factor: No effect in kvmesh: Envoy's",
        ]
        .iter()
        .all(|w| log.contains(w))
    })
    .unwrap_or_else(|e| panic!("{e}: {}", cp.proc().log_text()));
    assert_eq!(cp.snapshot().unwrap()["settings"]["retry_jitter_factor"], 0.3, "carried in the settings");
}

/// `message` with the control plane's bearer token in its metadata.
fn authed<T>(cp: &ControlPlane, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let value = format!("Bearer {}", cp.token.as_deref().unwrap());
    request.metadata_mut().insert("authorization", value.parse().unwrap());
    request
}

/// A message whose field 2 is a varint where `ReportBatch` has a list of messages: it does
/// not decode.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(uint64, tag = "2")]
    inserts: u64,
}

#[test]
fn malformed_and_bogus_reports_are_rejected_and_the_control_plane_keeps_serving() {
    use kvmesh_proto::v1::kvmesh_client::KvmeshClient;
    use kvmesh_proto::v1::{IndexInsert, ReportBatch};

    let workers = sims(1, FAST);
    let cp = control_plane(&workers, &[]);
    let endpoint = format!("http://127.0.0.1:{}", cp.grpc_port);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        // Well-formed, but naming a worker the control plane never issued.
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone()).unwrap().connect().await.unwrap();
        let mut client = KvmeshClient::new(channel);
        let bogus = ReportBatch {
            gateway_id: "test".into(),
            inserts: vec![IndexInsert { worker: 999, hashes: vec![1, 2], ..Default::default() }],
            ..Default::default()
        };
        let ack = client.report(authed(&cp, tokio_stream::iter(vec![bogus]))).await.unwrap().into_inner();
        assert_eq!(ack.batches, 1);

        // Bytes that are not a ReportBatch at all.
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone()).unwrap().connect().await.unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/kvmesh.v1.Kvmesh/Report");
        let codec = tonic_prost::ProstCodec::<Garbage, kvmesh_proto::v1::ReportAck>::default();
        let result =
            grpc.client_streaming(authed(&cp, tokio_stream::iter(vec![Garbage { inserts: 7 }])), path, codec).await;
        assert!(result.is_err(), "an undecodable report is refused");
    });
    let bad = cp.metric("kvmesh_bad_reports_total").unwrap_or(0.0);
    assert!(bad >= 2.0, "both rejections are counted: {bad}");
    assert_eq!(cp.snapshot().unwrap()["index_entries"], 0);
    // Still serving: gateways connect and route.
    let envoy = gateway(&cp);
    served(&generate(&envoy, &"still serving ".repeat(20)));
    let status: Value = cp.snapshot().unwrap();
    assert_eq!(status["workers"].as_array().unwrap().len(), 1);
}

/// Adds `authorization: Bearer <token>` to every call, when given a token.
#[derive(Clone)]
struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(a) = &self.0 {
            req.metadata_mut().insert("authorization", a.clone());
        }
        Ok(req)
    }
}

type Client = kvmesh_proto::v1::kvmesh_client::KvmeshClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// A gRPC client of `cp` presenting `token` (call inside a runtime).
fn grpc_client(cp: &ControlPlane, token: Option<&str>) -> Client {
    let endpoint = format!("http://127.0.0.1:{}", cp.grpc_port);
    let channel = tonic::transport::Endpoint::from_shared(endpoint).unwrap().connect_lazy();
    let bearer = Bearer(token.map(|t| format!("Bearer {t}").parse().unwrap()));
    kvmesh_proto::v1::kvmesh_client::KvmeshClient::with_interceptor(channel, bearer)
}

#[test]
fn unauthenticated_streams_and_admin_calls_are_refused_and_authenticated_ones_work() {
    use kvmesh_proto::v1::{ReportBatch, WatchRequest};
    let workers = sims(2, FAST);
    let cp = control_plane(&workers, &[]);
    let token = cp.token.clone().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        for presented in [None, Some("wrong-token"), Some(&token[1..])] {
            let mut client = grpc_client(&cp, presented);
            let watch = client.watch(WatchRequest { gateway_id: "intruder".into() }).await;
            assert_eq!(watch.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated), "{presented:?}");
            let report = ReportBatch { gateway_id: "intruder".into(), ..Default::default() };
            let r = client.report(tokio_stream::iter(vec![report])).await;
            assert_eq!(r.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated), "{presented:?}");
        }
        let mut client = grpc_client(&cp, Some(&token));
        let mut watch = client.watch(WatchRequest { gateway_id: "friend".into() }).await.unwrap().into_inner();
        let full = watch.message().await.unwrap().unwrap();
        assert_eq!(full.workers.len(), 2, "the token opens the topology");
        let report = ReportBatch { gateway_id: "friend".into(), ..Default::default() };
        assert_eq!(client.report(tokio_stream::iter(vec![report])).await.unwrap().into_inner().batches, 1);
    });
    assert!(cp.metric("kvmesh_auth_failures_total").unwrap_or(0.0) >= 6.0);

    // The admin API: changes need the key; reads are open, but for /match (cache contents).
    let add = cp.url(&format!("/add_worker?url=http://127.0.0.1:{}", kvmesh_testkit::free_port().unwrap()));
    for headers in [vec![], vec![("authorization", "Bearer not-the-key")], vec![("authorization", "Basic a2V5")]] {
        let r = http::post(&add, b"", &headers).unwrap();
        assert_eq!(r.status, 401, "{headers:?}: {}", r.text());
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    let r = http::post(&cp.url(&format!("/remove_worker?url={}", workers[0].url())), b"", &[]).unwrap();
    assert_eq!(r.status, 401);
    assert_eq!(http::get(&cp.url("/list_workers")).unwrap().json().unwrap()["urls"].as_array().unwrap().len(), 2);
    for path in ["/workers", "/snapshot", "/metrics", "/health"] {
        assert_eq!(http::get(&cp.url(path)).unwrap().status, 200, "{path} is open");
    }
    assert_eq!(http::post(&cp.url("/match"), b"a prompt", &[]).unwrap().status, 401, "/match needs a key");
    assert!(cp.match_text(b"a prompt").unwrap().is_array());
    let r = cp.post(&format!("/remove_worker?url={}", workers[0].url())).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // A filter with the wrong token gets nothing; with the right one it routes.
    let before = cp.metric("kvmesh_auth_failures_total").unwrap_or(0.0);
    let mut opts = EnvoyOptions::new(json!({"worker_urls": []})).unwrap();
    opts.use_control_plane(&cp);
    opts.control_plane_token = Some("not-the-token".into());
    let outsider = Envoy::start(&opts).unwrap();
    wait_until("kvmesh-cp to refuse the filter's streams", Duration::from_secs(20), || {
        cp.metric("kvmesh_auth_failures_total").unwrap_or(0.0) >= before + 2.0
    })
    .unwrap();
    assert_eq!(outsider.version(), 0, "no snapshot without the token");
    assert_eq!(generate(&outsider, "hello").status, 503, "no workers without the control plane");
    let envoy = gateway(&cp);
    assert_eq!(served(&generate(&envoy, &"authenticated ".repeat(20))), workers[1].addr());
}

/// A table naming a worker healthy goes to the filters only once every Envoy's endpoint
/// discovery acknowledged it (`--eds-wait-ms`): else a filter could pick a worker that Envoy's
/// cluster cannot send to yet. Here an EDS client of its own holds its acknowledgement back.
/// A removed worker leaves the table first, Envoy's endpoints after the same wait.
#[test]
fn a_worker_reaches_the_filters_after_envoys_endpoints_and_leaves_them_before() {
    use kvmesh_proto::eds::endpoint_discovery_service_client::EndpointDiscoveryServiceClient as Eds;
    use kvmesh_proto::eds::{ClusterLoadAssignment, DiscoveryRequest, DiscoveryResponse, HealthStatus};
    use kvmesh_proto::v1::{Snapshot, WatchRequest};
    use kvmesh_proto::{Message, CLUSTER_LOAD_ASSIGNMENT};
    use tokio_stream::StreamExt;
    let workers = sims(1, FAST);
    let cp = control_plane(&workers, &["--health-check-interval-secs", "1", "--eds-wait-ms", "60000"]);
    let port = kvmesh_testkit::free_port().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    assert_eq!(cp.post(&format!("/add_worker?url={url}")).unwrap().status, 200, "added, unhealthy until probed");
    // The endpoints' ports, each with whether it is listed healthy.
    let ports = |r: &DiscoveryResponse| -> Vec<(u32, bool)> {
        let cla = ClusterLoadAssignment::decode(r.resources[0].value.as_slice()).unwrap();
        let port = |e: &kvmesh_proto::eds::LbEndpoint| {
            e.endpoint.as_ref().unwrap().address.as_ref().unwrap().socket_address.as_ref().unwrap().port_value
        };
        cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| (port(e), e.health_status == HealthStatus::Healthy as i32))
            .collect()
    };
    let lists_it = |r: &DiscoveryResponse| ports(r).contains(&(u32::from(port), true));
    let names_it = |s: &Snapshot| s.workers.iter().any(|w| w.url == url && w.healthy);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let token = cp.token.clone().unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", cp.grpc_port))
            .unwrap()
            .connect_lazy();
        let mut eds = Eds::with_interceptor(channel, Bearer(Some(format!("Bearer {token}").parse().unwrap())));
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let request = |nonce: &str| DiscoveryRequest {
            type_url: CLUSTER_LOAD_ASSIGNMENT.into(),
            resource_names: vec!["kvmesh_workers".into()],
            response_nonce: nonce.into(),
            ..Default::default()
        };
        tx.send(request("")).await.unwrap();
        let mut assignments =
            eds.stream_endpoints(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        let first = assignments.next().await.unwrap().unwrap();
        assert!(!lists_it(&first));
        tx.send(request(&first.nonce)).await.unwrap();
        let mut watch = grpc_client(&cp, Some(&token))
            .watch(WatchRequest { gateway_id: "g".into() })
            .await
            .unwrap()
            .into_inner()
            .map(Result::unwrap);
        let _late = Sim::start_on(port, FAST).unwrap();
        let healed = loop {
            let r = assignments.next().await.unwrap().unwrap();
            if lists_it(&r) {
                break r;
            }
            tx.send(request(&r.nonce)).await.unwrap();
        };
        // EDS lists it healthy, unacknowledged: kvmesh-cp holds the table naming it (its gauge
        // says so), and no table received so far (a zero timeout: none waited for) names it.
        let held = || cp.metric("kvmesh_tables_held_for_endpoints").is_some_and(|n| n >= 1.0);
        wait_until("the table held for Envoy's ack", Duration::from_secs(10), held).unwrap();
        while let Ok(Some(s)) = tokio::time::timeout(Duration::ZERO, watch.next()).await {
            assert!(!names_it(&s), "a table named the worker before Envoy's endpoints did: {s:?}");
        }
        tx.send(request(&healed.nonce)).await.unwrap();
        let acked = table_where(&mut watch, Duration::from_secs(10), names_it).await;
        assert!(acked.is_some(), "the table after Envoy acknowledged the endpoint");
        // Removed: the table drops it at once, Envoy's endpoints after the wait (a filter on the old table may name it).
        assert_eq!(cp.post(&format!("/remove_worker?url={url}")).unwrap().status, 200);
        let without = |s: &Snapshot| s.workers_changed && !s.workers.iter().any(|w| w.url == url);
        assert!(table_where(&mut watch, Duration::from_secs(10), without).await.is_some());
        // The next endpoints Envoy gets (another worker added, listed unhealthy) still list it.
        let other_port = kvmesh_testkit::free_port().unwrap();
        assert_eq!(cp.post(&format!("/add_worker?url=http://127.0.0.1:{other_port}")).unwrap().status, 200);
        let next = loop {
            let r = tokio::time::timeout(Duration::from_secs(10), assignments.next()).await.unwrap().unwrap().unwrap();
            tx.send(request(&r.nonce)).await.unwrap();
            let listed: Vec<u32> = ports(&r).into_iter().map(|(p, _)| p).collect();
            if listed.contains(&u32::from(other_port)) {
                break listed;
            }
        };
        assert!(next.contains(&u32::from(port)), "Envoy's endpoints changed with the table: {next:?}");
    });
}

/// The next snapshot from `watch`, within `limit`, for which `pred` holds.
async fn table_where(
    watch: &mut (impl tokio_stream::Stream<Item = kvmesh_proto::v1::Snapshot> + Unpin),
    limit: Duration,
    pred: impl Fn(&kvmesh_proto::v1::Snapshot) -> bool,
) -> Option<kvmesh_proto::v1::Snapshot> {
    use tokio_stream::StreamExt;
    let found = async {
        while let Some(s) = watch.next().await {
            if pred(&s) {
                return Some(s);
            }
        }
        None
    };
    tokio::time::timeout(limit, found).await.ok().flatten()
}

#[test]
fn a_worker_added_through_the_api_gets_no_traffic_until_its_health_check_passes() {
    let workers = sims(1, FAST);
    let cp = control_plane(&workers, &["--health-check-interval-secs", "1", "--health-success-threshold", "3"]);
    let envoy = gateway(&cp);
    // Addresses that are no worker are refused, whoever asks.
    for url in [
        "http://169.254.169.254:80",
        "http://0.0.0.0:9901",
        "http://[::]:9901",
        "http://[fe80::1]:80",
        "https://127.0.0.1:443",
        "file:///etc/passwd",
    ] {
        let r = cp.post(&format!("/add_worker?url={url}")).unwrap();
        assert_eq!(r.status, 400, "{url}: {}", r.text());
    }
    // Nothing listens on the new worker's port yet.
    let port = kvmesh_testkit::free_port().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let r = cp.post(&format!("/add_worker?url={url}")).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let health = || cp.worker(&url)["healthy"].as_bool();
    assert_eq!(health(), Some(false), "unhealthy until probed");
    sync(&cp, &envoy);
    // Fresh prompts would go to the worker with the smallest index, the new one, if it were
    // routable: every one lands on the old worker.
    for i in 0..10 {
        assert_eq!(served(&generate(&envoy, &long_prompt("before the probe", i))), workers[0].addr());
    }
    let late = Sim::start_on(port, FAST).unwrap();
    wait_until("the new worker to pass its first health check", Duration::from_secs(15), || health() == Some(true))
        .unwrap();
    sync(&cp, &envoy);
    // Routable now, with the empty index: the fresh prompts go to it.
    for i in 0..TO_THE_EMPTIEST {
        assert_eq!(served(&generate(&envoy, &short_prompt("after the probe", i))), late.addr(), "fresh prompt {i}");
    }
}

#[test]
fn oversize_and_flood_reports_are_refused_or_throttled_and_rss_stays_flat() {
    use kvmesh_proto::v1::{IndexInsert, ReportBatch};
    const MAX_ENTRIES: u64 = 100_000;
    let workers = sims(2, FAST);
    let mut flags: Vec<String> = Vec::new();
    // Capacities far above the flood: only the index bounds under test evict (the sims' own
    // capacity, learned at some point during the flood, would evict too, at a moment of its own).
    for w in &workers {
        flags.extend(["--worker-kv-capacity".to_string(), format!("{}=1000000000", w.url())]);
    }
    flags.extend(
        [
            "--max-index-entries",
            "100000",
            "--max-inserts-per-sec",
            "100000",
            "--max-message-bytes",
            "1048576",
            "--eviction-interval-secs",
            "3600",
        ]
        .map(String::from),
    );
    let cp = control_plane(&workers, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    let token = cp.token.clone().unwrap();
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut batch = |gateway: &str, n: usize| {
        let hashes = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                seed ^ (seed >> 29)
            })
            .collect();
        ReportBatch {
            gateway_id: gateway.into(),
            inserts: vec![IndexInsert { worker: 0, hashes, ..Default::default() }],
            ..Default::default()
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut client = rt.block_on(async { grpc_client(&cp, Some(&token)) });
    // Oversize: 200,000 hashes (1.6 MB) in one message; a 10 kB gateway id.
    let big = batch("big", 200_000);
    let r = rt.block_on(client.report(tokio_stream::iter(vec![big])));
    assert!(
        matches!(r.as_ref().err().map(|s| s.code()), Some(tonic::Code::OutOfRange | tonic::Code::ResourceExhausted)),
        "{r:?}"
    );
    let r = rt.block_on(client.report(tokio_stream::iter(vec![batch(&"g".repeat(10_000), 1)])));
    assert_eq!(r.err().map(|s| s.code()), Some(tonic::Code::InvalidArgument));
    assert_eq!(cp.snapshot().unwrap()["index_entries"], 0);

    // Flood: gateways each sending 8 x 100,000 hashes (800 kB messages, under the limit).
    let mut flood = |gateways: std::ops::Range<u32>| {
        for g in gateways {
            let batches: Vec<ReportBatch> = (0..8).map(|_| batch(&format!("flood-{g}"), 100_000)).collect();
            let ack = rt.block_on(client.report(tokio_stream::iter(batches))).unwrap().into_inner();
            assert_eq!(ack.batches, 8);
        }
    };
    flood(0..2);
    let start = cp.rss_kib().unwrap();
    flood(2..12);
    let end = cp.rss_kib().unwrap();
    let snapshot = cp.snapshot().unwrap();
    let entries = snapshot["index_entries"].as_u64().unwrap();
    let dropped = cp.metric("kvmesh_dropped_inserts_total").unwrap_or(0.0);
    let evicted = cp.metric("kvmesh_evicted_blocks_total").unwrap_or(0.0);
    eprintln!(
        "kvmesh-cp RSS under a report flood of 9.6M hashes from 12 gateways: start {} MiB, end {} MiB; \
         index entries {entries}, dropped {dropped}, evicted {evicted}",
        start / 1024,
        end / 1024
    );
    assert!(entries <= MAX_ENTRIES + MAX_ENTRIES / 8, "the index stays bounded: {entries}");
    // Each gateway's bucket holds 400,000 hashes (and refills 100,000 a second): about half of
    // its 800,000 are dropped.
    assert!(dropped >= 12.0 * 200_000.0, "the rate limit dropped hashes: {dropped}");
    assert!(evicted >= 1_000_000.0, "the bound evicted on insert: {evicted}");
    assert!(end <= start + 64 * 1024, "RSS stays flat: {start} KiB -> {end} KiB");
    // Still serving; a gateway that connects now gets the index, over 65536 hashes, in several
    // messages, and applies them all.
    let envoy = gateway(&cp);
    served(&generate(&envoy, &"after the flood ".repeat(20)));
    wait_until("the gateway to apply every part of the full snapshot", Duration::from_secs(20), || {
        envoy.filter_stat("kvmesh_index_blocks") >= entries
    })
    .unwrap_or_else(|e| panic!("{e}: {} of {entries}", envoy.filter_stat("kvmesh_index_blocks")));
}

/// `--state-file`: a restarted control plane has the workers added through the API again,
/// under the same ids, and a prefix routed before the restart goes to the same worker after.
#[test]
fn a_restarted_control_plane_keeps_api_workers_and_their_ids_and_prefixes_stay_put() {
    let workers = sims(2, FAST);
    let dir = kvmesh_testkit::scratch_dir("cp-state-e2e").unwrap();
    let file = dir.path().join("state.json");
    let first = workers[0].url();
    let flags = ["--worker-urls", &first, "--state-file", file.to_str().unwrap(), "--health-check-interval-secs", "1"];
    let mut cp = ControlPlane::start(&flags).unwrap();
    let envoy = gateway(&cp);
    // The static worker indexes something first, so that a fresh prefix prefers the added one:
    // 50 blocks, more than half of the fresh prefix's 32 (a worker within half a prefix of the
    // emptiest would count as equally empty, and the prefix's hash would choose).
    assert_eq!(served(&generate(&envoy, &"warm-up ".repeat(200))), workers[0].addr());
    let r = cp.post(&format!("/add_worker?url={}", workers[1].url())).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = |cp: &ControlPlane| -> Vec<(String, u64, bool)> {
        let mut out: Vec<(String, u64, bool)> = cp
            .workers()
            .iter()
            .map(|w| (w["url"].as_str().unwrap().to_string(), w["id"].as_u64().unwrap(), w["healthy"] == true))
            .collect();
        out.sort();
        out
    };
    wait_until("the added worker to be probed healthy", Duration::from_secs(10), || {
        listed(&cp).iter().all(|w| w.2) && listed(&cp).len() == 2
    })
    .unwrap();
    sync(&cp, &envoy);
    let before = listed(&cp);
    let prefix = "A conversation the added worker holds in its cache. ".repeat(20);
    let home = served(&generate(&envoy, &format!("{prefix}before")));
    assert_eq!(home, workers[1].addr(), "a fresh prefix goes to the worker with the smallest index");
    wait_until("the control plane to learn the prefix", Duration::from_secs(10), || {
        cp.holder(&prefix) == Some(workers[1].url())
    })
    .unwrap();

    cp.restart().unwrap();
    wait_until("the restarted control plane to list the same workers, ids and health", Duration::from_secs(20), || {
        listed(&cp) == before
    })
    .unwrap_or_else(|e| panic!("{e}: {:?} (before: {before:?})", listed(&cp)));
    // The filter re-reports its index once it applied the new table: under the same ids.
    wait_until("the gateway to re-report the prefix", Duration::from_secs(20), || {
        cp.holder(&prefix) == Some(workers[1].url())
    })
    .unwrap();
    sync(&cp, &envoy);
    // Found in the gateway's index under the same worker id: a cache hit at the same worker
    // (a fresh placement would choose between the two by the prefix's hash alone).
    let hits = envoy.cache_hits();
    assert_eq!(served(&generate(&envoy, &format!("{prefix}after the restart"))), home);
    assert_eq!(envoy.cache_hits(), hits + 1, "the prefix is a cache hit after the restart");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(state["api_workers"][0]["url"], workers[1].url(), "{state}");
}

#[test]
fn flush_cache_fans_out_to_every_worker_and_empties_every_index() {
    let workers = sims(2, FAST);
    let cp = control_plane(&workers, &[]);
    let envoy = gateway(&cp);
    let prefix = "A long system prompt that every request shares. ".repeat(20);
    served(&generate(&envoy, &format!("{prefix}one")));
    let again = served(&generate(&envoy, &format!("{prefix}two")));
    // What each worker's prefix cache holds.
    let cached_tokens = |addr: &str| -> u64 {
        let stats = http::get(&format!("http://{addr}/sim/stats")).unwrap().json().unwrap();
        stats["cache_tokens"].as_u64().unwrap_or(0)
    };
    assert!(cached_tokens(&again) > 0, "the worker holds the prefix");
    wait_until("the control plane to index the prefix", Duration::from_secs(10), || {
        cp.snapshot().is_ok_and(|s| s["index_entries"].as_u64().unwrap_or(0) > 0)
    })
    .unwrap();

    // Not without an admin key: worker administration is the control plane's, and guarded.
    let anonymous = http::post(&cp.url("/flush_cache"), b"", &[]).unwrap();
    assert_eq!(anonymous.status, 401, "{}", anonymous.text());
    assert!(cached_tokens(&again) > 0);

    let r = cp.post("/flush_cache").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json().unwrap();
    assert_eq!(body["workers"].as_array().map(Vec::len), Some(2), "{body}");
    assert!(body["workers"].as_array().unwrap().iter().all(|w| w["ok"] == true), "{body}");
    for w in &workers {
        assert_eq!(cached_tokens(&w.addr()), 0, "{} was flushed", w.addr());
    }
    assert_eq!(cp.snapshot().unwrap()["index_entries"], 0, "the global index forgot too");
    // And the filter: the next request with the prefix is no cache hit in the gateway's eyes.
    sync(&cp, &envoy);
    let before = envoy.cache_hits();
    served(&generate(&envoy, &format!("{prefix}three")));
    assert_eq!(envoy.cache_hits(), before, "the filter's index forgot the flushed prefix");
}
