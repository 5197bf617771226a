use super::*;
use crate::gateway::{Outcome, RequestInfo};
use crate::shared::fake::FakeStore;
use crate::shared::SharedTable;
use kvmesh_core::Endpoint;
use kvmesh_core::RoutingSettings;

fn gateway(store: &FakeStore, seed: u64) -> Gateway {
    let json = r#"{"control_plane_cluster":"cp","worker_urls":["http://127.0.0.1:1"],"cache_threshold":0.2,
        "balance_abs_threshold":5}"#;
    let mut g = Gateway::new(kvmesh_core::Config::from_json(json.as_bytes()).unwrap(), store, seed);
    g.publisher().set_reporting(true);
    g
}

fn cp_settings(json: &str) -> Option<proto::RoutingSettings> {
    Some((&serde_json::from_str::<RoutingSettings>(json).unwrap()).into())
}

fn worker(id: u32, port: u16) -> proto::Worker {
    proto::Worker { id, url: format!("http://127.0.0.1:{port}"), healthy: true, ..Default::default() }
}

fn route(g: &mut Gateway, store: &FakeStore, text: &str) -> String {
    let body = format!(r#"{{"text":"{text}"}}"#);
    match g.route_request(store, Endpoint::Generate, body.as_bytes(), &RequestInfo::default()) {
        Outcome::Route(plan) => g.commit(store, plan).main.addr,
        Outcome::Reply(r) => panic!("not routed: {}", r.status),
    }
}

#[test]
fn marginal_utility_scores_from_the_snapshot_steer_every_vm() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
    let scored = |id, port, utility| proto::Worker { utility, ..worker(id, port) };
    let full = proto::Snapshot {
        version: 4,
        full: true,
        workers: vec![scored(10, 20, Some(-1.0)), scored(11, 21, Some(1.5)), scored(12, 22, Some(f64::NAN))],
        workers_changed: true,
        settings: cp_settings(r#"{"policy":"marginal_utility"}"#),
        ..Default::default()
    };
    owner.apply_snapshot(&store, &full);
    assert!(owner.view.table.get(12).is_some_and(|w| w.utility.is_none()), "not finite: no score");
    // Every request goes to the best score while the loads stay equal (each is finished
    // before the next: routed requests stay in flight, so end them).
    for i in 0..5 {
        assert_eq!(route(&mut other, &store, &format!("q{i}")), "127.0.0.1:21");
        crate::shared::Inflight::finish(&store, 11, false);
    }
}

/// A restarted control plane counts its versions from the start again: a VM that last
/// saw the old one's version 2 (and has been idle since, as a native build's thread can
/// be) still adopts the new one's version 2, which lists another table.
#[test]
fn a_restarted_control_planes_repeated_version_is_still_adopted() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
    let snap = |version, workers: Vec<proto::Worker>| proto::Snapshot {
        version,
        full: version == 1,
        workers,
        workers_changed: true,
        ..Default::default()
    };
    owner.apply_snapshot(&store, &snap(1, vec![worker(10, 20)]));
    owner.apply_snapshot(&store, &snap(2, vec![worker(10, 20)]));
    route(&mut other, &store, "a");
    assert_eq!(other.table_version(), Some(2));
    owner.apply_snapshot(&store, &snap(3, vec![worker(10, 20), worker(11, 21)]));
    // The control plane restarts before `other` routes again; its first snapshot is a
    // full one numbered 2 again, with both workers.
    let mut again = snap(2, vec![worker(10, 20), worker(11, 21)]);
    again.full = true;
    owner.apply_snapshot(&store, &again);
    route(&mut other, &store, "b");
    assert_eq!(other.view.table.workers.len(), 2, "the new table, though its version is the one seen last");
    let served: std::collections::HashSet<String> =
        (0..8).map(|i| route(&mut other, &store, &format!("distinct prompt {i} ").repeat(20))).collect();
    assert!(served.contains("127.0.0.1:21"), "the added worker gets traffic: {served:?}");
}

