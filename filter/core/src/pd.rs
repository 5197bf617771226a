//! Prefill/decode disaggregation: choosing the pair, and deciding whether to split at all.
//!
//! The prefill worker is chosen by the prefill policy (default `cache_aware`, so shared
//! prefixes keep landing where their KV is), the decode worker by the decode policy (default
//! `power_of_two`). The decider (llm-d's) may skip the prefill leg: `prefix` runs a request on
//! the decode worker alone when the part of its prompt that worker has not cached is at most
//! `non_cached_tokens`.

use crate::config::Config;
use crate::policy::{Candidate, PolicyKind};
use crate::router::{Decision, Router};
use rand::RngCore;

/// Bytes of routing text per token, for comparing text lengths with token budgets.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decider {
    /// Split every request (sglang-router's behaviour).
    Always,
    /// Skip the prefill leg when at most this many prompt tokens are uncached on the decode
    /// worker.
    Prefix { non_cached_tokens: u64 },
}

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
    pub fn new(config: &Config, prefill_policy: PolicyKind, decode_policy: PolicyKind, decider: Decider) -> Self {
        let mut decode = Router::with_policy(config, decode_policy);
        // The prefix decider needs to know what each decode worker has cached.
        decode.track_prefixes(matches!(decider, Decider::Prefix { .. }));
        Self { prefill: Router::with_policy(config, prefill_policy), decode, decider }
    }

    /// Chooses the decode worker, then (unless the decider skips it) the prefill worker.
    pub fn route(
        &mut self,
        text: &[u8],
        prefill: &[Candidate],
        decode: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<PdDecision> {
        let d = self.decode.route(text, decode, rng)?;
        if let Decider::Prefix { non_cached_tokens } = self.decider {
            let uncached = text.len().saturating_sub(d.matched_bytes).div_ceil(BYTES_PER_TOKEN);
            if uncached as u64 <= non_cached_tokens {
                return Some(PdDecision::DecodeOnly(d));
            }
        }
        let p = self.prefill.route(text, prefill, rng)?;
        Some(PdDecision::Split { prefill: p, decode: d })
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
    use crate::rng::seeded;

    fn cands(ids: std::ops::Range<u32>, load: u64) -> Vec<Candidate> {
        ids.map(|id| Candidate { id, load }).collect()
    }

    #[test]
    fn shared_prefixes_keep_their_prefill_worker_and_decode_spreads() {
        let cfg = Config::default();
        let mut pd = PdRouter::new(&cfg, PolicyKind::CacheAware, PolicyKind::PowerOfTwo, Decider::Always);
        let mut rng = seeded(3);
        let prefix = "A long shared system prompt. ".repeat(30);
        let mut prefills = std::collections::HashSet::new();
        let mut decodes = std::collections::HashSet::new();
        for i in 0..40 {
            let text = format!("{prefix}{i}");
            // Decode loads differ per round so that power-of-two has something to balance.
            let decode: Vec<Candidate> = (10..14).map(|id| Candidate { id, load: (id as u64 * 7 + i) % 5 }).collect();
            match pd.route(text.as_bytes(), &cands(0..3, 0), &decode, &mut rng).unwrap() {
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
        let cfg = Config::default();
        let mut pd = PdRouter::new(
            &cfg,
            PolicyKind::CacheAware,
            PolicyKind::RoundRobin,
            Decider::Prefix { non_cached_tokens: 8 },
        );
        let mut rng = seeded(1);
        let text = "x".repeat(1000);
        let first = pd.route(text.as_bytes(), &cands(0..1, 0), &cands(5..6, 0), &mut rng).unwrap();
        assert!(matches!(first, PdDecision::Split { .. }), "nothing cached yet");
        let again = format!("{text}tail");
        let second = pd.route(again.as_bytes(), &cands(0..1, 0), &cands(5..6, 0), &mut rng).unwrap();
        assert!(matches!(second, PdDecision::DecodeOnly(ref d) if d.worker == 5), "{second:?}");
    }

    #[test]
    fn no_candidates_means_no_decision() {
        let cfg = Config::default();
        let mut pd = PdRouter::new(&cfg, PolicyKind::CacheAware, PolicyKind::PowerOfTwo, Decider::Always);
        let mut rng = seeded(1);
        assert!(pd.route(b"t", &[], &cands(0..1, 0), &mut rng).is_none());
        assert!(pd.route(b"t", &cands(0..1, 0), &[], &mut rng).is_none());
    }
}
