//! Health checks and load polling of the workers, over a minimal HTTP/1.0 client (worker
//! addresses are IPs on the cluster network; nothing else is needed).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::state::{Pressure, RankLoad, State};

/// The most of a worker's answer kvmesh-cp reads (a health, load or metrics page; a hostile or
/// broken worker cannot make it hold more).
pub const MAX_RESPONSE_BYTES: u64 = 4 << 20;

/// The workers' API key (`--api-key`), sent with every request to a worker when set.
pub type Key<'a> = Option<&'a str>;

/// `GET path` on `addr`: the status and body, or why not.
pub async fn get(addr: &str, path: &str, timeout: Duration, key: Key<'_>) -> Result<(u16, String), String> {
    request("GET", addr, path, timeout, key).await
}

/// `method path` (no body) on `addr`: the status and at most [`MAX_RESPONSE_BYTES`] of the
/// answer, or why not.
pub async fn request(
    method: &str,
    addr: &str,
    path: &str,
    timeout: Duration,
    key: Key<'_>,
) -> Result<(u16, String), String> {
    send(method, addr, path, None, timeout, key).await
}

/// `POST path` with a JSON `body` on `addr`, as [`request`].
pub async fn post_json(
    addr: &str,
    path: &str,
    body: &str,
    timeout: Duration,
    key: Key<'_>,
) -> Result<(u16, String), String> {
    send("POST", addr, path, Some(body), timeout, key).await
}

async fn send(
    method: &str,
    addr: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
    key: Key<'_>,
) -> Result<(u16, String), String> {
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (kind, body) = match body {
            Some(b) => ("content-type: application/json\r\n", b),
            None => ("", ""),
        };
        // The key was checked at startup: visible ASCII, nothing that could end the line.
        let auth = key.map(|k| format!("authorization: Bearer {k}\r\n")).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.0\r\nhost: {addr}\r\nuser-agent: kvmesh-cp\r\n{auth}{kind}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        (&mut conn).take(MAX_RESPONSE_BYTES).read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&buf);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or("no HTTP status")?;
        Ok((status, body.to_string()))
    };
    tokio::time::timeout(timeout, attempt).await.map_err(|_| "timed out".to_string())?
}

/// Load from SGLang's `/get_load`: `{"load": N}` (older) or one object per DP rank with
/// `num_reqs` (current).
pub fn parse_get_load(body: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    if let Some(n) = v.get("load").and_then(serde_json::Value::as_u64) {
        return Some(n);
    }
    let ranks = v.as_array()?;
    Some(ranks.iter().filter_map(|r| r.get("num_reqs").and_then(serde_json::Value::as_u64)).sum())
}

/// Each data-parallel rank's entry of SGLang's `/get_load` list (`dp_rank`, `num_reqs`,
/// `num_waiting_reqs`); at most [`kvmesh_core::dp::MAX_DP_SIZE`] are read.
pub fn ranks_from_get_load(body: &str) -> Vec<RankLoad> {
    let Ok(serde_json::Value::Array(ranks)) = serde_json::from_str(body) else { return Vec::new() };
    let u64_of = |r: &serde_json::Value, k: &str| r.get(k).and_then(serde_json::Value::as_u64);
    ranks
        .iter()
        .take(kvmesh_core::dp::MAX_DP_SIZE as usize)
        .filter_map(|r| {
            let rank = u32::try_from(u64_of(r, "dp_rank")?).ok()?;
            Some(RankLoad { rank, load: u64_of(r, "num_reqs"), waiting: u64_of(r, "num_waiting_reqs"), kv_usage: None })
        })
        .collect()
}

/// SGLang's `dp_size` from `/get_server_info` (top level), if it says.
pub fn dp_size_from_server_info(body: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get("dp_size").and_then(serde_json::Value::as_u64)
}

