//! Merging the prefill leg's input logprobs into the decode leg's response.
//!
//! In PD mode the prompt's logprobs are computed by the prefill worker, but the client gets
//! the decode worker's response. When the client asked for `return_logprob`, the prefill
//! response's `meta_info.input_token_logprobs` is put in front of the decode response's,
//! per batch item (`index`): in the JSON body, or in every SSE event that carries them.

use serde_json::Value;
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum MergeError {
    #[error("response is not JSON: {0}")]
    NotJson(String),
    #[error("response of {0} bytes is larger than the {MAX_MERGE_BYTES} bytes logprobs are merged into")]
    TooLarge(usize),
}

/// The largest response (prefill answer, decode JSON body, one SSE event) that logprobs are
/// merged in or out of; a larger one passes through unmerged.
pub const MAX_MERGE_BYTES: usize = 16 << 20;

/// The most batch items whose logprobs are kept.
pub const MAX_ITEMS: usize = 1 << 16;

/// The prefill leg's input logprobs, per item.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefillLogprobs(Vec<Option<Vec<Value>>>);

fn item_logprobs(item: &Value) -> Option<Vec<Value>> {
    item.get("meta_info")?.get("input_token_logprobs")?.as_array().cloned()
}

fn item_index(item: &Value, fallback: usize) -> usize {
    item.get("index").and_then(Value::as_u64).map_or(fallback, |i| i as usize)
}

impl PrefillLogprobs {
    /// From the prefill response: a JSON object, a JSON list (batch) or an SSE stream (the
    /// last event of each item that carries them).
    pub fn from_response(body: &[u8]) -> Result<Self, MergeError> {
        if body.len() > MAX_MERGE_BYTES {
            return Err(MergeError::TooLarge(body.len()));
        }
        let mut out = PrefillLogprobs::default();
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if matches!(first, Some(b'{' | b'[')) {
            let v: Value = serde_json::from_slice(body).map_err(|e| MergeError::NotJson(e.to_string()))?;
            match v {
                Value::Array(items) => items.iter().enumerate().for_each(|(i, it)| out.set(i, item_logprobs(it))),
                item => out.set(0, item_logprobs(&item)),
            }
            return Ok(out);
        }
        for data in sse_data(body) {
            if let Ok(item) = serde_json::from_str::<Value>(data) {
                if let Some(lp) = item_logprobs(&item) {
                    out.set(item_index(&item, 0), Some(lp));
                }
            }
        }
        Ok(out)
    }

    /// Item `index`'s logprobs. An index past [`MAX_ITEMS`] (a response claiming an absurd
    /// batch position) is ignored rather than allocated for.
    fn set(&mut self, index: usize, lp: Option<Vec<Value>>) {
        if index >= MAX_ITEMS {
            return;
        }
        if self.0.len() <= index {
            self.0.resize(index + 1, None);
        }
        if let Some(slot) = self.0.get_mut(index) {
            *slot = lp;
        }
    }

    pub fn get(&self, index: usize) -> Option<&[Value]> {
        self.0.get(index).and_then(|o| o.as_deref())
    }

    /// Prepends item `index`'s prefill logprobs to `item`'s own, if it carries them.
    fn merge_into(&self, item: &mut Value, index: usize) -> bool {
        let Some(prefill) = self.get(index) else { return false };
        let Some(own) = item.get_mut("meta_info").and_then(|m| m.get_mut("input_token_logprobs")) else {
            return false;
        };
        let Some(list) = own.as_array_mut() else { return false };
        let mut merged = prefill.to_vec();
        merged.append(list);
        *list = merged;
        true
    }

    /// Merges into a complete JSON response (object or batch list).
    pub fn merge_json(&self, decode: &[u8]) -> Result<Vec<u8>, MergeError> {
        if decode.len() > MAX_MERGE_BYTES {
            return Err(MergeError::TooLarge(decode.len()));
        }
        let mut v: Value = serde_json::from_slice(decode).map_err(|e| MergeError::NotJson(e.to_string()))?;
        match &mut v {
            Value::Array(items) => {
                for (i, item) in items.iter_mut().enumerate() {
                    self.merge_into(item, i);
                }
            }
            item => {
                self.merge_into(item, 0);
            }
        }
        serde_json::to_vec(&v).map_err(|e| MergeError::NotJson(e.to_string()))
    }
}

