//! vLLM's KV-transfer protocol for disaggregated serving (the NIXL connector's, as vLLM's own
//! disaggregation proxy drives it): the gateway sends the prefill worker the client's body
//! asking for a remote decode and one token, takes the `kv_transfer_params` of its answer, and
//! sends the client's body with them to the decode worker, which pulls the KV and streams the
//! answer. Both rewrites keep every other top-level field byte for byte; only the named
//! top-level keys are touched, and nothing nested is parsed.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::request::RequestError;

/// What the prefill leg asks for, in place of the client's own fields of these names.
const PREFILL_FIELDS: &str = r#""kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false"#;

/// Client fields the prefill leg goes without (vLLM's proxy removes them: a one-token,
/// non-streaming prefill must not be held to a minimum length or stream options).
const DROPPED: [&str; 3] = ["stream_options", "min_tokens", "min_completion_tokens"];

/// The top-level members of a JSON object, in order, as borrowed raw values (no DOM: a
/// value's bytes are not parsed beyond validation).
pub(crate) fn members(body: &[u8]) -> Result<Vec<(String, &RawValue)>, RequestError> {
    struct Members;
    impl<'de> Visitor<'de> for Members {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                out.push((k, v));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let out = (&mut de).deserialize_map(Members).map_err(|e| RequestError::MalformedJson(e.to_string()))?;
    de.end().map_err(|e| RequestError::MalformedJson(e.to_string()))?;
    Ok(out)
}

/// Writes `members` back as an object, then `extra` (already `"key":value` pairs, comma
/// separated) at its end.
pub(crate) fn object(members: &[(String, &RawValue)], extra: &str, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity + extra.len() + 2);
    out.push(b'{');
    for (i, (k, v)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Keys are re-escaped by serde_json (they were unescaped when read).
        out.extend_from_slice(serde_json::to_string(k).unwrap_or_default().as_bytes());
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    if !extra.is_empty() {
        if !members.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(extra.as_bytes());
    }
    out.push(b'}');
    out
}

/// The prefill leg's body: the client's, with `kv_transfer_params` asking for a remote decode,
/// `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when the client set it),
/// and without `stream_options`, `min_tokens`, `min_completion_tokens`. A client's own
/// `kv_transfer_params` is refused (only the gateway writes it).
pub fn prefill_body(body: &[u8]) -> Result<Vec<u8>, RequestError> {
    let all = members(body)?;
    if all.iter().any(|(k, _)| k == "kv_transfer_params") {
        return Err(RequestError::Reserved("kv_transfer_params"));
    }
    let completion_tokens = all.iter().any(|(k, _)| k == "max_completion_tokens");
    let kept: Vec<(String, &RawValue)> = all
        .into_iter()
        .filter(|(k, _)| !DROPPED.contains(&k.as_str()))
        .filter(|(k, _)| !matches!(k.as_str(), "stream" | "max_tokens" | "max_completion_tokens"))
        .collect();
    let mut extra = format!("{PREFILL_FIELDS},\"max_tokens\":1");
    if completion_tokens {
        extra.push_str(",\"max_completion_tokens\":1");
    }
    Ok(object(&kept, &extra, body.len()))
}

/// The `kv_transfer_params` object of the prefill worker's JSON answer (None: not JSON, or no
/// such object — the transfer cannot happen).
pub fn transfer_params(answer: &[u8]) -> Option<Box<RawValue>> {
    let members = members(answer).ok()?;
    let (_, raw) = members.into_iter().find(|(k, _)| k == "kv_transfer_params")?;
    raw.get().trim_start().starts_with('{').then(|| raw.to_owned())
}

/// The decode leg's body: the client's, with the prefill's `kv_transfer_params`.
pub fn decode_body(body: &[u8], params: &RawValue) -> Result<Vec<u8>, RequestError> {
    let all = members(body)?;
    if all.iter().any(|(k, _)| k == "kv_transfer_params") {
        return Err(RequestError::Reserved("kv_transfer_params"));
    }
    Ok(object(&all, &format!("\"kv_transfer_params\":{}", params.get()), body.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn v(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_for_a_remote_decode_of_one_token_and_keeps_the_rest() {
        let body = br#"{"model":"m","prompt":"hi \"there\"","stream":true,"stream_options":{"include_usage":true},
            "max_tokens":50,"min_tokens":3,"temperature":0.5,"n\u00e9":[1,{"a":null}]}"#;
        let p = v(&prefill_body(body).unwrap());
        assert_eq!(
            p["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        assert_eq!((p["stream"].clone(), p["max_tokens"].clone()), (json!(false), json!(1)));
        for gone in ["stream_options", "min_tokens", "max_completion_tokens"] {
            assert!(p.get(gone).is_none(), "{gone} is dropped (or never set): {p}");
        }
        assert_eq!(p["prompt"], "hi \"there\"");
        assert_eq!(p["temperature"], 0.5);
        assert_eq!(p["né"], json!([1, {"a": null}]), "an escaped key and nested values kept");
        let chat = br#"{"messages":[],"max_completion_tokens":9,"min_completion_tokens":2}"#;
        let c = v(&prefill_body(chat).unwrap());
        assert_eq!((c["max_completion_tokens"].clone(), c.get("min_completion_tokens")), (json!(1), None));
    }

    #[test]
    fn the_decode_leg_gets_the_clients_body_and_the_prefills_params() {
        let answer = br#"{"id":"x","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e1","remote_block_ids":[1,2]}}"#;
        let params = transfer_params(answer).unwrap();
        let body = br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":50}"#;
        let d = v(&decode_body(body, &params).unwrap());
        assert_eq!(d["kv_transfer_params"]["remote_block_ids"], json!([1, 2]));
        assert_eq!((d["stream"].clone(), d["max_tokens"].clone()), (json!(true), json!(50)), "the client's own");
        assert!(transfer_params(br#"{"kv_transfer_params":null}"#).is_none());
        assert!(transfer_params(br#"{"kv_transfer_params":[1]}"#).is_none());
        assert!(transfer_params(b"not json").is_none());
    }

    #[test]
    fn a_clients_own_params_or_a_broken_body_are_refused() {
        let own = br#"{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.6.6.6"}}"#;
        assert_eq!(prefill_body(own), Err(RequestError::Reserved("kv_transfer_params")));
        let params = RawValue::from_string("{}".into()).unwrap();
        assert_eq!(decode_body(own, &params), Err(RequestError::Reserved("kv_transfer_params")));
        assert!(matches!(prefill_body(b"[1]"), Err(RequestError::MalformedJson(_))));
        assert!(matches!(prefill_body(br#"{"a":1} trailing"#), Err(RequestError::MalformedJson(_))));
        assert_eq!(v(&prefill_body(b"{}").unwrap())["max_tokens"], 1);
    }
}
