//! Registering workers: the workers from the flags, the state file, the admin API and
//! discovery, each URL through the worker URL policy and each with an id never reused (so
//! that the filters' index entries stay unambiguous); and what probing finds out about them:
//! health (with the failure and success thresholds), load, queue and KV pressure.

use std::sync::Arc;

use kvmesh_core::models::ServedModel;
use kvmesh_core::settings::PdProtocol;
use kvmesh_proto::v1::Role;

use super::persist::{self, Persisted};
use super::store::State;
use super::worker::{Pressure, Source, WorkerEntry};
use crate::settings::Settings;

impl State {
    /// The state without a state file (tests).
    #[cfg(test)]
    pub fn new(settings: Settings) -> Arc<Self> {
        Self::build(settings, Persisted::default())
    }

    /// The state, with what `--state-file` kept (a missing file is a first start).
    pub fn open(settings: Settings) -> Result<Arc<Self>, String> {
        let persisted = persist::read(settings.state_file.as_deref())?;
        Ok(Self::build(settings, persisted))
    }

    /// Registers the workers from the flags, then those the state file kept.
    fn build(settings: Settings, persisted: Persisted) -> Arc<Self> {
        // Ids by canonical URL (a file an older kvmesh-cp wrote may spell them otherwise).
        let remembered = persisted.ids.into_iter().map(|(url, id)| (crate::urls::canonical(&url).unwrap_or(url), id));
        let state = Self::empty(settings, persisted.next_id, remembered.collect());
        let s = &state.settings;
        for url in &s.workers {
            let _ = state.add_worker(url, Role::Regular, None, Source::Static);
        }
        for (url, port) in &s.prefill {
            let _ = state.add_worker(url, Role::Prefill, *port, Source::Static);
        }
        for url in &s.decode {
            let _ = state.add_worker(url, Role::Decode, None, Source::Static);
        }
        for w in persisted.api_workers {
            match state.add_worker(&w.url, w.role(), w.bootstrap_port, Source::Api) {
                Ok(id) => state.set_model_id(id, w.model_id),
                Err(e) => tracing::warn!(url = %w.url, "worker from the state file not restored: {e}"),
            }
        }
        state.persist();
        state
    }

    /// Adds a worker under its canonical URL (ids are never reused, so filters' index entries
    /// stay unambiguous).
    pub fn add_worker(
        &self,
        url: &str,
        role: Role,
        bootstrap_port: Option<u16>,
        source: Source,
    ) -> Result<u32, String> {
        self.add_pd_worker(url, role, bootstrap_port, None, source)
    }

    /// [`add_worker`](Self::add_worker) for a PD worker speaking `pd_protocol` when it is not
    /// the deployment's (none: the deployment's).
    pub fn add_pd_worker(
        &self,
        url: &str,
        role: Role,
        bootstrap_port: Option<u16>,
        pd_protocol: Option<PdProtocol>,
        source: Source,
    ) -> Result<u32, String> {
        let url = crate::urls::check(url, &self.settings.worker_policy)?;
        let url = url.as_str();
        let mut inner = self.lock();
        if let Some(id) = inner.registry().id_of(url) {
            return Err(format!("worker {url} is already registered (id {id})"));
        }
        // The id this URL had before a restart, if the state file says and it is free.
        let id = inner.registry_mut().new_id(url);
        // A worker someone named at runtime gets traffic only once it answered a health check.
        let awaiting_probe = source == Source::Api && self.settings.health_checks;
        let mut entry = WorkerEntry::new(id, url, role, bootstrap_port, source, awaiting_probe);
        entry.pd_protocol = pd_protocol;
        inner.registry_mut().insert(entry);
        inner.publication_mut().workers_changed();
        drop(inner);
        tracing::info!(url, ?role, id, ?source, pd_protocol = ?pd_protocol, "worker added");
        self.persist();
        Ok(id)
    }

    /// Removes the worker `url` names, however it is spelled.
    pub fn remove_worker(&self, url: &str) -> bool {
        let Ok(url) = crate::urls::canonical(url) else { return false };
        let url = url.as_str();
        let mut inner = self.lock();
        // The worker, or every data-parallel rank of it (`URL@rank`).
        let ids = inner.registry().ids_at(url);
        if ids.is_empty() {
            return false;
        }
        let (registry, index, publication, _) = inner.parts();
        for &id in &ids {
            registry.remove(id);
            index.remove_worker(id);
        }
        publication.workers_changed();
        drop(inner);
        tracing::info!(url, ?ids, "worker removed");
        self.persist();
        true
    }

