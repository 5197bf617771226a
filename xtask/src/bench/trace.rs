//! The quality suite's `trace` workload: a Mooncake-format trace replayed on its own schedule.
//! A trace is one JSON object a line: `timestamp` (ms), `input_length` and `output_length`
//! (tokens) and `hash_ids`, one id per block of [`BLOCK_TOKENS`] tokens, equal ids for equal
//! content. Each id becomes a fixed chunk of text ([`Texts`]); a request's prompt is its chunks
//! in order, the last one cut to reach `input_length`; it leaves at the trace's time divided by
//! the speed-up, a follow-up turn only after the request it extends ([`followups`]). The hit
//! rate is what the workers counted, beside three references computed here with the workers'
//! own cache model ([`references`]).

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use kvmesh_testkit::{http, repo_root, Sim};
use serde_json::{json, Value};

use super::report::{f, table};
use super::routers::{delta, start, stats, Config};
use super::stack::{PeerBins, Workers};
use super::workload::{text, Rng};
use super::Opts;
use crate::loadgen::{self, Timed};
use crate::tools::step;

/// Tokens per block of `hash_ids` (Mooncake's traces).
pub const BLOCK_TOKENS: u64 = 512;
/// Bytes of prompt per token: what the simulated workers count as a token (`kvmesh-sim`'s
/// `BYTES_PER_TOKEN`), and kvmesh's default `bytes_per_token`.
pub const BYTES_PER_TOKEN: usize = 4;
/// Bytes of one block's chunk of text: a multiple of kvmesh's 32-byte index blocks and of the
/// workers' 64-byte cache pages, so chunk boundaries are block and page boundaries.
pub const CHUNK_BYTES: usize = BLOCK_TOKENS as usize * BYTES_PER_TOKEN;
/// The workers' cache page: 16 tokens (`kvmesh-sim`'s `PAGE_TOKENS`).
const PAGE_BYTES: usize = 16 * BYTES_PER_TOKEN;
/// The chunks' filler text comes from this seed.
const SEED: u64 = 20_251_126;
/// The simulated workers, as in the other quality workloads.
const WORKERS: usize = 4;
/// Requests in flight at most (connections).
const CONCURRENCY: usize = 128;
/// A run whose 99th-percentile lateness is above this did not keep pace with the schedule.
const PACE_MS: f64 = 500.0;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub timestamp_ms: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// What the replay is given: the file, how much of it, how fast, on what workers.
#[derive(Clone, Debug)]
pub struct Settings {
    pub path: PathBuf,
    /// The first N requests (0: all).
    pub requests: usize,
    pub speed_up: f64,
    /// Each worker's KV cache, in tokens.
    pub kv_capacity: u64,
}

/// The trace that `--workload trace` replays when no `--trace FILE` is given.
pub fn default_file() -> PathBuf {
    repo_root().join("../shared/data/mooncake/synthetic_trace.jsonl")
}

impl Settings {
    /// The options' values, else the defaults: the first 1,000 requests of the trace (200 with
    /// `--quick`; 277 s of the synthetic trace), 10× faster, 1 Mi tokens of KV per worker.
    pub fn of(o: &Opts) -> Self {
        let path = o.trace.clone().unwrap_or_else(default_file);
        Self {
            path: path.canonicalize().unwrap_or(path),
            requests: o.trace_requests.unwrap_or(if o.quick { 200 } else { 1000 }),
            speed_up: o.speed_up.unwrap_or(10.0),
            kv_capacity: o.kv_capacity.unwrap_or(1 << 20),
        }
    }
}

/// A field of line `line`: present and not null.
fn field<'a>(obj: &'a serde_json::Map<String, Value>, line: usize, name: &str) -> anyhow::Result<&'a Value> {
    obj.get(name).filter(|v| !v.is_null()).with_context(|| format!("line {line}: `{name}` is missing"))
}

fn integer(v: &Value, line: usize, name: &str, least: u64) -> anyhow::Result<u64> {
    v.as_u64()
        .filter(|&n| n >= least)
        .with_context(|| format!("line {line}: `{name}` must be an integer of at least {least}, not {v}"))
}

