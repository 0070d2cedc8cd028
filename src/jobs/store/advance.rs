//! Time moved forward for a drain: jobs due within a horizon made due now.

use sea_orm::{ConnectionTrait, DbErr, Value};

use crate::jobs::state::Stored::Pending;
use crate::{
    db::{autocommit::autocommit, pool::Pool},
    lock::sql::{now_ms, statement},
    schema::JOB_TABLE,
};

/// Makes every waiting job of `kinds` that is due within `horizon_ms` from now (a retry after
/// its backoff, a delayed job) due now, as if that much time had passed. Returns how many.
pub(crate) async fn advance(db: &Pool, kinds: &[Vec<u8>], horizon_ms: i64) -> Result<u64, DbErr> {
    if kinds.is_empty() {
        return Ok(0);
    }
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let marks = vec!["?"; kinds.len()].join(", ");
    let sql = format!(
        "UPDATE {JOB_TABLE} SET run_at = {now} WHERE state = {Pending} \
         AND run_at > {now} AND run_at <= {now} + ? AND kind IN ({marks})"
    );
    let mut values = vec![Value::from(horizon_ms)];
    values.extend(kinds.iter().map(|kind| Value::Bytes(Some(kind.clone()))));
    let done = autocommit(db)
        .execute_raw(statement(backend, &sql, values))
        .await?;
    Ok(done.rows_affected())
}