/// Waiting requests from SGLang's `/get_load` (one object per DP rank: `num_waiting_reqs`).
pub fn waiting_from_get_load(body: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let ranks = v.as_array()?;
    let counts: Vec<u64> =
        ranks.iter().filter_map(|r| r.get("num_waiting_reqs").and_then(serde_json::Value::as_u64)).collect();
    (!counts.is_empty()).then(|| counts.iter().fold(0u64, |a, &n| a.saturating_add(n)))
}

/// Waiting requests and KV cache usage from Prometheus text (SGLang or vLLM names).
pub fn parse_pressure(text: &str) -> Pressure {
    let mut p = Pressure::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let name = name_labels.split('{').next().unwrap_or(name_labels);
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        if !v.is_finite() || v < 0.0 {
            continue;
        }
        match name {
            "sglang:num_queue_reqs" | "vllm:num_requests_waiting" => {
                p.waiting = Some(p.waiting.unwrap_or(0).saturating_add(v.round() as u64));
            }
            "sglang:token_usage" | "vllm:kv_cache_usage_perc" => {
                p.kv_usage = Some(p.kv_usage.unwrap_or(0.0).max(v.min(1.0)));
            }
            _ => {}
        }
    }
    p
}

/// Each data-parallel rank's KV usage from SGLang's `/metrics` (`sglang:token_usage` with a
/// `dp_rank` label, as its schedulers export it under data parallelism), into `ranks` (a rank
/// `/get_load` did not list is added); at most [`kvmesh_core::dp::MAX_DP_SIZE`] ranks.
pub fn rank_kv_usage(text: &str, ranks: &mut Vec<RankLoad>) {
    for line in text.lines().filter(|l| l.starts_with("sglang:token_usage{")) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        let rank = label(name_labels, "dp_rank").and_then(|r| r.parse::<u32>().ok());
        let Some(rank) = rank.filter(|_| v.is_finite() && v >= 0.0) else { continue };
        let at = match ranks.iter().position(|r| r.rank == rank) {
            Some(at) => at,
            None if ranks.len() < kvmesh_core::dp::MAX_DP_SIZE as usize => {
                ranks.push(RankLoad { rank, ..RankLoad::default() });
                ranks.len() - 1
            }
            None => continue,
        };
        if let Some(r) = ranks.get_mut(at) {
            r.kv_usage = Some(r.kv_usage.unwrap_or(0.0).max(v.min(1.0)));
        }
    }
}

/// The value of label `name` in a series' `name{k="v",...}` (a whole label name: `dp_rank` is
/// not `attn_dp_rank`).
fn label<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    let labels = series.split_once('{')?.1;
    let mut rest = labels;
    while let Some((key, after)) = rest.split_once("=\"") {
        let (value, next) = after.split_once('"')?;
        if key.trim_start_matches(',').trim() == name {
            return Some(value);
        }
        rest = next;
    }
    None
}

/// Load (running + queued) and cache hit rate from Prometheus text (SGLang or vLLM names).
pub fn parse_metrics(text: &str) -> (Option<u64>, Option<f64>) {
    let mut load = None::<f64>;
    let mut hit = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let name = name_labels.split('{').next().unwrap_or(name_labels);
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        match name {
            "sglang:num_running_reqs"
            | "sglang:num_queue_reqs"
            | "vllm:num_requests_running"
            | "vllm:num_requests_waiting" => {
                *load.get_or_insert(0.0) += v;
            }
            "sglang:cache_hit_rate" => hit = Some(v),
            _ => {}
        }
    }
    (load.map(|l| l.round() as u64), hit)
}

/// One health check of worker `id` now (a worker added through the API is unhealthy until
/// one passes).
pub async fn check_one(state: Arc<State>, id: u32) {
    let Some(w) = state.workers().into_iter().find(|w| w.id == id) else { return };
    let timeout = Duration::from_secs(state.settings.health_timeout_secs);
    health_check(&state, &w.url, id, timeout).await;
}