/// Reads a Mooncake-format trace, every line checked (a bad line is an error that names the
/// line and the field); keeps the first `limit` requests (0: all). Blank lines are skipped.
pub fn parse(trace: &str, limit: usize) -> anyhow::Result<Vec<Entry>> {
    let mut out: Vec<Entry> = Vec::new();
    let mut last: Option<(usize, f64)> = None;
    for (i, raw) in trace.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(raw).with_context(|| format!("line {line}: not JSON"))?;
        let obj = v.as_object().with_context(|| format!("line {line}: not a JSON object"))?;
        let ts = field(obj, line, "timestamp")?;
        let timestamp_ms = ts
            .as_f64()
            .filter(|t| *t >= 0.0 && t.is_finite())
            .with_context(|| format!("line {line}: `timestamp` must be a non-negative number of ms, not {ts}"))?;
        if let Some((at, before)) = last.filter(|&(_, before)| timestamp_ms < before) {
            bail!("line {line}: `timestamp` {timestamp_ms} is before line {at}'s {before} (a trace is in time order)");
        }
        last = Some((line, timestamp_ms));
        let input_length = integer(field(obj, line, "input_length")?, line, "input_length", 1)?;
        let output_length = integer(field(obj, line, "output_length")?, line, "output_length", 0)?;
        let ids = field(obj, line, "hash_ids")?;
        let list = ids
            .as_array()
            .filter(|l| !l.is_empty())
            .with_context(|| format!("line {line}: `hash_ids` must be a non-empty list of integers, not {ids}"))?;
        let hash_ids = list
            .iter()
            .enumerate()
            .map(|(k, id)| integer(id, line, &format!("hash_ids[{k}]"), 0))
            .collect::<anyhow::Result<Vec<u64>>>()?;
        let n = hash_ids.len() as u64;
        let fits = (n - 1) * BLOCK_TOKENS + 1..=n * BLOCK_TOKENS;
        if !fits.contains(&input_length) {
            bail!(
                "line {line}: `input_length` {input_length} does not fit its {n} `hash_ids` (blocks of {BLOCK_TOKENS} tokens: {} to {})",
                fits.start(),
                fits.end()
            );
        }
        if limit == 0 || out.len() < limit {
            out.push(Entry { timestamp_ms, input_length, output_length, hash_ids });
        }
    }
    anyhow::ensure!(!out.is_empty(), "no requests in the trace");
    Ok(out)
}

/// [`parse`] of a file.
pub fn load(path: &Path, limit: usize) -> anyhow::Result<Vec<Entry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the trace {}", path.display()))?;
    parse(&text, limit).with_context(|| format!("trace {}", path.display()))
}

/// The letters of a chunk's head (URL-safe base64: no JSON escaping).
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// Distinct ids a replay can give a head of their own (64^4).
const MAX_IDS: usize = 1 << 24;

/// The first token (4 bytes) of the chunk of the `n`-th distinct id: one of 2^24 values, a
/// different one for every `n` (an odd multiplier is a bijection modulo 2^24; it spreads
/// neighbours so that most pairs differ in their first byte already).
fn head(n: u32) -> [u8; 4] {
    let x = n.wrapping_mul(0x9E_3779) & 0xFF_FFFF;
    [0, 1, 2, 3].map(|k| ALPHABET[(x >> (6 * k)) as usize & 63])
}

/// The chunks of text the ids stand for. The `n`-th distinct id met (in the order of the
/// trace) gets the `n`-th chunk: [`head`]`(n)` then words from a seed of its own, exactly
/// [`CHUNK_BYTES`] bytes. So the same id always gives the same text, and two distinct ids'
/// chunks differ within their first token: two prompts that share k leading ids share k
/// chunks and not one token more, at any block size that divides a chunk.
#[derive(Default)]
pub struct Texts {
    index: HashMap<u64, u32>,
    chunks: Vec<String>,
}

