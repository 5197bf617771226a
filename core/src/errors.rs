//! The OpenAI-style error body every gateway error uses:
//! `{"error": {"message": ..., "type": ..., "code": ...}}`.

use serde::Serialize;

#[derive(Serialize)]
pub struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
}

impl<'a> ErrorBody<'a> {
    /// `kind` follows the HTTP status: client errors are `invalid_request_error`, the rest
    /// `server_error` (as OpenAI's API names them).
    pub fn new(status: u16, code: &'a str, message: &'a str) -> Self {
        let kind = if (400..500).contains(&status) { "invalid_request_error" } else { "server_error" };
        Self { error: ErrorFields { message, kind, code } }
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The JSON body for `status` with `code` and `message`.
pub fn error_json(status: u16, code: &str, message: &str) -> Vec<u8> {
    ErrorBody::new(status, code, message).to_json()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_escaping() {
        let v: serde_json::Value =
            serde_json::from_slice(&error_json(400, "invalid_field", "field `text` \"x\"")).unwrap();
        assert_eq!(v["error"]["message"], "field `text` \"x\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_field");
        let v: serde_json::Value = serde_json::from_slice(&error_json(503, "no_healthy_worker", "m")).unwrap();
        assert_eq!(v["error"]["type"], "server_error");
    }
}
