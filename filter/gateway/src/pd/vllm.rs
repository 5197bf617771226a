//! vLLM's PD protocol (its KV-transfer connector, as vLLM's own disaggregation proxy drives
//! it): the prefill leg goes first, asking for a remote decode and one token
//! ([`kvmesh_core::vllm`] writes both bodies); the request is held until it answers, then
//! goes to the decode worker with the answer's `kv_transfer_params` — or, when it gave none,
//! alone as the client sent it (unless `prefill_fallback` is off).

use kvmesh_core::logprobs::{MergeRoom, MAX_MERGE_BYTES};
use kvmesh_core::request::RequestError;
use kvmesh_core::vllm;

use super::{Answer, Protocol, Running, Split};
use crate::host::{Metric, StreamHost};
use crate::pd_leg::Effect;
use crate::routed::Routed;

/// The plan: the prefill leg's body.
#[derive(Debug, PartialEq)]
pub struct Vllm {
    body: Vec<u8>,
}

/// The running split: the prefill leg out (its token), then whether the decode leg got its KV.
pub struct First {
    prefill: Routed,
    token: Option<u32>,
    transferred: bool,
}

impl Protocol for Vllm {
    type Running = First;

    fn split(split: &Split<'_>, _random: impl FnMut() -> u64) -> Result<Self, RequestError> {
        Ok(Self { body: vllm::prefill_body(split.body)? })
    }

    fn callout_body(&self) -> Option<&[u8]> {
        Some(&self.body)
    }

    fn waits_for_prefill(&self) -> bool {
        true
    }

    fn start(self, prefill: Routed, token: Option<u32>, _stream: bool, _room: Option<MergeRoom>) -> First {
        First { prefill, token, transferred: false }
    }
}

impl Running for First {
    fn prefill(&self) -> &Routed {
        &self.prefill
    }

    fn token(&self) -> Option<u32> {
        self.token
    }

    /// The response names the prefill worker whose KV the decode leg got.
    fn named(&self) -> bool {
        self.transferred
    }

    /// With its `kv_transfer_params` the held request goes to the decode worker carrying them;
    /// without (an error, a timeout, an answer without them, one past the merge bound, which
    /// is not copied in) it runs on the decode worker alone, as the client sent it, and
    /// `kvmesh_prefill_fallbacks_total` counts it.
    fn answered(&mut self, host: &dyn StreamHost, answer: &Answer) -> Vec<Effect> {
        self.token = None;
        let params = Some(answer.size)
            .filter(|&size| answer.ok() && size <= MAX_MERGE_BYTES)
            .and_then(|size| vllm::transfer_params(&host.callout_body(size)));
        let decode = params.as_deref().map(|p| vllm::decode_body(&host.request_body(answer.request_size), p));
        if let Some(Ok(body)) = decode {
            self.transferred = true;
            return vec![Effect::DecodeBody(body), Effect::ResumeRequest];
        }
        let why = answer.status.map_or_else(|| "no response".to_string(), |s| format!("HTTP {s}"));
        let addr = &self.prefill.addr;
        if !answer.prefill_fallback {
            return vec![Effect::Fail502(format!("prefill worker {addr} gave no KV transfer ({why})"))];
        }
        log::warn!("prefill worker {addr} gave no KV transfer ({why}): the decode worker runs it alone");
        host.increment(Metric::PrefillFallbacks);
        vec![Effect::ResumeRequest]
    }
}