impl Texts {
    fn chunk(&mut self, id: u64) -> anyhow::Result<&str> {
        let n = match self.index.get(&id) {
            Some(&n) => n,
            None => {
                anyhow::ensure!(self.chunks.len() < MAX_IDS, "more than {MAX_IDS} distinct hash ids");
                let n = self.chunks.len() as u32;
                let mut rng = Rng::new(SEED ^ u64::from(n));
                let mut s = String::from_utf8_lossy(&head(n)).into_owned();
                s.push(' ');
                s.push_str(&text(&mut rng, CHUNK_BYTES));
                s.truncate(CHUNK_BYTES);
                self.chunks.push(s);
                self.index.insert(id, n);
                n
            }
        };
        Ok(&self.chunks[n as usize])
    }

    /// The prompt of `e`: its chunks in order, the last cut to `input_length` tokens.
    pub fn prompt(&mut self, e: &Entry) -> anyhow::Result<String> {
        let bytes = e.input_length as usize * BYTES_PER_TOKEN;
        let mut out = String::with_capacity(bytes);
        for &id in &e.hash_ids {
            let chunk = self.chunk(id)?;
            out.push_str(&chunk[..chunk.len().min(bytes - out.len())]);
        }
        Ok(out)
    }
}

/// The ids of `e`'s whole blocks (a partial last block left out).
fn whole_blocks(e: &Entry) -> &[u64] {
    let whole = (e.input_length / BLOCK_TOKENS) as usize;
    &e.hash_ids[..whole.min(e.hash_ids.len())]
}

/// For each request, the earlier one it is a follow-up turn of, if any: the latest earlier
/// request whose whole blocks are the longest leading part of this one's ids, when this
/// prompt is longer than that one's (the previous turn, its answer and a new question). A
/// follow-up leaves only once that request is answered.
pub fn followups(entries: &[Entry]) -> Vec<Option<usize>> {
    let mut latest: HashMap<&[u64], usize> = HashMap::new();
    let mut out = Vec::with_capacity(entries.len());
    for (j, e) in entries.iter().enumerate() {
        let parent = (1..=e.hash_ids.len()).rev().find_map(|k| latest.get(&e.hash_ids[..k]).copied());
        out.push(parent.filter(|&i| entries[i].input_length < e.input_length));
        let whole = whole_blocks(e);
        if !whole.is_empty() {
            latest.insert(whole, j);
        }
    }
    out
}

/// Hit rates the workers could reach, by their own cache model (pages of 16 tokens keyed by
/// the whole prefix up to them, LRU; a request hits its leading pages found, then stores all
/// of its pages), the requests taken in the trace's order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct References {
    /// One cache that never evicts.
    pub ideal: f64,
    /// One LRU cache of the workers' capacity together.
    pub pooled: f64,
    /// One worker alone, every request sent to it.
    pub one_worker: f64,
}

/// The keys of a prompt's pages: each the hash of the prompt up to the end of that page.
fn page_keys(prompt: &[u8]) -> Vec<u64> {
    let mut h = DefaultHasher::new();
    prompt
        .chunks(PAGE_BYTES)
        .map(|page| {
            h.write(page);
            h.finish()
        })
        .collect()
}

/// Cached over prompt tokens, an LRU of `capacity_tokens` (None: unbounded) serving `prompts`.
fn lru_hit_rate(prompts: &[Vec<u64>], tokens: &[u64], capacity_tokens: Option<u64>) -> f64 {
    let capacity = capacity_tokens.map(|c| (c / (PAGE_BYTES / BYTES_PER_TOKEN) as u64).max(1) as usize);
    let mut stamp_of: HashMap<u64, u64> = HashMap::new();
    let mut by_stamp: BTreeMap<u64, u64> = BTreeMap::new();
    let mut clock = 0u64;
    let (mut cached, mut total) = (0u64, 0u64);
    for (pages, &t) in prompts.iter().zip(tokens) {
        let hit = pages.iter().take_while(|p| stamp_of.contains_key(*p)).count() as u64;
        cached += (hit * (PAGE_BYTES / BYTES_PER_TOKEN) as u64).min(t);
        total += t;
        for &p in pages {
            clock += 1;
            if let Some(old) = stamp_of.insert(p, clock) {
                by_stamp.remove(&old);
            }
            by_stamp.insert(clock, p);
            if capacity.is_some_and(|c| stamp_of.len() > c) {
                if let Some((_, oldest)) = by_stamp.pop_first() {
                    stamp_of.remove(&oldest);
                }
            }
        }
    }
    if total == 0 {
        0.0
    } else {
        cached as f64 / total as f64
    }
}

