//! The lock backends' names: [`LockKind`].

use std::{fmt, str::FromStr};

use crate::error::LockError;

/// The lock backends, by name: what a configuration file or a `--lock` flag says.
///
/// | name | scope | across processes | crash | fencing |
/// |---|---|---|---|---|
/// | `local` | lease, in-process | no | freed with the process | not needed |
/// | `table` | lease in `freshlock_lock` | yes, any of the three databases | freed after TTL | owner + expiry checked in the write's transaction |
/// | `row` | row lock in the transaction | yes (SQLite: `BEGIN IMMEDIATE` serializes; not on a Galera cluster, where a row lock is node-local) | freed at once | not needed |
/// | `pg_advisory` | advisory lock in the transaction | yes, PostgreSQL | freed at once | not needed |
/// | `mysql_named` | `GET_LOCK` lease on its own connection | yes, MySQL/MariaDB (not on a Galera cluster: `GET_LOCK` is node-local) | freed at once | fence in `freshlock_lock` |
/// | `redis` | Redis lease | yes, any database | freed after TTL | fence in `freshlock_lock` |
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockKind {
    /// [`LocalLock::shared`](crate::lock::LocalLock::shared).
    Local,
    /// [`TableLock`](crate::lock::TableLock).
    Table,
    /// [`RowLock`](crate::lock::RowLock).
    Row,
    /// [`PgAdvisoryLock`](crate::lock::PgAdvisoryLock).
    PgAdvisory,
    /// `MySqlNamedLock` (feature `mysql`).
    MySqlNamed,
    /// `RedisLock` (feature `redis`).
    Redis,
    /// A backend of the application's own, by the name its [`LockBackend::kind`](crate::LockBackend::kind) gives (never
    /// read by [`FromStr`], not in [`ALL`](Self::ALL), and not built by
    /// `connect`).
    Other(&'static str),
}

impl LockKind {
    /// Every kind, in the order of the table above.
    pub const ALL: [LockKind; 6] = [
        Self::Local,
        Self::Table,
        Self::Row,
        Self::PgAdvisory,
        Self::MySqlNamed,
        Self::Redis,
    ];

    /// The kind's name, as [`FromStr`] reads it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Table => "table",
            Self::Row => "row",
            Self::PgAdvisory => "pg_advisory",
            Self::MySqlNamed => "mysql_named",
            Self::Redis => "redis",
            Self::Other(name) => name,
        }
    }
}

impl fmt::Display for LockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LockKind {
    type Err = LockError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| LockError::UnknownKind { name: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_typed_errors() {
        for kind in LockKind::ALL {
            assert_eq!(kind.as_str().parse::<LockKind>().ok(), Some(kind));
        }
        assert_eq!(" Table ".parse::<LockKind>().ok(), Some(LockKind::Table));
        assert!(matches!(
            "zookeeper".parse::<LockKind>(),
            Err(LockError::UnknownKind { .. })
        ));
    }
}
