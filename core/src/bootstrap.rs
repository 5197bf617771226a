//! PD bootstrap injection: what SGLang's router adds to both legs of a disaggregated request.
//!
//! `bootstrap_host` (the prefill worker's host), `bootstrap_port` (its bootstrap port, or
//! null for `none`) and `bootstrap_room` (a random 63-bit id the decode worker uses to fetch
//! the KV) go into the body, identical for both legs; for a batch of N each is a list of N
//! (rooms distinct). The gateway's own request id is always the `rid`, in place of any the
//! client set (SGLang aborts every request whose rid starts with the one it is given, so
//! neither a client's `rid` nor its `x-request-id` may name what a worker aborts; and a
//! client's rid could repeat another's on the same worker). Every other field passes through
//! byte for byte: the fields are spliced in before the object's closing brace. A client may
//! not send `bootstrap_*` fields itself: the decode worker would fetch KV from a host the
//! client picked.

use serde_json::Value;

use crate::request::{Endpoint, ParsedRequest, RequestError};

/// The fields to inject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: Option<u16>,
    /// One room per item (one for a single request).
    pub rooms: Vec<u64>,
    /// The gateway's id for this request (random): the `rid`s are made from it.
    pub rid: u64,
}

/// The rid of item `item` of the request the gateway numbered `id`: `kvmesh-<16 hex>-<4 digits>`,
/// one length for every rid (a batch has at most 4096 items), so that no rid is a prefix of
/// another and an `/abort_request` by one stops that item alone.
pub fn rid(id: u64, item: usize) -> String {
    format!("kvmesh-{id:016x}-{item:04}")
}

/// The `rid` field's value for the request numbered `id`: one rid, or for a batch `/generate`
/// (SGLang takes one rid per item there) a list of them.
fn rid_value(parsed: &ParsedRequest<'_>, id: u64) -> Value {
    match (parsed.endpoint, parsed.batch) {
        (Endpoint::Generate, Some(n)) => Value::Array((0..n).map(|i| Value::from(rid(id, i))).collect()),
        _ => Value::from(rid(id, 0)),
    }
}

/// `n` random rooms below 2^63 (sglang-router masks a random u64 to 63 bits).
pub fn random_rooms(n: usize, rng: impl FnMut() -> u64) -> Vec<u64> {
    let mut next = rng;
    (0..n.max(1)).map(|_| next() & (i64::MAX as u64)).collect()
}

impl Bootstrap {
    fn fields(&self, parsed: &ParsedRequest<'_>) -> Vec<(&'static str, Value)> {
        let host = Value::from(self.host.as_str());
        let port = self.port.map_or(Value::Null, Value::from);
        let mut fields = match parsed.batch {
            Some(n) => vec![
                ("bootstrap_host", Value::Array(vec![host; n])),
                ("bootstrap_port", Value::Array(vec![port; n])),
                ("bootstrap_room", Value::Array(self.rooms.iter().take(n).map(|&r| Value::from(r)).collect())),
            ],
            None => vec![
                ("bootstrap_host", host),
                ("bootstrap_port", port),
                ("bootstrap_room", Value::from(self.rooms.first().copied().unwrap_or(0))),
            ],
        };
        if parsed.rid_at.is_none() {
            fields.push(("rid", rid_value(parsed, self.rid)));
        }
        fields
    }

    /// The rids the gateway gives the request's items: what the prefill leg can be aborted by
    /// (`/abort_request`). At most `max` of them.
    pub fn injected_rids(&self, parsed: &ParsedRequest<'_>, max: usize) -> Vec<String> {
        match (parsed.endpoint, parsed.batch) {
            (Endpoint::Generate, Some(n)) => (0..n.min(max)).map(|i| rid(self.rid, i)).collect(),
            _ => vec![rid(self.rid, 0)],
        }
    }

    /// The body both legs receive: `body` with the client's `rid` value (if any) replaced by
    /// the gateway's and the other fields spliced in before its closing brace, every other
    /// byte unchanged. A body carrying its own `bootstrap_*` fields is refused (only the
    /// gateway writes them).
    pub fn inject(&self, body: &[u8], parsed: &ParsedRequest<'_>) -> Result<Vec<u8>, RequestError> {
        if let Some(field) = parsed.client_bootstrap {
            return Err(RequestError::Reserved(field));
        }
        let fields = self.fields(parsed);
        match own_rid(body, parsed, self.rid)? {
            Some(replaced) => splice(&replaced, &fields),
            None => splice(body, &fields),
        }
        .ok_or(RequestError::NotAnObject)
    }
}

