//! The engines' own KV events, end to end (real kvmesh-cp, Envoy with the real filter, sims
//! publishing as engines do: vLLM's tagged maps on one, SGLang's positional form on another,
//! none on the third). One stack for every case:
//!
//! - bypass: prompts and chats sent straight to a worker (not through a gateway) are routed
//!   there afterwards, because its engine said it holds them (chats laid out by the model's
//!   chat template);
//! - flush and restart: the worker's entries go as soon as its engine says so (a clear, a
//!   sequence that starts again in place, or a new process on the same ports);
//! - a gap: a batch lost on the PUB socket is fetched from the replay socket;
//! - a mixed pool: the worker without events is still routed to by the gateways' own index.

use std::time::Duration;

use kvmesh_testkit::e2e::{gateway, generate, served, sync};
use kvmesh_testkit::{free_port, http, repo_root, wait_until, ControlPlane, Sim};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(15);

struct Publisher {
    sim: Sim,
    pub_port: u16,
    replay_port: u16,
}

fn tokenizer() -> String {
    repo_root().join("sim/data/tokenizer.json").to_string_lossy().into_owned()
}

fn publisher(encoding: &str) -> Publisher {
    publisher_on(free_port().unwrap(), free_port().unwrap(), free_port().unwrap(), encoding)
}

fn publisher_on(port: u16, pub_port: u16, replay_port: u16, encoding: &str) -> Publisher {
    let (p, r) = (pub_port.to_string(), replay_port.to_string());
    let tok = tokenizer();
    let args = [
        "--time-scale",
        "0",
        "--tokenizer",
        &tok,
        "--kv-events-port",
        &p,
        "--kv-events-replay-port",
        &r,
        "--kv-events-encoding",
        encoding,
    ];
    Publisher { sim: Sim::start_on(port, &args).unwrap(), pub_port, replay_port }
}

