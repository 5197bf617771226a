//! Tenant ids (issue 47): where a request's tenant comes from, and its requests-per-second
//! window.
//!
//! The id comes from a configured header (kvmesh's `kvmesh-tenant`, llm-d's
//! `x-llm-d-inference-fairness-id`, SMG's `x-smg-tenant-id`, or the header Istio's
//! `RequestAuthentication` copies a JWT claim into), or from an identity a client cannot
//! forge: the SPIFFE id of the caller in `x-forwarded-client-cert`, in the element this Envoy
//! appended (the last one: Envoy sanitizes or appends, and a client's own elements come
//! before it). With the identity source the header is not read (the filter removes it).

/// The longest tenant id kept; a longer or malformed one counts as no tenant.
pub const MAX_TENANT_BYTES: usize = 128;
/// The label and table entry for tenants past the bound.
pub const OTHER: &str = "other";
/// Envoy's header for the caller's certificate.
pub const XFCC_HEADER: &str = "x-forwarded-client-cert";
/// The tenant header when none is configured.
pub const DEFAULT_TENANT_HEADER: &str = "kvmesh-tenant";

/// The validated tenant settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantParams {
    /// The tenant header (lower case): read, or with `xfcc` removed and not read.
    pub header: String,
    /// The id is the caller's SPIFFE id (the `URI` of the last `x-forwarded-client-cert`
    /// element), not the header.
    pub xfcc: bool,
    /// Requests per second a tenant may send through one Envoy (none: no limit).
    pub requests_per_second: Option<u32>,
    /// Tokens per minute a tenant may use through one Envoy (none: no limit).
    pub tokens_per_minute: Option<u64>,
    /// Tenants tracked at once per Envoy; the others share [`OTHER`]'s entry.
    pub max_tenants: usize,
    /// Weights in the fair share (`tenant_weight`, [`crate::fair`]); none given: no fair
    /// ordering (each class's queue is first come, first served).
    pub weights: Option<Vec<(String, u32)>>,
}

/// Whether `id` is usable as a tenant id as it is: 1 to [`MAX_TENANT_BYTES`] visible ASCII
/// characters other than the separators of records, labels and shared values.
pub fn valid_tenant(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_TENANT_BYTES
        && id.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b';' | b'=' | b'"' | b'\\' | b','))
}

/// The SPIFFE id in an `x-forwarded-client-cert` value: the `URI` key of its last element
/// (elements are separated by `,`, keys by `;`, values may be quoted), if it is a valid id.
pub fn xfcc_uri(value: &str) -> Option<&str> {
    if value.len() > 16 * 1024 {
        return None;
    }
    let last = split_outside_quotes(value, b',').last()?;
    split_outside_quotes(last, b';').find_map(|pair| {
        let (key, v) = pair.split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("uri") {
            return None;
        }
        let v = v.trim();
        let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v);
        (v.starts_with("spiffe://") && valid_tenant(v)).then_some(v)
    })
}

/// `s` split at `sep` where it is not inside double quotes.
fn split_outside_quotes(s: &str, sep: u8) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut quoted = false;
    let mut escaped = false;
    let mut cuts = Vec::new();
    for (i, b) in s.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b if b == sep && !quoted => {
                cuts.push((start, i));
                start = i + 1;
            }
            _ => {}
        }
    }
    cuts.push((start, s.len()));
    cuts.into_iter().filter_map(move |(a, b)| s.get(a..b))
}

/// A tenant's requests in the current one-second window, as the rate limit judges them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// The window's second (ms / 1000).
    pub second: u64,
    /// Requests counted in it.
    pub count: u32,
}

/// What the limit says about one more request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    pub limit: u32,
    /// Requests left in the window after this one (0 when refused).
    pub remaining: u32,
    /// Milliseconds until the window resets.
    pub reset_ms: u64,
}

impl Window {
    /// Counts one more request at `now_ms` under `limit` per second (a new second starts a
    /// new window); a refused request is not counted.
    pub fn hit(&mut self, limit: u32, now_ms: u64) -> Verdict {
        self.hit_with(limit, 0, now_ms)
    }

    /// As [`Self::hit`], with `elsewhere` requests more in this second (the rest of the
    /// fleet's, estimated as a steady rate: [`crate::fleet::per_second`]).
    pub fn hit_with(&mut self, limit: u32, elsewhere: u32, now_ms: u64) -> Verdict {
        let second = now_ms / 1000;
        if second != self.second {
            *self = Window { second, count: 0 };
        }
        let allowed = self.count.saturating_add(elsewhere) < limit;
        if allowed {
            self.count += 1;
        }
        let reset_ms = (second + 1) * 1000 - now_ms;
        Verdict { allowed, limit, remaining: limit.saturating_sub(self.count.saturating_add(elsewhere)), reset_ms }
    }
}

/// A tenant's tokens in the current one-minute window (uncached prompt tokens as a request is
/// routed, generated tokens as its response ends).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenWindow {
    /// The window's minute (ms / 60 000).
    pub minute: u64,
    pub tokens: u64,
}

/// The most tokens one charge counts (a hostile count clamps).
pub const MAX_TOKEN_CHARGE: u64 = 1 << 24;

