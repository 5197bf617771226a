//! Merging the prefill leg's input logprobs into the decode leg's response.
//!
//! In PD mode the prompt's logprobs are computed by the prefill worker, but the client gets
//! the decode worker's response. When the client asked for `return_logprob`, the prefill
//! response's `meta_info.input_token_logprobs` is put in front of the decode response's,
//! per batch item (`index`): in the JSON body, or in every SSE event that carries them.
//!
//! Work and memory are linear in what the workers send: the prefill's entries are kept as the
//! JSON text they arrived in (not as a parsed tree), each event is spliced, not re-serialised,
//! and the bytes merging adds to one response are capped ([`MAX_ADDED_BYTES`]: SGLang repeats
//! the input logprobs in every streamed event, so a long prompt times many events would
//! otherwise multiply one request's prefill answer into hundreds of MB). The prefill entries a
//! VM holds across its requests are capped too ([`MergeRoom`]).

use std::cell::Cell;
use std::ops::Range;
use std::rc::Rc;

use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum MergeError {
    #[error("response is not JSON: {0}")]
    NotJson(String),
    #[error("response of {0} bytes is larger than the {MAX_MERGE_BYTES} bytes logprobs are merged into")]
    TooLarge(usize),
    #[error("this gateway thread already holds {held} bytes of prefill logprobs for merging; {wanted} more would pass its {cap}-byte cap")]
    NoRoom { held: usize, wanted: usize, cap: usize },
}

/// The largest response (prefill answer, decode JSON body, one SSE event) that logprobs are
/// merged in or out of; a larger one passes through unmerged.
pub const MAX_MERGE_BYTES: usize = 16 << 20;

/// The most batch items whose logprobs are kept.
pub const MAX_ITEMS: usize = 1 << 16;

/// The most bytes merging adds to one response; past it the rest passes through unmerged,
/// after an SSE error event that says so.
pub const MAX_ADDED_BYTES: usize = 64 << 20;

/// The most bytes of prefill logprobs one VM (one Envoy worker thread) holds for merging,
/// over all its requests; a request past it gets its decode response unmerged.
pub const VM_ROOM_BYTES: usize = 64 << 20;

/// What one VM holds for merging, shared by its requests.
#[derive(Clone, Debug)]
pub struct MergeRoom {
    held: Rc<Cell<usize>>,
    cap: usize,
}

impl Default for MergeRoom {
    fn default() -> Self {
        Self::with_cap(VM_ROOM_BYTES)
    }
}

impl MergeRoom {
    pub fn with_cap(cap: usize) -> Self {
        Self { held: Rc::default(), cap }
    }

    /// Bytes of prefill logprobs held now.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    fn seat(&self, bytes: usize) -> Result<Seat, MergeError> {
        let held = self.held.get();
        if held.saturating_add(bytes) > self.cap {
            return Err(MergeError::NoRoom { held, wanted: bytes, cap: self.cap });
        }
        self.held.set(held + bytes);
        Ok(Seat { room: self.clone(), bytes })
    }
}

/// Bytes taken from a [`MergeRoom`], given back when dropped.
#[derive(Debug)]
struct Seat {
    room: MergeRoom,
    bytes: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        let held = &self.room.held;
        held.set(held.get().saturating_sub(self.bytes));
    }
}

/// The prefill leg's input logprobs, per item: the JSON text of the list's entries (without
/// the brackets), as the prefill worker wrote them.
#[derive(Debug, Default)]
pub struct PrefillLogprobs {
    items: Vec<Option<String>>,
    _seat: Option<Seat>,
}

/// The fields of a response item merging looks at, borrowed from its text.
#[derive(Deserialize)]
struct ItemRef<'a> {
    #[serde(borrow, default)]
    meta_info: Option<&'a RawValue>,
    #[serde(borrow, default)]
    index: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MetaRef<'a> {
    #[serde(borrow, default)]
    input_token_logprobs: Option<&'a RawValue>,
}

