//! `freshlock_worker_kind`: the kinds running workers handle, and when a worker last said so
//! (what [`crate::jobs::Depth::handled`] reads).

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use super::WORKER_KIND_TABLE;

super::freshlock_migration! {
    /// The name of the migration that adds the worker-kind table.
    const WORKER_KIND_MIGRATION_NAME = "m20261205_001000_freshlock_worker_kind";
    /// The migration that creates `freshlock_worker_kind`: one row per job kind (its SHA-256,
    /// and the kind as bytes) with the last time, in milliseconds on the database's clock, that
    /// a running worker ([`crate::jobs::Worker::run`]) said it takes that kind. A kind nobody
    /// took lately waits for a worker: the queue's depth says so.
    struct WorkerKindMigration { up: create_worker_kind_table, drops: [WORKER_KIND_TABLE] }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_worker_kind`, per dialect.
pub(super) async fn create_worker_kind_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let (bytes, hash, tail) = match db.get_database_backend() {
        DbBackend::Postgres => ("BYTEA", "BYTEA", ""),
        DbBackend::MySql => ("LONGBLOB", "BINARY(32)", " ENGINE=InnoDB"),
        _ => ("BLOB", "BLOB", ""),
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {WORKER_KIND_TABLE} (\
         kind_hash {hash} NOT NULL PRIMARY KEY, \
         kind {bytes} NOT NULL, \
         seen_at BIGINT NOT NULL){tail}"
    ))
    .await
    .map(drop)
}
