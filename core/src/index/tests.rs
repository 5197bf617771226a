#[test]
fn the_total_bound_evicts_the_oldest_entries_of_any_worker() {
    let mut idx = super::PrefixIndex::new();
    idx.insert(1, &[10, 11, 12]);
    idx.insert(2, &[20, 21]);
    idx.insert(1, &[10]); // fresh again
    assert!(idx.evict_total_to(10).is_empty());
    let mut gone = idx.evict_total_to(3);
    gone.sort_unstable();
    // Oldest: worker 1's deeper blocks 12 and 11 (stamped first, deepest oldest).
    assert_eq!(gone, vec![(11, 1), (12, 1)]);
    assert_eq!(idx.entries(), 3);
    assert_eq!(idx.size_of(1), 1);
}

use super::*;
use crate::blocks::block_hashes;

fn h(text: &str) -> Vec<u64> {
    block_hashes(text.as_bytes(), 4)
}

#[test]
fn the_leading_run_is_found_at_every_length() {
    for len in 0..40 {
        for run in 0..=len {
            let calls = std::cell::Cell::new(0);
            let found = leading_run(len, |i| {
                calls.set(calls.get() + 1);
                i < run
            });
            assert_eq!(found, run, "{run} of {len}");
            assert!(calls.get() <= 6, "{} look-ups for {len} blocks", calls.get());
        }
    }
}

#[test]
fn the_deepest_block_and_each_depth_agree_with_the_walk_under_inserts_and_evictions() {
    let mut rng = crate::rng::seeded(17);
    let mut next = || rand::RngCore::next_u64(&mut rng);
    let mut idx = PrefixIndex::new();
    let texts: Vec<String> = (0..30).map(|i| format!("root {} / branch {i} / {}", i % 4, "x".repeat(i * 3))).collect();
    for round in 0..400 {
        let t = &texts[(next() % 30) as usize];
        let cut = (next() as usize % t.len()).max(1);
        idx.insert((next() % 6) as u32, &h(&t[..cut]));
        if round % 50 == 49 {
            idx.evict_to(20);
            idx.evict_total_to(60);
        }
        let q = h(&texts[(next() % 30) as usize]);
        let walk = idx.match_prefix(&q);
        let best = walk.iter().map(|m| m.blocks).max().unwrap_or(0);
        let (depth, owners) = idx.deepest(&q);
        let mut owners: Vec<WorkerId> = owners.collect();
        owners.sort_unstable();
        let mut want: Vec<WorkerId> = walk.iter().filter(|m| m.blocks == best).map(|m| m.worker).collect();
        want.sort_unstable();
        assert_eq!((depth, owners), (best, want), "round {round}");
        for w in 0..6 {
            let by_walk = walk.iter().find(|m| m.worker == w).map_or(0, |m| m.blocks);
            assert_eq!(idx.depth_of(w, &q), by_walk, "worker {w}, round {round}");
        }
    }
}

#[test]
fn the_total_bound_takes_exactly_the_oldest_entries_shared_blocks_included() {
    let mut rng = crate::rng::seeded(0x9e37_79b9_7f4a_7c15);
    let mut next = || rand::RngCore::next_u64(&mut rng);
    let mut idx = PrefixIndex::new();
    for _ in 0..3000 {
        // Few distinct prefixes, so that many blocks end up with several owners.
        let root = next() % 40;
        let len = 1 + next() % 12;
        let hashes: Vec<u64> = (0..len).map(|i| root * 1000 + i).collect();
        idx.insert((next() % 5) as u32, &hashes);
    }
    let mut all: Vec<(u32, u64, WorkerId)> = idx
        .nodes
        .iter()
        .flat_map(|(&h, n)| n.owners(&idx.shared).iter().map(move |o| (o.tick, h, o.worker)))
        .map(|(t, h, w)| (idx.age(t), h, w))
        .collect();
    assert!(all.len() > 200 && all.len() > idx.len(), "shared blocks exist");
    all.sort_unstable_by_key(|a| std::cmp::Reverse(a.0));
    let excess = all.len() / 3;
    let mut want: Vec<(u64, WorkerId)> = all.iter().take(excess).map(|&(_, h, w)| (h, w)).collect();
    let entries = idx.entries();
    let mut got = idx.evict_total_to(entries - excess as u64);
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(idx.entries(), entries - excess as u64);
    for (h, w) in got {
        assert!(idx.nodes.get(&h).is_none_or(|n| n.owners(&idx.shared).iter().all(|o| o.worker != w)));
    }
}

