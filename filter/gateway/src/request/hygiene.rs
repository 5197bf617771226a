//! What a client or a worker wrote that must not reach another reader as written: a trace
//! context that is not W3C's and a request id that is not one (they would reach the workers,
//! their logs and the access log), and the secrets in a passthrough answer (SGLang's
//! `/get_server_info` carries its `api_key`; the gateway adds the workers' key to the request).

use kvmesh_core::paths::{valid_request_id, valid_traceparent};

use crate::headers::Headers;
use crate::host::{Action, StreamHost};

/// A passthrough answer, buffered to its end, then with its secrets taken out (see
/// [`kvmesh_core::secrets`]); one too large to read is withheld.
pub(super) fn redact_answer(host: &dyn StreamHost, key: Option<&str>, size: usize, end_of_stream: bool) -> Action {
    use kvmesh_core::secrets;
    if !end_of_stream {
        return Action::Pause;
    }
    let out = match size {
        0 => None,
        n if n > secrets::MAX_REDACTED_BYTES => Some(secrets::withheld(n)),
        n => secrets::redact(&host.response_body(0..n), key),
    };
    if let Some(out) = out {
        if let Err(e) = host.set_response_body(size, &out) {
            log::warn!("cannot redact a passthrough answer: {e}");
        }
    }
    Action::Continue
}

/// The client's trace context and request id, read in one pass over the request headers.
pub(super) struct TraceHeaders<'a> {
    /// No `traceparent`, or exactly one in W3C's format.
    pub traceparent_ok: bool,
    /// The client's `x-request-id` when it sent exactly one that is usable as it is.
    pub request_id: Option<&'a str>,
    /// Whether it sent any `x-request-id` at all.
    pub request_id_seen: bool,
}

impl<'a> TraceHeaders<'a> {
    pub fn scan(headers: &'a Headers) -> Self {
        let (mut traceparents, mut ids) = (0u32, 0u32);
        let (mut traceparent_ok, mut request_id) = (true, None);
        for (name, value) in headers.raw_pairs() {
            let value = std::str::from_utf8(value).ok();
            if name.eq_ignore_ascii_case(b"traceparent") {
                traceparents += 1;
                traceparent_ok &= traceparents == 1 && value.is_some_and(valid_traceparent);
            } else if name.eq_ignore_ascii_case(b"x-request-id") {
                ids += 1;
                request_id = value.filter(|v| ids == 1 && valid_request_id(v));
            }
        }
        Self { traceparent_ok, request_id: request_id.filter(|_| ids == 1), request_id_seen: ids > 0 }
    }
}
