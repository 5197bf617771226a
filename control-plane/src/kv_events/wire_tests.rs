//! Frames written as each engine writes them (msgspec's layouts, reproduced with `rmp`):
//! SGLang 006d053f (positional, int hashes, no dp rank), vLLM ≤ 0.11 (positional batch with
//! the dp rank, positional events with `medium`), vLLM 0181ea31 (a map batch, tagged map
//! events, sha256 bytes hashes, `lora_name`, `extra_keys`, `group_idx`).

use super::*;
use rmp::encode::*;

fn str_(b: &mut Vec<u8>, s: &str) {
    write_str(b, s).unwrap();
}
fn uints(b: &mut Vec<u8>, v: &[u64]) {
    write_array_len(b, v.len() as u32).unwrap();
    for &x in v {
        write_uint(b, x).unwrap();
    }
}

/// One `BlockStored`: hashes, parent, token ids, tokens per block.
pub(crate) type StoredArgs = (Vec<u64>, Option<u64>, Vec<u64>, u64);

/// SGLang: `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id], ...]]`.
pub(crate) fn sglang_batch(ts: f64, stored: &[StoredArgs], removed: &[u64], clear: bool) -> Vec<u8> {
    let mut b = Vec::new();
    write_array_len(&mut b, 2).unwrap();
    write_f64(&mut b, ts).unwrap();
    let n = stored.len() + usize::from(!removed.is_empty()) + usize::from(clear);
    write_array_len(&mut b, n as u32).unwrap();
    for (hashes, parent, tokens, bs) in stored {
        write_array_len(&mut b, 6).unwrap();
        str_(&mut b, "BlockStored");
        uints(&mut b, hashes);
        match parent {
            Some(p) => write_uint(&mut b, *p).map(|_| ()).unwrap(),
            None => write_nil(&mut b).unwrap(),
        }
        uints(&mut b, tokens);
        write_uint(&mut b, *bs).unwrap();
        write_nil(&mut b).unwrap();
    }
    if !removed.is_empty() {
        write_array_len(&mut b, 2).unwrap();
        str_(&mut b, "BlockRemoved");
        uints(&mut b, removed);
    }
    if clear {
        write_array_len(&mut b, 1).unwrap();
        str_(&mut b, "AllBlocksCleared");
    }
    b
}

#[test]
fn sglang_positional_batches_decode() {
    let b =
        sglang_batch(1.5, &[(vec![7], None, vec![1, 2, 3, 4], 4), (vec![8], Some(7), vec![5, 6, 7, 8], 4)], &[7], true);
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.ts, 1.5);
    assert_eq!(batch.dp_rank, None);
    assert_eq!(batch.events.len(), 4);
    let Event::Stored(s) = &batch.events[1] else { panic!() };
    assert_eq!(
        (s.hashes.clone(), s.parent, s.tokens.clone(), s.block_size, s.lora, s.gpu),
        (vec![8], Some(7), vec![5, 6, 7, 8], 4, false, true)
    );
    assert_eq!(batch.events[2], Event::Removed { hashes: vec![7], gpu: true });
    assert_eq!(batch.events[3], Event::Cleared);
}

#[test]
fn vllm_positional_batches_with_rank_and_medium_decode() {
    let mut b = Vec::new();
    write_array_len(&mut b, 3).unwrap();
    write_f64(&mut b, 2.0).unwrap();
    write_array_len(&mut b, 2).unwrap();
    // ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]
    write_array_len(&mut b, 7).unwrap();
    str_(&mut b, "BlockStored");
    write_array_len(&mut b, 1).unwrap();
    write_sint(&mut b, -5).unwrap();
    write_nil(&mut b).unwrap();
    uints(&mut b, &[1, 2]);
    write_uint(&mut b, 2).unwrap();
    write_nil(&mut b).unwrap();
    str_(&mut b, "GPU");
    write_array_len(&mut b, 3).unwrap();
    str_(&mut b, "BlockRemoved");
    uints(&mut b, &[9]);
    str_(&mut b, "CPU");
    write_uint(&mut b, 3).unwrap();
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.dp_rank, Some(3));
    let Event::Stored(s) = &batch.events[0] else { panic!() };
    assert_eq!(s.hashes, vec![(-5i64) as u64]);
    assert!(s.gpu);
    assert_eq!(batch.events[1], Event::Removed { hashes: vec![9], gpu: false }, "a CPU-tier removal");
}

