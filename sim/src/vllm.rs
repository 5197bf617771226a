//! vLLM's prefill/decode KV transfer, simulated after its NIXL connector.
//!
//! A prefill asked with `kv_transfer_params.do_remote_decode` computes the prompt, keeps its
//! KV for a decode to pull (a bounded LRU of transfers that expire, as vLLM frees blocks no
//! decode read), and answers `kv_transfer_params` naming its engine id, the transfer's block
//! ids and where to pull them (`remote_host:remote_port`, this sim's HTTP port, where
//! `POST /sim/kv/pull` stands in for NIXL's side channel). A decode given
//! `do_remote_prefill` parameters pulls that KV (taking it: a transfer is read once, as vLLM
//! frees the blocks after the decode's read) and fails the request when the engine, the
//! blocks or the prompt do not match — so a wrong pairing or made-up parameters are visible.
//!
//! Also here: llm-d's routing sidecar's side (`x-prefiller-host-port` and the prefill request
//! it sends).

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use lru::LruCache;
use serde_json::{json, Map, Value};

use crate::cache::PAGE_TOKENS;
use crate::client;

/// Transfers a prefill holds at most (the least recently published go first).
pub const MAX_TRANSFERS: usize = 16_384;
/// How long a prefill keeps a transfer no decode pulled (vLLM's abort timeout is similar).
pub const KEEP: Duration = Duration::from_secs(480);

/// The KV of one computed prompt: which prompt (its hash, model included) and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kv {
    pub prompt_hash: u64,
    pub tokens: u64,
}

struct Held {
    block_ids: Vec<u64>,
    kv: Kv,
    request_id: String,
    at: Instant,
}

/// The transfers a prefill worker holds, keyed by their first block id.
pub struct Transfers {
    pub engine_id: String,
    host: String,
    port: u16,
    next_block: AtomicU64,
    held: Mutex<LruCache<u64, Held>>,
    keep: Duration,
}

impl Transfers {
    pub fn new(engine_id: String, host: String, port: u16, capacity: usize, keep: Duration) -> Self {
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Self { engine_id, host, port, next_block: AtomicU64::new(0), held: Mutex::new(LruCache::new(capacity)), keep }
    }

    /// Keeps `kv` for a decode to pull and returns the `kv_transfer_params` naming it: one
    /// block id per page of the prompt, never reused by this process.
    pub fn publish(&self, kv: Kv, request_id: &str) -> Value {
        let blocks = kv.tokens.div_ceil(PAGE_TOKENS).max(1);
        let first = self.next_block.fetch_add(blocks, Relaxed);
        let block_ids: Vec<u64> = (first..first + blocks).collect();
        let params = json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": block_ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request_id,
            "tp_size": 1,
        });
        if let Ok(mut held) = self.held.lock() {
            held.put(first, Held { block_ids, kv, request_id: request_id.to_string(), at: Instant::now() });
        }
        params
    }

    /// A decode's pull: the KV the blocks hold, taken (a second pull of them fails).
    pub fn take(&self, engine_id: &str, block_ids: &[u64], request_id: Option<&str>) -> Result<Kv, String> {
        if engine_id != self.engine_id {
            return Err(format!("engine `{engine_id}` is not this worker (engine `{}`)", self.engine_id));
        }
        let first = *block_ids.first().ok_or("no block ids")?;
        let mut held = self.held.lock().map_err(|_| "transfer table unavailable")?;
        let missing =
            || format!("no KV held for blocks starting at {first} (never computed here, already pulled, or expired)");
        let entry = held.peek(&first).ok_or_else(missing)?;
        if entry.at.elapsed() > self.keep {
            held.pop(&first);
            return Err(format!("the KV of blocks starting at {first} expired before it was pulled"));
        }
        if entry.block_ids != block_ids {
            return Err(format!("blocks starting at {first} are not one transfer of {} blocks", block_ids.len()));
        }
        if let Some(id) = request_id.filter(|id| *id != entry.request_id) {
            return Err(format!("blocks starting at {first} hold request `{}`, not `{id}`", entry.request_id));
        }
        held.pop(&first).map(|h| h.kv).ok_or_else(missing)
    }

    /// Transfers held now.
    pub fn len(&self) -> usize {
        self.held.lock().map_or(0, |h| h.len())
    }
}

/// What a request's `kv_transfer_params` ask of a worker.
#[derive(Debug, PartialEq, Eq)]
pub enum Transfer {
    /// Nothing: the worker computes the prompt itself.
    None,
    /// `do_remote_decode`: compute the prompt and keep its KV for a decode.
    Produce,
    /// `do_remote_prefill`: the prompt's KV is at a prefill worker.
    Consume(Remote),
}