/// The `data:` payloads of the complete events in `body`.
fn sse_data(body: &[u8]) -> impl Iterator<Item = &str> {
    std::str::from_utf8(body).unwrap_or("").lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim)
}

/// Rewrites an SSE stream chunk by chunk, merging into each event that carries logprobs.
/// Partial events are held back until their end arrives — up to [`MAX_MERGE_BYTES`]: an event
/// that grows past it ends merging (an SSE error event says so) and the rest of the stream
/// passes through unchanged. Each byte is scanned for event ends once.
pub struct SseMerger {
    prefill: PrefillLogprobs,
    pending: Vec<u8>,
    /// How much of `pending` is known to hold no event end.
    scanned: usize,
    /// Merging stopped (an event too large): pass everything through.
    passthrough: bool,
}

impl SseMerger {
    pub fn new(prefill: PrefillLogprobs) -> Self {
        Self { prefill, pending: Vec::new(), scanned: 0, passthrough: false }
    }

    /// The rewritten bytes for the complete events now available.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.passthrough {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        // An event end may straddle the previous chunk: look back 3 bytes.
        let from = self.scanned.saturating_sub(3);
        let Some(end) = last_event_end(self.pending.get(from..).unwrap_or_default()).map(|e| e + from) else {
            self.scanned = self.pending.len();
            if self.pending.len() > MAX_MERGE_BYTES {
                return self.give_up();
            }
            return Vec::new();
        };
        let complete: Vec<u8> = self.pending.drain(..end).collect();
        self.scanned = 0;
        let out = self.rewrite(&complete);
        if self.pending.len() > MAX_MERGE_BYTES {
            return [out, self.give_up()].concat();
        }
        out
    }

    /// Whatever is left at the end of the stream.
    pub fn finish(&mut self) -> Vec<u8> {
        let rest = std::mem::take(&mut self.pending);
        if self.passthrough {
            return rest;
        }
        self.rewrite(&rest)
    }

    /// An event too large to merge into: say so, then pass it and the rest through.
    fn give_up(&mut self) -> Vec<u8> {
        self.passthrough = true;
        let message = format!("input logprobs not merged: an event exceeds {MAX_MERGE_BYTES} bytes");
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&crate::errors::error_json(502, "logprob_merge_refused", &message));
        out.extend_from_slice(b"\n\n");
        out.append(&mut self.pending);
        out
    }

    fn rewrite(&self, events: &[u8]) -> Vec<u8> {
        let Ok(text) = std::str::from_utf8(events) else { return events.to_vec() };
        let mut out = String::with_capacity(text.len() + 256);
        for line in text.split_inclusive('\n') {
            let Some(data) = line.strip_prefix("data:") else {
                out.push_str(line);
                continue;
            };
            let eol = line.get(line.trim_end_matches(['\r', '\n']).len()..).unwrap_or_default();
            match serde_json::from_str::<Value>(data.trim()) {
                Ok(mut item) => {
                    let index = item_index(&item, 0);
                    if self.prefill.merge_into(&mut item, index) {
                        out.push_str("data: ");
                        out.push_str(&item.to_string());
                        out.push_str(eol);
                    } else {
                        out.push_str(line);
                    }
                }
                Err(_) => out.push_str(line),
            }
        }
        out.into_bytes()
    }
}