/// vLLM now: `{"ts", "events": [{"type": "BlockStored", ...}], "data_parallel_rank"}`.
pub(crate) fn vllm_tagged_batch(ts: f64, hashes: &[&[u8]], parent: Option<&[u8]>, tokens: &[u64], bs: u64) -> Vec<u8> {
    let mut b = Vec::new();
    write_map_len(&mut b, 3).unwrap();
    str_(&mut b, "ts");
    write_f64(&mut b, ts).unwrap();
    str_(&mut b, "events");
    write_array_len(&mut b, 2).unwrap();
    write_map_len(&mut b, 11).unwrap();
    str_(&mut b, "type");
    str_(&mut b, "BlockStored");
    str_(&mut b, "block_hashes");
    write_array_len(&mut b, hashes.len() as u32).unwrap();
    for h in hashes {
        write_bin(&mut b, h).unwrap();
    }
    str_(&mut b, "parent_block_hash");
    match parent {
        Some(p) => write_bin(&mut b, p).unwrap(),
        None => write_nil(&mut b).unwrap(),
    }
    str_(&mut b, "token_ids");
    uints(&mut b, tokens);
    str_(&mut b, "block_size");
    write_uint(&mut b, bs).unwrap();
    str_(&mut b, "lora_id");
    write_nil(&mut b).unwrap();
    str_(&mut b, "medium");
    str_(&mut b, "GPU");
    str_(&mut b, "lora_name");
    write_nil(&mut b).unwrap();
    str_(&mut b, "extra_keys");
    write_array_len(&mut b, hashes.len() as u32).unwrap();
    for _ in hashes {
        write_nil(&mut b).unwrap();
    }
    str_(&mut b, "group_idx");
    write_uint(&mut b, 0).unwrap();
    str_(&mut b, "kv_cache_spec_kind");
    str_(&mut b, "full_attention");
    write_map_len(&mut b, 1).unwrap();
    str_(&mut b, "type");
    str_(&mut b, "AllBlocksCleared");
    str_(&mut b, "data_parallel_rank");
    write_uint(&mut b, 0).unwrap();
    b
}

#[test]
fn vllm_tagged_maps_with_bytes_hashes_decode() {
    let h1 = [1u8; 32];
    let h2 = [2u8; 32];
    let b = vllm_tagged_batch(3.0, &[&h1, &h2], Some(&[0u8; 32]), &[1, 2, 3, 4], 2);
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    let Event::Stored(s) = &batch.events[0] else { panic!() };
    assert_eq!(s.hashes, vec![xxh3_64(&h1), xxh3_64(&h2)]);
    assert_eq!(s.parent, Some(xxh3_64(&[0u8; 32])));
    assert_eq!(s.tokens, vec![1, 2, 3, 4]);
    assert_eq!(s.block_size, 2);
    assert_eq!(batch.events[1], Event::Cleared);
}

#[test]
fn hostile_frames_are_refused_without_allocating_their_claims() {
    assert!(decode_batch(&[]).is_err());
    assert!(decode_batch(b"\xc1").is_err());
    // An array header claiming 2^32-1 events, with nothing after it.
    let mut b = Vec::new();
    write_array_len(&mut b, 2).unwrap();
    write_f64(&mut b, 0.0).unwrap();
    write_array_len(&mut b, u32::MAX).unwrap();
    assert!(decode_batch(&b).is_err());
    // Too many token ids in one event.
    let big: Vec<u64> = vec![1; MAX_TOKENS_PER_EVENT + 1];
    assert!(decode_batch(&sglang_batch(0.0, &[(vec![1], None, big, 1)], &[], false)).is_err());
    assert!(decode_batch(&vec![0u8; MAX_PAYLOAD_BYTES + 1]).is_err());
    // Unknown tags are skipped, unknown fields ignored.
    let mut b = Vec::new();
    write_array_len(&mut b, 2).unwrap();
    write_f64(&mut b, 0.0).unwrap();
    write_array_len(&mut b, 1).unwrap();
    write_array_len(&mut b, 2).unwrap();
    str_(&mut b, "BlockMoved");
    write_uint(&mut b, 1).unwrap();
    assert_eq!(decode_batch(&b).unwrap().events, vec![Event::Unknown]);
    assert_eq!(decode_seq(&7u64.to_be_bytes()).unwrap(), 7);
    assert_eq!(decode_seq(&(-1i64).to_be_bytes()).unwrap(), -1);
    assert!(decode_seq(b"short").is_err());
}
