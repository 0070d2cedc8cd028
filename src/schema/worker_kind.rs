//! `freshlock_worker_kind`: the kinds running workers handle, and when a worker last said so
//! (what [`crate::jobs::Depth::handled`] reads).

use sea_orm::{ConnectionTrait, DbErr};

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
    super::statements::create_kind_table(db, WORKER_KIND_TABLE, "seen_at").await
}
