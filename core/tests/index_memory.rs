//! The prefix index at its bound of 10^6 blocks fits a filter VM: natively, with every
//! allocation counted, the peak of live bytes while it is built and evicted stays under the
//! memory the index may take of a VM (the filter's memory is bounded to 64 MiB per Envoy
//! worker; 8 MiB of that is left to the rest of the filter).
//!
//! Native bytes and a Wasm VM's linear memory: the index's table is one allocation of 16-byte
//! entries (a `u64` hash and a `Node` of two `u32`s, no pointer: the same size on wasm32) and
//! one control byte per bucket — the same bytes on both targets, but for the control bytes'
//! tail of one SIMD group (16 here, 8 on wasm32). What holds pointers (the owner lists of
//! blocks several workers share, the per-worker maps) is a few KiB at most here, half as wide
//! on wasm32. So the peak counted here is what the index allocates in a VM, within a few KiB.
//! A VM's linear memory grows by at least that (it never shrinks, so its growth is the peak
//! of live bytes) plus the allocator's chunk headers and the rounding to 64 KiB pages: a few
//! bytes on each of a handful of large allocations. `cargo xtask bench scale` measures the
//! whole VM inside Envoy (the filter's `kvmesh_vm_memory_bytes`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvmesh_core::index::PrefixIndex;

/// What the index may take of a VM's memory.
const BOUND: usize = 56 << 20;

/// The system allocator, keeping count of the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

// Unsafe: a global allocator is an unsafe trait; each call forwards to `System` as is.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Counted as if moved: the old and the new block live at once.
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_million_blocks_fit_in_a_vm() {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    // As a gateway holds its index at the worst: 2^20 entries and the quarter more it takes
    // before it refuses inserts (`Router::insert`), which the tick's eviction brings back.
    // (PD mode holds two such indexes, one a leg: that worst case is not within the bound.)
    let mut idx = PrefixIndex::new();
    idx.expect_blocks((1 << 20) + (1 << 18));
    let mut x = 1u64;
    for p in 0..26_215u64 {
        let hashes: Vec<u64> = (0..50)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                x
            })
            .collect();
        idx.insert((p % 64) as u32, &hashes);
    }
    assert_eq!(idx.len(), 1_310_750);
    let evicted = idx.evict_total_to(1 << 20);
    assert_eq!(evicted.len(), 1_310_750 - (1 << 20));
    drop(evicted);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
    eprintln!("index of 10^6 blocks: peak {:.1} MiB allocated", mib(peak));
    // The allocations are counted: at the least the 1,310,750 entries of 16 bytes were live.
    assert!(peak >= 1_310_750 * 16, "only {peak} bytes counted");
    assert!(peak < BOUND, "the index of 10^6 blocks peaked at {:.1} MiB, over {} MiB", mib(peak), BOUND >> 20);
    drop(idx);
}
