//! What a suite writes: `target/bench/<suite>.json` (the run's context, one object per
//! router/config, the pair-wise ratios), `target/bench/<suite>.md` (the tables) and the charts.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use kvmesh_testkit::repo_root;

/// The default output directory.
pub fn default_dir() -> PathBuf {
    repo_root().join("target/bench")
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .current_dir(repo_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The commit measured (`-dirty` with uncommitted changes).
pub fn commit() -> String {
    let head = sh("git", &["rev-parse", "--short=12", "HEAD"]);
    let dirty = !sh("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty();
    if head.is_empty() {
        "unknown".into()
    } else if dirty {
        format!("{head}-dirty")
    } else {
        head
    }
}

/// The machine: CPU model, cores, memory, kernel, and the load average when the run began
/// (a busy machine distorts every number).
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:")?.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    json!({
        "cpu": model,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "memory_gib": (mem_kib as f64 / (1 << 20) as f64 * 10.0).round() / 10.0,
        "kernel": sh("uname", &["-sr"]),
        "loadavg_at_start": load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    })
}

/// A markdown table.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("| {} |\n", headers.join(" | "));
    out.push_str(&format!(
        "|{}\n",
        headers.iter().enumerate().map(|(i, _)| if i == 0 { " --- |" } else { " ---: |" }).collect::<String>()
    ));
    for r in rows {
        out.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    out
}

pub fn f(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "-".into()
    }
}

/// Writes `<suite>.json`, `<suite>.md` (the tables under a line naming the run) and the
/// suite's charts into `dir`, and prints the tables.
pub fn finish(dir: &Path, suite: &str, doc: &Value, markdown: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(format!("{suite}.json")), serde_json::to_string_pretty(doc)?)?;
    let m = &doc["machine"];
    let header = format!(
        "<!-- `{}` at commit {}{}; {} ({} cores, {} GiB), load average at start {} -->\n\n",
        doc["command"].as_str().unwrap_or(""),
        doc["commit"].as_str().unwrap_or(""),
        if doc["quick"] == true { ", QUICK run" } else { "" },
        m["cpu"].as_str().unwrap_or(""),
        m["cores"],
        m["memory_gib"],
        m["loadavg_at_start"].as_str().unwrap_or(""),
    );
    let charts = super::charts::draw(dir, suite, doc);
    let mut md = format!("{header}{markdown}");
    for c in &charts {
        md.push_str(&format!("\n![{suite}]({c})\n"));
    }
    std::fs::write(dir.join(format!("{suite}.md")), &md)?;
    println!("\n{md}");
    eprintln!("==> wrote {}/{suite}.json and {suite}.md ({} charts)", dir.display(), charts.len());
    Ok(())
}
