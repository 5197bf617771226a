//! Time as the filter keeps it.

/// A time from the host's clock, in milliseconds since the epoch: a type of its own, so that
/// the circuit breakers (which time out to the millisecond) cannot be handed seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Now(u64);

impl Now {
    /// From the host's clock (`StreamHost::now_nanos`).
    pub fn from_nanos(nanos: u64) -> Self {
        Self(nanos / 1_000_000)
    }

    pub fn from_ms(ms: u64) -> Self {
        Self(ms)
    }

    pub fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(1000))
    }

    pub fn ms(self) -> u64 {
        self.0
    }
}
