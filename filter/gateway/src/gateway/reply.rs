//! The gateway's own answers: JSON errors in the SPEC's shape.

use kvmesh_core::errors::error_json;
use kvmesh_core::models::{ModelError, ServedModel};
use kvmesh_core::request::RequestError;
use serde_json::{json, Value};

#[derive(Debug, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    /// Seconds for a `retry-after` header.
    pub retry_after: Option<u32>,
    /// The methods an `allow` header lists (405).
    pub allow: Option<&'static str>,
    /// More headers (a rate limit's `x-ratelimit-*`).
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    pub fn error(status: u16, code: &str, message: &str) -> Self {
        Self { status, body: error_json(status, code, message), retry_after: None, allow: None, headers: Vec::new() }
    }

    /// 405 for an LLM endpoint asked with another method than POST.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let msg = format!("{method} is not allowed on {path}: use POST");
        Self { allow: Some("POST"), ..Self::error(405, "method_not_allowed", &msg) }
    }

    /// 404 for a path the gateway does not serve (worker admin operations among them).
    pub fn not_found(method: &str, path: &str) -> Self {
        let msg = format!(
            "{method} {path} is not served by the gateway (LLM endpoints: POST /generate, /v1/chat/completions, \
             /v1/completions; read-only worker endpoints such as GET /v1/models; worker administration goes \
             through kvmesh-cp)"
        );
        Self::error(404, "not_found", &msg)
    }

    pub fn request(e: &RequestError) -> Self {
        Self::error(e.status(), e.code(), &e.to_string())
    }

    /// A request whose `model` names no pool: 404 `model_not_found` for a name no worker
    /// serves, 400 when it names none and several are served.
    pub fn model(e: &ModelError) -> Self {
        match e {
            ModelError::Unknown(_) => Self::error(404, "model_not_found", &e.to_string()),
            ModelError::Required(_) => Self::error(400, "missing_field", &e.to_string()),
        }
    }

    /// 200 with OpenAI's model list (`GET /v1/models`).
    pub(super) fn models(served: &[&ServedModel]) -> Self {
        let data: Vec<Value> = served.iter().map(|m| card(m)).collect();
        Self::json(&json!({"object": "list", "data": data}))
    }

    /// 200 with one model's card (`GET /v1/models/{id}`).
    pub(super) fn model_card(m: &ServedModel) -> Self {
        Self::json(&card(m))
    }

    fn json(value: &Value) -> Self {
        Self {
            status: 200,
            body: serde_json::to_vec(value).unwrap_or_default(),
            retry_after: None,
            allow: None,
            headers: Vec::new(),
        }
    }

    /// 503 with retry-after: none available, or (`full`) all of them overloaded.
    pub(super) fn no_worker_or_full(what: &str, full: bool) -> Self {
        if !full {
            return Self::no_worker(what);
        }
        Self {
            retry_after: Some(1),
            ..Self::error(
                503,
                "overloaded",
                &format!("every {what} is overloaded (queue or KV cache full); retry later"),
            )
        }
    }

    pub(super) fn no_worker(what: &str) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::error(503, "no_healthy_worker", &format!("no healthy {what} is available"))
        }
    }
}

/// A model's card in OpenAI's shape; an adapter names its base model as `parent`.
fn card(m: &ServedModel) -> Value {
    let owned_by = if m.owned_by.is_empty() { "kvmesh" } else { m.owned_by.as_str() };
    json!({
        "id": m.id,
        "object": "model",
        "created": 0,
        "owned_by": owned_by,
        "parent": m.parent,
    })
}
