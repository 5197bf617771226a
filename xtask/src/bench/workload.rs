//! The quality suite's request streams, generated from a seed (the same stream for every
//! router): `/v1/chat/completions` with `stream: true` (time to first token is the first
//! event), 8 output tokens. The simulated workers count 4 bytes of prompt as a token.

use serde_json::json;

use crate::loadgen;

/// SplitMix64: small, seeded, the same on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const WORDS: &[&str] = &[
    "model", "cache", "prefix", "token", "router", "worker", "kernel", "matrix", "vector", "tensor", "graph", "query",
    "answer", "system", "policy", "memory", "latency", "request", "stream", "batch", "layer", "weight", "signal",
    "review", "summary", "account", "invoice", "contract", "ticket", "support", "travel", "recipe", "garden",
    "history", "science", "music", "poem", "story", "letter", "report",
];

/// About `bytes` bytes of words.
pub fn text(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push(' ');
    }
    s
}

/// A streamed chat request; `session` goes in `x-session-id`, the routing key
/// `consistent_hashing` reads by default (the other routers and policies ignore it).
fn chat(session: &str, messages: &[(&str, String)]) -> Vec<u8> {
    let messages: Vec<_> = messages.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    // `include_usage`: the last event carries the usage (cached tokens included), as clients
    // that bill or meter ask for; it changes nothing in the routing.
    let body = json!({
        "model": "kvmesh-sim", "messages": messages, "max_tokens": 8, "stream": true,
        "stream_options": {"include_usage": true},
    });
    loadgen::post_with("/v1/chat/completions", &body.to_string(), &[("x-session-id", session)])
}

/// A workload: its name, what it is, the request stream, and the KV capacity per worker (in
/// simulated tokens) it is meant for.
pub struct Workload {
    pub name: &'static str,
    pub what: &'static str,
    pub requests: Vec<Vec<u8>>,
    pub kv_capacity_tokens: u64,
    /// The first worker's `--slowdown` (heterogeneous workers), if any.
    pub slow_worker: Option<f64>,
}

impl Workload {
    /// The distinct sessions (`x-session-id`) among the requests.
    pub fn sessions(&self) -> usize {
        let mut ids: Vec<&[u8]> = self.requests.iter().filter_map(|r| session_of(r)).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// The `x-session-id` header's value in a raw request.
fn session_of(request: &[u8]) -> Option<&[u8]> {
    const NAME: &[u8] = b"\r\nx-session-id: ";
    let at = request.windows(NAME.len()).position(|w| w == NAME)? + NAME.len();
    let rest = request.get(at..)?;
    rest.get(..rest.iter().position(|&b| b == b'\r')?)
}

/// Every workload, `n` requests each (about), from `seed`.
pub fn all(seed: u64, n: usize) -> Vec<Workload> {
    vec![
        shared_prompts(seed, n),
        multi_turn(seed, n),
        zipf(seed, n),
        random(seed, n),
        tight(seed, n),
        heterogeneous(seed, n),
    ]
}

/// Many users sharing a few long system prompts (8 prompts of ~2000 tokens), each with a
/// question of their own.
fn shared_prompts(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 1);
    let systems: Vec<String> = (0..8).map(|i| format!("You are assistant {i}. {}", text(&mut rng, 8000))).collect();
    let requests = (0..n)
        .map(|_| {
            let s = rng.below(systems.len());
            chat(&format!("prompt-{s}"), &[("system", systems[s].clone()), ("user", text(&mut rng, 200))])
        })
        .collect();
    Workload {
        name: "shared_prompts",
        what: "8 system prompts of ~2000 tokens shared by all users, a ~50-token question each",
        requests,
        kv_capacity_tokens: 262_144,
        slow_worker: None,
    }
}

/// Multi-turn chats that grow: conversations of up to 8 turns (each turn adds a ~100-token
/// question and the previous answer), interleaved: round r sends turn r of every live
/// conversation, in a shuffled order.
pub fn multi_turn(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 2);
    let turns = 8;
    let conversations = n.div_ceil(turns).max(1);
    let mut history: Vec<Vec<(&str, String)>> =
        (0..conversations).map(|c| vec![("system", format!("Conversation {c}. {}", text(&mut rng, 1600)))]).collect();
    let mut requests = Vec::with_capacity(n);
    for _ in 0..turns {
        let mut order: Vec<usize> = (0..conversations).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        for c in order {
            if requests.len() == n {
                break;
            }
            history[c].push(("user", text(&mut rng, 400)));
            requests.push(chat(&format!("conversation-{c}"), &history[c]));
            history[c].push(("assistant", text(&mut rng, 32)));
        }
    }
    Workload {
        name: "multi_turn",
        what: "chats of up to 8 turns growing by ~100 tokens a turn, interleaved across conversations",
        requests,
        kv_capacity_tokens: 262_144,
        slow_worker: None,
    }
}