/// Where a prompt's KV is, as a prefill named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    pub engine_id: String,
    pub block_ids: Vec<u64>,
    pub host: String,
    pub port: u16,
    pub request_id: Option<String>,
}

fn flag(params: &Map<String, Value>, name: &str) -> Result<bool, String> {
    match params.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| format!("`kv_transfer_params.{name}` must be a boolean")),
    }
}

/// The transfer a body's `kv_transfer_params` ask for (absent or null: none). Anything
/// malformed is an error for a 400.
pub fn transfer_of(body: &Value) -> Result<Transfer, String> {
    let params = match body.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(Transfer::None),
        Some(Value::Object(p)) => p,
        Some(_) => return Err("`kv_transfer_params` must be an object".into()),
    };
    match (flag(params, "do_remote_decode")?, flag(params, "do_remote_prefill")?) {
        (true, true) => Err("`kv_transfer_params` asks for both do_remote_decode and do_remote_prefill".into()),
        (true, false) => Ok(Transfer::Produce),
        (false, true) => remote(params).map(Transfer::Consume),
        (false, false) => Ok(Transfer::None),
    }
}

fn remote(p: &Map<String, Value>) -> Result<Remote, String> {
    let bad = |name: &str, what: &str| format!("`kv_transfer_params.{name}` must be {what} for do_remote_prefill");
    let text = |name: &str| match p.get(name) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Ok(s.clone()),
        _ => Err(bad(name, "a non-empty string")),
    };
    let block_ids = match p.get("remote_block_ids") {
        Some(Value::Array(ids)) if !ids.is_empty() && ids.len() <= 1 << 20 => {
            ids.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>()
        }
        _ => None,
    }
    .ok_or_else(|| bad("remote_block_ids", "a non-empty list of block ids"))?;
    let port = p
        .get("remote_port")
        .and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
        .filter(|&n| n != 0)
        .ok_or_else(|| bad("remote_port", "a port number"))?;
    let request_id = match p.get("remote_request_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("remote_request_id", "a string or null")),
    };
    Ok(Remote { engine_id: text("remote_engine_id")?, block_ids, host: text("remote_host")?, port, request_id })
}

/// `POST /sim/kv/pull` on a prefill worker (NIXL's read, simulated): the body names the
/// engine, the blocks and the request (`remote_*` as the prefill answered them).
pub async fn pull_handler(State(t): State<Arc<Transfers>>, body: Bytes) -> (StatusCode, Json<Value>) {
    let asked: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let engine = asked["remote_engine_id"].as_str();
    let blocks: Option<Vec<u64>> =
        asked["remote_block_ids"].as_array().and_then(|a| a.iter().map(Value::as_u64).collect());
    let (Some(engine), Some(blocks)) = (engine, blocks) else {
        let msg = "a pull names `remote_engine_id` and `remote_block_ids`";
        return (StatusCode::BAD_REQUEST, Json(json!({"error": msg})));
    };
    match t.take(engine, &blocks, asked["remote_request_id"].as_str()) {
        Ok(kv) => (StatusCode::OK, Json(json!({"prompt_hash": kv.prompt_hash, "tokens": kv.tokens}))),
        Err(msg) => (StatusCode::NOT_FOUND, Json(json!({"error": msg}))),
    }
}

/// A decode's side: pulls the KV `r` names from its prefill, waiting at most `wait`.
pub async fn pull(r: &Remote, wait: Duration) -> Result<Kv, String> {
    let body =
        json!({"remote_engine_id": r.engine_id, "remote_block_ids": r.block_ids, "remote_request_id": r.request_id});
    let from = client::authority(&r.host, r.port);
    let answer = client::request("POST", &r.host, r.port, "/sim/kv/pull", &[], body.to_string().as_bytes(), wait)
        .await
        .map_err(|e| format!("cannot pull KV from {from}: {e}"))?;
    let v: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
    if answer.status != 200 {
        let why = v["error"].as_str().map_or_else(|| answer.text(), String::from);
        return Err(format!("cannot pull KV from {from} (engine `{}`): {} {why}", r.engine_id, answer.status));
    }
    match (v["prompt_hash"].as_u64(), v["tokens"].as_u64()) {
        (Some(prompt_hash), Some(tokens)) => Ok(Kv { prompt_hash, tokens }),
        _ => Err(format!("cannot pull KV from {from}: unexpected answer {}", answer.text())),
    }
}

