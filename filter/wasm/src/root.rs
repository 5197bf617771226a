//! The root context: parses and validates the plugin configuration once, owns the VM's
//! [`Gateway`], runs periodic work on the tick and hands each request an [`Http`] context.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use kvmesh_core::rng::random_u64;
use kvmesh_core::Config;
use log::{error, info};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::gateway::Gateway;
use crate::host::{now_nanos, EnvoyShared, Metrics};
use crate::http::Http;

#[derive(Default)]
pub struct Root {
    gateway: Option<Rc<RefCell<Gateway>>>,
    metrics: Option<Rc<Metrics>>,
}

impl Context for Root {}

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
        self.gateway = Some(Rc::new(RefCell::new(Gateway::new(config, &EnvoyShared, seed))));
        self.metrics = Some(Rc::new(Metrics::define()));
        let _ = hostcalls::set_tick_period(Duration::from_secs(1));
        true
    }

    fn on_tick(&mut self) {
        let (Some(gateway), Some(metrics)) = (&self.gateway, &self.metrics) else {
            return;
        };
        let Ok(mut gateway) = gateway.try_borrow_mut() else {
            return;
        };
        if let Some(evicted) = gateway.tick(&EnvoyShared, now_nanos() / 1_000_000_000) {
            info!("evicted {evicted} index blocks, {} left", gateway.index_len());
        }
        Metrics::record(metrics.index_blocks, gateway.index_len() as u64);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http::new(self.gateway.clone(), self.metrics.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
