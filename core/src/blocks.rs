//! Chained block hashes of a routing text: the keys of the prefix index.
//!
//! The text is cut into blocks of `block_size` bytes (the last one may be shorter); each
//! block's hash is xxh3 of its bytes seeded with the previous block's hash. Equal hashes at
//! position `i` therefore mean equal prefixes up to block `i`, in every filter and in the
//! control plane alike, and a longest-prefix match is a walk over the request's own blocks.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of the first block: any fixed value, so that every process agrees.
const ROOT_SEED: u64 = 0x6b76_6d65_7368_0001;

/// The chained hashes of `text` in blocks of `block_size` bytes (which must be > 0).
pub fn block_hashes(text: &[u8], block_size: usize) -> Vec<u64> {
    block_hashes_from(text, block_size, ROOT_SEED)
}

/// The first block's seed for requests to the pool of `model` (see [`crate::models`]): no
/// model is the root seed, so that a gateway that knows no names keys as it always did.
pub fn model_seed(model: Option<&str>) -> u64 {
    model.map_or(ROOT_SEED, |m| xxh3_64_with_seed(m.as_bytes(), ROOT_SEED))
}

/// [`block_hashes`] chained from `seed` ([`model_seed`]).
pub fn block_hashes_from(text: &[u8], block_size: usize, seed: u64) -> Vec<u64> {
    let block_size = block_size.max(1);
    let mut out = Vec::with_capacity(text.len().div_ceil(block_size));
    let mut seed = seed;
    for block in text.chunks(block_size) {
        seed = xxh3_64_with_seed(block, seed);
        out.push(seed);
    }
    out
}

/// How many bytes of a text of `text_len` bytes the first `blocks` blocks cover.
pub fn covered_bytes(blocks: usize, block_size: usize, text_len: usize) -> usize {
    blocks.saturating_mul(block_size).min(text_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_leading_hashes() {
        let a = block_hashes(b"0123456789abcdefXYZ", 4);
        let b = block_hashes(b"0123456789abQQQQ", 4);
        assert_eq!(a.len(), 5);
        assert_eq!(b.len(), 4);
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a[3], b[3]);
    }

    #[test]
    fn equal_blocks_at_other_positions_differ() {
        let h = block_hashes(b"aaaaaaaa", 4);
        assert_ne!(h[0], h[1], "the chain makes position part of the key");
    }

    #[test]
    fn a_prompt_for_two_models_shares_no_block() {
        let text = b"the same system prompt for both";
        let (a, b) =
            (block_hashes_from(text, 4, model_seed(Some("a"))), block_hashes_from(text, 4, model_seed(Some("b"))));
        assert!(a.iter().all(|h| !b.contains(h)));
        assert_eq!(block_hashes_from(text, 4, model_seed(None)), block_hashes(text, 4));
    }

    #[test]
    fn covered_bytes_clamps_to_text() {
        assert_eq!(covered_bytes(2, 4, 19), 8);
        assert_eq!(covered_bytes(5, 4, 19), 19);
        assert_eq!(block_hashes(b"", 4), Vec::<u64>::new());
    }
}
