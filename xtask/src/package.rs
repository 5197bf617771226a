//! `cargo xtask package`: the filter as users install it — a size-optimised release `.wasm`,
//! its sha256, and an OCI image layout holding it that istio-agent can pull once pushed to a
//! registry (the "compat" variant of the Wasm OCI image format: one `tar+gzip` layer with
//! `plugin.wasm`, plain OCI media types, so any registry and any copy tool takes it). Written
//! by hand, without a container engine, and reproducibly: the same `.wasm` always gives the
//! same digests.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use kvmesh_testkit::repo_root;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::tools::{ensure_envoy, ensure_wasm_target, run, step};

/// The cargo profile the packaged `.wasm` is built with (`Cargo.toml`).
const PROFILE: &str = "wasm-package";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file name istio-agent looks for in the layer.
const PLUGIN_FILE: &str = "plugin.wasm";

const USAGE: &str = "usage: cargo xtask package [--out DIR] [--tag TAG]
  builds the filter (.wasm, size-optimised), prints its sha256, and writes DIR (default dist/):
    kvmesh_filter.wasm   the module (for http:// URLs and Istio 1.27's own fetch)
    oci/                 an OCI image layout of it, tagged TAG (default: the crate version)
  and the native build, for a standalone Envoy of the release it is built against (1.40):
    libkvmesh_native.so  the filter as an Envoy dynamic module
    envoy-native.yaml, envoy-pd-native.yaml
                         envoy/envoy.yaml and envoy-pd.yaml loading it in the .wasm's place
                         (each checked with `envoy --mode validate`)
  and for Istio (istio/overlays/native), one module per Envoy ABI and their image's recipe:
    native/envoy-1.39/, native/envoy-1.40/   libkvmesh_native.so built for that Envoy
    native/Dockerfile    deploy/native-module/Dockerfile (--build-arg ENVOY=1.39 or 1.40)";

/// The native build's file name, and the shipped configurations rendered for it.
const NATIVE_MODULE: &str = "libkvmesh_native.so";
const NATIVE_CONFIGS: [(&str, &str); 2] =
    [("envoy/envoy.yaml", "envoy-native.yaml"), ("envoy/envoy-pd.yaml", "envoy-pd-native.yaml")];

pub fn run_package(args: &[String]) -> anyhow::Result<()> {
    let mut out = repo_root().join("dist");
    let mut tag = env!("CARGO_PKG_VERSION").to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(it.next().context("--out takes a directory")?),
            "--tag" => tag = it.next().context("--tag takes a tag")?.clone(),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option `{other}`\n{USAGE}"),
        }
    }
    check_tag(&tag)?;
    // Absolute: Envoy validates the native configurations from the repository root.
    let out = std::path::absolute(&out).with_context(|| format!("--out {}", out.display()))?;
    ensure_wasm_target()?;
    step(&format!("building the filter (wasm32-wasip1, profile {PROFILE})"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(cargo).args(["build", "--profile", PROFILE, "-p", "kvmesh-filter", "--target", "wasm32-wasip1"]))?;
    let built = repo_root().join(format!("target/wasm32-wasip1/{PROFILE}/kvmesh_filter.wasm"));
    let module = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;

    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let wasm = out.join("kvmesh_filter.wasm");
    std::fs::write(&wasm, &module).with_context(|| format!("writing {}", wasm.display()))?;
    let layout = out.join("oci");
    let image = write_oci_layout(&layout, &module, &tag)?;

    let wasm_sha = hex(&Sha256::digest(&module));
    println!();
    println!("{}  ({} bytes)", wasm.display(), module.len());
    println!("  sha256 {wasm_sha}");
    println!("{}  (OCI image layout, tag {tag})", layout.display());
    println!("  manifest digest sha256:{}", image.manifest_digest);
    println!();
    println!("Push the image, e.g. (any of these tools; none is needed to build it):");
    println!("  skopeo copy oci:{}:{tag} docker://REGISTRY/kvmesh-filter:{tag}", layout.display());
    println!("  oras cp --from-oci-layout {}:{tag} REGISTRY/kvmesh-filter:{tag}", layout.display());
    println!("Then, in istio/base/envoyfilter-gateway.yaml (and examples/):");
    println!("  uri: oci://REGISTRY/kvmesh-filter:{tag}");
    println!("  sha256: \"{}\"   # oci://: the manifest digest", image.manifest_digest);
    println!("For an http(s):// URL, or Istio 1.27 (istio/istio-1.27/), the module's own digest:");
    println!("  sha256: \"{wasm_sha}\"");
    package_native(&out)
}