impl TokenWindow {
    /// What the limit says about one more request at `now_ms`: refused once the window's
    /// tokens reached `limit` (a request's own tokens are not known before it runs).
    pub fn verdict(self, limit: u64, now_ms: u64) -> Verdict {
        self.verdict_with(limit, 0, now_ms)
    }

    /// As [`Self::verdict`], with `elsewhere` tokens more used this minute (the rest of the
    /// fleet's, estimated: [`crate::fleet::per_minute`]).
    pub fn verdict_with(self, limit: u64, elsewhere: u64, now_ms: u64) -> Verdict {
        let minute = now_ms / 60_000;
        let used = if minute == self.minute { self.tokens } else { 0 }.saturating_add(elsewhere);
        let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Verdict {
            allowed: used < limit,
            limit: clamp(limit),
            remaining: clamp(limit.saturating_sub(used)),
            reset_ms: (minute + 1) * 60_000 - now_ms,
        }
    }

    /// Counts `tokens` more at `now_ms` (a new minute starts a new window).
    pub fn charge(&mut self, tokens: u64, now_ms: u64) {
        let minute = now_ms / 60_000;
        if minute != self.minute {
            *self = TokenWindow { minute, tokens: 0 };
        }
        self.tokens = self.tokens.saturating_add(tokens.min(MAX_TOKEN_CHARGE));
    }
}

/// A duration as OpenAI's `x-ratelimit-reset-*` headers write it (`1s`, `250ms`, `6m0s`).
pub fn reset_text(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        1_000..=59_999 => format!("{:.3}s", ms as f64 / 1000.0),
        _ => format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spiffe_id_comes_from_the_last_xfcc_element() {
        let v = r#"By=spiffe://cluster.local/ns/gw/sa/gw;Hash=ab;Subject="CN=a,O=b";URI=spiffe://cluster.local/ns/team-a/sa/app"#;
        assert_eq!(xfcc_uri(v), Some("spiffe://cluster.local/ns/team-a/sa/app"));
        // A client's forged element first, the one Envoy appended last.
        let forged =
            r#"URI=spiffe://cluster.local/ns/admin/sa/x,By=spiffe://gw;URI="spiffe://cluster.local/ns/b/sa/y""#;
        assert_eq!(xfcc_uri(forged), Some("spiffe://cluster.local/ns/b/sa/y"));
        assert_eq!(xfcc_uri("Hash=ab;DNS=a.example"), None);
        assert_eq!(xfcc_uri("URI=http://not-spiffe"), None);
        assert_eq!(xfcc_uri(&format!("URI=spiffe://{}", "a".repeat(200))), None);
        assert_eq!(xfcc_uri(""), None);
    }

    #[test]
    fn the_rest_of_the_fleets_requests_take_their_part_of_the_second() {
        let mut w = Window { second: 0, count: 0 };
        assert_eq!(w.hit_with(5, 3, 100), Verdict { allowed: true, limit: 5, remaining: 1, reset_ms: 900 });
        assert!(w.hit_with(5, 3, 200).allowed);
        assert_eq!(w.hit_with(5, 3, 300), Verdict { allowed: false, limit: 5, remaining: 0, reset_ms: 700 });
        assert!(!Window { second: 1, count: 0 }.hit_with(5, u32::MAX, 1_000).allowed, "no overflow");
        assert!(w.hit_with(5, 0, 1_000).allowed, "a new second");
    }

    #[test]
    fn tenant_ids_are_bounded_and_clean() {
        assert!(valid_tenant("team-a"));
        assert!(!valid_tenant(""));
        assert!(!valid_tenant("a b"));
        assert!(!valid_tenant("a;b=c"));
        assert!(!valid_tenant(&"a".repeat(129)));
    }

    #[test]
    fn a_window_counts_a_second_then_starts_again() {
        let mut w = Window { second: 0, count: 0 };
        assert_eq!(w.hit(2, 1_100), Verdict { allowed: true, limit: 2, remaining: 1, reset_ms: 900 });
        assert!(w.hit(2, 1_500).allowed);
        assert_eq!(w.hit(2, 1_999), Verdict { allowed: false, limit: 2, remaining: 0, reset_ms: 1 });
        assert_eq!(w.hit(2, 2_000).remaining, 1, "a new second");
    }

    #[test]
    fn a_token_window_counts_a_minute_and_clamps() {
        let mut w = TokenWindow::default();
        w.charge(70, 60_500);
        assert_eq!(w.verdict(100, 61_000), Verdict { allowed: true, limit: 100, remaining: 30, reset_ms: 59_000 });
        w.charge(u64::MAX, 61_000);
        assert_eq!(w.tokens, 70 + MAX_TOKEN_CHARGE, "a hostile count clamps");
        assert!(!w.verdict(100, 119_999).allowed);
        assert!(w.verdict(100, 120_000).allowed, "the next minute");
        w.charge(5, 120_000);
        assert_eq!(w.tokens, 5);
    }

    #[test]
    fn reset_durations_read_as_openais() {
        assert_eq!(reset_text(250), "250ms");
        assert_eq!(reset_text(1_000), "1s");
        assert_eq!(reset_text(1_500), "1.500s");
        assert_eq!(reset_text(360_000), "6m0s");
    }
}
