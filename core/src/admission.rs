//! Admission control as sglang-router does it (`--max-concurrent-requests`,
//! `--rate-limit-tokens-per-second`, `--queue-size`, `--queue-timeout-secs`): a token bucket
//! whose capacity is the concurrency limit, refilled at a rate per second and given a token
//! back by every request that ends; a request that finds it empty waits in a FIFO queue of
//! bounded size (full: 429) for at most the queue timeout (past it: 408).
//!
//! This is the bucket's arithmetic and its encoding; where it lives (Envoy's shared data, one
//! bucket per Envoy) and the queue itself are the filter's.

use crate::priority::{Class, ClassLimits, CLASSES};

/// The validated admission settings; none at all when `max_concurrent_requests` is not set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdmissionParams {
    /// Tokens in a full bucket: requests admitted at once.
    pub capacity: u32,
    /// Tokens added per second (sglang-router: the capacity, unless set).
    pub refill_per_sec: f64,
    /// Requests that may wait; 0 answers 429 at once.
    pub queue_size: u32,
    /// Longest wait in the queue before a 408.
    pub queue_timeout_ms: u64,
    /// Reserved slots, queue bounds and timeouts per priority class ([`crate::priority`]).
    pub classes: ClassLimits,
}

impl AdmissionParams {
    /// How long a request of `class` may wait.
    pub fn timeout_ms(&self, class: Class) -> u64 {
        self.classes.queue_timeout_ms.get(class.index()).copied().flatten().unwrap_or(self.queue_timeout_ms)
    }

    /// Whether a request of `class` may take a slot when `held[k]` requests of each class
    /// hold one: fewer than the capacity held, counting as held the reserve of every class
    /// above it that its own requests do not use.
    pub fn slot_free(&self, held: &[u64; CLASSES], class: Class) -> bool {
        let total: u64 = held.iter().sum();
        let kept: u64 = Class::ALL
            .iter()
            .filter(|c| **c > class)
            .map(|c| {
                let reserved = u64::from(self.classes.reserved.get(c.index()).copied().unwrap_or(0));
                reserved.saturating_sub(held.get(c.index()).copied().unwrap_or(0))
            })
            .sum();
        total.saturating_add(kept) < u64::from(self.capacity)
    }

    /// Whether a request of `class` may queue when `queued[k]` wait in each class: a class with
    /// its own bound counts against it alone, the others against `queue_size` with every
    /// waiting request. Sheddable requests never queue.
    pub fn queue_room(&self, queued: &[u64; CLASSES], class: Class) -> bool {
        if class == Class::Sheddable {
            return false;
        }
        match self.classes.queue_size.get(class.index()).copied().flatten() {
            Some(bound) => queued.get(class.index()).copied().unwrap_or(0) < u64::from(bound),
            None => queued.iter().sum::<u64>() < u64::from(self.queue_size),
        }
    }
}

/// The bucket: tokens left (fractional, as refill is continuous) at a point in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    pub tokens: f64,
    pub at_ms: u64,
}

impl Bucket {
    /// A full bucket at `now_ms` (how an Envoy starts).
    pub fn full(p: &AdmissionParams, now_ms: u64) -> Self {
        Self { tokens: f64::from(p.capacity), at_ms: now_ms }
    }

    /// Adds what the time since the last update earned, up to the capacity. A clock that went
    /// back earns nothing (and does not move the bucket's time back).
    pub fn refill(&mut self, p: &AdmissionParams, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64 / 1000.0;
        self.tokens = (self.tokens + elapsed * p.refill_per_sec).min(f64::from(p.capacity));
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Takes one token if there is one.
    pub fn take(&mut self, p: &AdmissionParams, now_ms: u64) -> bool {
        self.refill(p, now_ms);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Whole tokens available now.
    pub fn available(&mut self, p: &AdmissionParams, now_ms: u64) -> u32 {
        self.refill(p, now_ms);
        // At most the capacity (a u32), so the cast cannot truncate.
        self.tokens.floor().max(0.0) as u32
    }

    /// A request ended: its token goes back (never above the capacity).
    pub fn give_back(&mut self, p: &AdmissionParams, now_ms: u64) {
        self.refill(p, now_ms);
        self.tokens = (self.tokens + 1.0).min(f64::from(p.capacity));
    }

    /// 16 bytes: tokens (f64) and time (u64), little-endian.
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let bytes = self.tokens.to_le_bytes().into_iter().chain(self.at_ms.to_le_bytes());
        for (o, b) in out.iter_mut().zip(bytes) {
            *o = b;
        }
        out
    }

    /// The bucket in the first 16 bytes of `bytes`; `None` if they are missing or not a
    /// plausible bucket (whoever reads it then starts from a full one).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let tokens = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let at_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        (tokens.is_finite() && tokens >= 0.0).then_some(Self { tokens, at_ms })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(capacity: u32, reserved: [u32; CLASSES]) -> AdmissionParams {
        AdmissionParams {
            capacity,
            refill_per_sec: 1.0,
            queue_size: 2,
            queue_timeout_ms: 1_000,
            classes: ClassLimits { reserved, ..Default::default() },
        }
    }

