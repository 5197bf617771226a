//! What the filter writes on the requests it sends workers: the destination headers Envoy's
//! router and workers' cluster read, the workers' key, and the prefill callout's headers.

use crate::gateway::{endpoint_list, Destination};
use crate::host::StreamHost;
use crate::pd::PREFILLER_HEADER;

/// The header Envoy's ORIGINAL_DST cluster (`use_http_header`) connects to: the chosen
/// worker (for clusters that pin one host; no failover there).
pub const DST_HEADER: &str = "x-envoy-original-dst-host";
/// The header the workers' cluster's `override_host` load balancer reads: the chosen worker,
/// then the ones Envoy fails over to, in order (as the Gateway API Inference Extension uses it).
pub const ENDPOINTS_HEADER: &str = "x-gateway-destination-endpoint";
/// How many times Envoy's router may retry (fail over): one less than the workers listed.
pub const RETRIES_HEADER: &str = "x-envoy-max-retries";
/// The request's whole time budget (all attempts), from `request_timeout_secs`.
pub const TIMEOUT_HEADER: &str = "x-envoy-upstream-rq-timeout-ms";
/// Whether a client request header also goes to the prefill leg: end-to-end headers do;
/// pseudo-headers, hop-by-hop headers, routing headers, Envoy's internal `x-envoy-*` headers and
/// the ones the callout sets itself do not.
pub(super) fn forwarded_to_prefill(name: &str) -> bool {
    const NOT: [&str; 14] = [
        "host",
        "content-length",
        "content-type",
        "x-request-id",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    ];
    let lower = name.to_ascii_lowercase();
    !lower.starts_with(':')
        && !lower.starts_with("x-envoy-")
        && !is_routing_header(&lower)
        && !NOT.contains(&lower.as_str())
}

/// Points the request at `addr`, with `fallbacks` for Envoy to fail over to, and bounds it by
/// the request timeout (Envoy answers a JSON 504 past it). `addr` alone goes in
/// [`DST_HEADER`] too unless the configuration says no cluster reads it (each header written
/// is a host call on every request).
pub(super) fn set_destination(
    host: &dyn StreamHost,
    addr: &str,
    fallbacks: &[String],
    how: &Destination,
) -> Result<(), crate::host::HostError> {
    let (endpoints, retries) = (endpoint_list(addr, fallbacks), fallbacks.len().to_string());
    let timeout = how.timeout_secs.saturating_mul(1000).to_string();
    let all = [
        (DST_HEADER, Some(addr)),
        (ENDPOINTS_HEADER, Some(endpoints.as_str())),
        (RETRIES_HEADER, Some(retries.as_str())),
        (TIMEOUT_HEADER, Some(timeout.as_str())),
        ("authorization", how.authorization.as_deref()),
    ];
    // Without the original_dst header, the first write is left out; without a workers' key,
    // the last (the client's authorization passes).
    let (start, end) = (usize::from(!how.original_dst), all.len() - usize::from(how.authorization.is_none()));
    host.set_request_headers(all.get(start..end).unwrap_or_default())
}

/// A JSON POST of `path` to the worker at `addr`, through the workers' cluster.
pub(super) fn callout_headers<'a>(path: &'a str, addr: &'a str) -> [(&'a str, &'a str); 6] {
    [
        (":method", "POST"),
        (":path", path),
        (":authority", addr),
        (DST_HEADER, addr),
        (ENDPOINTS_HEADER, addr),
        ("content-type", "application/json"),
    ]
}

/// Whether a client-sent request header could steer routing and must be dropped.
pub fn is_routing_header(name: &str) -> bool {
    // Every request header passes here: no allocation, and most leave at the first byte.
    name.as_bytes().first().is_some_and(|c| c.eq_ignore_ascii_case(&b'x'))
        && (name.eq_ignore_ascii_case("x-envoy-original-dst-host")
            || name.eq_ignore_ascii_case("x-gateway-destination-endpoint")
            || name.eq_ignore_ascii_case(PREFILLER_HEADER)
            || name.get(..9).is_some_and(|p| p.eq_ignore_ascii_case("x-kvmesh-")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_headers_are_recognised() {
        for h in [
            "x-envoy-original-dst-host",
            "X-Gateway-Destination-Endpoint",
            "x-kvmesh-worker",
            "x-kvmesh-anything",
            "X-Prefiller-Host-Port",
        ] {
            assert!(is_routing_header(h), "{h}");
        }
        for h in ["x-request-id", "content-type", "x-envoy-expected-rq-timeout-ms"] {
            assert!(!is_routing_header(h), "{h}");
        }
    }
}
