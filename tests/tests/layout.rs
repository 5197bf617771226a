//! The workspace's layout rules (issues 28 and 45): no import circles between the modules of a
//! crate, no source file over 800 lines in any crate of the workspace, no `pub(super)` field
//! in kvmesh-cp's state (its parts are owners with private data), and no PD protocol named
//! outside its module.
//!
//! The module graph is read from the source text by a small scanner, not the compiler: one
//! node per file under a crate's `src/` (`foo.rs` and `foo/mod.rs` are module `foo`,
//! `lib.rs`/`main.rs` the crate root), and an edge A -> B when file A names module B through a
//! `crate::`, `super::` or `self::` path, in a `use` (grouped ones included) or inline. A path
//! goes to the deepest file module it names (`crate::policy::affinity_of` is `policy/mod`).
//! Comments, string and char literals and `#[cfg(test)]` items are skipped (tests may use
//! anything), and so are files declared `#[cfg(test)] mod x;`. Declaring `mod child;` is
//! containment, not an edge; a child naming its parent's items (`super::Thing`) is one.
//!
//! Not seen: paths that macros build from pieces, items brought in by a bare child-module
//! path (`use child::X` / `pub use child::X` in the parent, without `self::`), and
//! `#[path]`/`include!`. A glob (`use super::*`) counts as an edge to the module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

#[path = "layout/rules.rs"]
mod rules;

// ---- the scanner -------------------------------------------------------------------------

