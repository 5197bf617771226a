//! Randomness for the policies, passed in so that tests are reproducible.
//!
//! Policies take `&mut dyn Rng`. [`FastRng`] is a SplitMix64 generator seeded from the
//! platform (`getrandom`, which is WASI `random_get` under wasm32-wasip1): cheap enough for
//! the request path, and each VM seeds its own.

/// A source of random numbers.
pub trait Rng {
    fn next_u64(&mut self) -> u64;

    /// A uniform integer in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        // Multiply-shift: unbiased enough for load balancing, no division.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// SplitMix64.
#[derive(Clone, Debug)]
pub struct FastRng(u64);

impl FastRng {
    pub fn seeded(seed: u64) -> Self {
        Self(seed)
    }

    /// Seeded from the platform's entropy source.
    pub fn from_entropy() -> Result<Self, getrandom::Error> {
        Ok(Self(random_u64()?))
    }
}

impl Rng for FastRng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A u64 from the platform's entropy source.
pub fn random_u64() -> Result<u64, getrandom::Error> {
    let mut buf = [0u8; 8];
    getrandom::fill(&mut buf)?;
    Ok(u64::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = FastRng::seeded(7);
        let mut seen = [0u32; 5];
        for _ in 0..1000 {
            seen[rng.below(5)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 120), "{seen:?}");
    }

    #[test]
    fn entropy_is_available() {
        let a = random_u64().unwrap();
        let b = random_u64().unwrap();
        assert_ne!(a, b);
    }
}
