//! `freshlock_job_slot`: the tokens of job limits ([`crate::jobs::Limit`]).

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use super::JOB_SLOT_TABLE;

super::freshlock_migration! {
    /// The name of the migration that adds the job-slot table.
    const JOB_SLOT_MIGRATION_NAME = "m20261205_001100_freshlock_job_slot";
    /// The migration that creates `freshlock_job_slot`: the tokens of job limits
    /// ([`crate::jobs::Limit`]), `n` rows per limit (its scope: the SHA-256 of the limit's kind,
    /// and key for a per-key rate). A running job holds a row of its kind's running limit
    /// locked; a rate's row says when it is free again (a period after its last use, database
    /// clock, milliseconds). Workers lock the rows with `SKIP LOCKED`, so
    /// a job over its limit is passed over, never waited for.
    struct JobSlotMigration { up: create_job_slot_table, drops: [JOB_SLOT_TABLE] }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_job_slot`, per dialect.
pub(super) async fn create_job_slot_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let (hash, tail) = match db.get_database_backend() {
        DbBackend::Postgres => ("BYTEA", ""),
        DbBackend::MySql => ("BINARY(32)", " ENGINE=InnoDB"),
        _ => ("BLOB", ""),
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {JOB_SLOT_TABLE} (\
         scope {hash} NOT NULL, \
         slot INTEGER NOT NULL, \
         free_at BIGINT NOT NULL, \
         PRIMARY KEY (scope, slot)){tail}"
    ))
    .await
    .map(drop)
}
