//! A prefill leg sent beside the decode leg (SGLang's protocol, `pd/sglang.rs`), as an
//! explicit state machine.
//!
//! Two things happen concurrently after dispatch: the prefill callout answers (or fails), and
//! the decode response arrives (headers, then body chunks). This type is told each event and
//! says what the glue must do; it never calls the host itself, so every ordering is unit-tested
//! natively.
//!
//! Only when the client asked for logprobs does the response wait for the prefill: its headers
//! (and any body Envoy delivers meanwhile) are held until the prefill answers, then the
//! prefill's input logprobs are merged in (JSON at the end of the body, SSE event by event).
//! A failed prefill becomes a local 502 while nothing has gone downstream, else an SSE error
//! event in front of the next chunk.

use kvmesh_core::errors::error_json;
use kvmesh_core::logprobs::{self, MergeError, MergeRoom, PrefillLogprobs, SseMerger};

use crate::host::Action;
use crate::routed::Routed;

/// How the prefill callout ended, as far as the state machine cares.
#[derive(Debug)]
pub enum PrefillResult {
    /// 2xx; `body` is present when [`PdLeg::wants_prefill_body`] said it was needed.
    Ok { body: Option<Vec<u8>> },
    /// Error, non-2xx or timeout, with a message naming the worker.
    Failed { message: String },
}

/// What the glue does after the prefill answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Answer the client with a JSON 502 (Envoy resets the decode leg).
    Fail502(String),
    /// Replace the first `size` bytes of the held response body with `body`.
    ReplaceHeldBody { size: usize, body: Vec<u8> },
    /// Let the held response go on.
    ResumeResponse,
    /// The held request's body becomes this (vLLM's decode leg, with the prefill's KV).
    DecodeBody(Vec<u8>),
    /// Send the held request on to the decode worker.
    ResumeRequest,
}

/// The glue's answer to a decode response body chunk.
#[derive(Debug, PartialEq, Eq)]
pub struct BodyStep {
    pub action: Action,
    /// Replace the chunk with these bytes before continuing.
    pub replace: Option<Vec<u8>>,
}

impl BodyStep {
    pub const CONTINUE: Self = Self { action: Action::Continue, replace: None };
    pub const PAUSE: Self = Self { action: Action::Pause, replace: None };
}

/// Merging the prefill's input logprobs into the decode response.
enum Merge {
    /// Not asked for.
    No,
    /// Asked for; the prefill has not answered yet. Its logprobs will be held in this VM's room.
    Waiting(MergeRoom),
    Json(PrefillLogprobs),
    Sse(SseMerger),
    /// Asked for, but there is nothing to merge (a decode error, or no usable logprobs).
    Off,
}

/// Where the decode response stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// No decode response yet.
    Awaiting,
    /// The decode headers are held until the prefill answers (merging only).
    HeadersHeld,
    /// Headers and `size` bytes of body are held until the prefill answers (merging only).
    BodyHeld { size: usize, ended: bool },
    /// The headers went downstream; the body flows (a JSON body to merge is buffered).
    Flowing,
}

pub struct PdLeg {
    prefill: Routed,
    token: u32,
    stream: bool,
    pending: bool,
    merge: Merge,
    phase: Phase,
    /// A prefill failure to report inside a response that has already started.
    error_event: Option<Vec<u8>>,
}

impl PdLeg {
    /// `token`: the prefill callout's (none: none went out, nothing is awaited); `merge`: the
    /// client asked for logprobs, held in this VM's room.
    pub fn new(prefill: Routed, token: Option<u32>, stream: bool, merge: Option<MergeRoom>) -> Self {
        Self {
            prefill,
            token: token.unwrap_or_default(),
            stream,
            pending: token.is_some(),
            merge: merge.map_or(Merge::No, Merge::Waiting),
            phase: Phase::Awaiting,
            error_event: None,
        }
    }

    pub fn prefill(&self) -> &Routed {
        &self.prefill
    }

    /// Whether `token` is this leg's callout and it has not answered yet.
    pub fn awaits(&self, token: u32) -> bool {
        self.pending && self.token == token
    }

    /// The callout's token while it is out.
    pub fn token(&self) -> Option<u32> {
        self.pending.then_some(self.token)
    }

    /// The callout is still out (on stream end it must be released).
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// Whether the prefill's response body must be read (to merge its logprobs).
    pub fn wants_prefill_body(&self) -> bool {
        matches!(self.merge, Merge::Waiting(_))
    }

    /// Logprobs will not be merged into this response: a stream is told so in an SSE error
    /// event in front of what comes next (a JSON body passes with the decode's own only).
    pub fn refuse_merge(&mut self, why: &MergeError) {
        log::warn!("input logprobs of {} not merged: {why}", self.prefill.addr);
        self.merge = Merge::Off;
        if self.stream {
            self.error_event = Some(logprobs::error_event(&format!("input logprobs not merged: {why}")).into_bytes());
        }
    }

