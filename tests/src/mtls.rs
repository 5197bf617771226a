//! Istio's mutual TLS, for the tests that need a caller's identity (`--tenant-identity xfcc`):
//! the gateway's listener requires a client certificate from the test CA and, as an Istio
//! gateway does, replaces any `x-forwarded-client-cert` a client sends with its own element
//! (`SANITIZE_SET`, with the certificate's URI SAN). A second, plain listener in the same Envoy
//! stands for the calling sidecar: it forwards whatever the test sends over mTLS with the
//! client certificate of `spiffe://cluster.local/ns/team-c/sa/app` (tests/data/mtls).

use anyhow::{anyhow, bail};
use serde_norway::Value as Yaml;

use crate::repo_root;

/// The SPIFFE id in the test client certificate.
pub const CLIENT_SPIFFE_ID: &str = "spiffe://cluster.local/ns/team-c/sa/app";

fn fixture(name: &str) -> String {
    repo_root().join("tests/data/mtls").join(name).display().to_string()
}

/// Makes the first listener of `doc` (on `listener_port`) an mTLS one and adds the caller's
/// listener on `client_port` with its cluster.
pub(crate) fn apply(doc: &mut Yaml, listener_port: u16, client_port: u16) -> anyhow::Result<()> {
    let downstream: Yaml = serde_norway::from_str(&format!(
        r#"
name: envoy.transport_sockets.tls
typed_config:
  "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
  require_client_certificate: true
  common_tls_context:
    tls_certificates: [{{certificate_chain: {{filename: "{server}"}}, private_key: {{filename: "{server_key}"}}}}]
    validation_context: {{trusted_ca: {{filename: "{ca}"}}}}
"#,
        server = fixture("server.pem"),
        server_key = fixture("server.key"),
        ca = fixture("ca.pem"),
    ))?;
    let listeners = doc
        .get_mut("static_resources")
        .and_then(|r| r.get_mut("listeners"))
        .and_then(Yaml::as_sequence_mut)
        .ok_or_else(|| anyhow!("the configuration has no listeners"))?;
    let chain = listeners
        .get_mut(0)
        .and_then(|l| l.get_mut("filter_chains"))
        .and_then(|c| c.get_mut(0))
        .and_then(Yaml::as_mapping_mut)
        .ok_or_else(|| anyhow!("the first listener has no filter chain"))?;
    chain.insert("transport_socket".into(), downstream);
    let Some(hcm) = chain
        .get_mut("filters")
        .and_then(|f| f.get_mut(0))
        .and_then(|f| f.get_mut("typed_config"))
        .and_then(Yaml::as_mapping_mut)
    else {
        bail!("the first listener has no connection manager")
    };
    hcm.insert("forward_client_cert_details".into(), "SANITIZE_SET".into());
    hcm.insert("set_current_client_cert_details".into(), serde_norway::from_str("{uri: true}")?);
    listeners.push(serde_norway::from_str(&format!(
        r#"
name: mtls_caller
address: {{socket_address: {{address: 127.0.0.1, port_value: {client_port}}}}}
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: mtls_caller
      route_config:
        virtual_hosts: [{{name: all, domains: ["*"], routes: [{{match: {{prefix: "/"}}, route: {{cluster: mtls_gateway, timeout: 60s}}}}]}}]
      http_filters:
      - name: envoy.filters.http.router
        typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
"#
    ))?);
    let clusters = doc
        .get_mut("static_resources")
        .and_then(|r| r.get_mut("clusters"))
        .and_then(Yaml::as_sequence_mut)
        .ok_or_else(|| anyhow!("the configuration has no clusters"))?;
    clusters.push(serde_norway::from_str(&format!(
        r#"
name: mtls_gateway
type: STATIC
connect_timeout: 5s
load_assignment:
  cluster_name: mtls_gateway
  endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {listener_port}}}}}}}}}]}}]
transport_socket:
  name: envoy.transport_sockets.tls
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
    sni: gateway.test
    common_tls_context:
      tls_certificates: [{{certificate_chain: {{filename: "{client}"}}, private_key: {{filename: "{client_key}"}}}}]
      validation_context: {{trusted_ca: {{filename: "{ca}"}}}}
"#,
        client = fixture("client.pem"),
        client_key = fixture("client.key"),
        ca = fixture("ca.pem"),
    ))?);
    Ok(())
}
