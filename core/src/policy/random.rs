//! `random`: a uniformly random healthy worker.

use super::{Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use rand::{Rng, RngCore};

#[derive(Debug, Default)]
pub struct Random;

impl Random {
    pub fn pick(&self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        (!cands.is_empty()).then(|| rng.random_range(0..cands.len()))
    }
}

impl RoutingPolicy for Random {
    fn new(_: &RouterParams) -> Self {
        Self
    }

    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        at.blind(self.pick(cands, rng), text, cands)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;

    #[test]
    fn spreads_over_all_candidates() {
        let cands: Vec<Candidate> = (0..4).map(|id| Candidate { id, load: 0, ..Default::default() }).collect();
        let mut rng = seeded(3);
        let mut hits = [0; 4];
        for _ in 0..400 {
            hits[Random.pick(&cands, &mut rng).unwrap()] += 1;
        }
        assert!(hits.iter().all(|&h| h > 50), "{hits:?}");
        assert_eq!(Random.pick(&[], &mut rng), None);
    }
}
