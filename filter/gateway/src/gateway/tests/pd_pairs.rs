//! PD pairs from the control plane's table: per-worker protocols (a pod's
//! `kvmesh.io/pd-protocol`) and workers of role `both`.

use std::collections::HashSet;

use super::*;
use crate::gateway::{Outcome, PrefillLeg, RequestInfo};
use crate::shared::fake::FakeStore;
use kvmesh_core::Endpoint;

/// A PD gateway whose workers come from the control plane; the deployment speaks `protocol`.
fn pd_gateway(store: &FakeStore, protocol: &str) -> Gateway {
    let json = format!(
        r#"{{"control_plane_cluster":"cp","pd_disaggregation":true,"prefill":[],"decode":[],
            "pd_protocol":"{protocol}","decode_policy":"round_robin","prefill_policy":"round_robin"}}"#
    );
    Gateway::new(kvmesh_core::Config::from_json(json.as_bytes()).unwrap(), store, 7)
}

fn worker(id: u32, role: proto::Role, protocol: Option<proto::PdProtocol>) -> proto::Worker {
    proto::Worker {
        id,
        url: format!("http://127.0.0.1:{}", 20000 + id),
        role: role as i32,
        healthy: true,
        pd_protocol: protocol.map(|p| p as i32),
        ..Default::default()
    }
}

fn table(g: &mut Gateway, store: &FakeStore, version: u64, workers: Vec<proto::Worker>) {
    let snapshot = proto::Snapshot { version, full: true, workers, workers_changed: true, ..Default::default() };
    g.apply_snapshot(store, &snapshot);
}

fn port(addr: &str) -> u32 {
    addr.rsplit(':').next().and_then(|p| p.parse::<u32>().ok()).map_or(0, |p| p - 20000)
}