/// The end of the last complete event (after its blank line) in `buf`.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).rposition(|w| w == b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lp(ids: &[i64]) -> Value {
        Value::Array(ids.iter().map(|&i| json!([-0.1 * i as f64, i, null])).collect())
    }

    #[test]
    fn json_single_and_batch() {
        let prefill = json!({"text": "", "meta_info": {"input_token_logprobs": lp(&[1, 2, 3])}});
        let p = PrefillLogprobs::from_response(prefill.to_string().as_bytes()).unwrap();
        let decode = json!({"text": "x", "meta_info": {"input_token_logprobs": lp(&[4]), "id": "r"}});
        let merged: Value = serde_json::from_slice(&p.merge_json(decode.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(merged["meta_info"]["input_token_logprobs"], lp(&[1, 2, 3, 4]));
        assert_eq!(merged["meta_info"]["id"], "r");

        let prefill = json!([{"meta_info": {"input_token_logprobs": lp(&[1])}}, {"meta_info": {"input_token_logprobs": lp(&[2])}}]);
        let p = PrefillLogprobs::from_response(prefill.to_string().as_bytes()).unwrap();
        let decode =
            json!([{"meta_info": {"input_token_logprobs": lp(&[9])}}, {"meta_info": {"input_token_logprobs": []}}]);
        let merged: Value = serde_json::from_slice(&p.merge_json(decode.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(merged[0]["meta_info"]["input_token_logprobs"], lp(&[1, 9]));
        assert_eq!(merged[1]["meta_info"]["input_token_logprobs"], lp(&[2]));
    }

    #[test]
    fn prefill_sse_takes_each_items_last_logprobs() {
        let sse = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"index": 1, "meta_info": {"input_token_logprobs": lp(&[7])}}),
            json!({"index": 0, "meta_info": {"input_token_logprobs": lp(&[5, 6])}})
        );
        let p = PrefillLogprobs::from_response(sse.as_bytes()).unwrap();
        assert_eq!(p.get(0).unwrap().len(), 2);
        assert_eq!(p.get(1).unwrap().len(), 1);
        assert_eq!(p.get(2), None);
    }

    #[test]
    fn sse_events_are_merged_across_chunk_boundaries() {
        let p = PrefillLogprobs::from_response(
            json!({"meta_info": {"input_token_logprobs": lp(&[1, 2])}}).to_string().as_bytes(),
        )
        .unwrap();
        let mut m = SseMerger::new(p);
        let e1 = format!("data: {}\n\n", json!({"text": "a", "meta_info": {"input_token_logprobs": lp(&[3])}}));
        let e2 = format!("data: {}\n\n", json!({"text": "ab", "meta_info": {"completion_tokens": 2}}));
        let stream = format!("{e1}{e2}data: [DONE]\n\n");
        let (a, b) = stream.as_bytes().split_at(e1.len() - 5);
        let mut out = m.push(a);
        assert!(out.is_empty(), "a partial event is held back");
        out.extend(m.push(b));
        out.extend(m.finish());
        let text = String::from_utf8(out).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3);
        let first: Value = serde_json::from_str(events[0].trim_start_matches("data: ")).unwrap();
        assert_eq!(first["meta_info"]["input_token_logprobs"], lp(&[1, 2, 3]));
        assert_eq!(events[1], e2.trim_end(), "events without logprobs pass through unchanged");
        assert_eq!(events[2], "data: [DONE]");
    }

    #[test]
    fn a_stream_without_event_ends_is_scanned_once_and_bounded() {
        let mut m = SseMerger::new(PrefillLogprobs::default());
        let chunk = vec![b'x'; 1 << 20];
        let mut out = Vec::new();
        for _ in 0..16 {
            out.extend(m.push(&chunk));
            assert!(m.pending.len() <= MAX_MERGE_BYTES && m.scanned == m.pending.len());
        }
        assert!(out.is_empty(), "nothing complete yet");
        out.extend(m.push(b"x"));
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("data: {\"error\"") && text.contains("logprob_merge_refused"));
        assert_eq!(out.len(), text.find("\n\n").unwrap() + 2 + (16 << 20) + 1, "everything held comes out");
        assert!(m.pending.is_empty());
        assert_eq!(m.push(b"data: {}\n\n"), b"data: {}\n\n", "then it passes through");
        assert!(m.finish().is_empty());
    }

    #[test]
    fn an_event_end_split_across_chunks_is_found() {
        let prefill = json!({"meta_info": {"input_token_logprobs": lp(&[1])}});
        let mut m = SseMerger::new(PrefillLogprobs::from_response(prefill.to_string().as_bytes()).unwrap());
        let event = format!("data: {}", json!({"meta_info": {"input_token_logprobs": lp(&[2])}}));
        assert!(m.push(event.as_bytes()).is_empty());
        assert!(m.push(b"\r\n\r").is_empty());
        let out = String::from_utf8(m.push(b"\n")).unwrap();
        assert!(out.contains("[-0.1,1,null],[-0.2,2,null]"), "{out}");
    }

    #[test]
    fn oversized_responses_are_not_merged() {
        let big = vec![b' '; MAX_MERGE_BYTES + 1];
        assert_eq!(PrefillLogprobs::from_response(&big), Err(MergeError::TooLarge(big.len())));
        assert_eq!(PrefillLogprobs::default().merge_json(&big), Err(MergeError::TooLarge(big.len())));
    }
}
