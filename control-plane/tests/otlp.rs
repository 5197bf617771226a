//! `--enable-trace`: a real kvmesh-cp exports its spans over OTLP/gRPC to a collector (an
//! in-process tonic server implementing OpenTelemetry's `TraceService` on a free loopback
//! port), as service `kvmesh-cp`: an admin call's span names its path and status, and the
//! startup snapshot's publish is there too. Without the flag nothing is sent, the collector
//! named or not.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_testkit::{free_port, http, wait_until, ControlPlane};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;

/// A span as received: its service, name and string-valued attributes.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    name: String,
    attributes: Vec<(String, String)>,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Received>>>);

fn text(kv: &KeyValue) -> (String, String) {
    let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    };
    (kv.key.clone(), value)
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource: Vec<(String, String)> =
                rs.resource.iter().flat_map(|r| r.attributes.iter().map(text)).collect();
            let service =
                resource.iter().find(|(k, _)| k == "service.name").map(|(_, v)| v.clone()).unwrap_or_default();
            for span in rs.scope_spans.iter().flat_map(|s| &s.spans) {
                spans.push(Received {
                    service: service.clone(),
                    name: span.name.clone(),
                    attributes: span.attributes.iter().map(text).collect(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    /// Serves on a free loopback port of `runtime`; returns the port.
    fn serve(&self, runtime: &tokio::runtime::Runtime) -> u16 {
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let port = listener.local_addr().unwrap().port();
        let service = TraceServiceServer::new(self.clone());
        runtime.spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await
        });
        port
    }

    fn spans(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }
}

fn attribute<'a>(span: &'a Received, key: &str) -> Option<&'a str> {
    span.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// A kvmesh-cp that flushes its spans every 100 ms, with `flags`.
fn control_plane(flags: &[&str]) -> ControlPlane {
    let args = [&["--worker-urls", "http://127.0.0.1:1", "--disable-health-check"][..], flags].concat();
    ControlPlane::start_with_env(
        free_port().unwrap(),
        free_port().unwrap(),
        &args,
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
    .unwrap()
}

#[test]
fn an_admin_call_and_a_snapshot_reach_the_collector_as_kvmesh_cp_spans() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let collector = Collector::default();
    let port = collector.serve(&runtime);
    let cp = control_plane(&["--enable-trace", "--otlp-traces-endpoint", &format!("127.0.0.1:{port}")]);
    let r = http::get(&cp.url("/health")).unwrap();
    assert_eq!(r.status, 200);
    let admin = |s: &Received| s.name == "admin" && attribute(s, "url.path") == Some("/health");
    wait_until("kvmesh-cp's spans at the collector", Duration::from_secs(15), || {
        let spans = collector.spans();
        spans.iter().any(admin) && spans.iter().any(|s| s.name == "snapshot.publish")
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", collector.spans()));
    let spans = collector.spans();
    assert!(spans.iter().all(|s| s.service == "kvmesh-cp"), "{spans:?}");
    let call = spans.iter().find(|s| admin(s)).unwrap();
    assert_eq!(attribute(call, "http.request.method"), Some("GET"), "{call:?}");
    assert_eq!(attribute(call, "http.response.status_code"), Some("200"), "{call:?}");
    let publish = spans.iter().find(|s| s.name == "snapshot.publish").unwrap();
    assert_eq!(attribute(publish, "version"), Some("1"), "{publish:?}");
}

#[test]
fn without_enable_trace_nothing_is_exported_and_a_bad_endpoint_is_refused() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let collector = Collector::default();
    let port = collector.serve(&runtime);
    // Off without --enable-trace, as in sglang-router, even with the collector named: after
    // a call and a stop that flushes what the exporter holds (SIGTERM), the collector has
    // nothing, and the log says why.
    let mut cp = control_plane(&["--otlp-traces-endpoint", &format!("127.0.0.1:{port}")]);
    http::get(&cp.url("/health")).unwrap();
    let status = cp.proc().terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}");
    assert!(collector.spans().is_empty(), "{:?}", collector.spans());
    assert!(cp.proc().log_text().contains("has no effect without --enable-trace"), "{}", cp.proc().log_text());
    let mut child = std::process::Command::new(kvmesh_testkit::cp_bin())
        .args(["--worker-urls", "http://127.0.0.1:1", "--enable-trace", "--otlp-traces-endpoint", "grpc://c:4317"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A kvmesh-cp that took the endpoint would serve on: bounded, then stopped.
    let exited = wait_until("kvmesh-cp to refuse the endpoint", Duration::from_secs(10), || {
        child.try_wait().ok().flatten().is_some()
    });
    if exited.is_err() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    assert!(exited.is_ok(), "kvmesh-cp started with a grpc:// endpoint");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--otlp-traces-endpoint") && err.lines().count() == 1, "{err}");
}
