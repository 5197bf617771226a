//! The PD protocols, one module each: [`sglang`] (bootstrap fields in both bodies, the prefill
//! leg sent beside the decode leg), [`vllm`] (the prefill leg first, its `kv_transfer_params`
//! handed to the decode leg) and [`llm_d`] (the decode pod's sidecar runs the prefill). Each
//! owns what differs between them: its prefill plan (made in the decision), the bodies and
//! headers the legs get, what its prefill's answer does, and what is left to do for a prefill
//! still out when the request ends.
//!
//! The view and the request state machine see them only through [`PrefillLeg`] (a split's
//! plan, made by [`PrefillLeg::plan`]) and [`Leg`] (the split while its request runs, from
//! [`Leg::start`]), which dispatch to the modules statically — no protocol is named outside
//! this folder (`tests/tests/layout.rs` checks it).
//!
//! To add a protocol: its variant in `kvmesh_core::pd_protocol`, a module here implementing
//! [`Protocol`], and one arm for it in [`PrefillLeg::plan`], [`PrefillLeg::alone`],
//! [`PrefillLeg::protocol`] and the two `each!` dispatch macros below.

mod llm_d;
mod sglang;
mod vllm;

use kvmesh_core::logprobs::MergeRoom;
use kvmesh_core::request::{ParsedRequest, RequestError};
use kvmesh_core::settings::PdProtocol;
use kvmesh_core::{Endpoint, Worker};

use crate::host::{Action, StreamHost};
use crate::pd_leg::{BodyStep, Effect};
use crate::routed::Routed;

pub use llm_d::PREFILLER_HEADER;

/// The protocol of a worker, and of a deployment, that names none in a routing view without
/// PD settings (where it decides nothing): SGLang's.
pub const DEFAULT: PdProtocol = PdProtocol::Sglang;

/// What a split is planned from.
pub struct Split<'a> {
    pub endpoint: Endpoint,
    /// The body the client sent (without a data-parallel rank it named).
    pub body: &'a [u8],
    pub parsed: &'a ParsedRequest<'a>,
    /// The prefill worker chosen.
    pub prefill: &'a Worker,
}

/// How the prefill callout answered, as a protocol reads it.
pub struct Answer {
    /// The answer's HTTP status (none: no answer — a connection failure or a timeout).
    pub status: Option<u16>,
    /// The answer body's size.
    pub size: usize,
    /// The size of the request body the filter holds (the client's, or the gateway's version).
    pub request_size: usize,
    /// `prefill_fallback`: a request whose prefill failed may run on the decode worker alone.
    pub prefill_fallback: bool,
}

impl Answer {
    /// A 2xx answer.
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }
}

/// What one PD protocol does. The plan side (`split` to `waits_for_prefill`) is asked while
/// deciding and applying; [`Protocol::start`] turns the plan into the protocol's running
/// state ([`Running`]) once the decision committed. The defaults are "nothing to do".
pub trait Protocol: Sized {
    type Running: Running;

    /// The prefill leg of a split onto `split.prefill`; `random` gives random numbers.
    fn split(split: &Split<'_>, random: impl FnMut() -> u64) -> Result<Self, RequestError>;

    /// The body a request that runs on the decode worker alone gets in place of the client's,
    /// with the `rid` the gateway gave it (for the decision record); none: the client's body.
    fn alone(
        _body: &[u8],
        _parsed: &ParsedRequest<'_>,
        _random: impl FnMut() -> u64,
    ) -> Result<Option<(Vec<u8>, String)>, RequestError> {
        Ok(None)
    }

    /// Whether the prefill's input logprobs are merged into the decode response.
    fn merges_logprobs(&self) -> bool {
        false
    }

    /// The `rid` the gateway gave the request's (first) item, for the decision record.
    fn rid(&self) -> Option<&str> {
        None
    }

    /// Whether the gateway sends the prefill leg itself (and so counts it in flight).
    fn sent_by_gateway(&self) -> bool {
        true
    }

    /// The body the decode leg gets in place of the client's (none: the client's, or the
    /// gateway's version of it — a client's rank taken out).
    fn decode_body(&self) -> Option<&[u8]> {
        None
    }

    /// The request header naming the prefill worker (`ip:port`) on the decode leg.
    fn decode_header(&self) -> Option<&'static str> {
        None
    }

