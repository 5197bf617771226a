//! llm-d's PD protocol: the request goes to the decode pod, whose routing sidecar runs the
//! prefill on the pod that [`PREFILLER_HEADER`] names. The gateway sends no prefill leg and
//! rewrites no body; it counts only the decode leg (it never sees the prefill end).

use kvmesh_core::logprobs::MergeRoom;
use kvmesh_core::request::RequestError;

use super::{Answer, Protocol, Running, Split};
use crate::host::StreamHost;
use crate::pd_leg::Effect;
use crate::routed::Routed;

/// The header llm-d's routing sidecar reads: the prefill pod (`ip:port`). A client's own is
/// removed with the other routing headers.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// The plan: nothing but the prefill pod, which the split names.
#[derive(Debug, PartialEq)]
pub struct LlmD;

/// The running split: the prefill pod, named in the response.
pub struct Sidecar {
    prefill: Routed,
}

impl Protocol for LlmD {
    type Running = Sidecar;

    fn split(_split: &Split<'_>, _random: impl FnMut() -> u64) -> Result<Self, RequestError> {
        Ok(Self)
    }

    fn sent_by_gateway(&self) -> bool {
        false
    }

    fn decode_header(&self) -> Option<&'static str> {
        Some(PREFILLER_HEADER)
    }

    fn start(self, prefill: Routed, _token: Option<u32>, _stream: bool, _room: Option<MergeRoom>) -> Sidecar {
        Sidecar { prefill }
    }
}

impl Running for Sidecar {
    fn prefill(&self) -> &Routed {
        &self.prefill
    }

    /// No callout, so no answer.
    fn answered(&mut self, _host: &dyn StreamHost, _answer: &Answer) -> Vec<Effect> {
        Vec::new()
    }
}
