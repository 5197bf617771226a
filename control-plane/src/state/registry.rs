//! The worker registry's data: every entry by id, the ids by name (`URL`, or `URL@rank` for a
//! data-parallel rank), the ids the state file remembers for names not registered (yet), and
//! the next new id. Only this file writes them: an id is never reused, and `ids` and `workers`
//! always name the same entries.

use std::collections::{BTreeMap, HashMap};

use super::worker::WorkerEntry;

/// The registered workers (the owner; read through `&Registry`, written through `&mut`).
#[derive(Default)]
pub(super) struct Registry {
    workers: BTreeMap<u32, WorkerEntry>,
    ids: HashMap<String, u32>,
    /// Ids from the state file for names not registered (yet) since the start.
    remembered: HashMap<String, u32>,
    next_id: u32,
}

impl Registry {
    /// An empty registry: new ids start at `next_id`, the names in `remembered` get their old
    /// ids back.
    pub(super) fn new(next_id: u32, remembered: HashMap<String, u32>) -> Self {
        Self { workers: BTreeMap::new(), ids: HashMap::new(), remembered, next_id }
    }

    // ---- reads

    pub(super) fn get(&self, id: u32) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    pub(super) fn contains(&self, id: u32) -> bool {
        self.workers.contains_key(&id)
    }

    /// Every entry, by id.
    pub(super) fn entries(&self) -> impl Iterator<Item = &WorkerEntry> + Clone {
        self.workers.values()
    }

    /// The id registered under `name`.
    pub(super) fn id_of(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The ids of the worker at `url` and of every data-parallel rank of it (`URL@rank`).
    pub(super) fn ids_at(&self, url: &str) -> Vec<u32> {
        let ranks = format!("{url}@");
        self.ids.iter().filter(|(k, _)| *k == url || k.starts_with(&ranks)).map(|(_, &id)| id).collect()
    }

    pub(super) fn next_id(&self) -> u32 {
        self.next_id
    }

    /// The ids remembered for names not registered now.
    pub(super) fn remembered(&self) -> impl Iterator<Item = (&String, u32)> {
        self.remembered.iter().map(|(name, &id)| (name, id))
    }

    // ---- writes

    pub(super) fn get_mut(&mut self, id: u32) -> Option<&mut WorkerEntry> {
        self.workers.get_mut(&id)
    }

    pub(super) fn entries_mut(&mut self) -> impl Iterator<Item = &mut WorkerEntry> {
        self.workers.values_mut()
    }

    /// The id for a new entry named `name`: the one the state file kept for it if no entry
    /// has it, else a new one (ids are never reused).
    pub(super) fn new_id(&mut self, name: &str) -> u32 {
        let id = match self.remembered.remove(name) {
            Some(id) if !self.workers.contains_key(&id) => id,
            _ => self.next_id,
        };
        self.next_id = self.next_id.max(id.saturating_add(1));
        id
    }

    /// Registers `entry` (its id from [`new_id`](Self::new_id)) under its name.
    pub(super) fn insert(&mut self, entry: WorkerEntry) {
        self.ids.insert(entry.name(), entry.id);
        self.workers.insert(entry.id, entry);
    }

    /// Removes entry `id` and its name.
    pub(super) fn remove(&mut self, id: u32) -> Option<WorkerEntry> {
        let entry = self.workers.remove(&id)?;
        self.ids.remove(&entry.name());
        Some(entry)
    }
}
