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

    /// A stable 64-bit hash of the name (FNV-1a): the same in every process, build and platform,
    /// unlike std's `DefaultHasher`. PostgreSQL advisory locks use it as their key.
    pub fn stable_hash(&self) -> u64 {
        self.0.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// The name as it fits a store that takes at most `max` bytes of ASCII (`ascii_only`) or of
    /// UTF-8: unchanged when it fits, otherwise a prefix, `#` and the 16-hex-digit
    /// [`stable_hash`](Self::stable_hash) — stable, and distinct for names that share the prefix.
    pub(crate) fn bounded(&self, max: usize, ascii_only: bool) -> std::borrow::Cow<'_, str> {
        let fits = self.0.len() <= max && (!ascii_only || self.0.is_ascii());
        if fits {
            return std::borrow::Cow::Borrowed(&self.0);
        }
        let budget = max.saturating_sub(17);
        let mut prefix = String::with_capacity(max);
        for c in self.0.chars() {
            let c = if ascii_only && !c.is_ascii() { '?' } else { c };
            if prefix.len() + c.len_utf8() > budget {
                break;
            }
            prefix.push(c);
        }
        std::borrow::Cow::Owned(format!("{prefix}#{:016x}", self.stable_hash()))
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
    fn stable_hash_is_pinned() {
        // FNV-1a 64; "a" is the published test vector. Changing any of these would move every
        // deployed advisory-lock key: they must never change.
        let pinned = [
            ("a", 0xaf63_dc4c_8601_ec8c_u64),
            ("node:1", 0xe6e4_f4c2_20ba_a8ac),
            ("ham:42", 0x2473_1bd6_fbba_0083),
            ("freshlock", 0xf147_75bc_bd48_5688),
        ];
        for (name, hash) in pinned {
            let name = LockName::new(name).expect("valid");
            assert_eq!(name.stable_hash(), hash, "{name}");
        }
    }

    #[test]
    fn bounded_names_fit_and_stay_distinct() {
        let long_a = LockName::new(format!("{}a", "x".repeat(300))).expect("valid");
        let long_b = LockName::new(format!("{}b", "x".repeat(300))).expect("valid");
        let (a, b) = (long_a.bounded(64, true), long_b.bounded(64, true));
        assert!(a.len() <= 64 && b.len() <= 64);
        assert_ne!(a, b);
        let unicode = LockName::new("ロック:1").expect("valid");
        let mapped = unicode.bounded(64, true);
        assert!(mapped.is_ascii() && mapped.len() <= 64, "{mapped}");
        assert_eq!(unicode.bounded(255, false), "ロック:1");
        let short = LockName::new("node:1").expect("valid");
        assert_eq!(short.bounded(64, true), "node:1");
    }

    #[test]
    fn empty_name_is_rejected() {
        assert!(matches!(LockName::new(""), Err(LockError::EmptyName)));
        assert_eq!(
            LockName::new("node:1").map(|n| n.to_string()).ok(),
            Some("node:1".into())
        );
    }
}
