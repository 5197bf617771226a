//! Routing policies, one file each, each owning its state behind [`RoutingPolicy`]; [`Policy`]
//! is one of them with its state, and the table below (`policies!`) declares them all: the
//! names, numbers and types. They choose among plain-data [`Candidate`]s (the healthy workers
//! with their current load) and never see live worker objects, sockets or clocks.

mod cache_aware;
mod consistent_hash;
mod decision;
mod marginal_utility;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;

pub use cache_aware::{CacheAware, CacheAwareParams, Choice, Reason};
pub use consistent_hash::ConsistentHash;
pub use decision::{Decision, RouterParams, RoutingText};
pub use marginal_utility::{utility_scores, MarginalUtility, Sample, Trend, UtilityParams, UtilityWindow, MAX_WINDOW};
pub use power_of_two::PowerOfTwo;
pub use prefix_hash::{PrefixChoice, PrefixHash, PrefixHashParams};
pub use random::Random;
pub use round_robin::RoundRobin;

use rand::{Rng, RngCore};

use crate::blocks::covered_bytes;
use crate::index::PrefixIndex;
// `affinity_of` lives with the worker (the lower module), re-exported here where it was.
pub use crate::worker::affinity_of;
use crate::worker::WorkerId;

/// A worker a policy may pick, with its load: the control plane's load table plus this
/// gateway's in-flight requests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    pub id: WorkerId,
    pub load: u64,
    /// The worker's stable identity for consistent hashing ([`affinity_of`] its URL): the
    /// same in every gateway and across worker-table changes, unlike `id` in a static table.
    pub affinity: u64,
    /// `marginal_utility`'s score from the control plane (z-scored throughput and latency
    /// trends); none until the worker has enough history.
    pub utility: Option<f64>,
}

/// Why a name sglang-router knows is refused.
fn sglang_only(name: &str) -> Option<&'static str> {
    matches!(name, "manual" | "bucket").then_some("is an sglang-router policy kvmesh does not have")
}

/// What the router lends a policy for one decision: its prefix index and how it cuts text
/// into blocks.
#[derive(Clone, Copy)]
pub struct Indexed<'a> {
    pub index: &'a PrefixIndex,
    pub block_size: usize,
    /// The router indexes prefixes whatever the policy (the PD prefix decider needs it).
    pub track: bool,
}

impl Indexed<'_> {
    /// A decision for `worker` that indexes every block and reports the whole prefix it holds.
    pub fn tracked(&self, worker: WorkerId, text: RoutingText<'_>, blocks: Vec<u64>) -> Decision {
        let held = self.index.depth_of(worker, &blocks);
        Decision {
            worker,
            matched_bytes: covered_bytes(held, self.block_size, text.head.len()),
            held_blocks: held,
            blocks,
        }
    }

    /// The decision of a text-blind policy that chose the candidate at `pos`: it indexes
    /// nothing, unless the router tracks prefixes.
    pub fn blind(&self, pos: Option<usize>, text: RoutingText<'_>, cands: &[Candidate]) -> Option<Decision> {
        let worker = cands.get(pos?)?.id;
        if !self.track {
            return Some(Decision { worker, matched_bytes: 0, held_blocks: 0, blocks: Vec::new() });
        }
        Some(self.tracked(worker, text, text.blocks(self.block_size)))
    }
}

/// One routing policy: the state it keeps, and its part in each step of a router's life.
/// [`Policy`] holds one of them and dispatches statically (a `match`, no `dyn`).
pub trait RoutingPolicy: Sized {
    /// Whether the policy reads the routing text (so the text is hashed and indexed).
    const USES_TEXT: bool = false;

    /// The policy as configured.
    fn new(params: &RouterParams) -> Self;

    /// Chooses a candidate for a request. Changes nothing. A text-blind policy returns
    /// [`Indexed::blind`] of its choice.
    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision>;

    /// The share of a request's text (0..1) its decision may index at least, beyond the
    /// router's per-request cap.
    fn indexed_share(&self) -> f64 {
        0.0
    }

    /// The blocks per worker the index is evicted to, given the configured budget.
    fn max_blocks(&self, budget: u64) -> u64 {
        budget
    }

    /// A decision went through.
    fn commit(&mut self) {}

    /// Chooses a candidate for a request that carries no routing text (other paths); nothing
    /// is committed for these. By default the less loaded of two at random.
    fn route_any(&mut self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        PowerOfTwo.pick(cands, rng)
    }
}

