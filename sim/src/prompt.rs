//! What the simulator needs from a request body: the prompt of each item (as bytes, token
//! ids as 4 bytes each), the output length, streaming, and request ids.

use kvmesh_core::request::{self, Endpoint};
use serde_json::Value;

use crate::cache::tokens_of;

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

fn ids_prompt(ids: &[Value]) -> Option<Prompt> {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        bytes.extend_from_slice(&(id.as_u64()? as u32).to_le_bytes());
    }
    Some(Prompt { tokens: ids.len().max(1) as u64, bytes })
}

fn text_prompt(s: &str) -> Prompt {
    Prompt { bytes: s.as_bytes().to_vec(), tokens: tokens_of(s.len()) }
}

/// A string, list of strings, list of ids or list of id lists.
fn prompts(v: &Value, field: &str) -> Result<(Vec<Prompt>, bool), String> {
    let bad = || format!("field `{field}` has the wrong type");
    match v {
        Value::String(s) => Ok((vec![text_prompt(s)], false)),
        Value::Array(items) if items.first().is_some_and(Value::is_string) => {
            let out = items.iter().map(|i| i.as_str().map(text_prompt).ok_or_else(bad));
            Ok((out.collect::<Result<_, _>>()?, true))
        }
        Value::Array(items) if items.first().is_some_and(Value::is_array) => {
            let out = items.iter().map(|i| i.as_array().and_then(|ids| ids_prompt(ids)).ok_or_else(bad));
            Ok((out.collect::<Result<_, _>>()?, true))
        }
        Value::Array(ids) if !ids.is_empty() => Ok((vec![ids_prompt(ids).ok_or_else(bad)?], false)),
        _ => Err(bad()),
    }
}

impl Job {
    pub fn parse(endpoint: Endpoint, body: &[u8], default_max_tokens: u64) -> Result<Job, String> {
        // The gateway's own parser validates exactly as the gateway does.
        let routing = request::parse(endpoint, body).map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let (items, batch) = match endpoint {
            Endpoint::Generate if !v["text"].is_null() => prompts(&v["text"], "text")?,
            Endpoint::Generate => prompts(&v["input_ids"], "input_ids")?,
            Endpoint::Completions => prompts(&v["prompt"], "prompt")?,
            Endpoint::ChatCompletions => {
                (vec![Prompt { tokens: tokens_of(routing.text.len()), bytes: routing.text.into_owned() }], false)
            }
        };
        let max_tokens = match endpoint {
            Endpoint::Generate => v["sampling_params"]["max_new_tokens"].as_u64(),
            _ => v["max_completion_tokens"].as_u64().or(v["max_tokens"].as_u64()),
        }
        .unwrap_or(default_max_tokens)
        .min(1 << 16);
        let n = items.len();
        let item = |field: &str, i: usize| -> Value {
            match &v[field] {
                Value::Array(list) if batch => list.get(i).cloned().unwrap_or(Value::Null),
                other => other.clone(),
            }
        };
        let boots = (0..n)
            .map(|i| Boot {
                host: item("bootstrap_host", i).as_str().map(String::from),
                port: v.get("bootstrap_port").map(|_| item("bootstrap_port", i).as_u64().map(|p| p as u16)),
                room: item("bootstrap_room", i).as_u64(),
            })
            .collect();
        let logprobs = (0..n).map(|i| item("return_logprob", i).as_bool().unwrap_or(false)).collect();
        let rids = match &v["rid"] {
            Value::String(s) => vec![Some(s.clone())],
            Value::Array(list) => list.iter().map(|r| r.as_str().map(String::from)).collect(),
            _ => Vec::new(),
        };
        Ok(Job {
            boots,
            logprobs,
            batch,
            max_tokens,
            stream: routing.stream,
            include_usage: v["stream_options"]["include_usage"].as_bool().unwrap_or(false),
            rids,
            items,
        })
    }

    /// The request id of item `i`: the client's, else a fresh one.
    pub fn rid(&self, i: usize) -> String {
        self.rids.get(i).cloned().flatten().unwrap_or_else(|| format!("{:032x}", fastrand::u128(..)))
    }
}
