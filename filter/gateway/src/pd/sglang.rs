//! SGLang's PD protocol (sglang-router's behaviour): `bootstrap_host/port/room` and the
//! gateway's `rid` spliced into the body ([`kvmesh_core::bootstrap`]), which both legs get;
//! the prefill leg goes out as a callout beside the decode leg, and [`PdLeg`] follows its
//! answer and the decode response in any order (input logprobs merged when asked for). A
//! prefill still out when the request ends is stopped with `/abort_request` per rid.

use kvmesh_core::bootstrap::{self, random_rooms, Bootstrap};
use kvmesh_core::logprobs::{MergeError, MergeRoom, MAX_MERGE_BYTES};
use kvmesh_core::request::{ParsedRequest, RequestError};
use kvmesh_core::Endpoint;

use super::{Answer, Protocol, Running, Split};
use crate::host::{Action, StreamHost};
use crate::pd_leg::{BodyStep, Effect, PdLeg, PrefillResult};
use crate::routed::Routed;

/// Most `/abort_request` calls for one request's prefill leg (one per batch item).
const MAX_ABORTS: usize = 16;
/// How much of a failed prefill's body goes into the error message.
const ERROR_DETAIL_BYTES: usize = 512;

/// The plan: `body` (bootstrap fields and `rid` injected) goes to both legs; `abort_rids` can
/// stop the prefill should the request end before it answers.
#[derive(Debug, PartialEq)]
pub struct Sglang {
    body: Vec<u8>,
    abort_rids: Vec<String>,
    merge_logprobs: bool,
}

/// The running split: the prefill callout and the decode response, and the rids to abort by.
pub struct Beside {
    leg: PdLeg,
    abort_rids: Vec<String>,
}

impl Protocol for Sglang {
    type Running = Beside;

    fn split(split: &Split<'_>, mut random: impl FnMut() -> u64) -> Result<Self, RequestError> {
        let parsed = split.parsed;
        let boot = Bootstrap {
            host: split.prefill.host.clone(),
            port: split.prefill.bootstrap_port,
            rooms: random_rooms(parsed.batch.unwrap_or(1), &mut random),
            rid: random(),
        };
        let body = boot.inject(split.body, parsed)?;
        Ok(Self {
            body,
            abort_rids: boot.injected_rids(parsed, MAX_ABORTS),
            merge_logprobs: parsed.return_logprob && split.endpoint == Endpoint::Generate,
        })
    }

    /// The client's `rid` replaced by the gateway's (SGLang aborts by rid prefix: a client's
    /// could name other requests); the body is the client's when it set none.
    fn alone(
        body: &[u8],
        parsed: &ParsedRequest<'_>,
        mut random: impl FnMut() -> u64,
    ) -> Result<Option<(Vec<u8>, String)>, RequestError> {
        if parsed.rid_at.is_none() {
            return Ok(None);
        }
        let id = random();
        Ok(bootstrap::own_rid(body, parsed, id)?.map(|b| (b, bootstrap::rid(id, 0))))
    }

    fn merges_logprobs(&self) -> bool {
        self.merge_logprobs
    }

    fn rid(&self) -> Option<&str> {
        self.abort_rids.first().map(String::as_str)
    }

    fn decode_body(&self) -> Option<&[u8]> {
        Some(&self.body)
    }

    fn callout_body(&self) -> Option<&[u8]> {
        Some(&self.body)
    }

    fn start(self, prefill: Routed, token: Option<u32>, stream: bool, room: Option<MergeRoom>) -> Beside {
        Beside { leg: PdLeg::new(prefill, token, stream, room), abort_rids: self.abort_rids }
    }
}

impl Running for Beside {
    fn prefill(&self) -> &Routed {
        self.leg.prefill()
    }

    fn token(&self) -> Option<u32> {
        self.leg.token()
    }

    fn defers_decode_failures(&self) -> bool {
        self.leg.pending()
    }

    fn decode_headers(&mut self, status: u16) -> (Action, bool) {
        self.leg.decode_headers(status)
    }

    fn decode_body(&mut self, size: usize, end: bool, read: impl FnOnce() -> Vec<u8>) -> BodyStep {
        self.leg.decode_body(size, end, read)
    }

    fn answered(&mut self, host: &dyn StreamHost, answer: &Answer) -> Vec<Effect> {
        let leg = &mut self.leg;
        let size = answer.size;
        let result = if answer.ok() {
            // A prefill answer too large to merge is not even copied into the VM.
            let body = match leg.wants_prefill_body() {
                true if size > MAX_MERGE_BYTES => {
                    leg.refuse_merge(&MergeError::TooLarge(size));
                    None
                }
                wanted => wanted.then(|| host.callout_body(size)),
            };
            PrefillResult::Ok { body }
        } else {
            let why = answer
                .status
                .map_or_else(|| "no response (connection failure or timeout)".to_string(), |s| format!("HTTP {s}"));
            let detail = host.callout_body(size.min(ERROR_DETAIL_BYTES));
            let detail = String::from_utf8_lossy(&detail);
            PrefillResult::Failed {
                message: format!("prefill worker {} failed: {why} {detail}", leg.prefill().addr).trim_end().to_string(),
            }
        };
        leg.prefill_answered(result, |size| host.response_body(0..size))
    }

    /// Envoy does not cancel a Wasm callout when its stream ends (the ABI has no call for
    /// it): the prefill worker would go on computing, and publishing, a KV no decode will
    /// fetch. SGLang's `/abort_request` for each rid the gateway gave the request stops it.
    fn aborts(&self) -> Vec<(&'static str, String)> {
        self.abort_rids.iter().map(|rid| ("/abort_request", serde_json::json!({ "rid": rid }).to_string())).collect()
    }
}