// Native only: it grows the table to its full expected size, which makes Node 20's WASI
// runner segfault at exit (see `memory` below).
#[cfg(not(target_arch = "wasm32"))]
#[test]
fn the_index_grows_to_its_expected_size_in_one_step() {
    let mut idx = PrefixIndex::new();
    let expected = (1 << 20) + (1 << 17);
    idx.expect_blocks(expected);
    let mut capacities = vec![idx.nodes.capacity()];
    for b in 0..(2 * EARLY_GROWTH as u64 + 10) {
        idx.insert(1, &[b.wrapping_mul(0x9e37_79b9_7f4a_7c15)]);
        if idx.nodes.capacity() != *capacities.last().unwrap() {
            capacities.push(idx.nodes.capacity());
        }
    }
    let last = *capacities.last().unwrap();
    assert!(last >= expected, "{capacities:?}");
    let before = capacities[capacities.len() - 2];
    assert!(before < EARLY_GROWTH * 2, "one step from the early size to the expected one: {capacities:?}");
    // Without an expected size the table doubles as usual.
    let mut plain = PrefixIndex::new();
    for b in 0..(EARLY_GROWTH as u64 + 10) {
        plain.insert(1, &[b]);
    }
    assert!(plain.nodes.capacity() < expected / 2);
}

#[test]
fn a_node_holds_one_owner_inline_and_many_in_a_reused_slot() {
    assert_eq!(std::mem::size_of::<(u64, Node)>(), 16);
    let mut idx = PrefixIndex::new();
    idx.insert(1, &[7]);
    idx.insert(2, &[7]);
    idx.insert(3, &[7]);
    assert_eq!(idx.shared.slots.len(), 1);
    idx.remove(7, 2);
    idx.remove(7, 1);
    assert_eq!(idx.match_prefix(&[7]), vec![PrefixMatch { worker: 3, blocks: 1 }]);
    assert_eq!(idx.shared.free.len(), 1, "back inline: the slot is free");
    idx.insert(4, &[7]);
    assert_eq!(idx.shared.slots.len(), 1, "the freed slot is reused");
    idx.insert(WorkerId::MAX, &[8]);
    assert!(idx.match_prefix(&[8]).is_empty(), "the marker id is no worker");
    idx.remove_worker(3);
    idx.remove_worker(4);
    assert!(idx.is_empty());
}

#[test]
fn many_owners_match_as_a_few_do() {
    let mut idx = PrefixIndex::new();
    let prompt = h("aaaabbbbccccddddeeee");
    for w in 0..40u32 {
        // Worker w holds the first 1 + w % 5 blocks.
        idx.insert(w, &prompt[..1 + (w as usize % 5)]);
    }
    let m = idx.match_prefix(&prompt);
    assert_eq!(m.len(), 40);
    // In the order the workers first appear, each with its deepest block.
    for (i, pm) in m.iter().enumerate() {
        assert_eq!(*pm, PrefixMatch { worker: i as u32, blocks: 1 + i % 5 });
    }
}

#[test]
fn longest_prefix_per_worker() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbbcccc"));
    idx.insert(2, &h("aaaabbbbzzzz"));
    idx.insert(3, &h("qqqq"));
    let mut m = idx.match_prefix(&h("aaaabbbbccccdddd"));
    m.sort_by_key(|m| m.worker);
    assert_eq!(m, vec![PrefixMatch { worker: 1, blocks: 3 }, PrefixMatch { worker: 2, blocks: 2 }]);
    assert!(idx.match_prefix(&h("xxxx")).is_empty());
    assert_eq!(idx.size_of(1), 3);
    assert_eq!(idx.size_of(2), 3);
    assert_eq!(idx.len(), 5, "the two shared blocks are stored once");
    assert_eq!(idx.entries(), 7);
}