    pub fn workers(&self) -> Vec<WorkerEntry> {
        self.lock().registry().entries().cloned().collect()
    }

    /// Applies one health-check result with the failure/success thresholds.
    pub fn health_result(&self, id: u32, ok: bool) {
        let (fail_at, ok_at) = (self.settings.health_failure_threshold, self.settings.health_success_threshold);
        let mut inner = self.lock();
        let Some(w) = inner.registry_mut().get_mut(id) else { return };
        if w.health_result(ok, fail_at, ok_at) {
            tracing::warn!(url = %w.url, healthy = w.healthy, "worker health changed");
            inner.publication_mut().workers_changed();
        }
    }

    /// Worker `id` answered a probe (any HTTP status: it is alive, healthy or not). A worker
    /// taken out for not answering is back, unless its health checks failed meanwhile.
    pub fn answered(&self, id: u32) {
        let fail_at = self.settings.health_failure_threshold;
        let mut inner = self.lock();
        let Some(w) = inner.registry_mut().get_mut(id) else { return };
        if w.answered(fail_at) {
            tracing::warn!(url = %w.url, "worker answers again: back in rotation");
            inner.publication_mut().workers_changed();
        }
    }

    /// A probe of worker `id` is being sent: its silence counts from the oldest one not
    /// answered.
    pub fn asking(&self, id: u32) {
        let mut inner = self.lock();
        if let Some(w) = inner.registry_mut().get_mut(id) {
            w.asking(std::time::Instant::now());
        }
    }

    /// Takes out every healthy worker that answered no probe for `silence` (a hung worker:
    /// connections accepted, nothing answered), until it answers one; returns their ids. A
    /// worker busy generating still answers its probes and is never taken out.
    pub fn mark_unresponsive(&self, silence: std::time::Duration) -> Vec<u32> {
        self.mark_unresponsive_at(std::time::Instant::now(), silence)
    }

    fn mark_unresponsive_at(&self, now: std::time::Instant, silence: std::time::Duration) -> Vec<u32> {
        let mut inner = self.lock();
        let mut marked = Vec::new();
        for w in inner.registry_mut().entries_mut() {
            if w.take_out_if_silent(now, silence) {
                tracing::warn!(url = %w.url, silent_ms = silence.as_millis() as u64, "worker answers no probe: taken out");
                marked.push(w.id);
            }
        }
        if !marked.is_empty() {
            inner.publication_mut().workers_changed();
        }
        marked.sort_unstable();
        marked
    }

    pub fn load_result(&self, id: u32, load: Option<u64>, cache_hit_rate: Option<f64>) {
        let mut inner = self.lock();
        let Some(w) = inner.registry_mut().get_mut(id) else { return };
        if cache_hit_rate.is_some() {
            w.cache_hit_rate = cache_hit_rate;
        }
        if w.polled_load != load {
            w.polled_load = load;
            inner.publication_mut().workers_changed();
        }
    }

    /// The model names worker `id` serves, as it just said: a change goes to the filters.
    pub fn models_result(&self, id: u32, models: Vec<ServedModel>) {
        let mut inner = self.lock();
        let Some(w) = inner.registry_mut().get_mut(id) else { return };
        if w.models != models {
            let names: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
            tracing::info!(url = %w.url, models = ?names, "worker serves");
            w.models = models;
            inner.publication_mut().workers_changed();
        }
    }

    /// Gives worker `id` a model name of its own (`model_id`; none takes it back).
    /// Worker `id`'s KV-event publisher (a pod annotation, the add-worker API).
    pub fn set_kv_events(&self, id: u32, endpoints: Option<crate::settings::KvEventEndpoints>) {
        let mut inner = self.lock();
        if let Some(w) = inner.registry_mut().get_mut(id) {
            w.kv_events = endpoints;
        }
    }

    pub fn set_model_id(&self, id: u32, model_id: Option<String>) {
        let api = {
            let mut inner = self.lock();
            let Some(w) = inner.registry_mut().get_mut(id) else { return };
            if w.model_id == model_id {
                return;
            }
            tracing::info!(url = %w.url, ?model_id, "worker model id");
            w.model_id = model_id;
            let api = w.source == Source::Api;
            inner.publication_mut().workers_changed();
            api
        };
        if api {
            self.persist();
        }
    }

