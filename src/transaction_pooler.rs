//! PostgreSQL behind a transaction pooler — PgBouncer with `pool_mode = transaction` (and
//! poolers that behave like it) — without failed calls and without unlocked writes.
//!
//! # Why a pool must be told
//!
//! A transaction pooler lends a server connection to a client for one transaction only; between
//! two transactions a client's next statement may reach another server connection. sqlx, under
//! sea-orm, sends a statement with parameters in two exchanges (prepare, then bind and execute)
//! under a *named* prepared statement (`sqlx_s_1`, `sqlx_s_2`, … counted per client connection).
//! Outside a transaction the two exchanges can reach two server connections, and a name left on
//! a server connection by one client clashes with the same name of another (`prepared statement
//! "sqlx_s_1" already exists`, `bind message supplies 2 parameters, but prepared statement
//! "sqlx_s_15" requires 1`). Measured on PgBouncer 1.18 that failed 40–93 % of calls.
//!
//! # The route freshlock takes
//!
//! Named statements are kept, but none outlives its transaction and none is reused across
//! transactions:
//!
//! 1. **Every statement freshlock sends runs inside an explicit transaction.** Its locked writes,
//!    sections, claims and transaction-scoped locks already do; on a handle marked by [`adopt`],
//!    the single statements it sends on their own — `load`, `load_many`, a guarded `save`, the
//!    `table` lease's statements, a lost commit's resolution, the inspector's reads — are each
//!    wrapped in `BEGIN` … `COMMIT`, so a prepare and its execute reach one server connection.
//!    (Off such a pool they stay single autocommit statements: nothing changes.)
//! 2. **sqlx's statement cache is off** (`statement_cache_capacity(0)`), so no client reuses a
//!    statement name in a later transaction, where it would not exist.
//! 3. **The pooler discards a server connection's statements after every transaction**:
//!    `server_reset_query = DISCARD ALL` with `server_reset_query_always = 1`. Then the name
//!    another client left behind is gone before the next client's first `Parse`.
//!
//! [`connect`] sets 2 and checks 3; [`adopt`] checks both on a pool you built. Every lock
//! backend works behind such a pooler: `row` and `pg_advisory` lock inside the write's
//! transaction, `table` keeps its lease in rows, `redis` and `local` need nothing of the
//! database's sessions. Nothing freshlock does needs session state (no session-level advisory
//! lock, no `SET` outside a transaction, no `LISTEN`).
//!
//! A lock statement that fails with such a clash anyway (a pool the pooler reaches without
//! these settings) is never taken as "the lock is unavailable": even under
//! [`OnLockFailure::Proceed`](crate::OnLockFailure::Proceed) the call fails with
//! [`Error::TransactionPooler`] instead of writing without its lock.
//!
//! What stays yours: your own statements on the pool must run in transactions too, run
//! migrations against the server directly (not through the pooler), and do not use
//! `ConnectOptions::set_schema_search_path` (a `SET` once per client connection, which a
//! transaction pooler does not keep): set the search path for the role or the database
//! instead (`ALTER ROLE … SET search_path = …`).
//!
//! Cost: one `BEGIN` and one `COMMIT` more per single statement, and one prepare per statement
//! (no cache): a load is four round trips instead of one. A `locked_update` keeps its ratio to
//! the same statements written by hand in sea-orm through the pooler (0.80–0.92×, against 0.82×
//! directly); the `table` lease loses most, since its statements outside the write's
//! transaction each become one. Measured numbers: `BENCHMARKS.md`, *Through PgBouncer*.

use std::sync::atomic::{AtomicU64, Ordering};

use sea_orm::{
    ConnectOptions, Database, DbBackend,
    sqlx::{self, ConnectOptions as _, Row as _},
};
use tracing::debug;

use crate::{
    database::Db,
    error::{Error, Result},
};

/// Connects to PostgreSQL through a transaction pooler at `options`' URL: sqlx's statement cache
/// off, no `extra_float_digits` startup parameter (PgBouncer 1.18 refuses unknown ones), then
/// [`adopt`] checks the pooler and marks the handle it returns: keep that [`Db`] and make
/// sessions, lock backends and claims from it (`db.connection()` is the sea-orm pool, for your
/// own transactions).
///
/// This replaces a function given to `ConnectOptions::map_sqlx_postgres_opts`; to keep your
/// own, set `statement_cache_capacity(0)` in it, connect yourself and call [`adopt`].
///
/// # Errors
/// [`Error::Database`] when the connection fails; [`Error::TransactionPooler`] as [`adopt`].
pub async fn connect(mut options: ConnectOptions) -> Result<Db> {
    options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0).extra_float_digits(None));
    let url = options.get_url().to_owned();
    let conn = Database::connect(options)
        .await
        .map_err(|e| crate::error::database("connecting to", &redacted(&url), e))?;
    let db = Db::new(conn);
    adopt(&db).await?;
    Ok(db)
}

