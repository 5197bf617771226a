//! Worker administration, fanned out from kvmesh-cp (the gateway never forwards it): the
//! engines' own admin endpoints, called on every worker or on the ones a query selects, each
//! once per server (data-parallel ranks share one), with what the caller sent.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State as Axum};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use kvmesh_proto::v1::Role;
use serde_json::{json, Value};

use crate::state::{role_name, State, WorkerEntry};

/// One engine admin endpoint kvmesh-cp fans out.
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub path: &'static str,
    /// Whether the worker's KV cache is empty after it (or was while the worker slept): its
    /// part of the global prefix index (and so of every filter's) is forgotten then, as it
    /// would otherwise send prompts to a cache no longer there.
    pub drops_cache: bool,
    /// How long a worker has to answer, unless the caller says (`timeout_secs`); never more
    /// than `--request-timeout-secs`. `/flush_cache` has the health checks' timeout.
    pub timeout_secs: u64,
}

/// SGLang's (`flush_cache`, weight updates, profiling, abort, memory release) and vLLM's
/// (`reset_prefix_cache`, profiling, sleep): each worker answers the ones its engine has.
/// Loading weights from disk takes minutes; moving memory and sleeping, seconds; the rest, less.
pub const OPS: [Op; 10] = [
    Op { path: "/flush_cache", drops_cache: true, timeout_secs: 0 },
    Op { path: "/update_weights_from_disk", drops_cache: true, timeout_secs: 600 },
    Op { path: "/start_profile", drops_cache: false, timeout_secs: 30 },
    Op { path: "/stop_profile", drops_cache: false, timeout_secs: 120 },
    Op { path: "/abort_request", drops_cache: false, timeout_secs: 30 },
    Op { path: "/release_memory_occupation", drops_cache: true, timeout_secs: 120 },
    Op { path: "/resume_memory_occupation", drops_cache: true, timeout_secs: 120 },
    Op { path: "/reset_prefix_cache", drops_cache: true, timeout_secs: 30 },
    Op { path: "/sleep", drops_cache: true, timeout_secs: 120 },
    Op { path: "/wake_up", drops_cache: true, timeout_secs: 120 },
];

/// The longest a caller may give the workers (`timeout_secs`).
pub const MAX_TIMEOUT_SECS: u64 = 3600;
/// Most admin calls to workers in flight at once, over every fan-out: a pool of thousands
/// of workers, or many callers, is worked through this many at a time.
pub const MAX_CONCURRENT_CALLS: usize = 32;
static CALLS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_CONCURRENT_CALLS);

/// Largest body passed on (the ops take a few small fields).
pub const MAX_BODY: usize = 64 * 1024;
/// Most bytes of each worker's answer put in the reply.
const MAX_ANSWER: usize = 4096;

/// The ops' routes (the caller adds the admin-key guard).
pub fn routes() -> Router<Arc<State>> {
    OPS.iter().fold(Router::new(), |r, &op| {
        r.route(
            op.path,
            post(move |state: Axum<Arc<State>>, query: Query<Vec<(String, String)>>, body: Bytes| {
                fan_out(op, state, query, body)
            }),
        )
    })
}

type Reply = (StatusCode, Json<Value>);

fn refuse(status: StatusCode, why: impl Into<String>) -> Reply {
    (status, Json(json!({"error": why.into()})))
}

/// Which workers, and the query passed on: `url=` (a worker as `/list_workers` names it, its
/// server for a rank) and `role=` select, `timeout_secs=` bounds each worker's answer, every
/// other parameter goes to the workers.
#[derive(Debug)]
struct Selection {
    url: Option<String>,
    role: Option<Role>,
    timeout_secs: Option<u64>,
    forwarded: Vec<(String, String)>,
}

fn selection(query: Vec<(String, String)>, pd: bool) -> Result<Selection, String> {
    let mut s = Selection { url: None, role: None, timeout_secs: None, forwarded: Vec::new() };
    for (k, v) in query {
        match k.as_str() {
            "url" => s.url = Some(v.trim_end_matches('/').to_string()),
            "timeout_secs" => {
                s.timeout_secs = match v.parse::<u64>() {
                    Ok(n) if (1..=MAX_TIMEOUT_SECS).contains(&n) => Some(n),
                    _ => return Err(format!("timeout_secs `{v}` must be a whole number from 1 to {MAX_TIMEOUT_SECS}")),
                }
            }
            "role" => {
                s.role = Some(match (v.as_str(), pd) {
                    ("prefill", true) => Role::Prefill,
                    ("decode", true) => Role::Decode,
                    ("regular", false) => Role::Regular,
                    _ => return Err(format!("role `{v}` does not fit this control plane's mode")),
                })
            }
            _ if k.len() + v.len() > 1024 => return Err(format!("query parameter `{k}` is too long")),
            _ => s.forwarded.push((k, v)),
        }
    }
    Ok(s)
}

