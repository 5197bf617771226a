//! kvmesh's filter as a native Envoy dynamic module (`envoy.filters.http.dynamic_modules`,
//! `libkvmesh_native.so`): the same `RequestFilter`, `Gateway` and core as the `.wasm`, without
//! the Wasm boundary (`cargo xtask bench instructions` and `overhead` run it beside the
//! `.wasm`). Regular and PD mode, with static workers or with kvmesh-cp.
//!
//! - [`host::NativeHost`] implements the filter's `StreamHost` over the ABI on each Envoy worker
//!   thread; each thread has its own `Plugin` (as each has its own VM under Wasm), made on its
//!   first stream and dropped once Envoy replaces the configuration.
//! - Shared data and stats: [`store`] (in-process, with Envoy's compare-and-swap semantics;
//!   stats recorded through the configuration).
//! - The tick: Envoy gives HTTP-filter modules no timer on worker threads, so each thread ticks
//!   its plugin on its own streams' hooks once [`ticker::tick`] has passed, and the
//!   [`ticker`] thread wakes the threads holding requests in an admission queue through a
//!   stream scheduler ([`waiting`]).
//! - The control plane: the ticker thread's own plugin holds the streams ([`grpc`], tonic,
//!   to `control_plane_address`), applies snapshots and shares them with the worker threads'
//!   plugins through shared data, as the lease holder's VM does under Wasm.
//!
//! PD mode: the prefill leg is a per-stream HTTP callout. Every hook is
//! under `catch_unwind` (a panic across the C ABI would abort Envoy); a stream whose hook
//! panicked goes on unrouted, which the configuration answers with its 503.

#![allow(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use envoy_dynamic_module::{
    borrow_from_envoy, drop_from_envoy, empty_hooks, into_envoy, BodyKind, Buffer, HeaderPair, Scheduler, CONTINUE,
    STOP,
};
use kvmesh_gateway::host::Action;
use kvmesh_gateway::plugin::{own_link_address, Pacer, Plugin};
use kvmesh_gateway::request::RequestFilter;
use kvmesh_gateway::shared::admission::SharedBucket;

mod grpc;
mod host;
mod outbox;
mod store;
mod ticker;
mod waiting;

use host::NativeHost;
use outbox::Outbox;
use store::Stats;
use ticker::{tick, Link, Ticker};
use waiting::Waiting;

empty_hooks!();

/// The configuration Envoy gave the filter, and what belongs to it: its stats, its ticker,
/// its queue of paused streams.
struct Config {
    /// Tells this configuration's per-thread plugins from an earlier one's.
    id: u64,
    /// The plugin configuration the worker threads' plugins are made from.
    bytes: Vec<u8>,
    /// With a control plane, the worker threads' plugins follow the ticker's.
    follow: bool,
    stats: Arc<Stats>,
    waiting: Arc<Waiting>,
    /// Callouts that outlive their stream, sent by the main thread.
    outbox: Arc<Outbox>,
    /// False once Envoy destroyed the configuration: the threads drop their plugins for it.
    alive: Arc<AtomicBool>,
    /// Stopped (and joined) first when the configuration is dropped.
    _ticker: Ticker,
}

impl Drop for Config {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
        // On the main thread, where the configuration's scheduler was made.
        self.outbox.close();
    }
}

static CONFIGS: AtomicU64 = AtomicU64::new(0);

/// Validates the plugin configuration once (a bad one is refused at load) and says where the
/// control plane is, if anywhere.
fn parse(bytes: &[u8]) -> Result<(kvmesh_core::Config, Option<String>), String> {
    let config = kvmesh_core::Config::from_json(bytes).map_err(|e| format!("invalid configuration: {e}"))?;
    let address = own_link_address(&config)?.map(str::to_string);
    Ok((config, address))
}

/// One worker thread's plugin for one configuration: what one VM holds under Wasm.
struct Thread {
    config: u64,
    alive: Arc<AtomicBool>,
    host: NativeHost,
    plugin: RefCell<Plugin>,
    waiting: Arc<Waiting>,
    next_context: Cell<u32>,
    pacer: RefCell<Pacer>,
}

