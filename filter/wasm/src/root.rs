//! The root context: parses and validates the plugin configuration once, owns the VM's
//! [`Gateway`], hands each request an [`Http`] context, and on the tick:
//!
//! - adopts the control plane's worker table when the stream owner published a new one;
//! - competes for the stream lease (one VM per Envoy holds it; no singleton VM needed, which
//!   Istio only offers through a per-pod bootstrap override); the owner keeps a `Watch`
//!   stream (snapshots in) and a `Report` stream (prefix inserts and in-flight counts out),
//!   and reconnects with backoff when they close;
//! - runs eviction and syncs circuit breakers.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use kvmesh_core::rng::random_u64;
use kvmesh_core::Config;
use kvmesh_proto::v1::{ReportBatch, Snapshot, WatchRequest};
use kvmesh_proto::{Message, REPORT, SERVICE, WATCH};
use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::gateway::Gateway;
use crate::host::{now_nanos, EnvoyShared, Metrics};
use crate::http::Http;
use crate::shared::Lease;

/// How long a lease lasts without renewal.
const LEASE_MS: u64 = 3_000;
const TICK: Duration = Duration::from_millis(20);
const MIN_BACKOFF_MS: u64 = 100;
const MAX_BACKOFF_MS: u64 = 5_000;

/// The control-plane connection of this VM (live only while it holds the lease).
struct Link {
    cluster: String,
    gateway_id: String,
    report_interval_ms: u64,
    watch: Option<u32>,
    report: Option<u32>,
    backoff_ms: u64,
    next_attempt_ms: u64,
    last_report_ms: u64,
}

#[derive(Default)]
pub struct Root {
    gateway: Option<Rc<RefCell<Gateway>>>,
    metrics: Option<Rc<Metrics>>,
    link: Option<Link>,
}

fn now_ms() -> u64 {
    now_nanos() / 1_000_000
}

impl Root {
    fn gateway_id(vm: u32) -> String {
        let node = hostcalls::get_property(vec!["node", "id"])
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        match node.filter(|n| !n.is_empty()) {
            Some(n) => format!("{n}/{vm:08x}"),
            None => format!("envoy-{vm:08x}"),
        }
    }

    fn close_streams(link: &mut Link) {
        for token in [link.watch.take(), link.report.take()].into_iter().flatten() {
            let _ = hostcalls::cancel_grpc_stream(token);
        }
    }

    /// Opens both streams; sends the watch request and a full report of this VM's index (so
    /// that a restarted control plane learns what the gateways already know).
    fn connect(link: &mut Link, gateway: &mut Gateway) -> Result<(), String> {
        let watch = hostcalls::open_grpc_stream(&link.cluster, SERVICE, WATCH, vec![]).map_err(|s| format!("{s:?}"))?;
        link.watch = Some(watch);
        let request = WatchRequest { gateway_id: link.gateway_id.clone() }.encode_to_vec();
        hostcalls::send_grpc_stream_message(watch, Some(&request), true).map_err(|s| format!("{s:?}"))?;
        let report =
            hostcalls::open_grpc_stream(&link.cluster, SERVICE, REPORT, vec![]).map_err(|s| format!("{s:?}"))?;
        link.report = Some(report);
        let full = gateway.full_report(&link.gateway_id);
        hostcalls::send_grpc_stream_message(report, Some(&full.encode_to_vec()), false)
            .map_err(|s| format!("{s:?}"))?;
        Ok(())
    }

    fn send_report(link: &mut Link, batch: &ReportBatch) {
        let Some(token) = link.report else { return };
        if hostcalls::send_grpc_stream_message(token, Some(&batch.encode_to_vec()), false).is_err() {
            Self::close_streams(link);
        }
    }

