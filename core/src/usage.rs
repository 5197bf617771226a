//! What a worker's response says about the request it served: `cached_tokens` (SGLang's
//! `meta_info.cached_tokens`, OpenAI's `usage.prompt_tokens_details.cached_tokens`),
//! `completion_tokens` and SGLang's `e2e_latency` — read from the response bytes as they pass,
//! chunk by chunk, without buffering them.
//!
//! The scanner keeps a few bytes of state whatever the response's size or shape (no DOM, no
//! nesting stack): it looks for a JSON key `"<name>"` opened by an unescaped quote, then `:`
//! and a number, and keeps the last value of each. JSON, SSE (`data: {...}` events, the last
//! one carrying the key wins) and batched bodies read the same way; inside a string every
//! quote is escaped, so text the model generated cannot pass for a key.

/// The most bytes of a number kept (longer ones are not numbers a worker would send).
const MAX_NUMBER: usize = 32;

/// The keys read, in [`Usage`] order.
const KEYS: [&[u8]; 3] = [b"\"cached_tokens\"", b"\"completion_tokens\"", b"\"e2e_latency\""];

/// The last values a response carried.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens the worker found in its cache.
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Seconds from arrival to the end of the request, as the worker measured it.
    pub e2e_latency: Option<f64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Step {
    /// Looking for a key: how far each key's pattern is matched.
    #[default]
    Seek,
    /// A key matched: whitespace, then `:`.
    Colon(u8),
    /// After the colon: whitespace, then the number.
    Value(u8),
    /// Inside the number.
    Number(u8),
}

/// The incremental scanner; feed it every chunk, read [`usage`](Self::usage) at the end.
#[derive(Clone, Debug, Default)]
pub struct UsageScanner {
    step: Step,
    /// How many bytes of each key's pattern the input ends with.
    matched: [u8; KEYS.len()],
    /// The previous byte was a backslash that escapes the next one.
    escaped: bool,
    number: [u8; MAX_NUMBER],
    number_len: u8,
    /// The number is longer than [`MAX_NUMBER`]: it is dropped.
    number_long: bool,
    usage: Usage,
    /// Bytes seen.
    seen: u64,
}

