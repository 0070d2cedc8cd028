//! The sweep that readies queued jobs stranded behind a key that finished.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::jobs::state::Stored::{Pending, Queued};
use crate::{
    db::{
        autocommit::{autocommit, upkeep},
        pool::Pool,
    },
    lock::sql::statement,
    schema::JOB_TABLE,
};

use super::SWEEP_AT_MOST;

/// Makes ready every queued job with no unfinished job before it in its key: one whose head
/// finished while its own enqueue had not committed yet, so the promotion did not see it.
/// Returns how many.
///
/// Two statements, each locking nothing it does not change: a read of the stranded jobs (a
/// snapshot, no locks), then an `UPDATE` of those rows by id. One `UPDATE` that found them itself
/// would lock every row it read on MySQL/MariaDB (169 rows at READ COMMITTED, the whole table at
/// REPEATABLE READ) and hold them while it waited for the rows of running jobs: every take
/// meanwhile skipped them (`SKIP LOCKED`) and found nothing, every completion waited, and workers
/// that ran until idle stopped with a hot key's jobs left (CI's MariaDB demo). A job the read
/// saw stranded that is not by the time of the `UPDATE` is harmless: `QUEUED` is a hint, and a
/// take still checks that it is its key's head.
pub(crate) async fn sweep(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let db = autocommit(db);
    // Only the first queued job of a key can be stranded.
    let find = format!(
        "SELECT q.id FROM (SELECT MIN(id) AS id, key_hash FROM {JOB_TABLE} \
         WHERE state = {Queued} GROUP BY key_hash) q WHERE {} LIMIT {SWEEP_AT_MOST}",
        super::head::is_head(backend, "q")
    );
    let rows = db
        .query_all_raw(statement(backend, &find, Vec::new()))
        .await?;
    let ids = (rows.iter())
        .map(|row| row.try_get::<i64>("", "id").map(Value::from))
        .collect::<Result<Vec<_>, _>>()?;
    if ids.is_empty() {
        return Ok(0);
    }
    let placeholders = vec!["?"; ids.len()].join(", ");
    // By primary key on MySQL too (a small table is scanned whole, even for `id IN (…)`).
    let index = if backend == DbBackend::MySql {
        " FORCE INDEX (PRIMARY)"
    } else {
        ""
    };
    let ready = format!(
        "UPDATE {JOB_TABLE}{index} SET state = {Pending} \
         WHERE state = {Queued} AND id IN ({placeholders})"
    );
    upkeep(db.0, statement(backend, &ready, ids)).await
}