/// Rust source as tokens: identifiers (keywords and numbers included), lifetimes, `::` and
/// single punctuation characters. Comments and string/char literals are dropped.
fn tokenize(src: &str) -> Vec<String> {
    let c: Vec<char> = src.chars().collect();
    let n = c.len();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = Vec::new();
    let mut i = 0;
    // Skips a (raw when `hashes` is Some) string body starting after its opening quote.
    let skip_string = |mut i: usize, hashes: Option<usize>| -> usize {
        while i < n {
            match (c[i], hashes) {
                ('\\', None) => i += 2,
                ('"', None) => return i + 1,
                ('"', Some(h)) if (1..=h).all(|k| at(i + k) == '#') => return i + 1 + h,
                _ => i += 1,
            }
        }
        n
    };
    while i < n {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(i + 1, None);
        } else if matches!(ch, 'r' | 'b' | 'c') && {
            // A string prefix: b"", c"", r"", r#""#, br"", br#""#, cr"".
            let mut j = i + 1;
            if ch != 'r' && at(j) == 'r' {
                j += 1;
            }
            let raw = ch == 'r' || at(i + 1) == 'r';
            let mut h = 0;
            while raw && at(j + h) == '#' {
                h += 1;
            }
            at(j + h) == '"' && (raw || h == 0)
        } {
            let mut j = i + 1;
            if ch != 'r' && at(j) == 'r' {
                j += 1;
            }
            if ch == 'r' || at(i + 1) == 'r' {
                let mut h = 0;
                while at(j + h) == '#' {
                    h += 1;
                }
                i = skip_string(j + h + 1, Some(h));
            } else {
                i = skip_string(j + 1, None);
            }
        } else if ch == 'b' && at(i + 1) == '\'' {
            i += 1; // b'x': the char literal below
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                // An escaped char literal: '\n', '\'', '\u{1F600}'.
                i += 3;
                while i < n && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3; // 'x'
            } else {
                // A lifetime or label.
                let start = i;
                i += 1;
                while i < n && ident_char(c[i]) {
                    i += 1;
                }
                out.push(c[start..i].iter().collect());
            }
        } else if ch == 'r' && at(i + 1) == '#' && ident_char(at(i + 2)) {
            // A raw identifier, r#type.
            let start = i + 2;
            i += 2;
            while i < n && ident_char(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if ident_char(ch) {
            let start = i;
            while i < n && ident_char(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if ch == ':' && at(i + 1) == ':' {
            out.push("::".to_string());
            i += 2;
        } else {
            out.push(ch.to_string());
            i += 1;
        }
    }
    out
}

/// What one file says: the module paths it names (absolute, from the crate root) and the
/// child modules it declares under `#[cfg(test)]`.
#[derive(Debug, Default, PartialEq)]
struct FileRefs {
    refs: BTreeSet<Vec<String>>,
    test_children: BTreeSet<Vec<String>>,
}

/// Index just past the bracket matching the opener at `i`, or `toks.len()`.
fn skip_group(toks: &[String], i: usize) -> usize {
    let mut depth = 0usize;
    let mut j = i;
    while j < toks.len() {
        match toks[j].as_str() {
            "(" | "[" | "{" => depth += 1,
            ")" | "]" | "}" => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    toks.len()
}

/// Whether the attribute tokens between `#[` and `]` are `cfg(test)` or `cfg(all(.., test, ..))`.
fn is_test_cfg(attr: &[String]) -> bool {
    let a: Vec<&str> = attr.iter().map(String::as_str).collect();
    match a.as_slice() {
        ["cfg", "(", "test", ")"] => true,
        ["cfg", "(", "all", "(", rest @ ..] => {
            let mut depth = 0;
            rest.iter().any(|t| {
                match *t {
                    "(" => depth += 1,
                    ")" => depth -= 1,
                    _ => {}
                }
                depth == 0 && *t == "test"
            })
        }
        _ => false,
    }
}

/// Index just past the item starting at `j` (its attributes already skipped): through its
/// `;` or its braced body.
fn skip_item(toks: &[String], mut j: usize) -> usize {
    while j < toks.len() {
        match toks[j].as_str() {
            ";" => return j + 1,
            "{" => return skip_group(toks, j),
            "(" | "[" => j = skip_group(toks, j),
            "}" | ")" | "]" => return j,
            _ => j += 1,
        }
    }
    j
}

/// The tokens of `src` outside its `#[cfg(test)]` items.
fn non_test_tokens(src: &str) -> Vec<String> {
    let toks = tokenize(src);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if toks[i] == "#" && toks.get(i + 1).is_some_and(|t| t == "[") {
            let end = skip_group(&toks, i + 1);
            if is_test_cfg(toks.get(i + 2..end - 1).unwrap_or(&[])) {
                let mut j = end;
                while toks.get(j).is_some_and(|t| t == "#") && toks.get(j + 1).is_some_and(|t| t == "[") {
                    j = skip_group(&toks, j + 1);
                }
                i = skip_item(&toks, j);
                continue;
            }
        }
        out.push(toks[i].clone());
        i += 1;
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars().next().is_some_and(|ch| ch.is_alphabetic() || ch == '_')
}

/// Turns a path as written in module `here` into an absolute one, or None when it does not
/// start with `crate`, `super` or `self` (another crate, a local item, a bare child module).
fn resolve(here: &[String], path: &[String]) -> Option<Vec<String>> {
    let first = path.first()?.as_str();
    let (mut base, rest) = match first {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (here.to_vec(), &path[1..]),
        "super" => {
            let mut base = here.to_vec();
            let mut k = 0;
            while path.get(k).is_some_and(|s| s == "super") {
                base.pop()?;
                k += 1;
            }
            (base, &path[k..])
        }
        _ => return None,
    };
    base.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(base)
}

/// Parses the use tree starting at `i` with `prefix` already read; pushes every leaf path and
/// returns the index after the tree.
fn use_tree(toks: &[String], mut i: usize, mut prefix: Vec<String>, leaves: &mut Vec<Vec<String>>) -> usize {
    if toks.get(i).is_some_and(|t| t == "::") {
        i += 1;
    }
    loop {
        match toks.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                loop {
                    match toks.get(i).map(String::as_str) {
                        None => return i,
                        Some("}") => return i + 1,
                        Some(",") => i += 1,
                        Some(_) => i = use_tree(toks, i, prefix.clone(), leaves),
                    }
                }
            }
            Some("*") => {
                leaves.push(prefix);
                return i + 1;
            }
            Some(t) if is_ident(t) => {
                prefix.push(t.to_string());
                i += 1;
                if toks.get(i).is_some_and(|t| t == "::") {
                    i += 1;
                    continue;
                }
                if toks.get(i).is_some_and(|t| t == "as") {
                    i += 2;
                }
                leaves.push(prefix);
                return i;
            }
            _ => return i,
        }
    }
}

/// Scans one file of module `module` (its path from the crate root).
fn scan(module: &[String], src: &str) -> FileRefs {
    let toks = tokenize(src);
    let mut out = FileRefs::default();
    // Inline modules we are inside: (name, the brace depth their body opened at).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let here = |inline: &Vec<(String, usize)>| -> Vec<String> {
        module.iter().cloned().chain(inline.iter().map(|(m, _)| m.clone())).collect()
    };
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        match t {
            "#" if toks.get(i + 1).is_some_and(|t| t == "[") => {
                let end = skip_group(&toks, i + 1);
                if !is_test_cfg(toks.get(i + 2..end - 1).unwrap_or(&[])) {
                    i = end;
                    continue;
                }
                // A #[cfg(test)] item: skip its other attributes, then the item itself.
                let mut j = end;
                while toks.get(j).is_some_and(|t| t == "#") && toks.get(j + 1).is_some_and(|t| t == "[") {
                    j = skip_group(&toks, j + 1);
                }
                let mut k = j;
                if toks.get(k).is_some_and(|t| t == "pub") {
                    k += 1;
                    if toks.get(k).is_some_and(|t| t == "(") {
                        k = skip_group(&toks, k);
                    }
                }
                if toks.get(k).is_some_and(|t| t == "mod") && toks.get(k + 2).is_some_and(|t| t == ";") {
                    let mut child = here(&inline);
                    child.push(toks[k + 1].clone());
                    out.test_children.insert(child);
                }
                i = skip_item(&toks, j);
            }
            "{" => {
                depth += 1;
                i += 1;
            }
            "}" => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            "mod" if toks.get(i + 2).is_some_and(|t| t == "{") => {
                inline.push((toks[i + 1].clone(), depth + 1));
                depth += 1;
                i += 3;
            }
            "use" => {
                let mut leaves = Vec::new();
                i = use_tree(&toks, i + 1, Vec::new(), &mut leaves);
                let here = here(&inline);
                out.refs.extend(leaves.iter().filter_map(|p| resolve(&here, p)));
            }
            "crate" | "super" | "self" if toks.get(i + 1).is_some_and(|t| t == "::") => {
                // `pub(in crate::x)` is a visibility, not a use.
                let visibility = i >= 2 && toks[i - 1] == "in" && toks[i - 2] == "(";
                let mut path = vec![t.to_string()];
                let mut j = i + 1;
                while toks.get(j).is_some_and(|t| t == "::") && toks.get(j + 1).is_some_and(|t| is_ident(t)) {
                    path.push(toks[j + 1].clone());
                    j += 2;
                }
                if !visibility {
                    out.refs.extend(resolve(&here(&inline), &path));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

// ---- the graph ---------------------------------------------------------------------------

/// A file's module path from its path under `src/`, e.g. `policy/mod.rs` -> ["policy"].
fn module_of(rel: &str) -> Vec<String> {
    let stem = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut parts: Vec<String> = stem.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod") || (parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main")) {
        parts.pop();
    }
    parts
}

/// The import circles among one crate's files (paths under `src/` with their text), each as
/// `a -> b -> a` over the file names without `.rs`.
fn circles(files: &[(String, String)]) -> Vec<String> {
    let modules: BTreeMap<Vec<String>, &str> = files
        .iter()
        .filter(|(rel, _)| rel != "main.rs" || !files.iter().any(|(r, _)| r == "lib.rs"))
        .map(|(rel, _)| (module_of(rel), rel.as_str()))
        .collect();
    let scans: BTreeMap<&str, FileRefs> =
        files.iter().map(|(rel, src)| (rel.as_str(), scan(&module_of(rel), src))).collect();
    let test_only: Vec<&Vec<String>> = scans.values().flat_map(|s| &s.test_children).collect();
    let nodes: Vec<&str> =
        modules.iter().filter(|(m, _)| !test_only.iter().any(|t| m.starts_with(t))).map(|(_, rel)| *rel).collect();
    let index: BTreeMap<&str, usize> = nodes.iter().enumerate().map(|(k, rel)| (*rel, k)).collect();
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); nodes.len()];
    for (from, rel) in nodes.iter().enumerate() {
        for path in &scans[rel].refs {
            // The deepest module the path names.
            let target = (0..=path.len()).rev().find_map(|k| modules.get(&path[..k]));
            if let Some(to) = target.and_then(|t| index.get(t)) {
                if *to != from {
                    edges[from].insert(*to);
                }
            }
        }
    }
    let name = |k: usize| nodes[k].strip_suffix(".rs").unwrap_or(nodes[k]).to_string();
    strongly_connected(&edges)
        .into_iter()
        .filter(|scc| scc.len() > 1)
        .map(|scc| walk(&edges, &scc).into_iter().map(name).collect::<Vec<_>>().join(" -> "))
        .collect()
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            scc.sort_unstable();
            s.out.push(scc);
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// A closed walk through every module of a strongly connected component, along real edges:
/// from its first module to the nearest one not yet visited, and so on, then back.
fn walk(edges: &[BTreeSet<usize>], scc: &[usize]) -> Vec<usize> {
    let shortest = |from: usize, goal: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let mut prev: BTreeMap<usize, usize> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([from]);
        while let Some(v) = queue.pop_front() {
            for &w in &edges[v] {
                if !scc.contains(&w) || prev.contains_key(&w) {
                    continue;
                }
                prev.insert(w, v);
                if goal(w) {
                    let mut path = vec![w];
                    let mut at = prev[&w];
                    while at != from {
                        path.push(at);
                        at = prev[&at];
                    }
                    path.reverse();
                    return path;
                }
                queue.push_back(w);
            }
        }
        Vec::new()
    };
    let start = scc[0];
    let mut seen = BTreeSet::from([start]);
    let mut out = vec![start];
    while seen.len() < scc.len() {
        let step = shortest(*out.last().unwrap(), &|w| !seen.contains(&w));
        if step.is_empty() {
            break;
        }
        seen.extend(step.iter().copied());
        out.extend(step);
    }
    out.extend(shortest(*out.last().unwrap(), &|w| w == start));
    out
}

// ---- the workspace -----------------------------------------------------------------------

fn workspace_root() -> PathBuf {
    // Read at run time so that the test can be pointed at a scratch copy of the workspace.
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&dir).parent().expect("tests/ sits in the workspace root").to_path_buf()
}

