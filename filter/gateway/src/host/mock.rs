//! An in-memory [`StreamHost`] for native tests: one request's headers and bodies, the callouts and
//! gRPC messages sent, the replies given, a clock, stats, and shared data with Envoy's CAS
//! semantics (shared between the mocks of several "VMs" when cloned with [`MockHost::vm`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use super::{Callout, HostError, LabelledMetric, LinkHost, Metric, StreamHost, VmHost};
use crate::headers::Headers;
use crate::shared::fake::FakeStore;
use crate::shared::{SetError, SharedStore};

/// A callout the filter dispatched.
#[derive(Clone, Debug, PartialEq)]
pub struct SentCallout {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A local reply the filter sent.
#[derive(Clone, Debug, PartialEq)]
pub struct SentReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl SentReply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

/// A gRPC stream's initial metadata.
pub type Metadata = Vec<(String, Vec<u8>)>;

#[derive(Default)]
pub struct MockHost {
    pub store: Rc<FakeStore>,
    pub request_headers: RefCell<Vec<(String, String)>>,
    pub request_body: RefCell<Vec<u8>>,
    pub response_headers: RefCell<Vec<(String, String)>>,
    pub response_body: RefCell<Vec<u8>>,
    /// Bytes of the response body the filter has read, over all its reads.
    pub response_bytes_read: Cell<usize>,
    /// Envoy's response code details (None: the host does not say).
    pub code_details: RefCell<Option<String>>,
    /// The worker Envoy says answered (None: the host does not say).
    pub upstream: RefCell<Option<String>>,
    pub replies: RefCell<Vec<SentReply>>,
    pub resumed: Cell<u32>,
    /// Requests resumed after a pause (`resume_request`).
    pub resumed_requests: Cell<u32>,
    /// The contexts entered, in order (`enter_context`).
    pub entered: RefCell<Vec<u32>>,
    pub callouts: RefCell<Vec<SentCallout>>,
    /// The answer the callout callback reads: status and body.
    pub callout_answer: RefCell<(Option<u16>, Vec<u8>)>,
    /// Refuse dispatches (as Envoy does for an unknown cluster).
    pub refuse_dispatch: Cell<bool>,
    /// Refuse request header writes (to test failures after a decision).
    pub refuse_headers: Cell<bool>,
    pub grpc_opened: RefCell<Vec<(u32, String)>>,
    /// The initial metadata of each stream opened, by token.
    pub grpc_metadata: RefCell<Vec<(u32, Metadata)>>,
    pub grpc_sent: RefCell<Vec<(u32, Vec<u8>)>>,
    pub grpc_cancelled: RefCell<Vec<u32>>,
    pub grpc_inbox: RefCell<Vec<u8>>,
    pub refuse_grpc: Cell<bool>,
    /// Stream opens attempted (refused ones included).
    pub grpc_attempts: Cell<u32>,
    pub now_ms: Cell<u64>,
    pub metrics: RefCell<HashMap<Metric, Vec<u64>>>,
    /// Per-model counters: (metric, model) → count.
    pub labelled_metrics: RefCell<HashMap<(LabelledMetric, String), u64>>,
    /// The request's filter state as the filter set it (`set_filter_state`), in order.
    pub filter_state: RefCell<Vec<(String, String)>>,
    /// Every host call made, in order (each crosses the Wasm boundary in Envoy).
    pub calls: RefCell<Vec<&'static str>>,
    next_token: Cell<u32>,
}

impl MockHost {
    pub fn new() -> Self {
        Self { now_ms: Cell::new(1_000_000), ..Self::default() }
    }

    /// Another VM of the same Envoy: its own request and clock, the same shared data.
    pub fn vm(&self) -> Self {
        Self { store: Rc::clone(&self.store), now_ms: Cell::new(self.now_ms.get()), ..Self::default() }
    }

