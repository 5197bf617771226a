//! Prefill/decode disaggregation: choosing the pair, and deciding whether to split at all.
//!
//! The prefill worker is chosen by the prefill policy (default `cache_aware`, so shared
//! prefixes keep landing where their KV is), the decode worker by the decode policy (default
//! `power_of_two`). The decider (llm-d's) may skip the prefill leg: `prefix` runs a request on
//! the decode worker alone when the part of its prompt that worker has not cached is at most
//! `non_cached_tokens`.

pub use crate::config::Decider;
use crate::policy::{Candidate, PolicyKind};
use crate::router::{Decision, Router, RouterParams, RoutingText};
use rand::RngCore;

/// Bytes of routing text per token, for comparing text lengths with token budgets.
pub const BYTES_PER_TOKEN: usize = 4;

/// What to do with one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PdDecision {
    Split {
        prefill: Decision,
        decode: Decision,
    },
    /// Run on the decode worker alone (the decider found its cache good enough).
    DecodeOnly(Decision),
}

pub struct PdRouter {
    prefill: Router,
    decode: Router,
    decider: Decider,
}

impl PdRouter {
    pub fn new(params: RouterParams, prefill_policy: PolicyKind, decode_policy: PolicyKind, decider: Decider) -> Self {
        let mut decode = Router::new(params, decode_policy);
        // The prefix decider needs to know what each decode worker has cached.
        decode.track_prefixes(matches!(decider, Decider::Prefix { .. }));
        Self { prefill: Router::new(params, prefill_policy), decode, decider }
    }

