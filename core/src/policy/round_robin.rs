//! `round_robin`: the healthy workers in turn.

use super::{Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use rand::RngCore;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// The candidate whose turn it is (the turn passes only on [`advance`](Self::advance)).
    pub fn pick(&self, cands: &[Candidate]) -> Option<usize> {
        self.next.checked_rem(cands.len())
    }

    /// The turn passes to the next candidate.
    pub fn advance(&mut self) {
        self.next = self.next.wrapping_add(1);
    }
}

impl RoutingPolicy for RoundRobin {
    fn new(_: &RouterParams) -> Self {
        Self::default()
    }

    fn decide(
        &self,
        at: Indexed<'_>,
        text: RoutingText<'_>,
        cands: &[Candidate],
        _: &mut dyn RngCore,
    ) -> Option<Decision> {
        at.blind(self.pick(cands), text, cands)
    }

    /// The turn passes only with a decision that went through.
    fn commit(&mut self) {
        self.advance();
    }

    /// In turn too, and the turn passes at once (nothing is committed for these).
    fn route_any(&mut self, cands: &[Candidate], _: &mut dyn RngCore) -> Option<usize> {
        let pos = self.pick(cands);
        self.advance();
        pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_through_candidates() {
        let cands: Vec<Candidate> = (0..3).map(|id| Candidate { id, load: 0, ..Default::default() }).collect();
        let mut rr = RoundRobin::default();
        let picks: Vec<usize> = (0..6)
            .filter_map(|_| {
                let p = rr.pick(&cands);
                rr.advance();
                p
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(rr.pick(&[]), None);
    }
}
