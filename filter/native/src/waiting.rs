//! Requests paused in an admission queue, by worker thread: Envoy gives an HTTP-filter module
//! no timer on its worker threads, so the ticker wakes each thread that has some once a tick,
//! through one of its paused streams' schedulers. The woken stream's hook runs that thread's
//! tick, which admits or expires every request waiting there.
//!
//! Besides them, each thread with requests waiting for a worker's answer has one waker: a
//! stream of that thread whose scheduler the ticker commits the same way, so that the tick
//! runs there even when no hook does (every request of the thread stuck on a hung worker:
//! `Plugin::fail_hung` must run to move them). When the waker's stream ends, another live
//! stream of the thread takes its place.

use std::sync::Mutex;
use std::thread::ThreadId;

use envoy_dynamic_module::Scheduler;

/// The event the ticker commits.
pub const TICK_EVENT: u64 = 1;

struct Entry {
    thread: ThreadId,
    /// The stream's Envoy pointer, as a key.
    stream: usize,
    scheduler: Scheduler,
    /// The thread's waker, not a queued request.
    waker: bool,
}

/// One configuration's paused streams (schedulers are created and deleted by their own
/// worker thread, committed to by the ticker, always under the lock).
#[derive(Default)]
pub struct Waiting {
    entries: Mutex<Vec<Entry>>,
}

impl Waiting {
    /// Registers `stream` (on this thread) unless it is already there; `scheduler` makes its
    /// scheduler when needed.
    pub fn add(&self, stream: usize, scheduler: impl FnOnce() -> Option<Scheduler>) {
        let Ok(mut entries) = self.entries.lock() else { return };
        if entries.iter().any(|e| e.stream == stream) {
            return;
        }
        if let Some(scheduler) = scheduler() {
            entries.push(Entry { thread: std::thread::current().id(), stream, scheduler, waker: false });
        }
    }

    /// Makes `stream` (on this thread) the thread's waker unless it has one; `scheduler` makes
    /// its scheduler when needed.
    pub fn add_waker(&self, stream: usize, scheduler: impl FnOnce() -> Option<Scheduler>) {
        let Ok(mut entries) = self.entries.lock() else { return };
        let thread = std::thread::current().id();
        if entries.iter().any(|e| e.waker && e.thread == thread) {
            return;
        }
        if let Some(scheduler) = scheduler() {
            entries.push(Entry { thread, stream, scheduler, waker: true });
        }
    }

    /// Forgets `stream` (its schedulers are deleted): before Envoy destroys it. Whether it was
    /// its thread's waker.
    pub fn remove(&self, stream: usize) -> bool {
        let Ok(mut entries) = self.entries.lock() else { return false };
        let waker = entries.iter().any(|e| e.stream == stream && e.waker);
        entries.retain(|e| e.stream != stream);
        waker
    }

    /// Forgets `stream` as a queued request (admitted or answered); a waker stays.
    pub fn dequeue(&self, stream: usize) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|e| e.stream != stream || e.waker);
        }
    }

    /// Wakes one stream of each thread that has any.
    pub fn wake(&self) {
        let Ok(entries) = self.entries.lock() else { return };
        let mut woken: Vec<ThreadId> = Vec::new();
        for entry in entries.iter() {
            if !woken.contains(&entry.thread) {
                woken.push(entry.thread);
                entry.scheduler.commit(TICK_EVENT);
            }
        }
    }
}