/// The longest `x-prefiller-host-port` taken (a 253-byte DNS name and a port).
const MAX_HOST_PORT: usize = 262;

/// `x-prefiller-host-port`'s value: `host:port` (a DNS name or an IPv4 address, or an IPv6
/// address in brackets) with a port from 1 to 65535.
pub fn parse_host_port(v: &str) -> Result<(String, u16), String> {
    let bad = || format!("x-prefiller-host-port `{}` is not HOST:PORT", v.chars().take(64).collect::<String>());
    if v.is_empty() || v.len() > MAX_HOST_PORT {
        return Err(bad());
    }
    let (host, port) = match v.strip_prefix('[') {
        Some(rest) => {
            let (h, p) = rest.split_once("]:").ok_or_else(bad)?;
            h.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
            (h, p)
        }
        None => {
            let (h, p) = v.rsplit_once(':').ok_or_else(bad)?;
            let name_ok = h.split('.').all(|label| {
                !label.is_empty() && label.len() <= 63 && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
            if !name_ok {
                return Err(bad());
            }
            (h, p)
        }
    };
    let port = if !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()) {
        port.parse::<u16>().ok().filter(|&p| p != 0)
    } else {
        None
    };
    Ok((host.to_string(), port.ok_or_else(bad)?))
}

/// The body llm-d's sidecar sends the prefill worker: the client's, asking
/// `do_remote_decode`, not streamed, one output token.
pub fn prefill_body(client_body: &Value) -> Value {
    let mut body = client_body.clone();
    if let Some(o) = body.as_object_mut() {
        o.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        );
        o.insert("stream".into(), json!(false));
        o.insert("max_tokens".into(), json!(1));
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), json!(1));
        }
        for name in ["stream_options", "min_tokens", "min_completion_tokens"] {
            o.remove(name);
        }
    }
    body
}