#[test]
fn reinserting_does_not_grow() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbb"));
    let mut new = Vec::new();
    idx.insert_reporting(1, &h("aaaabbbbcccc"), |b| new.push(b));
    assert_eq!(new, h("aaaabbbbcccc")[2..]);
    idx.insert(1, &h("aaaabbbb"));
    assert_eq!(idx.size_of(1), 3);
    assert_eq!(idx.len(), 3);
}

#[test]
fn eviction_takes_least_recent_leaves_first() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbbcccc")); // old
    idx.insert(1, &h("xxxxyyyy")); // newer
    let evicted = idx.evict_to(3);
    assert_eq!(evicted.len(), 2);
    assert_eq!(idx.size_of(1), 3);
    // The old prefix lost its two deepest blocks, its root stays reachable.
    assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")), vec![PrefixMatch { worker: 1, blocks: 1 }]);
    assert_eq!(idx.match_prefix(&h("xxxxyyyy")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
}

#[test]
fn eviction_only_touches_workers_over_the_limit() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbbcccc"));
    idx.insert(2, &h("aaaabbbbcccc"));
    idx.insert(2, &h("zzzz"));
    idx.evict_to(3);
    assert_eq!(idx.size_of(1), 3);
    assert_eq!(idx.size_of(2), 3);
    assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")).len(), 2);
    assert_eq!(idx.match_prefix(&h("zzzz")), vec![PrefixMatch { worker: 2, blocks: 1 }]);
}

#[test]
fn touching_a_prefix_protects_it() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbb"));
    idx.insert(1, &h("cccc"));
    idx.insert(1, &h("aaaabbbb")); // used again: now the most recent
    idx.evict_to(2);
    assert_eq!(idx.match_prefix(&h("aaaabbbb")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
    assert!(idx.match_prefix(&h("cccc")).is_empty());
}

#[test]
fn one_workers_bound_evicts_its_least_recently_used_blocks_leaves_first() {
    for mut idx in [PrefixIndex::new(), PrefixIndex::with_recency()] {
        idx.insert(1, &h("aaaabbbbcccc")); // used first
        idx.insert(1, &h("xxxxyyyy"));
        idx.insert(2, &h("qqqqrrrrssss")); // another worker: untouched
        idx.insert(1, &h("aaaabbbb")); // a match routed here: the shared blocks are fresh again
        let gone = idx.evict_worker_to(1, 3);
        // Oldest by last use: "cccc" (stamped with the first insert), then "yyyy" (the
        // deeper block of the second), leaving "aaaa", "bbbb", "xxxx".
        assert_eq!(gone, vec![h("aaaabbbbcccc")[2], h("xxxxyyyy")[1]]);
        assert_eq!(idx.size_of(1), 3);
        assert_eq!(idx.size_of(2), 3);
        assert_eq!(idx.match_prefix(&h("aaaabbbbcccc")), vec![PrefixMatch { worker: 1, blocks: 2 }]);
        assert_eq!(idx.match_prefix(&h("xxxxyyyy")), vec![PrefixMatch { worker: 1, blocks: 1 }]);
        assert!(idx.evict_worker_to(1, 3).is_empty(), "within its bound: nothing");
        assert_eq!(idx.evict_worker_to(2, 0).len(), 3);
    }
}

#[test]
fn the_recency_order_survives_removals_restamps_and_compaction() {
    // A worker whose blocks are touched over and over (stale recency entries pile up and
    // are compacted) evicts exactly what a scan of the whole index evicts.
    let mut fast = PrefixIndex::with_recency();
    let mut slow = PrefixIndex::new();
    let mut x = 7u64;
    for round in 0..2_000u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let prompt = format!("{:04}{}", x % 50, "z".repeat((x >> 20) as usize % 12));
        for idx in [&mut fast, &mut slow] {
            idx.insert(1, &h(&prompt));
            if round % 7 == 0 {
                idx.remove(h(&prompt)[0], 1);
            }
        }
        if round % 100 == 99 {
            let mut a = fast.evict_worker_to(1, 40);
            let mut b = slow.evict_worker_to(1, 40);
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "round {round}");
        }
    }
    let log = fast.recency.as_ref().and_then(|r| r.get(&1)).map_or(0, |l| l.len()) as u64;
    assert!(log <= fast.size_of(1) * 2 + 64 + 16, "the log stays within twice the live entries: {log}");
}

