//! Engine blocks re-keyed onto the gateway's text-block chain (`kvmesh_core::blocks`).
//!
//! The engine names a block by its own hash of token ids; a gateway names the prefix of a
//! routing text by chained xxh3 hashes of `block_size`-byte blocks, the first seeded by the
//! pool's key. One engine block's tokens are bytes (the vocabulary), and those bytes continue
//! the chain where its parent block left it: each engine block keeps the chain state at its
//! end (the last full gateway hash and the tail bytes short of a gateway block), so a child
//! is re-keyed in O(its bytes) whatever its depth. The gateway blocks an engine block
//! completes are what the worker holds in the global index; a count per gateway hash keeps
//! one held while any engine block that completed it lives (two token paths can spell the
//! same bytes).
//!
//! Invariants: an engine block is known only if its parent was (or it had none); removing or
//! clearing gives back exactly the gateway hashes no live engine block still completes; the
//! table holds at most `max_blocks` engine blocks (further stores are refused and counted).

use std::collections::HashMap;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::vocab::Vocab;
use super::wire::{Stored, MAX_BLOCK_TOKENS};

/// The chain state at the end of an engine block.
#[derive(Clone, Debug)]
struct ChainEnd {
    /// The last full gateway block's hash (the pool's seed before the first).
    full: u64,
    /// Bytes after it, fewer than a gateway block.
    tail: Box<[u8]>,
}

#[derive(Debug)]
struct EngineBlock {
    end: ChainEnd,
    /// The gateway blocks this engine block completed.
    completed: Box<[u64]>,
}

/// What a store did.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    /// Gateway hashes the worker now holds that it did not.
    pub added: Vec<u64>,
    /// Engine blocks stored.
    pub blocks: u64,
    /// Engine blocks refused (unknown parent, unknown token, over the bound, bad shape).
    pub refused: u64,
}

/// One worker's engine blocks.
pub struct Rekeyer {
    vocab: Arc<Vocab>,
    block_size: usize,
    seed: u64,
    max_blocks: usize,
    blocks: HashMap<u64, EngineBlock>,
    held: HashMap<u64, u32>,
}

impl Rekeyer {
    /// `block_size`: the gateways' bytes per block; `seed`: the first block's seed for the
    /// worker's pool (`blocks::model_seed`).
    pub fn new(vocab: Arc<Vocab>, block_size: usize, seed: u64, max_blocks: usize) -> Self {
        Self { vocab, block_size: block_size.max(1), seed, max_blocks, blocks: HashMap::new(), held: HashMap::new() }
    }

    /// Engine blocks known.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether gateway block `hash` is held through the engine's events.
    pub fn holds(&self, hash: u64) -> bool {
        self.held.contains_key(&hash)
    }

    /// A `BlockStored`: its blocks chained from its parent.
    pub fn stored(&mut self, s: &Stored) -> Applied {
        let mut out = Applied::default();
        let n = s.hashes.len() as u64;
        let per = s.block_size as usize;
        if per == 0
            || s.block_size > MAX_BLOCK_TOKENS
            || s.tokens.len() != s.hashes.len().saturating_mul(per)
            || s.lora
            || !s.gpu
        {
            out.refused = n;
            return out;
        }
        let mut end = match s.parent {
            None => ChainEnd { full: self.seed, tail: Box::default() },
            Some(p) => match self.blocks.get(&p) {
                Some(b) => b.end.clone(),
                None => {
                    out.refused = n;
                    return out;
                }
            },
        };
        let mut tail: Vec<u8> = end.tail.to_vec();
        for (i, (&hash, tokens)) in s.hashes.iter().zip(s.tokens.chunks(per)).enumerate() {
            if self.blocks.len() >= self.max_blocks && !self.blocks.contains_key(&hash) {
                out.refused += n - i as u64;
                break;
            }
            let mut completed = Vec::new();
            let mut full = end.full;
            let mut known = true;
            for &t in tokens {
                let Some(bytes) = self.vocab.bytes(t) else {
                    known = false;
                    break;
                };
                tail.extend_from_slice(bytes);
                let mut at = 0;
                while tail.len() - at >= self.block_size {
                    let block = tail.get(at..at + self.block_size).unwrap_or_default();
                    full = xxh3_64_with_seed(block, full);
                    completed.push(full);
                    at += self.block_size;
                }
                tail.drain(..at);
            }
            if !known {
                out.refused += n - i as u64;
                break;
            }
            end = ChainEnd { full, tail: tail.clone().into_boxed_slice() };
            if let Some(old) = self.blocks.remove(&hash) {
                self.release(&old.completed, &mut Vec::new());
            }
            for &h in &completed {
                let c = self.held.entry(h).or_insert(0);
                if *c == 0 {
                    out.added.push(h);
                }
                *c += 1;
            }
            self.blocks.insert(hash, EngineBlock { end: end.clone(), completed: completed.into_boxed_slice() });
            out.blocks += 1;
        }
        out
    }

    /// A `BlockRemoved`: returns the gateway hashes the worker no longer holds.
    pub fn removed(&mut self, hashes: &[u64]) -> Vec<u64> {
        let mut gone = Vec::new();
        for h in hashes {
            if let Some(b) = self.blocks.remove(h) {
                self.release(&b.completed, &mut gone);
            }
        }
        gone
    }

    /// Everything goes (`AllBlocksCleared`, a restart, the worker removed); returns it.
    pub fn clear(&mut self) -> Vec<u64> {
        self.blocks.clear();
        let gone = self.held.keys().copied().collect();
        self.held.clear();
        gone
    }

    fn release(&mut self, completed: &[u64], gone: &mut Vec<u64>) {
        for h in completed {
            if let Some(c) = self.held.get_mut(h) {
                *c -= 1;
                if *c == 0 {
                    self.held.remove(h);
                    gone.push(*h);
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "rekey_tests.rs"]
mod tests;
