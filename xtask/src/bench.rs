//! `cargo xtask bench`: added later.

pub fn run(_args: &[String]) -> anyhow::Result<()> {
    anyhow::bail!("no benchmarks yet")
}
