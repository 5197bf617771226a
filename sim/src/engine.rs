//! The simulated inference engine: admission (queueing past `--max-running`), prefill whose
//! cost is the uncached part of the prompt, decode steps that slow down as the batch grows,
//! fault injection, and the counters `/metrics`, `/get_load` and `/sim/stats` report.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, SemaphorePermit};

use serde_json::Value;

use crate::bootstrap::Rooms;
use crate::cache::KvCache;
use crate::cli::Args;
use crate::models::Models;
use crate::vllm::Transfers;

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// Prompt tokens whose KV arrived from a prefill worker (PD decode).
    pub transferred_tokens: AtomicU64,
    /// KV tokens held by running requests whose KV was transferred from a prefill worker; a
    /// request prefilled here holds prefix cache pages instead, each page counted once however
    /// many requests share it (`KvCache::locked_tokens`). Cached prefixes that nothing runs on
    /// are evictable and not counted.
    pub active_tokens: AtomicU64,
    /// Requests being handled (a PD decode waiting for its KV included); a client that goes
    /// away takes its request out.
    pub in_progress: AtomicU64,
    /// `/abort_request` calls received (whether or not they found their request).
    pub abort_requests: AtomicU64,
    /// vLLM: requests that arrived with `do_remote_prefill` parameters whose KV was pulled
    /// from the prefill they name, for this prompt.
    pub kv_transfers_ok: AtomicU64,
    /// vLLM: requests whose `kv_transfer_params` were malformed, or named KV that could not be
    /// pulled or was computed for another prompt (each one answered with an error); and
    /// `--llm-d-sidecar` prefill requests that failed.
    pub kv_transfers_failed: AtomicU64,
    /// vLLM prefill: requests answered with `kv_transfer_params` for a decode to pull.
    pub kv_transfers_published: AtomicU64,
    /// vLLM: requests that computed their prompt here with no KV transfer either way.
    pub local_prefills: AtomicU64,
    /// `--llm-d-sidecar`: prefill requests this sim sent for `x-prefiller-host-port`.
    pub sidecar_prefills: AtomicU64,
}

/// The most distinct sessions a worker remembers between two cache flushes.
pub const MAX_SESSIONS: usize = 65_536;

pub struct Engine {
    pub args: Args,
    /// Requests that `/abort_request` can stop, by rid.
    aborts: Mutex<HashMap<String, Arc<Notify>>>,
    pub addr: String,
    /// PD: the KV this prefill worker holds per bootstrap room.
    pub rooms: Arc<Rooms>,
    /// vLLM PD: the KV this prefill worker holds for decode workers to pull.
    pub transfers: Arc<Transfers>,
    /// The model names served.
    pub models: Models,
    /// Its data-parallel ranks (`--dp-size`).
    pub ranks: Arc<crate::dp::Ranks>,
    /// The last requests received (for tests and debugging: `/sim/requests`).
    pub recent: Mutex<VecDeque<Value>>,
    /// The distinct `x-session-id`s served since the last cache flush (bounded): how many
    /// workers one session reached is how well a router keeps a session in one place.
    sessions: Mutex<HashSet<String>>,
    cache: Mutex<KvCache>,
    /// The KV-event publisher (`--kv-events-port`), once started.
    pub kv_events: std::sync::OnceLock<Arc<crate::kv_events::KvEvents>>,
    slots: Semaphore,
    pub counters: Counters,
    /// The probability of an injected failure (`--fail-rate`, changed by `POST /sim/fault`),
    /// as f64 bits.
    fail_rate: AtomicU64,
    /// The worker's slowness factor (`--slowdown`, changed by `POST /sim/fault`), as f64 bits.
    slowdown: AtomicU64,
}

/// An admitted request: holds a running slot until dropped.
pub struct Run<'a> {
    engine: &'a Engine,
    _slot: SemaphorePermit<'a>,
    /// Prompt tokens counted in `active_tokens` while this runs (KV transferred from a
    /// prefill worker: its own).
    tokens: u64,
    /// The prefix cache pages this run holds (a prompt prefilled here).
    pages: Vec<u64>,
    pub cached_tokens: u64,
    pub started: Instant,
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        self.engine.counters.running.fetch_sub(1, Relaxed);
        self.engine.counters.active_tokens.fetch_sub(self.tokens, Relaxed);
        if !self.pages.is_empty() {
            if let Ok(mut cache) = self.engine.cache.lock() {
                cache.release(&self.pages);
            }
        }
    }
}

/// A request `/abort_request` can stop (registered under its rids while this lives).
pub struct Abortable {
    engine: Arc<Engine>,
    rids: Vec<String>,
    signal: Arc<Notify>,
}