thread_local! {
    /// This thread's plugins, one for each live configuration it served.
    static THREADS: RefCell<Vec<Rc<Thread>>> = const { RefCell::new(Vec::new()) };
}

/// This worker thread's plugin for `config`, configured on its first stream.
fn thread(config: &Config) -> Option<Rc<Thread>> {
    THREADS.with(|t| {
        let mut t = t.borrow_mut();
        t.retain(|thread| thread.alive.load(Ordering::Acquire));
        if let Some(thread) = t.iter().find(|thread| thread.config == config.id) {
            return Some(Rc::clone(thread));
        }
        let host = NativeHost::new(Arc::clone(&config.stats), Arc::clone(&config.outbox));
        let mut plugin = Plugin::default();
        let seed = kvmesh_core::rng::random_u64().unwrap_or_else(|_| host::now_nanos());
        if let Err(e) = plugin.configure(&host, &config.bytes, seed) {
            log::error!("{e}");
            return None;
        }
        if config.follow {
            plugin.follow();
        }
        let thread = Rc::new(Thread {
            config: config.id,
            alive: Arc::clone(&config.alive),
            host,
            plugin: RefCell::new(plugin),
            waiting: Arc::clone(&config.waiting),
            next_context: Cell::new(1),
            pacer: RefCell::default(),
        });
        t.push(Rc::clone(&thread));
        Some(thread)
    })
}

impl Thread {
    /// The plugin's tick, from the hook of stream `envoy`, when [`tick`] has passed (or
    /// `always`): the table and index the ticker shared, ended requests, eviction, and the
    /// admission queue (requests admitted or expired in their own streams, then back).
    fn tick(&self, envoy: *mut c_void, always: bool) {
        let now = host::now_nanos() / 1_000_000;
        let wanted = self.plugin.try_borrow().map_or(tick(), |p| p.tick_period(tick()));
        let period = u64::try_from(wanted.as_millis()).unwrap_or(u64::MAX);
        if !self.pacer.try_borrow_mut().is_ok_and(|mut p| p.due(now, period, always)) {
            return;
        }
        let Ok(mut plugin) = self.plugin.try_borrow_mut() else { return };
        self.host.run_for(envoy);
        let ticked = catch_unwind(AssertUnwindSafe(|| {
            plugin.tick(&self.host, None);
            plugin.wake_waiting(&self.host);
            plugin.fail_hung(&self.host);
        }));
        if ticked.is_err() {
            log::error!("kvmesh: the tick panicked");
        }
    }

    /// A stream of this thread's ended: see [`Plugin::on_stream_end`] (no timer reaches this
    /// thread while it has no streams).
    fn stream_ended(&self) {
        let others = self.host.live_streams().saturating_sub(1);
        if let Ok(plugin) = self.plugin.try_borrow() {
            let _ = catch_unwind(AssertUnwindSafe(|| plugin.on_stream_end(&self.host, others)));
        }
    }
}

/// One stream's filter.
struct Streamed {
    thread: Rc<Thread>,
    filter: Rc<RefCell<RequestFilter>>,
    context: u32,
    envoy: *mut c_void,
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
        self.held().with(envoy, otherwise, f)
    }

    /// The stream's thread and filter, owned by the hook that runs.
    fn held(&self) -> Held {
        Held { thread: Rc::clone(&self.thread), filter: Rc::clone(&self.filter) }
    }
}

/// What a hook needs of its stream, kept alive by the hook itself: where a hook runs outside
/// the filter chain's iteration (a scheduled event, a callout's answer), an answer it sends
/// can end the stream at once, and Envoy 1.39 then destroys the module's filter (the
/// [`Streamed`]) before the call returns (1.40 waits for the hook to return).
struct Held {
    thread: Rc<Thread>,
    filter: Rc<RefCell<RequestFilter>>,
}