/// The three references for `prompts` on `workers` workers of `capacity_tokens` each.
pub fn references(prompts: &[&[u8]], capacity_tokens: u64, workers: usize) -> References {
    let pages: Vec<Vec<u64>> = prompts.iter().map(|p| page_keys(p)).collect();
    let tokens: Vec<u64> = prompts.iter().map(|p| (p.len().div_ceil(BYTES_PER_TOKEN) as u64).max(1)).collect();
    References {
        ideal: lru_hit_rate(&pages, &tokens, None),
        pooled: lru_hit_rate(&pages, &tokens, Some(capacity_tokens * workers as u64)),
        one_worker: lru_hit_rate(&pages, &tokens, Some(capacity_tokens)),
    }
}

/// The streamed `/v1/completions` request of a prompt: the prompt reaches the workers and the
/// routers byte for byte, so chunk boundaries stay block and page boundaries.
fn request(prompt: &str, output_length: u64) -> Vec<u8> {
    let body = json!({
        "model": "kvmesh-sim", "prompt": prompt, "max_tokens": output_length.max(1), "stream": true,
        "stream_options": {"include_usage": true},
    });
    loadgen::post("/v1/completions", &body.to_string())
}

/// The replay of a trace: its timed requests, their prompts' references, and what it is.
pub struct Replay {
    pub requests: Arc<Vec<Timed>>,
    pub references: References,
    pub summary: Value,
}

/// Builds the replay of `entries` at `speed_up` on workers of `kv_capacity` tokens each.
pub fn replay(entries: &[Entry], speed_up: f64, kv_capacity: u64) -> anyhow::Result<Replay> {
    let mut texts = Texts::default();
    let prompts: Vec<String> = entries.iter().map(|e| texts.prompt(e)).collect::<anyhow::Result<_>>()?;
    let after = followups(entries);
    let t0 = entries[0].timestamp_ms;
    let requests: Vec<Timed> = entries
        .iter()
        .zip(&prompts)
        .zip(&after)
        .map(|((e, p), &after)| Timed {
            at: Duration::from_secs_f64((e.timestamp_ms - t0) / 1e3 / speed_up),
            after,
            request: request(p, e.output_length),
        })
        .collect();
    let bytes: Vec<&[u8]> = prompts.iter().map(|p| p.as_bytes()).collect();
    let references = references(&bytes, kv_capacity, WORKERS);
    let n = entries.len() as f64;
    let span_s = (entries[entries.len() - 1].timestamp_ms - t0) / 1e3;
    let summary = json!({
        "requests": entries.len(),
        "trace_span_s": span_s,
        "replay_span_s": span_s / speed_up,
        "distinct_blocks": texts.chunks.len(),
        "followups": after.iter().flatten().count(),
        "mean_input_tokens": entries.iter().map(|e| e.input_length as f64).sum::<f64>() / n,
        "mean_output_tokens": entries.iter().map(|e| e.output_length as f64).sum::<f64>() / n,
        "references": {"ideal": references.ideal, "pooled_lru": references.pooled, "one_worker": references.one_worker},
    });
    Ok(Replay { requests: Arc::new(requests), references, summary })
}

/// What the trace workload compares: kvmesh at 1, 3 and 8 gateways (one kvmesh-cp), SMG at
/// 1 and 3 replicas (3 with its mesh), sglang-router at 1 and 3; `cache_aware` everywhere.
/// `--quick`: no 8 gateways.
fn configs(o: &Opts, bins: &PeerBins) -> Vec<Config> {
    let c = |router, replicas, mesh| Config { router, replicas, mesh, policy: "cache_aware" };
    let mut out = vec![c("kvmesh", 1, false), c("kvmesh", 3, false)];
    if !o.quick {
        out.push(c("kvmesh", 8, false));
    }
    if bins.smg.is_some() {
        out.extend([c("smg", 1, false), c("smg", 3, true)]);
    }
    if bins.sglang_python.is_some() {
        out.extend([c("sglang-router", 1, false), c("sglang-router", 3, false)]);
    }
    out.into_iter().filter(|c| o.wants(&c.label())).collect()
}