#[test]
fn the_owner_shares_the_table_and_index_with_the_other_vms() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
    let text = "p".repeat(300);
    let hashes = kvmesh_core::blocks::block_hashes(text.as_bytes(), 32);
    let full = proto::Snapshot {
        version: 3,
        full: true,
        workers: vec![worker(10, 20), worker(11, 21), worker(12, 22)],
        workers_changed: true,
        inserts: vec![IndexInsert { worker: 11, hashes, ..Default::default() }],
        settings: cp_settings(r#"{"cache_threshold":0.1}"#),
        ..Default::default()
    };
    owner.apply_snapshot(&store, &full);
    assert_eq!(owner.table_version(), Some(3));
    assert_eq!(owner.config().cache_aware.cache_threshold, 0.1, "the control plane's setting wins");
    assert_eq!(owner.config().cache_aware.balance_abs_threshold, 5, "the plugin's stays where the cp sets none");
    // The other VM adopts the table and the index before its next request.
    assert_eq!(route(&mut other, &store, &format!("{text}?")), "127.0.0.1:21");
    assert_eq!(other.table_version(), Some(3));
    assert_eq!(other.config().cache_aware.cache_threshold, 0.1);
    assert_eq!(other.config().cache_aware.balance_abs_threshold, 5);
    // A worker-set delta without settings keeps the control plane's settings, on every VM.
    let delta = proto::Snapshot {
        version: 4,
        workers: vec![worker(10, 20), worker(11, 21)],
        workers_changed: true,
        ..Default::default()
    };
    owner.apply_snapshot(&store, &delta);
    route(&mut other, &store, "x");
    assert_eq!((owner.config().cache_aware.cache_threshold, other.config().cache_aware.cache_threshold), (0.1, 0.1));
    assert_eq!(other.table_version(), Some(4));
}