/// The sidecar's prefill request to `host:port`: the `kv_transfer_params` it answered.
pub async fn sidecar_prefill(
    (host, port): (&str, u16),
    path: &str,
    body: &Value,
    request_id: Option<&str>,
    timeout: Duration,
) -> Result<Value, String> {
    let at = client::authority(host, port);
    let headers: Vec<(&str, &str)> = request_id.map(|id| ("x-request-id", id)).into_iter().collect();
    let answer = client::request("POST", host, port, path, &headers, body.to_string().as_bytes(), timeout)
        .await
        .map_err(|e| format!("prefill at {at} failed: {e}"))?;
    if !(200..300).contains(&answer.status) {
        let text: String = answer.text().chars().take(300).collect();
        return Err(format!("prefill at {at} answered {}: {text}", answer.status));
    }
    let v: Value = serde_json::from_slice(&answer.body).map_err(|_| format!("prefill at {at} answered no JSON"))?;
    match v.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => Ok(p.clone()),
        _ => Err(format!("prefill at {at} answered no kv_transfer_params")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transfers(keep: Duration) -> Transfers {
        Transfers::new("eng-a".into(), "127.0.0.1".into(), 9, 2, keep)
    }

    fn ids(params: &Value) -> Vec<u64> {
        params["remote_block_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
    }

    #[test]
    fn a_published_transfer_is_pulled_once_by_engine_and_blocks() {
        let t = transfers(KEEP);
        let kv = Kv { prompt_hash: 5, tokens: 33 };
        let p = t.publish(kv, "req-1");
        assert_eq!(p["remote_engine_id"], "eng-a");
        assert_eq!((p["remote_host"].as_str(), p["remote_port"].as_u64()), (Some("127.0.0.1"), Some(9)));
        assert_eq!((p["do_remote_prefill"].as_bool(), p["do_remote_decode"].as_bool()), (Some(true), Some(false)));
        assert_eq!(ids(&p), vec![0, 1, 2], "one block per 16-token page");
        let q = t.publish(Kv { prompt_hash: 6, tokens: 1 }, "req-2");
        assert_eq!(ids(&q), vec![3], "block ids are never reused");
        assert!(t.take("eng-b", &[0, 1, 2], None).unwrap_err().contains("not this worker"));
        assert!(t.take("eng-a", &[0, 1], None).unwrap_err().contains("not one transfer"));
        assert!(t.take("eng-a", &[1, 2], None).unwrap_err().contains("no KV held"));
        assert!(t.take("eng-a", &[0, 1, 2], Some("req-2")).unwrap_err().contains("not `req-2`"));
        assert_eq!(t.take("eng-a", &[0, 1, 2], Some("req-1")), Ok(kv));
        assert!(t.take("eng-a", &[0, 1, 2], None).unwrap_err().contains("already pulled"));
        assert_eq!(t.take("eng-a", &[3], None), Ok(Kv { prompt_hash: 6, tokens: 1 }));
    }

    #[test]
    fn transfers_are_bounded_and_expire() {
        let t = transfers(KEEP);
        for i in 0..3 {
            t.publish(Kv { prompt_hash: i, tokens: 1 }, "r");
        }
        assert_eq!(t.len(), 2, "the oldest went");
        assert!(t.take("eng-a", &[0], None).is_err());
        let t = transfers(Duration::ZERO);
        t.publish(Kv { prompt_hash: 1, tokens: 1 }, "r");
        assert!(t.take("eng-a", &[0], None).unwrap_err().contains("expired"));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn kv_transfer_params_are_read_strictly() {
        assert_eq!(transfer_of(&json!({})), Ok(Transfer::None));
        assert_eq!(transfer_of(&json!({"kv_transfer_params": null})), Ok(Transfer::None));
        assert_eq!(transfer_of(&json!({"kv_transfer_params": {}})), Ok(Transfer::None));
        let template = prefill_body(&json!({"prompt": "p"}));
        assert_eq!(transfer_of(&template), Ok(Transfer::Produce));
        let t = transfers(KEEP);
        let params = t.publish(Kv { prompt_hash: 1, tokens: 20 }, "cmpl-x-0");
        let Ok(Transfer::Consume(r)) = transfer_of(&json!({"kv_transfer_params": params})) else { panic!() };
        assert_eq!(
            r,
            Remote {
                engine_id: "eng-a".into(),
                block_ids: vec![0, 1],
                host: "127.0.0.1".into(),
                port: 9,
                request_id: Some("cmpl-x-0".into())
            }
        );
        for (bad, needle) in [
            (json!("x"), "must be an object"),
            (json!([1]), "must be an object"),
            (json!(true), "must be an object"),
            (json!({"do_remote_decode": "yes"}), "do_remote_decode"),
            (json!({"do_remote_decode": true, "do_remote_prefill": true}), "both"),
            (json!({"do_remote_prefill": true}), "remote_block_ids"),
            (json!({"do_remote_prefill": true, "remote_block_ids": [], "remote_port": 1}), "remote_block_ids"),
            (json!({"do_remote_prefill": true, "remote_block_ids": [-1], "remote_port": 1}), "remote_block_ids"),
            (json!({"do_remote_prefill": true, "remote_block_ids": [1], "remote_port": 0}), "remote_port"),
            (json!({"do_remote_prefill": true, "remote_block_ids": [1], "remote_port": 1}), "remote_engine_id"),
            (
                json!({"do_remote_prefill": true, "remote_block_ids": [1], "remote_port": 1, "remote_engine_id": "e"}),
                "remote_host",
            ),
        ] {
            let err = transfer_of(&json!({"kv_transfer_params": bad})).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn the_prefiller_header_is_host_and_port() {
        assert_eq!(parse_host_port("10.0.0.7:8000"), Ok(("10.0.0.7".into(), 8000)));
        assert_eq!(parse_host_port("prefill-0.svc:80"), Ok(("prefill-0.svc".into(), 80)));
        assert_eq!(parse_host_port("[::1]:5"), Ok(("::1".into(), 5)));
        let long = format!("{}:1", "a.".repeat(140));
        for bad in [
            "", "host", "host:", ":80", "h:0", "h:65536", "h:+80", "h:8 0", "h/x:80", "a..b:1", "::1:5", "[x]:5", &long,
        ] {
            assert!(parse_host_port(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_sidecars_prefill_body_asks_for_a_remote_decode_of_one_token() {
        let client = json!({"model": "m", "messages": [], "stream": true, "stream_options": {"include_usage": true},
                            "max_tokens": 50, "max_completion_tokens": 40, "min_tokens": 3, "min_completion_tokens": 2,
                            "temperature": 0.5});
        let body = prefill_body(&client);
        assert_eq!(
            body,
            json!({"model": "m", "messages": [], "stream": false, "max_tokens": 1, "max_completion_tokens": 1,
                   "temperature": 0.5,
                   "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                                          "remote_block_ids": null, "remote_host": null, "remote_port": null}})
        );
        assert_eq!(prefill_body(&json!({"prompt": "p"}))["max_tokens"], 1);
        assert!(prefill_body(&json!({"prompt": "p"})).get("max_completion_tokens").is_none());
    }
}