    /// Chooses the decode worker, then (unless the decider skips it) the prefill worker.
    /// Changes nothing until [`commit`](Self::commit).
    pub fn decide(
        &self,
        text: RoutingText<'_>,
        prefill: &[Candidate],
        decode: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<PdDecision> {
        let d = self.decode.decide(text, decode, rng)?;
        if let Decider::Prefix { non_cached_tokens } = self.decider {
            let uncached = text.len.saturating_sub(d.matched_bytes).div_ceil(BYTES_PER_TOKEN);
            if uncached as u64 <= non_cached_tokens {
                return Some(PdDecision::DecodeOnly(d));
            }
        }
        let p = self.prefill.decide(text, prefill, rng)?;
        Some(PdDecision::Split { prefill: p, decode: d })
    }

    /// Records a decision that went through in both legs' indexes.
    pub fn commit(&mut self, decision: &PdDecision) {
        match decision {
            PdDecision::Split { prefill, decode } => {
                self.prefill.commit(prefill);
                self.decode.commit(decode);
            }
            PdDecision::DecodeOnly(decode) => self.decode.commit(decode),
        }
    }

    pub fn prefill_router(&mut self) -> &mut Router {
        &mut self.prefill
    }

    pub fn decode_router(&mut self) -> &mut Router {
        &mut self.decode
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{seeded, FastRng};

    fn cands(ids: std::ops::Range<u32>, load: u64) -> Vec<Candidate> {
        ids.map(|id| Candidate { id, load, ..Default::default() }).collect()
    }

    fn route(
        pd: &mut PdRouter,
        text: &[u8],
        p: &[Candidate],
        d: &[Candidate],
        rng: &mut FastRng,
    ) -> Option<PdDecision> {
        let decision = pd.decide(text.into(), p, d, rng)?;
        pd.commit(&decision);
        Some(decision)
    }

    #[test]
    fn shared_prefixes_keep_their_prefill_worker_and_decode_spreads() {
        let cfg = crate::Config::default().router_params();
        let mut pd = PdRouter::new(cfg, PolicyKind::CacheAware, PolicyKind::PowerOfTwo, Decider::Always);
        let mut rng = seeded(3);
        let prefix = "A long shared system prompt. ".repeat(30);
        let mut prefills = std::collections::HashSet::new();
        let mut decodes = std::collections::HashSet::new();
        for i in 0..40 {
            let text = format!("{prefix}{i}");
            // Decode loads differ per round so that power-of-two has something to balance.
            let decode: Vec<Candidate> =
                (10..14).map(|id| Candidate { id, load: (id as u64 * 7 + i) % 5, ..Default::default() }).collect();
            match route(&mut pd, text.as_bytes(), &cands(0..3, 0), &decode, &mut rng).unwrap() {
                PdDecision::Split { prefill, decode } => {
                    prefills.insert(prefill.worker);
                    decodes.insert(decode.worker);
                }
                other => panic!("always splits: {other:?}"),
            }
        }
        assert_eq!(prefills.len(), 1);
        assert!(decodes.len() >= 3, "{decodes:?}");
    }

    #[test]
    fn prefix_decider_skips_prefill_when_the_decode_worker_has_the_prompt() {
        let cfg = crate::Config::default().router_params();
        let mut pd = PdRouter::new(
            cfg,
            PolicyKind::CacheAware,
            PolicyKind::RoundRobin,
            Decider::Prefix { non_cached_tokens: 8 },
        );
        let mut rng = seeded(1);
        let text = "x".repeat(1000);
        let first = route(&mut pd, text.as_bytes(), &cands(0..1, 0), &cands(5..6, 0), &mut rng).unwrap();
        assert!(matches!(first, PdDecision::Split { .. }), "nothing cached yet");
        let again = format!("{text}tail");
        let second = route(&mut pd, again.as_bytes(), &cands(0..1, 0), &cands(5..6, 0), &mut rng).unwrap();
        assert!(matches!(second, PdDecision::DecodeOnly(ref d) if d.worker == 5), "{second:?}");
    }

    #[test]
    fn prefix_decider_works_under_every_decode_policy() {
        // Decode workers of role `both` (llm-d's label) are decode workers here: the decider
        // must see what each holds whatever policy picks them, prefix_hash (whose own index
        // keeps only the leading blocks) included.
        for decode_policy in PolicyKind::ALL {
            let cfg = crate::Config::default().router_params();
            let mut pd =
                PdRouter::new(cfg, PolicyKind::PrefixHash, decode_policy, Decider::Prefix { non_cached_tokens: 8 });
            let mut rng = seeded(6);
            let text = "z".repeat(4000); // 125 blocks, far past prefix_hash's 32
            let first = route(&mut pd, text.as_bytes(), &cands(0..2, 0), &cands(5..6, 0), &mut rng).unwrap();
            assert!(matches!(first, PdDecision::Split { .. }), "{decode_policy}: nothing cached yet");
            let again = format!("{text}tail");
            let second = route(&mut pd, again.as_bytes(), &cands(0..2, 0), &cands(5..6, 0), &mut rng).unwrap();
            assert!(matches!(second, PdDecision::DecodeOnly(ref d) if d.worker == 5), "{decode_policy}: {second:?}");
        }
    }

    #[test]
    fn no_candidates_means_no_decision() {
        let cfg = crate::Config::default().router_params();
        let pd = PdRouter::new(cfg, PolicyKind::CacheAware, PolicyKind::PowerOfTwo, Decider::Always);
        let mut rng = seeded(1);
        assert!(pd.decide(b"t".as_slice().into(), &[], &cands(0..1, 0), &mut rng).is_none());
        assert!(pd.decide(b"t".as_slice().into(), &cands(0..1, 0), &[], &mut rng).is_none());
    }

    #[test]
    fn an_uncommitted_pair_leaves_no_trace_in_either_index() {
        let cfg = crate::Config::default().router_params();
        let mut pd = PdRouter::new(
            cfg,
            PolicyKind::CacheAware,
            PolicyKind::RoundRobin,
            Decider::Prefix { non_cached_tokens: 8 },
        );
        let mut rng = seeded(1);
        let text = "y".repeat(500);
        let d = pd.decide(text.as_bytes().into(), &cands(0..2, 0), &cands(5..7, 0), &mut rng).unwrap();
        assert!(pd.prefill_router().index().is_empty() && pd.decode_router().index().is_empty());
        pd.commit(&d);
        assert!(!pd.prefill_router().index().is_empty() && !pd.decode_router().index().is_empty());
    }
}
