//! The proxy-wasm glue, compiled for wasm32 only: [`EnvoyHost`] implements [`StreamHost`] over
//! `proxy_wasm::hostcalls` (every `Status` handled: the SDK's trait helpers unwrap, and a
//! panic kills the VM), and the contexts translate Envoy's callbacks into calls on
//! [`Plugin`] and [`RequestFilter`] — nothing else.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action as WasmAction, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use kvmesh_gateway::headers::Headers;
use kvmesh_gateway::host::{
    tagged_name, Action, Callout, HostError, LabelSets, LabelledMetric, LinkHost, Metric, MetricKind, StreamHost,
    VmHost,
};
use kvmesh_gateway::plugin::Plugin;
use kvmesh_gateway::request::RequestFilter;
use kvmesh_gateway::shared::{SetError, SharedStore};

fn err(status: Status) -> HostError {
    HostError(format!("{status:?}"))
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> Status;
}

/// A whole header map in one host call, kept as the host serialized it. The SDK's `get_map`
/// would build two `String`s per header (a third of the filter's own work on a request) and
/// unwrap values as UTF-8, which HTTP does not promise: a client's Latin-1 header would panic
/// and kill the VM.
#[allow(unsafe_code)]
fn header_map(map: MapType) -> Headers {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer and a length to the two locals. On success the
    // pointer is null or a buffer of `size` bytes that the host had this VM allocate through
    // the SDK's `proxy_on_memory_allocate` (a boxed slice of exactly `size` bytes) and hands
    // over: owning it as a `Vec` of that length and capacity is what the SDK's own `get_map`
    // does, and frees it with the same layout.
    let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
    if status != Status::Ok || data.is_null() {
        return Headers::default();
    }
    // SAFETY: see above; ownership passes from the host to this Vec once.
    Headers::from_raw(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Labelled counter ids by metric and label (None: the host refused to define it).
type LabelledIds = std::collections::HashMap<(LabelledMetric, String), Option<u32>>;

/// Envoy, as seen from one VM: shared data, the current stream, and the VM's stats.
#[derive(Default)]
pub struct EnvoyHost {
    /// Metric ids, in [`Metric::ALL`] order (None: the host refused to define it).
    metrics: Vec<Option<u32>>,
    /// Labelled counters, defined on first use (their tagged names, see [`tagged_name`]).
    labelled: RefCell<(LabelSets, LabelledIds)>,
}

impl EnvoyHost {
    pub fn new() -> Self {
        let metrics = Metric::ALL
            .iter()
            .map(|m| {
                let kind = match m.kind() {
                    MetricKind::Counter => MetricType::Counter,
                    MetricKind::Gauge => MetricType::Gauge,
                    MetricKind::Histogram => MetricType::Histogram,
                };
                hostcalls::define_metric(kind, m.name()).ok()
            })
            .collect();
        Self { metrics, labelled: RefCell::default() }
    }

    fn metric_id(&self, metric: Metric) -> Option<u32> {
        let pos = Metric::ALL.iter().position(|m| *m == metric)?;
        self.metrics.get(pos).copied().flatten()
    }
}

impl SharedStore for EnvoyHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Other),
        }
    }
}

