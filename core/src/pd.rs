//! Prefill/decode disaggregation: choosing the pair, and deciding whether to split at all.
//!
//! The prefill worker is chosen by the prefill policy (default `cache_aware`, so shared
//! prefixes keep landing where their KV is), the decode worker by the decode policy (default
//! `power_of_two`). The decider (llm-d's) may skip the prefill leg: `prefix` runs a request on
//! the decode worker alone when the part of its prompt that worker has not cached is at most
//! `non_cached_tokens`.
//!
//! Not every prefill worker can serve every decode worker: they must speak the same PD
//! protocol, and a worker of role `both` is never its own prefill worker. The caller says who
//! pairs with the chosen decode worker ([`Partners`]); with nobody, a `both` worker runs the
//! request alone (it prefills locally), and any other gets no decision.

use std::borrow::Cow;

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

/// The prefill candidates that can pair with one decode worker, and whether that worker can
/// run a request alone when none can.
#[derive(Clone, Debug, Default)]
pub struct Partners<'a> {
    pub prefill: Cow<'a, [Candidate]>,
    pub alone: bool,
}

pub struct PdRouter {
    prefill: Router,
    decode: Router,
    decider: Decider,
}

impl PdRouter {
    pub fn new(params: RouterParams, prefill_policy: PolicyKind, decode_policy: PolicyKind, decider: Decider) -> Self {
        // The two legs' indexes share one index's memory bound: half its entries each.
        let params = RouterParams { max_entries: params.max_entries / 2, ..params };
        let mut decode = Router::new(params, decode_policy);
        // The prefix decider needs to know what each decode worker has cached.
        decode.track_prefixes(matches!(decider, Decider::Prefix { .. }));
        Self { prefill: Router::new(params, prefill_policy), decode, decider }
    }

    /// Chooses the decode worker, then (unless the decider skips it) the prefill worker, any
    /// of `prefill` pairing with any of `decode`. Changes nothing until
    /// [`commit`](Self::commit).
    pub fn decide(
        &self,
        text: RoutingText<'_>,
        prefill: &[Candidate],
        decode: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<PdDecision> {
        self.decide_paired(text, decode, |_| Partners { prefill: Cow::Borrowed(prefill), alone: false }, rng)
    }

    /// Chooses the decode worker among `decode`, then (unless the decider skips it) the
    /// prefill worker among `partners(decode worker)`; with no partner, the decode worker
    /// runs the request alone if it can, else there is no decision. Changes nothing until
    /// [`commit`](Self::commit).
    pub fn decide_paired<'c>(
        &self,
        text: RoutingText<'_>,
        decode: &[Candidate],
        partners: impl FnOnce(crate::WorkerId) -> Partners<'c>,
        rng: &mut dyn RngCore,
    ) -> Option<PdDecision> {
        let d = self.decode.decide(text, decode, rng)?;
        if let Decider::Prefix { non_cached_tokens } = self.decider {
            let uncached = text.len.saturating_sub(d.matched_bytes).div_ceil(BYTES_PER_TOKEN);
            if uncached as u64 <= non_cached_tokens {
                return Some(PdDecision::DecodeOnly(d));
            }
        }
        let partners = partners(d.worker);
        match self.prefill.decide(text, &partners.prefill, rng) {
            Some(p) => Some(PdDecision::Split { prefill: p, decode: d }),
            None if partners.alone => Some(PdDecision::DecodeOnly(d)),
            None => None,
        }
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

    /// Both routers at once: (prefill, decode).
    pub fn routers(&mut self) -> (&mut Router, &mut Router) {
        (&mut self.prefill, &mut self.decode)
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
    fn a_decode_worker_pairs_only_with_its_partners_or_runs_alone() {
        let cfg = crate::Config::default().router_params();
        let pd = PdRouter::new(cfg, PolicyKind::CacheAware, PolicyKind::RoundRobin, Decider::Always);
        let mut rng = seeded(2);
        let text = b"a prompt".as_slice();
        // Partners 3 and 4 for decode worker 7: the prefill is one of them, never 0..3.
        for _ in 0..8 {
            let partners = |d| {
                assert_eq!(d, 7);
                Partners { prefill: Cow::Owned(cands(3..5, 0)), alone: false }
            };
            match pd.decide_paired(text.into(), &cands(7..8, 0), partners, &mut rng) {
                Some(PdDecision::Split { prefill, decode }) => {
                    assert!((3..5).contains(&prefill.worker) && decode.worker == 7)
                }
                other => panic!("a split with a partner: {other:?}"),
            }
        }
        // Nobody to pair with: a worker that can prefill itself runs it alone, another not at all.
        let alone = pd.decide_paired(
            text.into(),
            &cands(7..8, 0),
            |_| Partners { prefill: Cow::Borrowed(&[]), alone: true },
            &mut rng,
        );
        assert!(matches!(alone, Some(PdDecision::DecodeOnly(ref d)) if d.worker == 7), "{alone:?}");
        assert!(pd.decide_paired(text.into(), &cands(7..8, 0), |_| Partners::default(), &mut rng).is_none());
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

    /// PD's two indexes together stay within one index's entry bound (the filter's memory
    /// bound holds for one index at its worst: `tests/index_memory.rs`).
    #[test]
    fn the_two_legs_share_one_index_bound() {
        let mut cfg = crate::Config::default().router_params();
        cfg.max_entries = 1_000;
        let mut pd = PdRouter::new(cfg, PolicyKind::CacheAware, PolicyKind::CacheAware, Decider::Always);
        for i in 0..40u64 {
            let hashes: Vec<u64> = (0..100).map(|j| i * 1_000 + j).collect();
            pd.prefill_router().apply_insert((i % 4) as u32, &hashes);
            pd.decode_router().apply_insert((i % 4) as u32, &hashes);
        }
        let (p, d) = (pd.prefill_router().index().entries(), pd.decode_router().index().entries());
        assert!(p + d <= 1_250 && p > 0 && d > 0, "prefill {p} + decode {d} entries");
        pd.prefill_router().bound();
        pd.decode_router().bound();
        let (p, d) = (pd.prefill_router().index().entries(), pd.decode_router().index().entries());
        assert!(p + d <= 1_000, "bounded: prefill {p} + decode {d} entries");
    }
}
