//! The engines' administration endpoints besides `/flush_cache` and `/abort_request`: weight
//! updates, profiling, memory release or sleep. Each call is recorded (`/sim/requests`: path,
//! query, body) and answered as a success; the ones that empty a real engine's KV cache empty
//! the simulated one.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::Uri;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::cli::EngineKind;
use crate::engine::Engine;

/// Each engine's paths, and whether the call empties the KV cache.
fn ops(engine: EngineKind) -> &'static [(&'static str, bool)] {
    match engine {
        EngineKind::Sglang => &[
            ("/update_weights_from_disk", true),
            ("/start_profile", false),
            ("/stop_profile", false),
            ("/release_memory_occupation", true),
            ("/resume_memory_occupation", false),
        ],
        EngineKind::Vllm => &[
            ("/reset_prefix_cache", true),
            ("/start_profile", false),
            ("/stop_profile", false),
            ("/sleep", true),
            ("/wake_up", false),
        ],
    }
}

pub fn routes(engine: EngineKind) -> Router<Arc<Engine>> {
    ops(engine).iter().fold(Router::new(), |r, &(path, drops)| {
        r.route(
            path,
            post(move |State(e): State<Arc<Engine>>, uri: Uri, RawQuery(query): RawQuery, body: Bytes| async move {
                let body = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
                e.record(json!({"path": uri.path(), "query": query, "x_request_id": null, "body": body}));
                if drops {
                    e.flush_cache();
                }
                Json(json!({"success": true, "message": format!("{path} done")}))
            }),
        )
    })
}

/// The simulator's own controls of its KV events: `POST /sim/restart` (an engine restarted in
/// place) and `POST /sim/kv_events/drop_next` (the next batch lost on the PUB socket).
pub fn kv_event_routes(engine: Arc<Engine>) -> Router {
    Router::new()
        .route(
            "/sim/restart",
            post(|State(e): State<Arc<Engine>>| async move {
                e.restart();
                Json(json!({"success": true}))
            }),
        )
        .route(
            "/sim/kv_events/drop_next",
            post(|State(e): State<Arc<Engine>>| async move {
                let on = e.kv_events.get().map(|k| k.drop_next()).is_some();
                Json(json!({"success": on}))
            }),
        )
        .with_state(engine)
}
