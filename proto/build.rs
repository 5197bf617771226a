//! Compiles `kvmesh.proto` and `envoy_eds.proto` (the subset of Envoy's EDS API kvmesh-cp
//! serves) with protox (pure Rust: no protoc needed) into prost types, plus the tonic server
//! and client when the `server` feature is on.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=kvmesh.proto");
    println!("cargo:rerun-if-changed=envoy_eds.proto");
    let fds = protox::compile(["kvmesh.proto", "envoy_eds.proto"], ["."])?;
    let tonic = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    tonic_prost_build::configure().build_server(tonic).build_client(tonic).compile_fds(fds)?;
    Ok(())
}