impl UsageScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// What the bytes so far carried (a number still being read is not in it yet).
    pub fn usage(&self) -> Usage {
        let mut copy = self.clone();
        copy.finish();
        copy.usage
    }

    /// Bytes fed so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Reads the next bytes of the response.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.seen = self.seen.saturating_add(chunk.len() as u64);
        let mut rest = chunk;
        loop {
            if self.idle() {
                // Only a quote or a backslash can change an idle scanner: skip to the next one.
                match quote_or_backslash(rest) {
                    Some(at) => rest = rest.get(at..).unwrap_or_default(),
                    None => return,
                }
                // An unescaped quote with the bytes after it in this chunk: compared with each
                // key at once, not byte by byte. No key there leaves the scanner idle after the
                // quote (a key starts only at a quote); a whole key leaves it before the colon.
                if let [b'"', next, ..] = rest {
                    // Most strings of a response (`"text"`, `"id"`, a closing quote before
                    // `:` or `,`) start with a byte no key starts with: one step.
                    if !KEYS.iter().any(|k| k.get(1) == Some(next)) {
                        rest = rest.get(1..).unwrap_or_default();
                        continue;
                    }
                    match key_at(rest) {
                        KeyAt::None => {
                            rest = rest.get(1..).unwrap_or_default();
                            continue;
                        }
                        KeyAt::Key(k, len) => {
                            self.step = Step::Colon(k);
                            rest = rest.get(len..).unwrap_or_default();
                        }
                        // The chunk ends inside what may be a key: byte by byte from here.
                        KeyAt::Cut => {}
                    }
                }
            }
            let Some((&b, tail)) = rest.split_first() else { return };
            self.byte(b);
            rest = tail;
        }
    }

    /// Looking for a key with nothing matched and no pending escape: any byte but `"` and `\`
    /// leaves the scanner as it is.
    fn idle(&self) -> bool {
        self.step == Step::Seek && !self.escaped && self.matched == [0; KEYS.len()]
    }

    /// The response ended: a number at the very end counts.
    fn finish(&mut self) {
        if let Step::Number(key) = self.step {
            self.store(key);
            self.step = Step::Seek;
        }
    }

    fn byte(&mut self, b: u8) {
        match self.step {
            Step::Seek => self.seek(b),
            Step::Colon(key) => match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b':' => self.step = Step::Value(key),
                _ => self.restart(b),
            },
            Step::Value(key) => match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b'0'..=b'9' | b'-' => self.start_number(key, b),
                // `null`, a string, an object: not a number, nothing to keep.
                _ => self.restart(b),
            },
            Step::Number(key) => match b {
                b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-' => self.push_digit(b),
                _ => {
                    self.store(key);
                    self.restart(b);
                }
            },
        }
    }

    /// Back to looking for keys, with `b` read as the first byte of that search.
    fn restart(&mut self, b: u8) {
        self.step = Step::Seek;
        self.matched = [0; KEYS.len()];
        self.escaped = false;
        self.seek(b);
    }

    fn seek(&mut self, b: u8) {
        let escaped = self.escaped;
        self.escaped = b == b'\\' && !escaped;
        for (k, pattern) in KEYS.iter().enumerate() {
            let Some(m) = self.matched.get_mut(k) else { continue };
            let pos = usize::from(*m);
            *m = if pattern.get(pos) == Some(&b) && (pos > 0 || !escaped) {
                *m + 1
            } else if b == b'"' && !escaped {
                // The only quotes of a pattern are its first and last bytes, so a mismatch
                // can only restart the pattern at a quote.
                1
            } else {
                0
            };
            if usize::from(*m) == pattern.len() {
                self.matched = [0; KEYS.len()];
                self.step = Step::Colon(k as u8);
                return;
            }
        }
    }

    fn start_number(&mut self, key: u8, b: u8) {
        self.number_len = 0;
        self.number_long = false;
        self.step = Step::Number(key);
        self.push_digit(b);
    }

    fn push_digit(&mut self, b: u8) {
        match self.number.get_mut(usize::from(self.number_len)) {
            Some(slot) => {
                *slot = b;
                self.number_len += 1;
            }
            None => self.number_long = true,
        }
    }

    fn store(&mut self, key: u8) {
        if self.number_long {
            return;
        }
        let Some(text) = self.number.get(..usize::from(self.number_len)).and_then(|n| std::str::from_utf8(n).ok())
        else {
            return;
        };
        match key {
            0 => self.usage.cached_tokens = text.parse().ok().or(self.usage.cached_tokens),
            1 => self.usage.completion_tokens = text.parse().ok().or(self.usage.completion_tokens),
            _ => {
                if let Some(v) = text.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0) {
                    self.usage.e2e_latency = Some(v);
                }
            }
        }
    }
}

/// Where the first `"` or `\\` in `bytes` is: eight bytes a step (the gaps between a JSON
/// body's quotes are short, too short for a vector search's set-up to pay).
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // The lowest byte of `v` that is zero has its high bit set in the result (bits above it
    // may be set too, by the borrow: only the lowest is used).
    let zero_byte = |v: u64| v.wrapping_sub(ONES) & !v & HIGHS;
    let mut words = bytes.chunks_exact(8);
    for (i, word) in words.by_ref().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let w = u64::from_le_bytes(w);
        let hits = zero_byte(w ^ u64::from_ne_bytes([b'"'; 8])) | zero_byte(w ^ u64::from_ne_bytes([b'\\'; 8]));
        if hits != 0 {
            return Some(i * 8 + (hits.trailing_zeros() / 8) as usize);
        }
    }
    let tail = words.remainder();
    let at = tail.iter().position(|&c| c == b'"' || c == b'\\')?;
    Some(bytes.len() - tail.len() + at)
}

/// What starts at a quote: one of [`KEYS`] (its index and length), none, or the chunk ends
/// before that is known.
enum KeyAt {
    None,
    Key(u8, usize),
    Cut,
}