/// One health check: its result with the thresholds, any answer as a sign of life, and on a
/// pass the models the worker serves. A worker's data-parallel ranks share its answer.
async fn health_check(state: &Arc<State>, url: &str, id: u32, timeout: Duration) {
    let Ok(addr) = kvmesh_core::worker::socket_addr(url) else { return };
    let addr = addr.to_string();
    let ids: Vec<u32> = state.ranks_of(id).into_iter().map(|(id, _)| id).collect();
    ids.iter().for_each(|&id| state.asking(id));
    let answer = get(&addr, &state.settings.health_endpoint, timeout, state.settings.worker_key()).await;
    let ok = matches!(answer, Ok((200, _)));
    for &id in &ids {
        state.health_result(id, ok);
        if answer.is_ok() {
            state.answered(id);
        }
    }
    if ok {
        poll_models(state, &ids, &addr, timeout).await;
    }
}

/// Whether `w` is probed for itself: a worker, or the first rank of one (the others share
/// its answers).
fn probed_for_itself(w: &crate::state::WorkerEntry) -> bool {
    w.dp_rank.is_none_or(|r| r == 0)
}

/// Health checks every `health_interval_secs`.
pub async fn health_loop(state: Arc<State>) {
    let interval = Duration::from_secs(state.settings.health_interval_secs);
    let timeout = Duration::from_secs(state.settings.health_timeout_secs);
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let checks = state.workers().into_iter().filter(probed_for_itself).map(|w| {
            let state = state.clone();
            async move { health_check(&state, &w.url, w.id, timeout).await }
        });
        futures_util::future::join_all(checks).await;
    }
}

/// Asks the worker at `addr` what it serves and records the answer for its entries `ids`
/// (nothing when it does not say: what was known stays).
pub async fn poll_models(state: &Arc<State>, ids: &[u32], addr: &str, timeout: Duration) {
    let key = state.settings.worker_key();
    let served = match get(addr, "/v1/models", timeout, key).await {
        Ok((200, body)) => crate::models::parse_models(&body),
        _ => None,
    };
    let served = match served {
        Some(s) => Some(s),
        None => match get(addr, "/get_model_info", timeout, key).await {
            Ok((200, body)) => crate::models::parse_model_info(&body),
            _ => None,
        },
    };
    if let Some(served) = served {
        for &id in ids {
            state.models_result(id, served.clone());
        }
    }
}

/// How often a worker's KV capacity (`/get_server_info`) is asked again: a worker that does
/// not report it is not asked on every load poll, one that restarted is heard within this.
const CAPACITY_POLL: Duration = Duration::from_secs(30);

/// How long one load-poll request may take.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);

/// How often kvmesh-cp looks for workers silent past `--worker-unresponsive-secs` (at most
/// this late).
const SILENCE_CHECK: Duration = Duration::from_millis(250);

/// Load polling every `load_poll_interval_ms`: `/get_load`, else `/metrics`; and every
/// [`CAPACITY_POLL`] (at once for a worker new or healthy again) its KV capacity. Each worker
/// is polled on its own: one that does not answer delays no other's poll, and is not asked
/// again while a poll of it is still out. Every [`SILENCE_CHECK`], the workers that answered
/// no probe for `--worker-unresponsive-secs` are taken out; they are still polled, and the
/// first answer brings them back.
pub async fn load_loop(state: Arc<State>) {
    let every = Duration::from_millis(state.settings.load_poll_interval_ms);
    let silence = Duration::from_millis(state.settings.unresponsive_ms);
    let mut tick = tokio::time::interval(if silence.is_zero() { every } else { every.min(SILENCE_CHECK) });
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let polling: Arc<std::sync::Mutex<HashSet<u32>>> = Arc::default();
    let mut capacity_asked: HashMap<u32, Instant> = HashMap::new();
    let mut last_round: Option<Instant> = None;
    loop {
        tick.tick().await;
        if !silence.is_zero() {
            state.mark_unresponsive(silence);
        }
        let now = Instant::now();
        if last_round.is_some_and(|at| now.duration_since(at) < every) {
            continue;
        }
        last_round = Some(now);
        let workers = state.workers();
        capacity_asked.retain(|id, _| workers.iter().any(|w| w.id == *id && w.healthy));
        for w in workers.into_iter().filter(|w| w.probed() && probed_for_itself(w)) {
            if !polling.lock().is_ok_and(|mut p| p.insert(w.id)) {
                continue; // the last poll of it is still out
            }
            let ask_capacity =
                w.healthy && capacity_asked.get(&w.id).is_none_or(|at| now.duration_since(*at) >= CAPACITY_POLL);
            if ask_capacity {
                capacity_asked.insert(w.id, now);
            }
            let (state, polling) = (state.clone(), polling.clone());
            tokio::spawn(async move {
                poll_one(&state, w.id, &w.url, ask_capacity).await;
                if let Ok(mut p) = polling.lock() {
                    p.remove(&w.id);
                }
            });
        }
    }
}

