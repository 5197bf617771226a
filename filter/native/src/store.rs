//! What the plugins of one Envoy share: shared data (in this process, with the
//! compare-and-swap Envoy's shared data has, since every plugin here is in one address space)
//! and the configuration's stats (recorded through the configuration, from any thread).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use envoy_dynamic_module::{config_stat, define_stat, define_tagged_counter, increment_tagged_counter, StatKind};
use kvmesh_gateway::host::{LabelSets, LabelledMetric, Metric, MetricKind};
use kvmesh_gateway::shared::{SetError, SharedStore};

/// A shared-data value and its compare-and-swap version, by key. The keys are the filter's own
/// (no client picks one), so a fast hash without flood resistance fits.
type Values = HashMap<String, (Vec<u8>, u32), foldhash::fast::RandomState>;

static SHARED: Mutex<Option<Values>> = Mutex::new(None);

/// The value under `key` and its version.
pub fn get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    let Ok(guard) = SHARED.lock() else { return (None, None) };
    match guard.as_ref().and_then(|m| m.get(key)) {
        Some((v, cas)) => (Some(v.clone()), Some(*cas)),
        None => (None, None),
    }
}

/// Writes `value` under `key` if its version is still `cas` (none or 0: unconditionally).
pub fn set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
    let Ok(mut guard) = SHARED.lock() else { return Err(SetError::Other) };
    let values = guard.get_or_insert_with(Values::default);
    // Every request writes a few keys that exist: no key allocated, the value's buffer reused.
    let entry = match values.get_mut(key) {
        Some(entry) => entry,
        None => values.entry(key.to_string()).or_insert((Vec::new(), 0)),
    };
    if matches!(cas, Some(c) if c != 0 && c != entry.1) {
        return Err(SetError::CasMismatch);
    }
    entry.0.clear();
    entry.0.extend_from_slice(value);
    // Never 0 again once written: a reader holding version 0 would write unconditionally.
    entry.1 = entry.1.checked_add(1).unwrap_or(1);
    Ok(())
}

/// The process's shared data as a [`SharedStore`].
pub struct Process;

impl SharedStore for Process {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        set(key, value, cas)
    }
}

/// The filter's stats as defined for one configuration.
pub struct Stats {
    /// Envoy's configuration pointer (stats are recorded through it).
    config: usize,
    /// Stat ids, in [`Metric::ALL`] order (None: Envoy refused to define it).
    ids: Vec<Option<usize>>,
    /// Labelled counter ids, in [`LabelledMetric::ALL`] order, and the labels given out.
    labelled_ids: Vec<Option<usize>>,
    labels: Mutex<LabelSets>,
}

fn stat_kind(kind: MetricKind) -> StatKind {
    match kind {
        MetricKind::Counter => StatKind::Counter,
        MetricKind::Gauge => StatKind::Gauge,
        MetricKind::Histogram => StatKind::Histogram,
    }
}

impl Stats {
    /// Defines every metric (Envoy only allows it while it creates the configuration).
    ///
    /// # Safety
    /// `config` is the pointer `on_http_filter_config_new` was given, and the `Stats` are
    /// dropped before Envoy destroys the configuration... or never used after (see
    /// `Config::alive`).
    pub unsafe fn define(config: *mut c_void) -> Self {
        let ids = Metric::ALL.iter().map(|m| define_stat(config, stat_kind(m.kind()), m.name())).collect();
        let labelled_ids =
            LabelledMetric::ALL.iter().map(|m| define_tagged_counter(config, m.name(), m.label())).collect();
        Self { config: config as usize, ids, labelled_ids, labels: Default::default() }
    }

    /// Adds one to `metric`'s series for `value`.
    pub fn record_labelled(&self, metric: LabelledMetric, value: &str) {
        let pos = LabelledMetric::ALL.iter().position(|m| *m == metric);
        let Some(id) = pos.and_then(|p| self.labelled_ids.get(p).copied().flatten()) else { return };
        let Ok(label) = self.labels.lock().map(|mut labels| labels.label(metric, value, None)) else { return };
        // SAFETY: the configuration is alive (see `define`).
        unsafe { increment_tagged_counter(self.config as *mut c_void, id, &label, 1) }
    }

    pub fn record(&self, metric: Metric, value: u64) {
        let pos = Metric::ALL.iter().position(|m| *m == metric);
        if let Some(id) = pos.and_then(|p| self.ids.get(p).copied().flatten()) {
            // SAFETY: the configuration is alive (see `define`).
            unsafe { config_stat(self.config as *mut c_void, stat_kind(metric.kind()), id, value) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_gateway::shared::update;

    #[test]
    fn a_stale_version_is_refused_and_none_writes_unconditionally() {
        let key = "test.store.cas";
        set(key, b"a", None).unwrap();
        let (value, cas) = get(key);
        assert_eq!(value.as_deref(), Some(&b"a"[..]));
        set(key, b"b", cas).unwrap();
        assert_eq!(set(key, b"c", cas), Err(SetError::CasMismatch), "the version moved on");
        assert_eq!(get(key).0.as_deref(), Some(&b"b"[..]));
        set(key, b"d", None).unwrap();
        set(key, b"e", Some(0)).unwrap();
        assert_eq!(get(key).0.as_deref(), Some(&b"e"[..]));
    }

    #[test]
    fn the_version_wraps_past_zero() {
        let key = "test.store.wrap";
        set(key, b"a", None).unwrap();
        if let Ok(mut guard) = SHARED.lock() {
            if let Some(entry) = guard.as_mut().and_then(|m| m.get_mut(key)) {
                entry.1 = u32::MAX;
            }
        }
        set(key, b"b", Some(u32::MAX)).unwrap();
        let (_, cas) = get(key);
        assert_eq!(cas, Some(1), "not 0, which means no check");
        assert_eq!(set(key, b"c", Some(u32::MAX)), Err(SetError::CasMismatch));
    }

    /// Envoy's worker threads share one process here: compare-and-swap must lose no update
    /// when they race. (`update` gives up after a bounded number of conflicts, as the filter's
    /// callers expect: every update it reports written must be in the value, and no other.)
    #[test]
    fn threads_that_race_lose_no_update() {
        let key = "test.store.race";
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut written = 0u64;
                    for _ in 0..500 {
                        let ok = update(&Process, key, |v| {
                            let count = v.get(..8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
                            *v = (count + 1).to_le_bytes().to_vec();
                        });
                        written += u64::from(ok);
                    }
                    written
                })
            })
            .collect();
        let written: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let value = get(key).0.unwrap();
        assert_eq!(u64::from_le_bytes(value.try_into().unwrap()), written, "every written update counted once");
        assert!(written > 0);
    }
}
