//! Choosing a lock backend at run time, from configuration: [`LockKind::connect`].

use std::sync::Arc;

use super::{
    kind::LockKind, local::LocalLock, pg_advisory::PgAdvisoryLock, row::RowLock, table::TableLock,
    traits::LockBackend,
};
use crate::error::LockError;

impl LockKind {
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
        db: impl Into<crate::database::Db>,
        database_url: &str,
        redis_url: Option<&str>,
    ) -> Result<Arc<dyn LockBackend>, LockError> {
        let handle = db.into();
        let db = handle.connection();
        let _ = (database_url, redis_url);
        let unsupported = |what: &str| LockError::Unsupported {
            backend: self.as_str(),
            database: what.to_owned(),
        };
        Ok(match self {
            Self::Local => Arc::new(LocalLock::shared()),
            Self::Table => Arc::new(TableLock::new(handle.clone())),
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
                // No ping on checkout (a round trip per grant): a grant that finds its pooled
                // connection dead asks again on another (see `MySqlNamedLock`).
                options
                    .max_connections(16)
                    .test_before_acquire(false)
                    .sqlx_logging(false);
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
            Self::Other(name) => {
                return Err(LockError::UnknownKind {
                    name: name.to_owned(),
                });
            }
            #[allow(unreachable_patterns)]
            _ => return Err(unsupported("this build (its cargo feature is off)")),
        })
    }
}

/// Whether `db` is a node of a MariaDB Galera cluster (`wsrep_on`); `false` off MySQL/MariaDB or
/// when the variable cannot be read.
#[cfg(feature = "mysql")]
async fn galera(db: &sea_orm::DatabaseConnection) -> bool {
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
