//! The session's identity map: at most one cached model per (entity, primary key).
//!
//! It knows nothing about SQL or locks: repositories decide when to read, write and evict.

use std::{
    any::TypeId,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use dashmap::DashMap;
use sea_orm::{Value, sea_query::ValueTuple};

use crate::erased::Erased;

/// Entity type + primary key.
pub(crate) type Key = (TypeId, PkKey);

/// A primary-key value as the map stores it: 40 bytes for the usual single-column key, where a
/// `ValueTuple` takes 96 (it has room for three values inline).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum PkKey {
    /// A single-column key.
    One(Value),
    /// A composite key.
    Many(Box<[Value]>),
}

impl From<ValueTuple> for PkKey {
    fn from(tuple: ValueTuple) -> Self {
        match tuple {
            ValueTuple::One(value) => Self::One(value),
            many => Self::Many(many.into_iter().collect()),
        }
    }
}

impl PkKey {
    /// The key as sea-orm takes it.
    pub(crate) fn to_tuple(&self) -> ValueTuple {
        match self {
            Self::One(value) => ValueTuple::One(value.clone()),
            Self::Many(values) => match &values[..] {
                [a, b] => ValueTuple::Two(a.clone(), b.clone()),
                [a, b, c] => ValueTuple::Three(a.clone(), b.clone(), c.clone()),
                _ => ValueTuple::Many(values.to_vec()),
            },
        }
    }
}

/// Counters of an identity map, read with [`crate::Session::cache_stats`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Lookups answered from the map.
    pub hits: u64,
    /// Lookups that had to go to the database.
    pub misses: u64,
    /// Entries removed: by `reset_cache`, by `locked_update` before its reload, by the capacity
    /// bound, or by clearing the map.
    pub evictions: u64,
    /// Entries in the map now.
    pub len: usize,
}

/// One change a committed locked write makes to its session's cache. Every locked write records
/// its changes as these and makes them with [`IdentityMap::apply`] once its transaction
/// committed (never before: a rolled-back write leaves the cache as it was).
pub(crate) enum Change {
    /// The row as the write stored it (or, for a write that changed nothing, as it read it).
    Cache(Key, Erased),
    /// The row is gone, or what the write left is unknown.
    Evict(Key),
}

impl Change {
    /// Caches `model` under `key`.
    pub(crate) fn cache<M: Send + Sync + 'static>(key: Key, model: Arc<M>) -> Self {
        Self::Cache(key, Erased::new(model))
    }
}