    fn tick_link(link: &mut Link, gateway: &mut Gateway, now: u64) {
        let owner = Lease::hold(&EnvoyShared, gateway.vm_id(), now, LEASE_MS);
        if !owner {
            if link.watch.is_some() {
                info!("control-plane stream handed over to another VM");
                Self::close_streams(link);
            }
            return;
        }
        if link.watch.is_none() {
            if now < link.next_attempt_ms {
                return;
            }
            if let Err(e) = Self::connect(link, gateway) {
                warn!("cannot open the control-plane streams on cluster {}: {e}", link.cluster);
                Self::close_streams(link);
                Self::back_off(link, now);
            }
            return;
        }
        if now.saturating_sub(link.last_report_ms) >= link.report_interval_ms {
            let batch = gateway.take_report(&EnvoyShared, &link.gateway_id);
            // In-flight counts at least once a second; inserts as soon as there are some.
            if !batch.inserts.is_empty() || now.saturating_sub(link.last_report_ms) >= 1_000 {
                Self::send_report(link, &batch);
                link.last_report_ms = now;
            }
        }
    }

    fn back_off(link: &mut Link, now: u64) {
        link.next_attempt_ms = now + link.backoff_ms;
        link.backoff_ms = (link.backoff_ms * 2).min(MAX_BACKOFF_MS);
    }
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let (Some(link), Some(gateway)) = (self.link.as_mut(), &self.gateway) else { return };
        if link.watch != Some(token_id) {
            return;
        }
        let bytes =
            hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, message_size).ok().flatten().unwrap_or_default();
        match Snapshot::decode(bytes.as_slice()) {
            Ok(snapshot) => {
                link.backoff_ms = MIN_BACKOFF_MS;
                if let Ok(mut g) = gateway.try_borrow_mut() {
                    if snapshot.full {
                        info!("control plane snapshot {} with {} workers", snapshot.version, snapshot.workers.len());
                    }
                    g.apply_snapshot(&EnvoyShared, &snapshot);
                    if let Some(m) = &self.metrics {
                        Metrics::record(m.snapshot_version, snapshot.version);
                        Metrics::record(m.index_blocks, g.index_len() as u64);
                    }
                }
            }
            Err(e) => warn!("undecodable snapshot from the control plane: {e}"),
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let Some(link) = self.link.as_mut() else { return };
        if link.watch == Some(token_id) || link.report == Some(token_id) {
            warn!("control-plane stream closed (grpc status {status_code}); reconnecting with backoff");
            if link.watch == Some(token_id) {
                link.watch = None;
            } else {
                link.report = None;
            }
            Self::close_streams(link);
            Self::back_off(link, now_ms());
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                error!("cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                error!("invalid configuration: {e}");
                return false;
            }
        };
        let seed = random_u64().unwrap_or_else(|_| now_nanos());
        match &config.pd {
            Some(pd) => info!(
                "PD mode: prefill policy {}, decode policy {}, {} static workers",
                pd.prefill_policy,
                pd.decode_policy,
                config.workers.workers.len()
            ),
            None => info!(
                "policy {} over {} static workers, max payload {} bytes",
                config.policy,
                config.workers.workers.len(),
                config.max_payload_size
            ),
        }
        let cluster = config.control_plane_cluster.clone();
        let report_interval_ms = config.report_interval_ms;
        let gateway = Gateway::new(config, &EnvoyShared, seed);
        self.link = cluster.map(|cluster| Link {
            cluster,
            gateway_id: Self::gateway_id(gateway.vm_id()),
            report_interval_ms,
            watch: None,
            report: None,
            backoff_ms: MIN_BACKOFF_MS,
            next_attempt_ms: 0,
            last_report_ms: 0,
        });
        self.gateway = Some(Rc::new(RefCell::new(gateway)));
        self.metrics = Some(Rc::new(Metrics::define()));
        let _ = hostcalls::set_tick_period(TICK);
        true
    }

    fn on_tick(&mut self) {
        let (Some(gateway), Some(metrics)) = (&self.gateway, &self.metrics) else { return };
        let Ok(mut gateway) = gateway.try_borrow_mut() else { return };
        let now = now_ms();
        gateway.sync_table(&EnvoyShared);
        if let Some(link) = self.link.as_mut() {
            Self::tick_link(link, &mut gateway, now);
        }
        if let Some(evicted) = gateway.tick(&EnvoyShared, now / 1_000) {
            if evicted > 0 {
                info!("evicted {evicted} index blocks, {} left", gateway.index_len());
            }
            Metrics::record(metrics.index_blocks, gateway.index_len() as u64);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(self.gateway.clone(), self.metrics.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