fn measure(r: &Replay, c: &Config, sims: &[Sim], targets: &[std::net::SocketAddr]) -> Value {
    for s in sims {
        let _ = http::post(&format!("{}/flush_cache", s.url()), b"", &[]);
    }
    let before = stats(sims);
    let run = loadgen::replay(&c.label(), targets, &r.requests, CONCURRENCY);
    let after = stats(sims);
    let prompt: f64 = delta(&after, &before, "prompt_tokens").iter().sum();
    let cached: f64 = delta(&after, &before, "cached_tokens").iter().sum();
    let per_worker = delta(&after, &before, "requests");
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let max = per_worker.iter().cloned().fold(0.0, f64::max);
    let hit = if prompt > 0.0 { cached / prompt } else { 0.0 };
    let imbalance = if mean > 0.0 { max / mean } else { 0.0 };
    let load = &run.load;
    eprintln!(
        "    {}: hit {:.1}%  TTFT p50 {:.1} ms p99 {:.1} ms  imbalance {imbalance:.2}  late p50 {:.1} ms p99 {:.1} ms  {:.1} s  errors {}",
        c.label(),
        hit * 100.0,
        load.ttft_ms(0.5),
        load.ttft_ms(0.99),
        run.late_ms(0.5),
        run.late_ms(0.99),
        load.elapsed.as_secs_f64(),
        load.errors
    );
    json!({
        "workload": "trace",
        "router": c.router,
        "config": c.label(),
        "replicas": c.replicas,
        "mesh": c.mesh,
        "policy": c.policy,
        "requests_ok": load.ok,
        "errors": load.errors,
        "hit_rate": hit,
        "ttft_p50_ms": load.ttft_ms(0.5),
        "ttft_p99_ms": load.ttft_ms(0.99),
        "e2e_p50_ms": load.ms(0.5),
        "e2e_p99_ms": load.ms(0.99),
        "imbalance": imbalance,
        "requests_per_worker": per_worker,
        "lateness_p50_ms": run.late_ms(0.5),
        "lateness_p99_ms": run.late_ms(0.99),
        "lateness_max_ms": run.late_ms(1.0),
        "kept_pace": run.late_ms(0.99) <= PACE_MS,
        "followups_held": run.held,
        "seconds": load.elapsed.as_secs_f64(),
    })
}

/// Replays the trace against every configuration (`o.rounds` rounds, interleaved): rows into
/// `results`, configurations that did not start into `failures`; returns the trace's part of
/// the suite's parameters.
pub fn run(o: &Opts, bins: &PeerBins, results: &mut Vec<Value>, failures: &mut Vec<Value>) -> anyhow::Result<Value> {
    let s = Settings::of(o);
    let entries = load(&s.path, s.requests)?;
    let r = replay(&entries, s.speed_up, s.kv_capacity)?;
    let refs = r.references;
    step(&format!(
        "quality: trace ({} requests of {}, {:.0} s of trace in {:.0} s; references: ideal {:.1} %, pooled LRU {:.1} %, one worker {:.1} %)",
        entries.len(),
        s.path.display(),
        r.summary["trace_span_s"].as_f64().unwrap_or(0.0),
        r.summary["replay_span_s"].as_f64().unwrap_or(0.0),
        refs.ideal * 100.0,
        refs.pooled * 100.0,
        refs.one_worker * 100.0
    ));
    let configs = configs(o, bins);
    let cap = s.kv_capacity.to_string();
    let sims: Vec<Sim> = (0..WORKERS)
        .map(|_| Sim::start(&["--kv-capacity-tokens", &cap, "--max-running", "64"]))
        .collect::<Result<_, _>>()?;
    let workers = Workers::Regular(sims.iter().map(Sim::url).collect());
    for round in 0..o.rounds {
        if o.rounds > 1 {
            step(&format!("quality: trace round {} of {}", round + 1, o.rounds));
        }
        for c in &configs {
            match start(bins, c, &workers, o.threads) {
                Ok(running) => {
                    let mut row = measure(&r, c, &sims, &running.targets);
                    row["round"] = json!(round);
                    results.push(row);
                }
                Err(e) => {
                    eprintln!("    {} did not start: {e:#}", c.label());
                    failures.push(json!({"workload": "trace", "config": c.label(), "error": format!("{e:#}")}));
                }
            }
        }
    }
    let mut params = r.summary;
    params["file"] = json!(s.path.display().to_string());
    params["speed_up"] = json!(s.speed_up);
    params["kv_capacity_tokens"] = json!(s.kv_capacity);
    params["workers"] = json!(WORKERS);
    params["max_running"] = json!(64);
    params["concurrency"] = json!(CONCURRENCY);
    params["pace_ms"] = json!(PACE_MS);
    Ok(params)
}

