//! Lock names.

use std::{fmt, sync::Arc};

use crate::error::LockError;

/// The name of a lock: a non-empty string, cheap to clone.
///
/// Rows are locked under `"{table}:{key}"`, where `key` is the primary key written as SQL literals
/// separated by commas (`node:1`, `order_line:7,'abc'`). Backends with name limits (MySQL's 64
/// characters) map names to what they accept themselves.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// Makes a lock name.
    ///
    /// # Errors
    /// [`LockError::EmptyName`] for an empty string.
    pub fn new(name: impl Into<String>) -> Result<Self, LockError> {
        let name = name.into();
        if name.is_empty() {
            return Err(LockError::EmptyName);
        }
        Ok(Self(Arc::from(name)))
    }

    /// A name the caller has built to be non-empty (row names: `"{table}:{key}"`).
    pub(crate) fn trusted(name: String) -> Self {
        debug_assert!(!name.is_empty());
        Self(Arc::from(name))
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_name_is_rejected() {
        assert!(matches!(LockName::new(""), Err(LockError::EmptyName)));
        assert_eq!(
            LockName::new("node:1").map(|n| n.to_string()).ok(),
            Some("node:1".into())
        );
    }
}
