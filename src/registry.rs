//! What freshlock keeps for a live object it is handed but cannot extend (a sea-orm pool, a lock
//! backend given as `Arc<dyn LockBackend>`), shared by every session given the same object.
//!
//! An entry is found by the object's identity and holds it weakly: the weak handle keeps the
//! object's allocation from being reused while the entry exists, so a later object can never be
//! taken for an earlier one (which a table keyed by a bare address would allow), and entries of
//! dropped objects are pruned when a new one is added.

use std::sync::{Arc, PoisonError, RwLock, Weak};

/// A table of live objects of type `K` and a `V` for each.
pub(crate) struct Registry<K: ?Sized, V> {
    entries: RwLock<Vec<(Weak<K>, V)>>,
}

impl<K: ?Sized, V: Clone> Registry<K, V> {
    pub(crate) const fn new() -> Self {
        Self {
            entries: RwLock::new(Vec::new()),
        }
    }

    /// The value kept for `object`, made by `make` the first time it is asked for.
    pub(crate) fn get_or_insert_with(&self, object: &Arc<K>, make: impl FnOnce() -> V) -> V {
        let find = |entries: &[(Weak<K>, V)]| {
            entries
                .iter()
                .find(|(known, _)| std::ptr::addr_eq(known.as_ptr(), Arc::as_ptr(object)))
                .map(|(_, value)| value.clone())
        };
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = find(&entries) {
            return found;
        }
        drop(entries);
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = find(&entries) {
            return found;
        }
        entries.retain(|(known, _)| known.strong_count() > 0);
        let value = make();
        entries.push((Arc::downgrade(object), value.clone()));
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_per_live_object_and_none_inherited() {
        static TABLE: Registry<String, u32> = Registry::new();
        let (a, b) = (Arc::new("a".to_owned()), Arc::new("b".to_owned()));
        assert_eq!(TABLE.get_or_insert_with(&a, || 1), 1);
        assert_eq!(
            TABLE.get_or_insert_with(&Arc::clone(&a), || 2),
            1,
            "a clone is the same"
        );
        assert_eq!(
            TABLE.get_or_insert_with(&b, || 3),
            3,
            "another object has its own"
        );
        drop(a);
        // A new object never gets a dropped one's value, wherever it is allocated.
        for _ in 0..100 {
            let c = Arc::new("a".to_owned());
            assert_eq!(TABLE.get_or_insert_with(&c, || 4), 4);
        }
        let entries = TABLE.entries.read().unwrap().len();
        assert!(
            entries <= 3,
            "dropped objects are pruned ({entries} entries)"
        );
    }
}