/// Where `item`'s own `meta_info.input_token_logprobs` list lies in its text, and the
/// item's `index` field (None: absent or not a position).
fn logprobs_span(item: &str) -> Option<(Range<usize>, Option<usize>)> {
    let it: ItemRef = serde_json::from_str(item).ok()?;
    let index = it.index.and_then(|raw| raw.get().parse::<usize>().ok());
    let meta: MetaRef = serde_json::from_str(it.meta_info?.get()).ok()?;
    let list = meta.input_token_logprobs?.get();
    if !(list.starts_with('[') && list.ends_with(']')) {
        return None;
    }
    // `list` borrows from `item`: its offset there (checked, not assumed).
    let start = (list.as_ptr() as usize).checked_sub(item.as_ptr() as usize)?;
    let span = start..start.checked_add(list.len())?;
    (item.get(span.clone()) == Some(list)).then_some((span, index))
}

/// The entries of a JSON list's text: what lies between its brackets.
fn entries(list: &str) -> &str {
    list.get(1..list.len().saturating_sub(1)).unwrap_or_default().trim()
}

/// `item` with `pre` put in front of the entries of its list at `span`; returns the bytes added.
fn splice(out: &mut String, item: &str, span: &Range<usize>, pre: &str) -> usize {
    let Some((head, tail)) = item.get(..span.start + 1).zip(item.get(span.start + 1..)) else {
        out.push_str(item);
        return 0;
    };
    out.push_str(head);
    out.push_str(pre);
    let comma = !pre.is_empty() && !entries(item.get(span.clone()).unwrap_or_default()).is_empty();
    if comma {
        out.push(',');
    }
    out.push_str(tail);
    pre.len() + usize::from(comma)
}

/// The JSON items of a response: each element of a list (batch), or the object itself.
fn json_items(text: &str) -> Result<Vec<&str>, MergeError> {
    let not_json = |e: serde_json::Error| MergeError::NotJson(e.to_string());
    if text.trim_start().starts_with('[') {
        let items: Vec<&RawValue> = serde_json::from_str(text).map_err(not_json)?;
        return Ok(items.into_iter().map(RawValue::get).collect());
    }
    let item: &RawValue = serde_json::from_str(text).map_err(not_json)?;
    Ok(vec![item.get()])
}

/// The offset of `part` (a slice of `whole`) in `whole`.
fn offset_in(whole: &str, part: &str) -> Option<usize> {
    let at = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    (whole.get(at..at + part.len()) == Some(part)).then_some(at)
}

fn utf8(bytes: &[u8]) -> Result<&str, MergeError> {
    std::str::from_utf8(bytes).map_err(|e| MergeError::NotJson(e.to_string()))
}

impl PrefillLogprobs {
    /// From the prefill response: a JSON object, a JSON list (batch) or an SSE stream (the
    /// last event of each item that carries them). What it keeps is taken from `room`.
    pub fn from_response(body: &[u8], room: &MergeRoom) -> Result<Self, MergeError> {
        if body.len() > MAX_MERGE_BYTES {
            return Err(MergeError::TooLarge(body.len()));
        }
        let mut out = PrefillLogprobs::default();
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if matches!(first, Some(b'{' | b'[')) {
            for (i, item) in json_items(utf8(body)?)?.into_iter().enumerate() {
                out.set(i, logprobs_span(item).and_then(|(span, _)| item.get(span)).map(entries));
            }
        } else {
            for data in sse_data(body) {
                if let Some((span, index)) = logprobs_span(data) {
                    out.set(index.unwrap_or(0), data.get(span).map(entries));
                }
            }
        }
        let held = out.items.iter().flatten().map(String::len).sum();
        out._seat = Some(room.seat(held)?);
        Ok(out)
    }

