//! The scale suite's control-plane part: the control plane's memory with 10^6 index entries, and the size
//! of the full snapshot a gateway receives on connect.

use std::time::{Duration, Instant};

use kvmesh_proto::v1::kvmesh_client::KvmeshClient;
use kvmesh_proto::v1::{IndexInsert, ReportBatch, WatchRequest};
use kvmesh_testkit::{http, wait_until, ControlPlane, Envoy, EnvoyOptions};
use prost::Message;

use crate::tools::step;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:")?.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// SplitMix64's finaliser.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The control plane at 10^6 entries, then the gateway on it (`gateway_at_scale`) once per
/// round for this build and, with `--baseline-wasm`, for that one, interleaved.
pub fn run(o: &super::Opts) -> anyhow::Result<serde_json::Value> {
    const ENTRIES: u64 = 1_000_000;
    const WORKERS: u64 = 64;
    let workers: Vec<String> =
        (0..WORKERS).map(|i| format!("http://127.0.{}.{}:30000", 100 + i / 200, 1 + i % 200)).collect();
    let mut args = vec!["--worker-urls".to_string()];
    args.extend(workers);
    // Workers are not running here: keep health checks from marking them down during the run.
    args.extend(["--health-check-interval-secs", "3600", "--load-poll-interval-ms", "3600000"].map(String::from));
    // The gateway measured below sends requests to these absent workers: their refused
    // connections must not take them out of the decisions being timed.
    args.extend(["--disable-circuit-breaker", "--disable-retries"].map(String::from));
    let mut cp = ControlPlane::start(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    let pid = cp.proc().pid();
    let before = rss_kib(pid);
    step(&format!("reporting {ENTRIES} index entries over {WORKERS} workers"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let endpoint = format!("http://127.0.0.1:{}", cp.grpc_port);
    let token = cp.token.clone();
    let mut client = rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(endpoint)?.connect().await?;
        let authorization: tonic::metadata::MetadataValue<_> =
            format!("Bearer {}", token.as_deref().unwrap_or_default()).parse()?;
        let client = KvmeshClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
            req.metadata_mut().insert("authorization", authorization.clone());
            Ok(req)
        })
        .max_decoding_message_size(1 << 30);
        anyhow::Ok(client)
    })?;
    // Prefixes of 50 blocks, as chained hashes would give.
    let batches: Vec<ReportBatch> = (0..ENTRIES / 50_000)
        .map(|b| ReportBatch {
            gateway_id: "bench".into(),
            inserts: (0..1000u64)
                .map(|p| IndexInsert {
                    worker: ((b * 1000 + p) % WORKERS) as u32,
                    // Uniformly spread 64-bit values, like xxh3 block hashes.
                    hashes: (0..50).map(|i| mix((b << 40) ^ (p << 16) ^ i)).collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    rt.block_on(client.report(tokio_stream::iter(batches)))?;
    // The full snapshot is measured once the control plane holds every entry (the report
    // stream returning does not mean its batches are merged).
    wait_until("the control plane to merge the reports", Duration::from_secs(60), || {
        cp.snapshot().map(|s| s["index_entries"].as_u64().unwrap_or(0) >= ENTRIES).unwrap_or(false)
    })?;
    let (full_bytes, full_time) = rt.block_on(async {
        let started = Instant::now();
        // Another gateway's view: the control plane leaves a gateway's own inserts out of what
        // it sends that gateway.
        let mut watch = client.watch(WatchRequest { gateway_id: "bench-watcher".into() }).await?.into_inner();
        // The full snapshot arrives as a full message and deltas of the same version carrying
        // the rest of the hashes (512 KiB each): all of them are the snapshot.
        let full = watch.message().await?.ok_or_else(|| anyhow::anyhow!("no snapshot"))?;
        let hashes = |s: &kvmesh_proto::v1::Snapshot| s.inserts.iter().map(|i| i.hashes.len() as u64).sum::<u64>();
        let (version, mut bytes, mut got) = (full.version, full.encoded_len(), hashes(&full));
        while got < ENTRIES {
            let next = tokio::time::timeout(Duration::from_secs(30), watch.message()).await??;
            let Some(part) = next.filter(|p| p.version == version && !p.full) else { break };
            bytes += part.encoded_len();
            got += hashes(&part);
        }
        anyhow::ensure!(got >= ENTRIES, "the full snapshot carried {got} of {ENTRIES} hashes");
        anyhow::Ok((bytes, started.elapsed()))
    })?;
    let after = rss_kib(pid);
    let snapshot = cp.snapshot()?;
    let this = kvmesh_testkit::wasm_path();
    let mut rounds: Vec<serde_json::Value> = Vec::new();
    let mut baseline_rounds: Vec<serde_json::Value> = Vec::new();
    for round in 0..o.rounds {
        if o.rounds > 1 {
            step(&format!("round {} of {}", round + 1, o.rounds));
        }
        rounds.push(gateway_at_scale(&cp, &args, ENTRIES, &this)?);
        if let Some(wasm) = &o.baseline_wasm {
            baseline_rounds.push(gateway_at_scale(&cp, &args, ENTRIES, wasm)?);
        }
    }
    Ok(serde_json::json!({
        "gateway": median_round(&rounds),
        "gateway_rounds": rounds,
        "baseline_wasm": o.baseline_wasm.as_ref().map(|p| p.display().to_string()),
        "baseline_gateway": if baseline_rounds.is_empty() { serde_json::Value::Null } else { median_round(&baseline_rounds) },
        "baseline_gateway_rounds": baseline_rounds,
        "workers": WORKERS,
        "index_entries": snapshot["index_entries"],
        "rss_before_mib": before as f64 / 1024.0,
        "rss_after_mib": after as f64 / 1024.0,
        "snapshot_mib": full_bytes as f64 / (1 << 20) as f64,
        "snapshot_ms": full_time.as_secs_f64() * 1e3,
    }))
}

/// The rounds' medians, field by field (numbers only; the rest from the first round).
fn median_round(rounds: &[serde_json::Value]) -> serde_json::Value {
    let mut out = rounds.first().cloned().unwrap_or(serde_json::Value::Null);
    if let Some(obj) = out.as_object_mut() {
        for (k, v) in obj.iter_mut() {
            let mut xs: Vec<f64> = rounds.iter().filter_map(|r| r[k.as_str()].as_f64()).collect();
            if xs.len() == rounds.len() && v.is_number() {
                xs.sort_by(f64::total_cmp);
                *v = serde_json::json!(xs.get(xs.len() / 2));
            }
        }
    }
    out
}

/// A wasm custom stat's computed quantiles (Envoy's `/stats?format=json`), cumulative, by
/// quantile in percent.
fn quantiles(envoy: &Envoy, name: &str) -> Vec<(f64, Option<f64>)> {
    quantiles_at(&envoy.admin_url(""), name)
}

/// The decision count on a `/stats/prometheus` line: `kvmesh_route_decision_ns_count` (the
/// `.wasm`'s) or with Envoy's `envoy_wasmcustom_` prefix (the native build's).
fn decision_count(line: &str) -> Option<u64> {
    let rest = line.strip_prefix("envoy_wasmcustom_").unwrap_or(line);
    rest.strip_prefix("kvmesh_route_decision_ns_count")?.split_whitespace().last()?.parse::<u64>().ok()
}

/// The filter's decision time inside the Envoy whose admin is at `admin` (its base URL), in
/// µs, `(p50, p99)`, once Envoy's histogram holds at least `requests` decisions (it merges
/// them on its stats flush, every 5 s; none after 8 s: what it holds then).
pub fn decision_us(admin: &str, requests: u64) -> Option<(f64, f64)> {
    let counted = || {
        let text = http::get(&format!("{admin}/stats/prometheus")).map(|r| r.text()).unwrap_or_default();
        text.lines().find_map(decision_count).unwrap_or(0)
    };
    let _ = wait_until("Envoy to merge the decision histogram", Duration::from_secs(8), || counted() >= requests);
    let q = quantiles_at(admin, "kvmesh_route_decision_ns");
    let at = |p: f64| q.iter().find(|(k, _)| (k - p).abs() < 1e-9).and_then(|(_, v)| *v).map(|ns| ns / 1e3);
    Some((at(50.0)?, at(99.0)?))
}

fn quantiles_at(admin: &str, name: &str) -> Vec<(f64, Option<f64>)> {
    let url = format!("{admin}/stats?format=json&filter={name}");
    let Ok(doc) = http::get(&url).and_then(|r| Ok(serde_json::from_str::<serde_json::Value>(&r.text())?)) else {
        return Vec::new();
    };
    let Some(h) = doc["stats"].as_array().and_then(|a| a.iter().find_map(|s| s.get("histograms"))) else {
        return Vec::new();
    };
    let qs: Vec<f64> = h["supported_quantiles"].as_array().into_iter().flatten().filter_map(|q| q.as_f64()).collect();
    let Some(values) = h["computed_quantiles"]
        .as_array()
        .and_then(|c| c.iter().find(|q| q["name"].as_str().is_some_and(|n| n.ends_with(name))))
        .and_then(|q| q["values"].as_array())
    else {
        return Vec::new();
    };
    qs.into_iter().zip(values.iter().map(|v| v["cumulative"].as_f64())).collect()
}

/// The largest Wasm VM's linear memory (bytes) in `envoy`: the most the filter's
/// `kvmesh_vm_memory_bytes` histogram recorded (each VM records its memory once a second).
fn largest_vm(envoy: &Envoy) -> anyhow::Result<f64> {
    let mut max = None;
    wait_until("Envoy to report the VMs' memory", Duration::from_secs(30), || {
        max = quantiles(envoy, "kvmesh_vm_memory_bytes").iter().find(|(q, _)| *q >= 100.0).and_then(|(_, v)| *v);
        max.is_some()
    })?;
    Ok(max.unwrap_or(0.0))
}

/// A kvmesh gateway (Envoy, 1 worker thread) on the control plane holding `entries` index
/// entries: its memory against the same gateway on an empty control plane, and the routing
/// decision's time inside Envoy (the filter's `kvmesh_route_decision_ns` histogram) for
/// 4 KiB prompts half of which is indexed, decided among the 64 workers.
fn gateway_at_scale(
    cp: &ControlPlane,
    cp_args: &[String],
    entries: u64,
    wasm: &std::path::Path,
) -> anyhow::Result<serde_json::Value> {
    let requests: usize =
        std::env::var("KVMESH_BENCH_SCALE_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    step(&format!("a gateway on that control plane: memory and the decision inside Envoy ({})", wasm.display()));
    let start = |cp: &ControlPlane| -> anyhow::Result<Envoy> {
        let mut opts = EnvoyOptions::new(serde_json::json!({"worker_urls": [], "policy": "cache_aware"}))?;
        opts.concurrency = 1;
        opts.wasm = wasm.to_path_buf();
        opts.use_control_plane(cp);
        Envoy::start(&opts)
    };
    let applied = |e: &Envoy| e.stat("wasmcustom.kvmesh_snapshot_version").ok().flatten().is_some_and(|v| v > 0);
    // The baseline: the same gateway on a control plane with the same workers and no index.
    let empty = ControlPlane::start(&cp_args.iter().map(String::as_str).collect::<Vec<_>>())?;
    let mut base = start(&empty)?;
    wait_until("the baseline gateway's first snapshot", Duration::from_secs(60), || applied(&base))?;
    let rss_empty = rss_kib(base.proc().pid());
    let vm_empty = largest_vm(&base)?;
    drop(base);
    drop(empty);
    let mut envoy = start(cp)?;
    let blocks = |e: &Envoy| e.stat("wasmcustom.kvmesh_index_blocks").ok().flatten().unwrap_or(0);
    wait_until("the gateway to index the full snapshot", Duration::from_secs(120), || blocks(&envoy) >= entries)?;
    let rss_full = rss_kib(envoy.proc().pid());
    let vm_full = largest_vm(&envoy)?;
    // A 4 KiB prompt indexed once, then prompts sharing its first half.
    let mut x = 7u64;
    let mut word = || {
        x = mix(x);
        format!("{:016x} ", x)
    };
    let base_text: String = (0..241).map(|_| word()).collect();
    let url = envoy.url("/generate");
    let version = |e: &Envoy| e.stat("wasmcustom.kvmesh_snapshot_version").ok().flatten().unwrap_or(0);
    let version_before = version(&envoy);
    for i in 0..requests {
        let text = if i == 0 {
            base_text.clone()
        } else {
            let half: String = base_text.chars().take(2048).collect();
            half + &(0..120).map(|_| word()).collect::<String>()
        };
        // The workers are absent: Envoy answers 502, after the decision was made and timed.
        let _ = http::post_json(&url, &serde_json::json!({"text": text, "sampling_params": {"max_new_tokens": 1}}));
    }
    let counted = |e: &Envoy| {
        let text = http::get(&e.admin_url("/stats/prometheus")).map(|r| r.text()).unwrap_or_default();
        text.lines().find_map(decision_count).unwrap_or(0)
    };
    // Envoy merges histograms on its stats flush (every 5 s by default).
    wait_until("Envoy to merge the decision histogram", Duration::from_secs(30), || {
        counted(&envoy) >= requests as u64
    })?;
    let versions = version(&envoy).saturating_sub(version_before);
    let q = quantiles(&envoy, "kvmesh_route_decision_ns");
    let at = |p: f64| q.iter().find(|(k, _)| (k - p).abs() < 1e-9).and_then(|(_, v)| *v).map(|ns| ns / 1e3);
    Ok(serde_json::json!({
        "envoy_threads": 1,
        "index_blocks": blocks(&envoy),
        "rss_empty_index_mib": rss_empty as f64 / 1024.0,
        "rss_full_index_mib": rss_full as f64 / 1024.0,
        "largest_vm_empty_index_mib": vm_empty / (1 << 20) as f64,
        "largest_vm_full_index_mib": vm_full / (1 << 20) as f64,
        "requests": requests,
        "snapshot_versions_during_run": versions,
        "decision_p50_us": at(50.0),
        "decision_p99_us": at(99.0),
        "decision_p999_us": at(99.9),
        "decision_max_us": at(100.0),
    }))
}