#[test]
fn export_lists_every_block_oldest_first() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaabbbb"));
    idx.insert(2, &h("cccc"));
    idx.insert(1, &h("dddd"));
    let out = idx.export();
    assert_eq!(out.len(), 2);
    let (w, blocks) = &out[0];
    assert_eq!(*w, 1);
    // "bbbb" (deepest, oldest), "aaaa", then "dddd".
    let ab = h("aaaabbbb");
    assert_eq!(blocks, &vec![ab[1], ab[0], h("dddd")[0]]);
    assert_eq!(out[1], (2, h("cccc")));
}

#[test]
fn exported_pieces_inserted_elsewhere_keep_the_recency_order() {
    let mut idx = PrefixIndex::new();
    for i in 0..40 {
        idx.insert(1, &h(&format!("prompt {:02} {}", i % 13, "x".repeat(i))));
    }
    let (_, blocks) = idx.export().remove(0);
    for piece in [1, 7, 1000] {
        let mut copy = PrefixIndex::new();
        for chunk in blocks.chunks(piece) {
            copy.insert(1, &as_insert(chunk));
        }
        let (mut a, mut b) = (PrefixIndex::new(), copy);
        for chunk in blocks.chunks(1000) {
            a.insert(1, &as_insert(chunk));
        }
        // The same blocks go first, leaves before their roots.
        for keep in [60, 20, 5] {
            let (mut x, mut y) = (a.evict_to(keep), b.evict_to(keep));
            x.sort_unstable();
            y.sort_unstable();
            assert_eq!(x, y, "pieces of {piece}, down to {keep}");
        }
        assert_eq!(b.export(), a.export());
    }
    // And as the original's own eviction would.
    let mut original = idx;
    let mut copy = PrefixIndex::new();
    copy.insert(1, &as_insert(&blocks));
    let (mut x, mut y) = (original.evict_to(30), copy.evict_to(30));
    x.sort_unstable();
    y.sort_unstable();
    assert_eq!(x, y);
}

#[test]
fn remove_worker_and_single_block() {
    let mut idx = PrefixIndex::new();
    idx.insert(1, &h("aaaa"));
    idx.insert(2, &h("aaaabbbb"));
    idx.remove_worker(2);
    assert_eq!(idx.size_of(2), 0);
    assert_eq!(idx.len(), 1);
    let hashes = h("aaaa");
    idx.remove(hashes[0], 1);
    assert!(idx.is_empty());
    assert_eq!(idx.entries(), 0);
}

/// The recency log compacts itself while an insert stamps its blocks: the insert's own stamps
/// must survive it, or a worker's eviction (a cleared engine: down to 0) misses those blocks.
#[test]
fn a_worker_evicted_to_nothing_holds_nothing_after_log_compactions() {
    let chain: Vec<u64> = (1..=10).collect();
    // Whichever insert the compaction falls in.
    for rounds in 1..40 {
        let mut index = PrefixIndex::with_recency();
        for _ in 0..rounds {
            index.insert(1, &chain);
            index.insert(2, &chain[..3]);
        }
        let evicted = index.evict_worker_to(1, 0);
        assert_eq!(evicted.len(), 10, "after {rounds} rounds: {evicted:?}");
        assert_eq!(index.size_of(1), 0);
        assert!(index.match_prefix(&chain).iter().all(|m| m.worker != 1));
        assert_eq!(index.size_of(2), 3, "the other worker keeps its blocks");
    }
}
