//! The simulated prefix KV cache: pages of [`PAGE_TOKENS`] tokens keyed by chained hashes,
//! LRU beyond the capacity. A request's cached tokens are its leading pages found here.

use lru::LruCache;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use xxhash_rust::xxh3::Xxh3;

/// Tokens per cache page.
pub const PAGE_TOKENS: u64 = 16;
/// Bytes of prompt per simulated token.
pub const BYTES_PER_TOKEN: u64 = 4;

pub struct KvCache {
    pages: LruCache<u64, ()>,
    /// Pages running requests hold, with how many of them hold each: SGLang's radix cache
    /// locks a running request's prefix, and requests that share a prefix share its pages,
    /// so a page counts once in the KV in use however many requests run on it.
    locked: HashMap<u64, u32>,
}

impl KvCache {
    pub fn new(capacity_tokens: u64) -> Self {
        let pages = (capacity_tokens / PAGE_TOKENS).max(1) as usize;
        Self { pages: LruCache::new(NonZeroUsize::new(pages).unwrap_or(NonZeroUsize::MIN)), locked: HashMap::new() }
    }

    /// A request starts running on the prompt (its bytes; a token is [`BYTES_PER_TOKEN`]
    /// bytes): all of it is stored, and its pages are locked (counted in
    /// [`locked_tokens`](Self::locked_tokens)) until [`release`](Self::release)d with the
    /// keys returned. Returns how many of its `prompt_tokens` were already cached, and the keys.
    /// `seed` keys the pages of one model apart from another's (0: the base model).
    pub fn run(&mut self, prompt: &[u8], prompt_tokens: u64, seed: u64) -> (u64, Vec<u64>) {
        let hashes = page_keys(prompt, seed);
        let hit_pages = hashes.iter().take_while(|h| self.pages.contains(*h)).count() as u64;
        for &h in &hashes {
            self.pages.put(h, ());
            *self.locked.entry(h).or_default() += 1;
        }
        ((hit_pages * PAGE_TOKENS).min(prompt_tokens), hashes)
    }

    /// A running request ended: its pages are no longer held by it.
    pub fn release(&mut self, pages: &[u64]) {
        for h in pages {
            if let Some(n) = self.locked.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.locked.remove(h);
                }
            }
        }
    }

    /// Tokens in the pages running requests hold, each page once.
    pub fn locked_tokens(&self) -> u64 {
        self.locked.len() as u64 * PAGE_TOKENS
    }

    /// Empties the cache (SGLang's `POST /flush_cache`).
    pub fn clear(&mut self) {
        self.pages.clear();
    }

    pub fn used_tokens(&self) -> u64 {
        self.pages.len() as u64 * PAGE_TOKENS
    }

    pub fn capacity_tokens(&self) -> u64 {
        self.pages.cap().get() as u64 * PAGE_TOKENS
    }
}

/// One key per page of `prompt` (the last one may be partial): the hash of the whole prompt
/// up to the end of that page, so a page is found only after the same prefix. The
/// simulator's own scheme, independent of the gateway's block hashes. Seed 0 gives the same
/// keys as an unseeded hash.
fn page_keys(prompt: &[u8], seed: u64) -> Vec<u64> {
    let mut hasher = Xxh3::with_seed(seed);
    prompt
        .chunks((PAGE_TOKENS * BYTES_PER_TOKEN) as usize)
        .map(|page| {
            hasher.update(page);
            hasher.digest()
        })
        .collect()
}

/// Simulated token count of a prompt of `len` bytes.
pub fn tokens_of(len: usize) -> u64 {
    (len as u64).div_ceil(BYTES_PER_TOKEN).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_prefixes_hit() {
        let mut c = KvCache::new(1024);
        let a = "x".repeat(640);
        assert_eq!(c.run(a.as_bytes(), tokens_of(a.len()), 0).0, 0);
        let b = format!("{a}and more");
        assert_eq!(c.run(b.as_bytes(), tokens_of(b.len()), 0).0, 160);
    }

    #[test]
    fn a_page_hits_only_after_the_same_prefix() {
        let mut c = KvCache::new(1024);
        let page = "p".repeat(64);
        let a = format!("{}{page}", "a".repeat(64));
        let b = format!("{}{page}", "b".repeat(64));
        assert_eq!(c.run(a.as_bytes(), 32, 0).0, 0);
        assert_eq!(c.run(b.as_bytes(), 32, 0).0, 0, "same second page, other first page");
        assert_eq!(c.run(a.as_bytes(), 32, 0).0, 32);
    }

    #[test]
    fn running_requests_that_share_a_prefix_hold_its_pages_once() {
        let mut c = KvCache::new(1024);
        let system = "s".repeat(640); // 10 pages
        let a = format!("{system}{}", "a".repeat(64));
        let b = format!("{system}{}", "b".repeat(64));
        let (_, pa) = c.run(a.as_bytes(), tokens_of(a.len()), 0);
        let (cached, pb) = c.run(b.as_bytes(), tokens_of(b.len()), 0);
        assert_eq!(cached, 160, "the shared prefix hit");
        assert_eq!(c.locked_tokens(), 12 * PAGE_TOKENS, "10 shared pages and one of each");
        c.release(&pa);
        assert_eq!(c.locked_tokens(), 11 * PAGE_TOKENS);
        c.release(&pb);
        assert_eq!(c.locked_tokens(), 0);
        c.release(&pb);
        assert_eq!(c.locked_tokens(), 0, "a second release changes nothing");
    }

    #[test]
    fn seed_zero_keeps_the_unseeded_keys_and_another_seed_misses() {
        let a = "k".repeat(100);
        let mut unseeded = Xxh3::new();
        unseeded.update(&a.as_bytes()[..64]);
        assert_eq!(page_keys(a.as_bytes(), 0)[0], unseeded.digest());
        let mut c = KvCache::new(1024);
        c.run(a.as_bytes(), 25, 0);
        assert_eq!(c.run(a.as_bytes(), 25, 7).0, 0, "another model's pages");
        assert_eq!(c.run(a.as_bytes(), 25, 0).0, 25);
    }

    #[test]
    fn lru_capacity_is_enforced() {
        let mut c = KvCache::new(32); // two pages
        let a = "a".repeat(128);
        let b = "b".repeat(128);
        c.run(a.as_bytes(), 32, 0);
        c.run(b.as_bytes(), 32, 0);
        assert_eq!(c.used_tokens(), 32);
        assert_eq!(c.run(a.as_bytes(), 32, 0).0, 0, "evicted by b");
    }
}