impl Abortable {
    /// Resolves when the request is aborted (an abort that came first is not lost).
    pub async fn aborted(&self) {
        self.signal.notified().await;
    }
}

impl Drop for Abortable {
    fn drop(&mut self) {
        if let Ok(mut map) = self.engine.aborts.lock() {
            for rid in &self.rids {
                map.remove(rid);
            }
        }
    }
}

/// The injected failure of `--fail-rate`.
#[derive(Debug)]
pub struct InjectedFailure;

impl Engine {
    pub fn new(args: Args) -> Self {
        let engine_id = args.engine_id.clone().unwrap_or_else(|| {
            // vLLM's engine ids are random UUIDs; one per process identifies this instance.
            let r = fastrand::u128(..);
            let hex = format!("{r:032x}");
            format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
        });
        let advertised = args.advertise_host.clone().unwrap_or_else(|| args.host.clone());
        let transfers = Transfers::new(engine_id, advertised, args.port, crate::vllm::MAX_TRANSFERS, crate::vllm::KEEP);
        Self {
            addr: format!("{}:{}", args.host, args.port),
            cache: Mutex::new(KvCache::new(args.kv_capacity_tokens)),
            kv_events: std::sync::OnceLock::new(),
            rooms: Arc::new(Rooms::default()),
            transfers: Arc::new(transfers),
            models: Models::new(&args),
            ranks: Arc::new(crate::dp::Ranks::new(args.dp_size)),
            recent: Mutex::new(VecDeque::new()),
            sessions: Mutex::new(HashSet::new()),
            aborts: Mutex::new(HashMap::new()),
            slots: Semaphore::new(args.max_running),
            counters: Counters::default(),
            fail_rate: AtomicU64::new(args.fail_rate.to_bits()),
            slowdown: AtomicU64::new(args.slowdown.to_bits()),
            args,
        }
    }

    fn scaled(&self, secs: f64) -> Option<Duration> {
        let s = secs * self.args.time_scale * self.slowdown();
        (s > 0.0).then(|| Duration::from_secs_f64(s))
    }

    async fn pause(&self, secs: f64) {
        if let Some(d) = self.scaled(secs) {
            tokio::time::sleep(d).await;
        }
    }

    /// Makes a request stoppable by its rids until the returned guard drops.
    pub fn abortable(self: &Arc<Self>, rids: Vec<String>) -> Abortable {
        let signal = Arc::new(Notify::new());
        if let Ok(mut map) = self.aborts.lock() {
            for rid in &rids {
                map.insert(rid.clone(), Arc::clone(&signal));
            }
        }
        Abortable { engine: Arc::clone(self), rids, signal }
    }

    /// SGLang's `/abort_request`: a rid it does not know exactly stops nothing; one it knows
    /// stops every request whose rid starts with it (its scheduler matches by prefix); `None`
    /// (`abort_all`) stops every one. False if nothing stopped.
    pub fn abort(&self, rid: Option<&str>) -> bool {
        let signals: Vec<Arc<Notify>> = match (self.aborts.lock(), rid) {
            (Ok(map), Some(rid)) if !map.contains_key(rid) => Vec::new(),
            (Ok(map), rid) => map
                .iter()
                .filter(|(r, _)| rid.is_none_or(|rid| r.starts_with(rid)))
                .map(|(_, s)| Arc::clone(s))
                .collect(),
            (Err(_), _) => Vec::new(),
        };
        for s in &signals {
            s.notify_one();
        }
        !signals.is_empty()
    }

    /// Remembers a request (bounded to the last 64).
    pub fn record(&self, entry: Value) {
        if let Ok(mut recent) = self.recent.lock() {
            if recent.len() == 64 {
                recent.pop_front();
            }
            recent.push_back(entry);
        }
    }

    /// Remembers a request's session (at most [`MAX_SESSIONS`] of them, ids of at most 128
    /// bytes).
    pub fn record_session(&self, id: &str) {
        if let Ok(mut sessions) = self.sessions.lock() {
            if id.len() <= 128 && sessions.len() < MAX_SESSIONS && !sessions.contains(id) {
                sessions.insert(id.to_string());
            }
        }
    }

    /// The distinct sessions served since the last cache flush.
    pub fn sessions(&self) -> usize {
        self.sessions.lock().map_or(0, |s| s.len())
    }