/// One load poll of a worker (and its KV capacity and `dp_size` when `ask_capacity`); every
/// answer is a sign of life. Its data-parallel ranks get their own `/get_load` entries.
async fn poll_one(state: &State, id: u32, url: &str, ask_capacity: bool) {
    let Ok(addr) = kvmesh_core::worker::socket_addr(url) else { return };
    let addr = addr.to_string();
    let ids: Vec<u32> = state.ranks_of(id).into_iter().map(|(id, _)| id).collect();
    let ask = |path: &'static str| {
        let (addr, ids) = (addr.clone(), &ids);
        async move {
            ids.iter().for_each(|&id| state.asking(id));
            let answer = get(&addr, path, POLL_TIMEOUT, state.settings.worker_key()).await;
            if answer.is_ok() {
                ids.iter().for_each(|&id| state.answered(id));
            }
            answer
        }
    };
    if ask_capacity {
        let (capacity, dp_size) = match ask("/get_server_info").await {
            Ok((200, body)) => (crate::capacity::parse_server_info(&body), dp_size_from_server_info(&body)),
            _ => (None, None),
        };
        state.capacity_result(id, capacity);
        // Registers the worker again as its ranks when their number changed (the next poll
        // is theirs).
        if state.dp_size_result(id, dp_size) {
            return;
        }
    }
    let (mut load, mut hit, mut pressure) = (None, None, Pressure::default());
    let mut ranks = Vec::new();
    if let Ok((200, body)) = ask("/get_load").await {
        load = parse_get_load(&body);
        pressure.waiting = waiting_from_get_load(&body);
        ranks = ranks_from_get_load(&body);
    }
    if let Ok((200, body)) = ask("/metrics").await {
        let (l, h) = parse_metrics(&body);
        load = load.or(l);
        hit = h;
        let p = parse_pressure(&body);
        pressure = Pressure { waiting: pressure.waiting.or(p.waiting), kv_usage: p.kv_usage };
        rank_kv_usage(&body, &mut ranks);
    }
    for (id, load, pressure) in state.rank_loads(id, load, pressure, &ranks) {
        state.pressure_result(id, pressure);
        state.load_result(id, load, hit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_load_both_shapes() {
        assert_eq!(parse_get_load(r#"{"load": 7}"#), Some(7));
        assert_eq!(
            parse_get_load(
                r#"[{"dp_rank":0,"num_reqs":3,"num_waiting_reqs":1,"num_tokens":9},{"dp_rank":1,"num_reqs":2}]"#
            ),
            Some(5)
        );
        assert_eq!(parse_get_load("nope"), None);
    }

    #[test]
    fn pressure_from_get_load_and_metrics() {
        let ranks =
            r#"[{"dp_rank":0,"num_reqs":3,"num_waiting_reqs":1},{"dp_rank":1,"num_reqs":2,"num_waiting_reqs":4}]"#;
        assert_eq!(waiting_from_get_load(ranks), Some(5));
        assert_eq!(waiting_from_get_load(r#"{"load":3}"#), None, "the old shape does not say");
        let huge = format!(r#"[{{"num_waiting_reqs":{m}}},{{"num_waiting_reqs":{m}}}]"#, m = u64::MAX);
        assert_eq!(waiting_from_get_load(&huge), Some(u64::MAX), "saturates, never overflows");
        let sglang = "sglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:token_usage{model_name=\"m\"} 0.25\n";
        assert_eq!(parse_pressure(sglang), Pressure { waiting: Some(2), kv_usage: Some(0.25) });
        let vllm = "vllm:num_requests_waiting 7.0\nvllm:kv_cache_usage_perc 0.9\n";
        assert_eq!(parse_pressure(vllm), Pressure { waiting: Some(7), kv_usage: Some(0.9) });
        // Under data parallelism each rank's scheduler exports its own series.
        let dp = "sglang:token_usage{model_name=\"m\",dp_rank=\"0\",tp_rank=\"0\"} 0.8\n\
                  sglang:token_usage{model_name=\"m\",dp_rank=\"1\",tp_rank=\"0\"} 0.2\n\
                  sglang:token_usage{model_name=\"m\",dp_rank=\"x\"} 0.5\nsglang:token_usage{dp_rank=\"2\"} NaN\n\
                  sglang:token_usage{attn_dp_rank=\"3\"} 0.5\n";
        let mut ranks = vec![RankLoad { rank: 1, load: Some(3), ..RankLoad::default() }];
        rank_kv_usage(dp, &mut ranks);
        let kv: Vec<(u32, Option<u64>, Option<f64>)> = ranks.iter().map(|r| (r.rank, r.load, r.kv_usage)).collect();
        assert_eq!(kv, [(1, Some(3), Some(0.2)), (0, None, Some(0.8))], "a bad rank or value is skipped");
        assert_eq!(parse_pressure(dp).kv_usage, Some(0.8), "the worker's: its fullest rank");
        let many: String = (0..1000).map(|r| format!("sglang:token_usage{{dp_rank=\"{r}\"}} 0.1\n")).collect();
        let mut ranks = Vec::new();
        rank_kv_usage(&many, &mut ranks);
        assert_eq!(ranks.len(), kvmesh_core::dp::MAX_DP_SIZE as usize, "bounded");
        let hostile = "sglang:num_queue_reqs -5\nsglang:token_usage NaN\nsglang:token_usage 1e9\n";
        assert_eq!(
            parse_pressure(hostile),
            Pressure { waiting: None, kv_usage: Some(1.0) },
            "clamped, garbage skipped"
        );
    }

    #[test]
    fn metrics_sglang_and_vllm() {
        let sglang = "# TYPE x gauge\nsglang:num_running_reqs{model_name=\"m\"} 3\nsglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:cache_hit_rate{model_name=\"m\"} 0.5\n";
        assert_eq!(parse_metrics(sglang), (Some(5), Some(0.5)));
        let vllm = "vllm:num_requests_running{model_name=\"m\"} 4.0\nvllm:num_requests_waiting{model_name=\"m\"} 1.0\nvllm:kv_cache_usage_perc 0.3\n";
        assert_eq!(parse_metrics(vllm), (Some(5), None));
        assert_eq!(parse_metrics("other 1\n"), (None, None));
    }
}

#[cfg(test)]
mod bounded {
    use super::*;

    /// A "worker" that answers with a status line and then bytes without end.
    async fn endless_worker() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 1024];
            let _ = conn.read(&mut head).await;
            let _ = conn.write_all(b"HTTP/1.0 200 OK\r\n\r\n").await;
            let chunk = vec![b'x'; 64 * 1024];
            // Until kvmesh-cp stops reading (at most 64 MiB, to bound the test itself).
            for _ in 0..1024 {
                if conn.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        addr
    }

    #[test]
    fn an_endless_worker_answer_is_read_only_up_to_the_bound() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let addr = endless_worker().await;
            let (status, body) = get(&addr, "/metrics", Duration::from_secs(20), None).await.unwrap();
            assert_eq!(status, 200);
            assert!(body.len() as u64 <= MAX_RESPONSE_BYTES, "{} bytes kept", body.len());
            assert!(body.len() as u64 > MAX_RESPONSE_BYTES / 2, "the bound, not an early stop");
        });
    }
}