/// `body` with the gateway's rids (made from `id`) in place of the client's `rid`, every other
/// byte unchanged; None when the client set none. For a PD request that goes to one worker
/// alone (no bootstrap fields), as for both legs of a split.
pub fn own_rid(body: &[u8], parsed: &ParsedRequest<'_>, id: u64) -> Result<Option<Vec<u8>>, RequestError> {
    let Some(at) = parsed.rid_at.clone() else { return Ok(None) };
    let (Some(head), Some(tail)) = (body.get(..at.start), body.get(at.end..)) else {
        return Err(RequestError::NotAnObject);
    };
    let value = rid_value(parsed, id);
    let mut replaced = Vec::with_capacity(body.len() + 64);
    replaced.extend_from_slice(head);
    serde_json::to_writer(&mut replaced, &value).map_err(|_| RequestError::NotAnObject)?;
    replaced.extend_from_slice(tail);
    Ok(Some(replaced))
}

/// Appends `fields` inside the top-level object, before its closing brace.
pub(crate) fn splice(body: &[u8], fields: &[(&str, Value)]) -> Option<Vec<u8>> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    let (head, tail) = body.split_at_checked(end)?;
    if tail.first() != Some(&b'}') {
        return None;
    }
    let empty = head.iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let mut out = Vec::with_capacity(body.len() + 160);
    out.extend_from_slice(head);
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 || !empty {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b"\":");
        // Straight into the body (a `Value` is always serializable): no string in between.
        serde_json::to_writer(&mut out, v).ok()?;
    }
    out.extend_from_slice(tail);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse;

    fn boot(port: Option<u16>, rooms: Vec<u64>) -> Bootstrap {
        Bootstrap { host: "10.0.0.7".into(), port, rooms, rid: 0xabc }
    }

    fn inject(endpoint: Endpoint, body: &str, b: &Bootstrap) -> Value {
        let parsed = parse(endpoint, body.as_bytes()).unwrap();
        let out = b.inject(body.as_bytes(), &parsed).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn single_request_gets_the_three_fields_and_rid() {
        let v = inject(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0.7}"#,
            &boot(Some(8998), vec![42]),
        );
        assert_eq!(v["bootstrap_host"], "10.0.0.7");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["rid"], "kvmesh-0000000000000abc-0000");
        assert_eq!(v["temperature"], 0.7, "other fields pass through");
    }

    #[test]
    fn the_rids_to_abort_are_the_ones_injected() {
        let b = boot(Some(1), vec![1, 2, 3]);
        let single = parse(Endpoint::Generate, br#"{"text":"a"}"#).unwrap();
        assert_eq!(b.injected_rids(&single, 16), vec!["kvmesh-0000000000000abc-0000"]);
        let batch = parse(Endpoint::Generate, br#"{"text":["a","b","c"]}"#).unwrap();
        assert_eq!(
            b.injected_rids(&batch, 2),
            vec!["kvmesh-0000000000000abc-0000", "kvmesh-0000000000000abc-0001"],
            "capped"
        );
        let own = parse(Endpoint::Generate, br#"{"text":"a","rid":"mine"}"#).unwrap();
        assert_eq!(b.injected_rids(&own, 16), vec!["kvmesh-0000000000000abc-0000"], "the client's rid is replaced");
    }

    #[test]
    fn none_port_is_json_null() {
        let v = inject(Endpoint::Generate, r#"{"text":"a"}"#, &boot(None, vec![1]));
        assert!(v["bootstrap_port"].is_null() && v.get("bootstrap_port").is_some());
    }

    #[test]
    fn a_request_without_a_split_gets_the_gateways_rid_only_in_place_of_the_clients() {
        let body = br#"{"text":"a","rid":"req-1"}"#;
        let parsed = parse(Endpoint::Generate, body).unwrap();
        let out: Value = serde_json::from_slice(&own_rid(body, &parsed, 0xabc).unwrap().unwrap()).unwrap();
        assert_eq!(out, serde_json::json!({"text": "a", "rid": rid(0xabc, 0)}));
        let none = parse(Endpoint::Generate, br#"{"text":"a"}"#).unwrap();
        assert_eq!(own_rid(br#"{"text":"a"}"#, &none, 1), Ok(None), "nothing to replace: the body stays");
    }

    /// A client's `rid` (a prefix of other requests' rids, or another client's) never reaches
    /// a worker: the gateway's stands in its place, once, the other bytes unchanged.
    #[test]
    fn the_clients_rid_is_replaced_in_place() {
        let b = boot(Some(1), vec![7, 8]);
        for (endpoint, body, want) in [
            (Endpoint::Generate, r#"{"rid":"kvmesh-","text":"a"}"#, serde_json::json!(rid(0xabc, 0))),
            (Endpoint::Generate, r#"{"text":"a", "rid" : null}"#, serde_json::json!(rid(0xabc, 0))),
            (
                Endpoint::Generate,
                r#"{"text":["a","b"],"rid":["x","y"]}"#,
                serde_json::json!([rid(0xabc, 0), rid(0xabc, 1)]),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"hi"}],"rid":{"nested":"}"}}"#,
                serde_json::json!(rid(0xabc, 0)),
            ),
        ] {
            let parsed = parse(endpoint, body.as_bytes()).unwrap();
            let out = String::from_utf8(b.inject(body.as_bytes(), &parsed).unwrap()).unwrap();
            assert_eq!(out.matches("\"rid\"").count(), 1, "one rid: {out}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["rid"], want, "{body}");
            assert!(out.starts_with(&body[..body.find("\"rid\"").unwrap()]), "bytes before it unchanged: {out}");
        }
    }

    #[test]
    fn batches_get_lists_with_distinct_rooms() {
        let v = inject(Endpoint::Generate, r#"{"text":["a","b","c"]}"#, &boot(Some(9), vec![1, 2, 3]));
        assert_eq!(v["bootstrap_host"], serde_json::json!(["10.0.0.7", "10.0.0.7", "10.0.0.7"]));
        assert_eq!(v["bootstrap_port"], serde_json::json!([9, 9, 9]));
        assert_eq!(v["bootstrap_room"], serde_json::json!([1, 2, 3]));
        assert_eq!(v["rid"], serde_json::json!([rid(0xabc, 0), rid(0xabc, 1), rid(0xabc, 2)]));
        let v = inject(Endpoint::Completions, r#"{"prompt":["a","b"]}"#, &boot(None, vec![5, 6]));
        assert_eq!(v["bootstrap_port"], serde_json::json!([null, null]));
        assert_eq!(v["rid"], "kvmesh-0000000000000abc-0000");
    }

    #[test]
    fn splicing_keeps_the_body_bytes_and_handles_empty_objects() {
        let body = "{\"text\": \"a\",  \"x\": {\"y\": 1}}\n";
        let parsed = parse(Endpoint::Generate, body.as_bytes()).unwrap();
        let out = String::from_utf8(boot(Some(1), vec![2]).inject(body.as_bytes(), &parsed).unwrap()).unwrap();
        assert!(out.starts_with("{\"text\": \"a\",  \"x\": {\"y\": 1},\"bootstrap_host\""), "{out}");
        assert_eq!(splice(b"{ }", &[("a", Value::from(1))]).unwrap(), b"{ \"a\":1}");
    }

    #[test]
    fn client_bootstrap_fields_are_refused() {
        for field in ["bootstrap_room", "bootstrap_host", "bootstrap_port"] {
            let body = format!(r#"{{"text":"a","{field}":7}}"#);
            let parsed = parse(Endpoint::Generate, body.as_bytes()).unwrap();
            let e = boot(Some(1), vec![99]).inject(body.as_bytes(), &parsed).unwrap_err();
            assert_eq!(e, RequestError::Reserved(field));
            assert!(e.to_string().contains(field) && e.status() == 400);
        }
    }

    #[test]
    fn rooms_are_63_bit() {
        let rooms = random_rooms(3, || u64::MAX);
        assert_eq!(rooms, vec![i64::MAX as u64; 3]);
        assert_eq!(random_rooms(0, || 5).len(), 1);
    }

    /// SGLang aborts by rid prefix: the gateway's rids all have one length, so none is a
    /// prefix of another, whatever the ids and items (`req-1` would be a prefix of `req-10`).
    #[test]
    fn no_rid_is_a_prefix_of_another() {
        let rids: Vec<String> =
            [0u64, 1, 0x10, u64::MAX].iter().flat_map(|&id| [0, 1, 10, 4095].map(|i| rid(id, i))).collect();
        for a in &rids {
            for b in rids.iter().filter(|b| *b != a) {
                assert!(!b.starts_with(a.as_str()), "{a} is a prefix of {b}");
            }
        }
        assert!(rids.iter().all(|r| r.len() == rids[0].len()));
    }
}