impl VmHost for EnvoyHost {
    fn now_nanos(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
    fn node_id(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["node", "id"]).ok().flatten()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn vm_memory_bytes(&self) -> u64 {
        // Pages of 64 KiB.
        (core::arch::wasm32::memory_size::<0>() as u64).saturating_mul(65_536)
    }
    fn increment(&self, metric: Metric) {
        if let Some(id) = self.metric_id(metric) {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }
    fn record(&self, metric: Metric, value: u64) {
        if let Some(id) = self.metric_id(metric) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
    fn increment_labelled(&self, metric: LabelledMetric, value: &str) {
        let Ok(mut guard) = self.labelled.try_borrow_mut() else { return };
        let (labels, ids) = &mut *guard;
        let label = labels.label(metric, value, Some(self));
        let id = *ids
            .entry((metric, label))
            .or_insert_with_key(|(m, l)| hostcalls::define_metric(MetricType::Counter, &tagged_name(*m, l)).ok());
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }
}

impl LinkHost for EnvoyHost {
    fn open_grpc_stream(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        hostcalls::open_grpc_stream(cluster, service, method, metadata.to_vec()).map_err(err)
    }
    fn send_grpc(&self, token: u32, message: &[u8], end_of_stream: bool) -> Result<(), HostError> {
        hostcalls::send_grpc_stream_message(token, Some(message), end_of_stream).map_err(err)
    }
    fn cancel_grpc(&self, token: u32) {
        let _ = hostcalls::cancel_grpc_stream(token);
    }
    fn grpc_message(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default()
    }
}

impl StreamHost for EnvoyHost {
    fn request_headers(&self) -> Headers {
        header_map(MapType::HttpRequestHeaders)
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value).map_err(err)
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten().unwrap_or_default()
    }
    fn set_request_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body).map_err(err)
    }
    fn response_headers(&self) -> Headers {
        header_map(MapType::HttpResponseHeaders)
    }
    fn set_response_header(&self, name: &str, value: Option<&str>) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpResponseHeaders, name, value).map_err(err)
    }
    fn response_body(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        let len = range.end.saturating_sub(range.start);
        hostcalls::get_buffer(BufferType::HttpResponseBody, range.start, len).ok().flatten().unwrap_or_default()
    }
    fn response_code_details(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["response", "code_details"]).ok().flatten()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn upstream_address(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["upstream", "address"]).ok().flatten()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn set_response_body(&self, size: usize, body: &[u8]) -> Result<(), HostError> {
        hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, body).map_err(err)
    }
    fn send_reply(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError> {
        hostcalls::send_http_response(u32::from(status), headers.to_vec(), Some(body)).map_err(err)
    }
    /// A property: Envoy keeps it in the filter state as `wasm.<key>`.
    fn set_filter_state(&self, key: &str, value: &str) -> Result<(), HostError> {
        hostcalls::set_property(vec![key], Some(value.as_bytes())).map_err(err)
    }
    fn resume_response(&self) -> Result<(), HostError> {
        hostcalls::resume_http_response().map_err(err)
    }
    fn resume_request(&self) -> Result<(), HostError> {
        hostcalls::resume_http_request().map_err(err)
    }
    fn enter_context(&self, context_id: u32) -> Result<(), HostError> {
        hostcalls::set_effective_context(context_id).map_err(err)
    }
    fn dispatch(&self, c: Callout<'_>) -> Result<u32, HostError> {
        hostcalls::dispatch_http_call(c.cluster, c.headers.to_vec(), Some(c.body), vec![], c.timeout).map_err(err)
    }
    fn callout_status(&self) -> Option<u16> {
        // As bytes: the SDK's `get_map_value` unwraps the value as UTF-8 (a panic, were it not).
        let bytes = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status").ok().flatten()?;
        std::str::from_utf8(&bytes).ok()?.parse().ok()
    }
    fn callout_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
    }
}

/// Logs a panic through the host before the VM dies (Envoy then reloads it per
/// `failure_policy`), so that the cause is in Envoy's log and not lost.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("kvmesh filter panicked: {info}"));
    }));
}

fn action(a: Action) -> WasmAction {
    match a {
        Action::Continue => WasmAction::Continue,
        Action::Pause => WasmAction::Pause,
    }
}

/// The root context of one VM.
#[derive(Default)]
pub struct Root {
    host: Rc<EnvoyHost>,
    plugin: Plugin,
    /// The tick period last asked of Envoy.
    tick_period: std::cell::Cell<std::time::Duration>,
}

impl Root {
    /// Asks Envoy for the tick period the plugin wants now, if it changed.
    fn retune_tick(&self) {
        let period = self.plugin.tick_period(TICK);
        if period != self.tick_period.get() {
            self.tick_period.set(period);
            let _ = hostcalls::set_tick_period(period);
        }
    }

    pub fn new(context_id: u32) -> Self {
        let mut root = Self::default();
        root.plugin.set_context_id(context_id);
        root
    }
}

impl Context for Root {
    /// A prefill callout dispatched from the tick (for a request admitted from the queue).
    fn on_http_call_response(&mut self, token_id: u32, _num_headers: usize, body_size: usize, _num_trailers: usize) {
        self.plugin.on_callout_response(self.host.as_ref(), token_id, body_size);
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        self.plugin.on_grpc_message(self.host.as_ref(), token_id, message_size);
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        self.plugin.on_grpc_close(self.host.as_ref(), token_id, status_code);
    }
}