    /// How full worker `id` is, as just polled.
    pub fn pressure_result(&self, id: u32, pressure: Pressure) {
        let mut inner = self.lock();
        let Some(w) = inner.registry_mut().get_mut(id) else { return };
        if w.pressure != pressure {
            w.pressure = pressure;
            inner.publication_mut().workers_changed();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state from kvmesh-cp's command line (shared with the admin API's tests).
    pub(crate) fn state(args: &[&str]) -> Arc<State> {
        let mut argv = vec!["kvmesh-cp"];
        argv.extend(args);
        State::new(crate::args::Args::parse_from(argv).map_err(|e| e.one_line()).unwrap().load().unwrap())
    }

    #[test]
    fn health_thresholds() {
        let s = state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--health-failure-threshold",
            "2",
            "--health-success-threshold",
            "2",
        ]);
        s.publish();
        s.health_result(0, false);
        assert!(s.workers()[0].healthy);
        s.health_result(0, false);
        assert!(!s.workers()[0].healthy);
        s.health_result(0, true);
        assert!(!s.workers()[0].healthy);
        s.health_result(0, true);
        assert!(s.workers()[0].healthy);
    }

    #[test]
    fn a_silent_worker_is_taken_out_until_it_answers() {
        use std::time::{Duration, Instant};
        let s =
            state(&["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2", "--health-failure-threshold", "2"]);
        s.publish();
        let silence = Duration::from_secs(3);
        let later = |s: u64| Instant::now() + Duration::from_secs(s);
        assert!(s.mark_unresponsive_at(later(9), silence).is_empty(), "never asked: not silent");
        s.asking(0);
        s.asking(1);
        assert!(s.mark_unresponsive(silence).is_empty(), "asked just now");
        assert!(s.mark_unresponsive_at(later(2), silence).is_empty(), "silent for less than 3 s");
        assert_eq!(s.mark_unresponsive_at(later(4), silence), vec![0, 1], "silent for more");
        s.answered(1);
        let w = |id: u32| s.workers().into_iter().find(|w| w.id == id).unwrap();
        assert!(!w(0).healthy && w(0).unresponsive && w(0).probed() && w(1).healthy);
        assert!(s.publish().is_some(), "published to the filters");
        assert!(!s.mark_unresponsive_at(later(9), silence).contains(&0), "marked once");
        s.answered(0);
        assert!(w(0).healthy && !w(0).unresponsive, "one answer brings it back");
        // Failed health checks while it was silent: only passed ones bring it back.
        s.asking(0);
        assert!(s.mark_unresponsive_at(later(9), silence).contains(&0));
        s.health_result(0, false);
        s.health_result(0, false);
        s.answered(0);
        assert!(!w(0).healthy && !w(0).probed());
        s.health_result(0, true);
        s.health_result(0, true);
        assert!(w(0).healthy);
    }

    #[test]
    fn an_api_worker_is_unhealthy_until_its_first_health_check_passes() {
        let s = state(&["--worker-urls", "http://127.0.0.1:1", "--health-success-threshold", "3"]);
        let id = s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api).unwrap();
        let health = |s: &State| s.workers().iter().find(|w| w.id == id).unwrap().healthy;
        assert!(!health(&s), "no traffic before it is probed");
        assert!(s.workers()[0].healthy, "static workers start healthy");
        s.health_result(id, false);
        assert!(!health(&s));
        s.health_result(id, true);
        assert!(health(&s), "the first passed check is enough, whatever the success threshold");
        // Without health checks nothing would ever probe it: it starts healthy.
        let s = state(&["--disable-health-check"]);
        s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api).unwrap();
        assert!(s.workers()[0].healthy);
    }

    #[test]
    fn the_url_policy_applies_to_every_source() {
        let s = state(&["--worker-cidrs", "127.0.0.0/8"]);
        for source in [Source::Api, Source::Discovery, Source::Static] {
            assert!(s
                .add_worker("http://169.254.169.254:80", Role::Regular, None, source)
                .unwrap_err()
                .contains("link-local"));
            assert!(s.add_worker("http://0.0.0.0:9901", Role::Regular, None, source).is_err());
            assert!(s.add_worker("http://[::]:9901", Role::Regular, None, source).is_err());
            assert!(s
                .add_worker("http://10.0.0.1:80", Role::Regular, None, source)
                .unwrap_err()
                .contains("--worker-cidrs"));
        }
        assert!(s.add_worker("http://127.0.0.5:80", Role::Regular, None, Source::Api).is_ok());
        assert_eq!(s.workers().len(), 1);
    }

    #[test]
    fn every_source_registers_a_worker_under_one_spelling_of_its_url() {
        let urls = |s: &State| s.workers().into_iter().map(|w| w.url).collect::<Vec<_>>();
        // Flags: two spellings of one worker are one worker.
        let s = state(&["--worker-urls", "http://LOCALHOST:01/", "http://127.0.0.1:1", "http://[FD00:0::1]:8000"]);
        assert_eq!(urls(&s), ["http://127.0.0.1:1", "http://[fd00::1]:8000"]);
        // Discovery and the API, after the flags.
        for (source, url) in [(Source::Discovery, "http://127.0.0.1:1/"), (Source::Api, "http://[fd00::0:1]:08000")] {
            assert!(
                s.add_worker(url, Role::Regular, None, source).unwrap_err().contains("already registered"),
                "{url}"
            );
        }
        assert!(s.remove_worker("http://localhost:0001/"));
        assert_eq!(urls(&s), ["http://[fd00::1]:8000"]);
        // The state file (as an older kvmesh-cp may have written it).
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state.json");
        let kept = r#"{"next_id": 3, "ids": {"http://LOCALHOST:2/": 1},
            "api_workers": [{"url": "http://LOCALHOST:2/", "role": "regular", "bootstrap_port": null},
                            {"url": "http://127.0.0.1:02", "role": "regular", "bootstrap_port": null}]}"#;
        std::fs::write(&file, kept).unwrap();
        let argv = ["kvmesh-cp", "--state-file", file.to_str().unwrap()];
        let s = State::open(crate::args::Args::parse_from(argv).unwrap().load().unwrap()).unwrap();
        let ids: Vec<(String, u32)> = s.workers().into_iter().map(|w| (w.url, w.id)).collect();
        assert_eq!(ids, [("http://127.0.0.1:2".to_string(), 1)], "one worker, with its id");
    }

    #[test]
    fn the_state_file_keeps_api_workers_and_every_id_across_a_restart() {
        let dir = std::env::temp_dir().join(format!("kvmesh-cp-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("state.json");
        let _ = std::fs::remove_file(&file);
        let flags = |extra: &[&str]| {
            let mut f = vec!["--state-file", file.to_str().unwrap(), "--worker-urls", "http://127.0.0.1:1"];
            f.extend(extra);
            f.into_iter().map(String::from).collect::<Vec<_>>()
        };
        let start = |extra: &[&str]| {
            let argv: Vec<String> = std::iter::once("kvmesh-cp".to_string()).chain(flags(extra)).collect();
            State::open(crate::args::Args::parse_from(argv).unwrap().load().unwrap()).unwrap()
        };
        let s = start(&[]);
        assert_eq!(s.add_worker("http://127.0.0.1:2", Role::Regular, None, Source::Api), Ok(1));
        s.set_model_id(1, Some("mistral".into()));
        assert_eq!(s.add_worker("http://127.0.0.1:3", Role::Regular, None, Source::Discovery), Ok(2));
        assert_eq!(s.add_worker("http://127.0.0.1:4", Role::Regular, None, Source::Api), Ok(3));
        assert!(s.remove_worker("http://127.0.0.1:4"));
        drop(s);
        // Restarted, with one more static worker: everyone keeps their id, the discovered
        // worker gets its id back when it is discovered again, new ids are never old ones.
        let s = start(&["http://127.0.0.1:5"]);
        let ids: Vec<(String, u32, bool)> = s.workers().iter().map(|w| (w.url.clone(), w.id, w.healthy)).collect();
        assert_eq!(
            ids,
            [
                ("http://127.0.0.1:1".to_string(), 0, true),
                ("http://127.0.0.1:2".to_string(), 1, false),
                ("http://127.0.0.1:5".to_string(), 4, true)
            ],
            "the API worker is back, unhealthy until probed"
        );
        let api = s.workers().into_iter().find(|w| w.id == 1).unwrap();
        assert_eq!(api.model_id.as_deref(), Some("mistral"), "with its model name");
        assert_eq!(api.served()[0].id, "mistral");
        assert_eq!(s.add_worker("http://127.0.0.1:3", Role::Regular, None, Source::Discovery), Ok(2));
        assert_eq!(s.add_worker("http://127.0.0.1:4", Role::Regular, None, Source::Api), Ok(5));
        std::fs::write(&file, "not json").unwrap();
        let argv: Vec<String> = std::iter::once("kvmesh-cp".to_string()).chain(flags(&[])).collect();
        let e = State::open(crate::args::Args::parse_from(argv).unwrap().load().unwrap()).err().unwrap();
        assert!(e.starts_with("--state-file"), "{e}");
    }
}