/// Models shared as `Arc<Model>`, keyed by entity type and primary key.
#[derive(Debug, Default)]
pub(crate) struct IdentityMap {
    entries: DashMap<Key, Erased>,
    /// `None`: unbounded.
    capacity: Option<usize>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl IdentityMap {
    pub(crate) fn new(capacity: Option<usize>) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// The cached model, counting a hit or a miss. A hit is a map lookup and an `Arc` clone.
    pub(crate) fn get<M: Send + Sync + 'static>(&self, key: &Key) -> Option<Arc<M>> {
        let found = self
            .entries
            .get(key)
            .and_then(|entry| entry.value().get::<M>());
        let counter = if found.is_some() {
            crate::metrics::cache_hit();
            &self.hits
        } else {
            crate::metrics::cache_miss();
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Caches `model` under `key`, replacing what was there. When the map is bounded and full, an
    /// arbitrary other entry is evicted first (not the least recently used: the bound is a memory
    /// cap, not a cache policy).
    pub(crate) fn insert<M: Send + Sync + 'static>(&self, key: Key, model: Arc<M>) {
        self.insert_erased(key, Erased::new(model));
    }

    /// [`insert`](Self::insert) of a model whose type is erased.
    fn insert_erased(&self, key: Key, model: Erased) {
        if let Some(capacity) = self.capacity {
            if capacity == 0 {
                return;
            }
            while self.entries.len() >= capacity && !self.entries.contains_key(&key) {
                let victim = self.entries.iter().next().map(|entry| entry.key().clone());
                match victim {
                    Some(victim) => {
                        self.remove(&victim);
                    }
                    None => break,
                }
            }
        }
        self.entries.insert(key, model);
    }

    /// Forgets `key`; returns whether it was cached.
    pub(crate) fn remove(&self, key: &Key) -> bool {
        let removed = self.entries.remove(key).is_some();
        if removed {
            self.evictions.fetch_add(1, Ordering::Relaxed);
            crate::metrics::cache_evictions(1);
        }
        removed
    }

    /// Makes the changes a committed write recorded, in order.
    pub(crate) fn apply(&self, changes: impl IntoIterator<Item = Change>) {
        for change in changes {
            match change {
                Change::Cache(key, model) => self.insert_erased(key, model),
                Change::Evict(key) => {
                    self.remove(&key);
                }
            }
        }
    }

    /// Forgets every entry of one entity type; returns how many there were.
    pub(crate) fn remove_type(&self, entity: TypeId) -> usize {
        let mut removed = 0;
        self.entries.retain(|(ty, _), _| {
            let keep = *ty != entity;
            removed += usize::from(!keep);
            keep
        });
        self.evictions.fetch_add(removed as u64, Ordering::Relaxed);
        crate::metrics::cache_evictions(removed as u64);
        removed
    }

    /// Forgets every entry.
    pub(crate) fn clear(&self) {
        let before = self.entries.len();
        self.entries.clear();
        self.evictions.fetch_add(before as u64, Ordering::Relaxed);
        crate::metrics::cache_evictions(before as u64);
    }

    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            len: self.entries.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: i32) -> Key {
        (TypeId::of::<String>(), PkKey::One(Value::Int(Some(id))))
    }

    #[test]
    fn keys_are_compact_and_round_trip() {
        assert!(
            std::mem::size_of::<Key>() <= 56,
            "{}",
            std::mem::size_of::<Key>()
        );
        let composite = ValueTuple::Two(Value::from("a"), Value::Int(Some(1)));
        assert_eq!(PkKey::from(composite.clone()).to_tuple(), composite);
    }

    #[test]
    fn hit_returns_the_same_allocation() {
        let map = IdentityMap::new(None);
        let model = Arc::new(String::from("row"));
        map.insert(key(1), Arc::clone(&model));
        let hit = map.get::<String>(&key(1)).expect("cached");
        assert!(Arc::ptr_eq(&hit, &model));
        assert!(map.get::<String>(&key(2)).is_none());
        assert_eq!(
            map.stats(),
            CacheStats {
                hits: 1,
                misses: 1,
                evictions: 0,
                len: 1
            }
        );
    }

    #[test]
    fn a_different_type_under_the_same_key_is_a_miss() {
        let map = IdentityMap::new(None);
        map.insert(key(1), Arc::new(String::from("row")));
        assert!(map.get::<u8>(&key(1)).is_none());
    }

    #[test]
    fn remove_and_clear_count_evictions() {
        let map = IdentityMap::new(None);
        map.insert(key(1), Arc::new(1u8));
        map.insert(key(2), Arc::new(2u8));
        map.insert(key(3), Arc::new(3u8));
        assert!(map.remove(&key(1)));
        assert!(!map.remove(&key(1)), "removing twice evicts once");
        map.clear();
        let stats = map.stats();
        assert_eq!((stats.evictions, stats.len), (3, 0));
    }

    #[test]
    fn bounded_map_stays_at_its_cap() {
        let map = IdentityMap::new(Some(10));
        for id in 0..1000 {
            map.insert(key(id), Arc::new(id));
        }
        let stats = map.stats();
        assert_eq!(stats.len, 10);
        assert_eq!(stats.evictions, 990);
        // Replacing an existing key evicts nothing.
        let kept = map
            .entries
            .iter()
            .next()
            .map(|e| e.key().clone())
            .expect("entry");
        map.insert(kept, Arc::new(0));
        assert_eq!(map.stats().evictions, 990);
    }
}
