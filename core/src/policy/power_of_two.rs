//! `power_of_two`: two distinct random healthy workers; the less loaded one wins.

use super::{Candidate, Decision, Indexed, RouterParams, RoutingPolicy, RoutingText};
use rand::{Rng, RngCore};

#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl PowerOfTwo {
    pub fn pick(&self, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        match cands.len() {
            0 => None,
            1 => Some(0),
            n => {
                let a = rng.random_range(0..n);
                // A second, distinct draw: skip over `a`.
                let mut b = rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let load = |p: usize| cands.get(p).map_or(u64::MAX, |c| c.load);
                Some(if load(b) < load(a) { b } else { a })
            }
        }
    }
}

impl RoutingPolicy for PowerOfTwo {
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
    fn the_most_loaded_worker_never_wins() {
        let cands = [
            Candidate { id: 0, load: 9, ..Default::default() },
            Candidate { id: 1, load: 1, ..Default::default() },
            Candidate { id: 2, load: 2, ..Default::default() },
        ];
        let mut rng = seeded(5);
        let mut hits = [0; 3];
        for _ in 0..300 {
            hits[PowerOfTwo.pick(&cands, &mut rng).unwrap()] += 1;
        }
        assert_eq!(hits[0], 0);
        assert!(hits[1] > hits[2] && hits[2] > 0, "{hits:?}");
    }

    #[test]
    fn two_workers_always_compared() {
        let cands =
            [Candidate { id: 0, load: 4, ..Default::default() }, Candidate { id: 1, load: 0, ..Default::default() }];
        let mut rng = seeded(9);
        assert!((0..50).all(|_| PowerOfTwo.pick(&cands, &mut rng) == Some(1)));
        assert_eq!(PowerOfTwo.pick(&cands[..1], &mut rng), Some(0));
        assert_eq!(PowerOfTwo.pick(&[], &mut rng), None);
    }
}
