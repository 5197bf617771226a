//! Many models behind one gateway: pools by `model`, the index keyed by model, and the
//! gateway's own `/v1/models`.

use super::*;
use crate::gateway::{Outcome, RequestInfo};
use crate::shared::fake::FakeStore;
use kvmesh_core::Endpoint;

fn gateway(store: &FakeStore, seed: u64, settings: &str) -> Gateway {
    let json = format!(r#"{{"control_plane_cluster":"cp","worker_urls":["http://127.0.0.1:1"]{settings}}}"#);
    let mut g = Gateway::new(kvmesh_core::Config::from_json(json.as_bytes()).unwrap(), store, seed);
    g.publisher().set_reporting(true);
    g
}

fn served(id: &str, parent: &str) -> proto::ServedModel {
    proto::ServedModel { id: id.into(), parent: parent.into(), owned_by: "vllm".into() }
}

fn worker(id: u32, port: u16, healthy: bool, models: Vec<proto::ServedModel>) -> proto::Worker {
    proto::Worker { id, url: format!("http://127.0.0.1:{port}"), healthy, models, ..Default::default() }
}

/// Workers 20 and 21 serve `a` (21 with adapter `a-sql` loaded), 22 and 23 `b` (23 unhealthy).
fn two_models() -> proto::Snapshot {
    proto::Snapshot {
        version: 1,
        full: true,
        workers: vec![
            worker(10, 20, true, vec![served("a", "")]),
            worker(11, 21, true, vec![served("a", ""), served("a-sql", "a")]),
            worker(12, 22, true, vec![served("b", "")]),
            worker(13, 23, false, vec![served("b", ""), served("b-old", "b")]),
        ],
        workers_changed: true,
        ..Default::default()
    }
}

/// Routes a chat request for `model` (none: no `model` field); the worker's address and the
/// bytes of the prompt it was believed to hold, or the reply's status and body.
fn route(
    g: &mut Gateway,
    store: &FakeStore,
    model: Option<&str>,
    text: &str,
) -> Result<(String, usize), (u16, String)> {
    let model = model.map_or(String::new(), |m| format!(r#""model":"{m}","#));
    let body = format!(r#"{{{model}"messages":[{{"role":"user","content":"{text}"}}]}}"#);
    match g.route_request(store, Endpoint::ChatCompletions, body.as_bytes(), &RequestInfo::default()) {
        Outcome::Route(plan) => {
            let main = g.commit(store, plan).main;
            crate::shared::Inflight::finish(store, main.worker, false);
            Ok((main.addr, main.matched_bytes))
        }
        Outcome::Reply(r) => Err((r.status, String::from_utf8_lossy(&r.body).into_owned())),
    }
}

#[test]
fn every_request_goes_to_a_worker_serving_its_model_on_every_vm() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1, ""), gateway(&store, 2, r#","policy":"random""#));
    owner.apply_snapshot(&store, &two_models());
    for g in [&mut owner, &mut other] {
        for i in 0..40 {
            let text = format!("prompt {i}");
            let a = route(g, &store, Some("a"), &text).unwrap().0;
            assert!(a == "127.0.0.1:20" || a == "127.0.0.1:21", "model a on {a}");
            assert_eq!(route(g, &store, Some("a-sql"), &text).unwrap().0, "127.0.0.1:21", "the adapter's worker");
            assert_eq!(route(g, &store, Some("b"), &text).unwrap().0, "127.0.0.1:22", "b's healthy worker");
        }
        let (status, body) = route(g, &store, Some("gpt-4"), "x").unwrap_err();
        assert_eq!(status, 404);
        assert!(body.contains(r#""code":"model_not_found""#) && body.contains("`gpt-4`"), "{body}");
        let (status, body) = route(g, &store, None, "x").unwrap_err();
        assert_eq!(status, 400, "several models and none named: {body}");
        // Known, but its only worker is down: no worker, not an unknown model.
        assert_eq!(route(g, &store, Some("b-old"), "x").unwrap_err().0, 503);
    }
}

#[test]
fn a_prompt_cached_for_one_model_is_no_hit_for_another() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1, r#","cache_threshold":0.1"#);
    let mut snap = two_models();
    // Both models on both workers (servers of several models, each with its cache, as
    // Ollama's): only the index's keys tell them apart.
    for w in &mut snap.workers {
        let own = |id: &str| proto::ServedModel { owned_by: "library".into(), ..served(id, "") };
        w.models = vec![own("a"), own("b")];
        w.healthy = true;
    }
    g.apply_snapshot(&store, &snap);
    let text = "a long shared system prompt, the same for both models ".repeat(8);
    let (first, held) = route(&mut g, &store, Some("a"), &text).unwrap();
    assert_eq!(held, 0);
    let (again, held) = route(&mut g, &store, Some("a"), &text).unwrap();
    assert_eq!(again, first, "the same model comes back to its cache");
    assert!(held > 100, "held {held}");
    let (_, held_b) = route(&mut g, &store, Some("b"), &text).unwrap();
    assert_eq!(held_b, 0, "model b never had this prompt");
}

#[test]
fn one_model_under_one_name_takes_any_name_as_sglang_router_does() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1, "");
    let mut snap = two_models();
    snap.workers.truncate(1);
    g.apply_snapshot(&store, &snap);
    assert_eq!(route(&mut g, &store, Some("default"), "x").unwrap().0, "127.0.0.1:20");
    assert_eq!(route(&mut g, &store, None, "x").unwrap().0, "127.0.0.1:20");
    // With --enable-igw the name must be served; an alias names it.
    let mut igw = gateway(&store, 2, r#","enable_igw":true,"model_alias":["llama=a"]"#);
    igw.apply_snapshot(&store, &snap);
    assert_eq!(route(&mut igw, &store, Some("default"), "x").unwrap_err().0, 404);
    assert_eq!(route(&mut igw, &store, Some("llama"), "x").unwrap().0, "127.0.0.1:20");
    assert_eq!(route(&mut igw, &store, None, "x").unwrap().0, "127.0.0.1:20", "the one model is the default");
}

#[test]
fn the_gateway_lists_the_healthy_workers_models_itself() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1, "");
    assert_eq!(g.models_reply(&store, "/v1/models"), None, "no names known: a worker answers");
    g.apply_snapshot(&store, &two_models());
    let list = g.models_reply(&store, "/v1/models?x=1").unwrap();
    assert_eq!(list.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&list.body).unwrap();
    let cards: Vec<(String, serde_json::Value)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap().to_string(), c["parent"].clone()))
        .collect();
    assert_eq!(
        cards,
        vec![
            ("a".into(), serde_json::Value::Null),
            ("a-sql".into(), "a".into()),
            ("b".into(), serde_json::Value::Null)
        ],
        "the union over healthy workers, once each (b-old's only worker is down)"
    );
    assert_eq!(v["object"], "list");
    let card: serde_json::Value =
        serde_json::from_slice(&g.models_reply(&store, "/v1/models/a-sql").unwrap().body).unwrap();
    assert_eq!(
        (card["id"].as_str(), card["parent"].as_str(), card["owned_by"].as_str()),
        (Some("a-sql"), Some("a"), Some("vllm"))
    );
    assert_eq!(g.models_reply(&store, "/v1/models/b-old").unwrap().status, 404);
    assert_eq!(g.models_reply(&store, "/health"), None);
    assert_eq!(g.models_reply(&store, "/v1/modelsx"), None);
}