impl Held {
    /// As [`Streamed::with`].
    fn with<T>(&self, envoy: *mut c_void, otherwise: T, f: impl FnOnce(&mut RequestFilter, &NativeHost) -> T) -> T {
        self.thread.host.run_for(envoy);
        let Ok(mut filter) = self.filter.try_borrow_mut() else { return otherwise };
        catch_unwind(AssertUnwindSafe(|| f(&mut filter, &self.thread.host))).unwrap_or(otherwise)
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        self.thread.host.forget(self.context);
        // A waker made by a stream that ended before this one is not flagged here: every
        // stream's end is looked up (one lock).
        if self.thread.waiting.remove(self.envoy as usize) {
            // The thread's waker ended: another live stream of the thread takes over.
            if let Some(other) = self.thread.host.any_stream() {
                self.thread.waiting.add_waker(other, || {
                    // SAFETY: a stream of this thread that Envoy has not destroyed (streams
                    // leave the host's registry, and this list, when destroyed).
                    unsafe { Scheduler::new(other as *mut c_void) }
                });
            }
        }
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
    envoy_dynamic_module::init_logging();
    let made = catch_unwind(AssertUnwindSafe(|| -> Result<Config, String> {
        // Validated here once, so that a bad configuration is refused at load.
        let bytes = config.bytes().to_vec();
        let (parsed, address) = parse(&bytes)?;
        // The concurrency limit's shared value, before any stream (see SharedBucket::create).
        if let Some(params) = &parsed.admission {
            let _ = SharedBucket::create(&store::Process, params, host::now_nanos() / 1_000_000);
        }
        // Stats can only be defined now.
        let stats = Arc::new(Stats::define(envoy));
        let waiting = Arc::new(Waiting::default());
        let follow = parsed.control_plane_cluster.is_some();
        let link = address.map(|address| Link { address, config: bytes.clone() });
        let ticker = Ticker::start(link, Arc::clone(&stats), Arc::clone(&waiting))?;
        let id = CONFIGS.fetch_add(1, Ordering::Relaxed);
        let outbox = Arc::new(Outbox::new(envoy));
        let alive = Arc::new(AtomicBool::new(true));
        Ok(Config { id, bytes, follow, stats, waiting, outbox, alive, _ticker: ticker })
    }));
    match made {
        Ok(Ok(config)) => into_envoy(Some(config)),
        Ok(Err(e)) => {
            log::error!("kvmesh: {e}");
            std::ptr::null()
        }
        Err(_) => std::ptr::null(),
    }
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
    envoy: *mut c_void,
) -> *mut c_void {
    let Some(config) = borrow_from_envoy::<Config>(config) else { return std::ptr::null_mut() };
    let made = catch_unwind(AssertUnwindSafe(|| {
        let thread = thread(config)?;
        let context = thread.next_context.get();
        thread.next_context.set(context.wrapping_add(1).max(1));
        let filter = thread.plugin.try_borrow().ok()?.new_request(context);
        thread.host.register(context, envoy);
        Some(Streamed { thread, filter, context, envoy })
    }));
    into_envoy(made.ok().flatten())
}

/// # Safety
/// `m` came from `filter_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: *mut c_void) {
    let _ = catch_unwind(|| drop_from_envoy::<Streamed>(m));
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
    s.thread.tick(f, false);
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
    let (action, waiting) = s.with(f, (Action::Continue, false), |filter, host| {
        let size = host.body_size(&[BodyKind::BufferedRequest, BodyKind::ReceivedRequest]);
        (filter.on_request_body(host, size, end_of_stream), filter.is_waiting())
    });
    if waiting {
        // In the admission queue: the ticker wakes this thread while it is there.
        s.thread.waiting.add(f as usize, || {
            // SAFETY: this hook's stream, on its thread; deleted in `Streamed::drop`.
            unsafe { Scheduler::new(f) }
        });
    } else if s.held().filter.try_borrow().is_ok_and(|filter| filter.awaits_answer()) {
        // Sent to a worker: the ticker wakes this thread while it has streams, so that a hung
        // worker's requests are moved even if no hook runs here.
        s.thread.waiting.add_waker(f as usize, || {
            // SAFETY: as above.
            unsafe { Scheduler::new(f) }
        });
    }
    status(action)
}

