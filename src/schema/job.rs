//! `freshlock_job`: the keyed job queue ([`crate::jobs`]).

use sea_orm::{ConnectionTrait, DbErr};

use super::JOB_TABLE;
use super::statements::create_index;

super::freshlock_migration! {
    /// The name of the migration that adds the job table.
    const JOB_MIGRATION_NAME = "m20261202_000600_freshlock_job";
    /// The migration that creates `freshlock_job`, the table of [`crate::jobs`]: one row per job
    /// (kind, payload, serialization key, unique key, priority, run-at time on the database clock,
    /// attempts, last error, state). Kinds and keys are bytes: PostgreSQL's text cannot hold NUL,
    /// and MySQL's default collations merge case and trailing spaces. A key's index holds its
    /// SHA-256, so a 10 kB key indexes like a short one; the unique key's hash is set only while
    /// its job waits, so a finished job never blocks a new one.
    struct JobMigration { up: create_job_table, drops: [JOB_TABLE] }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_job` and its indexes, per dialect.
pub(super) async fn create_job_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    use sea_orm::DbBackend;
    let backend = db.get_database_backend();
    // id, then the columns every dialect spells alike.
    let (id, bytes, hash, text, long_text, owner, tail) = match backend {
        DbBackend::Postgres => (
            "id BIGSERIAL PRIMARY KEY",
            "BYTEA",
            "BYTEA",
            "TEXT",
            "TEXT",
            "VARCHAR(64)",
            "",
        ),
        DbBackend::MySql => (
            "id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
            "LONGBLOB",
            "BINARY(32)",
            "TEXT CHARACTER SET utf8mb4",
            "LONGTEXT CHARACTER SET utf8mb4",
            "VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin",
            " ENGINE=InnoDB",
        ),
        // AUTOINCREMENT: an id is never handed out twice, so enqueue order is id order.
        _ => (
            "id INTEGER PRIMARY KEY AUTOINCREMENT",
            "BLOB",
            "BLOB",
            "TEXT",
            "TEXT",
            "TEXT",
            "",
        ),
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {JOB_TABLE} (\
         {id}, \
         kind {bytes} NOT NULL, \
         job_key {bytes} NULL, \
         key_hash {hash} NULL, \
         unique_key {bytes} NULL, \
         unique_hash {hash} NULL, \
         payload {long_text} NOT NULL, \
         state SMALLINT NOT NULL DEFAULT 0, \
         priority INTEGER NOT NULL DEFAULT 0, \
         run_at BIGINT NOT NULL, \
         attempts INTEGER NOT NULL DEFAULT 0, \
         owner {owner} NULL, \
         lease_until BIGINT NULL, \
         last_error {text} NULL, \
         created_at BIGINT NOT NULL, \
         finished_at BIGINT NULL, \
         CONSTRAINT freshlock_job_unique UNIQUE (unique_hash)){tail}"
    ))
    .await?;
    for (index, columns) in [
        // The order jobs are taken in, so that the next job is the first the scan meets: a
        // sort would read (and on InnoDB lock) every due job to return one.
        ("freshlock_job_next", "state, priority DESC, id"),
        ("freshlock_job_key", "key_hash, state, id"),
    ] {
        create_index(db, JOB_TABLE, index, columns).await?;
    }
    Ok(())
}