impl Selection {
    fn picks(&self, w: &WorkerEntry) -> bool {
        // A worker that prefills and decodes (`both`) answers to either role.
        let role_ok = self.role.is_none_or(|r| w.role == r || w.role == Role::Both);
        let url_ok = self.url.as_deref().is_none_or(|u| w.url.trim_end_matches('/') == u || w.name() == u);
        role_ok && url_ok
    }

    /// The path with the forwarded parameters (encoded again: nothing the caller sent can
    /// end the request line).
    fn target(&self, path: &str) -> String {
        if self.forwarded.is_empty() {
            return path.to_string();
        }
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.extend_pairs(&self.forwarded);
        format!("{path}?{}", q.finish())
    }
}

/// `POST <op>[?url=…][&role=…]` with the engine's JSON body (or none): the op on each selected
/// worker at once. 200 when every one answered 2xx, 502 otherwise (the body says per worker),
/// 404 when none is selected.
async fn fan_out(
    op: Op,
    Axum(state): Axum<Arc<State>>,
    Query(query): Query<Vec<(String, String)>>,
    body: Bytes,
) -> Reply {
    let sel = match selection(query, state.settings.pd) {
        Ok(s) => s,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
    };
    if body.len() > MAX_BODY {
        return refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {MAX_BODY} bytes"));
    }
    let body = match std::str::from_utf8(&body) {
        Ok(b) if b.trim().is_empty() => None,
        Ok(b) if serde_json::from_str::<serde_json::Map<String, Value>>(b).is_ok() => Some(b),
        _ => return refuse(StatusCode::BAD_REQUEST, "the body must be a JSON object (or empty)"),
    };
    // Once per server: its data-parallel ranks share it.
    let mut servers: Vec<WorkerEntry> = state.workers().into_iter().filter(|w| sel.picks(w)).collect();
    servers.sort_by(|a, b| (&a.url, a.dp_rank).cmp(&(&b.url, b.dp_rank)));
    servers.dedup_by(|a, b| a.url == b.url);
    if servers.is_empty() {
        return refuse(StatusCode::NOT_FOUND, "no worker matches (see /list_workers)");
    }
    let most = state.settings.routing.request_timeout_secs.unwrap_or(1800);
    let default = if op.timeout_secs == 0 { state.settings.health_timeout_secs } else { op.timeout_secs };
    let timeout = Duration::from_secs(sel.timeout_secs.unwrap_or(default).min(most).max(1));
    let call = Call {
        target: sel.target(op.path),
        body: body.map(str::to_string),
        timeout,
        key: state.settings.worker_key().map(str::to_string),
    };
    // A task of its own: a caller that goes away (or a proxy's idle timeout) does not stop
    // the index from forgetting what the workers emptied.
    let task = tokio::spawn(async move {
        let results: Vec<(Outcome, Value)> =
            futures_util::future::join_all(servers.iter().map(|w| call.bounded(w))).await;
        if op.drops_cache {
            // A worker that gave no answer (a timeout, a reset) may have done it all the same.
            let maybe = |o: &Outcome| *o != Outcome::Refused;
            let emptied: Vec<&str> =
                servers.iter().zip(&results).filter(|(_, (o, _))| maybe(o)).map(|(w, _)| w.url.as_str()).collect();
            // Every rank of each server that did it.
            for w in state.workers().iter().filter(|w| emptied.contains(&w.url.as_str())) {
                state.forget_worker_index(w.id);
            }
        }
        results
    });
    let results = match task.await {
        Ok(r) => r,
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, format!("the fan-out stopped: {e}")),
    };
    let all_ok = results.iter().all(|(o, _)| *o == Outcome::Done);
    tracing::info!(op = op.path, workers = results.len(), ok = all_ok, "worker administration");
    let status = if all_ok { StatusCode::OK } else { StatusCode::BAD_GATEWAY };
    let workers: Vec<Value> = results.into_iter().map(|(_, v)| v).collect();
    let mut reply = json!({"ok": all_ok, "workers": workers});
    if op.path == "/flush_cache" {
        reply["flushed"] = json!(all_ok);
    }
    (status, Json(reply))
}

/// What one worker made of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// It answered 2xx.
    Done,
    /// It answered otherwise (the op did not run, as far as it says).
    Refused,
    /// No answer: not reached, timed out, or cut off.
    Unknown,
}