/// A callout this stream sent (a PD prefill leg) answered, failed or timed out.
///
/// # Safety
/// See [`Streamed::of`]; the headers and body chunks are Envoy's, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    f: *mut c_void,
    m: *mut c_void,
    callout_id: u64,
    result: u32,
    headers: *const HeaderPair,
    header_count: usize,
    chunks: *const Buffer,
    chunk_count: usize,
) {
    let Some(s) = Streamed::of(m) else { return };
    // Only a completed exchange has an answer (the others: reset, or over the buffer limit).
    let answered = result == 0 && !headers.is_null() && header_count < (1 << 16);
    let status = answered.then(|| std::slice::from_raw_parts(headers, header_count)).and_then(|pairs| {
        pairs.iter().find(|p| Buffer { ptr: p.key, len: p.key_len }.bytes() == b":status").and_then(|p| {
            std::str::from_utf8(Buffer { ptr: p.value, len: p.value_len }.bytes()).ok()?.parse::<u16>().ok()
        })
    });
    let mut body = Vec::new();
    if answered && !chunks.is_null() && chunk_count < (1 << 20) {
        for chunk in std::slice::from_raw_parts(chunks, chunk_count) {
            body.extend_from_slice(chunk.bytes());
        }
    }
    let size = body.len();
    // `s` may be destroyed by the answer the filter sends: only `held` is used from here on.
    let held = s.held();
    held.thread.host.set_callout_answer(status, body);
    // The filter knows callouts by the low 32 bits (Envoy numbers them from 1).
    let token = callout_id as u32;
    held.with(f, (), |filter, host| filter.on_callout_response(host, token, size));
    held.thread.host.set_callout_answer(None, Vec::new());
}

/// A worker thread queued callouts for the main thread ([`outbox`]): they are sent now.
///
/// # Safety
/// `config` came from `config_new`; `envoy` is its Envoy pointer, on the main thread.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    envoy: *mut c_void,
    config: *mut c_void,
    _event: u64,
) {
    if let Some(config) = borrow_from_envoy::<Config>(config) {
        let _ = catch_unwind(AssertUnwindSafe(|| config.outbox.send(envoy)));
    }
}

/// A callout of the configuration's answered: nobody awaits it ([`outbox`]).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done() {}

/// The ticker woke this stream's thread (it holds requests in the admission queue, or this
/// stream is its waker: see [`waiting`]).
///
/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(f: *mut c_void, m: *mut c_void, _event: u64) {
    if let Some(s) = Streamed::of(m) {
        // The tick may answer this very stream, which can destroy `s` (see [`Held`]).
        let held = s.held();
        // A queued request's wake-up ticks at once; a waker's, when a tick is due anyway.
        let queued = held.filter.try_borrow().is_ok_and(|filter| filter.is_waiting());
        held.thread.tick(f, queued);
        // Admitted or answered meanwhile: the thread needs no more waking for this stream.
        if held.filter.try_borrow().is_ok_and(|filter| !filter.is_waiting()) {
            held.thread.waiting.dequeue(f as usize);
        }
    }
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
        // As proxy-wasm counts it: what Envoy holds (a response the filter paused, PD's
        // logprob merge) and the chunk just received.
        let size = host.body_size(&[BodyKind::BufferedResponse, BodyKind::ReceivedResponse]);
        filter.on_response_body(host, size, end_of_stream)
    }))
}

/// # Safety
/// See [`Streamed::of`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(f: *mut c_void, m: *mut c_void) {
    if let Some(s) = Streamed::of(m) {
        s.with(f, (), |filter, host| filter.on_log(host));
        s.thread.stream_ended();
    }
}