    /// Item `index`'s logprobs. An index past [`MAX_ITEMS`] (a response claiming an absurd
    /// batch position) is ignored rather than allocated for.
    fn set(&mut self, index: usize, entries: Option<&str>) {
        if index >= MAX_ITEMS {
            return;
        }
        if self.items.len() <= index {
            self.items.resize(index + 1, None);
        }
        if let Some(slot) = self.items.get_mut(index) {
            *slot = entries.map(str::to_owned);
        }
    }

    /// Item `index`'s entries, as JSON text (no brackets).
    pub fn get(&self, index: usize) -> Option<&str> {
        self.items.get(index).and_then(|o| o.as_deref())
    }

    /// Merges into a complete JSON response (object or batch list).
    pub fn merge_json(&self, decode: &[u8]) -> Result<Vec<u8>, MergeError> {
        if decode.len() > MAX_MERGE_BYTES {
            return Err(MergeError::TooLarge(decode.len()));
        }
        let text = utf8(decode)?;
        let mut out = String::with_capacity(text.len() + self.items.iter().flatten().map(String::len).sum::<usize>());
        let mut done = 0;
        for (i, item) in json_items(text)?.into_iter().enumerate() {
            let (Some(pre), Some(at), Some((span, _))) = (self.get(i), offset_in(text, item), logprobs_span(item))
            else {
                continue;
            };
            out.push_str(text.get(done..at).unwrap_or_default());
            splice(&mut out, item, &span, pre);
            done = at + item.len();
        }
        out.push_str(text.get(done..).unwrap_or_default());
        Ok(out.into_bytes())
    }
}

/// The `data:` payloads of the complete events in `body`.
fn sse_data(body: &[u8]) -> impl Iterator<Item = &str> {
    std::str::from_utf8(body).unwrap_or("").lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim)
}

/// An SSE event saying that input logprobs are not merged, and why.
pub fn error_event(message: &str) -> String {
    let body = crate::errors::error_json(502, "logprob_merge_refused", message);
    format!("data: {}\n\n", String::from_utf8_lossy(&body))
}

/// Rewrites an SSE stream chunk by chunk, merging into each event that carries logprobs.
/// Partial events are held back until their end arrives — up to [`MAX_MERGE_BYTES`]: an event
/// that grows past it ends merging (an SSE error event says so) and the rest of the stream
/// passes through unchanged; so does the rest once merging has added [`MAX_ADDED_BYTES`].
/// Each byte is scanned for event ends once.
pub struct SseMerger {
    prefill: PrefillLogprobs,
    pending: Vec<u8>,
    /// How much of `pending` is known to hold no event end.
    scanned: usize,
    /// Merging stopped: pass everything through.
    passthrough: bool,
    /// Bytes merging has added to this response.
    added: usize,
}

