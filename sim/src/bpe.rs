//! A minimal byte-level BPE encoder over a Hugging Face `tokenizer.json` (its vocabulary and
//! merges; GPT-2's byte-to-unicode table): enough for the simulator to turn prompts into token
//! ids an engine would publish, without the `tokenizers` crate's build time. Words are split
//! before each space; within a word the lowest-ranked adjacent pair is merged until none is.
//! Decoding the ids gives back the prompt's bytes exactly, whatever the merges.

use std::collections::HashMap;

use anyhow::Context;
use serde::Deserialize;

pub struct Bpe {
    ids: HashMap<String, u32>,
    /// Bytes each id stands for (one a character of its vocabulary entry).
    lens: HashMap<u32, u64>,
    ranks: HashMap<(String, String), usize>,
    byte_char: [char; 256],
}

#[derive(Deserialize)]
struct File {
    model: Model,
}

#[derive(Deserialize)]
struct Model {
    vocab: HashMap<String, u32>,
    merges: Vec<String>,
}

fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

impl Bpe {
    pub fn load(path: &str) -> anyhow::Result<Self> {
        let text = std::fs::read(path).with_context(|| format!("cannot read {path}"))?;
        let file: File = serde_json::from_slice(&text).with_context(|| format!("{path}: not a tokenizer.json"))?;
        let ranks = file
            .model
            .merges
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.split_once(' ').map(|(a, b)| ((a.to_string(), b.to_string()), i)))
            .collect();
        let lens = file.model.vocab.iter().map(|(k, &id)| (id, k.chars().count() as u64)).collect();
        Ok(Self { ids: file.model.vocab, lens, ranks, byte_char: byte_to_char() })
    }

    /// Bytes of text `id` stands for (0 for an unknown id).
    pub fn byte_len(&self, id: u32) -> u64 {
        self.lens.get(&id).copied().unwrap_or(0)
    }

    /// The token ids of `text`.
    pub fn encode(&self, text: &[u8]) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut start = 0;
        for i in 1..=text.len() {
            if i == text.len() || text.get(i) == Some(&b' ') {
                self.encode_word(text.get(start..i).unwrap_or_default(), &mut out);
                start = i;
            }
        }
        out
    }

    fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        let mut parts: Vec<String> = word.iter().map(|&b| self.byte_char[b as usize].to_string()).collect();
        while parts.len() > 1 {
            let best = parts
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| Some((*self.ranks.get(&(w[0].clone(), w[1].clone()))?, i)))
                .min();
            let Some((_, i)) = best else { break };
            let right = parts.remove(i + 1);
            parts[i].push_str(&right);
        }
        out.extend(parts.iter().filter_map(|p| self.ids.get(p)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_tokenizer_merges_and_every_id_is_known() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/tokenizer.json");
        let bpe = Bpe::load(path).unwrap();
        let text = "You are a helpful assistant. Zebra émigré!";
        let ids = bpe.encode(text.as_bytes());
        assert!(ids.len() < text.len(), "merges apply");
        let back: HashMap<u32, &String> = bpe.ids.iter().map(|(k, v)| (*v, k)).collect();
        let chars: HashMap<char, u8> = bpe.byte_char.iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|i| back[i].chars().map(|c| chars[&c])).collect();
        assert_eq!(bytes, text.as_bytes());
        assert_eq!(ids.iter().map(|&i| bpe.byte_len(i)).sum::<u64>(), text.len() as u64);
    }
}