#[test]
fn a_request_carries_its_model_for_the_per_model_counters_only_where_routing_is_by_model() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 5, "");
    g.apply_snapshot(&store, &two_models());
    let body = |m: &str| format!(r#"{{"model":"{m}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let model_of = |g: &mut Gateway, m: &str| match g.route_request(
        &store,
        Endpoint::ChatCompletions,
        body(m).as_bytes(),
        &RequestInfo::default(),
    ) {
        Outcome::Route(plan) => g.commit(&store, plan).model,
        Outcome::Reply(r) => panic!("{}", String::from_utf8_lossy(&r.body)),
    };
    assert_eq!(model_of(&mut g, "a-sql").as_deref(), Some("a-sql"));
    assert_eq!(model_of(&mut g, "b").as_deref(), Some("b"));
    // One model under one name: no per-model series (the gateway's totals are its own).
    let mut single = gateway(&store, 6, "");
    let mut one = two_models();
    one.workers.retain(|w| w.models.iter().all(|m| m.id == "a"));
    single.apply_snapshot(&store, &one);
    assert_eq!(model_of(&mut single, "a"), None);
}

#[test]
fn model_labels_are_bounded_and_never_confuse_tag_extraction() {
    let mut labels = crate::host::Labels::default();
    assert_eq!(labels.label("org/m;x=y", None), "org/m_x_y");
    assert_eq!(labels.label("a\"} 1\nb\\ c", None), "a___1_b__c", "nothing a scraper would read as syntax");
    for i in 0..crate::host::MAX_LABEL_SERIES * 2 {
        labels.label(&format!("m{i}"), None);
    }
    assert_eq!(labels.label("m0", None), "m0", "a name seen early keeps its series");
    assert_eq!(labels.label("late", None), "other");
    assert_eq!(
        crate::host::tagged_name(crate::host::LabelledMetric::ModelRequests, "m0"),
        "model=.=m0;.;kvmesh_model_requests_total"
    );
}

