//! Randomness for the policies, passed in so that tests are reproducible.
//!
//! Policies take `&mut dyn RngCore` and draw with [`rand::Rng`]'s methods (`random_range`),
//! which rand implements for unsized generators too. Each VM keeps a [`FastRng`] — rand's
//! `SmallRng`, a xoshiro generator: fast and not cryptographic, which is all load balancing
//! needs — seeded once from the platform (`getrandom`, which is WASI `random_get` under
//! wasm32-wasip1). Tests seed it with a constant.

use rand::SeedableRng;
pub use rand::{Rng, RngCore};

/// The generator a VM keeps for its policies.
pub type FastRng = rand::rngs::SmallRng;

/// A generator with a fixed seed (tests; a VM seeded from [`random_u64`]).
pub fn seeded(seed: u64) -> FastRng {
    FastRng::seed_from_u64(seed)
}

/// A u64 from the platform's entropy source.
pub fn random_u64() -> Result<u64, getrandom::Error> {
    getrandom::u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_range_through_a_trait_object_stays_in_range_and_covers_it() {
        let mut rng = seeded(7);
        let dyn_rng: &mut dyn RngCore = &mut rng;
        let mut seen = [0u32; 5];
        for _ in 0..1000 {
            seen[dyn_rng.random_range(0..5usize)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 150), "{seen:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_sequence_and_another_seed_another() {
        let draw = |seed| {
            let mut rng = seeded(seed);
            (0..4).map(|_| rng.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn entropy_is_available() {
        let a = random_u64().unwrap();
        let b = random_u64().unwrap();
        assert_ne!(a, b);
        let (mut x, mut y) = (seeded(random_u64().unwrap()), seeded(random_u64().unwrap()));
        assert_ne!(x.next_u64(), y.next_u64());
    }
}