/// Declares `PolicyKind` (through [`named_enum!`](crate::named)) and [`Policy`], the enum
/// carrying each policy's state, from the one table below.
macro_rules! policies {
    ($($kind:ident = $number:literal => $name:literal: $ty:ident,)+) => {
        crate::named::named_enum! {
            /// The policy names of `--policy` (sglang-router's, plus llm-d's `prefix_hash`,
            /// seed 002's `marginal_utility` and SMG's `consistent_hashing`).
            pub enum PolicyKind as "policy" {
                $($kind = $number => $name,)+
            }
            hint = sglang_only;
        }

        impl PolicyKind {
            /// Whether the policy looks at the routing text (so it must be hashed).
            pub fn uses_text(self) -> bool {
                match self {
                    $(Self::$kind => <$ty as RoutingPolicy>::USES_TEXT,)+
                }
            }
        }

        /// A policy with its state, one variant per [`PolicyKind`]: what a router runs.
        #[derive(Debug)]
        pub enum Policy {
            $($kind($ty),)+
        }

        impl Policy {
            /// `kind` as configured by `params`.
            pub fn new(kind: PolicyKind, params: &RouterParams) -> Self {
                match kind {
                    $(PolicyKind::$kind => Self::$kind(<$ty as RoutingPolicy>::new(params)),)+
                }
            }

            pub fn kind(&self) -> PolicyKind {
                match self {
                    $(Self::$kind(_) => PolicyKind::$kind,)+
                }
            }

            /// See [`RoutingPolicy::decide`].
            pub fn decide(
                &self,
                at: Indexed<'_>,
                text: RoutingText<'_>,
                cands: &[Candidate],
                rng: &mut dyn RngCore,
            ) -> Option<Decision> {
                match self {
                    $(Self::$kind(p) => p.decide(at, text, cands, rng),)+
                }
            }

            /// See [`RoutingPolicy::indexed_share`].
            pub fn indexed_share(&self) -> f64 {
                match self {
                    $(Self::$kind(p) => p.indexed_share(),)+
                }
            }

            /// See [`RoutingPolicy::max_blocks`].
            pub fn max_blocks(&self, budget: u64) -> u64 {
                match self {
                    $(Self::$kind(p) => p.max_blocks(budget),)+
                }
            }

            /// See [`RoutingPolicy::commit`].
            pub fn commit(&mut self) {
                match self {
                    $(Self::$kind(p) => p.commit(),)+
                }
            }

            /// See [`RoutingPolicy::route_any`].
            pub fn route_any(&mut self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
                match self {
                    $(Self::$kind(p) => p.route_any(cands, rng),)+
                }
            }
        }
    };
}
// The policies, one line each: the `PolicyKind` variant, its number in kvmesh.proto's
// `Policy` enum, its name (`--policy`) and the type that carries its state. A new policy is
// a file here, a line here and a value in kvmesh.proto (docs/ARCHITECTURE.md, "To add a
// policy").
policies! {
    Random = 1 => "random": Random,
    RoundRobin = 2 => "round_robin": RoundRobin,
    PowerOfTwo = 3 => "power_of_two": PowerOfTwo,
    CacheAware = 4 => "cache_aware": CacheAware,
    PrefixHash = 5 => "prefix_hash": PrefixHash,
    MarginalUtility = 6 => "marginal_utility": MarginalUtility,
    ConsistentHashing = 7 => "consistent_hashing": ConsistentHash,
}

/// Position of the least-loaded candidate among `positions`, ties broken at random.
pub(crate) fn least_loaded(
    cands: &[Candidate],
    positions: impl IntoIterator<Item = usize>,
    rng: &mut dyn RngCore,
) -> Option<usize> {
    // (position, its load) of the best so far.
    let mut best: Option<(usize, u64)> = None;
    let mut ties = 0usize;
    for p in positions {
        let Some(load) = cands.get(p).map(|c| c.load) else { continue };
        match best {
            Some((_, b)) if load > b => {}
            Some((_, b)) if load == b => {
                // Reservoir sampling over the tied candidates.
                ties += 1;
                if rng.random_range(0..=ties) == 0 {
                    best = Some((p, load));
                }
            }
            _ => {
                best = Some((p, load));
                ties = 0;
            }
        }
    }
    best.map(|(p, _)| p)
}

/// Scores within this of the best count as ties.
const SCORE_EPSILON: f64 = 1e-9;

/// Position of the highest-scoring candidate among `positions` (scores that are not finite
/// are passed over), ties broken at random.
pub(crate) fn best_scored(
    positions: impl IntoIterator<Item = usize>,
    score: impl Fn(usize) -> f64,
    rng: &mut dyn RngCore,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    let mut ties = 0usize;
    for p in positions {
        let s = score(p);
        if !s.is_finite() {
            continue;
        }
        match best {
            Some((_, b)) if s < b - SCORE_EPSILON => {}
            Some((_, b)) if s <= b + SCORE_EPSILON => {
                ties += 1;
                if rng.random_range(0..=ties) == 0 {
                    best = Some((p, b));
                }
            }
            _ => {
                best = Some((p, s));
                ties = 0;
            }
        }
    }
    best.map(|(p, _)| p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;

    #[test]
    fn names_round_trip_and_unknown_is_explained() {
        let params = crate::Config::default().router_params();
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
            assert_eq!(serde_json::from_value::<PolicyKind>(serde_json::to_value(k).unwrap()).unwrap(), k);
            assert_eq!(PolicyKind::from_number(k.number()), Some(k));
            assert_eq!(Policy::new(k, &params).kind(), k, "the table gives {k} its own state");
        }
        let text = PolicyKind::ALL.into_iter().filter(|k| k.uses_text());
        assert_eq!(text.collect::<Vec<_>>(), [PolicyKind::CacheAware, PolicyKind::PrefixHash]);
        let e = "manual".parse::<PolicyKind>().unwrap_err();
        assert!(e.starts_with("`manual` is an sglang-router policy kvmesh does not have"), "{e}");
        let e = "fastest".parse::<PolicyKind>().unwrap_err();
        assert!(e.contains("`fastest`") && e.contains("cache_aware"), "{e}");
    }

    #[test]
    fn least_loaded_breaks_ties_at_random() {
        let cands = [
            Candidate { id: 0, load: 3, ..Default::default() },
            Candidate { id: 1, load: 1, ..Default::default() },
            Candidate { id: 2, load: 1, ..Default::default() },
            Candidate { id: 3, load: 2, ..Default::default() },
        ];
        let mut rng = seeded(1);
        let mut hits = [0; 4];
        for _ in 0..400 {
            hits[least_loaded(&cands, 0..4, &mut rng).unwrap()] += 1;
        }
        assert_eq!(hits[0] + hits[3], 0);
        assert!(hits[1] > 100 && hits[2] > 100, "{hits:?}");
        assert_eq!(least_loaded(&cands, [], &mut rng), None);
    }
}
