//! The naive body-routing filter `cargo xtask bench overhead` runs beside kvmesh: what any
//! proxy-wasm filter that routes by the request body costs at least. It pauses the headers,
//! buffers the body, parses it whole into a JSON DOM, hashes the prompt to pick one of the
//! configured workers, and sets the header the workers' cluster routes by. No index, no
//! shared data, no stats, no response callbacks: a floor, not a router. Built for the host,
//! the same filter is a native Envoy dynamic module (`native.rs`): the floor without the VM.

#[cfg(not(target_arch = "wasm32"))]
mod native;

#[cfg(target_arch = "wasm32")]
mod glue {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};
    use std::rc::Rc;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { workers: Rc::new(Vec::new()), probe: super::Probe::default() }) });
    }}

    struct Root {
        workers: Rc<Vec<String>>,
        probe: super::Probe,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let Some(bytes) = self.get_plugin_configuration() else { return false };
            self.workers = Rc::new(super::workers(&bytes));
            self.probe = super::Probe::from_config(&bytes);
            use proxy_wasm::types::MetricType;
            if self.probe.counter > 0 {
                self.probe.counter_id =
                    proxy_wasm::hostcalls::define_metric(MetricType::Counter, "naive_probe_total").unwrap_or(0);
            }
            if self.probe.histogram > 0 {
                self.probe.histogram_id =
                    proxy_wasm::hostcalls::define_metric(MetricType::Histogram, "naive_probe_ns").unwrap_or(0);
            }
            !self.workers.is_empty()
        }

        fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Http { workers: Rc::clone(&self.workers), probe: self.probe }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Http {
        workers: Rc<Vec<String>>,
        probe: super::Probe,
    }

    impl Context for Http {}

    impl super::Probe {
        /// The extra host calls a profiling run asked for, on every request.
        fn run(self) {
            use proxy_wasm::hostcalls as h;
            use proxy_wasm::types::{BufferType, MapType};
            for i in 0..self.shared_set {
                let _ = h::set_shared_data("naive.probe", Some(&i.to_le_bytes()), None);
            }
            for _ in 0..self.shared_get {
                let _ = h::get_shared_data("naive.probe");
            }
            for _ in 0..self.header_pairs {
                let _ = h::get_map(MapType::HttpRequestHeaders);
            }
            for _ in 0..self.header_get {
                let _ = h::get_map_value(MapType::HttpRequestHeaders, ":path");
            }
            for i in 0..self.header_set {
                let _ = h::set_map_value(MapType::HttpRequestHeaders, "x-naive-probe", Some(&i.to_string()));
            }
            for _ in 0..self.property {
                let _ = h::get_property(vec!["request", "id"]);
            }
            for _ in 0..self.body_get {
                let _ = h::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX);
            }
            for _ in 0..self.time {
                let _ = h::get_current_time();
            }
            if self.touch_kib > 0 {
                thread_local!(static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) });
                BUF.with(|b| {
                    let mut b = b.borrow_mut();
                    let n = self.touch_kib as usize * 1024;
                    if b.len() != n {
                        b.resize(n, 1);
                    }
                    // One write per cache line: the working set a bigger filter would touch.
                    let mut i = 0;
                    while i < n {
                        b[i] = b[i].wrapping_add(1);
                        i += 64;
                    }
                });
            }
            for _ in 0..self.counter {
                let _ = h::increment_metric(self.counter_id, 1);
            }
            for i in 0..self.histogram {
                let _ = h::record_metric(self.histogram_id, u64::from(i) * 1000);
            }
        }
    }

    impl HttpContext for Http {
        fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
            if end_of_stream {
                return Action::Continue;
            }
            Action::Pause
        }

        fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                return Action::Pause;
            }
            let body = self.get_http_request_body(0, size).unwrap_or_default();
            if let Some(dst) = super::pick(&self.workers, &body) {
                self.set_http_request_header("x-gateway-destination-endpoint", Some(dst));
            }
            self.probe.run();
            Action::Continue
        }
    }
}

/// The `ip:port` of each `worker_urls` entry of the plugin configuration.
pub fn workers(config: &[u8]) -> Vec<String> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(config) else { return Vec::new() };
    let urls = v.get("worker_urls").and_then(|u| u.as_array()).cloned().unwrap_or_default();
    urls.iter()
        .filter_map(|u| u.as_str())
        .map(|u| u.trim_start_matches("http://").trim_end_matches('/').to_string())
        .collect()
}

/// The worker for a body: its prompt (`text`, `prompt` or the last message) hashed.
pub fn pick<'a>(workers: &'a [String], body: &[u8]) -> Option<&'a str> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let text = v
        .get("text")
        .or_else(|| v.get("prompt"))
        .or_else(|| v.get("messages").and_then(|m| m.as_array()).and_then(|m| m.last()).and_then(|m| m.get("content")))
        .and_then(|t| t.as_str())
        .unwrap_or("");
    let n = u64::try_from(workers.len()).ok().filter(|&n| n > 0)?;
    let i = usize::try_from(xxhash_rust::xxh3::xxh3_64(text.as_bytes()) % n).ok()?;
    workers.get(i).map(String::as_str)
}

/// Extra host calls per request, for profiling what each kind costs inside Envoy (the plugin
/// configuration's `probe` object; none by default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Probe {
    pub shared_get: u32,
    pub shared_set: u32,
    pub header_pairs: u32,
    pub header_get: u32,
    pub header_set: u32,
    pub property: u32,
    pub body_get: u32,
    pub time: u32,
    /// Increments of a counter and values recorded in a histogram (the filter's stats).
    pub counter: u32,
    pub histogram: u32,
    /// KiB of the VM's memory written (a cache line at a time) on every request.
    pub touch_kib: u32,
    /// The stats' ids (defined once, at configuration).
    pub counter_id: u32,
    pub histogram_id: u32,
}

impl Probe {
    pub fn from_config(config: &[u8]) -> Self {
        let v: serde_json::Value = serde_json::from_slice(config).unwrap_or_default();
        let n = |k: &str| v["probe"][k].as_u64().and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
        Self {
            shared_get: n("shared_get"),
            shared_set: n("shared_set"),
            header_pairs: n("header_pairs"),
            header_get: n("header_get"),
            header_set: n("header_set"),
            property: n("property"),
            body_get: n("body_get"),
            time: n("time"),
            counter: n("counter"),
            histogram: n("histogram"),
            touch_kib: n("touch_kib"),
            counter_id: 0,
            histogram_id: 0,
        }
    }
}
