//! `consistent_hashing`: sticky sessions by a routing key (SMG's `--policy
//! consistent_hashing` with `--routing-key-headers`, or a body field).
//!
//! Rendezvous (highest-random-weight) hashing: each candidate's weight for a key is xxh3 of
//! the key seeded with the worker's [`affinity`](super::Candidate::affinity) (a hash of its
//! URL), and the heaviest wins. A key stays on its worker while that worker is available;
//! when a worker leaves, only its keys move (each to the next heaviest), and when one joins it
//! takes only the keys it now wins — about 1/n of them. No state, no ring to rebuild, and
//! every gateway agrees without talking. A request without a key is placed by load (two
//! random choices).

use super::{Candidate, Decision, Indexed, PowerOfTwo, RouterParams, RoutingPolicy, RoutingText};
use rand::RngCore;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Clone, Copy, Debug, Default)]
pub struct ConsistentHash;

impl ConsistentHash {
    /// The candidate `key` belongs to, or (without a key) the less loaded of two at random.
    pub fn pick(&self, key: Option<&[u8]>, cands: &[Candidate], rng: &mut dyn RngCore) -> Option<usize> {
        let Some(key) = key else { return PowerOfTwo.pick(cands, rng) };
        // Ties (equal weights: same affinity) go to the first, so every gateway agrees.
        let weight = |c: &Candidate| (xxh3_64_with_seed(key, c.affinity), c.affinity);
        cands.iter().enumerate().max_by_key(|(_, c)| weight(c)).map(|(p, _)| p)
    }
}

impl RoutingPolicy for ConsistentHash {
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
        at.blind(self.pick(text.key, cands, rng), text, cands)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;
    use crate::worker::affinity_of;

    fn cands(n: u32) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                id: i,
                affinity: affinity_of(&format!("http://10.0.0.{i}:8000")),
                ..Default::default()
            })
            .collect()
    }

    fn owner(key: &str, cands: &[Candidate]) -> u32 {
        let mut rng = seeded(1);
        cands[ConsistentHash.pick(Some(key.as_bytes()), cands, &mut rng).unwrap()].id
    }

    #[test]
    fn a_key_keeps_its_worker_whatever_the_load_or_order() {
        let mut cs = cands(5);
        let first = owner("session-42", &cs);
        cs.reverse();
        for (i, c) in cs.iter_mut().enumerate() {
            c.load = i as u64 * 10;
        }
        assert_eq!(owner("session-42", &cs), first);
        assert_eq!(affinity_of("http://10.0.0.1:8000/"), affinity_of("http://10.0.0.1:8000"));
    }

    #[test]
    fn removing_a_worker_moves_only_its_keys_and_adding_one_takes_about_its_share() {
        let all = cands(5);
        let keys: Vec<String> = (0..2000).map(|i| format!("user-{i}")).collect();
        let before: Vec<u32> = keys.iter().map(|k| owner(k, &all)).collect();
        let mut per_worker = [0usize; 5];
        for &w in &before {
            per_worker[w as usize] += 1;
        }
        assert!(per_worker.iter().all(|&n| (300..500).contains(&n)), "spread: {per_worker:?}");
        let without: Vec<Candidate> = all.iter().copied().filter(|c| c.id != 2).collect();
        for (k, &was) in keys.iter().zip(&before) {
            let now = owner(k, &without);
            if was != 2 {
                assert_eq!(now, was, "{k} moved although its worker stayed");
            }
        }
        // Adding a sixth worker takes about a sixth of the keys, all from the others.
        let mut more = all.clone();
        more.extend(cands(6).last().copied());
        let moved = keys.iter().zip(&before).filter(|(k, &was)| owner(k, &more) != was).count();
        assert!((230..440).contains(&moved), "{moved} of 2000 moved to the new worker");
        assert!(keys.iter().zip(&before).all(|(k, &was)| [was, 5].contains(&owner(k, &more))));
    }

    #[test]
    fn no_key_means_by_load_and_no_worker_means_none() {
        let mut cs = cands(2);
        cs[0].load = 9;
        let mut rng = seeded(2);
        assert!((0..20).all(|_| ConsistentHash.pick(None, &cs, &mut rng) == Some(1)));
        assert_eq!(ConsistentHash.pick(Some(b"k"), &[], &mut rng), None);
        assert_eq!(ConsistentHash.pick(Some(b""), &cs[..1], &mut rng), Some(0), "one worker");
    }
}
