//! Criterion micro-benchmarks of the routing core (`cargo xtask bench scale` runs them): the
//! cache-aware decision with 8/64/256 workers over an index of 10^4 or 10^6 blocks, the other
//! policies' decisions with 64 workers over 10^6 blocks, and index insert and LRU eviction.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvmesh_core::blocks::block_hashes;
use kvmesh_core::policy::{Candidate, PolicyKind};
use kvmesh_core::{Config, Router, RouterParams, RoutingText};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// Blocks per indexed prefix (a ~1.6 KB shared prompt at 32-byte blocks).
const PREFIX_BLOCKS: u64 = 50;

fn params(workers: u64, blocks: u64) -> RouterParams {
    let mut p = Config::default().router_params();
    // Room for every block: the benchmark measures lookups in a full index, not eviction.
    p.max_blocks = blocks.div_ceil(workers) * 2;
    p.max_entries = blocks * 2;
    p
}

/// A router whose index holds `blocks` blocks spread over `workers` workers, and the text of
/// a request that shares its first half with a prefix worker 3 holds.
fn filled(workers: u64, blocks: u64) -> (Router, Vec<u8>) {
    filled_for(PolicyKind::CacheAware, workers, blocks)
}

fn filled_for(kind: PolicyKind, workers: u64, blocks: u64) -> (Router, Vec<u8>) {
    let mut r = Router::new(params(workers, blocks), kind);
    let mut rng = SmallRng::seed_from_u64(7);
    for p in 0..blocks / PREFIX_BLOCKS {
        let hashes: Vec<u64> = (0..PREFIX_BLOCKS).map(|_| rng.next_u64()).collect();
        r.apply_insert((p % workers) as u32, &hashes);
    }
    let text: Vec<u8> = (0..4096u32).map(|i| b'a' + (i.wrapping_mul(2_654_435_761) >> 27) as u8 % 26).collect();
    let shared = block_hashes(&text[..2048], Config::default().block_size);
    r.apply_insert(3 % workers as u32, &shared);
    (r, text)
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for blocks in [10_000u64, 1_000_000] {
        for workers in [8u64, 64, 256] {
            let (router, text) = filled(workers, blocks);
            let cands: Vec<Candidate> =
                (0..workers).map(|i| Candidate { id: i as u32, load: i % 5, ..Default::default() }).collect();
            let mut rng = SmallRng::seed_from_u64(1);
            g.bench_with_input(BenchmarkId::new(format!("{blocks}_blocks"), workers), &workers, |b, _| {
                b.iter(|| router.decide(RoutingText::from(black_box(&text[..])), black_box(&cands), &mut rng))
            });
        }
    }
    g.finish();
}

/// The other policies at 64 workers over 10^6 blocks (consistent_hashing with a key,
/// marginal_utility with every worker scored).
fn other_policies(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_policies");
    for kind in [PolicyKind::PrefixHash, PolicyKind::MarginalUtility, PolicyKind::ConsistentHashing] {
        let (router, text) = filled_for(kind, 64, 1_000_000);
        let cands: Vec<Candidate> = (0..64u64)
            .map(|i| Candidate {
                id: i as u32,
                load: i % 5,
                affinity: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                utility: Some((i % 7) as f64 / 7.0 - 0.5),
            })
            .collect();
        let mut rng = SmallRng::seed_from_u64(1);
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                let t = RoutingText::from(black_box(&text[..])).with_key(Some(b"session-1234"));
                router.decide(t, black_box(&cands), &mut rng)
            })
        });
    }
    g.finish();
}

fn index(c: &mut Criterion) {
    let mut g = c.benchmark_group("index");
    let (mut router, _) = filled(64, 1_000_000);
    let mut rng = SmallRng::seed_from_u64(9);
    g.bench_function("insert_50_blocks_into_1e6", |b| {
        b.iter_batched(
            || (0..PREFIX_BLOCKS).map(|_| rng.next_u64()).collect::<Vec<u64>>(),
            |hashes| router.apply_insert((hashes[0] % 64) as u32, &hashes),
            BatchSize::SmallInput,
        )
    });
    // LRU eviction of a 10^5-block index over 64 workers down to nine tenths of it (the
    // periodic eviction's work).
    g.bench_function("evict_1e4_of_1e5", |b| {
        b.iter_batched(
            || {
                let mut p = params(64, 100_000);
                p.max_blocks = 100_000 / 64 * 9 / 10;
                let mut r = Router::new(p, PolicyKind::CacheAware);
                let mut rng = SmallRng::seed_from_u64(11);
                for i in 0..100_000 / PREFIX_BLOCKS {
                    let hashes: Vec<u64> = (0..PREFIX_BLOCKS).map(|_| rng.next_u64()).collect();
                    r.apply_insert((i % 64) as u32, &hashes);
                }
                r
            },
            |mut r| r.evict(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, decision, other_policies, index);
criterion_main!(benches);