/// A Zipf-popular prompt mix: 256 prompts of ~1000 tokens, prompt k drawn with weight
/// 1/k^1.1, each with a short suffix of its own.
fn zipf(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 3);
    let prompts: Vec<String> = (0..256).map(|i| format!("Document {i}. {}", text(&mut rng, 4000))).collect();
    let weights: Vec<f64> = (1..=prompts.len()).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let requests = (0..n)
        .map(|_| {
            let mut x = rng.unit() * total;
            let k = weights.iter().position(|w| {
                x -= w;
                x <= 0.0
            });
            let k = k.unwrap_or(prompts.len() - 1);
            chat(&format!("document-{k}"), &[("user", format!("{}\nQuestion: {}", prompts[k], text(&mut rng, 80)))])
        })
        .collect();
    Workload {
        name: "zipf",
        what: "256 prompts of ~1000 tokens with Zipf(1.1) popularity, a short suffix each",
        requests,
        kv_capacity_tokens: 262_144,
        slow_worker: None,
    }
}

/// Random prompts of ~1000 tokens, nothing shared: the control (no router can hit).
fn random(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 4);
    let requests = (0..n).map(|i| chat(&format!("request-{i}"), &[("user", text(&mut rng, 4000))])).collect();
    Workload {
        name: "random",
        what: "random ~1000-token prompts, nothing shared (control)",
        requests,
        kv_capacity_tokens: 262_144,
        slow_worker: None,
    }
}

/// Tight capacity: 24 system prompts of ~2000 tokens (48k tokens) on workers that hold 16k
/// tokens each (64k in all): the prompts fit only when a router partitions them across
/// workers; one that spreads every prompt everywhere keeps evicting.
fn tight(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 5);
    let systems: Vec<String> = (0..24).map(|i| format!("You are agent {i}. {}", text(&mut rng, 8000))).collect();
    let requests = (0..n)
        .map(|_| {
            let s = rng.below(systems.len());
            chat(&format!("agent-{s}"), &[("system", systems[s].clone()), ("user", text(&mut rng, 200))])
        })
        .collect();
    Workload {
        name: "tight_capacity",
        what: "24 system prompts of ~2000 tokens on workers holding 16k tokens each",
        requests,
        kv_capacity_tokens: 16_384,
        slow_worker: None,
    }
}

/// Heterogeneous workers: the multi-turn chats of [`multi_turn`] (shorter: 4 turns) on four
/// workers of which one is four times slower (`--slowdown 4`), as a node with an older GPU
/// or a noisy neighbour would be. Load-aware policies should send it less.
fn heterogeneous(seed: u64, n: usize) -> Workload {
    let mut rng = Rng::new(seed ^ 6);
    let turns = 4;
    let conversations = n.div_ceil(turns).max(1);
    let mut history: Vec<Vec<(&str, String)>> =
        (0..conversations).map(|c| vec![("system", format!("Chat {c}. {}", text(&mut rng, 2000)))]).collect();
    let mut requests = Vec::with_capacity(n);
    for _ in 0..turns {
        for (c, h) in history.iter_mut().enumerate() {
            if requests.len() == n {
                break;
            }
            h.push(("user", text(&mut rng, 300)));
            requests.push(chat(&format!("chat-{c}"), h));
            h.push(("assistant", text(&mut rng, 32)));
        }
    }
    Workload {
        name: "heterogeneous",
        what: "4-turn chats on 4 workers, one of them 4x slower (--slowdown 4)",
        requests,
        kv_capacity_tokens: 262_144,
        slow_worker: Some(4.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workload_has_its_requests_and_a_session_key_and_one_has_a_slow_worker() {
        let all = all(7, 40);
        let names: Vec<&str> = all.iter().map(|w| w.name).collect();
        assert_eq!(names, ["shared_prompts", "multi_turn", "zipf", "random", "tight_capacity", "heterogeneous"]);
        for w in &all {
            assert_eq!(w.requests.len(), 40, "{}", w.name);
            let first = String::from_utf8_lossy(&w.requests[0]).to_string();
            assert!(first.contains("\r\nx-session-id: "), "{}: {first:.200}", w.name);
            assert!(w.sessions() > 1 && w.sessions() <= w.requests.len(), "{}: {} sessions", w.name, w.sessions());
        }
        let slow: Vec<_> = all.iter().filter_map(|w| w.slow_worker.map(|f| (w.name, f))).collect();
        assert_eq!(slow, [("heterogeneous", 4.0)]);
        // A conversation keeps its key from turn to turn.
        let h = &all[5];
        let key = |r: &[u8]| {
            let t = String::from_utf8_lossy(r).to_string();
            t.split("x-session-id: ").nth(1).and_then(|r| r.split("\r\n").next()).map(String::from)
        };
        assert_eq!(key(&h.requests[0]), key(&h.requests[10]), "10 chats: request 10 is chat 0's second turn");
    }
}
