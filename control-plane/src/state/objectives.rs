//! The InferenceObjective priorities discovery found (`--inference-pool`), merged into the
//! routing settings every filter gets: the pool's objectives, then the `--priority-objective`
//! entries of names the pool does not have (an object in the cluster wins over a flag).

use kvmesh_core::priority::MAX_OBJECTIVES;
use kvmesh_core::RoutingSettings;

use super::store::State;

impl State {
    /// The routing settings the filters get: the flags', with the discovered objectives.
    pub fn routing(&self) -> RoutingSettings {
        merged(&self.settings.routing, &self.objectives())
    }

    /// The pool's objectives now (valid `name=N` entries). When that changes what the
    /// filters get, the next delta carries the settings. Returns whether it did.
    pub fn set_objectives(&self, entries: Vec<String>) -> bool {
        {
            let mut current = self.objectives();
            if *current == entries {
                return false;
            }
            *current = entries;
        }
        let routing = self.routing();
        self.lock().publication_mut().settings_changed((&routing).into());
        true
    }
}

/// `flags` with `discovered` objectives first, then the flags' of other names, at most
/// [`MAX_OBJECTIVES`] (more would fail the filters' validation of every setting).
fn merged(flags: &RoutingSettings, discovered: &[String]) -> RoutingSettings {
    if discovered.is_empty() {
        return flags.clone();
    }
    let name = |e: &str| e.rsplit_once('=').map_or(e, |(n, _)| n).trim().to_string();
    let mut entries: Vec<String> = discovered.iter().take(MAX_OBJECTIVES).cloned().collect();
    let names: std::collections::HashSet<String> = entries.iter().map(|e| name(e)).collect();
    let from_flags = flags.priority_objective.iter().flatten().filter(|e| !names.contains(&name(e)));
    entries.extend(from_flags.cloned());
    entries.truncate(MAX_OBJECTIVES);
    RoutingSettings { priority_objective: Some(entries), ..flags.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_state;

    #[test]
    fn discovered_objectives_win_over_flags_and_go_out_in_the_next_delta() {
        let s = test_state(&[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--priority-objective",
            "batch=0",
            "--priority-objective",
            "chat=1",
        ]);
        s.publish();
        assert!(!s.set_objectives(Vec::new()), "nothing discovered yet: no change");
        assert_eq!(s.publish(), None);
        assert!(s.set_objectives(vec!["batch=-1".into()]));
        let got = s.routing().priority_objective.unwrap();
        assert_eq!(got, ["batch=-1", "chat=1"], "the object wins; the flag's other name stays");
        let mut deltas = s.subscribe();
        assert!(s.publish().is_some(), "a delta for the settings alone");
        let delta = deltas.try_recv().unwrap();
        let shipped = kvmesh_core::RoutingSettings::try_from(delta.settings.clone().unwrap()).unwrap();
        assert_eq!(shipped.priority_objective.unwrap(), ["batch=-1", "chat=1"]);
        assert!(!s.set_objectives(vec!["batch=-1".into()]), "the same again: no delta");
        assert_eq!(s.publish(), None);
        let full = s.full_snapshot();
        assert!(full.settings.unwrap().priority_objective.unwrap().values.contains(&"batch=-1".to_string()));
    }

    #[test]
    fn the_merged_list_stays_within_the_bound() {
        let flags = RoutingSettings { priority_objective: Some(vec!["flag=1".into()]), ..Default::default() };
        let many: Vec<String> = (0..MAX_OBJECTIVES + 5).map(|i| format!("o{i}=0")).collect();
        let got = merged(&flags, &many).priority_objective.unwrap();
        assert_eq!(got.len(), MAX_OBJECTIVES);
        assert!(kvmesh_core::priority::parse_objectives(&got).is_ok());
    }
}