    #[test]
    fn a_reserve_keeps_lower_classes_out_until_its_class_uses_it() {
        let p = params(4, [0, 0, 2, 1]);
        // Nothing held: the default class may take one slot (4 - 2 - 1 reserved).
        assert!(p.slot_free(&[0, 0, 0, 0], Class::Default));
        assert!(!p.slot_free(&[0, 1, 0, 0], Class::Default), "the rest is reserved");
        assert!(p.slot_free(&[0, 1, 0, 0], Class::Interactive));
        assert!(p.slot_free(&[0, 1, 1, 0], Class::Interactive));
        assert!(!p.slot_free(&[0, 1, 2, 0], Class::Interactive), "the system slot is kept");
        assert!(p.slot_free(&[0, 1, 2, 0], Class::System));
        assert!(!p.slot_free(&[0, 1, 2, 1], Class::System), "full");
        // Interactive requests beyond their reserve use the shared slots.
        assert!(p.slot_free(&[0, 0, 2, 0], Class::Interactive));
        assert!(!p.slot_free(&[0, 0, 3, 0], Class::Interactive));
    }

    #[test]
    fn per_class_queue_bounds_and_sheddable_never_queues() {
        let mut p = params(1, [0; CLASSES]);
        p.classes.queue_size[Class::Interactive.index()] = Some(1);
        assert!(!p.queue_room(&[0, 0, 0, 0], Class::Sheddable));
        assert!(p.queue_room(&[0, 1, 0, 0], Class::Default));
        assert!(!p.queue_room(&[0, 2, 0, 0], Class::Default), "queue_size 2 shared");
        assert!(p.queue_room(&[0, 2, 0, 0], Class::Interactive), "its own bound");
        assert!(!p.queue_room(&[0, 0, 1, 0], Class::Interactive));
    }

    const P: AdmissionParams = AdmissionParams {
        capacity: 2,
        refill_per_sec: 4.0,
        queue_size: 1,
        queue_timeout_ms: 1000,
        classes: ClassLimits { reserved: [0; 4], queue_size: [None; 4], queue_timeout_ms: [None; 4] },
    };

    #[test]
    fn a_full_bucket_admits_its_capacity_then_refills_over_time() {
        let mut b = Bucket::full(&P, 1_000);
        assert!(b.take(&P, 1_000));
        assert!(b.take(&P, 1_000));
        assert!(!b.take(&P, 1_000), "empty");
        assert!(!b.take(&P, 1_200), "0.8 tokens after 200 ms at 4/s");
        assert!(b.take(&P, 1_250), "1.0 token after 250 ms");
        assert_eq!(b.available(&P, 60_000), 2, "never above the capacity");
    }

    #[test]
    fn an_ended_request_gives_its_token_back_up_to_the_capacity() {
        let mut b = Bucket::full(&P, 0);
        assert!(b.take(&P, 0) && b.take(&P, 0));
        b.give_back(&P, 0);
        assert_eq!(b.available(&P, 0), 1);
        b.give_back(&P, 0);
        b.give_back(&P, 0);
        assert_eq!(b.available(&P, 0), 2);
    }

    #[test]
    fn a_clock_going_back_earns_nothing() {
        let mut b = Bucket { tokens: 0.0, at_ms: 5_000 };
        assert_eq!(b.available(&P, 1_000), 0);
        assert_eq!(b.at_ms, 5_000);
        assert_eq!(b.available(&P, 5_500), 2);
    }

    #[test]
    fn encoding_round_trips_and_garbage_is_refused() {
        let b = Bucket { tokens: 1.5, at_ms: 42 };
        assert_eq!(Bucket::decode(&b.encode()), Some(b));
        assert_eq!(Bucket::decode(&[1, 2, 3]), None);
        let mut nan = [0u8; 16];
        nan[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(Bucket::decode(&nan), None);
        let mut negative = [0u8; 16];
        negative[..8].copy_from_slice(&(-3.0f64).to_le_bytes());
        assert_eq!(Bucket::decode(&negative), None);
    }
}