/// How often every VM ticks (table check, lease, reports, eviction).
#[cfg(not(feature = "slow-tick"))]
const TICK: std::time::Duration = kvmesh_gateway::plugin::TICK;
/// Profiling builds: out of the way of the requests being counted (once the VM has settled,
/// see `Plugin::tick_period`).
#[cfg(feature = "slow-tick")]
const TICK: std::time::Duration = std::time::Duration::from_secs(100);

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                log::error!("cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
        self.host = Rc::new(EnvoyHost::new());
        let seed = kvmesh_core::rng::random_u64().unwrap_or_else(|_| self.host.now_nanos());
        if let Err(e) = self.plugin.configure(self.host.as_ref(), &bytes, seed) {
            log::error!("{e}");
            return false;
        }
        self.tick_period.set(self.plugin.tick_period(TICK));
        let _ = hostcalls::set_tick_period(self.tick_period.get());
        true
    }

    fn on_tick(&mut self) {
        self.plugin.on_tick(self.host.as_ref());
        // After the tick's work: the VM stops with its in-flight counts published (a VM that
        // traps mid-tick loses what it counted since its last heartbeat; see internals.md).
        #[cfg(feature = "test-crash")]
        {
            let vm = self.plugin.gateway().and_then(|g| g.try_borrow().ok().map(|g| g.ledger().vm()));
            stop_if_lease_owner(self.host.as_ref(), vm);
        }
        self.retune_tick();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // A VM's first requests can shorten a profiling build's tick (no host call otherwise).
        self.retune_tick();
        Some(Box::new(Http { host: Rc::clone(&self.host), filter: self.plugin.new_request(context_id) }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Test builds only: traps the VM when the request asks for it (read before the routing
/// headers are stripped; Envoy's header_mutation filter removes only `x-kvmesh-*` from clients,
/// so the trigger uses its own name).
#[cfg(feature = "test-crash")]
fn crash_if_asked() {
    let asked = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-test-crash-vm").ok().flatten().is_some();
    if asked {
        let _ = hostcalls::log(LogLevel::Warn, "test-crash: trapping this VM on request");
        core::arch::wasm32::unreachable();
    }
}

/// Test builds only: where a request leaves the order for the lease owner to stop.
#[cfg(feature = "test-crash")]
const STOP_LEASE_OWNER_KEY: &str = "kvmesh.test.stop_lease_owner";

/// Test builds only: a request carrying `x-test-stop-lease-owner` asks whichever VM holds the
/// control-plane lease to stop (a flag in shared data, see [`stop_if_lease_owner`]). The
/// request is answered here (200) and reaches no worker, so it is in no count.
#[cfg(feature = "test-crash")]
fn stop_lease_owner_if_asked() -> Option<WasmAction> {
    let asked =
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "x-test-stop-lease-owner").ok().flatten().is_some();
    if !asked {
        return None;
    }
    let _ = hostcalls::set_shared_data(STOP_LEASE_OWNER_KEY, Some(b"1"), None);
    let _ = hostcalls::log(LogLevel::Warn, "test-crash: the lease owner is asked to stop");
    let body = br#"{"test_crash":"the control-plane lease owner will stop"}"#;
    let _ = hostcalls::send_http_response(200, vec![("content-type", "application/json")], Some(body));
    Some(WasmAction::Pause)
}

/// Test builds only, on every tick: when the stop flag is set and this VM (`vm`) holds the
/// control-plane lease, it clears the flag (by compare-and-swap: one VM stops per order) and
/// traps. It ticks no more, so its lease lapses and another VM takes the streams over.
#[cfg(feature = "test-crash")]
fn stop_if_lease_owner(host: &EnvoyHost, vm: Option<u32>) {
    let (flag, cas) = host.get(STOP_LEASE_OWNER_KEY);
    if flag.as_deref() != Some(b"1".as_slice()) || vm.is_none() || kvmesh_gateway::shared::Lease::owner(host) != vm {
        return;
    }
    if host.set(STOP_LEASE_OWNER_KEY, b"", cas).is_ok() {
        let _ = hostcalls::log(LogLevel::Warn, &format!("test-crash: trapping the lease owner VM {vm:?}"));
        core::arch::wasm32::unreachable();
    }
}

/// One HTTP stream. Its filter is shared with the VM's admission queue (the tick admits it);
/// a callback that finds it busy (never expected: one thread, no re-entry) does nothing.
pub struct Http {
    host: Rc<EnvoyHost>,
    filter: Rc<RefCell<RequestFilter>>,
}

impl Http {
    fn with<T>(&self, busy: T, f: impl FnOnce(&mut RequestFilter, &EnvoyHost) -> T) -> T {
        match self.filter.try_borrow_mut() {
            Ok(mut filter) => f(&mut filter, self.host.as_ref()),
            Err(_) => busy,
        }
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, token_id: u32, _num_headers: usize, body_size: usize, _num_trailers: usize) {
        self.with((), |f, host| f.on_callout_response(host, token_id, body_size));
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> WasmAction {
        #[cfg(feature = "test-crash")]
        {
            crash_if_asked();
            if let Some(stopped) = stop_lease_owner_if_asked() {
                return stopped;
            }
        }
        action(self.with(Action::Continue, |f, host| f.on_request_headers(host, end_of_stream)))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        action(self.with(Action::Continue, |f, host| f.on_request_body(host, body_size, end_of_stream)))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> WasmAction {
        action(self.with(Action::Continue, |f, host| f.on_response_headers(host)))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        action(self.with(Action::Continue, |f, host| f.on_response_body(host, body_size, end_of_stream)))
    }

    fn on_log(&mut self) {
        self.with((), |f, host| f.on_log(host));
    }
}
