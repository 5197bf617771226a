//! [`NativeHost`]: the filter's [`StreamHost`] on an Envoy worker thread, over the dynamic-modules
//! ABI. "The" stream is the one whose hook is running, or the one the tick entered.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use envoy_dynamic_module::{Attribute, BodyKind, HeaderKind, Stream};
use kvmesh_gateway::headers::Headers;
use kvmesh_gateway::host::{Callout, HostError, LabelledMetric, Metric, StreamHost, VmHost};
use kvmesh_gateway::shared::{SetError, SharedStore};

use crate::outbox::Outbox;
use crate::store::{self, Stats};

/// Envoy, as seen from one worker thread.
pub struct NativeHost {
    /// The stream calls act on (0: none).
    stream: Cell<usize>,
    /// The stream whose hook is running: where [`StreamHost::enter_context`] comes back to.
    home: Cell<usize>,
    /// This thread's live streams of the configuration: Envoy's stream pointer by context id
    /// (ids are ours: a fast hash fits).
    contexts: RefCell<HashMap<u32, usize, foldhash::fast::RandomState>>,
    stats: Arc<Stats>,
    /// Callouts the main thread sends for this thread's streams (they outlive the stream).
    outbox: Arc<Outbox>,
    /// The answer of the callout whose hook is running: `:status` (None: no response) and body.
    callout: RefCell<(Option<u16>, Vec<u8>)>,
}

impl NativeHost {
    pub fn new(stats: Arc<Stats>, outbox: Arc<Outbox>) -> Self {
        Self {
            stream: Cell::new(0),
            home: Cell::new(0),
            contexts: RefCell::default(),
            stats,
            outbox,
            callout: RefCell::default(),
        }
    }

    /// Holds a callout's answer for the hook that hands it to the filter.
    pub fn set_callout_answer(&self, status: Option<u16>, body: Vec<u8>) {
        *self.callout.borrow_mut() = (status, body);
    }

    fn replace_body(&self, buffered: BodyKind, received: BodyKind, body: &[u8]) -> Result<(), HostError> {
        if self.stream().ok_or_else(no_stream)?.replace_body(buffered, received, body) {
            Ok(())
        } else {
            Err(HostError("Envoy holds no body to replace".into()))
        }
    }

    /// Makes `envoy` (the running hook's stream) "the" stream.
    pub fn run_for(&self, envoy: *mut c_void) {
        self.stream.set(envoy as usize);
        self.home.set(envoy as usize);
    }

    pub fn register(&self, context: u32, envoy: *mut c_void) {
        self.contexts.borrow_mut().insert(context, envoy as usize);
    }

    pub fn forget(&self, context: u32) {
        self.contexts.borrow_mut().remove(&context);
    }

    /// One of this thread's live streams (its Envoy pointer), if any.
    pub fn any_stream(&self) -> Option<usize> {
        self.contexts.borrow().values().next().copied()
    }

    /// This thread's streams of the configuration that Envoy has not destroyed yet.
    pub fn live_streams(&self) -> usize {
        self.contexts.borrow().len()
    }

    fn stream(&self) -> Option<Stream<'_>> {
        let ptr = self.stream.get();
        // SAFETY: set by the running hook to its stream, or by `enter_context` to a stream of
        // this thread that Envoy has not destroyed (streams leave `contexts` when destroyed).
        (ptr != 0).then(|| unsafe { Stream::new(ptr as *mut c_void) })
    }

    /// A header map, copied once (names that are not UTF-8 are left out when read).
    fn headers(&self, kind: HeaderKind) -> Headers {
        let pairs = self.stream().map(|s| s.headers(kind)).unwrap_or_default();
        Headers::from_byte_pairs(&pairs)
    }

    fn set_header(&self, kind: HeaderKind, name: &str, value: Option<&str>) -> Result<(), HostError> {
        let stream = self.stream().ok_or_else(no_stream)?;
        let ok = stream.set_header(kind, name, value.map(str::as_bytes));
        if kind == HeaderKind::Request {
            // As proxy-wasm's header writes do: the route is matched again.
            stream.clear_route_cache();
        }
        if ok {
            Ok(())
        } else {
            Err(HostError(format!("Envoy refused to set {name}")))
        }
    }

    /// What Envoy buffered of a body, then the chunk just received, up to `size` bytes.
    /// Bytes `range` of a body Envoy holds in several chunks, copied once.
    fn body(&self, kinds: [BodyKind; 2], range: std::ops::Range<usize>) -> Vec<u8> {
        let Some(stream) = self.stream() else { return Vec::new() };
        let mut out = Vec::with_capacity(range.end.saturating_sub(range.start).min(1 << 20));
        let mut at = 0; // where the next chunk starts in the body
        for chunk in kinds.into_iter().flat_map(|k| stream.body(k)) {
            let (from, to) = (range.start.max(at) - at, range.end.saturating_sub(at).min(chunk.len()));
            out.extend_from_slice(chunk.get(from..to).unwrap_or_default());
            at += chunk.len();
            if at >= range.end {
                break;
            }
        }
        out
    }

    pub fn body_size(&self, kinds: &[BodyKind]) -> usize {
        let Some(stream) = self.stream() else { return 0 };
        kinds.iter().map(|&k| stream.body_size(k)).sum()
    }
}

fn no_stream() -> HostError {
    HostError("no stream to act on".into())
}

pub fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl SharedStore for NativeHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        store::get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        store::set(key, value, cas)
    }
}

