//! PNG charts of a suite's JSON (`plotters`): horizontal bars, one per router/config (and the
//! trace's reference hit rates, in green). Text is drawn with a TrueType font found on the
//! system at run time (DejaVu or any `.ttf` under /usr/share/fonts; `cargo xtask test`
//! installs fonts-dejavu-core when there is none); without one, no chart is drawn and the run
//! says so.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::Value;

fn font_file(dir: &Path, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut dirs = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            dirs.push(p);
        } else if p.extension().is_some_and(|x| x == "ttf") {
            return Some(p);
        }
    }
    dirs.into_iter().filter(|_| depth > 0).find_map(|d| font_file(&d, depth - 1))
}

/// The font charts are drawn with: DejaVu Sans (Debian's `fonts-dejavu-core`, which `cargo
/// xtask test` installs when no font is found), else any `.ttf` under /usr/share/fonts.
pub(crate) fn font_path() -> Option<PathBuf> {
    let preferred = PathBuf::from("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf");
    if preferred.exists() {
        Some(preferred)
    } else {
        font_file(Path::new("/usr/share/fonts"), 4)
    }
}

/// Registers a system font as "sans-serif" once; false when there is none.
fn font() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let Some(bytes) = font_path().and_then(|p| std::fs::read(p).ok()) else { return false };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

/// One horizontal bar per `(label, value)`, kvmesh's in another colour.
fn bars(path: &Path, title: &str, unit: &str, items: &[(String, f64)]) -> anyhow::Result<()> {
    let (w, row) = (1100u32, 26u32);
    let h = 70 + row * items.len() as u32 + 20;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let text = |size: u32| ("sans-serif", size).into_font().color(&BLACK);
    root.draw(&Text::new(title.to_string(), (20, 15), text(20))).map_err(|e| anyhow::anyhow!("{e}"))?;
    let max = items.iter().map(|(_, v)| *v).filter(|v| v.is_finite()).fold(0.0, f64::max).max(1e-9);
    let (x0, span) = (430i32, 560f64);
    for (i, (label, v)) in items.iter().enumerate() {
        let y = 60 + (i as u32 * row) as i32;
        let colour = if label.starts_with("kvmesh") {
            RGBColor(31, 119, 180)
        } else if label.starts_with("reference") {
            RGBColor(150, 200, 150)
        } else {
            RGBColor(170, 170, 170)
        };
        let len = if v.is_finite() { (v / max * span) as i32 } else { 0 };
        root.draw(&Text::new(label.clone(), (20, y + 4), text(14))).map_err(|e| anyhow::anyhow!("{e}"))?;
        root.draw(&Rectangle::new([(x0, y), (x0 + len.max(1), y + row as i32 - 6)], colour.filled()))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let value = if v.is_finite() { format!("{v:.1} {unit}") } else { "-".into() };
        root.draw(&Text::new(value, (x0 + len + 6, y + 4), text(14))).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// A chart to draw: file name, title, unit, bars.
type Chart = (String, String, &'static str, Vec<(String, f64)>);

/// Draws the suite's charts into `dir`; returns their file names.
pub fn draw(dir: &Path, suite: &str, doc: &Value) -> Vec<String> {
    if !font() {
        eprintln!("xtask: no TrueType font under /usr/share/fonts: no charts (apt-get install fonts-dejavu-core)");
        return Vec::new();
    }
    let results = doc["results"].as_array().cloned().unwrap_or_default();
    let mut charts: Vec<Chart> = Vec::new();
    let pick = |filter: &dyn Fn(&Value) -> bool, key: &str, scale: f64| -> Vec<(String, f64)> {
        results
            .iter()
            .filter(|r| filter(r))
            .map(|r| (r["config"].as_str().unwrap_or("").to_string(), r[key].as_f64().unwrap_or(f64::NAN) * scale))
            .collect()
    };
    match suite {
        "overhead" => {
            for mode in ["regular", "pd"] {
                let rows = pick(&|r: &Value| r["mode"] == mode, "rps", 1.0);
                if !rows.is_empty() {
                    charts.push((
                        format!("overhead-{mode}-rps.png"),
                        format!("Overhead ({mode}): requests per second"),
                        "req/s",
                        rows,
                    ));
                }
                let rows =
                    pick(&|r: &Value| r["mode"] == mode && r["router"] != "direct", "proxy_cpu_us_per_request", 1.0);
                if !rows.is_empty() {
                    charts.push((
                        format!("overhead-{mode}-cpu.png"),
                        format!("Overhead ({mode}): proxy CPU per request"),
                        "µs",
                        rows,
                    ));
                }
            }
        }
        "quality" => {
            let mut workloads: Vec<String> =
                results.iter().filter_map(|r| r["workload"].as_str().map(String::from)).collect();
            workloads.dedup();
            for w in workloads {
                let mut rows = pick(&|r: &Value| r["workload"] == w.as_str(), "hit_rate", 100.0);
                if w == "trace" {
                    // What the workers' caches could reach on this trace, beside what they did.
                    let refs = &doc["params"]["trace"]["references"];
                    for (key, label) in [
                        ("ideal", "reference: infinite cache"),
                        ("pooled_lru", "reference: one LRU, pooled capacity"),
                        ("one_worker", "reference: one worker alone"),
                    ] {
                        if let Some(v) = refs[key].as_f64() {
                            rows.push((label.to_string(), v * 100.0));
                        }
                    }
                }
                charts.push((format!("quality-{w}-hit.png"), format!("Quality ({w}): KV cache hit rate"), "%", rows));
            }
        }
        _ => {}
    }
    let mut out = Vec::new();
    for (file, title, unit, rows) in charts {
        match bars(&dir.join(&file), &title, unit, &rows) {
            Ok(()) => out.push(file),
            Err(e) => eprintln!("xtask: chart {file}: {e:#}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs a TrueType font, as the benchmarks do: `cargo xtask test` installs
    /// fonts-dejavu-core when none is found.
    #[test]
    fn an_overhead_chart_is_a_png() {
        assert!(
            font(),
            "no TrueType font under /usr/share/fonts to draw charts with: `cargo xtask test` installs one \
             (apt-get install fonts-dejavu-core)"
        );
        let dir = std::env::temp_dir().join(format!("kvmesh-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let doc = serde_json::json!({"results": [
            {"mode": "regular", "router": "kvmesh", "config": "kvmesh (1 thread)", "rps": 5000.0, "proxy_cpu_us_per_request": 150.0},
            {"mode": "regular", "router": "smg", "config": "SMG 1.13.0", "rps": 3000.0, "proxy_cpu_us_per_request": 250.0},
        ]});
        let files = draw(&dir, "overhead", &doc);
        assert_eq!(files, ["overhead-regular-rps.png", "overhead-regular-cpu.png"]);
        for file in &files {
            let png = std::fs::read(dir.join(file)).unwrap();
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{file}");
            // The IHDR chunk's size: 1100 pixels wide, one 26-pixel row per bar under the title.
            let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
            assert_eq!((&png[12..16], be(16), be(20)), (&b"IHDR"[..], 1100, 70 + 26 * 2 + 20), "{file}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
