//! `kvmesh.gateway.id`: this Envoy's id in the control plane.

use super::SharedStore;

/// Where the Envoy's id lives in shared data.
pub const GATEWAY_ID_KEY: &str = "kvmesh.gateway.id.v1";

/// This Envoy's id in the control plane: one per Envoy, whichever of its VMs holds the
/// streams, so that the cumulative counts it reports are never counted twice when the stream
/// moves. The first VM that needs it makes it (the node id, if set, and 64 random bits) and
/// stores it in shared data; the others read it.
pub fn gateway_id(store: &dyn SharedStore, node_id: Option<String>, seed: u64) -> String {
    if let Some(id) = store.get(GATEWAY_ID_KEY).0.and_then(|v| String::from_utf8(v).ok()).filter(|id| !id.is_empty()) {
        return id;
    }
    let mut node: String = node_id.unwrap_or_default().chars().filter(char::is_ascii_graphic).take(64).collect();
    if node.is_empty() {
        node = "envoy".into();
    }
    let id = format!("{node}/{seed:016x}");
    // Only a missing key is written (a VM that lost a race reads the winner's id back).
    let (existing, cas) = store.get(GATEWAY_ID_KEY);
    if existing.is_none() {
        let _ = store.set(GATEWAY_ID_KEY, id.as_bytes(), cas);
    }
    store.get(GATEWAY_ID_KEY).0.and_then(|v| String::from_utf8(v).ok()).filter(|id| !id.is_empty()).unwrap_or(id)
}
