//! Experiment, not shipped: kvmesh's filter as a native Envoy dynamic module
//! (`envoy.filters.http.dynamic_modules`, `libkvmesh_native.so`), to measure what the Wasm
//! boundary costs (`cargo xtask bench instructions` and `overhead` run it beside the `.wasm`).
//!
//! [`NativeHost`] implements the filter's [`Host`] over the dynamic-modules ABI for the
//! request path of regular mode: headers, bodies, local replies, resuming, time, and shared
//! data (kept in this process, with Envoy's compare-and-swap), stats (Envoy names them
//! `dynamicmodulescustom.<name>`). Each Envoy worker thread gets its own [`Plugin`], as each
//! gets its own VM under Wasm, so the same code decides. Not here: the tick (like the
//! `slow-tick` build it is compared with), HTTP callouts (PD) and the control plane's gRPC
//! streams — static workers only. A panic is caught at each hook
//! (it would otherwise abort Envoy) and the stream goes on unrouted.

#![allow(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use envoy_dynamic_module::{
    borrow_from_envoy, define_stat, drop_from_envoy, empty_hooks, into_envoy, Attribute, BodyKind, Buffer, HeaderKind,
    StatKind, Stream, CONTINUE, STOP,
};
use kvmesh_filter::headers::Headers;
use kvmesh_filter::host::{Action, Callout, Host, HostError, Metric, MetricKind};
use kvmesh_filter::plugin::Plugin;
use kvmesh_filter::request::RequestFilter;
use kvmesh_filter::shared::{SetError, SharedStore};

empty_hooks!();

/// A shared-data value and its compare-and-swap version, by key.
type Values = HashMap<String, (Vec<u8>, u32)>;

/// Shared data across the process's threads, as Envoy keeps it across VMs.
static SHARED: Mutex<Option<Values>> = Mutex::new(None);

/// Envoy, as seen from one worker thread; "the" stream is the one whose hook is running.
#[derive(Default)]
pub struct NativeHost {
    stream: Cell<usize>,
    /// Stat ids, in [`Metric::ALL`] order (None: Envoy refused to define it).
    stats: Vec<Option<usize>>,
}

impl NativeHost {
    fn stream(&self) -> Stream<'_> {
        // SAFETY: set by the running hook to the stream it was given (see `Streamed::with`).
        unsafe { Stream::new(self.stream.get() as *mut c_void) }
    }

    /// A header map, copied (names that are not UTF-8 left out: HTTP names are tokens).
    fn headers(&self, kind: HeaderKind) -> Headers {
        let pairs = self.stream().headers(kind);
        Headers::from_pairs(pairs.into_iter().filter_map(|(k, v)| Some((std::str::from_utf8(k).ok()?, v))))
    }

    fn set_header(&self, kind: HeaderKind, name: &str, value: Option<&str>) -> Result<(), HostError> {
        let stream = self.stream();
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
    fn body(&self, kinds: [BodyKind; 2], size: usize) -> Vec<u8> {
        let stream = self.stream();
        let mut out = Vec::with_capacity(size.min(1 << 20));
        for chunk in kinds.into_iter().flat_map(|k| stream.body(k)) {
            let room = size.saturating_sub(out.len());
            out.extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
        }
        out
    }

    fn body_size(&self, kinds: &[BodyKind]) -> usize {
        let stream = self.stream();
        kinds.iter().flat_map(|&k| stream.body(k)).map(<[u8]>::len).sum()
    }
}

fn stat_kind(kind: MetricKind) -> StatKind {
    match kind {
        MetricKind::Counter => StatKind::Counter,
        MetricKind::Gauge => StatKind::Gauge,
        MetricKind::Histogram => StatKind::Histogram,
    }
}

fn unsupported<T>(what: &str) -> Result<T, HostError> {
    Err(HostError(format!("{what}: not in the native experiment")))
}

impl SharedStore for NativeHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let Ok(guard) = SHARED.lock() else { return (None, None) };
        match guard.as_ref().and_then(|m| m.get(key)) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let Ok(mut guard) = SHARED.lock() else { return Err(SetError::Other) };
        let entry = guard.get_or_insert_with(HashMap::new).entry(key.to_string()).or_insert((Vec::new(), 0));
        if matches!(cas, Some(c) if c != 0 && c != entry.1) {
            return Err(SetError::CasMismatch);
        }
        *entry = (value.to_vec(), entry.1.wrapping_add(1));
        Ok(())
    }
}

