//! Engine feedback: what the gateway predicted a worker held against what the worker says it
//! found in its cache (`cached_tokens`), for one routed request.
//!
//! The prediction is the prefix the index matched for that worker when the decision was made
//! (bytes of routing text), converted to tokens with `bytes_per_token` — the way the engine
//! (and the simulator: 4 bytes a token, in pages of 16) counts them. A prediction is accurate
//! within one index block. When the worker held less, the blocks past what it held are stale
//! for that worker: the caller drops them (and tells the control plane, so every gateway
//! does).

use std::ops::Range;

/// How a prediction compares with the worker's report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Within one block of what the worker reported.
    Accurate,
    /// The worker held less than predicted (it evicted part of the prefix).
    Over,
    /// The worker held more than predicted (traffic the index did not see).
    Under,
}

/// One request judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judged {
    pub predicted_tokens: u64,
    pub cached_tokens: u64,
    pub verdict: Verdict,
    /// The matched blocks (by position in the request) the worker did not hold: empty unless
    /// [`Verdict::Over`].
    pub stale: Range<usize>,
}

/// Tokens of `bytes` bytes of routing text (rounded down: a partial token is not cached).
pub fn tokens_of(bytes: u64, bytes_per_token: u64) -> u64 {
    bytes / bytes_per_token.max(1)
}

/// Judges a prediction of `matched_bytes` (the first `matched_blocks` blocks of the request,
/// `block_size` bytes each, the last one possibly shorter) against `cached_tokens`.
pub fn judge(
    matched_bytes: u64,
    matched_blocks: usize,
    cached_tokens: u64,
    block_size: u64,
    bytes_per_token: u64,
) -> Judged {
    let bytes_per_token = bytes_per_token.max(1);
    let block_size = block_size.max(1);
    let predicted_tokens = tokens_of(matched_bytes, bytes_per_token);
    let tolerance = block_size.div_ceil(bytes_per_token);
    let verdict = if predicted_tokens > cached_tokens.saturating_add(tolerance) {
        Verdict::Over
    } else if cached_tokens > predicted_tokens.saturating_add(tolerance) {
        Verdict::Under
    } else {
        Verdict::Accurate
    };
    let stale = if verdict == Verdict::Over {
        let held_blocks = cached_tokens.saturating_mul(bytes_per_token) / block_size;
        let held = usize::try_from(held_blocks).unwrap_or(usize::MAX).min(matched_blocks);
        held..matched_blocks
    } else {
        0..0
    };
    Judged { predicted_tokens, cached_tokens, verdict, stale }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_one_block_is_accurate() {
        // 10 blocks of 32 bytes = 320 bytes = 80 tokens; the simulator caches whole pages of
        // 16 tokens (64 bytes): 80 tokens exactly, or 72..88 with other page boundaries.
        for cached in [72, 80, 88] {
            let j = judge(320, 10, cached, 32, 4);
            assert_eq!((j.predicted_tokens, j.verdict, j.stale), (80, Verdict::Accurate, 0..0), "{cached}");
        }
        assert_eq!(judge(0, 0, 0, 32, 4).verdict, Verdict::Accurate, "a miss predicted and found");
        assert_eq!(judge(0, 0, 8, 32, 4).verdict, Verdict::Accurate);
    }

    #[test]
    fn a_worker_that_held_less_makes_the_rest_of_the_match_stale() {
        let j = judge(320, 10, 0, 32, 4);
        assert_eq!((j.verdict, j.stale), (Verdict::Over, 0..10), "nothing held: every matched block");
        let j = judge(320, 10, 32, 32, 4);
        assert_eq!((j.verdict, j.stale), (Verdict::Over, 4..10), "32 tokens = 128 bytes = 4 blocks held");
        // A partial last block: 330 bytes matched in 11 blocks.
        let j = judge(330, 11, 16, 32, 4);
        assert_eq!((j.predicted_tokens, j.stale), (82, 2..11));
    }

    #[test]
    fn a_worker_that_held_more_is_under_predicted_and_nothing_is_dropped() {
        let j = judge(0, 0, 64, 32, 4);
        assert_eq!((j.verdict, j.stale), (Verdict::Under, 0..0));
    }

    #[test]
    fn hostile_reports_saturate() {
        let j = judge(u64::MAX, usize::MAX, u64::MAX / 4, 32, 4);
        assert_eq!((j.predicted_tokens, j.verdict), (u64::MAX / 4, Verdict::Accurate));
        let j = judge(320, 10, u64::MAX, 32, 0);
        assert_eq!((j.verdict, j.stale), (Verdict::Under, 0..0));
        let j = judge(u64::MAX, usize::MAX, 0, 0, 0);
        assert_eq!((j.verdict, j.stale), (Verdict::Over, 0..usize::MAX));
    }
}