#[test]
fn control_plane_settings_switch_the_policy_and_bad_ones_are_ignored() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1);
    let full = |version, settings| proto::Snapshot {
        version,
        full: true,
        workers: vec![worker(0, 30), worker(1, 31), worker(2, 32)],
        workers_changed: true,
        settings,
        ..Default::default()
    };
    g.apply_snapshot(&store, &full(1, cp_settings(r#"{"policy":"round_robin"}"#)));
    assert_eq!(g.config().policy, kvmesh_core::policy::PolicyKind::RoundRobin);
    let text = "s".repeat(200);
    let picks: Vec<String> = (0..3).map(|_| route(&mut g, &store, &text)).collect();
    assert_eq!(picks.iter().collect::<std::collections::HashSet<_>>().len(), 3, "round robin: {picks:?}");
    // Invalid (block_size 0) and unconvertible (an unknown policy number) settings change nothing.
    g.apply_snapshot(&store, &full(2, cp_settings(r#"{"block_size":0}"#)));
    let unknown = proto::RoutingSettings { policy: Some(99), ..Default::default() };
    g.apply_snapshot(&store, &full(3, Some(unknown)));
    assert_eq!(g.config().policy, kvmesh_core::policy::PolicyKind::RoundRobin);
    assert_eq!(g.config().block_size, 32);
    assert_eq!(g.table_version(), Some(3));
}

#[test]
fn a_table_with_new_loads_for_the_same_workers_is_adopted_in_place_and_a_new_role_is_not() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
    let with = |version, loads: [u64; 2], healthy: bool| proto::Snapshot {
        version,
        full: version == 1,
        workers: vec![
            proto::Worker { load: loads[0], healthy, ..worker(0, 30) },
            proto::Worker { load: loads[1], ..worker(1, 31) },
        ],
        workers_changed: true,
        // As from kvmesh-cp: settings only in a full snapshot.
        settings: if version == 1 { cp_settings(r#"{"policy":"power_of_two"}"#) } else { None },
        ..Default::default()
    };
    owner.apply_snapshot(&store, &with(1, [0, 0], true));
    route(&mut other, &store, "first");
    let table_cas = store.get("kvmesh.cp.table.v1").1;
    assert!(table_cas.is_some());
    let url_before = other.view.table.get(0).map(|w| w.url.as_ptr());
    for (version, loads, want) in [(2, [50, 0], "127.0.0.1:31"), (3, [0, 50], "127.0.0.1:30")] {
        owner.apply_snapshot(&store, &with(version, loads, true));
        for _ in 0..4 {
            let to = route(&mut other, &store, "q");
            crate::shared::Inflight::finish(&store, if to.ends_with("31") { 1 } else { 0 }, false);
            assert_eq!(to, want, "loads {loads:?}");
        }
        assert_eq!(other.table_version(), Some(version));
        assert_eq!(other.view.table.get(0).map(|w| w.load), Some(loads[0]));
    }
    assert_eq!(other.view.table.get(0).map(|w| w.url.as_ptr()), url_before, "the same workers, updated in place");
    owner.apply_snapshot(&store, &with(4, [0, 0], false));
    route(&mut other, &store, "q");
    assert_eq!(other.view.table.get(0).map(|w| w.healthy), Some(false));
    assert_eq!(store.get("kvmesh.cp.table.v1").1, table_cas, "only the polled records were shared again");
    // A new role for the same URL is a new worker: the table is rebuilt.
    let mut pd = with(5, [0, 0], true);
    pd.workers[1].role = proto::Role::Prefill as i32;
    owner.apply_snapshot(&store, &pd);
    route(&mut other, &store, "q");
    assert_eq!(other.view.table.get(1).map(|w| w.role), Some(kvmesh_core::worker::Role::Prefill));
}

#[test]
fn a_new_owner_names_the_table_the_last_owner_published() {
    let store = FakeStore::default();
    let (mut a, mut b) = (gateway(&store, 1), gateway(&store, 2));
    let snap = |version, full| proto::Snapshot {
        version,
        full,
        workers: vec![worker(0, 30), worker(1, 31)],
        workers_changed: true,
        ..Default::default()
    };
    a.apply_snapshot(&store, &snap(1, true));
    route(&mut b, &store, "q");
    // A reconnects: the same workers, published again as a table of version 3.
    a.apply_snapshot(&store, &snap(3, true));
    // B takes the streams over without having routed since, and gets new loads.
    b.apply_snapshot(&store, &snap(4, false));
    let (table_at, _) = SharedTable::polled(&store).unwrap();
    assert_eq!(table_at, 3, "the records name the table that is in shared data");
    let decoded = a.follower.shared_table_version;
    route(&mut a, &store, "q");
    assert_eq!(a.follower.shared_table_version, decoded, "A decodes no table for new loads");
}

#[test]
fn an_id_that_changes_worker_loses_its_index_entries() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1);
    let snapshot = |version, workers: Vec<proto::Worker>| proto::Snapshot {
        version,
        full: true,
        workers,
        workers_changed: true,
        ..Default::default()
    };
    g.apply_snapshot(&store, &snapshot(1, vec![worker(0, 30), worker(1, 31)]));
    // Only id 0 is up when the prefix is first routed.
    let mut down = worker(1, 31);
    down.healthy = false;
    g.apply_snapshot(&store, &snapshot(2, vec![worker(0, 30), down]));
    assert_eq!(route(&mut g, &store, &"q".repeat(300)), "127.0.0.1:30");
    assert!(g.index_len() > 0);
    // Same id, same worker, new health: the index stays.
    g.apply_snapshot(&store, &snapshot(3, vec![worker(0, 30), worker(1, 31)]));
    assert!(g.index_len() > 0);
    // Id 0 now names another worker: its blocks are forgotten.
    g.apply_snapshot(&store, &snapshot(4, vec![worker(0, 40), worker(1, 31)]));
    assert_eq!(g.index_len(), 0);
}

#[test]
fn a_delta_does_not_echo_this_envoys_own_inserts() {
    let store = FakeStore::default();
    let (mut owner, mut other) = (gateway(&store, 1), gateway(&store, 2));
    owner.publisher().set_own_id("envoy/a");
    let full = proto::Snapshot {
        version: 1,
        full: true,
        workers: vec![worker(0, 20), worker(1, 21)],
        workers_changed: true,
        ..Default::default()
    };
    owner.apply_snapshot(&store, &full);
    let insert = |origin: &str, hashes: Vec<u64>| IndexInsert { worker: 1, hashes, origin: origin.into() };
    let delta = proto::Snapshot {
        version: 2,
        inserts: vec![insert("envoy/a", vec![1, 2, 3]), insert("envoy/b", vec![4]), insert("", vec![5])],
        ..Default::default()
    };
    let before = owner.index_len();
    owner.apply_snapshot(&store, &delta);
    assert_eq!(owner.index_len(), before + 2, "only the other gateway's and the control plane's blocks");
    // The other VMs get the same through the delta log.
    route(&mut other, &store, "x");
    assert_eq!(other.index_len(), 1 + 2, "its own block, and the two from the delta");
}

#[test]
fn reports_carry_new_inserts_once_and_the_counts() {
    let store = FakeStore::default();
    let mut g = gateway(&store, 1);
    g.apply_snapshot(
        &store,
        &proto::Snapshot {
            version: 1,
            full: true,
            workers: vec![worker(0, 30)],
            workers_changed: true,
            ..Default::default()
        },
    );
    route(&mut g, &store, &"r".repeat(100));
    let report = g.take_report(&store, "gw", Now::default());
    assert_eq!(report.inserts.len(), 1);
    assert_eq!(report.counts[0].in_flight, 1);
    assert!(g.take_report(&store, "gw", Now::default()).inserts.is_empty(), "reported once");
    let full = g.full_report("gw", 1 << 16);
    assert_eq!(full.len(), 1);
    assert_eq!(full[0].inserts.iter().map(|i| i.hashes.len()).sum::<usize>(), 4);
    // In chunks of at most 3 hashes: every hash once, no chunk over the bound.
    route(&mut g, &store, &"s".repeat(100));
    let chunks = g.full_report("gw", 3);
    let sizes: Vec<usize> = chunks.iter().map(|b| b.inserts.iter().map(|i| i.hashes.len()).sum()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 8, "{sizes:?}");
    assert!(sizes.iter().all(|&n| (1..=3).contains(&n)), "{sizes:?}");
    assert!(chunks.iter().all(|b| b.gateway_id == "gw" && b.counts.is_empty()));
}

/// Tenant usage (issue 47): a report carries this Envoy's (what its VMs shared), and the
/// fleet's usage a snapshot carries goes to the other VMs less that, counted once.
#[test]
fn reports_carry_the_envoys_tenant_usage_and_the_fleets_comes_back_less_it() {
    use crate::shared::tenant_usage;
    use kvmesh_core::fleet::Usage;
    let store = FakeStore::default();
    let mut g = gateway(&store, 1);
    assert_eq!(g.take_report(&store, "gw", Now::default()).tenant_usage, None, "no tenants charged");
    assert!(tenant_usage::add(&store, &Usage::sanitized([("a", 300.0)], 8, 0), 8, 0));
    // Not reported yet (a VM that just took the streams over): the Envoy's own usage as it
    // stands is taken off.
    let fleet = kvmesh_proto::usage_to_wire(&Usage::sanitized([("a", 1_300.0)], 8, 0));
    g.publisher().fleet_usage(&store, &proto::Snapshot { tenant_usage: Some(fleet), ..Default::default() }, 0);
    assert_eq!(tenant_usage::read(&store).unwrap().1.get("a", 0), 1_000.0);
    let report = g.take_report(&store, "gw", Now::default());
    let sent = report.tenant_usage.unwrap();
    assert_eq!((sent.tenants[0].tenant.as_str(), sent.tenants[0].tokens), ("a", 300.0));
    // The fleet: this Envoy's 300 of `a` plus 1000 elsewhere, and `b`'s 50 elsewhere.
    let fleet = kvmesh_proto::usage_to_wire(&Usage::sanitized([("a", 1_300.0), ("b", 50.0)], 8, 0));
    let snapshot = proto::Snapshot { version: 2, tenant_usage: Some(fleet), ..Default::default() };
    g.publisher().fleet_usage(&store, &snapshot, 0);
    let (envoy, rest) = tenant_usage::read(&store).unwrap();
    assert_eq!((envoy.get("a", 0), rest.get("a", 0), rest.get("b", 0)), (300.0, 1_000.0, 50.0));
    // A snapshot without usage changes nothing.
    g.publisher().fleet_usage(&store, &proto::Snapshot::default(), 0);
    assert_eq!(tenant_usage::read(&store).unwrap().1.get("a", 0), 1_000.0);
}

/// Admitted requests (issue 47's requests-per-second limit across gateways): a report carries
/// this Envoy's, and the fleet's a snapshot carries comes back less them, for the limit.
#[test]
fn reports_carry_the_envoys_admitted_requests_and_the_fleets_come_back_less_them() {
    use crate::shared::{tenant_requests, tenants};
    use kvmesh_core::fleet::Usage;
    let store = FakeStore::default();
    let mut g = gateway(&store, 1);
    assert_eq!(g.take_report(&store, "gw", Now::default()).tenant_requests, None, "no limit counted any");
    for _ in 0..4 {
        assert!(tenants::hit(&store, "a", 100, 0, 8, 0).is_some_and(|(v, _)| v.allowed));
    }
    let sent = g.take_report(&store, "gw", Now::default()).tenant_requests.unwrap();
    assert_eq!((sent.tenants[0].tenant.as_str(), sent.tenants[0].tokens), ("a", 4.0));
    let fleet = kvmesh_proto::usage_to_wire(&Usage::sanitized([("a", 104.0), ("b", 7.0)], 8, 0));
    g.publisher().fleet_usage(&store, &proto::Snapshot { tenant_requests: Some(fleet), ..Default::default() }, 0);
    let rest = tenant_requests::rest(&store);
    assert_eq!((rest.get("a", 0), rest.get("b", 0)), (100.0, 7.0), "this Envoy's own taken off");
    // 100 decayed requests elsewhere: about 6.9 a second, which the limit counts.
    let elsewhere = kvmesh_core::fleet::per_second(rest.get("a", 0));
    assert_eq!(elsewhere, 6);
    let (v, _) = tenants::hit(&store, "a", 10, elsewhere, 8, 0).unwrap();
    assert_eq!((v.allowed, v.remaining), (false, 0), "4 here and 6 elsewhere fill a limit of 10");
}