    /// The decode response headers, with their status. Returns what to do with them and
    /// whether `content-length` must be dropped (the merged body has another length).
    pub fn decode_headers(&mut self, status: u16) -> (Action, bool) {
        let merging = !matches!(self.merge, Merge::No);
        if merging && status != 200 {
            self.merge = Merge::Off;
        }
        let drop_length = merging && status == 200 && !self.stream;
        if matches!(self.merge, Merge::Waiting(_)) {
            self.phase = Phase::HeadersHeld;
            return (Action::Pause, drop_length);
        }
        self.phase = Phase::Flowing;
        (Action::Continue, drop_length)
    }

    /// A decode response body chunk: `size` bytes buffered so far, `end` at end of stream;
    /// `read` fetches them (called only when needed).
    pub fn decode_body(&mut self, size: usize, end: bool, read: impl FnOnce() -> Vec<u8>) -> BodyStep {
        if let Phase::HeadersHeld | Phase::BodyHeld { .. } = self.phase {
            // Envoy keeps the data while we wait for the prefill.
            self.phase = Phase::BodyHeld { size, ended: end };
            return BodyStep::PAUSE;
        }
        self.phase = Phase::Flowing;
        let error_event = self.error_event.take();
        let merging = matches!(self.merge, Merge::Json(_) | Merge::Sse(_));
        if error_event.is_none() && !merging {
            return BodyStep::CONTINUE;
        }
        if matches!(self.merge, Merge::Json(_)) && !end && error_event.is_none() {
            return BodyStep::PAUSE; // Buffer the whole JSON body, merge at its end.
        }
        let chunk = read();
        let mut out = error_event.unwrap_or_default();
        match &mut self.merge {
            Merge::Json(lp) if end => out.extend(lp.merge_json(&chunk).unwrap_or(chunk)),
            Merge::Sse(m) => {
                out.extend(m.push(&chunk));
                if end {
                    out.extend(m.finish());
                }
            }
            _ => out.extend(chunk),
        }
        BodyStep { action: Action::Continue, replace: Some(out) }
    }

    /// The prefill callout answered; `read_held` fetches the held decode body (if any).
    pub fn prefill_answered(&mut self, result: PrefillResult, read_held: impl FnOnce(usize) -> Vec<u8>) -> Vec<Effect> {
        self.pending = false;
        let body = match result {
            PrefillResult::Failed { message } => return self.prefill_failed(message),
            PrefillResult::Ok { body } => body,
        };
        if let Merge::Waiting(room) = &self.merge {
            let room = room.clone();
            self.merge = Merge::Off;
            match body.as_deref().map(|body| PrefillLogprobs::from_response(body, &room)) {
                Some(Ok(lp)) if self.stream => self.merge = Merge::Sse(SseMerger::new(lp)),
                Some(Ok(lp)) => self.merge = Merge::Json(lp),
                Some(Err(e)) => self.refuse_merge(&e),
                None => {}
            }
        }
        match self.phase {
            Phase::HeadersHeld => {
                self.phase = Phase::Flowing;
                vec![Effect::ResumeResponse]
            }
            Phase::BodyHeld { size, ended } => {
                let json = matches!(self.merge, Merge::Json(_));
                if json && !ended {
                    // The rest of the JSON body is still coming: the next body callback sees
                    // all of it and merges at its end (continuing it resumes the headers too).
                    self.phase = Phase::Flowing;
                    return Vec::new();
                }
                self.phase = Phase::Flowing;
                let held = read_held(size);
                let merged = match (&mut self.merge, self.error_event.take()) {
                    (Merge::Json(lp), _) => lp.merge_json(&held).ok(),
                    (Merge::Sse(m), _) => {
                        let mut out = m.push(&held);
                        if ended {
                            out.extend(m.finish());
                        }
                        Some(out)
                    }
                    (_, Some(mut event)) => {
                        event.extend(held);
                        Some(event)
                    }
                    _ => None,
                };
                let mut effects: Vec<Effect> =
                    merged.map(|body| Effect::ReplaceHeldBody { size, body }).into_iter().collect();
                effects.push(Effect::ResumeResponse);
                effects
            }
            Phase::Awaiting | Phase::Flowing => Vec::new(),
        }
    }

