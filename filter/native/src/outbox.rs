//! Callouts that must outlive the stream that sends them (a PD request's `/abort_request` for a
//! prefill leg still running when the request ends). Envoy cancels a stream's callouts when
//! the stream ends, so a worker thread queues them here and the configuration's scheduler
//! has the main thread send them as the configuration's own callouts, which run to their
//! answer or timeout. Their answers are not awaited.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Mutex;

use envoy_dynamic_module::{config_callout, ConfigScheduler};
use kvmesh_gateway::host::{Callout, HostError};

/// Callouts queued and not yet sent past which more are refused (the main thread sends them
/// all on its next turn, so only a stalled main thread reaches this).
pub const MAX_PENDING: usize = 1024;

/// A callout queued for the main thread, owning its parts.
struct Pending {
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout_ms: u64,
}

struct Open {
    scheduler: ConfigScheduler,
    pending: VecDeque<Pending>,
}

/// One configuration's queue (None once the configuration is gone: nothing is queued).
pub struct Outbox(Mutex<Option<Open>>);

impl Outbox {
    /// # Safety
    /// On the main thread, in `on_http_filter_config_new`, with its configuration pointer.
    pub unsafe fn new(config: *mut c_void) -> Self {
        let open = ConfigScheduler::new(config).map(|scheduler| Open { scheduler, pending: VecDeque::new() });
        Self(Mutex::new(open))
    }

    /// Queues `c` for the main thread (from any thread), waking it on the first one queued.
    pub fn push(&self, c: Callout<'_>) -> Result<(), HostError> {
        let mut guard = self.0.lock().map_err(|_| HostError("the callout queue is poisoned".into()))?;
        let open = guard.as_mut().ok_or_else(|| HostError("the configuration is gone".into()))?;
        if open.pending.len() >= MAX_PENDING {
            return Err(HostError(format!("{MAX_PENDING} callouts already wait for the main thread")));
        }
        open.pending.push_back(Pending {
            cluster: c.cluster.to_string(),
            headers: c.headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body: c.body.to_vec(),
            timeout_ms: u64::try_from(c.timeout.as_millis()).unwrap_or(u64::MAX),
        });
        if open.pending.len() == 1 {
            open.scheduler.commit(0);
        }
        Ok(())
    }

    /// Sends everything queued as `config`'s own callouts; how many Envoy took.
    ///
    /// # Safety
    /// On the main thread, in a configuration hook of `config`.
    pub unsafe fn send(&self, config: *mut c_void) -> usize {
        let pending = match self.0.lock() {
            Ok(mut guard) => guard.as_mut().map(|open| std::mem::take(&mut open.pending)).unwrap_or_default(),
            Err(_) => return 0,
        };
        let mut sent = 0;
        for p in pending {
            let headers: Vec<(&str, &str)> = p.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            match config_callout(config, &p.cluster, &headers, &p.body, p.timeout_ms) {
                Ok(_) => sent += 1,
                Err(code) => log::warn!("kvmesh: Envoy refused a callout to cluster {} (code {code})", p.cluster),
            }
        }
        sent
    }

    /// Deletes the scheduler (on the main thread, as the configuration goes) and drops what
    /// was not sent.
    pub fn close(&self) {
        if let Ok(mut guard) = self.0.lock() {
            guard.take();
        }
    }
}