/// What one decision was, its workers by id: (decode, the prefill and how its leg runs if
/// split, the fallbacks).
type Pair = (u32, Option<(u32, &'static str)>, Vec<u32>);

/// Decides one request (and commits it): the pair, or the local reply's status and body.
fn decide(g: &mut Gateway, store: &FakeStore, body: &str) -> Result<Pair, (u16, String)> {
    match g.route_request(store, Endpoint::Completions, body.as_bytes(), &RequestInfo::default()) {
        Outcome::Route(p) => {
            let fallbacks = p.fallbacks().iter().map(|a| port(a)).collect();
            let leg = |l: &PrefillLeg| l.protocol().name();
            let prefill = p.pd().map(|pd| (port(&pd.prefill.addr), leg(&pd.leg)));
            let decode = port(p.addr());
            g.commit(store, p);
            Ok((decode, prefill, fallbacks))
        }
        Outcome::Reply(r) => Err((r.status, String::from_utf8_lossy(&r.body).into_owned())),
    }
}

fn completion(i: usize) -> String {
    format!(r#"{{"model":"m","prompt":"request {i} with a prompt long enough to fill a block or two"}}"#)
}

/// A prefill and a decode worker pair only when they speak the same protocol (a worker's own,
/// else the deployment's), and the plan is that protocol's; Envoy fails over only to decode
/// workers speaking it; a decode worker nobody speaks to takes no request, and with no pair at
/// all the request is the JSON 503.
#[test]
fn pairs_speak_one_protocol_and_the_plan_is_theirs() {
    use proto::{PdProtocol as P, Role as R};
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "sglang");
    let (vllm, llm_d) = (Some(P::Vllm), Some(P::LlmD));
    table(
        &mut g,
        &store,
        1,
        vec![
            worker(1, R::Prefill, None),
            worker(2, R::Prefill, vllm),
            worker(3, R::Prefill, llm_d),
            worker(4, R::Decode, None),
            worker(5, R::Decode, Some(P::Sglang)),
            worker(6, R::Decode, vllm),
            worker(7, R::Decode, llm_d),
        ],
    );
    let protocol_of = |id: u32| match id {
        1 | 4 | 5 => "sglang",
        2 | 6 => "vllm",
        _ => "llm-d",
    };
    let mut decodes = HashSet::new();
    for i in 0..24 {
        let (decode, prefill, fallbacks) = decide(&mut g, &store, &completion(i)).unwrap();
        let (prefill, leg) = prefill.expect("always split");
        assert_eq!(protocol_of(prefill), protocol_of(decode), "request {i}: {prefill} with {decode}");
        assert_eq!(leg, protocol_of(decode), "request {i}: the pair's protocol runs the leg");
        assert!(fallbacks.iter().all(|f| protocol_of(*f) == protocol_of(decode) && *f != decode), "{fallbacks:?}");
        decodes.insert(decode);
    }
    assert_eq!(decodes, HashSet::from([4, 5, 6, 7]), "every decode worker has a partner");

    // Without vLLM's prefill worker, its decode worker takes nothing; the others go on.
    let without = |gone: &[u32]| {
        let all = [
            (1, R::Prefill, None),
            (2, R::Prefill, vllm),
            (3, R::Prefill, llm_d),
            (4, R::Decode, None),
            (6, R::Decode, vllm),
            (7, R::Decode, llm_d),
        ];
        all.iter().filter(|w| !gone.contains(&w.0)).map(|&(id, role, p)| worker(id, role, p)).collect::<Vec<_>>()
    };
    table(&mut g, &store, 2, without(&[2]));
    for i in 0..12 {
        let (decode, prefill, _) = decide(&mut g, &store, &completion(100 + i)).unwrap();
        assert_ne!(decode, 6, "vLLM's decode worker has no vLLM prefill worker");
        assert_eq!(prefill.map(|p| protocol_of(p.0)), Some(protocol_of(decode)));
    }
    // Only decode workers whose protocol no prefill worker speaks: no pair, the JSON 503.
    table(&mut g, &store, 3, without(&[1, 2, 7]));
    let (status, body) = decide(&mut g, &store, &completion(200)).unwrap_err();
    assert_eq!(status, 503, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "no_healthy_worker", "{body}");
    assert!(body.contains("PD protocol"), "{body}");
}

/// llm-d's `both`: such a worker is a prefill worker for some requests and a decode worker
/// for others, never both for one; alone (nobody else to pair with) it runs requests by
/// itself.
#[test]
fn a_both_worker_serves_either_role_and_runs_alone_without_a_partner() {
    use proto::Role as R;
    let store = FakeStore::default();
    let mut g = pd_gateway(&store, "llm-d");
    table(&mut g, &store, 1, vec![worker(1, R::Both, None), worker(2, R::Both, None), worker(3, R::Decode, None)]);
    let (mut as_prefill, mut as_decode) = (HashSet::new(), HashSet::new());
    for i in 0..12 {
        let (decode, prefill, fallbacks) = decide(&mut g, &store, &completion(i)).unwrap();
        let (prefill, leg) = prefill.expect("always split while there is a partner");
        assert_ne!(prefill, decode, "request {i}: never its own prefill worker");
        assert_eq!(leg, "llm-d");
        assert!(!fallbacks.contains(&prefill), "the prefill pod is not a decode fallback: {fallbacks:?}");
        as_prefill.insert(prefill);
        as_decode.insert(decode);
    }
    assert_eq!(as_prefill, HashSet::from([1, 2]), "a decode-only worker never prefills");
    assert_eq!(as_decode, HashSet::from([1, 2, 3]));

    // One `both` worker alone: it runs every request itself (no 503, no prefill leg).
    table(&mut g, &store, 2, vec![worker(1, R::Both, None)]);
    for i in 0..3 {
        assert_eq!(decide(&mut g, &store, &completion(50 + i)), Ok((1, None, vec![])));
    }
    // A client's transfer parameters are refused even when nothing is split.
    let forged = r#"{"model":"m","prompt":"x","kv_transfer_params":{"remote_host":"10.6.6.6"}}"#;
    let (status, body) = decide(&mut g, &store, forged).unwrap_err();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("kv_transfer_params"), "{body}");
}
