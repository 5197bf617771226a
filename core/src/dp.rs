//! Data-parallel ranks (`--dp-aware`, as sglang-router and SMG): a worker running SGLang with
//! data-parallel attention has `dp_size` schedulers, each with its own KV cache. The control
//! plane lists each rank as a worker of its own (same address, own id, load and prefix index),
//! and the body sent to a rank names it: `"data_parallel_rank": <rank>`, which SGLang's DP
//! controller obeys. The gateway's rank replaces any the client sent (a client does not pick
//! where its request runs), and a rank the gateway does not write is taken out of the body
//! ([`without_rank`]): a worker never sees a client's; every other byte of the body is kept.

use serde_json::Value;

use crate::bootstrap::splice;
use crate::request::{ParsedRequest, RequestError};
use crate::vllm::{members, object};

/// The body field SGLang reads the rank from.
pub const FIELD: &str = "data_parallel_rank";

/// The most ranks one worker may have (kvmesh-cp ignores a larger `dp_size`).
pub const MAX_DP_SIZE: u32 = 64;

/// `body` for rank `rank`: `"data_parallel_rank": rank` at the end of the top-level object, in
/// place of the client's own when it sent one.
pub fn with_rank(body: &[u8], parsed: &ParsedRequest<'_>, rank: u32) -> Result<Vec<u8>, RequestError> {
    if !parsed.client_dp_rank {
        return splice(body, &[(FIELD, Value::from(rank))]).ok_or(RequestError::NotAnObject);
    }
    let kept: Vec<_> = members(body)?.into_iter().filter(|(k, _)| k != FIELD).collect();
    Ok(object(&kept, &format!("\"{FIELD}\":{rank}"), body.len()))
}

/// `body` without its top-level `data_parallel_rank` (every one, should the client have sent
/// several): what a worker gets when the gateway names no rank. SGLang's DP controller indexes
/// its schedulers by the value, so a client's would pick (or break) the scheduler.
pub fn without_rank(body: &[u8]) -> Result<Vec<u8>, RequestError> {
    let kept: Vec<_> = members(body)?.into_iter().filter(|(k, _)| k != FIELD).collect();
    Ok(object(&kept, "", body.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, Endpoint};

    fn ranked(endpoint: Endpoint, body: &str, rank: u32) -> Value {
        let parsed = parse(endpoint, body.as_bytes()).unwrap();
        serde_json::from_slice(&with_rank(body.as_bytes(), &parsed, rank).unwrap()).unwrap()
    }

    #[test]
    fn the_rank_is_added_to_every_endpoint_and_the_rest_is_kept() {
        let v = ranked(Endpoint::Generate, r#"{"text":"hi","sampling_params":{"max_new_tokens":3}}"#, 1);
        assert_eq!(v[FIELD], 1);
        assert_eq!(v["sampling_params"]["max_new_tokens"], 3);
        let v = ranked(Endpoint::ChatCompletions, r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#, 0);
        assert_eq!((v[FIELD].clone(), v["model"].clone()), (Value::from(0), Value::from("m")));
        let v = ranked(Endpoint::Completions, r#"{"prompt":["a","b"]}"#, 7);
        assert_eq!(v[FIELD], 7);
        let body = "{\"text\": \"a\" }\n";
        let parsed = parse(Endpoint::Generate, body.as_bytes()).unwrap();
        let out = with_rank(body.as_bytes(), &parsed, 2).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "{\"text\": \"a\" ,\"data_parallel_rank\":2}\n", "bytes kept");
    }

    #[test]
    fn a_clients_own_rank_is_replaced_not_duplicated() {
        for own in ["3", "\"0\"", "null", "[1,2]", "{\"a\":1}"] {
            let body = format!(r#"{{"data_parallel_rank":{own},"text":"hi","n\u00e9":1}}"#);
            let parsed = parse(Endpoint::Generate, body.as_bytes()).unwrap();
            assert!(parsed.client_dp_rank, "{own}");
            let out = String::from_utf8(with_rank(body.as_bytes(), &parsed, 1).unwrap()).unwrap();
            assert_eq!(out.matches(FIELD).count(), 1, "{out}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!((v[FIELD].clone(), v["né"].clone()), (Value::from(1), Value::from(1)), "{out}");
        }
        let parsed = parse(Endpoint::Generate, br#"{"text":"a"}"#).unwrap();
        assert!(!parsed.client_dp_rank);
    }

    #[test]
    fn a_rank_the_gateway_does_not_write_is_taken_out() {
        for (i, own) in ["7", "-1", "4096", "\"1\"", "null"].into_iter().enumerate() {
            // Spelled with an escape too: it is the same key to the worker's JSON parser.
            let key = if i % 2 == 0 { "data_parallel_rank" } else { "data_parall\\u0065l_rank" };
            let body = format!(r#"{{"text":"hi","{key}":{own},"x":[1]}}"#);
            let parsed = parse(Endpoint::Generate, body.as_bytes()).unwrap();
            assert!(parsed.client_dp_rank, "{own}");
            let out = without_rank(body.as_bytes()).unwrap();
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v, serde_json::json!({"text": "hi", "x": [1]}), "{own}");
            assert!(!parse(Endpoint::Generate, &out).unwrap().client_dp_rank);
        }
    }
}
