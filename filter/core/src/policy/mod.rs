//! Routing policies, one file each. They choose among plain-data [`Candidate`]s (the healthy
//! workers with their current load) and never see live worker objects, sockets or clocks.

mod cache_aware;
mod consistent_hash;
mod marginal_utility;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;

use std::fmt;
use std::str::FromStr;

pub use cache_aware::{CacheAware, CacheAwareParams, Choice, Reason};
pub use consistent_hash::ConsistentHash;
pub use marginal_utility::{utility_scores, MarginalUtility, Sample, Trend, UtilityParams, UtilityWindow, MAX_WINDOW};
pub use power_of_two::PowerOfTwo;
pub use prefix_hash::{PrefixChoice, PrefixHash, PrefixHashParams};
pub use random::Random;
pub use round_robin::RoundRobin;

use rand::{Rng, RngCore};

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

/// The policy names of `--policy` (sglang-router's, plus llm-d's `prefix_hash`, seed 002's
/// `marginal_utility` and SMG's `consistent_hashing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    Random,
    RoundRobin,
    PowerOfTwo,
    CacheAware,
    PrefixHash,
    MarginalUtility,
    ConsistentHashing,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 7] = [
        Self::Random,
        Self::RoundRobin,
        Self::PowerOfTwo,
        Self::CacheAware,
        Self::PrefixHash,
        Self::MarginalUtility,
        Self::ConsistentHashing,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::RoundRobin => "round_robin",
            Self::PowerOfTwo => "power_of_two",
            Self::CacheAware => "cache_aware",
            Self::PrefixHash => "prefix_hash",
            Self::MarginalUtility => "marginal_utility",
            Self::ConsistentHashing => "consistent_hashing",
        }
    }

    /// Whether the policy looks at the routing text (so it must be hashed).
    pub fn uses_text(self) -> bool {
        matches!(self, Self::CacheAware | Self::PrefixHash)
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
            let why = match s {
                "manual" | "bucket" => format!("`{s}` is an sglang-router policy kvmesh does not have"),
                _ => format!("unknown policy `{s}`"),
            };
            format!("{why} (expected one of {})", names.join(", "))
        })
    }
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
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
        }
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
