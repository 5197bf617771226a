//! An in-memory [`SharedStore`] with Envoy's CAS semantics.
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use super::{SetError, SharedStore};

#[derive(Default)]
pub struct FakeStore {
    data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    gets: Cell<u32>,
}

impl FakeStore {
    /// How many reads were made (each is a host call that copies the value in Envoy).
    pub fn gets(&self) -> u32 {
        self.gets.get()
    }
}

impl SharedStore for FakeStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.gets.set(self.gets.get() + 1);
        match self.data.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut data = self.data.borrow_mut();
        let entry = data.entry(key.to_string()).or_insert((Vec::new(), 0));
        if matches!(cas, Some(c) if c != 0 && c != entry.1) {
            return Err(SetError::CasMismatch);
        }
        *entry = (value.to_vec(), entry.1 + 1);
        Ok(())
    }
}

/// What another VM does to the store.
type Race<'a> = Box<dyn FnOnce(&FakeStore) + 'a>;

/// A [`FakeStore`] that another VM writes to once, between our read and our first
/// write, so that write meets a real CAS conflict. Counts writes and conflicts.
pub struct Racing<'a> {
    inner: &'a FakeStore,
    race: RefCell<Option<Race<'a>>>,
    sets: Cell<u32>,
    conflicts: Cell<u32>,
}

impl<'a> Racing<'a> {
    pub fn new(inner: &'a FakeStore, race: impl FnOnce(&FakeStore) + 'a) -> Self {
        Self { inner, race: RefCell::new(Some(Box::new(race))), sets: Cell::new(0), conflicts: Cell::new(0) }
    }

    /// `(writes attempted, writes refused for a stale version)`.
    pub fn writes(&self) -> (u32, u32) {
        (self.sets.get(), self.conflicts.get())
    }
}

impl SharedStore for Racing<'_> {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.inner.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let race = self.race.borrow_mut().take();
        if let Some(race) = race {
            race(self.inner);
        }
        self.sets.set(self.sets.get() + 1);
        let result = self.inner.set(key, value, cas);
        if result == Err(SetError::CasMismatch) {
            self.conflicts.set(self.conflicts.get() + 1);
        }
        result
    }
}
