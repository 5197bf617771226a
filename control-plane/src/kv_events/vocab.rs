//! A model's vocabulary as bytes: token id → the bytes it stands for, read once from the
//! model's `tokenizer.json` (a path the operator gives; no hub download). Only byte-level BPE
//! vocabularies (GPT-2, Llama 3, Qwen, DeepSeek: `ByteLevel` decoder) are read: each vocabulary
//! entry is a string over GPT-2's byte↔unicode table, mapped back to its bytes. Added tokens
//! that are `special` (BOS, chat markers) stand for no bytes of the text; other added tokens
//! stand for their content. No BPE runs here: events carry token ids, this turns them into
//! text bytes.

use std::collections::HashMap;

use serde::Deserialize;

/// The largest `tokenizer.json` read.
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// The highest token id kept.
pub const MAX_VOCAB: u32 = 1 << 21;

/// Token id → bytes.
#[derive(Debug, Default)]
pub struct Vocab {
    bytes: Vec<Box<[u8]>>,
}

#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error("cannot read {0}: {1}")]
    Read(String, std::io::Error),
    #[error("{0} is over {MAX_FILE_BYTES} bytes")]
    TooLarge(String),
    #[error("not a tokenizer.json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not a byte-level BPE tokenizer (decoder {0:?}): kvmesh maps ids back to bytes only for those")]
    NotByteLevel(Option<String>),
    #[error("token id {0} is over {MAX_VOCAB}")]
    IdTooLarge(u32),
}

#[derive(Deserialize)]
struct File {
    model: Model,
    #[serde(default)]
    added_tokens: Vec<Added>,
    decoder: Option<Decoder>,
}

#[derive(Deserialize)]
struct Model {
    vocab: HashMap<String, u32>,
}

#[derive(Deserialize)]
struct Added {
    id: u32,
    content: String,
    #[serde(default)]
    special: bool,
}

#[derive(Deserialize)]
struct Decoder {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    decoders: Vec<Decoder>,
}

impl Decoder {
    fn byte_level(&self) -> bool {
        self.kind == "ByteLevel" || self.decoders.iter().any(Decoder::byte_level)
    }
}

/// GPT-2's table: the unicode character each byte is written as in a byte-level vocabulary.
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

impl Vocab {
    /// Reads `path` (a `tokenizer.json`).
    pub fn load(path: &str) -> Result<Self, VocabError> {
        let len = std::fs::metadata(path).map_err(|e| VocabError::Read(path.into(), e))?.len();
        if len > MAX_FILE_BYTES {
            return Err(VocabError::TooLarge(path.into()));
        }
        let text = std::fs::read(path).map_err(|e| VocabError::Read(path.into(), e))?;
        Self::parse(&text)
    }

    /// Parses a `tokenizer.json`'s text.
    pub fn parse(json: &[u8]) -> Result<Self, VocabError> {
        let file: File = serde_json::from_slice(json)?;
        if !file.decoder.as_ref().is_some_and(Decoder::byte_level) {
            return Err(VocabError::NotByteLevel(file.decoder.map(|d| d.kind)));
        }
        let table = byte_to_char();
        let back: HashMap<char, u8> = table.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut vocab = Vocab::default();
        for (token, id) in file.model.vocab {
            // A character outside the table (a malformed entry) stands for its UTF-8.
            let mut bytes = Vec::with_capacity(token.len());
            for c in token.chars() {
                match back.get(&c) {
                    Some(&b) => bytes.push(b),
                    None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            vocab.set(id, bytes)?;
        }
        for a in file.added_tokens {
            vocab.set(a.id, if a.special { Vec::new() } else { a.content.into_bytes() })?;
        }
        Ok(vocab)
    }

    fn set(&mut self, id: u32, bytes: Vec<u8>) -> Result<(), VocabError> {
        if id >= MAX_VOCAB {
            return Err(VocabError::IdTooLarge(id));
        }
        let at = id as usize;
        if self.bytes.len() <= at {
            self.bytes.resize(at + 1, Box::default());
        }
        if let Some(slot) = self.bytes.get_mut(at) {
            *slot = bytes.into_boxed_slice();
        }
        Ok(())
    }

    /// The bytes token `id` stands for (none for an unknown id).
    pub fn bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(|b| &b[..])
    }

    /// Token ids known.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const TINY: &str = r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1,"Ġ":2,"Ġa":3,"ab":4,"Ċ":5,"Ã©":6},"merges":[]},
        "added_tokens":[{"id":7,"content":"<s>","special":true},{"id":8,"content":"<tool>","special":false}],
        "decoder":{"type":"ByteLevel"}}"#;

    #[test]
    fn byte_level_entries_map_back_to_their_bytes() {
        let v = Vocab::parse(TINY.as_bytes()).unwrap();
        assert_eq!(v.bytes(3), Some(&b" a"[..]));
        assert_eq!(v.bytes(5), Some(&b"\n"[..]));
        assert_eq!(v.bytes(6), Some("é".as_bytes()));
        assert_eq!(v.bytes(7), Some(&b""[..]), "special tokens stand for no text");
        assert_eq!(v.bytes(8), Some(&b"<tool>"[..]));
        assert_eq!(v.bytes(99), None);
    }

    #[test]
    fn other_tokenizers_and_huge_ids_are_refused() {
        let sp = TINY.replace("ByteLevel", "Metaspace");
        assert!(matches!(Vocab::parse(sp.as_bytes()), Err(VocabError::NotByteLevel(_))));
        let huge = TINY.replace("\"b\":1", "\"b\":4000000000");
        assert!(matches!(Vocab::parse(huge.as_bytes()), Err(VocabError::IdTooLarge(_))));
        assert!(Vocab::parse(b"{").is_err());
    }
}