/// One op as each worker receives it.
struct Call {
    target: String,
    body: Option<String>,
    timeout: Duration,
    key: Option<String>,
}

impl Call {
    /// [`Call::on`] once one of the [`MAX_CONCURRENT_CALLS`] places is free.
    async fn bounded(&self, w: &WorkerEntry) -> (Outcome, Value) {
        // The semaphore is never closed: a permit always comes.
        let _permit = CALLS.acquire().await.ok();
        self.on(w).await
    }

    /// How `w` took it, and what to report of it.
    async fn on(&self, w: &WorkerEntry) -> (Outcome, Value) {
        let report = |fields: Value| {
            let mut v = json!({"url": w.url, "role": role_name(w.role)});
            if let (Some(v), Value::Object(f)) = (v.as_object_mut(), fields) {
                v.extend(f);
            }
            v
        };
        let addr = match kvmesh_core::worker::socket_addr(&w.url) {
            Ok(addr) => addr.to_string(),
            Err(e) => return (Outcome::Refused, report(json!({"error": e.to_string(), "ok": false}))),
        };
        let (target, key) = (self.target.as_str(), self.key.as_deref());
        let outcome = match &self.body {
            Some(b) => crate::probe::post_json(&addr, target, b, self.timeout, key).await,
            None => crate::probe::request("POST", &addr, target, self.timeout, key).await,
        };
        match outcome {
            Ok((status, text)) => {
                let ok = (200..300).contains(&status);
                let answer = (text.len() <= MAX_ANSWER)
                    .then(|| serde_json::from_str::<Value>(&text).ok())
                    .flatten()
                    .unwrap_or_else(|| json!(truncated(&text)));
                let outcome = if ok { Outcome::Done } else { Outcome::Refused };
                (outcome, report(json!({"status": status, "ok": ok, "answer": answer})))
            }
            Err(e) => (Outcome::Unknown, report(json!({"error": e, "ok": false}))),
        }
    }
}

fn truncated(text: &str) -> &str {
    let mut end = text.len().min(MAX_ANSWER);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &[(&str, &str)]) -> Vec<(String, String)> {
        q.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_selectors_stay_here_and_the_rest_goes_on_encoded() {
        let s =
            selection(pairs(&[("url", "http://10.0.0.1:8000/"), ("level", "1"), ("tags", "a b&c")]), false).unwrap();
        assert_eq!(s.url.as_deref(), Some("http://10.0.0.1:8000"));
        assert_eq!(s.target("/sleep"), "/sleep?level=1&tags=a+b%26c");
        assert_eq!(selection(pairs(&[]), true).unwrap().target("/stop_profile"), "/stop_profile");
        let crlf = selection(pairs(&[("x", "1 HTTP/1.1\r\nhost: evil")]), false).unwrap().target("/wake_up");
        assert!(!crlf.contains(['\r', '\n', ' ']), "{crlf}");
        assert!(selection(pairs(&[("role", "prefill")]), false).unwrap_err().contains("mode"));
        assert_eq!(selection(pairs(&[("role", "prefill")]), true).unwrap().role, Some(Role::Prefill));
        assert!(selection(pairs(&[("k", &"v".repeat(2000))]), false).is_err());
        let t = selection(pairs(&[("timeout_secs", "5"), ("level", "1")]), false).unwrap();
        assert_eq!((t.timeout_secs, t.target("/sleep").as_str()), (Some(5), "/sleep?level=1"));
        for bad in ["0", "-1", "3601", "x", ""] {
            assert!(selection(pairs(&[("timeout_secs", bad)]), false).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_op_has_a_bounded_default() {
        assert!(OPS.iter().all(|op| op.timeout_secs <= 600), "{OPS:?}");
        assert!(OPS.iter().filter(|op| op.timeout_secs == 0).all(|op| op.path == "/flush_cache"));
    }

    #[tokio::test]
    async fn at_most_the_bound_of_calls_is_in_flight() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        let (now, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let tasks = (0..4 * MAX_CONCURRENT_CALLS).map(|_| {
            let (now, peak) = (Arc::clone(&now), Arc::clone(&peak));
            async move {
                let _permit = CALLS.acquire().await.ok();
                peak.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
                tokio::task::yield_now().await;
                now.fetch_sub(1, SeqCst);
            }
        });
        futures_util::future::join_all(tasks).await;
        assert_eq!(peak.load(SeqCst), MAX_CONCURRENT_CALLS);
    }

    #[test]
    fn answers_are_cut_on_a_character() {
        let long = "é".repeat(MAX_ANSWER);
        assert!(truncated(&long).len() <= MAX_ANSWER && truncated(&long).ends_with('é'));
        assert_eq!(truncated("short"), "short");
    }
}
