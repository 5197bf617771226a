//! What the simulator needs from a request body: the prompt of each item (as bytes, token
//! ids as 4 bytes each), the output length, streaming, and request ids.
//!
//! The simulator reads bodies on its own, with `serde_json::Value`, as a real server would,
//! and shares no parsing code with the gateway (`kvmesh-core`): a body the gateway forwards
//! wrongly, or a routing text the gateway extracts wrongly, shows up in the end-to-end tests
//! as a 400 or a cache that does not hit, instead of being hidden by the same bug on both
//! sides.

use serde_json::{Map, Value};

use crate::cache::tokens_of;

/// The LLM endpoints a worker serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// SGLang native `POST /generate`.
    Generate,
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
}

#[derive(Debug)]
pub struct Prompt {
    pub bytes: Vec<u8>,
    pub tokens: u64,
}

/// The PD fields of one item.
#[derive(Clone, Debug, Default)]
pub struct Boot {
    pub host: Option<String>,
    /// `Some(None)`: present and null (use the default bootstrap port).
    pub port: Option<Option<u16>>,
    pub room: Option<u64>,
}

#[derive(Debug)]
pub struct Job {
    pub items: Vec<Prompt>,
    pub boots: Vec<Boot>,
    pub logprobs: Vec<bool>,
    /// Whether the client sent a list (a batch), even of one.
    pub batch: bool,
    pub max_tokens: u64,
    pub stream: bool,
    pub include_usage: bool,
    pub rids: Vec<Option<String>>,
}

fn wrong(field: &str, expected: &str) -> String {
    format!("field `{field}` must be {expected}")
}

fn text_prompt(s: &str) -> Prompt {
    Prompt { bytes: s.as_bytes().to_vec(), tokens: tokens_of(s.len()) }
}

/// A non-empty list of token ids (each fits in 32 bits), as 4 little-endian bytes each.
fn ids_prompt(ids: &[Value]) -> Option<Prompt> {
    if ids.is_empty() {
        return None;
    }
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        let id = u32::try_from(id.as_u64()?).ok()?;
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    Some(Prompt { tokens: ids.len() as u64, bytes })
}

/// A string, a list of strings (batch), a list of token ids, or a list of lists of token ids
/// (batch). `texts_only` refuses token ids (`/generate`'s `text`).
fn prompts(v: &Value, field: &str, texts_only: bool) -> Result<(Vec<Prompt>, bool), String> {
    let expected = if texts_only {
        "a string or a non-empty list of strings"
    } else {
        "a string, a non-empty list of strings, or (lists of) token ids"
    };
    let bad = || wrong(field, expected);
    let Value::Array(items) = v else {
        return v.as_str().map(|s| (vec![text_prompt(s)], false)).ok_or_else(bad);
    };
    match items.first() {
        None => Err(bad()),
        Some(Value::String(_)) => {
            let out: Option<Vec<Prompt>> = items.iter().map(|i| i.as_str().map(text_prompt)).collect();
            Ok((out.ok_or_else(bad)?, true))
        }
        Some(_) if texts_only => Err(bad()),
        Some(Value::Array(_)) => {
            let out: Option<Vec<Prompt>> = items.iter().map(|i| i.as_array().and_then(|ids| ids_prompt(ids))).collect();
            Ok((out.ok_or_else(bad)?, true))
        }
        Some(_) => Ok((vec![ids_prompt(items).ok_or_else(bad)?], false)),
    }
}

/// The prompt a chat renders to here: one `<|role|>` line and the message's text per
/// message, in order (text content parts only). Deliberately not the gateway's layout.
fn chat_prompt(v: &Value) -> Result<Prompt, String> {
    let messages = match v {
        Value::Array(m) if !m.is_empty() => m,
        _ => return Err(wrong("messages", "a non-empty list of message objects")),
    };
    let mut out = String::new();
    for (i, m) in messages.iter().enumerate() {
        let m = m.as_object().ok_or_else(|| wrong(&format!("messages[{i}]"), "an object"))?;
        let role = match m.get("role") {
            None | Some(Value::Null) => "",
            Some(r) => r.as_str().ok_or_else(|| wrong(&format!("messages[{i}].role"), "a string"))?,
        };
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        let bad_content = || wrong(&format!("messages[{i}].content"), "a string or a list of content parts");
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for part in parts {
                    let part = part.as_object().ok_or_else(bad_content)?;
                    let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
                    if let (Some(text), "text") = (part.get("text").and_then(Value::as_str), kind) {
                        out.push_str(text);
                    }
                }
            }
            Some(_) => return Err(bad_content()),
        }
        out.push('\n');
    }
    Ok(text_prompt(&out))
}

