use super::*;
use kvmesh_core::blocks::{block_hashes_from, model_seed};

/// A vocabulary of single bytes: id b stands for byte b; 256 is special (no bytes), 257 "ab".
fn vocab() -> Arc<Vocab> {
    let mut vocab = String::from(r#"{"model":{"type":"BPE","vocab":{"#);
    let table = {
        let mut t = Vec::new();
        let mut next = 256u32;
        for b in 0..256u32 {
            let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
            t.push(if printable {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            });
        }
        t
    };
    for (b, c) in table.iter().enumerate() {
        vocab.push_str(&format!("{}:{b},", serde_json::to_string(&c.to_string()).unwrap()));
    }
    vocab.push_str(r#""ab":257},"merges":[]},"added_tokens":[{"id":256,"content":"<s>","special":true}],"decoder":{"type":"ByteLevel"}}"#);
    Arc::new(Vocab::parse(vocab.as_bytes()).unwrap())
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> Stored {
    Stored { hashes, parent, tokens, block_size: bs, lora: false, gpu: true }
}

fn ids(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[test]
fn engine_blocks_rekey_to_the_gateways_chain_across_parents() {
    let seed = model_seed(Some("m"));
    let mut k = Rekeyer::new(vocab(), 8, seed, 1000);
    let text = "the quick brown fox jumps over the lazy dog!!!!"; // 47 bytes
    let want = block_hashes_from(text.as_bytes(), 8, seed);
    let t = ids(text);
    // Engine blocks of 5 tokens: the first event two blocks, then one chained on its parent.
    let a = k.stored(&stored(vec![100, 101], None, t[..10].to_vec(), 5));
    assert_eq!(a.added, want[..1].to_vec(), "10 bytes complete one 8-byte block");
    let b = k.stored(&stored(vec![102], Some(101), t[10..15].to_vec(), 5));
    assert!(b.added.is_empty());
    let c = k.stored(&stored(vec![103, 104, 105, 106], Some(102), t[15..35].to_vec(), 5));
    assert_eq!(c.added, want[1..4].to_vec());
    assert!(want[..4].iter().all(|h| k.holds(*h)));
    assert!(!k.holds(want[4]));
    // Removing the last engine block gives back only what it completed.
    assert_eq!(k.removed(&[106]), vec![want[3]]);
    assert_eq!(k.clear().len(), 3);
    assert_eq!(k.len(), 0);
}

#[test]
fn special_tokens_and_multi_byte_tokens_keep_the_text_bytes() {
    let seed = model_seed(None);
    let mut k = Rekeyer::new(vocab(), 4, seed, 1000);
    // <s> a b c d e f g  → "abcdefg" via ids [256, 257("ab"), c, d, e, f, g, 0]: tokens per block 4.
    let mut t = vec![256, 257];
    t.extend(ids("cdefg!"));
    let a = k.stored(&stored(vec![1, 2], None, t, 4));
    assert_eq!(a.added, block_hashes_from(b"abcdefg!", 4, seed));
}

#[test]
fn unknown_parents_tokens_shapes_and_the_bound_are_refused() {
    let mut k = Rekeyer::new(vocab(), 4, 0, 2);
    assert_eq!(k.stored(&stored(vec![1], Some(99), ids("abcd"), 4)).refused, 1, "unknown parent");
    assert_eq!(k.stored(&stored(vec![1], None, vec![999_999], 1)).refused, 1, "unknown token");
    assert_eq!(k.stored(&stored(vec![1, 2], None, ids("abc"), 2)).refused, 2, "tokens do not fill the blocks");
    let mut lora = stored(vec![1], None, ids("ab"), 2);
    lora.lora = true;
    assert_eq!(k.stored(&lora).refused, 1);
    let out = k.stored(&stored(vec![1, 2, 3], None, ids("abcdef"), 2));
    assert_eq!((out.blocks, out.refused), (2, 1), "two blocks at most");
    // The same engine block stored again replaces itself.
    assert_eq!(k.stored(&stored(vec![1], None, ids("ab"), 2)).blocks, 1);
    assert_eq!(k.len(), 2);
}

/// Ingestion rate on one core: decoding SGLang-style batches (one BlockStored per 16-token
/// page, as SGLang publishes) and re-keying them. Printed, not asserted:
/// `cargo test -p kvmesh-cp --release ingestion_rate -- --ignored --nocapture`.
#[test]
#[ignore]
fn ingestion_rate() {
    use crate::kv_events::wire::decode_batch;
    use crate::kv_events::wire::tests::sglang_batch;
    let vocab = vocab();
    let mut k = Rekeyer::new(vocab, 64, 0, 1 << 21);
    let pages_per_batch = 512u64;
    let batches = 2000u64;
    let frames: Vec<Vec<u8>> = (0..batches)
        .map(|b| {
            let stored: Vec<_> = (0..pages_per_batch)
                .map(|p| {
                    let h = b * pages_per_batch + p + 1;
                    let parent = if p == 0 { None } else { Some(h - 1) };
                    let tokens: Vec<u64> =
                        (0..16).map(|i| 32 + ((h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (i * 4)) % 90)).collect();
                    (vec![h], parent, tokens, 16)
                })
                .collect();
            sglang_batch(0.0, &stored, &[], false)
        })
        .collect();
    let rss = || -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
    };
    let rss_before = rss();
    let start = std::time::Instant::now();
    let mut blocks = 0u64;
    let mut added = Vec::new();
    for f in &frames {
        for e in decode_batch(f).unwrap().events {
            if let crate::kv_events::wire::Event::Stored(s) = e {
                let out = k.stored(&s);
                blocks += out.blocks;
                if !out.added.is_empty() {
                    added.push(out.added);
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rekey_grown = rss().saturating_sub(rss_before) as f64;
    // The rest of the path: the gateway blocks into the global index and the next delta.
    let state = crate::state::test_state(&["--worker-urls", "http://127.0.0.1:2", "--max-index-entries", "100000000"]);
    let id = state.workers()[0].id;
    let t = std::time::Instant::now();
    for a in added.iter().filter(|a| !a.is_empty()) {
        state.engine_stored(id, a);
    }
    let index_secs = t.elapsed().as_secs_f64();
    println!(
        "global index: {} gateway blocks entered in {index_secs:.3} s; decode + re-key + index: {:.0} block events/s",
        added.iter().map(Vec::len).sum::<usize>(),
        blocks as f64 / (secs + index_secs)
    );
    println!(
        "ingestion: {blocks} block events in {secs:.3} s = {:.0} block events/s on one core",
        blocks as f64 / secs
    );
    let grown = rss().saturating_sub(rss_before) as f64;
    let per_million = |bytes: f64| bytes / 1048576.0 / (k.len() as f64 / 1e6);
    println!(
        "engine blocks kept: {}; resident memory per 10^6 engine blocks (64-byte gateway blocks, 16-token pages): \
         re-keying {:.0} MiB, with the global index's entries {:.0} MiB",
        k.len(),
        per_million(rekey_grown),
        per_million(grown)
    );
}