/// The trace's section of the quality report: one row per configuration (means over the
/// rounds), the references under it.
pub fn markdown(doc: &Value) -> String {
    let t = &doc["params"]["trace"];
    let file = t["file"].as_str().unwrap_or("");
    let mut md = format!(
        "### trace — {} requests of `{}` ({:.0} s of trace replayed {}× faster, in {:.0} s; {} follow-up turns), {} workers of {}k KV tokens, at most {} requests in flight\n\n",
        t["requests"],
        Path::new(file).file_name().map_or(file.into(), |n| n.to_string_lossy()),
        t["trace_span_s"].as_f64().unwrap_or(f64::NAN),
        t["speed_up"],
        t["replay_span_s"].as_f64().unwrap_or(f64::NAN),
        t["followups"],
        t["workers"],
        t["kv_capacity_tokens"].as_u64().unwrap_or(0) / 1024,
        t["concurrency"],
    );
    let mut late = Vec::new();
    let rows: Vec<Vec<String>> = doc["summaries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["workload"] == "trace")
        .map(|r| {
            let v = |k: &str, d: usize| r[k].as_f64().map_or("-".into(), |x| f(x, d));
            if r["lateness_p99_ms"].as_f64().is_some_and(|l| l > PACE_MS) {
                late.push(r["config"].as_str().unwrap_or("").to_string());
            }
            vec![
                r["config"].as_str().unwrap_or("").to_string(),
                r["hit_rate"].as_f64().map_or("-".into(), |x| f(x * 100.0, 1)),
                v("ttft_p50_ms", 1),
                v("ttft_p99_ms", 1),
                v("imbalance", 2),
                format!("{} / {}", v("lateness_p50_ms", 1), v("lateness_p99_ms", 1)),
                v("errors", 0),
            ]
        })
        .collect();
    md.push_str(&table(
        &["router", "hit %", "TTFT p50 ms", "TTFT p99 ms", "imbalance", "late p50 / p99 ms", "errors"],
        &rows,
    ));
    let pct = |k: &str| t["references"][k].as_f64().map_or("-".into(), |x| f(x * 100.0, 1));
    md.push_str(&format!(
        "\nReferences (the workers' cache model, requests in trace order): ideal, infinite cache {} %; one LRU of the {} workers' pooled capacity {} %; one worker alone {} %.\n",
        pct("ideal"),
        t["workers"],
        pct("pooled_lru"),
        pct("one_worker")
    ));
    if !late.is_empty() {
        md.push_str(&format!(
            "\n**Did not keep pace** (99th-percentile lateness over {PACE_MS} ms): {}.\n",
            late.join(", ")
        ));
    }
    md.push('\n');
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ids: &[u64], input_length: u64) -> Entry {
        Entry { timestamp_ms: 0.0, input_length, output_length: 1, hash_ids: ids.to_vec() }
    }

    fn common(a: &[u8], b: &[u8]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    /// Checks every pair of `prompts` (of `entries`): they share exactly the text of their
    /// shared leading ids. Returns how many pairs share 0, 1, … 7 or more ids.
    fn check_sharing(entries: &[Entry], prompts: &[String]) -> [usize; 8] {
        let mut pairs_sharing = [0usize; 8];
        for (i, a) in entries.iter().enumerate() {
            assert_eq!(prompts[i].len(), a.input_length as usize * BYTES_PER_TOKEN);
            for (j, b) in entries.iter().enumerate().skip(i + 1) {
                let k = a.hash_ids.iter().zip(&b.hash_ids).take_while(|(x, y)| x == y).count();
                pairs_sharing[k.min(7)] += 1;
                let (pa, pb) = (prompts[i].as_bytes(), prompts[j].as_bytes());
                let shared = common(pa, pb);
                let (la, lb) = (a.hash_ids.len(), b.hash_ids.len());
                // Both go on past the k shared ids: exactly k whole chunks in common, then a
                // difference within the next token.
                if k < la && k < lb {
                    assert!(shared >= k * CHUNK_BYTES, "{a:?} {b:?}: {shared} bytes in common");
                    assert!(shared < k * CHUNK_BYTES + BYTES_PER_TOKEN, "{a:?} {b:?}: {shared} bytes in common");
                    for unit in [BYTES_PER_TOKEN, 32, PAGE_BYTES] {
                        let same = pa.chunks(unit).zip(pb.chunks(unit)).take_while(|(x, y)| x == y).count();
                        assert_eq!(same * unit, k * CHUNK_BYTES, "units of {unit} bytes: {a:?} {b:?}");
                    }
                } else {
                    // One's ids all lead the other's: the shorter prompt (up to its own cut of
                    // the last shared chunk) is all in common.
                    let last = k - 1;
                    let cut = |e: &Entry, p: &[u8]| {
                        if e.hash_ids.len() == k {
                            p.len() - last * CHUNK_BYTES
                        } else {
                            CHUNK_BYTES
                        }
                    };
                    assert_eq!(shared, last * CHUNK_BYTES + cut(a, pa).min(cut(b, pb)), "{a:?} {b:?}");
                }
            }
        }
        pairs_sharing
    }

    /// The exact prefix-sharing check: over requests drawn from a tree of ids (so many share
    /// 0, 1, 2 … leading ids) with partial last blocks, every pair's prompts share exactly the
    /// text of their shared leading ids, and not one token, kvmesh index block (32 bytes) or
    /// worker cache page (64 bytes) more.
    #[test]
    fn the_replay_preserves_prefix_sharing_exactly() {
        let mut rng = Rng::new(7);
        let mut entries = Vec::new();
        // Ids far apart and ids that are neighbours, so heads are checked for both.
        let pool: Vec<u64> = (0..40).map(|i| if i % 2 == 0 { i } else { i * 64 + (1 << 40) }).collect();
        for _ in 0..80 {
            let len = 1 + rng.below(6);
            let mut ids = Vec::new();
            for depth in 0..len {
                // A narrow tree near the root, wide below it.
                let width = [3, 2, 2].get(depth).copied().unwrap_or(pool.len());
                ids.push(pool[rng.below(width)] + depth as u64 * 1000);
            }
            let input = (len as u64 - 1) * BLOCK_TOKENS + 1 + rng.below(BLOCK_TOKENS as usize) as u64;
            entries.push(entry(&ids, input));
        }
        let mut texts = Texts::default();
        let prompts: Vec<String> = entries.iter().map(|e| texts.prompt(e).unwrap()).collect();
        let pairs_sharing = check_sharing(&entries, &prompts);
        assert!(pairs_sharing[..4].iter().all(|&n| n > 20), "pairs sharing 0, 1, 2 and 3 ids: {pairs_sharing:?}");
        // The same ids give the same text again, and every head is a different one.
        assert_eq!(texts.prompt(&entries[5]).unwrap(), prompts[5]);
        let mut value = [0usize; 256];
        for (v, &c) in ALPHABET.iter().enumerate() {
            value[c as usize] = v;
        }
        let mut seen = vec![false; MAX_IDS];
        for n in 0..MAX_IDS as u32 {
            let h = head(n).iter().fold(0, |acc, &c| acc * 64 + value[c as usize]);
            assert!(!std::mem::replace(&mut seen[h], true), "head {n} repeats another");
        }
    }

    #[test]
    fn a_malformed_line_is_refused_with_its_line_number_and_field() {
        let good = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;
        let cases = [
            (r#"{"timestamp": 5, "input_length": 600, "output_length": 5}"#, "`hash_ids` is missing"),
            (r#"{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}"#, "`hash_ids[1]`"),
            (r#"{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": []}"#, "`hash_ids`"),
            (r#"{"timestamp": "x", "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#, "`timestamp`"),
            (r#"{"timestamp": 5, "input_length": 0, "output_length": 5, "hash_ids": [1]}"#, "`input_length`"),
            (r#"{"timestamp": 5, "input_length": 600, "output_length": 1.5, "hash_ids": [1, 2]}"#, "`output_length`"),
            (
                r#"{"timestamp": 5, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2]}"#,
                "`input_length` 2000",
            ),
            (
                r#"{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}"#,
                "`input_length` 600",
            ),
            (r#"{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#, "`timestamp`"),
            (r#"{"timestamp": 5, "input_length": 600"#, "not JSON"),
            ("[1, 2]", "not a JSON object"),
        ];
        for (bad, what) in cases {
            let trace = format!("{good}\n\n{bad}\n{good}\n");
            let e = format!("{:#}", parse(&trace, 0).unwrap_err());
            assert!(e.contains("line 3") && e.contains(what), "{bad}: {e}");
        }
        let backwards = format!("{}\n{good}\n", good.replace("\"timestamp\": 0", "\"timestamp\": 9"));
        let e = format!("{:#}", parse(&backwards, 0).unwrap_err());
        assert!(e.contains("line 2: `timestamp` 0 is before line 1's 9"), "{e}");
        // A bad line past the first N is refused too; the first N are kept.
        let late = format!("{good}\n{good}\n{}\n", cases[0].0);
        assert!(format!("{:#}", parse(&late, 1).unwrap_err()).contains("line 3"));
        assert_eq!(parse(&format!("{good}\n{good}\n"), 1).unwrap().len(), 1);
        assert!(parse("\n", 0).is_err(), "no requests");
    }

    #[test]
    fn a_follow_up_turn_waits_for_the_turn_it_extends_and_shared_prompts_do_not() {
        let entries = [
            entry(&[1, 2, 3], 1300),    // a conversation's first turn: 2 whole blocks
            entry(&[1, 2, 4], 1400),    // its second turn (same whole blocks, longer)
            entry(&[1, 2, 4, 5], 1700), // its third
            entry(&[1, 2, 9], 1100),    // shorter: another question on the same document
            entry(&[7], 300),
            entry(&[7, 8], 700), // only a partial block before: nothing to extend
        ];
        assert_eq!(followups(&entries), [None, Some(0), Some(1), None, None, None]);
    }

    #[test]
    fn the_references_follow_the_workers_cache_model() {
        let a = "a".repeat(6400); // 100 pages, 1,600 tokens
        let b = "b".repeat(6400);
        let prompts: Vec<&[u8]> = vec![a.as_bytes(), b.as_bytes(), a.as_bytes()];
        let r = references(&prompts, 1600, 2);
        assert_eq!(r.ideal, 1.0 / 3.0, "the third request hits entirely");
        assert_eq!(r.pooled, 1.0 / 3.0, "two prompts fit in the pooled capacity");
        assert_eq!(r.one_worker, 0.0, "one worker holds only the last prompt");
    }

    #[test]
    fn the_synthetic_trace_loads_and_keeps_its_sharing() {
        // The trace ships in the workplace's shared/ beside the repository (CI has it too): a
        // missing one is a failure, not a pass.
        let path = default_file();
        assert!(path.is_file(), "{}: the benchmark's trace is missing (shared/data/mooncake)", path.display());
        let entries = load(&path, 0).unwrap();
        assert_eq!(entries.len(), 3993);
        let mut texts = Texts::default();
        let prompts: Vec<String> = entries[..300].iter().map(|e| texts.prompt(e).unwrap()).collect();
        let pairs = check_sharing(&entries[..300], &prompts);
        assert!(pairs[1..].iter().sum::<usize>() > 10, "pairs sharing ids in the first 300: {pairs:?}");
        let r = replay(&entries[..300], 10.0, 1 << 20).unwrap();
        assert!(r.references.ideal >= r.references.pooled && r.references.pooled >= r.references.one_worker);
        assert_eq!(r.requests.len(), 300);
    }
}
