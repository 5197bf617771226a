//! Which requests the gateway handles, and how: the three LLM endpoints are parsed and routed
//! (POST only), a short allowlist of read-only worker endpoints passes through to one worker,
//! and everything else — worker admin operations above all (flush cache, weight updates,
//! profiling, abort) — is refused by the gateway itself.
//!
//! Paths are matched after Envoy has normalised them (`normalize_path`, `merge_slashes`, escaped
//! slashes rejected): `POST /%67enerate` and `//generate` reach the filter as `/generate`.

use crate::request::Endpoint;

/// Read-only worker endpoints that pass through by default (GET or HEAD): sglang-router's
/// router-level set. An entry ending in `/*` matches that prefix.
pub const DEFAULT_PASSTHROUGH: [&str; 8] = [
    "/health",
    "/health_generate",
    "/liveness",
    "/readiness",
    "/get_model_info",
    "/get_server_info",
    "/v1/models",
    "/v1/models/*",
];

/// What the gateway does with a request line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathClass {
    /// An LLM endpoint, POSTed: parse the body and route it.
    Llm(Endpoint),
    /// An LLM endpoint with another method: 405 (`allow: POST`).
    WrongMethod,
    /// A read-only endpoint on the allowlist: to one healthy worker, unchanged.
    Passthrough,
    /// Anything else: 404 from the gateway.
    NotFound,
}

/// Classifies `method` and `path` (with or without a query string) against `passthrough`.
pub fn classify<S: AsRef<str>>(method: &str, path: &str, passthrough: &[S]) -> PathClass {
    let bare = path.split(['?', '#']).next().unwrap_or(path);
    if let Some(endpoint) = Endpoint::from_path(bare) {
        return if method == "POST" { PathClass::Llm(endpoint) } else { PathClass::WrongMethod };
    }
    let read_only = method == "GET" || method == "HEAD";
    if read_only && passthrough.iter().any(|p| allowed(p.as_ref(), bare)) {
        PathClass::Passthrough
    } else {
        PathClass::NotFound
    }
}

fn allowed(entry: &str, path: &str) -> bool {
    match entry.strip_suffix("/*") {
        // A prefix entry: `/v1/models/*` matches `/v1/models/x` (not `/v1/models` itself).
        Some(prefix) => path.strip_prefix(prefix).is_some_and(|rest| rest.len() > 1 && rest.starts_with('/')),
        None => entry == path,
    }
}

/// Whether a client's request id is used as is (1 to 128 visible ASCII characters, as SMG
/// honours, other than `"` and `\`, which would end or escape a quoted log field); any other
/// value is replaced by one the gateway generates.
pub fn valid_request_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

/// Whether a `traceparent` header is W3C Trace Context (`version-trace_id-parent_id-flags`:
/// lowercase hex, 2-32-16-2 digits, neither id all zeros, version `ff` invalid; a later
/// version may append `-` and fields of its own, version `00` may not). Any other value is not
/// propagated: it would reach the workers, their logs and the access log as the client wrote it.
pub fn valid_traceparent(value: &str) -> bool {
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    let (Some(head), rest) = (value.get(..55), value.get(55..).unwrap_or_default()) else {
        return false;
    };
    let mut parts = head.split('-');
    let (Some(version), Some(trace), Some(parent), Some(flags), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let sized = version.len() == 2 && trace.len() == 32 && parent.len() == 16 && flags.len() == 2;
    let tail_ok = match version {
        "00" => rest.is_empty(),
        _ => {
            rest.is_empty()
                || (rest.starts_with('-') && rest.len() <= 256 && rest.bytes().all(|b| b.is_ascii_graphic()))
        }
    };
    sized
        && [version, trace, parent, flags].iter().all(|p| hex(p))
        && version != "ff"
        && nonzero(trace)
        && nonzero(parent)
        && tail_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(method: &str, path: &str) -> PathClass {
        classify(method, path, &DEFAULT_PASSTHROUGH)
    }

    #[test]
    fn llm_endpoints_take_post_only() {
        assert_eq!(class("POST", "/generate"), PathClass::Llm(Endpoint::Generate));
        assert_eq!(class("POST", "/v1/chat/completions?x=1"), PathClass::Llm(Endpoint::ChatCompletions));
        for m in ["PUT", "GET", "PATCH", "DELETE"] {
            assert_eq!(class(m, "/generate"), PathClass::WrongMethod, "{m}");
        }
    }

    #[test]
    fn read_only_endpoints_pass_and_admin_ones_do_not() {
        for p in ["/v1/models", "/v1/models/llama", "/health", "/get_model_info", "/get_server_info?x"] {
            assert_eq!(class("GET", p), PathClass::Passthrough, "{p}");
        }
        assert_eq!(class("HEAD", "/health"), PathClass::Passthrough);
        for p in [
            "/flush_cache",
            "/update_weights_from_disk",
            "/init_weights_update_group",
            "/abort_request",
            "/start_profile",
            "/sleep",
            "/v1/models/",
            "/v1/modelsx",
            "/",
            "/generate/x",
        ] {
            assert_eq!(class("POST", p), PathClass::NotFound, "{p}");
            assert_eq!(class("GET", p), PathClass::NotFound, "{p}");
        }
        assert_eq!(class("POST", "/health"), PathClass::NotFound, "read-only paths are GET/HEAD only");
    }

    #[test]
    fn the_allowlist_is_configurable() {
        assert_eq!(classify("GET", "/metrics", &["/metrics"]), PathClass::Passthrough);
        assert_eq!(classify("GET", "/v1/models", &[] as &[&str]), PathClass::NotFound);
    }

    #[test]
    fn traceparents() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid_traceparent(good));
        assert!(valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra"));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 upstream=6.6.6.6:1 kvmesh=\"x\"",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-a b",
            "0é-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
        ] {
            assert!(!valid_traceparent(bad), "{bad}");
        }
    }

    #[test]
    fn request_ids() {
        assert!(valid_request_id("abc-123_X.y"));
        assert!(valid_request_id(&"a".repeat(128)));
        assert!(!valid_request_id(&"a".repeat(129)));
        assert!(!valid_request_id(""));
        assert!(!valid_request_id("has space"));
        assert!(!valid_request_id("tab\there"));
        assert!(!valid_request_id("é"));
        assert!(!valid_request_id("a\"b"));
        assert!(!valid_request_id("a\\b"));
    }
}
