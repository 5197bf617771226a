//! What a client may read of a worker's answer on a passthrough path. Engines put secrets in
//! some of their read-only answers: SGLang's `/get_server_info` returns its `server_args`,
//! `api_key` and `admin_api_key` among them, and the gateway itself adds the workers' key to
//! the requests it passes through. [`redact`] takes both out of a response body:
//!
//! - in a JSON body, the value of every member whose name says it holds a secret
//!   ([`is_secret_name`]: `api_key`, `*_api_key`, `*secret*`, `*password*`, `token`, `*_token`,
//!   `authorization`, `*credential*`), at any depth, becomes `"<redacted>"`;
//! - in any body, every occurrence of the key the gateway sends (as written, and as JSON
//!   escapes it) becomes `<redacted>`.
//!
//! A body over [`MAX_REDACTED_BYTES`] is not read: it is withheld whole ([`withheld`]).

use serde_json::Value;

/// What replaces a secret.
pub const REDACTED: &str = "<redacted>";

/// The largest passthrough answer the gateway reads through (server info is a few KiB).
pub const MAX_REDACTED_BYTES: usize = 4 << 20;

/// Whether a JSON member named `name` holds a secret.
pub fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.ends_with("api_key")
        || n.ends_with("apikey")
        || n.contains("secret")
        || n.contains("password")
        || n.contains("credential")
        || n == "token"
        || n.ends_with("_token")
        || n == "authorization"
}

/// `body` with its secrets redacted, or `None` when it holds none (it goes on unchanged).
/// `key` is the credential the gateway added to the request (none: only names are looked at).
pub fn redact(body: &[u8], key: Option<&str>) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    if matches!(body.iter().find(|b| !b.is_ascii_whitespace()), Some(b'{' | b'[')) {
        if let Ok(mut value) = serde_json::from_slice::<Value>(body) {
            if redact_names(&mut value) {
                out = serde_json::to_vec(&value).ok();
            }
        }
    }
    let key = key.filter(|k| !k.is_empty());
    if let Some(key) = key {
        let escaped = serde_json::to_string(key).unwrap_or_default();
        let escaped = escaped.get(1..escaped.len().saturating_sub(1)).unwrap_or(key);
        let current = out.as_deref().unwrap_or(body);
        if let Some(replaced) = replace_all(current, &[key.as_bytes(), escaped.as_bytes()]) {
            out = Some(replaced);
        }
    }
    out
}

/// The body that replaces an answer too large to read through.
pub fn withheld(size: usize) -> Vec<u8> {
    let msg = format!("the worker's answer ({size} bytes) is over {MAX_REDACTED_BYTES} bytes; the gateway withheld it");
    crate::errors::error_json(502, "response_withheld", &msg)
}

/// Redacts secret members in place; whether any was found.
fn redact_names(value: &mut Value) -> bool {
    match value {
        Value::Object(map) => {
            let mut found = false;
            for (name, v) in map.iter_mut() {
                if is_secret_name(name) && !v.is_null() && !matches!(v, Value::Bool(_)) && v.as_str() != Some("") {
                    *v = Value::from(REDACTED);
                    found = true;
                } else {
                    found |= redact_names(v);
                }
            }
            found
        }
        Value::Array(items) => items.iter_mut().fold(false, |found, v| redact_names(v) | found),
        _ => false,
    }
}

/// `body` with every occurrence of any of `needles` (longest first) replaced, or `None`.
fn replace_all(body: &[u8], needles: &[&[u8]]) -> Option<Vec<u8>> {
    let mut needles: Vec<&[u8]> = needles.iter().copied().filter(|n| !n.is_empty()).collect();
    needles.sort_by_key(|n| std::cmp::Reverse(n.len()));
    needles.dedup();
    let mut out: Option<Vec<u8>> = None;
    let (mut copied, mut i) = (0, 0);
    while i < body.len() {
        match needles.iter().find(|n| body.get(i..i + n.len()) == Some(**n)) {
            Some(n) => {
                let o = out.get_or_insert_with(|| Vec::with_capacity(body.len()));
                o.extend_from_slice(body.get(copied..i).unwrap_or_default());
                o.extend_from_slice(REDACTED.as_bytes());
                i += n.len();
                copied = i;
            }
            None => i += 1,
        }
    }
    let mut o = out?;
    o.extend_from_slice(body.get(copied..).unwrap_or_default());
    Some(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_loses_its_keys_and_keeps_the_rest() {
        let body = br#"{"model_path":"m","api_key":"sk-1","admin_api_key":"adm","max_total_num_tokens":9,
            "hf_token":"hf","ssl_keyfile_password":"p","enable_metrics":true,"nested":[{"client_secret":"s"}],
            "api_key_unset":null,"tokenizer_path":"t"}"#;
        let out: Value = serde_json::from_slice(&redact(body, None).unwrap()).unwrap();
        for k in ["api_key", "admin_api_key", "hf_token", "ssl_keyfile_password"] {
            assert_eq!(out[k], REDACTED, "{k}");
        }
        assert_eq!(out["nested"][0]["client_secret"], REDACTED);
        assert_eq!((out["max_total_num_tokens"].clone(), out["tokenizer_path"].clone()), (Value::from(9), "t".into()));
        assert_eq!(out["enable_metrics"], true);
    }

    #[test]
    fn the_gateways_key_is_taken_out_wherever_it_is() {
        let key = "k3y\"with\\quote";
        let json = serde_json::to_vec(&serde_json::json!({"args": format!("--api-key {key} --port 1")})).unwrap();
        let out = redact(&json, Some(key)).unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("k3y"), "{}", String::from_utf8_lossy(&out));
        let text = format!("# args: --api-key {key}\nup 1\n{key}");
        let out = String::from_utf8(redact(text.as_bytes(), Some(key)).unwrap()).unwrap();
        assert_eq!(out, "# args: --api-key <redacted>\nup 1\n<redacted>");
    }

    #[test]
    fn a_body_without_secrets_is_left_alone() {
        assert_eq!(redact(br#"{"model_path":"m","is_generation":true}"#, Some("sk")), None);
        assert_eq!(redact(b"OK", Some("sk")), None);
        assert_eq!(redact(b"{not json", None), None);
        assert_eq!(redact(b"", Some("sk")), None);
    }
}
