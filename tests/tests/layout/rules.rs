//! The layout rules of issue 45, over the scanner of the parent file.

use std::fs;

use super::{non_test_tokens, rust_files, skip_group, tokenize, workspace_root};

/// Issue 45: each PD protocol's behaviour lives in its module under `filter/gateway/src/pd/`,
/// which the rest of the filter calls through `PrefillLeg` and `Leg`. Outside that folder no
/// code of the filter crates (tests aside) names a protocol's variant — of `PdProtocol`, or of
/// the dispatch enums `PrefillLeg` and `Leg` — so nothing there can branch on the protocol.
/// Left out: the declaration (`pd_protocol.rs`, which names them) and `config.rs`, which
/// gives the deployment's protocol its default when none is configured (a value, no branch).
#[test]
fn pd_protocols_are_named_only_in_their_modules() {
    let root = workspace_root();
    let declaration = root.join("core/src/pd_protocol.rs");
    let modules = root.join("filter/gateway/src/pd");
    let allowed = [declaration.clone(), root.join("core/src/config.rs")];
    // The variants, from the declaration.
    let toks = tokenize(&fs::read_to_string(&declaration).unwrap());
    let start = toks.windows(2).position(|w| w[0] == "enum" && w[1] == "PdProtocol").expect("enum PdProtocol");
    let open = start + toks[start..].iter().position(|t| t == "{").unwrap();
    let body = &toks[open + 1..skip_group(&toks, open) - 1];
    let variants: Vec<&str> = body
        .iter()
        .enumerate()
        .filter(|(k, t)| t.starts_with(|c: char| c.is_ascii_uppercase()) && (*k == 0 || body[k - 1] == ","))
        .map(|(_, t)| t.as_str())
        .collect();
    assert!(variants.len() >= 3, "PdProtocol's variants, read from {}: {variants:?}", declaration.display());
    assert!(modules.join("mod.rs").is_file(), "the PD protocols' modules are in {}", modules.display());
    let mut found = Vec::new();
    for path in rust_files(&root.join("filter")) {
        let rel = path.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
        let test_file = rel.contains("/tests/") || rel.ends_with("tests.rs");
        if path.starts_with(&modules) || allowed.contains(&path) || test_file {
            continue;
        }
        let toks = non_test_tokens(&fs::read_to_string(&path).unwrap());
        for w in toks.windows(3) {
            let named = matches!(w[0].as_str(), "PdProtocol" | "PrefillLeg" | "Leg") && w[1] == "::";
            if named && variants.contains(&w[2].as_str()) {
                found.push(format!("{rel}: {}::{}", w[0], w[2]));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a PD protocol named outside its module (put the behaviour in filter/gateway/src/pd/):\n  {}",
        found.join("\n  ")
    );
}

/// kvmesh-cp's state (issue 45): the registry, the global index, the publication and the
/// gateways each hold their data privately behind methods, so no field in `state/` is
/// `pub(super)` (one that must be seen outside its file is a method of its owner).
#[test]
fn control_plane_state_has_no_pub_super_fields() {
    let dir = workspace_root().join("control-plane/src/state");
    let files = rust_files(&dir);
    assert!(files.len() > 5, "control-plane/src/state/ holds the state's modules");
    let mut fields = Vec::new();
    for path in files {
        let toks = tokenize(&fs::read_to_string(&path).unwrap());
        for (i, t) in toks.iter().enumerate() {
            // `pub(super) name:` (a named field), or `(pub(super) T` / `, pub(super) T` (a tuple field).
            let at = |k: usize| toks.get(i + k).map(String::as_str);
            if t != "pub" || at(1) != Some("(") || at(2) != Some("super") || at(3) != Some(")") {
                continue;
            }
            let named = at(5) == Some(":") && at(6) != Some(":");
            let tuple = i > 0 && matches!(toks[i - 1].as_str(), "(" | ",") && at(4) != Some("fn");
            if named || tuple {
                fields.push(format!("{}: {}", path.file_name().unwrap().to_string_lossy(), at(4).unwrap_or("")));
            }
        }
    }
    assert!(fields.is_empty(), "pub(super) fields in control-plane/src/state:\n  {}", fields.join("\n  "));
}

/// The two documents that drift as they grow stay within their size: the architecture map
/// (invariants, not tunable numbers or history) and the current benchmark results (history
/// belongs in git).
#[test]
fn the_map_and_the_benchmark_results_stay_short() {
    for (doc, max_lines, max_bytes) in [("docs/ARCHITECTURE.md", 380, 28_672), ("docs/benchmarks.md", 380, 40_960)] {
        let text = std::fs::read_to_string(kvmesh_testkit::repo_root().join(doc)).unwrap();
        let lines = text.lines().count();
        assert!(lines <= max_lines && text.len() <= max_bytes, "{doc}: {lines} lines, {} bytes", text.len());
    }
}

/// `Gateway` composes its parts and lends them out (`Front`, `Outcomes`, the ledger, the
/// publisher, engine feedback); it does not grow their methods back: at most 30 functions in
/// its `impl`, and its file at most 400 lines.
#[test]
fn the_gateway_stays_a_composition() {
    let path = workspace_root().join("filter/gateway/src/gateway/mod.rs");
    let src = fs::read_to_string(&path).unwrap();
    assert!(src.lines().count() <= 400, "gateway/mod.rs: {} lines", src.lines().count());
    let toks = non_test_tokens(&src);
    let start = toks.windows(2).position(|w| w[0] == "impl" && w[1] == "Gateway").expect("impl Gateway");
    let open = start + toks[start..].iter().position(|t| t == "{").unwrap();
    let end = skip_group(&toks, open);
    let fns = toks[open..end].iter().filter(|t| *t == "fn").count();
    assert!(fns > 10, "the scan found the impl ({fns} functions)");
    assert!(fns <= 30, "Gateway has {fns} functions: lend a part out instead (see gateway/mod.rs's doc)");
}

/// The folders are the layers (ARCHITECTURE.md, "Code map"): a crate's normal and build
/// dependencies are workspace crates of lower layers only (tests may reach up: dev-dependencies
/// are not checked).
#[test]
fn crates_depend_only_on_lower_layers() {
    let layers: [(&str, &str, u32); 11] = [
        ("core", "kvmesh-core", 0),
        ("filter/dynamic-module", "envoy-dynamic-module", 0),
        ("proto", "kvmesh-proto", 1),
        ("filter/gateway", "kvmesh-gateway", 2),
        ("filter/wasm", "kvmesh-filter", 3),
        ("filter/native", "kvmesh-native", 3),
        ("control-plane", "kvmesh-cp", 2),
        ("sim", "kvmesh-sim", 2),
        ("tests", "kvmesh-testkit", 4),
        ("xtask", "xtask", 5),
        ("xtask/naive-filter", "kvmesh-naive-filter", 1),
    ];
    let layer_of = |name: &str| layers.iter().find(|(_, n, _)| *n == name).map(|l| l.2);
    let mut wrong = Vec::new();
    for (dir, name, layer) in layers {
        let manifest = fs::read_to_string(workspace_root().join(dir).join("Cargo.toml")).unwrap();
        assert!(manifest.contains(&format!("name = \"{name}\"")), "{dir} is {name}");
        let mut section = String::new();
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
                continue;
            }
            if !section.ends_with("dependencies]") || section.contains("dev-dependencies") {
                continue;
            }
            let dep = line.split(['=', '.', ' ']).next().unwrap_or("");
            if let Some(dep_layer) = layer_of(dep).filter(|_| dep != name) {
                if dep_layer >= layer {
                    wrong.push(format!("{name} (layer {layer}) -> {dep} (layer {dep_layer})"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "dependencies that do not run down:\n  {}", wrong.join("\n  "));
}