impl Host for NativeHost {
    fn request_headers(&self) -> Headers {
        self.headers(HeaderKind::Request)
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.set_header(HeaderKind::Request, name, value)
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.body([BodyKind::BufferedRequest, BodyKind::ReceivedRequest], size)
    }
    fn set_request_body(&self, _size: usize, _body: &[u8]) -> Result<(), HostError> {
        unsupported("set_request_body")
    }
    fn response_headers(&self) -> Headers {
        self.headers(HeaderKind::Response)
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        self.set_header(HeaderKind::Response, name, value)
    }
    fn response_body(&self, size: usize) -> Vec<u8> {
        self.body([BodyKind::BufferedResponse, BodyKind::ReceivedResponse], size)
    }
    fn response_code_details(&self) -> Option<String> {
        self.stream().attribute(Attribute::ResponseCodeDetails)
    }
    fn set_response_body(&self, _size: usize, _body: &[u8]) -> Result<(), HostError> {
        unsupported("set_response_body")
    }
    fn upstream_address(&self) -> Option<String> {
        self.stream().attribute(Attribute::UpstreamAddress)
    }
    fn send_reply(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError> {
        self.stream().send_response(status, headers, body, "kvmesh");
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.stream().continue_encoding();
        Ok(())
    }
    fn resume_request(&self) -> Result<(), HostError> {
        self.stream().continue_decoding();
        Ok(())
    }
    fn enter_context(&self, _context_id: u32) -> Result<(), HostError> {
        unsupported("enter_context")
    }
    fn dispatch(&self, _callout: Callout<'_>) -> Result<u32, HostError> {
        unsupported("HTTP callouts")
    }
    fn callout_status(&self) -> Option<u16> {
        None
    }
    fn callout_body(&self, _size: usize) -> Vec<u8> {
        Vec::new()
    }
    fn open_grpc_stream(&self, _: &str, _: &str, _: &str, _: &[(&str, &[u8])]) -> Result<u32, HostError> {
        unsupported("gRPC streams")
    }
    fn send_grpc(&self, _token: u32, _message: &[u8], _end: bool) -> Result<(), HostError> {
        unsupported("gRPC streams")
    }
    fn cancel_grpc(&self, _token: u32) {}
    fn grpc_message(&self, _size: usize) -> Vec<u8> {
        Vec::new()
    }
    fn now_nanos(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
    fn node_id(&self) -> Option<String> {
        None
    }
    fn vm_memory_bytes(&self) -> u64 {
        0
    }
    fn increment(&self, metric: Metric) {
        self.record(metric, 1);
    }
    fn record(&self, metric: Metric, value: u64) {
        let pos = Metric::ALL.iter().position(|m| *m == metric);
        if let Some(id) = pos.and_then(|p| self.stats.get(p).copied().flatten()) {
            self.stream().stat(stat_kind(metric.kind()), id, value);
        }
    }
}

/// The configuration Envoy gave the filter (parsed per worker thread, as each VM does), and
/// the stats defined for it.
struct Config {
    /// Tells this configuration's per-thread plugins from an earlier one's.
    id: u64,
    bytes: Vec<u8>,
    stats: Vec<Option<usize>>,
}

static CONFIGS: AtomicU64 = AtomicU64::new(0);

/// One worker thread's plugin: what one VM holds under Wasm.
struct Thread {
    host: NativeHost,
    plugin: Plugin,
    next_context: Cell<u32>,
}

thread_local! {
    /// This thread's plugin for each configuration it served (a new configuration from Envoy
    /// gets new ones; the old ones stay, unused).
    static THREAD: RefCell<Vec<(u64, Rc<Thread>)>> = const { RefCell::new(Vec::new()) };
}

/// This worker thread's plugin for `config`, configured on its first stream.
fn thread(config: &Config) -> Option<Rc<Thread>> {
    THREAD.with(|t| {
        let mut t = t.borrow_mut();
        if let Some((_, thread)) = t.iter().find(|(id, _)| *id == config.id) {
            return Some(Rc::clone(thread));
        }
        let host = NativeHost { stream: Cell::new(0), stats: config.stats.clone() };
        let mut plugin = Plugin::default();
        let seed = kvmesh_core::rng::random_u64().unwrap_or_else(|_| host.now_nanos());
        if let Err(e) = plugin.configure(&host, &config.bytes, seed) {
            log::error!("{e}");
            return None;
        }
        let thread = Rc::new(Thread { host, plugin, next_context: Cell::new(1) });
        t.push((config.id, Rc::clone(&thread)));
        Some(thread)
    })
}

/// One stream's filter.
struct Streamed {
    thread: Rc<Thread>,
    filter: Rc<RefCell<RequestFilter>>,
}

impl Streamed {
    /// # Safety
    /// `m` is a pointer `filter_new` returned that Envoy has not destroyed yet.
    unsafe fn of<'a>(m: *mut c_void) -> Option<&'a Streamed> {
        borrow_from_envoy(m)
    }

    /// Runs `f` as the hook of Envoy's stream `envoy`; a panic (or a re-entered filter)
    /// answers `otherwise`.
    fn with<T>(&self, envoy: *mut c_void, otherwise: T, f: impl FnOnce(&mut RequestFilter, &NativeHost) -> T) -> T {
        self.thread.host.stream.set(envoy as usize);
        let Ok(mut filter) = self.filter.try_borrow_mut() else { return otherwise };
        catch_unwind(AssertUnwindSafe(|| f(&mut filter, &self.thread.host))).unwrap_or(otherwise)
    }
}

fn status(a: Action) -> u32 {
    match a {
        Action::Continue => CONTINUE,
        Action::Pause => STOP,
    }
}

/// # Safety
/// Envoy passes its buffers, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: *mut c_void,
    _name: Buffer,
    config: Buffer,
) -> *const c_void {
    let bytes = config.bytes().to_vec();
    // Validated here once, so that a bad configuration is refused at load.
    if kvmesh_core::Config::from_json(&bytes).is_err() {
        return std::ptr::null();
    }
    // Stats can only be defined now.
    let stats = Metric::ALL.iter().map(|m| define_stat(envoy, stat_kind(m.kind()), m.name())).collect();
    let id = CONFIGS.fetch_add(1, Ordering::Relaxed);
    into_envoy(Some(Config { id, bytes, stats }))
}

/// # Safety
/// `config` came from `config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *mut c_void) {
    drop_from_envoy::<Config>(config);
}