    /// Starts a new request (clears the per-request state).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
        let mut h = vec![(":method".to_string(), method.to_string()), (":path".to_string(), path.to_string())];
        h.extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        *self.request_headers.borrow_mut() = h;
        *self.request_body.borrow_mut() = body.to_vec();
        self.response_headers.borrow_mut().clear();
        self.response_body.borrow_mut().clear();
        *self.code_details.borrow_mut() = None;
        self.replies.borrow_mut().clear();
        self.callouts.borrow_mut().clear();
        self.filter_state.borrow_mut().clear();
        self.resumed.set(0);
    }

    /// A filter-state value the filter set for the request (tests).
    pub fn filter_state(&self, key: &str) -> Option<String> {
        self.filter_state.borrow().iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    pub fn request_header(&self, name: &str) -> Option<String> {
        self.request_headers.borrow().iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
    }

    /// A response from the worker (`via_upstream`).
    /// A response header as the filter left it (tests).
    pub fn response_header(&self, name: &str) -> Option<String> {
        self.response_headers.borrow().iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
    }

    pub fn set_response(&self, status: u16, body: &[u8]) {
        *self.response_headers.borrow_mut() = vec![(":status".into(), status.to_string())];
        *self.response_body.borrow_mut() = body.to_vec();
        *self.code_details.borrow_mut() = Some("via_upstream".into());
    }

    /// A response Envoy made itself, with its code details.
    pub fn set_local_response(&self, status: u16, details: &str) {
        self.set_response(status, b"");
        *self.code_details.borrow_mut() = Some(details.into());
    }

    pub fn reply(&self) -> Option<SentReply> {
        self.replies.borrow().last().cloned()
    }

    pub fn advance_ms(&self, ms: u64) {
        self.now_ms.set(self.now_ms.get() + ms);
    }

    pub fn metric_sum(&self, m: Metric) -> u64 {
        self.metrics.borrow().get(&m).map_or(0, |v| v.iter().sum())
    }

    pub fn metric_count(&self, m: Metric) -> usize {
        self.metrics.borrow().get(&m).map_or(0, Vec::len)
    }

    fn note(&self, call: &'static str) {
        self.calls.borrow_mut().push(call);
    }

    fn token(&self) -> u32 {
        self.next_token.set(self.next_token.get() + 1);
        self.next_token.get()
    }
}

fn set(list: &RefCell<Vec<(String, String)>>, name: &str, value: Option<&str>) {
    let mut list = list.borrow_mut();
    list.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    if let Some(v) = value {
        list.push((name.to_string(), v.to_string()));
    }
}

fn replace(buf: &RefCell<Vec<u8>>, size: usize, body: &[u8]) {
    let mut buf = buf.borrow_mut();
    let size = size.min(buf.len());
    buf.splice(..size, body.iter().copied());
}

impl SharedStore for MockHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.note("get");
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.note("set");
        self.store.set(key, value, cas)
    }
}

impl VmHost for MockHost {
    fn now_nanos(&self) -> u64 {
        self.note("now_nanos");
        self.now_ms.get() * 1_000_000
    }
    fn node_id(&self) -> Option<String> {
        self.note("node_id");
        Some("test-node".into())
    }
    fn vm_memory_bytes(&self) -> u64 {
        1 << 20
    }
    fn increment(&self, metric: Metric) {
        self.note("increment");
        self.metrics.borrow_mut().entry(metric).or_default().push(1);
    }
    fn record(&self, metric: Metric, value: u64) {
        self.note("record");
        self.metrics.borrow_mut().entry(metric).or_default().push(value);
    }
    fn increment_labelled(&self, metric: LabelledMetric, value: &str) {
        *self.labelled_metrics.borrow_mut().entry((metric, value.to_string())).or_default() += 1;
    }
}