/// The native build and the shipped configurations that load it, each validated by Envoy.
fn package_native(out: &Path) -> anyhow::Result<()> {
    step(&format!("building the native build ({NATIVE_MODULE}, release)"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(cargo).args(["build", "--release", "-p", "kvmesh-native"]))?;
    let built = repo_root().join("target/release").join(NATIVE_MODULE);
    let module = out.join(NATIVE_MODULE);
    std::fs::copy(&built, &module).with_context(|| format!("copying {} to {}", built.display(), module.display()))?;
    let bytes = std::fs::read(&module).with_context(|| format!("reading {}", module.display()))?;
    let envoy = ensure_envoy()?;
    std::env::set_var("ENVOY_BIN", &envoy);
    let mut written = Vec::new();
    for (template, name) in NATIVE_CONFIGS {
        let body = kvmesh_testkit::envoy::native_template(&repo_root().join(template), &module)?;
        let path = out.join(name);
        std::fs::write(&path, native_header(template, name) + &body)
            .with_context(|| format!("writing {}", path.display()))?;
        step(&format!("envoy --mode validate -c {}", path.display()));
        kvmesh_testkit::envoy::validate_with_modules(&path, Some(out))?;
        written.push(path);
    }
    println!();
    println!("{}  ({} bytes, native: Envoy 1.40 on this platform only)", module.display(), bytes.len());
    println!("  sha256 {}", hex(&Sha256::digest(&bytes)));
    for path in &written {
        println!("{}", path.display());
    }
    package_native_for_istio(out)?;
    println!("Run it (kvmesh-cp on :18000, or edit worker_urls and control_plane_cluster as in envoy/envoy.yaml):");
    println!(
        "  ENVOY_DYNAMIC_MODULES_SEARCH_PATH={} envoy -c {}",
        out.display(),
        out.join(NATIVE_CONFIGS[0].1).display()
    );
    Ok(())
}

/// The Envoy releases whose ABI the native build is packaged for (Istio 1.31 ships 1.39).
const NATIVE_ABIS: [&str; 2] = ["1.39", "1.40"];

/// `native/`: the module built for each Envoy ABI in [`NATIVE_ABIS`], and the image recipe.
fn package_native_for_istio(out: &Path) -> anyhow::Result<()> {
    let dir = out.join("native");
    for abi in NATIVE_ABIS {
        let built = crate::matrix::build_native_for(&format!("{abi}.0"))?
            .with_context(|| format!("no native build for Envoy {abi}"))?;
        let into = dir.join(format!("envoy-{abi}"));
        std::fs::create_dir_all(&into).with_context(|| format!("creating {}", into.display()))?;
        std::fs::copy(&built, into.join(NATIVE_MODULE)).with_context(|| format!("copying {}", built.display()))?;
        let bytes = std::fs::read(into.join(NATIVE_MODULE))?;
        println!("{}  (Envoy {abi}; sha256 {})", into.join(NATIVE_MODULE).display(), hex(&Sha256::digest(&bytes)));
    }
    let recipe = repo_root().join("deploy/native-module/Dockerfile");
    std::fs::copy(&recipe, dir.join("Dockerfile")).with_context(|| format!("copying {}", recipe.display()))?;
    println!("Its image for Istio (istio/overlays/native; ENVOY: your Istio's Envoy, 1.31: 1.39):");
    println!(
        "  docker build --build-arg ENVOY=1.39 -t REGISTRY/kvmesh-native:{}-envoy1.39 {}",
        env!("CARGO_PKG_VERSION"),
        dir.display()
    );
    Ok(())
}

/// The comment at the top of a rendered native configuration.
fn native_header(template: &str, name: &str) -> String {
    format!(
        "# kvmesh's native build in a standalone Envoy, written by `cargo xtask package` from\n\
         # {template} (read that file for what each part does; regenerate this one instead of\n\
         # editing it): the same configuration with the Wasm filter replaced by Envoy's\n\
         # dynamic-modules filter loading {NATIVE_MODULE}, configured with the same JSON plus\n\
         # control_plane_address (the module opens its control-plane streams itself).\n\
         #   ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$PWD/dist envoy -c dist/{name}\n\
         # The module runs only in the Envoy release it was built against (1.40): Envoy only\n\
         # warns when the ABI versions differ.\n"
    )
}

/// A tag as OCI references allow it.
fn check_tag(tag: &str) -> anyhow::Result<()> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && tag.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if !ok {
        bail!("--tag `{tag}` is not an OCI tag (letters, digits, `_`, `.`, `-`; at most 128; no leading `.` or `-`)");
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What [`write_oci_layout`] wrote.
pub struct Image {
    /// Hex sha256 of the image manifest: what istio-agent checks an `oci://` module against.
    pub manifest_digest: String,
}

/// Writes `blob` under `blobs/sha256/`, returning its descriptor.
fn put_blob(layout: &Path, media_type: &str, blob: &[u8]) -> anyhow::Result<(serde_json::Value, String)> {
    let digest = hex(&Sha256::digest(blob));
    let path = layout.join("blobs/sha256").join(&digest);
    std::fs::write(&path, blob).with_context(|| format!("writing {}", path.display()))?;
    Ok((json!({"mediaType": media_type, "digest": format!("sha256:{digest}"), "size": blob.len()}), digest))
}

/// A POSIX ustar archive holding one regular file, `name`, with fixed owner, mode and time (so
/// that the same content always gives the same bytes).
fn tar_one_file(name: &str, content: &[u8]) -> anyhow::Result<Vec<u8>> {
    if name.len() > 100 {
        bail!("tar entry name `{name}` is longer than 100 bytes");
    }
    let mut header = [0u8; 512];
    let mut put = |at: usize, field: &[u8]| header[at..at + field.len()].copy_from_slice(field);
    put(0, name.as_bytes());
    put(100, b"0000644\0"); // mode
    put(108, b"0000000\0"); // uid
    put(116, b"0000000\0"); // gid
    put(124, format!("{:011o}\0", content.len()).as_bytes()); // size
    put(136, b"00000000000\0"); // mtime: the epoch
    put(148, b"        "); // checksum, counted as spaces
    put(156, b"0"); // a regular file
    put(257, b"ustar\0"); // magic
    put(263, b"00"); // version
    let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
    header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    let mut tar = header.to_vec();
    tar.extend_from_slice(content);
    tar.resize(tar.len().div_ceil(512) * 512, 0);
    tar.extend_from_slice(&[0u8; 1024]); // end of archive
    Ok(tar)
}

/// Writes an OCI image layout (image-spec 1.0: `oci-layout`, `index.json`, `blobs/sha256/`) at
/// `layout` holding `module` as `plugin.wasm`, tagged `tag`. Replaces what was there.
pub fn write_oci_layout(layout: &Path, module: &[u8], tag: &str) -> anyhow::Result<Image> {
    if module.len() < 8 || &module[..4] != b"\0asm" {
        bail!("not a WebAssembly module (no \\0asm header)");
    }
    if layout.exists() {
        std::fs::remove_dir_all(layout).with_context(|| format!("removing the old {}", layout.display()))?;
    }
    std::fs::create_dir_all(layout.join("blobs/sha256")).with_context(|| format!("creating {}", layout.display()))?;

    let tar = tar_one_file(PLUGIN_FILE, module)?;
    let mut gz = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::best());
    gz.write_all(&tar)?;
    let layer_blob = gz.finish()?;
    let (mut layer, _) = put_blob(layout, LAYER, &layer_blob)?;
    layer["annotations"] = json!({"org.opencontainers.image.title": PLUGIN_FILE});

    let config_blob = serde_json::to_vec(&json!({
        "architecture": "wasm",
        "os": "wasip1",
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", hex(&Sha256::digest(&tar)))]},
        "config": {},
    }))?;
    let (config, _) = put_blob(layout, CONFIG, &config_blob)?;

    let manifest_blob = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config,
        "layers": [layer],
        "annotations": {
            "org.opencontainers.image.title": "kvmesh-filter",
            "org.opencontainers.image.description": "kvmesh proxy-wasm filter (wasm32-wasip1) for Envoy and Istio",
            "org.opencontainers.image.version": tag,
        },
    }))?;
    let (mut manifest, manifest_digest) = put_blob(layout, MANIFEST, &manifest_blob)?;
    manifest["annotations"] = json!({"org.opencontainers.image.ref.name": tag});

    let index =
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest]});
    std::fs::write(layout.join("index.json"), serde_json::to_vec_pretty(&index)?)?;
    std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion": "1.0.0"}"#)?;
    Ok(Image { manifest_digest })
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use serde_json::Value;

    use super::*;

    fn blob(layout: &Path, descriptor: &Value) -> Vec<u8> {
        let digest = descriptor["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap();
        let bytes = std::fs::read(layout.join("blobs/sha256").join(digest)).unwrap();
        assert_eq!(hex(&Sha256::digest(&bytes)), digest, "a blob is stored under its digest");
        assert_eq!(descriptor["size"].as_u64(), Some(bytes.len() as u64));
        bytes
    }

    /// Reads the layout back as a registry client would, and the layer with independent
    /// decoders (flate2's gzip reader, the `tar` crate).
    #[test]
    fn the_layout_holds_the_module_as_istio_agent_expects_it() {
        let dir = std::env::temp_dir().join(format!("kvmesh-oci-test-{}", std::process::id()));
        let module: Vec<u8> = b"\0asm\x01\0\0\0".iter().copied().chain((0..3000u32).map(|i| (i % 251) as u8)).collect();
        let image = write_oci_layout(&dir, &module, "1.2.3").unwrap();

        let layout: Value = serde_json::from_slice(&std::fs::read(dir.join("oci-layout")).unwrap()).unwrap();
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");
        let index: Value = serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
        let entry = &index["manifests"][0];
        assert_eq!(entry["mediaType"], MANIFEST);
        assert_eq!(entry["annotations"]["org.opencontainers.image.ref.name"], "1.2.3");
        assert_eq!(entry["digest"], format!("sha256:{}", image.manifest_digest));

        let manifest: Value = serde_json::from_slice(&blob(&dir, entry)).unwrap();
        assert_eq!(manifest["schemaVersion"], 2);
        assert_eq!(manifest["config"]["mediaType"], CONFIG);
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "istio-agent's compat variant: exactly one layer");
        assert_eq!(layers[0]["mediaType"], LAYER);

        let mut tar_bytes = Vec::new();
        flate2::read::GzDecoder::new(blob(&dir, &layers[0]).as_slice()).read_to_end(&mut tar_bytes).unwrap();
        let config: Value = serde_json::from_slice(&blob(&dir, &manifest["config"])).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], format!("sha256:{}", hex(&Sha256::digest(&tar_bytes))));
        let mut archive = tar::Archive::new(tar_bytes.as_slice());
        let mut entries: Vec<(String, Vec<u8>)> = Vec::new();
        for e in archive.entries().unwrap() {
            let mut e = e.unwrap();
            assert!(e.header().entry_type().is_file());
            let mut content = Vec::new();
            e.read_to_end(&mut content).unwrap();
            entries.push((e.path().unwrap().display().to_string(), content));
        }
        assert_eq!(entries, vec![(PLUGIN_FILE.to_string(), module.clone())]);

        // Reproducible: the same module gives the same digest.
        let again = write_oci_layout(&dir, &module, "1.2.3").unwrap();
        assert_eq!(again.manifest_digest, image.manifest_digest);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("kvmesh-oci-bad-{}", std::process::id()));
        let e = write_oci_layout(&dir, b"not wasm at all", "x").err().unwrap();
        assert!(e.to_string().contains("not a WebAssembly module"), "{e}");
        for tag in ["", ".hidden", "a/b", "spaces here", &"x".repeat(129)] {
            assert!(check_tag(tag).is_err(), "{tag:?}");
        }
        assert!(check_tag("0.1.0-rc.1").is_ok());
        assert!(tar_one_file(&"n".repeat(101), b"").is_err());
    }
}