/// # Safety
/// `config` came from `config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *mut c_void,
    _envoy: *mut c_void,
) -> *mut c_void {
    let Some(config) = borrow_from_envoy::<Config>(config) else { return std::ptr::null_mut() };
    let made = catch_unwind(AssertUnwindSafe(|| {
        let thread = thread(config)?;
        let id = thread.next_context.get();
        thread.next_context.set(id.wrapping_add(1).max(1));
        let filter = thread.plugin.new_request(id);
        Some(Streamed { thread, filter })
    }));
    into_envoy(made.ok().flatten())
}

/// # Safety
/// `m` came from `filter_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: *mut c_void) {
    drop_from_envoy::<Streamed>(m);
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    f: *mut c_void,
    m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    let Some(s) = Streamed::of(m) else { return CONTINUE };
    status(s.with(f, Action::Continue, |filter, host| filter.on_request_headers(host, end_of_stream)))
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    f: *mut c_void,
    m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    let Some(s) = Streamed::of(m) else { return CONTINUE };
    status(s.with(f, Action::Continue, |filter, host| {
        let size = host.body_size(&[BodyKind::BufferedRequest, BodyKind::ReceivedRequest]);
        filter.on_request_body(host, size, end_of_stream)
    }))
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    f: *mut c_void,
    m: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    let Some(s) = Streamed::of(m) else { return CONTINUE };
    status(s.with(f, Action::Continue, |filter, host| filter.on_response_headers(host)))
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    f: *mut c_void,
    m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    let Some(s) = Streamed::of(m) else { return CONTINUE };
    status(s.with(f, Action::Continue, |filter, host| {
        // proxy-wasm passes the chunk's size (the filter never holds a response to buffer it).
        let size = host.body_size(&[BodyKind::ReceivedResponse]);
        filter.on_response_body(host, size, end_of_stream)
    }))
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(f: *mut c_void, m: *mut c_void) {
    if let Some(s) = Streamed::of(m) {
        s.with(f, (), |filter, host| filter.on_log(host));
    }
}