impl VmHost for NativeHost {
    /// A worker thread's plugin ticks on its streams' hooks alone.
    fn has_timer(&self) -> bool {
        false
    }
    fn now_nanos(&self) -> u64 {
        now_nanos()
    }
    fn node_id(&self) -> Option<String> {
        None
    }
    fn vm_memory_bytes(&self) -> u64 {
        0
    }
    fn increment(&self, metric: Metric) {
        self.stats.record(metric, 1);
    }
    fn record(&self, metric: Metric, value: u64) {
        self.stats.record(metric, value);
    }
    fn increment_labelled(&self, metric: LabelledMetric, value: &str) {
        self.stats.record_labelled(metric, value);
    }
}

impl StreamHost for NativeHost {
    fn request_headers(&self) -> Headers {
        self.headers(HeaderKind::Request)
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.set_header(HeaderKind::Request, name, value)
    }
    /// Every write, then one route-cache clear (not one per write).
    fn set_request_headers(&self, headers: &[(&str, Option<&str>)]) -> Result<(), HostError> {
        let stream = self.stream().ok_or_else(no_stream)?;
        let refused = headers
            .iter()
            .find(|(name, value)| !stream.set_header(HeaderKind::Request, name, value.map(str::as_bytes)));
        stream.clear_route_cache();
        match refused {
            Some((name, _)) => Err(HostError(format!("Envoy refused to set {name}"))),
            None => Ok(()),
        }
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.body([BodyKind::BufferedRequest, BodyKind::ReceivedRequest], 0..size)
    }
    /// The whole body (the filter replaces nothing less).
    fn set_request_body(&self, _size: usize, body: &[u8]) -> Result<(), HostError> {
        self.replace_body(BodyKind::BufferedRequest, BodyKind::ReceivedRequest, body)
    }
    fn response_headers(&self) -> Headers {
        self.headers(HeaderKind::Response)
    }
    /// One lookup in Envoy's map for each name, nothing else copied.
    fn response_header_values(&self, names: &[&str]) -> Vec<Option<String>> {
        let stream = self.stream();
        names
            .iter()
            .map(|name| {
                let value = stream?.header(HeaderKind::Response, name)?;
                std::str::from_utf8(value).ok().map(str::to_string)
            })
            .collect()
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.set_header(HeaderKind::Response, name, value)
    }
    fn response_body(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        self.body([BodyKind::BufferedResponse, BodyKind::ReceivedResponse], range)
    }
    fn response_code_details(&self) -> Option<String> {
        self.stream()?.attribute(Attribute::ResponseCodeDetails)
    }
    /// What Envoy holds of the response and the chunk of the running hook, as a whole.
    fn set_response_body(&self, _size: usize, body: &[u8]) -> Result<(), HostError> {
        self.replace_body(BodyKind::BufferedResponse, BodyKind::ReceivedResponse, body)
    }
    fn upstream_address(&self) -> Option<String> {
        self.stream()?.attribute(Attribute::UpstreamAddress)
    }
    /// With `kvmesh` as the reply's code details: Envoy fills in `dynamic_module` for empty
    /// ones, and the shipped configurations wrap local replies that carry details, except
    /// these (JSON already).
    fn send_reply(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError> {
        self.stream().ok_or_else(no_stream)?.send_response(status, headers, body, "kvmesh");
        Ok(())
    }
    /// Under the name Envoy gives a Wasm filter's property (`wasm.<key>`): one access-log
    /// format for both builds.
    fn set_filter_state(&self, key: &str, value: &str) -> Result<(), HostError> {
        let stream = self.stream().ok_or_else(no_stream)?;
        if stream.set_filter_state(&format!("wasm.{key}"), value.as_bytes()) {
            Ok(())
        } else {
            Err(HostError(format!("Envoy refused to set the filter state {key}")))
        }
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.stream().ok_or_else(no_stream)?.continue_encoding();
        Ok(())
    }
    fn resume_request(&self) -> Result<(), HostError> {
        self.stream().ok_or_else(no_stream)?.continue_decoding();
        Ok(())
    }
    /// Context 0 is the plugin's own (the tick's): back to the running hook's stream.
    fn enter_context(&self, context_id: u32) -> Result<(), HostError> {
        let ptr = if context_id == 0 {
            self.home.get()
        } else {
            *self.contexts.borrow().get(&context_id).ok_or_else(|| HostError("the stream is gone".into()))?
        };
        self.stream.set(ptr);
        Ok(())
    }
    /// On "the" stream: the answer comes to its `http_callout_done` hook, and Envoy cancels
    /// it when the stream ends.
    fn dispatch(&self, c: Callout<'_>) -> Result<u32, HostError> {
        let timeout_ms = u64::try_from(c.timeout.as_millis()).unwrap_or(u64::MAX);
        let id = self
            .stream()
            .ok_or_else(no_stream)?
            .callout(c.cluster, c.headers, c.body, timeout_ms)
            .map_err(|code| HostError(format!("Envoy refused the callout (code {code})")))?;
        // Envoy numbers callouts per stream from 1; the filter knows them as u32.
        u32::try_from(id).map_err(|_| HostError(format!("callout id {id} out of range")))
    }
    /// Through the main thread: a stream's own callout would be cancelled as the stream ends.
    fn dispatch_detached(&self, c: Callout<'_>) -> Result<(), HostError> {
        self.outbox.push(c)
    }
    fn callout_status(&self) -> Option<u16> {
        self.callout.borrow().0
    }
    fn callout_body(&self, size: usize) -> Vec<u8> {
        let answer = self.callout.borrow();
        answer.1.get(..size.min(answer.1.len())).unwrap_or_default().to_vec()
    }
}
