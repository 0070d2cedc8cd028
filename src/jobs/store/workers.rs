//! The kinds running workers take (`freshlock_worker_kind`): said by [`crate::jobs::Worker::run`]
//! every few seconds, read by the queue's depth.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::{
    db::{autocommit::upkeep, pool::Pool},
    lock::sql::{now_ms, statement},
    schema::WORKER_KIND_TABLE,
};

/// How long a kind counts as taken after a worker last said so: three of a worker's periods
/// (`chores::ADVERTISE_EVERY`), so one missed beat does not matter.
pub(crate) const TAKEN_FOR_MS: i64 = 30_000;

/// Says that a running worker takes `kinds`, now (one statement; a kind's row is made on its
/// first say).
pub(crate) async fn advertise(db: &Pool, kinds: &[Vec<u8>]) -> Result<u64, DbErr> {
    if kinds.is_empty() {
        return Ok(0);
    }
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let rows = vec![format!("(?, ?, {now})"); kinds.len()].join(", ");
    let conflict = match backend {
        DbBackend::MySql => "ON DUPLICATE KEY UPDATE seen_at = VALUES(seen_at)",
        _ => "ON CONFLICT (kind_hash) DO UPDATE SET seen_at = excluded.seen_at",
    };
    let sql = format!(
        "INSERT INTO {WORKER_KIND_TABLE} (kind_hash, kind, seen_at) VALUES {rows} {conflict}"
    );
    let mut values = Vec::with_capacity(kinds.len() * 2);
    for kind in kinds {
        values.push(super::hashed(kind));
        values.push(Value::Bytes(Some(kind.clone())));
    }
    upkeep(db, statement(backend, &sql, values)).await
}

/// The kinds a running worker said it takes within the last [`TAKEN_FOR_MS`].
pub(crate) async fn taken(db: &impl ConnectionTrait) -> Result<Vec<Vec<u8>>, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let sql = format!("SELECT kind FROM {WORKER_KIND_TABLE} WHERE seen_at > {now} - ?");
    let rows = db
        .query_all_raw(statement(backend, &sql, vec![TAKEN_FOR_MS.into()]))
        .await?;
    rows.iter().map(|row| row.try_get("", "kind")).collect()
}