    /// The prefill callout's body (none: the gateway sends no prefill leg).
    fn callout_body(&self) -> Option<&[u8]> {
        None
    }

    /// Whether the request is held until the prefill callout answers.
    fn waits_for_prefill(&self) -> bool {
        false
    }

    /// The running state, once the decision committed: `token` is the prefill callout's
    /// (when [`Protocol::callout_body`] gave one), `room` holds the logprobs to merge.
    fn start(self, prefill: Routed, token: Option<u32>, stream: bool, room: Option<MergeRoom>) -> Self::Running;
}

/// A split while its request runs.
pub trait Running {
    /// The prefill worker.
    fn prefill(&self) -> &Routed;

    /// The prefill callout's token while it is out.
    fn token(&self) -> Option<u32> {
        None
    }

    /// Whether a decode failure seen now waits for the prefill's answer (it may be the
    /// prefill's doing) and counts only if the prefill succeeds.
    fn defers_decode_failures(&self) -> bool {
        false
    }

    /// Whether the response names the prefill worker (`x-kvmesh-prefill`).
    fn named(&self) -> bool {
        true
    }

    /// The decode response's headers, with their status: what to do with them and whether
    /// `content-length` must go.
    fn decode_headers(&mut self, _status: u16) -> (Action, bool) {
        (Action::Continue, false)
    }

    /// A decode response body chunk (`size` bytes so far, `end` at its end; `read` reads them).
    fn decode_body(&mut self, _size: usize, _end: bool, _read: impl FnOnce() -> Vec<u8>) -> BodyStep {
        BodyStep::CONTINUE
    }

    /// The prefill callout answered (or failed): what the request does now. The callout is
    /// no longer out afterwards.
    fn answered(&mut self, host: &dyn StreamHost, answer: &Answer) -> Vec<Effect>;