/// The `members` of the root Cargo.toml's `[workspace]` (a `dir/*` glob expands to its crates).
fn members(root: &Path) -> Vec<PathBuf> {
    let text = fs::read_to_string(root.join("Cargo.toml")).expect("the root Cargo.toml");
    let start = text.find("[workspace]").expect("a [workspace] table");
    let after = &text[start..];
    let key = after.find("\nmembers").expect("workspace members");
    let list = &after[key..];
    let list = &list[list.find('[').expect("members = [")..list.find(']').expect("members = [..]")];
    let mut out = Vec::new();
    for quoted in list.split('"').skip(1).step_by(2) {
        match quoted.strip_suffix("/*") {
            Some(dir) => {
                let mut dirs: Vec<PathBuf> = fs::read_dir(root.join(dir))
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .filter(|p| p.join("Cargo.toml").is_file())
                    .collect();
                dirs.sort();
                out.extend(dirs);
            }
            None => out.push(root.join(quoted)),
        }
    }
    assert!(!out.is_empty(), "no workspace members found in {}", root.display());
    out
}

/// Every `.rs` file under `dir`, skipping `target` and hidden directories.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else { return out };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                out.extend(rust_files(&path));
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn no_import_circles() {
    let root = workspace_root();
    let mut found = Vec::new();
    for member in members(&root) {
        let src = member.join("src");
        // Files under src/bin/ are crates of their own.
        let files: Vec<(String, String)> = rust_files(&src)
            .into_iter()
            .map(|p| p.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/"))
            .filter(|rel| !rel.starts_with("bin/"))
            .map(|rel| {
                let text = fs::read_to_string(src.join(&rel)).unwrap();
                (rel, text)
            })
            .collect();
        let name = member.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
        found.extend(circles(&files).into_iter().map(|c| format!("{name}: {c}")));
    }
    assert!(
        found.is_empty(),
        "import circles between modules (move what both sides need into the lower module):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn no_file_over_800_lines() {
    let root = workspace_root();
    let mut long = Vec::new();
    // Every crate of the workspace, whole: its sources, tests, build scripts and benches.
    let mut dirs = members(&root);
    // A member nested in another (xtask/naive-filter) is read once, with its parent.
    dirs.retain(|d| !members(&root).iter().any(|o| o != d && d.starts_with(o)));
    for dir in dirs {
        for path in rust_files(&dir) {
            let lines = fs::read_to_string(&path).unwrap().lines().count();
            if lines > 800 {
                long.push(format!("{} ({lines} lines)", path.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(long.is_empty(), "source files over 800 lines:\n  {}", long.join("\n  "));
}

// ---- the scanner's own tests -------------------------------------------------------------

fn krate(files: &[(&str, &str)]) -> Vec<String> {
    circles(&files.iter().map(|(p, s)| (p.to_string(), s.to_string())).collect::<Vec<_>>())
}

fn path(s: &str) -> Vec<String> {
    s.split("::").filter(|p| !p.is_empty()).map(str::to_string).collect()
}

#[test]
fn scanner_resolves_crate_super_self_and_groups() {
    let src = r#"
        use crate::{a, b::c::{D, e as f}, g::*};
        use super::{sibling::X, Parent};
        use self::inner::Y;
        use std::fmt;
        fn f() { crate::h::go(); super::super::top(); Self::new(); }
        pub(in crate::vis) fn g() {}
    "#;
    let refs = scan(&path("p::q"), src).refs;
    let want: BTreeSet<Vec<String>> =
        ["a", "b::c::D", "b::c::e", "g", "p::sibling::X", "p::Parent", "p::q::inner::Y", "h::go", "top"]
            .into_iter()
            .map(path)
            .collect();
    assert_eq!(refs, want);
}

#[test]
fn scanner_skips_comments_strings_and_test_items() {
    let src = r##"
        // use crate::a;
        /* crate::b::X /* nested */ crate::c::X */
        const S: &str = "crate::d::X";
        const R: &str = r#"crate::e::X " still"#;
        const C: char = '"'; fn lt<'a>(x: &'a str) -> &'a str { crate::kept::go(); x }
        #[cfg(test)]
        use crate::f;
        #[cfg(test)]
        mod tests { use super::*; use crate::g; }
        #[cfg(all(test, target_arch = "wasm32"))]
        mod wasm_tests { use crate::h; }
        #[cfg(test)]
        pub mod mock;
        #[cfg(any(test, feature = "x"))]
        fn also_kept() { crate::any::go(); }
    "##;
    let scanned = scan(&path("m"), src);
    assert_eq!(scanned.refs, ["kept::go", "any::go"].into_iter().map(path).collect());
    assert_eq!(scanned.test_children, BTreeSet::from([path("m::mock")]));
}

#[test]
fn test_items_are_left_out_of_the_tokens() {
    let src = "fn f() -> u8 { 1 } #[cfg(test)] #[allow(x)] mod tests { fn g() { A::B; } } fn h() { C::D; }";
    let toks = non_test_tokens(src).join(" ");
    assert!(!toks.contains('A') && toks.contains("C :: D") && toks.contains("fn f"), "{toks}");
}

#[test]
fn inline_modules_shift_super_and_self() {
    let src = "mod inner { use super::X; use self::deep::Y; mod deep { use super::super::Z; } }";
    let refs = scan(&path("m"), src).refs;
    assert_eq!(refs, ["m::X", "m::inner::deep::Y", "m::Z"].into_iter().map(path).collect());
}

#[test]
fn a_circle_is_reported() {
    let found = krate(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c;"),
        ("a.rs", "use crate::b::B; pub struct A;"),
        ("b.rs", "pub struct B(crate::c::C);"),
        ("c.rs", "pub struct C; fn f() -> crate::a::A { todo!() }"),
    ]);
    assert_eq!(found, ["a -> b -> c -> a"]);
}

#[test]
fn a_child_using_its_parent_and_the_parent_using_it_is_a_circle() {
    let found = krate(&[
        ("lib.rs", "pub mod p;"),
        ("p/mod.rs", "mod kid; pub struct Shared; pub fn f() { self::kid::go() }"),
        ("p/kid.rs", "use super::Shared; pub fn go() {}"),
    ]);
    assert_eq!(found, ["p/mod -> p/kid -> p/mod"]);
}

#[test]
fn declaring_a_module_is_not_an_edge() {
    // Every parent declares its children and every child uses its parent: no circle.
    let found = krate(&[
        ("lib.rs", "pub mod p; pub mod q; pub struct Root;"),
        ("p/mod.rs", "mod kid; pub use kid::go; use crate::q::Q; pub struct Shared;"),
        ("p/kid.rs", "use super::Shared; use crate::Root; pub fn go() {}"),
        ("q.rs", "pub struct Q; use crate::Root; #[cfg(test)] mod tests;"),
        // Test-only files may use anything.
        ("q/tests.rs", "use crate::p::Shared;"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn test_only_files_are_left_out() {
    let found = krate(&[
        ("lib.rs", "pub mod a; pub mod b;"),
        ("a.rs", "use crate::b::B; pub struct A; #[cfg(test)] mod tests;"),
        ("a/tests.rs", "use crate::b::B;"),
        ("b.rs", "pub struct B; #[cfg(test)] mod tests { use crate::a::A; }"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}
