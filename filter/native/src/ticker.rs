//! The ticker: one background thread per configuration, what the native build has in place
//! of the timers a Wasm VM's root context gets. Every [`tick`] it wakes the worker threads
//! that hold requests in an admission queue ([`Waiting`]); with a control plane, it is also the
//! plugin that holds the control-plane streams (permanently the lease holder, as one VM is
//! under Wasm): it applies the snapshots and publishes them to the worker threads' plugins in
//! shared data, and reports what they indexed.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvmesh_gateway::host::{HostError, LinkHost, Metric, MetricKind, VmHost};
use kvmesh_gateway::plugin::{self, Plugin};
use kvmesh_gateway::shared::admission::SharedBucket;
use kvmesh_gateway::shared::{SetError, SharedStore, VmLedger};
use tokio::sync::{mpsc, oneshot};

use crate::grpc::{Event, Streams, INBOX};
use crate::host::now_nanos;
use crate::store::{self, Process, Stats};
use crate::waiting::Waiting;

/// How often plugins tick: as often as a Wasm VM's (20 ms), unless `KVMESH_NATIVE_TICK_MS`
/// in Envoy's environment says otherwise (profiling under valgrind, where 20 ms of wall time
/// is a handful of requests, sets it out of the way, as the `.wasm`'s `slow-tick` build does).
pub fn tick() -> Duration {
    static TICK: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *TICK.get_or_init(|| {
        let ms = std::env::var("KVMESH_NATIVE_TICK_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(plugin::TICK.as_millis() as u64);
        Duration::from_millis(ms.clamp(1, 3_600_000))
    })
}

/// The running thread; stopped and joined when dropped.
pub struct Ticker {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The control plane's side: where, and the plugin configuration for the stream owner.
pub struct Link {
    pub address: String,
    pub config: Vec<u8>,
}

impl Ticker {
    pub fn start(link: Option<Link>, stats: Arc<Stats>, waiting: Arc<Waiting>) -> Result<Self, String> {
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("kvmesh-ticker".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(r) => r,
                    Err(e) => return log::error!("kvmesh ticker: no runtime: {e}"),
                };
                runtime.block_on(run(link, stats, waiting, stopped));
            })
            .map_err(|e| format!("cannot start the ticker thread: {e}"))?;
        Ok(Self { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn run(link: Option<Link>, stats: Arc<Stats>, waiting: Arc<Waiting>, mut stopped: oneshot::Receiver<()>) {
    let (events, mut inbox) = mpsc::channel(INBOX);
    let mut owner = link.and_then(|link| match StreamOwner::new(&link, Arc::clone(&stats), events) {
        Ok(o) => Some(o),
        Err(e) => {
            log::error!("kvmesh: no control-plane link: {e}");
            None
        }
    });
    let mut interval = tokio::time::interval(tick());
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let me = kvmesh_core::rng::random_u64().map_or(0x6b76_6d73, |r| r as u32);
    let mut last_beat = 0;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = interval.tick() => {
                waiting.wake();
                if let Some(o) = owner.as_mut() {
                    o.guarded(|plugin, host| plugin.tick(host, Some(host)));
                }
                let now = now_nanos() / 1_000_000;
                if now.saturating_sub(last_beat) >= 1_000 {
                    last_beat = now;
                    VmLedger::stand_in(&Process, me, now);
                    // Threads idle under long requests keep the slots they hold.
                    SharedBucket::keep_alive(&Process, now);
                }
                // Envoy-wide gauges, fresh while the worker threads are idle.
                stats.record(Metric::InFlight, plugin::in_flight(&Process));
                stats.record(Metric::Queued, SharedBucket::queued(&Process, now));
            }
            Some(event) = inbox.recv(), if owner.is_some() => {
                if let Some(o) = owner.as_mut() {
                    o.event(event);
                }
            }
        }
    }
}

/// The plugin that holds the control-plane streams, and its host.
struct StreamOwner {
    host: TickerHost,
    plugin: Plugin,
}

impl StreamOwner {
    fn new(link: &Link, stats: Arc<Stats>, events: mpsc::Sender<Event>) -> Result<Self, String> {
        let host = TickerHost { streams: Streams::new(&link.address, events)?, stats, inbox: RefCell::default() };
        let mut plugin = Plugin::default();
        let seed = kvmesh_core::rng::random_u64().unwrap_or_else(|_| now_nanos());
        plugin.configure(&host, &link.config, seed)?;
        Ok(Self { host, plugin })
    }

    /// A panic in the plugin is logged and the ticker goes on (the next tick starts afresh).
    fn guarded(&mut self, f: impl FnOnce(&mut Plugin, &TickerHost)) {
        let (plugin, host) = (&mut self.plugin, &self.host);
        if catch_unwind(AssertUnwindSafe(|| f(plugin, host))).is_err() {
            log::error!("kvmesh ticker: the control-plane plugin panicked");
        }
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::Message(token, message) => {
                let size = message.len();
                *self.host.inbox.borrow_mut() = message;
                self.guarded(|plugin, host| plugin.on_grpc_message(host, token, size));
                self.host.inbox.borrow_mut().clear();
            }
            Event::Closed(token, status) => {
                self.host.streams.closed(token);
                self.guarded(|plugin, host| plugin.on_grpc_close(host, token, status));
            }
        }
    }
}

/// The host of the stream owner: shared data, time, stats and the gRPC streams; no request
/// of its own.
struct TickerHost {
    streams: Streams,
    stats: Arc<Stats>,
    /// The message being handed to the plugin.
    inbox: RefCell<Vec<u8>>,
}

impl SharedStore for TickerHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        store::get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        store::set(key, value, cas)
    }
}

impl VmHost for TickerHost {
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
        self.record(metric, 1);
    }
    /// Counters and gauges only: Envoy records histograms through its worker threads' storage,
    /// which this thread has not (Envoy crashes).
    fn record(&self, metric: Metric, value: u64) {
        if metric.kind() != MetricKind::Histogram {
            self.stats.record(metric, value);
        }
    }
}

impl LinkHost for TickerHost {
    /// The cluster is Envoy's name for the control plane; this build connects to
    /// `control_plane_address` itself.
    fn open_grpc_stream(
        &self,
        _cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        self.streams.open(service, method, metadata).map_err(HostError)
    }
    fn send_grpc(&self, token: u32, message: &[u8], end_of_stream: bool) -> Result<(), HostError> {
        self.streams.send(token, message, end_of_stream).map_err(HostError)
    }
    fn cancel_grpc(&self, token: u32) {
        self.streams.cancel(token);
    }
    fn grpc_message(&self, size: usize) -> Vec<u8> {
        let inbox = self.inbox.borrow();
        inbox.get(..size.min(inbox.len())).unwrap_or_default().to_vec()
    }
}