/// The bound holds for the Envoy, not for each VM: two VMs sharing one store give out
/// [`crate::host::MAX_LABEL_SERIES`] labels between them, exactly.
#[test]
fn model_series_are_bounded_for_the_whole_envoy() {
    use std::collections::HashSet;
    let store = FakeStore::default();
    let (mut a, mut b) = (crate::host::Labels::default(), crate::host::Labels::default());
    let max = crate::host::MAX_LABEL_SERIES;
    let mut given = HashSet::new();
    for i in 0..max {
        given.insert(a.label(&format!("a{i}"), Some((&store, crate::shared::series::MODEL_SERIES_KEY))));
        given.insert(b.label(&format!("b{i}"), Some((&store, crate::shared::series::MODEL_SERIES_KEY))));
    }
    given.remove("other");
    assert_eq!(given.len(), max, "{given:?}");
    assert_eq!(
        b.label("a0", Some((&store, crate::shared::series::MODEL_SERIES_KEY))),
        "a0",
        "a label another VM gave out has its series here too"
    );
    assert_eq!(a.label("new", Some((&store, crate::shared::series::MODEL_SERIES_KEY))), "other");
}

/// The control plane's workers' key (its `--api-key`, on full snapshots) wins over the
/// plugin's on the VM that holds the streams and on the others; a delta keeps it; a full
/// snapshot without one brings the plugin's back.
#[test]
fn the_control_planes_workers_key_reaches_every_vm_over_the_plugins() {
    let store = FakeStore::default();
    let (mut owner, mut other) =
        (gateway(&store, 1, r#","worker_api_key":"mine""#), gateway(&store, 2, r#","worker_api_key":"mine""#));
    let auth = |g: &Gateway| g.front().destination().authorization;
    assert_eq!(auth(&owner).as_deref(), Some("Bearer mine"));
    let mut full = two_models();
    full.worker_authorization = "Bearer cp-key".into();
    owner.apply_snapshot(&store, &full);
    other.sync_table(&store);
    assert_eq!((auth(&owner).as_deref(), auth(&other).as_deref()), (Some("Bearer cp-key"), Some("Bearer cp-key")));
    let delta =
        proto::Snapshot { version: 2, workers: full.workers.clone(), workers_changed: true, ..Default::default() };
    owner.apply_snapshot(&store, &delta);
    other.sync_table(&store);
    assert_eq!((auth(&owner).as_deref(), auth(&other).as_deref()), (Some("Bearer cp-key"), Some("Bearer cp-key")));
    // A value that could not be a header is not sent.
    let bad = proto::Snapshot { version: 3, worker_authorization: "Bearer a\r\nx: 1".into(), ..two_models() };
    owner.apply_snapshot(&store, &bad);
    assert_eq!(auth(&owner).as_deref(), Some("Bearer mine"));
    let none = proto::Snapshot { version: 4, ..two_models() };
    owner.apply_snapshot(&store, &none);
    other.sync_table(&store);
    assert_eq!((auth(&owner).as_deref(), auth(&other).as_deref()), (Some("Bearer mine"), Some("Bearer mine")));
}