    /// The callouts (path, JSON body) that stop a prefill still out when the request ends.
    fn aborts(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

/// How a split request's prefill leg runs: the pair's protocol's plan.
#[derive(Debug, PartialEq)]
pub enum PrefillLeg {
    Sglang(sglang::Sglang),
    LlmD(llm_d::LlmD),
    Vllm(vllm::Vllm),
}

/// The split of a request while it runs (see [`Running`]).
pub enum Leg {
    Sglang(<sglang::Sglang as Protocol>::Running),
    LlmD(<llm_d::LlmD as Protocol>::Running),
    Vllm(<vllm::Vllm as Protocol>::Running),
}

/// `$body` with `$p` bound to the protocol's own value inside a `$ty` (`PrefillLeg` or `Leg`),
/// for every protocol: the one place a new protocol is added to the dispatch.
macro_rules! each {
    ($ty:ident, $leg:expr, $p:ident => $body:expr) => {
        match $leg {
            $ty::Sglang($p) => $body,
            $ty::LlmD($p) => $body,
            $ty::Vllm($p) => $body,
        }
    };
}

impl PrefillLeg {
    /// The prefill leg of a split in `protocol` (the pair's).
    pub fn plan(protocol: PdProtocol, split: &Split<'_>, random: impl FnMut() -> u64) -> Result<Self, RequestError> {
        Ok(match protocol {
            PdProtocol::Sglang => Self::Sglang(sglang::Sglang::split(split, random)?),
            PdProtocol::LlmD => Self::LlmD(llm_d::LlmD::split(split, random)?),
            PdProtocol::Vllm => Self::Vllm(vllm::Vllm::split(split, random)?),
        })
    }

    /// See [`Protocol::alone`], for a request of `protocol` run on its decode worker alone.
    pub fn alone(
        protocol: PdProtocol,
        body: &[u8],
        parsed: &ParsedRequest<'_>,
        random: impl FnMut() -> u64,
    ) -> Result<Option<(Vec<u8>, String)>, RequestError> {
        match protocol {
            PdProtocol::Sglang => sglang::Sglang::alone(body, parsed, random),
            PdProtocol::LlmD => llm_d::LlmD::alone(body, parsed, random),
            PdProtocol::Vllm => vllm::Vllm::alone(body, parsed, random),
        }
    }

    /// The protocol this leg is planned in.
    pub fn protocol(&self) -> PdProtocol {
        match self {
            Self::Sglang(_) => PdProtocol::Sglang,
            Self::LlmD(_) => PdProtocol::LlmD,
            Self::Vllm(_) => PdProtocol::Vllm,
        }
    }

    pub fn merges_logprobs(&self) -> bool {
        each!(Self, self, p => p.merges_logprobs())
    }

    pub fn rid(&self) -> Option<&str> {
        each!(Self, self, p => p.rid())
    }

    pub fn sent_by_gateway(&self) -> bool {
        each!(Self, self, p => p.sent_by_gateway())
    }

    pub fn decode_body(&self) -> Option<&[u8]> {
        each!(Self, self, p => p.decode_body())
    }

    pub fn decode_header(&self) -> Option<&'static str> {
        each!(Self, self, p => p.decode_header())
    }

    pub fn callout_body(&self) -> Option<&[u8]> {
        each!(Self, self, p => p.callout_body())
    }

    pub fn waits_for_prefill(&self) -> bool {
        each!(Self, self, p => p.waits_for_prefill())
    }
}

impl Leg {
    /// The committed plan `leg` running, with its prefill worker, its callout's token and (to
    /// merge logprobs) the VM's room.
    pub fn start(leg: PrefillLeg, prefill: Routed, token: Option<u32>, stream: bool, room: Option<MergeRoom>) -> Self {
        match leg {
            PrefillLeg::Sglang(p) => Self::Sglang(p.start(prefill, token, stream, room)),
            PrefillLeg::LlmD(p) => Self::LlmD(p.start(prefill, token, stream, room)),
            PrefillLeg::Vllm(p) => Self::Vllm(p.start(prefill, token, stream, room)),
        }
    }

    pub fn prefill(&self) -> &Routed {
        each!(Self, self, r => r.prefill())
    }

    pub fn token(&self) -> Option<u32> {
        each!(Self, self, r => r.token())
    }

    /// Whether `token` is this leg's callout and it has not answered yet.
    pub fn awaits(&self, token: u32) -> bool {
        self.token() == Some(token)
    }

    /// The prefill callout is still out (at the request's end it must be released).
    pub fn pending(&self) -> bool {
        self.token().is_some()
    }

    pub fn defers_decode_failures(&self) -> bool {
        each!(Self, self, r => r.defers_decode_failures())
    }

    /// The prefill worker the response names, if any.
    pub fn named_prefill(&self) -> Option<&str> {
        each!(Self, self, r => r.named().then_some(r.prefill().addr.as_str()))
    }

    pub fn decode_headers(&mut self, status: u16) -> (Action, bool) {
        each!(Self, self, r => r.decode_headers(status))
    }

    pub fn decode_body(&mut self, size: usize, end: bool, read: impl FnOnce() -> Vec<u8>) -> BodyStep {
        each!(Self, self, r => r.decode_body(size, end, read))
    }

    pub fn answered(&mut self, host: &dyn StreamHost, answer: &Answer) -> Vec<Effect> {
        each!(Self, self, r => r.answered(host, answer))
    }

    pub fn aborts(&self) -> Vec<(&'static str, String)> {
        each!(Self, self, r => r.aborts())
    }
}