impl SseMerger {
    pub fn new(prefill: PrefillLogprobs) -> Self {
        Self { prefill, pending: Vec::new(), scanned: 0, passthrough: false, added: 0 }
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
        let mut out = self.rewrite(&complete);
        if self.passthrough {
            out.append(&mut self.pending);
        } else if self.pending.len() > MAX_MERGE_BYTES {
            out.extend(self.give_up());
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
        let mut out = error_event(&message).into_bytes();
        out.append(&mut self.pending);
        out
    }

    /// Complete events, each `data:` line that carries logprobs spliced. Past the added-bytes
    /// cap: an error event before the event that would pass it, and everything after as is.
    fn rewrite(&mut self, events: &[u8]) -> Vec<u8> {
        let Ok(text) = std::str::from_utf8(events) else { return events.to_vec() };
        let mut out = String::with_capacity(text.len() + 256);
        let mut event_start = 0;
        let mut consumed = 0;
        for line in text.split_inclusive('\n') {
            consumed += line.len();
            if line.trim_end_matches(['\r', '\n']).is_empty() {
                out.push_str(line);
                event_start = out.len();
                continue;
            }
            let merge = line.strip_prefix("data:").and_then(|data| {
                let (span, index) = logprobs_span(data.trim_end_matches(['\r', '\n']))?;
                Some((data, span, self.prefill.get(index.unwrap_or(0))?))
            });
            let Some((data, span, pre)) = merge else {
                out.push_str(line);
                continue;
            };
            if self.added.saturating_add(pre.len() + 1) > MAX_ADDED_BYTES {
                let message = format!("input logprobs not merged into the rest of the stream: merging added {} bytes, the most one response gets is {MAX_ADDED_BYTES}", self.added);
                let this_event = out.split_off(event_start);
                out.push_str(&error_event(&message));
                out.push_str(&this_event);
                out.push_str(line);
                out.push_str(text.get(consumed..).unwrap_or_default());
                self.passthrough = true;
                return out.into_bytes();
            }
            out.push_str("data:");
            self.added += splice(&mut out, data, &span, pre);
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
    use serde_json::{json, Value};

    fn lp(ids: &[i64]) -> Value {
        Value::Array(ids.iter().map(|&i| json!([-0.1 * i as f64, i, null])).collect())
    }

    fn prefill(v: &Value) -> PrefillLogprobs {
        PrefillLogprobs::from_response(v.to_string().as_bytes(), &MergeRoom::default()).unwrap()
    }

    #[test]
    fn json_single_and_batch() {
        let p = prefill(&json!({"text": "", "meta_info": {"input_token_logprobs": lp(&[1, 2, 3])}}));
        let decode = json!({"text": "x", "meta_info": {"input_token_logprobs": lp(&[4]), "id": "r"}});
        let merged: Value = serde_json::from_slice(&p.merge_json(decode.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(merged["meta_info"]["input_token_logprobs"], lp(&[1, 2, 3, 4]));
        assert_eq!(merged["meta_info"]["id"], "r");

        let p = prefill(
            &json!([{"meta_info": {"input_token_logprobs": lp(&[1])}}, {"meta_info": {"input_token_logprobs": lp(&[2])}}]),
        );
        let decode =
            json!([{"meta_info": {"input_token_logprobs": lp(&[9])}}, {"meta_info": {"input_token_logprobs": []}}]);
        let merged: Value = serde_json::from_slice(&p.merge_json(decode.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(merged[0]["meta_info"]["input_token_logprobs"], lp(&[1, 9]));
        assert_eq!(merged[1]["meta_info"]["input_token_logprobs"], lp(&[2]));
    }

    #[test]
    fn the_decode_body_is_spliced_byte_for_byte() {
        let p = prefill(&json!({"meta_info": {"input_token_logprobs": lp(&[1])}}));
        let decode = br#"{ "text" : "x",  "meta_info":{"z":1, "input_token_logprobs" : [ [-1,2,null] ] } }"#;
        let merged = String::from_utf8(p.merge_json(decode).unwrap()).unwrap();
        assert_eq!(
            merged,
            r#"{ "text" : "x",  "meta_info":{"z":1, "input_token_logprobs" : [[-0.1,1,null], [-1,2,null] ] } }"#
        );
        // Not a list, duplicated, or no meta_info: passed through as it came.
        for odd in [
            r#"{"meta_info":{"input_token_logprobs":null}}"#,
            r#"{"meta_info":{"input_token_logprobs":[],"input_token_logprobs":[]}}"#,
            r#"{"meta_info":7}"#,
            r#"{"text":"x"}"#,
        ] {
            assert_eq!(p.merge_json(odd.as_bytes()).unwrap(), odd.as_bytes());
        }
        assert!(matches!(p.merge_json(b"{not json"), Err(MergeError::NotJson(_))));
    }

    #[test]
    fn prefill_sse_takes_each_items_last_logprobs() {
        let sse = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"index": 1, "meta_info": {"input_token_logprobs": lp(&[7])}}),
            json!({"index": 0, "meta_info": {"input_token_logprobs": lp(&[5, 6])}})
        );
        let p = PrefillLogprobs::from_response(sse.as_bytes(), &MergeRoom::default()).unwrap();
        assert_eq!(p.get(0).unwrap(), "[-0.5,5,null],[-0.6000000000000001,6,null]");
        assert_eq!(p.get(1).unwrap(), "[-0.7000000000000001,7,null]");
        assert_eq!(p.get(2), None);
    }

    #[test]
    fn what_a_vm_holds_is_the_entries_text_and_is_capped() {
        let room = MergeRoom::with_cap(120);
        let body = json!({"text": "", "meta_info": {"input_token_logprobs": lp(&[1, 2, 3])}}).to_string();
        let p = PrefillLogprobs::from_response(body.as_bytes(), &room).unwrap();
        let held = room.held();
        assert_eq!(held, p.get(0).unwrap().len(), "the entries' text, not a parsed tree");
        assert!(held < body.len());
        let q = PrefillLogprobs::from_response(body.as_bytes(), &room).unwrap();
        assert_eq!(room.held(), 2 * held);
        assert_eq!(
            PrefillLogprobs::from_response(body.as_bytes(), &room).err(),
            Some(MergeError::NoRoom { held: 2 * held, wanted: held, cap: 120 }),
            "a third would pass the VM's cap"
        );
        drop(p);
        assert_eq!(room.held(), held, "given back when the request is done with it");
        drop(q);
        assert_eq!(room.held(), 0);
    }

    #[test]
    fn sse_events_are_merged_across_chunk_boundaries() {
        let mut m = SseMerger::new(prefill(&json!({"meta_info": {"input_token_logprobs": lp(&[1, 2])}})));
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
    fn merging_adds_at_most_its_cap_to_a_response() {
        // ~1 MiB of prefill entries, repeated into each of 100 events, would add 100 MiB.
        let ids: Vec<i64> = (0..40_000).collect();
        let p = prefill(&json!({"meta_info": {"input_token_logprobs": lp(&ids)}}));
        let per_event = p.get(0).unwrap().len() + 1;
        let mut m = SseMerger::new(p);
        let event = |i: usize| {
            format!("data: {{\"text\":\"{i}\",\"meta_info\":{{\"input_token_logprobs\":[[-1,2,null]]}}}}\n\n")
        };
        let (mut sent, mut out) = (0, Vec::new());
        for i in 0..100 {
            let e = event(i);
            sent += e.len();
            out.extend(m.push(e.as_bytes()));
        }
        out.extend(m.finish());
        let merged_events = MAX_ADDED_BYTES / per_event;
        let text = String::from_utf8(out).unwrap();
        let refusal = text.find("logprob_merge_refused").expect("the client is told merging stopped");
        let before = text[..refusal].matches("\"text\"").count();
        assert_eq!(before, merged_events, "every event before the refusal merged");
        assert!(text.len() <= sent + MAX_ADDED_BYTES + 512, "{} bytes out for {sent} in", text.len());
        let unmerged: String = (merged_events..100).map(event).collect();
        assert!(text.ends_with(&unmerged), "the rest passes through as the worker sent it");
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
        let mut m = SseMerger::new(prefill(&json!({"meta_info": {"input_token_logprobs": lp(&[1])}})));
        let event = format!("data: {}", json!({"meta_info": {"input_token_logprobs": lp(&[2])}}));
        assert!(m.push(event.as_bytes()).is_empty());
        assert!(m.push(b"\r\n\r").is_empty());
        let out = String::from_utf8(m.push(b"\n")).unwrap();
        assert!(out.contains("[-0.1,1,null],[-0.2,2,null]"), "{out}");
    }

    #[test]
    fn oversized_responses_are_not_merged_nor_held() {
        let big = vec![b' '; MAX_MERGE_BYTES + 1];
        let room = MergeRoom::default();
        assert_eq!(PrefillLogprobs::from_response(&big, &room).err(), Some(MergeError::TooLarge(big.len())));
        assert_eq!(room.held(), 0);
        assert_eq!(PrefillLogprobs::default().merge_json(&big), Err(MergeError::TooLarge(big.len())));
    }
}