impl LinkHost for MockHost {
    fn open_grpc_stream(
        &self,
        cluster: &str,
        _service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        self.grpc_attempts.set(self.grpc_attempts.get() + 1);
        if self.refuse_grpc.get() {
            return Err(HostError("ParseFailure".into()));
        }
        let token = self.token();
        self.grpc_opened.borrow_mut().push((token, format!("{cluster}/{method}")));
        self.grpc_metadata
            .borrow_mut()
            .push((token, metadata.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect()));
        Ok(token)
    }
    fn send_grpc(&self, token: u32, message: &[u8], _end_of_stream: bool) -> Result<(), HostError> {
        self.note("send_grpc");
        if self.refuse_grpc.get() {
            return Err(HostError("closed".into()));
        }
        self.grpc_sent.borrow_mut().push((token, message.to_vec()));
        Ok(())
    }
    fn cancel_grpc(&self, token: u32) {
        self.note("cancel_grpc");
        self.grpc_cancelled.borrow_mut().push(token);
    }
    fn grpc_message(&self, size: usize) -> Vec<u8> {
        self.note("grpc_message");
        let m = self.grpc_inbox.borrow();
        m[..size.min(m.len())].to_vec()
    }
}

impl StreamHost for MockHost {
    fn request_headers(&self) -> Headers {
        self.note("request_headers");
        Headers::from_pairs(self.request_headers.borrow().iter().map(|(n, v)| (n.as_str(), v.as_bytes())))
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.note("set_request_header");
        if self.refuse_headers.get() {
            return Err(HostError("refused".into()));
        }
        set(&self.request_headers, name, value);
        Ok(())
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.note("request_body");
        let b = self.request_body.borrow();
        b[..size.min(b.len())].to_vec()
    }
    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        self.note("set_request_body");
        replace(&self.request_body, size, body);
        Ok(())
    }
    fn response_headers(&self) -> Headers {
        self.note("response_headers");
        Headers::from_pairs(self.response_headers.borrow().iter().map(|(n, v)| (n.as_str(), v.as_bytes())))
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.note("set_response_header");
        set(&self.response_headers, name, value);
        Ok(())
    }
    fn response_body(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        self.note("response_body");
        let b = self.response_body.borrow();
        let part = b.get(range.start.min(b.len())..range.end.min(b.len())).unwrap_or_default();
        self.response_bytes_read.set(self.response_bytes_read.get() + part.len());
        part.to_vec()
    }
    fn response_code_details(&self) -> Option<String> {
        self.note("response_code_details");
        self.code_details.borrow().clone()
    }
    fn upstream_address(&self) -> Option<String> {
        self.note("upstream_address");
        self.upstream.borrow().clone()
    }
    fn set_response_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        self.note("set_response_body");
        replace(&self.response_body, size, body);
        Ok(())
    }
    fn send_reply(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError> {
        self.note("send_reply");
        self.replies.borrow_mut().push(SentReply {
            status,
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: body.to_vec(),
        });
        Ok(())
    }
    fn set_filter_state(&self, key: &str, value: &str) -> Result<(), HostError> {
        self.note("set_filter_state");
        self.filter_state.borrow_mut().push((key.to_string(), value.to_string()));
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.note("resume_response");
        self.resumed.set(self.resumed.get() + 1);
        Ok(())
    }
    fn resume_request(&self) -> Result<(), HostError> {
        self.note("resume_request");
        self.resumed_requests.set(self.resumed_requests.get() + 1);
        Ok(())
    }
    fn enter_context(&self, context_id: u32) -> Result<(), HostError> {
        self.note("enter_context");
        self.entered.borrow_mut().push(context_id);
        Ok(())
    }
    fn dispatch(&self, callout: Callout<'_>) -> Result<u32, HostError> {
        self.note("dispatch");
        if self.refuse_dispatch.get() {
            return Err(HostError("BadArgument".into()));
        }
        let token = self.token();
        self.callouts.borrow_mut().push(SentCallout {
            token,
            cluster: callout.cluster.to_string(),
            headers: callout.headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: callout.body.to_vec(),
        });
        Ok(token)
    }
    fn callout_status(&self) -> Option<u16> {
        self.note("callout_status");
        self.callout_answer.borrow().0
    }
    fn callout_body(&self, size: usize) -> Vec<u8> {
        self.note("callout_body");
        let a = self.callout_answer.borrow();
        a.1[..size.min(a.1.len())].to_vec()
    }
}
