//! Child processes that die with their handle, free ports, and bounded waiting on conditions.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A child process, killed (and reaped) on drop. Its output goes to a log file in
/// `$TMPDIR/kvmesh-logs`, removed when it stops unless [`keep_logs`] was called.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command) -> anyhow::Result<Proc> {
        let dir = std::env::temp_dir().join("kvmesh-logs");
        std::fs::create_dir_all(&dir)?;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let log = dir.join(format!("{name}-{}-{n}.log", std::process::id()));
        let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Proc { name: name.to_string(), child, log })
    }

    /// The last lines of the process's output, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("{} output ({}):\n{tail}", self.name, self.log.display())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Some(exit status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    /// Stops the process; its log goes with it unless the test is failing by a panic or logs
    /// are kept ([`keep_logs`], `KVMESH_KEEP_LOGS`). A test that fails by returning an error
    /// already carries the log's tail in its message.
    fn drop(&mut self) {
        self.kill();
        let keep = KEEP_LOGS.load(Ordering::Relaxed) || std::env::var_os("KVMESH_KEEP_LOGS").is_some();
        if !keep && !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

static KEEP_LOGS: AtomicBool = AtomicBool::new(false);

/// Keeps every process's log after it stops (`cargo xtask up`: its console names the log
/// of a process that exited).
pub fn keep_logs() {
    KEEP_LOGS.store(true, Ordering::Relaxed);
}

/// A port that was free on 127.0.0.1 a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Polls `cond` every 20 ms until it holds, for at most `limit`.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