/// An optional non-negative integer field.
fn count(obj: &Map<String, Value>, field: &str, name: &str) -> Result<Option<u64>, String> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| wrong(name, "a non-negative integer")),
    }
}

/// Fields SGLang takes per item of a batch: as a list, they need one entry per item.
const PER_ITEM: [&str; 6] =
    ["sampling_params", "rid", "return_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room"];

impl Job {
    pub fn parse(endpoint: Endpoint, body: &[u8], default_max_tokens: u64) -> Result<Job, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
        let obj = v.as_object().ok_or("request body must be a JSON object")?;
        let field = |name: &str| obj.get(name).filter(|f| !f.is_null());
        let (items, batch) = match endpoint {
            Endpoint::Generate => match (field("text"), field("input_ids")) {
                (Some(text), _) => prompts(text, "text", true)?,
                (None, Some(ids)) => prompts(ids, "input_ids", false)?,
                (None, None) => return Err("request must contain `text` or `input_ids`".into()),
            },
            Endpoint::Completions => prompts(field("prompt").ok_or("request must contain `prompt`")?, "prompt", false)?,
            Endpoint::ChatCompletions => {
                (vec![chat_prompt(field("messages").ok_or("request must contain `messages`")?)?], false)
            }
        };
        let stream = match field("stream") {
            None => false,
            Some(s) => s.as_bool().ok_or_else(|| wrong("stream", "a boolean"))?,
        };
        let n = items.len();
        if batch {
            for name in PER_ITEM {
                if let Some(Value::Array(list)) = field(name) {
                    if list.len() != n {
                        return Err(format!("field `{name}` has {} entries for a batch of {n}", list.len()));
                    }
                }
            }
        }
        let max_tokens = match endpoint {
            Endpoint::Generate => match field("sampling_params") {
                Some(Value::Object(p)) => count(p, "max_new_tokens", "sampling_params.max_new_tokens")?,
                Some(Value::Array(list)) => match list.first() {
                    Some(Value::Object(p)) => count(p, "max_new_tokens", "sampling_params[0].max_new_tokens")?,
                    _ => None,
                },
                Some(_) => return Err(wrong("sampling_params", "an object or a list of objects")),
                None => None,
            },
            _ => match count(obj, "max_completion_tokens", "max_completion_tokens")? {
                Some(m) => Some(m),
                None => count(obj, "max_tokens", "max_tokens")?,
            },
        }
        .unwrap_or(default_max_tokens)
        .min(1 << 16);
        // Item `i`'s value of a per-item field (one value for all items unless a batch list).
        let item = |name: &str, i: usize| -> Option<&Value> {
            match field(name)? {
                Value::Array(list) if batch => list.get(i).filter(|v| !v.is_null()),
                other => Some(other),
            }
        };
        let mut boots = Vec::with_capacity(n);
        let mut logprobs = Vec::with_capacity(n);
        for i in 0..n {
            let host = match item("bootstrap_host", i) {
                None => None,
                Some(h) => Some(h.as_str().ok_or_else(|| wrong("bootstrap_host", "a string"))?.to_string()),
            };
            let port = match (obj.get("bootstrap_port"), item("bootstrap_port", i)) {
                (None, _) => None,
                (Some(_), None) => Some(None),
                (Some(_), Some(p)) => Some(Some(
                    p.as_u64()
                        .and_then(|p| u16::try_from(p).ok())
                        .ok_or_else(|| wrong("bootstrap_port", "a port number or null"))?,
                )),
            };
            let room = match item("bootstrap_room", i) {
                None => None,
                Some(r) => Some(r.as_u64().ok_or_else(|| wrong("bootstrap_room", "a non-negative integer"))?),
            };
            boots.push(Boot { host, port, room });
            logprobs.push(match item("return_logprob", i) {
                None => false,
                Some(l) => l.as_bool().ok_or_else(|| wrong("return_logprob", "a boolean"))?,
            });
        }
        let rids = match field("rid") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![Some(s.clone())],
            Some(Value::Array(list)) => list.iter().map(|r| r.as_str().map(String::from)).collect(),
            Some(_) => return Err(wrong("rid", "a string or a list of strings")),
        };
        let include_usage = match obj.get("stream_options").and_then(|o| o.get("include_usage")) {
            None | Some(Value::Null) => false,
            Some(u) => u.as_bool().ok_or_else(|| wrong("stream_options.include_usage", "a boolean"))?,
        };
        Ok(Job { items, boots, logprobs, batch, max_tokens, stream, include_usage, rids })
    }

    /// The request id of item `i`: the client's, else a fresh one.
    /// The rids the client set (the ones `/abort_request` can name).
    pub fn given_rids(&self) -> Vec<String> {
        self.rids.iter().flatten().cloned().collect()
    }

    pub fn rid(&self, i: usize) -> String {
        self.rids.get(i).cloned().flatten().unwrap_or_else(|| format!("{:032x}", fastrand::u128(..)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<Job, String> {
        Job::parse(endpoint, body.as_bytes(), 8)
    }

    fn bytes(job: &Job) -> Vec<&[u8]> {
        job.items.iter().map(|p| p.bytes.as_slice()).collect()
    }

    #[test]
    fn generate_takes_text_or_token_ids_single_or_batched() {
        let j = parse(Endpoint::Generate, r#"{"text":"hello","stream":true,"sampling_params":{"max_new_tokens":3}}"#)
            .unwrap();
        assert_eq!((bytes(&j), j.batch, j.stream, j.max_tokens), (vec![&b"hello"[..]], false, true, 3));
        assert_eq!(j.items[0].tokens, 2);
        let j = parse(Endpoint::Generate, r#"{"text":["a","bc"],"rid":["x","y"]}"#).unwrap();
        assert_eq!((bytes(&j), j.batch, j.max_tokens), (vec![&b"a"[..], b"bc"], true, 8));
        assert_eq!((j.rid(0), j.rid(1)), ("x".to_string(), "y".to_string()));
        let j = parse(Endpoint::Generate, r#"{"text":null,"input_ids":[1,258]}"#).unwrap();
        assert_eq!((bytes(&j), j.items[0].tokens), (vec![&[1, 0, 0, 0, 2, 1, 0, 0][..]], 2));
        let j = parse(Endpoint::Generate, r#"{"input_ids":[[1],[2,3]]}"#).unwrap();
        assert_eq!((j.items.len(), j.batch), (2, true));
    }

    #[test]
    fn completions_take_every_prompt_shape() {
        let j = parse(Endpoint::Completions, r#"{"prompt":"p","max_tokens":4}"#).unwrap();
        assert_eq!((bytes(&j), j.max_tokens), (vec![&b"p"[..]], 4));
        let j = parse(Endpoint::Completions, r#"{"prompt":"p","max_tokens":4,"max_completion_tokens":5}"#).unwrap();
        assert_eq!(j.max_tokens, 5);
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":["p","q"]}"#).unwrap().items.len(), 2);
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":[7,8]}"#).unwrap().items[0].tokens, 2);
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":[[7],[8]]}"#).unwrap().items.len(), 2);
    }

    #[test]
    fn a_chat_renders_roles_and_text_parts_in_order() {
        let body = r#"{"messages":[{"role":"system","content":"Be brief."},
            {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"image_url","image_url":{"url":"x"}},{"text":"there"}]},
            {"role":"assistant","content":null}],
            "stream":true,"stream_options":{"include_usage":true}}"#;
        let j = parse(Endpoint::ChatCompletions, body).unwrap();
        assert_eq!(bytes(&j), vec![&b"<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n\n"[..]]);
        assert!(j.stream && j.include_usage && !j.batch);
    }

    #[test]
    fn pd_fields_are_read_per_item() {
        let j = parse(
            Endpoint::Generate,
            r#"{"text":["a","b"],"bootstrap_host":["h1","h2"],"bootstrap_port":[8998,null],"bootstrap_room":[5,6],"return_logprob":[false,true]}"#,
        )
        .unwrap();
        let boots: Vec<_> = j.boots.iter().map(|b| (b.host.as_deref(), b.port, b.room)).collect();
        assert_eq!(boots, vec![(Some("h1"), Some(Some(8998)), Some(5)), (Some("h2"), Some(None), Some(6))]);
        assert_eq!(j.logprobs, vec![false, true]);
        let j =
            parse(Endpoint::Generate, r#"{"text":"a","bootstrap_host":"h","bootstrap_port":null,"bootstrap_room":9}"#)
                .unwrap();
        assert_eq!((j.boots[0].host.as_deref(), j.boots[0].port, j.boots[0].room), (Some("h"), Some(None), Some(9)));
        let j = parse(Endpoint::Generate, r#"{"text":"a"}"#).unwrap();
        assert_eq!((j.boots[0].port, j.boots[0].room, j.logprobs[0]), (None, None, false));
    }

    #[test]
    fn malformed_bodies_and_wrong_types_are_refused_naming_the_field() {
        let cases = [
            (Endpoint::Generate, "", "not valid JSON"),
            (Endpoint::Generate, "{", "not valid JSON"),
            (Endpoint::Generate, "[1]", "JSON object"),
            (Endpoint::Generate, "{}", "`text` or `input_ids`"),
            (Endpoint::Generate, r#"{"text":3}"#, "`text`"),
            (Endpoint::Generate, r#"{"text":[]}"#, "`text`"),
            (Endpoint::Generate, r#"{"text":[1,2]}"#, "`text`"),
            (Endpoint::Generate, r#"{"input_ids":[-1]}"#, "`input_ids`"),
            (Endpoint::Generate, r#"{"input_ids":[4294967296]}"#, "`input_ids`"),
            (Endpoint::Generate, r#"{"input_ids":[[1],"x"]}"#, "`input_ids`"),
            (Endpoint::Generate, r#"{"text":"a","stream":"yes"}"#, "`stream`"),
            (Endpoint::Generate, r#"{"text":["a","b"],"rid":["x"]}"#, "`rid`"),
            (Endpoint::Generate, r#"{"text":["a","b"],"bootstrap_room":[1,2,3]}"#, "`bootstrap_room`"),
            (Endpoint::Generate, r#"{"text":"a","bootstrap_room":"r"}"#, "`bootstrap_room`"),
            (Endpoint::Generate, r#"{"text":"a","bootstrap_port":70000}"#, "`bootstrap_port`"),
            (Endpoint::Generate, r#"{"text":"a","sampling_params":{"max_new_tokens":-1}}"#, "max_new_tokens"),
            (Endpoint::Completions, r#"{"max_tokens":2}"#, "`prompt`"),
            (Endpoint::Completions, r#"{"prompt":{}}"#, "`prompt`"),
            (Endpoint::Completions, r#"{"prompt":"p","max_tokens":"2"}"#, "`max_tokens`"),
            (Endpoint::ChatCompletions, r#"{"messages":[]}"#, "`messages`"),
            (Endpoint::ChatCompletions, r#"{"messages":"hi"}"#, "`messages`"),
            (Endpoint::ChatCompletions, r#"{"messages":[3]}"#, "`messages[0]`"),
            (Endpoint::ChatCompletions, r#"{"messages":[{"role":1,"content":"x"}]}"#, "`messages[0].role`"),
            (Endpoint::ChatCompletions, r#"{"messages":[{"role":"user","content":3}]}"#, "`messages[0].content`"),
        ];
        for (endpoint, body, needle) in cases {
            let err = parse(endpoint, body).expect_err(body);
            assert!(err.contains(needle), "{body}: {err}");
        }
    }
}
