//! What a policy decides from and what it returns: a request's routing text, the router's
//! parameters, a decision. Below the policies and the router, which both name them.

use super::{CacheAwareParams, PrefixHashParams};
use crate::blocks::{block_hashes_from, model_seed};
use crate::worker::WorkerId;

/// A request's routing text: its first bytes (what is hashed, at most
/// [`crate::request::MAX_ROUTING_BYTES`]) and its full length (what match ratios divide by),
/// and its routing key (`consistent_hashing`), if it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutingText<'a> {
    pub head: &'a [u8],
    pub len: usize,
    pub key: Option<&'a [u8]>,
    /// The first block's seed: the model pool's ([`model_seed`]), so that no prefix is a hit
    /// across models.
    pub seed: u64,
}

impl<'a> RoutingText<'a> {
    /// The same text with a routing key.
    pub fn with_key(self, key: Option<&'a [u8]>) -> Self {
        Self { key, ..self }
    }

    /// The same text for the pool of `model`.
    pub fn for_model(self, model: Option<&str>) -> Self {
        Self { seed: model_seed(model), ..self }
    }

    /// The text's chained block hashes.
    pub fn blocks(&self, block_size: usize) -> Vec<u64> {
        block_hashes_from(self.head, block_size, self.seed)
    }
}

impl<'a> From<&'a [u8]> for RoutingText<'a> {
    fn from(head: &'a [u8]) -> Self {
        Self { head, len: head.len(), key: None, seed: model_seed(None) }
    }
}

impl<'a> From<&'a crate::request::ParsedRequest<'a>> for RoutingText<'a> {
    fn from(p: &'a crate::request::ParsedRequest<'a>) -> Self {
        Self { head: &p.text, len: p.text_len.max(p.text.len()), key: None, seed: model_seed(None) }
    }
}

/// What the router decided for one request. Deciding changes nothing; the router learns of
/// the decision only when the caller [commits](crate::router::Router::commit) it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub worker: WorkerId,
    /// Bytes of the routing text found in the chosen worker's index.
    pub matched_bytes: usize,
    /// Leading blocks the index believes the chosen worker holds, whether or not the policy
    /// chose it for them (what engine feedback judges its answer against; 0 for text-blind
    /// policies that do not track prefixes).
    pub held_blocks: usize,
    /// The request's blocks, indexed for the chosen worker when the decision commits (empty
    /// for text-blind policies): what other threads and gateways must apply to their copies
    /// of the index.
    pub blocks: Vec<u64>,
}

/// What a router needs from the configuration (see `Config::router_params`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    pub cache_aware: CacheAwareParams,
    pub prefix_hash: PrefixHashParams,
    /// `marginal_utility`: weight of a request in flight against a unit of utility.
    pub utility_load_weight: f64,
    /// Bytes of routing text per index block.
    pub block_size: usize,
    /// Per-worker index budget in blocks (`max_tree_size / block_size`).
    pub max_blocks: u64,
    /// The hard bound on the index's `(worker, block)` entries ([`crate::router::MAX_INDEX_ENTRIES`]).
    pub max_entries: u64,
}
