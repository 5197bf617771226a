//! Data-parallel attention (`--dp-size N`): the worker runs N schedulers ("ranks"), each with
//! its own prefix cache and queue, as SGLang with `--dp-size` and `--enable-dp-attention`.
//! `/get_server_info` says `dp_size`, `/get_load` lists one entry per rank, and a request may
//! name its rank (`data_parallel_rank`, as a DP-aware router writes it; out of range: a 400).
//! One that names none goes to the ranks in turn (SGLang's round-robin DP controller).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde_json::{json, Value};

/// One rank's counters.
#[derive(Default)]
pub struct Rank {
    /// Requests that ran on it.
    pub requests: AtomicU64,
    /// Requests on it now (its `/get_load` `num_reqs`).
    pub in_progress: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
}

/// The worker's ranks.
pub struct Ranks {
    ranks: Vec<Rank>,
    next: AtomicU64,
}

impl Ranks {
    pub fn new(dp_size: usize) -> Self {
        Self { ranks: (0..dp_size.max(1)).map(|_| Rank::default()).collect(), next: AtomicU64::new(0) }
    }

    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The rank a request runs on: the one its body names, else the next in turn.
    pub fn pick(&self, body: &Value) -> Result<usize, String> {
        let n = self.ranks.len();
        match body.get("data_parallel_rank") {
            None | Some(Value::Null) => Ok((self.next.fetch_add(1, Relaxed) % n as u64) as usize),
            Some(v) => match v.as_u64() {
                Some(r) if (r as usize) < n => Ok(r as usize),
                _ => Err(format!("data_parallel_rank {v} is out of range: dp_size is {n}")),
            },
        }
    }

    pub fn rank(&self, r: usize) -> Option<&Rank> {
        self.ranks.get(r)
    }

    /// The prefix cache key seed of rank `r` of a model with `seed`: with several ranks each
    /// has a cache of its own, so no prompt hits across them.
    pub fn seed(&self, seed: u64, r: usize) -> u64 {
        if self.ranks.len() > 1 {
            seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        } else {
            seed
        }
    }

    /// SGLang's `/get_load` entries with each rank's own requests (`waiting` and `tokens`: the
    /// worker's, on rank 0 alone).
    pub fn get_load(&self, waiting: u64, tokens: u64, running: u64) -> Value {
        if self.ranks.len() == 1 {
            return json!([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}]);
        }
        let entries: Vec<Value> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let first = i == 0;
                json!({"dp_rank": i, "num_reqs": r.in_progress.load(Relaxed),
                       "num_waiting_reqs": if first { waiting } else { 0 }, "num_tokens": if first { tokens } else { 0 }})
            })
            .collect();
        Value::Array(entries)
    }

    /// `/sim/stats`' `ranks`.
    pub fn stats(&self) -> Value {
        let entries: Vec<Value> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (prompt, cached) = (r.prompt_tokens.load(Relaxed), r.cached_tokens.load(Relaxed));
                json!({"rank": i, "requests": r.requests.load(Relaxed), "in_progress": r.in_progress.load(Relaxed),
                       "prompt_tokens": prompt, "cached_tokens": cached,
                       "cache_hit_rate": if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 }})
            })
            .collect();
        Value::Array(entries)
    }
}

/// A request counted on its rank while it is handled (a stream: until it ends).
pub struct OnRank {
    ranks: Arc<Ranks>,
    rank: usize,
}

impl OnRank {
    pub fn new(ranks: &Arc<Ranks>, rank: usize) -> Self {
        if let Some(r) = ranks.rank(rank) {
            r.requests.fetch_add(1, Relaxed);
            r.in_progress.fetch_add(1, Relaxed);
        }
        Self { ranks: Arc::clone(ranks), rank }
    }

    /// Prompt and cached tokens served on the rank.
    pub fn tokens(&self, prompt: u64, cached: u64) {
        if let Some(r) = self.ranks.rank(self.rank) {
            r.prompt_tokens.fetch_add(prompt, Relaxed);
            r.cached_tokens.fetch_add(cached, Relaxed);
        }
    }
}

impl Drop for OnRank {
    fn drop(&mut self) {
        if let Some(r) = self.ranks.rank(self.rank) {
            r.in_progress.fetch_sub(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_rank_is_checked_and_others_go_in_turn() {
        let r = Ranks::new(2);
        assert_eq!(r.pick(&json!({"data_parallel_rank": 1})), Ok(1));
        for bad in [json!(2), json!(-1), json!("0"), json!(1.5)] {
            assert!(r.pick(&json!({"data_parallel_rank": bad})).unwrap_err().contains("out of range"), "{bad}");
        }
        let turns: Vec<usize> = (0..4).map(|_| r.pick(&json!({})).unwrap()).collect();
        assert_eq!(turns, [0, 1, 0, 1]);
        assert_eq!(
            Ranks::new(1).pick(&json!({"data_parallel_rank": 1})).unwrap_err(),
            "data_parallel_rank 1 is out of range: dp_size is 1"
        );
        assert_ne!(r.seed(0, 0), r.seed(0, 1));
        assert_eq!(Ranks::new(1).seed(5, 0), 5, "one rank: the cache keys as before");
    }
}
