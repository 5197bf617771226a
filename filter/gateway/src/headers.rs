//! A header map as the proxy-wasm ABI hands it over, read in place: one host call and one
//! buffer for the whole map, no allocation per header, and no panic on values that are not
//! UTF-8 (HTTP allows bytes above 0x7f in values; the SDK's own decoder unwraps them as UTF-8,
//! so one such header from a client would kill the VM).

/// The ABI's serialization: a `u32` count, a `(u32 name length, u32 value length)` pair per
/// header, then each name and each value followed by a NUL byte (integers little-endian).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers {
    raw: Vec<u8>,
}

fn u32_at(raw: &[u8], at: usize) -> Option<usize> {
    let bytes: [u8; 4] = raw.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(bytes)).ok()
}

impl Headers {
    /// A map as the host serialized it (malformed bytes read as the headers before them).
    pub fn from_raw(raw: Vec<u8>) -> Self {
        Self { raw }
    }

    /// Serializes `pairs` as the host would (tests, the mock host).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let pairs: Vec<(&[u8], &[u8])> = pairs.into_iter().map(|(k, v)| (k.as_bytes(), v)).collect();
        Self::from_byte_pairs(&pairs)
    }

    /// Serializes `pairs` as the host would, names as bytes (the native build's host: what
    /// Envoy lends, copied once). A name that is not UTF-8 is kept here and left out when read,
    /// as from a map the host serialized.
    pub fn from_byte_pairs(pairs: &[(&[u8], &[u8])]) -> Self {
        // One allocation: a count, two lengths and two NULs per header, then the bytes.
        let size = pairs.iter().fold(4usize, |n, (k, v)| n.saturating_add(10 + k.len() + v.len()));
        let mut raw = Vec::with_capacity(size);
        raw.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (name, value) in pairs {
            raw.extend_from_slice(&(name.len() as u32).to_le_bytes());
            raw.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (name, value) in pairs {
            raw.extend_from_slice(name);
            raw.push(0);
            raw.extend_from_slice(value);
            raw.push(0);
        }
        Self { raw }
    }

    /// Every header as bytes, in order; stops at the first entry that does not fit the buffer.
    pub fn raw_pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        let count = u32_at(&self.raw, 0).unwrap_or(0);
        // Each header takes at least 10 bytes (8 of lengths, two NULs): a count that claims
        // more than fit is cut at what the buffer could hold.
        let count = count.min(self.raw.len() / 10);
        let mut data = 4 + count * 8;
        (0..count).map_while(move |i| {
            let name_len = u32_at(&self.raw, 4 + i * 8)?;
            let value_len = u32_at(&self.raw, 8 + i * 8)?;
            let name_end = data.checked_add(name_len)?;
            let value_start = name_end.checked_add(1)?;
            let value_end = value_start.checked_add(value_len)?;
            let name = self.raw.get(data..name_end)?;
            let value = self.raw.get(value_start..value_end)?;
            data = value_end.checked_add(1)?;
            Some((name, value))
        })
    }

    /// The headers whose name and value are UTF-8 (others are left out).
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.raw_pairs().filter_map(|(n, v)| Some((std::str::from_utf8(n).ok()?, std::str::from_utf8(v).ok()?)))
    }

    /// Every header's name (whatever its value).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.raw_pairs().filter_map(|(n, _)| std::str::from_utf8(n).ok())
    }

    /// The first value of `name` (any case), if it is UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        let (_, v) = self.raw_pairs().find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))?;
        std::str::from_utf8(v).ok()
    }

    /// [`Headers::get`] for each of `names` (lower case), in one pass over the map.
    pub fn lookup<const N: usize>(&self, names: [&str; N]) -> [Option<&str>; N] {
        let mut found = [None; N];
        let mut seen = [false; N];
        for (name, value) in self.raw_pairs() {
            for ((wanted, slot), seen) in names.iter().zip(&mut found).zip(&mut seen) {
                if !*seen && name.len() == wanted.len() && name.eq_ignore_ascii_case(wanted.as_bytes()) {
                    *seen = true;
                    *slot = std::str::from_utf8(value).ok();
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_wrote_and_looks_up_any_case() {
        let h = Headers::from_pairs([(":path", &b"/generate"[..]), ("Content-Length", b"12"), ("x-empty", b"")]);
        assert_eq!(h.get(":path"), Some("/generate"));
        assert_eq!(h.get("content-length"), Some("12"));
        assert_eq!(h.get("x-empty"), Some(""));
        assert_eq!(h.get("x-missing"), None);
        assert_eq!(h.pairs().count(), 3);
        assert_eq!(Headers::default().pairs().count(), 0);
    }

    #[test]
    fn a_lookup_finds_what_get_finds() {
        let h = Headers::from_pairs([
            (":path", &b"/generate"[..]),
            ("X-Request-Id", b"caf\xe9"),
            ("x-request-id", b"r2"),
            ("Content-Length", b"12"),
            (":path", b"/second"),
        ]);
        let names = [":path", "x-request-id", "content-length", "x-missing", ":method"];
        assert_eq!(h.lookup(names), names.map(|n| h.get(n)));
        assert_eq!(h.lookup(names), [Some("/generate"), None, Some("12"), None, None]);
        assert_eq!(Headers::default().lookup([":path"]), [None]);
    }

    #[test]
    fn a_value_that_is_not_utf8_is_left_out_but_its_name_is_seen() {
        let h = Headers::from_pairs([("x-latin1", &b"caf\xe9"[..]), ("x-request-id", b"r1")]);
        assert_eq!(h.get("x-latin1"), None);
        assert_eq!(h.pairs().collect::<Vec<_>>(), vec![("x-request-id", "r1")]);
        assert_eq!(h.names().collect::<Vec<_>>(), vec!["x-latin1", "x-request-id"]);
    }

    /// The native build copies Envoy's map with names as bytes: a name that is not UTF-8 is
    /// neither a name nor found, and the headers after it read as usual.
    #[test]
    fn a_name_that_is_not_utf8_is_left_out_when_read() {
        let h = Headers::from_byte_pairs(&[(b"x-\xff", b"v"), (b":path", b"/generate"), (b"x-kvmesh-worker", b"w")]);
        assert_eq!(h.names().collect::<Vec<_>>(), vec![":path", "x-kvmesh-worker"]);
        assert_eq!(h.get(":path"), Some("/generate"));
        assert_eq!(h.pairs().count(), 2);
        assert_eq!(h.raw_pairs().count(), 3);
        assert_eq!(Headers::from_byte_pairs(&[(b"a", b"1")]), Headers::from_pairs([("a", &b"1"[..])]));
    }

    #[test]
    fn malformed_buffers_read_as_the_headers_that_fit() {
        let good = Headers::from_pairs([("a", &b"1"[..]), ("b", b"2")]);
        // Cut anywhere: never a panic, only the headers that are whole.
        for cut in 0..good.raw.len() {
            let h = Headers::from_raw(good.raw[..cut].to_vec());
            assert!(h.pairs().count() <= 2);
        }
        // A count far beyond the buffer, lengths that overflow.
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&[0; 16]);
        assert_eq!(Headers::from_raw(huge).pairs().count(), 0);
        assert_eq!(Headers::from_raw(vec![1, 2]).raw_pairs().count(), 0);
    }
}
