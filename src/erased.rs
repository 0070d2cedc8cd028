//! A shared value whose type is erased for storage and read back as that type: the crate's one
//! type erasure.
//!
//! Three maps hold values of whatever entity types the application has — the session's cache
//! (`identity_map.rs`: a model per entity and key), a section's snapshots (`tx.rs`) and commit
//! combining's rooms (`write/room.rs`: the waiters of one entity's row). Rust has no statics
//! generic over a type, and freshlock asks nothing of an entity beyond sea-orm's traits, so
//! these are type maps (as `http::Extensions` is one): each key holds the value type's `TypeId`
//! and the value is stored erased. This file is the only place that erases and reads back;
//! the maps and the write path name only [`Erased`].
//!
//! Why not values instead (each row as its columns' `sea_orm::Value`s): a cache hit would
//! rebuild the model column by column where it now clones an `Arc`, and a combined write would
//! move every waiter's row through the same conversion twice. The erasure costs one `TypeId`
//! comparison per read.

use std::{any::Any, sync::Arc};

/// A shared value of some `'static` type, read back as that type with [`Erased::get`]. Cheap to
/// clone (an `Arc`).
#[derive(Clone)]
pub(crate) struct Erased(Arc<dyn Any + Send + Sync>);

impl std::fmt::Debug for Erased {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Erased")
    }
}

impl Erased {
    /// `value`, its type erased.
    pub(crate) fn new<T: Any + Send + Sync>(value: Arc<T>) -> Self {
        Self(value)
    }

    /// The value as a `T`, or `None` when it is another type. The maps key their entries by the
    /// value type's `TypeId`, so for them `None` means a key built for another type: a bug,
    /// which reads as an absent entry rather than a wrong value.
    pub(crate) fn get<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        Arc::clone(&self.0).downcast::<T>().ok()
    }

    /// How many handles share the value (this one included): a map entry nobody else refers to
    /// can go.
    pub(crate) fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_as_its_own_type_only() {
        let erased = Erased::new(Arc::new(7_u32));
        assert_eq!(erased.get::<u32>().as_deref(), Some(&7));
        assert!(erased.get::<u64>().is_none());
        assert!(erased.get::<String>().is_none());
    }

    #[test]
    fn counts_its_holders() {
        let value = Arc::new(String::from("row"));
        let erased = Erased::new(Arc::clone(&value));
        assert_eq!(erased.holders(), 2);
        let read = erased.get::<String>();
        assert_eq!(erased.holders(), 3);
        drop((read, value));
        assert_eq!(erased.holders(), 1);
    }
}
