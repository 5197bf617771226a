//! What a decision is made of: the plan a decision returns (not recorded anywhere yet), what
//! committing it gives the glue, and the per-request facts a decision takes.

use kvmesh_core::pd::PdDecision;
use kvmesh_core::{Decision, WorkerId};

use super::reply::Reply;
use crate::headers::Headers;
use crate::now::Now;
use crate::pd::PrefillLeg;
use crate::routed::Routed;
use crate::shared::Inflight;

/// What the filter does with a request.
// One per request, moved once into the glue's `apply`: the size difference costs nothing that
// boxing the plan (an allocation per request) would save.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Outcome {
    /// Send it where the plan says, then [`Gateway::commit`] the plan.
    Route(Plan),
    /// Answer locally with a JSON error.
    Reply(Reply),
}

/// A decision not yet recorded anywhere: where to send the request and, in PD mode, what to
/// send the prefill worker.
#[derive(Debug)]
pub struct Plan {
    pub(super) chosen: Chosen,
    pub(super) main: Routed,
    /// Where Envoy fails the main leg over to, in order (other available workers of its
    /// role, least loaded first; at most `max_attempts - 1`).
    pub(super) fallbacks: Vec<String>,
    /// Boxed: `Outcome` stays small for the regular requests.
    pub(super) pd: Option<Box<PdPlan>>,
    /// The body the worker gets when it is not the client's: regular mode with a data-parallel
    /// rank chosen (the client's with `data_parallel_rank`), or a PD request run on the decode
    /// worker alone whose client set a `rid` (the gateway's in its place); none: the client's
    /// body goes unchanged.
    pub(super) body: Option<Box<[u8]>>,
    /// The `rid` the gateway gave a PD request run on the decode worker alone (see `body`),
    /// for the decision record.
    pub(super) rid: Option<String>,
    /// The shared counts as read for this decision (the commit's CAS starts from them).
    pub(super) inflight: Inflight,
    /// When the decision was made: a half-open worker's probe slot is taken at that time.
    pub(super) now: Now,
    /// A batch: no prediction is judged (its items' reports cannot be told apart).
    pub(super) batch: bool,
    /// The model pool it was routed in (for the decision record and, where the gateway
    /// routes by model, the per-model counters).
    pub(super) model: Option<Box<str>>,
}

#[derive(Debug)]
pub(super) enum Chosen {
    Regular(Decision),
    Pd(PdDecision),
}

/// The PD part of a plan.
#[derive(Debug, PartialEq)]
pub struct PdPlan {
    pub prefill: Routed,
    /// How its prefill leg runs: the pair's PD protocol's plan (`crate::pd`).
    pub leg: PrefillLeg,
    /// Whether the prefill's input logprobs must be merged into the decode response.
    pub merge_logprobs: bool,
    pub stream: bool,
    /// Whether the prefill worker was believed to hold more than `cache_threshold` of the
    /// routing text (sglang-router's PD cache hit; a text-blind policy's pick never is).
    pub cache_hit: bool,
}

impl Plan {
    /// Where the request itself goes (the decode worker in PD mode).
    pub fn addr(&self) -> &str {
        &self.main.addr
    }

    pub fn pd(&self) -> Option<&PdPlan> {
        self.pd.as_deref()
    }

    /// The body the main leg gets instead of the client's, in regular mode (a rank named).
    pub fn body(&self) -> Option<&[u8]> {
        self.body.as_deref()
    }

    /// Where Envoy fails the main leg over to, in order.
    pub fn fallbacks(&self) -> &[String] {
        &self.fallbacks
    }
}

/// `first,then,...`: the value `override_host` reads, in the order it tries them.
pub fn endpoint_list(first: &str, then: &[String]) -> String {
    let mut out = String::with_capacity(first.len() + then.iter().map(|a| a.len() + 1).sum::<usize>());
    out.push_str(first);
    for addr in then {
        out.push(',');
        out.push_str(addr);
    }
    out
}

/// A committed plan: the legs, counted in flight.
#[derive(Debug)]
pub struct Committed {
    pub main: Routed,
    pub prediction: Option<Prediction>,
    pub prefill: Option<Routed>,
    /// A split's prefill plan, which the request runs ([`crate::pd::Leg::start`]).
    pub leg: Option<PrefillLeg>,
    /// A PD request's prefill pick: a cache hit or not (see [`PdPlan::cache_hit`]).
    pub pd_cache_hit: Option<bool>,
    pub merge_logprobs: bool,
    pub stream: bool,
    /// The model, for the per-model counters: only where the gateway routes by model.
    pub model: Option<Box<str>>,
    /// The decision record (`record.rs`), for the host's filter state under
    /// [`DECISION_KEY`](super::DECISION_KEY).
    pub record: String,
}

/// How a routed request's destination headers are written (from the configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    /// The whole request's budget, for `x-envoy-upstream-rq-timeout-ms`.
    pub timeout_secs: u64,
    /// Also write `x-envoy-original-dst-host` (`original_dst_header`).
    pub original_dst: bool,
    /// The `authorization` the workers get (`worker_api_key`), in place of the client's.
    pub authorization: Option<String>,
}

impl Default for Destination {
    /// As configured by default.
    fn default() -> Self {
        Self {
            timeout_secs: kvmesh_core::config::DEFAULT_REQUEST_TIMEOUT_SECS,
            original_dst: true,
            authorization: None,
        }
    }
}
/// Per-request facts from the host.
#[derive(Clone, Copy, Default)]
pub struct RequestInfo<'a> {
    /// The request id (`x-request-id`; logs and both PD legs carry it as a header, never as
    /// `rid`).
    pub request_id: Option<&'a str>,
    /// The routing key a request header gave (`consistent_hashing`; see [`Front::routing_key`](super::Front::routing_key)).
    pub routing_key: Option<&'a str>,
    /// Reads the request headers again, for a VM that learns only at the body that a key is
    /// needed (its first snapshot, or new settings, arrived in between); none when the headers
    /// were already looked up for a key (or cannot be read again).
    pub headers: Option<&'a dyn Fn() -> Headers>,
    /// When the request body was complete.
    pub now: Now,
}

/// What the gateway believed a worker held when it routed a request there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prediction {
    pub worker: WorkerId,
    /// Bytes of the routing text the index matched for that worker.
    pub matched_bytes: u64,
    /// How many leading blocks that is.
    pub matched_blocks: usize,
    /// The hashes of all the request's blocks, in order (indexed for the worker when the
    /// request was routed).
    pub hashes: Vec<u64>,
}

impl Prediction {
    /// The prediction of a decision for `worker` that matched `matched_bytes` of a routing
    /// text cut into `blocks` of `block_size` bytes.
    pub fn new(worker: WorkerId, matched_bytes: usize, blocks: &[u64], block_size: usize) -> Self {
        let n = matched_bytes.div_ceil(block_size.max(1)).min(blocks.len());
        Self { worker, matched_bytes: matched_bytes as u64, matched_blocks: n, hashes: blocks.to_vec() }
    }
}
