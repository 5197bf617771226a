//! PD KV transfer, simulated: a prefill worker publishes the KV of each `bootstrap_room` on
//! its bootstrap port; a decode worker fetches it from `bootstrap_host:bootstrap_port`,
//! waiting a bounded time for the prefill to get there. A wrong host, port or room, or a KV
//! computed for another prompt, fails the decode — so a wrong pairing is visible.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

/// What a prefill leaves for the decode: which prompt it computed, and how long it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomKv {
    pub prompt_hash: u64,
    pub tokens: u64,
}

/// The rooms a prefill worker holds.
#[derive(Default)]
pub struct Rooms {
    kv: Mutex<Held>,
    published: Notify,
}

/// The rooms held and the order they were published in, so that the oldest go first, one at a
/// time: past [`MAX_ROOMS`] or [`KEEP`]. (A scan of every room once the table was full made
/// each publish of a busy prefill worker cost milliseconds under the lock.)
#[derive(Default)]
struct Held {
    map: HashMap<u64, (RoomKv, Instant)>,
    order: VecDeque<(u64, Instant)>,
}

const KEEP: Duration = Duration::from_secs(120);
const MAX_ROOMS: usize = 100_000;

impl Rooms {
    pub fn publish(&self, room: u64, kv: RoomKv) {
        if let Ok(mut held) = self.kv.lock() {
            let now = Instant::now();
            held.map.insert(room, (kv, now));
            held.order.push_back((room, now));
            while let Some(&(old, at)) = held.order.front() {
                if held.order.len() <= MAX_ROOMS && at.elapsed() < KEEP {
                    break;
                }
                held.order.pop_front();
                // Unless the room was published again since.
                if held.map.get(&old).is_some_and(|(_, t)| *t == at) {
                    held.map.remove(&old);
                }
            }
        }
        self.published.notify_waiters();
    }

    fn get(&self, room: u64) -> Option<RoomKv> {
        self.kv.lock().ok()?.map.get(&room).map(|(kv, _)| *kv)
    }

    /// The room's KV, waiting up to `wait` for it to be published.
    async fn wait_for(&self, room: u64, wait: Duration) -> Option<RoomKv> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.published.notified();
            if let Some(kv) = self.get(room) {
                return Some(kv);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.get(room);
            }
        }
    }
}

#[derive(Deserialize)]
struct Wait {
    wait_ms: Option<u64>,
}

async fn fetch_room(
    State(rooms): State<Arc<Rooms>>,
    Path(room): Path<u64>,
    Query(q): Query<Wait>,
) -> (StatusCode, Json<Value>) {
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0).min(60_000));
    match rooms.wait_for(room, wait).await {
        Some(kv) => (StatusCode::OK, Json(json!({"room": room, "prompt_hash": kv.prompt_hash, "tokens": kv.tokens}))),
        None => (StatusCode::NOT_FOUND, Json(json!({"error": format!("no KV for bootstrap_room {room}")}))),
    }
}

/// The bootstrap server of a prefill worker.
pub fn router(rooms: Arc<Rooms>) -> Router {
    Router::new().route("/kv/{room}", get(fetch_room)).with_state(rooms)
}

/// Fetches `room` from a prefill worker's bootstrap server at `host:port` (a decode
/// worker's side of the transfer).
pub async fn fetch(host: &str, port: u16, room: u64, wait: Duration) -> Result<RoomKv, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let target = format!("{host}:{port}");
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(&target).await.map_err(|e| format!("cannot connect: {e}"))?;
        let req = format!("GET /kv/{room}?wait_ms={} HTTP/1.0\r\nhost: {target}\r\n\r\n", wait.as_millis());
        conn.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut resp = Vec::new();
        conn.read_to_end(&mut resp).await.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&resp);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            return Err(format!("no KV for this room ({})", head.lines().next().unwrap_or("no answer")));
        }
        let v: Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
        Ok(RoomKv { prompt_hash: v["prompt_hash"].as_u64().unwrap_or(0), tokens: v["tokens"].as_u64().unwrap_or(0) })
    };
    match tokio::time::timeout(wait + Duration::from_secs(2), attempt).await {
        Ok(r) => r.map_err(|e| format!("cannot fetch KV for bootstrap_room {room} from {target}: {e}")),
        Err(_) => Err(format!("cannot fetch KV for bootstrap_room {room} from {target}: timed out")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_lets_the_oldest_rooms_go_one_by_one() {
        let rooms = Rooms::default();
        let kv = |n: u64| RoomKv { prompt_hash: n, tokens: 1 };
        for room in 0..(MAX_ROOMS as u64 + 10) {
            rooms.publish(room, kv(room));
        }
        // Room 3 published again: it stays while its first publication goes.
        rooms.publish(3, kv(33));
        assert_eq!(rooms.get(3), Some(kv(33)));
        assert_eq!((rooms.get(2), rooms.get(10), rooms.get(11)), (None, None, Some(kv(11))));
        let held = rooms.kv.lock().unwrap();
        assert_eq!(held.order.len(), MAX_ROOMS, "one room in, the oldest out");
        assert!(held.map.len() <= MAX_ROOMS);
    }
}