impl Publisher {
    fn flag(&self) -> String {
        format!("{}=tcp://127.0.0.1:{},tcp://127.0.0.1:{}", self.sim.url(), self.pub_port, self.replay_port)
    }
    /// The engine restarted as a new process on the same ports.
    fn restart(self, encoding: &str) -> Publisher {
        let (port, pub_port, replay_port) = (self.sim.port, self.pub_port, self.replay_port);
        drop(self);
        publisher_on(port, pub_port, replay_port, encoding)
    }
    /// A generation sent straight to the worker (bypassing every gateway).
    fn direct(&self, text: &str) {
        let r = http::post_json(&format!("{}/generate", self.sim.url()), &json!({"text": text})).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    fn post(&self, path: &str) {
        let r = http::post(&format!("{}{path}", self.sim.url()), b"{}", &[]).unwrap();
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
}

/// `/match` of `text` for worker `url`: (blocks, source).
fn entry(cp: &ControlPlane, url: &str, text: &str) -> Option<(u64, String)> {
    let m: Value = cp.match_text(text.as_bytes()).unwrap();
    m.as_array()?
        .iter()
        .find(|e| e["url"] == url)
        .map(|e| (e["blocks"].as_u64().unwrap_or(0), e["source"].as_str().unwrap_or("").to_string()))
}

fn wait_engine_holds(cp: &ControlPlane, url: &str, text: &str) {
    wait_until(&format!("{url}'s engine events to reach the index"), LIMIT, || {
        entry(cp, url, text).is_some_and(|(b, s)| b >= 4 && s == "kv-events")
    })
    .unwrap();
}

fn wait_gone(cp: &ControlPlane, url: &str, text: &str) {
    wait_until(&format!("{url}'s entries to go"), LIMIT, || entry(cp, url, text).is_none()).unwrap();
}

/// A prompt of about 700 bytes, distinct from every other `tag`.
fn prompt(tag: &str) -> String {
    format!(
        "{tag}: You are a helpful assistant. Answer the question below using the documents provided. {}",
        "The quick brown fox jumps over the lazy dog. ".repeat(14)
    )
}

#[test]
fn engine_events_route_bypass_traffic_and_drop_flushed_restarted_and_removed_caches() {
    let a = publisher("vllm-tagged");
    let b = publisher("sglang");
    let c = Sim::start(&["--time-scale", "0"]).unwrap();
    let tok = tokenizer();
    let (fa, fb) = (a.flag(), b.flag());
    let urls = [a.sim.url(), b.sim.url(), c.url()];
    let cp = ControlPlane::start(&[
        "--worker-urls",
        &urls[0],
        &urls[1],
        &urls[2],
        "--kv-events-worker",
        &fa,
        "--kv-events-worker",
        &fb,
        "--kv-events-tokenizer",
        &tok,
    ])
    .unwrap();
    let envoy = gateway(&cp);
    let (ua, ub) = (a.sim.url(), b.sim.url());

    // Bypass: three prompts sent straight to B are routed to B (1/27 by chance without events).
    for i in 0..3 {
        let p = prompt(&format!("bypass {i}"));
        b.direct(&p);
        wait_engine_holds(&cp, &ub, &p);
        sync(&cp, &envoy);
        assert_eq!(served(&generate(&envoy, &p)), b.sim.addr(), "bypass prompt {i}");
    }
    // Chats: kvmesh-cp lays them out as the model's chat template does (sim/data's
    // tokenizer_config.json), so a conversation held by B's engine is routed there too.
    for i in 0..3 {
        let content = prompt(&format!("chat {i}"));
        let body = json!({"model": "kvmesh-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 1});
        let r = http::post_json(&format!("{}/v1/chat/completions", b.sim.url()), &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        wait_engine_holds(&cp, &ub, &format!("<|user|>\n{content}\n"));
        sync(&cp, &envoy);
        assert_eq!(
            served(&http::post_json(&envoy.url("/v1/chat/completions"), &body).unwrap()),
            b.sim.addr(),
            "chat {i}"
        );
    }
    // The same through the other encoding.
    let pa = prompt("bypass on A");
    a.direct(&pa);
    wait_engine_holds(&cp, &ua, &pa);
    sync(&cp, &envoy);
    assert_eq!(served(&generate(&envoy, &pa)), a.sim.addr());

    // Flush: B's entries go (whatever put them there, the gateway's routing included).
    let flushed = prompt("bypass 0");
    b.post("/flush_cache");
    wait_gone(&cp, &ub, &flushed);

    // Restart: the sequence starts again; the next batch drops what B held before.
    let before = prompt("before restart");
    let after = prompt("after restart");
    b.direct(&before);
    wait_engine_holds(&cp, &ub, &before);
    b.post("/sim/restart");
    b.direct(&after);
    wait_engine_holds(&cp, &ub, &after);
    wait_gone(&cp, &ub, &before);
    assert!(cp.worker_metric("kvmesh_kv_events_restarts_total", &ub) >= Some(1.0));

    // A gap: the batch of `lost` never reaches the subscriber; the next one reveals the gap and
    // the replay socket brings it back.
    let lost = prompt("lost on the PUB socket");
    a.post("/sim/kv_events/drop_next");
    a.direct(&lost);
    a.direct(&prompt("after the gap"));
    wait_engine_holds(&cp, &ua, &lost);
    assert!(cp.worker_metric("kvmesh_kv_events_gaps_total", &ua) >= Some(1.0));
    assert!(cp.worker_metric("kvmesh_kv_events_replays_total", &ua) >= Some(2.0), "on connect and for the gap");
    assert!(cp.worker_metric("kvmesh_kv_events_applied_total", &ua) >= Some(3.0));

    // A mixed pool: C publishes nothing; a prompt the gateway sent there goes there again,
    // from the gateways' own index.
    let on_c = (0..30)
        .map(|i| prompt(&format!("mixed {i}")))
        .find(|p| served(&generate(&envoy, p)) == c.addr())
        .expect("some prompt lands on the worker without events");
    wait_until("the gateway's report of C's prefix", LIMIT, || entry(&cp, &c.url(), &on_c).is_some()).unwrap();
    assert_eq!(entry(&cp, &c.url(), &on_c).map(|e| e.1).as_deref(), Some("routed"));
    assert_eq!(served(&generate(&envoy, &on_c)), c.addr());

    // A restarted as a new process on the same ports: the subscriber sees the publisher go,
    // drops what A held, connects again and follows the new process.
    let old = prompt("before the new process");
    a.direct(&old);
    wait_engine_holds(&cp, &ua, &old);
    let a = a.restart("vllm-tagged");
    let fresh = prompt("from the new process");
    a.direct(&fresh);
    wait_engine_holds(&cp, &ua, &fresh);
    wait_gone(&cp, &ua, &old);

    // Removing B drops its entries at once.
    let kept = prompt("held when removed");
    b.direct(&kept);
    wait_engine_holds(&cp, &ub, &kept);
    assert_eq!(cp.post(&format!("/remove_worker?url={ub}")).unwrap().status, 200);
    wait_gone(&cp, &ub, &kept);
}
