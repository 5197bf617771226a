//! Criterion micro-benchmarks of the full snapshot a gateway receives on connect (`cargo
//! xtask bench scale` runs them): encoding 10^6 index entries, and decoding them and applying
//! them to a router's index, as the filter's stream owner does.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvmesh_core::policy::PolicyKind;
use kvmesh_core::{Config, Router};
use kvmesh_proto::v1::{IndexInsert, Snapshot};
use prost::Message;

/// SplitMix64's finaliser: uniformly spread values, like xxh3 block hashes.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 10^6 entries: 20,000 prefixes of 50 blocks over 64 workers.
fn snapshot() -> Snapshot {
    Snapshot {
        version: 1,
        full: true,
        inserts: (0..20_000u64)
            .map(|p| IndexInsert {
                worker: (p % 64) as u32,
                hashes: (0..50).map(|i| mix((p << 8) | i)).collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn benches(c: &mut Criterion) {
    let snap = snapshot();
    let bytes = snap.encode_to_vec();
    let mut g = c.benchmark_group("snapshot");
    g.sample_size(10);
    g.bench_function("encode_1e6_entries", |b| b.iter(|| black_box(&snap).encode_to_vec()));
    g.bench_function("decode_apply_1e6_entries", |b| {
        b.iter(|| {
            let s = Snapshot::decode(black_box(&bytes[..])).expect("valid snapshot");
            let mut p = Config::default().router_params();
            p.max_entries = 2_000_000;
            let mut r = Router::new(p, PolicyKind::CacheAware);
            for i in &s.inserts {
                r.apply_insert(i.worker, &i.hashes);
            }
            r
        })
    });
    g.finish();
}

criterion_group!(snapshot_benches, benches);
criterion_main!(snapshot_benches);
