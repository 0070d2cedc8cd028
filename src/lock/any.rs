//! Choosing a lock backend at run time, from configuration.

use std::{fmt, str::FromStr, sync::Arc};

use sea_orm::DatabaseConnection;

use super::{
    local::LocalLock, pg_advisory::PgAdvisoryLock, row::RowLock, table::TableLock,
    traits::LockBackend,
};
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
    /// [`LocalLock::shared`].
    Local,
    /// [`TableLock`].
    Table,
    /// [`RowLock`].
    Row,
    /// [`PgAdvisoryLock`].
    PgAdvisory,
    /// `MySqlNamedLock` (feature `mysql`).
    MySqlNamed,
    /// `RedisLock` (feature `redis`).
    Redis,
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
        }
    }

    /// Builds the backend for the data in `db`.
    ///
    /// `database_url` is `db`'s URL (`mysql_named` opens its own small pool there); `redis_url`
    /// is needed by `redis` only.
    ///
    /// # Errors
    /// [`LockError::Unsupported`] when the backend does not work on `db`'s database or was not
    /// compiled in (its cargo feature is off), or a URL is missing; [`LockError::Backend`] when a
    /// server cannot be reached.
    pub async fn connect(
        self,
        db: &DatabaseConnection,
        database_url: &str,
        redis_url: Option<&str>,
    ) -> Result<Arc<dyn LockBackend>, LockError> {
        let _ = (database_url, redis_url);
        let unsupported = |what: &str| LockError::Unsupported {
            backend: self.as_str(),
            database: what.to_owned(),
        };
        Ok(match self {
            Self::Local => Arc::new(LocalLock::shared()),
            Self::Table => Arc::new(TableLock::new(db.clone())),
            Self::Row => {
                // On a Galera cluster a row lock is local to the node that took it: writers on
                // two nodes would both hold it, and only certification would stand between their
                // writes — which Galera does not make a lost-update guarantee of (MDEV-29044; a
                // transfer test here lost money with node-local locks). Refused, as `mysql_named`.
                #[cfg(feature = "mysql")]
                if galera(db).await {
                    return Err(unsupported(
                        "a MariaDB Galera cluster (row locks are local to one node; use `table` or `redis`)",
                    ));
                }
                Arc::new(RowLock::new(db.clone()))
            }
            Self::PgAdvisory => {
                if db.get_database_backend() != sea_orm::DbBackend::Postgres {
                    return Err(unsupported(&format!("{:?}", db.get_database_backend())));
                }
                Arc::new(PgAdvisoryLock::new())
            }
            #[cfg(feature = "mysql")]
            Self::MySqlNamed => {
                let mut options = sea_orm::ConnectOptions::new(database_url);
                options.max_connections(16).sqlx_logging(false);
                let locks =
                    sea_orm::Database::connect(options)
                        .await
                        .map_err(|e| LockError::Backend {
                            backend: "mysql_named",
                            source: Box::new(e),
                        })?;
                // On a Galera cluster GET_LOCK is local to the node that ran it: two nodes
                // would both grant one name. Refused rather than silently not excluding.
                if galera(&locks).await {
                    return Err(unsupported(
                        "a MariaDB Galera cluster (GET_LOCK is local to one node)",
                    ));
                }
                Arc::new(super::mysql_named::MySqlNamedLock::new(locks)?)
            }
            #[cfg(feature = "redis")]
            Self::Redis => {
                let url =
                    redis_url.ok_or_else(|| unsupported("a configuration without a Redis URL"))?;
                Arc::new(super::redis::RedisLock::connect(url, db.clone()).await?)
            }
            #[allow(unreachable_patterns)]
            _ => return Err(unsupported("this build (its cargo feature is off)")),
        })
    }
}

/// Whether `db` is a node of a MariaDB Galera cluster (`wsrep_on`); `false` off MySQL/MariaDB or
/// when the variable cannot be read.
#[cfg(feature = "mysql")]
async fn galera(db: &DatabaseConnection) -> bool {
    use sea_orm::ConnectionTrait as _;
    if db.get_database_backend() != sea_orm::DbBackend::MySql {
        return false;
    }
    db.query_one_raw(sea_orm::Statement::from_string(
        sea_orm::DbBackend::MySql,
        "SHOW VARIABLES LIKE 'wsrep_on'",
    ))
    .await
    .ok()
    .flatten()
    .and_then(|row| row.try_get_by_index::<String>(1).ok())
    .is_some_and(|on| on.eq_ignore_ascii_case("ON"))
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