/// Which of [`KEYS`] `rest` (starting with a quote) starts with.
fn key_at(rest: &[u8]) -> KeyAt {
    let mut cut = false;
    for (k, key) in KEYS.iter().enumerate() {
        if rest.starts_with(key) {
            return KeyAt::Key(k as u8, key.len());
        }
        cut |= rest.len() < key.len() && key.starts_with(rest);
    }
    if cut {
        KeyAt::Cut
    } else {
        KeyAt::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(parts: &[&[u8]]) -> Usage {
        let mut s = UsageScanner::new();
        for p in parts {
            s.feed(p);
        }
        s.usage()
    }

    fn every_split(body: &[u8]) -> Vec<Usage> {
        (0..=body.len()).map(|i| scan(&[&body[..i], &body[i..]])).collect()
    }

    #[test]
    fn sglang_meta_info_and_openai_usage() {
        let sglang = br#"{"text":" w0 w1","meta_info":{"id":"a","prompt_tokens":40,"completion_tokens":2,"cached_tokens":32,"e2e_latency":0.0125}}"#;
        let want = Usage { cached_tokens: Some(32), completion_tokens: Some(2), e2e_latency: Some(0.0125) };
        assert_eq!(scan(&[sglang]), want);
        let openai = br#"{"id":"x","choices":[{"text":"a"}],"usage":{"prompt_tokens":9,"completion_tokens":3,
            "total_tokens":12,"prompt_tokens_details":{"cached_tokens" : 8}}}"#;
        assert_eq!(scan(&[openai]), Usage { cached_tokens: Some(8), completion_tokens: Some(3), e2e_latency: None });
        assert_eq!(scan(&[br#"{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}"#]), Usage::default());
    }

    #[test]
    fn every_chunk_boundary_reads_the_same() {
        let body = br#"{"meta_info":{"cached_tokens":1234,"completion_tokens":56,"e2e_latency":1.5e-1}}"#;
        let want = scan(&[body]);
        assert_eq!(want.cached_tokens, Some(1234));
        assert_eq!(want.e2e_latency, Some(0.15));
        for (i, got) in every_split(body).into_iter().enumerate() {
            assert_eq!(got, want, "split at {i}");
        }
        // One byte at a time.
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&bytes), want);
    }

    #[test]
    fn sse_the_last_event_carrying_the_key_wins() {
        let stream = b"data: {\"text\":\" w0\",\"meta_info\":{\"cached_tokens\":0,\"completion_tokens\":1}}\n\n\
            data: {\"text\":\" w0 w1\",\"meta_info\":{\"cached_tokens\":0,\"completion_tokens\":2}}\n\n\
            data: {\"choices\":[],\"usage\":{\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
            data: [DONE]\n\n";
        let want = Usage { cached_tokens: Some(16), completion_tokens: Some(2), e2e_latency: None };
        for (i, got) in every_split(stream).into_iter().enumerate() {
            assert_eq!(got, want, "split at {i}");
        }
    }

    #[test]
    fn generated_text_cannot_pass_for_a_key() {
        // The model wrote `"cached_tokens": 999` in its answer: escaped inside the string.
        let body = br#"{"text":"say \"cached_tokens\": 999 and \\\"cached_tokens\": 5","x\"cached_tokens":7,"meta_info":{"cached_tokens":3}}"#;
        assert_eq!(scan(&[body]).cached_tokens, Some(3));
        let only_text = br#"{"text":"\"cached_tokens\":999"}"#;
        assert_eq!(scan(&[only_text]).cached_tokens, None);
    }

    #[test]
    fn hostile_values_are_dropped_not_trusted() {
        let long = format!(r#"{{"cached_tokens":{}}}"#, "9".repeat(100));
        assert_eq!(scan(&[long.as_bytes()]).cached_tokens, None, "too long to be a count");
        assert_eq!(scan(&[br#"{"cached_tokens":-5}"#]).cached_tokens, None);
        assert_eq!(scan(&[br#"{"cached_tokens":1.5}"#]).cached_tokens, None);
        assert_eq!(scan(&[br#"{"cached_tokens":"12"}"#]).cached_tokens, None);
        assert_eq!(scan(&[br#"{"e2e_latency":-1}"#]).e2e_latency, None);
        assert_eq!(scan(&[br#"{"e2e_latency":1e999}"#]).e2e_latency, None);
        // A good value survives a later bad one.
        assert_eq!(scan(&[br#"{"cached_tokens":7}{"cached_tokens":"x"}"#]).cached_tokens, Some(7));
        // A number at the very end of the stream counts.
        assert_eq!(scan(&[br#"{"cached_tokens":4"#]).cached_tokens, Some(4));
    }

    /// The scanner fed one byte at a time through `byte`, without the idle skip.
    fn scan_bytewise(body: &[u8]) -> Usage {
        let mut s = UsageScanner::new();
        for &b in body {
            s.byte(b);
        }
        s.usage()
    }

    #[test]
    fn skipping_idle_bytes_and_whole_keys_reads_what_every_byte_reads() {
        let pieces: [&[u8]; 17] = [
            b"\"cached_tokens\"",
            b"\"completion_tokens\"",
            b"\"e2e_latency\"",
            b":",
            b" ",
            b"12",
            b"0.5",
            b"\\",
            b"\"",
            b"x",
            b"{",
            b"\"cached_",
            b"\"text\"",
            b"\"c",
            b"\"e",
            b"c",
            b"e2e",
        ];
        let mut rng = crate::rng::seeded(0x2545_f491_4f6c_dd1d);
        let mut next = || rand::RngCore::next_u64(&mut rng);
        for _ in 0..3000 {
            let len = (next() % 24) as usize;
            let body: Vec<u8> =
                (0..len).flat_map(|_| pieces[(next() % pieces.len() as u64) as usize].to_vec()).collect();
            let want = scan_bytewise(&body);
            assert_eq!(scan(&[&body]), want, "{}", String::from_utf8_lossy(&body));
            let cut = (next() as usize) % (body.len() + 1);
            assert_eq!(scan(&[&body[..cut], &body[cut..]]), want, "{}", String::from_utf8_lossy(&body));
            // Three chunks: a key can begin in one and end two chunks later.
            let (a, b) = (cut.min(body.len()), (cut + (next() as usize) % 20).min(body.len()));
            assert_eq!(scan(&[&body[..a], &body[a..b], &body[b..]]), want, "{}", String::from_utf8_lossy(&body));
        }
    }

    #[test]
    fn the_word_search_finds_the_first_quote_or_backslash() {
        for len in 0..40 {
            for at in 0..=len {
                for c in [b'"', b'\\'] {
                    let mut bytes = vec![b'a'; len];
                    // Bytes that differ from a quote or a backslash by one bit, and one above 0x7f.
                    for (i, b) in bytes.iter_mut().enumerate() {
                        *b = [b'#', b'!', b']', b'|', 0xa2, 0xdc, 0, b'a'][i % 8];
                    }
                    if at < len {
                        bytes[at] = c;
                        if at + 1 < len {
                            bytes[at + 1] = b'"';
                        }
                    }
                    let want = bytes.iter().position(|&b| b == b'"' || b == b'\\');
                    assert_eq!(quote_or_backslash(&bytes), want, "{bytes:?}");
                }
            }
        }
    }

    #[test]
    fn huge_and_deep_input_costs_no_memory() {
        let mut s = UsageScanner::new();
        let deep = "[".repeat(1 << 16);
        for _ in 0..64 {
            s.feed(deep.as_bytes());
            s.feed(&[b'"'; 4096]);
            s.feed(&[b'\\'; 4096]);
        }
        s.feed(br#""cached_tokens":12}"#);
        assert_eq!(s.usage().cached_tokens, Some(12));
        assert_eq!(s.seen(), 64 * ((1 << 16) + 4096 + 4096) + 19);
        assert!(std::mem::size_of::<UsageScanner>() < 128);
    }
}