    fn prefill_failed(&mut self, message: String) -> Vec<Effect> {
        match self.phase {
            // Nothing went downstream yet: the client gets a clean 502.
            Phase::Awaiting | Phase::HeadersHeld | Phase::BodyHeld { .. } => vec![Effect::Fail502(message)],
            Phase::Flowing => {
                let body = error_json(502, "prefill_failed", &message);
                let mut event = b"data: ".to_vec();
                event.extend_from_slice(&body);
                event.extend_from_slice(b"\n\n");
                self.error_event = Some(event);
                self.merge = Merge::Off;
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(stream: bool, merge: bool) -> PdLeg {
        let prefill =
            Routed { worker: 1, addr: "127.0.0.1:30001".into(), counted: true, matched_bytes: 0, dp_rank: None };
        PdLeg::new(prefill, Some(7), stream, merge.then(MergeRoom::default))
    }

    fn prefill_body() -> Vec<u8> {
        br#"{"text":"","meta_info":{"input_token_logprobs":[[-0.5,1,null],[-0.25,2,null]]}}"#.to_vec()
    }

    fn ok(l: &PdLeg) -> PrefillResult {
        PrefillResult::Ok { body: l.wants_prefill_body().then(prefill_body) }
    }

    fn decode_json() -> Vec<u8> {
        br#"{"text":"hi","meta_info":{"input_token_logprobs":[[-1.0,3,null]]}}"#.to_vec()
    }

    fn merged_ids(body: &[u8]) -> Vec<u64> {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["meta_info"]["input_token_logprobs"].as_array().unwrap().iter().map(|t| t[1].as_u64().unwrap()).collect()
    }

    fn no_read(_: usize) -> Vec<u8> {
        panic!("nothing is held")
    }

    #[test]
    fn without_merging_nothing_waits_for_the_prefill() {
        let mut l = leg(false, false);
        assert!(!l.wants_prefill_body());
        assert_eq!(l.decode_headers(200), (Action::Continue, false));
        assert_eq!(l.decode_body(10, false, || panic!("not read")), BodyStep::CONTINUE);
        assert!(l.prefill_answered(PrefillResult::Ok { body: None }, no_read).is_empty());
        assert!(!l.pending());
        assert_eq!(l.decode_body(10, true, || panic!("not read")), BodyStep::CONTINUE);
    }

    #[test]
    fn prefill_first_then_json_decode_is_merged_at_its_end() {
        let mut l = leg(false, true);
        assert!(l.prefill_answered(ok(&l), no_read).is_empty());
        assert_eq!(l.decode_headers(200), (Action::Continue, true));
        assert_eq!(l.decode_body(5, false, || panic!("not yet")), BodyStep::PAUSE);
        let step = l.decode_body(decode_json().len(), true, decode_json);
        assert_eq!(step.action, Action::Continue);
        assert_eq!(merged_ids(&step.replace.unwrap()), vec![1, 2, 3]);
    }

    #[test]
    fn decode_headers_first_are_held_until_the_prefill_answers() {
        let mut l = leg(false, true);
        assert_eq!(l.decode_headers(200), (Action::Pause, true));
        assert_eq!(l.prefill_answered(ok(&l), no_read), vec![Effect::ResumeResponse]);
        assert_eq!(l.decode_body(3, false, || panic!("not yet")), BodyStep::PAUSE);
        let step = l.decode_body(decode_json().len(), true, decode_json);
        assert_eq!(merged_ids(&step.replace.unwrap()), vec![1, 2, 3]);
    }

    #[test]
    fn whole_decode_body_first_is_merged_in_place_when_the_prefill_answers() {
        let mut l = leg(false, true);
        assert_eq!(l.decode_headers(200).0, Action::Pause);
        let size = decode_json().len();
        assert_eq!(l.decode_body(size, true, || panic!("held, not read")), BodyStep::PAUSE);
        let effects = l.prefill_answered(ok(&l), |n| {
            assert_eq!(n, size);
            decode_json()
        });
        match effects.as_slice() {
            [Effect::ReplaceHeldBody { size: s, body }, Effect::ResumeResponse] => {
                assert_eq!(*s, size);
                assert_eq!(merged_ids(body), vec![1, 2, 3]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn part_of_a_json_body_first_waits_for_the_rest() {
        let mut l = leg(false, true);
        l.decode_headers(200);
        assert_eq!(l.decode_body(4, false, || panic!("held")), BodyStep::PAUSE);
        assert!(l.prefill_answered(ok(&l), no_read).is_empty(), "the next body callback merges");
        let step = l.decode_body(decode_json().len(), true, decode_json);
        assert_eq!(merged_ids(&step.replace.unwrap()), vec![1, 2, 3]);
    }

    fn sse(events: &[&str]) -> Vec<u8> {
        events.iter().map(|e| format!("data: {e}\n\n")).collect::<String>().into_bytes()
    }

    #[test]
    fn sse_chunks_held_before_the_prefill_are_merged_then_the_rest_flows() {
        let mut l = leg(true, true);
        assert_eq!(l.decode_headers(200), (Action::Pause, false), "SSE keeps no content-length");
        let first = sse(&[r#"{"text":"a","meta_info":{"input_token_logprobs":[[-1.0,3,null]]}}"#]);
        assert_eq!(l.decode_body(first.len(), false, || panic!("held")), BodyStep::PAUSE);
        let effects = l.prefill_answered(ok(&l), |_| first.clone());
        let [Effect::ReplaceHeldBody { body, .. }, Effect::ResumeResponse] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(text.contains("[-0.5,1,null],[-0.25,2,null],[-1.0,3,null]"), "{text}");
        let rest = sse(&["[DONE]"]);
        let step = l.decode_body(rest.len(), true, || rest.clone());
        assert_eq!(step.action, Action::Continue);
        assert!(String::from_utf8(step.replace.unwrap()).unwrap().contains("[DONE]"));
    }

    #[test]
    fn a_failed_prefill_before_anything_went_downstream_is_a_502() {
        for headers_first in [false, true] {
            let mut l = leg(false, true);
            if headers_first {
                l.decode_headers(200);
                l.decode_body(3, false, || panic!("held"));
            }
            let effects = l.prefill_answered(PrefillResult::Failed { message: "prefill x failed".into() }, no_read);
            assert_eq!(effects, vec![Effect::Fail502("prefill x failed".into())]);
        }
        let mut l = leg(false, false);
        let effects = l.prefill_answered(PrefillResult::Failed { message: "m".into() }, no_read);
        assert_eq!(effects, vec![Effect::Fail502("m".into())]);
    }

    #[test]
    fn a_failed_prefill_inside_a_stream_becomes_an_sse_error_event() {
        let mut l = leg(true, false);
        assert_eq!(l.decode_headers(200), (Action::Continue, false));
        assert_eq!(l.decode_body(4, false, || panic!("not read")), BodyStep::CONTINUE);
        assert!(l.prefill_answered(PrefillResult::Failed { message: "prefill x failed".into() }, no_read).is_empty());
        let chunk = sse(&[r#"{"text":"b"}"#]);
        let step = l.decode_body(chunk.len(), false, || chunk.clone());
        let out = String::from_utf8(step.replace.unwrap()).unwrap();
        assert!(out.starts_with("data: {\"error\"") && out.contains("prefill x failed"), "{out}");
        assert!(out.ends_with(&String::from_utf8(chunk).unwrap()));
        assert_eq!(l.decode_body(2, true, || panic!("not read")), BodyStep::CONTINUE, "reported once");
    }

    #[test]
    fn a_decode_error_turns_merging_off() {
        let mut l = leg(false, true);
        assert_eq!(l.decode_headers(503), (Action::Continue, false));
        assert!(l.prefill_answered(PrefillResult::Ok { body: None }, no_read).is_empty());
        assert_eq!(l.decode_body(9, true, || panic!("not read")), BodyStep::CONTINUE);
    }

    #[test]
    fn unusable_prefill_logprobs_pass_the_decode_body_through() {
        let mut l = leg(false, true);
        l.decode_headers(200);
        l.decode_body(decode_json().len(), true, || panic!("held"));
        let effects = l.prefill_answered(PrefillResult::Ok { body: Some(b"{not json".to_vec()) }, |_| decode_json());
        assert_eq!(effects, vec![Effect::ResumeResponse]);
    }

    #[test]
    fn logprobs_past_the_vms_room_are_not_merged_and_a_stream_is_told() {
        let prefill =
            Routed { worker: 1, addr: "127.0.0.1:30001".into(), counted: true, matched_bytes: 0, dp_rank: None };
        let room = MergeRoom::with_cap(10);
        let mut l = PdLeg::new(prefill, Some(7), true, Some(room.clone()));
        assert_eq!(l.decode_headers(200), (Action::Pause, false));
        assert_eq!(l.prefill_answered(ok(&l), no_read), vec![Effect::ResumeResponse]);
        assert_eq!(room.held(), 0, "nothing held past the cap");
        let chunk = sse(&[r#"{"text":"a","meta_info":{"input_token_logprobs":[[-1.0,3,null]]}}"#]);
        let out = String::from_utf8(l.decode_body(chunk.len(), false, || chunk.clone()).replace.unwrap()).unwrap();
        assert!(out.starts_with("data: {\"error\"") && out.contains("logprob_merge_refused"), "{out}");
        assert!(out.ends_with(std::str::from_utf8(&chunk).unwrap()), "the decode's events as sent");
        assert_eq!(l.decode_body(4, true, || panic!("not read")), BodyStep::CONTINUE, "told once");
    }

    #[test]
    fn the_token_identifies_the_pending_callout() {
        let mut l = leg(false, false);
        assert!(l.awaits(7) && !l.awaits(8));
        l.prefill_answered(PrefillResult::Ok { body: None }, no_read);
        assert!(!l.awaits(7));
    }
}