    /// Queues for a slot for a prompt whose KV was transferred from a prefill worker: no
    /// prefill here.
    pub async fn admit_transferred(&self, prompt_tokens: u64) -> Result<Run<'_>, InjectedFailure> {
        let started = Instant::now();
        self.counters.waiting.fetch_add(1, Relaxed);
        let slot = self.slots.acquire().await;
        self.counters.waiting.fetch_sub(1, Relaxed);
        let Ok(slot) = slot else { return Err(InjectedFailure) };
        self.counters.running.fetch_add(1, Relaxed);
        self.counters.transferred_tokens.fetch_add(prompt_tokens, Relaxed);
        self.counters.active_tokens.fetch_add(prompt_tokens, Relaxed);
        Ok(Run {
            engine: self,
            _slot: slot,
            tokens: prompt_tokens,
            pages: Vec::new(),
            cached_tokens: prompt_tokens,
            started,
        })
    }

    /// Queues for a slot for a prompt whose KV a vLLM decode pulled from a prefill worker: no
    /// prefill here, but the KV lands in the prefix cache (vLLM caches the blocks it reads), so
    /// a later request on the same prefix hits here. `seed` as in [`admit`](Self::admit).
    pub async fn admit_pulled(&self, prompt: &[u8], prompt_tokens: u64, seed: u64) -> Result<Run<'_>, InjectedFailure> {
        let started = Instant::now();
        self.counters.waiting.fetch_add(1, Relaxed);
        let slot = self.slots.acquire().await;
        self.counters.waiting.fetch_sub(1, Relaxed);
        let Ok(slot) = slot else { return Err(InjectedFailure) };
        self.counters.running.fetch_add(1, Relaxed);
        let mut run = Run { engine: self, _slot: slot, tokens: 0, pages: Vec::new(), cached_tokens: 0, started };
        if let Ok(mut cache) = self.cache.lock() {
            run.pages = cache.run(prompt, prompt_tokens, seed).1;
        }
        if seed == 0 {
            if let Some(events) = self.kv_events.get() {
                events.on_prompt(prompt);
            }
        }
        self.counters.transferred_tokens.fetch_add(prompt_tokens, Relaxed);
        run.cached_tokens = prompt_tokens;
        Ok(run)
    }

    /// Queues for a slot, then runs the prefill of `prompt` (`prompt_tokens` tokens). `seed`
    /// keys the prompt's cache pages (0: the base model; a LoRA adapter has its own).
    pub async fn admit(&self, prompt: &[u8], prompt_tokens: u64, seed: u64) -> Result<Run<'_>, InjectedFailure> {
        let started = Instant::now();
        self.counters.waiting.fetch_add(1, Relaxed);
        let slot = self.slots.acquire().await;
        self.counters.waiting.fetch_sub(1, Relaxed);
        let Ok(slot) = slot else {
            return Err(InjectedFailure);
        };
        self.counters.running.fetch_add(1, Relaxed);
        let mut run = Run { engine: self, _slot: slot, tokens: 0, pages: Vec::new(), cached_tokens: 0, started };
        // With KV events the engine's block cache is the truth: the answer is what it held of
        // the prompt when it arrived, in whole pages (their bytes in the simulator's tokens).
        let held = match (seed, self.kv_events.get()) {
            (0, Some(events)) => Some(events.on_prompt(prompt)),
            _ => None,
        };
        let cached = match self.cache.lock() {
            Ok(mut cache) => {
                let (cached, pages) = cache.run(prompt, prompt_tokens, seed);
                run.pages = pages;
                cached
            }
            Err(_) => 0,
        };
        let cached = held.map_or(cached, |bytes| (bytes / crate::cache::BYTES_PER_TOKEN).min(prompt_tokens));
        self.counters.prompt_tokens.fetch_add(prompt_tokens, Relaxed);
        self.counters.cached_tokens.fetch_add(cached, Relaxed);
        self.pause((prompt_tokens - cached) as f64 * self.args.prefill_us_per_token / 1e6).await;
        run.cached_tokens = cached;
        Ok(run)
    }

    pub fn fail_rate(&self) -> f64 {
        f64::from_bits(self.fail_rate.load(Relaxed))
    }

    pub fn slowdown(&self) -> f64 {
        f64::from_bits(self.slowdown.load(Relaxed))
    }

    /// Changes the slowness factor at run time (finite, > 0, at most 1000; else refused).
    pub fn set_slowdown(&self, f: f64) -> Result<(), String> {
        if !(f.is_finite() && f > 0.0 && f <= 1000.0) {
            return Err(format!("slowdown {f} is not in (0, 1000]"));
        }
        self.slowdown.store(f.to_bits(), Relaxed);
        Ok(())
    }

    /// Changes the failure probability at run time (0..1, else refused).
    pub fn set_fail_rate(&self, p: f64) -> Result<(), String> {
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("fail_rate {p} is not between 0 and 1"));
        }
        self.fail_rate.store(p.to_bits(), Relaxed);
        Ok(())
    }

    /// Counts a request and decides whether `--fail-rate` fails it.
    pub fn accept(&self) -> Result<(), InjectedFailure> {
        self.counters.requests.fetch_add(1, Relaxed);
        let fail_rate = self.fail_rate();
        if fail_rate > 0.0 && fastrand::f64() < fail_rate {
            self.counters.failures.fetch_add(1, Relaxed);
            return Err(InjectedFailure);
        }
        Ok(())
    }

    /// One decode step (one output token) of a running request.
    pub async fn decode_step(&self) {
        self.counters.completion_tokens.fetch_add(1, Relaxed);
        let running = self.counters.running.load(Relaxed) as f64;
        self.pause(self.args.decode_ms_per_token / 1e3 * (1.0 + self.args.batch_slowdown * running)).await;
    }

    /// KV tokens in use by running requests, and the capacity (SGLang's `token_usage` is their
    /// ratio: evictable cached prefixes do not count, and a prefix that several running
    /// requests share counts once).
    pub fn kv_usage(&self) -> (u64, u64) {
        let (locked, cap) = self.cache.lock().map(|c| (c.locked_tokens(), c.capacity_tokens())).unwrap_or((0, 1));
        (locked.saturating_add(self.counters.active_tokens.load(Relaxed)).min(cap), cap)
    }

    /// Tokens the prefix cache holds, and its capacity.
    pub fn cache_usage(&self) -> (u64, u64) {
        self.cache.lock().map(|c| (c.used_tokens(), c.capacity_tokens())).unwrap_or((0, 1))
    }

    /// A request prefilled here finished with `output`: with KV events, the pages its output
    /// completed are cached after its prompt (decode tokens take cache space).
    pub fn finished(&self, prompt: &[u8], output: &str, seed: u64) {
        if let (0, Some(events)) = (seed, self.kv_events.get()) {
            events.on_finished(prompt, output.as_bytes());
        }
    }

    /// Empties the prefix KV cache.
    pub fn flush_cache(&self) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.clear();
        }
        if let Some(events) = self.kv_events.get() {
            events.cleared();
        }
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.clear();
        }
    }

    /// An engine restarted in place: its cache empty, its KV-event sequence from 0 (no
    /// event says so: a subscriber sees the sequence start again).
    pub fn restart(&self) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.clear();
        }
        if let Some(events) = self.kv_events.get() {
            events.restarted();
        }
    }

    /// Cached prompt tokens over prompt tokens, since start.
    pub fn hit_rate(&self) -> f64 {
        let prompt = self.counters.prompt_tokens.load(Relaxed);
        if prompt == 0 {
            0.0
        } else {
            self.counters.cached_tokens.load(Relaxed) as f64 / prompt as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use futures_util::FutureExt;

    #[test]
    fn the_fail_rate_changes_at_run_time_within_its_range() {
        let e = Engine::new(Args::parse_from(["kvmesh-sim", "--fail-rate", "1"]));
        assert!(e.accept().is_err());
        e.set_fail_rate(0.0).unwrap();
        assert!(e.accept().is_ok());
        assert!(e.set_fail_rate(1.5).is_err() && e.set_fail_rate(f64::NAN).is_err());
        assert_eq!(e.fail_rate(), 0.0);
    }

    /// As SGLang: a rid it knows stops every request whose rid starts with it; one it does
    /// not know (a mere prefix included) stops nothing; `abort_all` stops every one.
    #[test]
    fn aborts_go_by_a_known_rid_then_by_prefix() {
        let e = Arc::new(Engine::new(Args::parse_from(["kvmesh-sim"])));
        let one = e.abortable(vec!["req-1".into()]);
        let ten = e.abortable(vec!["req-10".into()]);
        assert!(!e.abort(Some("req-")) && !e.abort(Some("")), "not a rid it knows");
        assert!(one.signal.notified().now_or_never().is_none());
        assert!(e.abort(Some("req-1")), "req-1 and, by prefix, req-10");
        for (a, name) in [(&one, "req-1"), (&ten, "req-10")] {
            assert!(a.signal.notified().now_or_never().is_some(), "{name} was stopped");
        }
        let other = e.abortable(vec!["x".into()]);
        assert!(e.abort(None), "abort_all");
        assert!(other.signal.notified().now_or_never().is_some());
        drop((one, ten, other));
        assert!(!e.abort(None), "nothing left to stop");
    }
}