/// Checks that `db`'s pool can run behind a transaction pooler and marks the handle, so
/// freshlock runs each of its single statements on it in a transaction of its own (see the
/// [module](self)). The mark belongs to the handle and its clones: sessions, lock backends and
/// claims made from a bare connection of the same pool do not have it.
///
/// Checked: the pool is PostgreSQL, sqlx's statement cache is off, and a prepared statement does
/// not outlive its transaction (the pooler runs `DISCARD ALL` after each one). The last check
/// prepares a statement in one transaction and looks for it in the next, on one client
/// connection; a pooler hands that connection's next transaction to the server connection it
/// just freed whenever that one is idle, so a missing reset is seen. Calling `adopt` on a pool
/// that connects to PostgreSQL directly is harmless (it only adds the wrapping transactions),
/// unless its next transaction happens to reach the same server session, where the check fails.
///
/// # Errors
/// [`Error::TransactionPooler`] naming the setting that is missing; [`Error::Database`] when
/// the check cannot run.
pub async fn adopt(db: &Db) -> Result<()> {
    let pool = db.pool();
    let db = db.connection();
    if db.get_database_backend() != DbBackend::Postgres {
        return Err(refused(format!(
            "a transaction pooler fronts PostgreSQL; this pool is {:?}",
            db.get_database_backend()
        )));
    }
    let pg = db.get_postgres_connection_pool();
    let url = pg.connect_options().to_url_lossy();
    let capacity = url
        .query_pairs()
        .find(|(key, _)| key == "statement-cache-capacity")
        .map(|(_, value)| value.into_owned());
    if capacity.as_deref() != Some("0") {
        return Err(refused(format!(
            "sqlx's statement cache is on (capacity {}): a cached statement would be reused in a \
             later transaction, on a server connection that does not have it; connect with \
             freshlock::transaction_pooler::connect or set statement_cache_capacity(0)",
            capacity.as_deref().unwrap_or("default")
        )));
    }
    probe_reset(pg).await?;
    pool.mark_transaction_pooled();
    debug!("pool marked as running behind a transaction pooler");
    Ok(())
}

/// Whether [`adopt`] marked `db` (or a handle it is a clone of).
pub fn is_adopted(db: &Db) -> bool {
    db.pool().transaction_pooled()
}

/// Prepares a statement in one transaction and looks for it in the next (simple protocol only,
/// so the probe itself cannot clash).
async fn probe_reset(pg: &sqlx::PgPool) -> Result<()> {
    static PROBE: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "freshlock_probe_{}_{}",
        std::process::id(),
        PROBE.fetch_add(1, Ordering::Relaxed)
    );
    let failed = |e: sqlx::Error| {
        crate::error::database(
            "checking the transaction pooler of",
            &"the pool",
            sea_orm::DbErr::Conn(sea_orm::RuntimeErr::SqlxError(std::sync::Arc::new(e))),
        )
    };
    let mut conn = pg.acquire().await.map_err(failed)?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; PREPARE {name} AS SELECT 1; COMMIT"
    )))
    .execute(&mut *conn)
    .await
    .map_err(failed)?;
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; SELECT count(*) FROM pg_prepared_statements WHERE name = '{name}'; COMMIT"
    )))
    .fetch_all(&mut *conn)
    .await
    .map_err(failed)?;
    let survived = rows
        .first()
        .and_then(|row| row.try_get::<i64, _>(0).ok())
        .unwrap_or(0);
    if survived > 0 {
        // Not left behind for the next client of that server connection.
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DEALLOCATE {name}")))
            .execute(&mut *conn)
            .await;
        return Err(refused(
            "a prepared statement outlived its transaction: the pooler must run \
             `server_reset_query = DISCARD ALL` with `server_reset_query_always = 1`, or another \
             client's statement names clash with ours (or this pool is not behind a \
             transaction pooler: then do not adopt it)"
                .to_owned(),
        ));
    }
    Ok(())
}

fn refused(reason: String) -> Error {
    Error::TransactionPooler {
        reason,
        source: None,
    }
}

/// `url` without its password, for error messages.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((credentials, host)) if credentials.contains(':') => {
            let user = credentials.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redacted("postgres://app:secret@127.0.0.1:6432/app"),
            "postgres://app:***@127.0.0.1:6432/app"
        );
        assert_eq!(
            redacted("postgres://app@127.0.0.1:6432/app"),
            "postgres://app@127.0.0.1:6432/app"
        );
    }
}
