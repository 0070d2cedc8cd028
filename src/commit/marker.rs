//! Commit markers: a row with a token no other write has, inserted in the write's own
//! transaction (see the module docs of `commit`), and the writers' sweep of old ones.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement, sea_query::Query};
use tracing::warn;

use crate::{
    db::{
        autocommit::{read_committed, upkeep},
        deadline::{DEFAULT_REPLY, within},
        own::Own,
        pool::Pool,
    },
    lock::holder,
    schema::COMMIT_TABLE,
};

/// How long markers are kept: far longer than any resolution takes.
pub(crate) const KEEP_MARKERS: Duration = Duration::from_secs(600);

/// Every this many markers written on a pool, the writer deletes the expired ones.
const SWEEP_EVERY: u64 = 1024;

/// Most old markers one sweep deletes (on PostgreSQL and MySQL/MariaDB): twice the markers a
/// pool writes between two of its sweeps, so the sweeps keep up.
const SWEEP_AT_MOST: u64 = 2 * SWEEP_EVERY;

/// One write's commit marker.
#[derive(Debug)]
pub(crate) struct Marker {
    pub(super) token: String,
}

impl Marker {
    pub(crate) fn new() -> Self {
        Self {
            token: holder::new_token(),
        }
    }

    /// The marker's INSERT: the writer's, stamped with the database clock, or the resolver's
    /// (`created_at = 0`).
    pub(crate) fn insert(
        &self,
        backend: sea_orm::DbBackend,
        writer: bool,
    ) -> sea_orm::sea_query::InsertStatement {
        let now = if writer {
            crate::lock::sql::now_ms(backend)
        } else {
            "0"
        };
        Query::insert()
            .into_table(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
            .columns([
                sea_orm::sea_query::Alias::new("token"),
                sea_orm::sea_query::Alias::new("created_at"),
            ])
            // Two columns, two values: `values_panic` cannot panic here.
            .values_panic([
                self.token.clone().into(),
                sea_orm::sea_query::Expr::cust(now),
            ])
            .to_owned()
    }

    /// The writer's INSERT made only while `check` is `NULL`, an expression that fails the
    /// statement otherwise (MySQL/MariaDB: `jobs::store::unless_counted`): one statement that
    /// both checks a message's completion and marks its commit. (A binary log in `STATEMENT`
    /// format replays it right after the same completion, so a replica reads the same count;
    /// `MIXED` and `ROW`, the defaults, log its row.)
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn insert_unless(&self, backend: DbBackend, check: &str) -> Statement {
        let now = crate::lock::sql::now_ms(backend);
        let sql = format!(
            "INSERT INTO {COMMIT_TABLE} (token, created_at) SELECT ?, {now} FROM DUAL \
             WHERE {check} IS NULL"
        );
        Statement::from_sql_and_values(backend, sql, [self.token.clone().into()])
    }

    /// Writes the marker in the write's transaction, just before its `COMMIT`.
    pub(crate) async fn write(&self, txn: &impl ConnectionTrait) -> Result<(), DbErr> {
        txn.execute(&self.insert(txn.get_database_backend(), true))
            .await
            .map(drop)
    }
}

/// Now and then (every [`SWEEP_EVERY`] markers written on the pool) deletes the markers older than
/// [`KEEP_MARKERS`]. A failure is logged: it only leaves rows for the next sweep. The write
/// that runs it still holds its locks, so the sweep waits at most `reply` (a reply's bound, see
/// `deadline.rs`): a reply that never comes must not freeze the write's key.
pub(super) async fn sweep(db: &Pool, marker: &Marker, reply: Duration) {
    if !db.marker_written().is_multiple_of(SWEEP_EVERY) {
        return;
    }
    if let Err(error) = within(reply, delete_old_markers(db)).await {
        warn!(%error, token = %marker.token, "deleting old commit markers failed");
    }
}

/// Deletes up to [`SWEEP_AT_MOST`] markers older than [`KEEP_MARKERS`], oldest first (on the
/// age index, `schema::MarkerAgeMigration`), passing over any that a transaction still holds:
/// a write in flight, or one whose `COMMIT` reply a silent partition lost, whose transaction
/// stays open until the server drops its connection. A `DELETE` that found its rows itself
/// waited for such a marker — for `innodb_lock_wait_timeout` (50 s) on MySQL/MariaDB, where it
/// also reads past the oldest young marker — and the writer running the sweep with it; at
/// REPEATABLE READ its gap locks held up every other writer's marker insert meanwhile. Returns
/// how many it deleted.
async fn delete_old_markers(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let now = crate::lock::sql::now_ms(backend);
    let keep = KEEP_MARKERS.as_millis();
    let old = format!(
        "SELECT token FROM {COMMIT_TABLE} WHERE created_at < {now} - {keep} \
         ORDER BY created_at LIMIT {SWEEP_AT_MOST}"
    );
    let sql = match backend {
        // SQLite has one writer: nothing to pass over.
        DbBackend::Sqlite => {
            format!("DELETE FROM {COMMIT_TABLE} WHERE created_at < {now} - {keep}")
        }
        DbBackend::Postgres => {
            format!("DELETE FROM {COMMIT_TABLE} WHERE token IN ({old} FOR UPDATE SKIP LOCKED)")
        }
        // MySQL cannot read the table it deletes from in a subquery: the markers are locked
        // first (READ COMMITTED: no gap locks), then deleted by key, in one transaction.
        _ => {
            let own = Own::new(db, DEFAULT_REPLY).with(read_committed());
            return own
                .run(|txn| {
                    let lock =
                        Statement::from_string(backend, format!("{old} FOR UPDATE SKIP LOCKED"));
                    Box::pin(async move {
                        let tokens = (txn.query_all_raw(lock).await?.iter())
                            .map(|row| row.try_get::<String>("", "token").map(sea_orm::Value::from))
                            .collect::<Result<Vec<_>, _>>()?;
                        if tokens.is_empty() {
                            return Ok(0);
                        }
                        let placeholders = vec!["?"; tokens.len()].join(", ");
                        let sql =
                            format!("DELETE FROM {COMMIT_TABLE} WHERE token IN ({placeholders})");
                        let done = txn
                            .execute_raw(Statement::from_sql_and_values(backend, sql, tokens))
                            .await?;
                        Ok(done.rows_affected())
                    })
                })
                .await;
        }
    };
    upkeep(db, Statement::from_string(backend, sql)).await
}
