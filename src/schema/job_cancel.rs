//! `freshlock_job_cancel`: requests to stop jobs that were running in their transaction when
//! [`crate::jobs::cancel`] was called.

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use super::JOB_CANCEL_TABLE;

super::freshlock_migration! {
    /// The name of the migration that adds the job-cancel table.
    const JOB_CANCEL_MIGRATION_NAME = "m20261205_000900_freshlock_job_cancel";
    /// The migration that creates `freshlock_job_cancel`: one row per job asked to stop while it
    /// ran in a worker's transaction. A job's row is locked while it runs, so the request is a
    /// row of its own table, which the job's completion reads: a job with a request is rolled
    /// back and ends `cancelled`.
    struct JobCancelMigration { up: create_job_cancel_table, drops: [JOB_CANCEL_TABLE] }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_job_cancel`, per dialect.
pub(super) async fn create_job_cancel_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let tail = match db.get_database_backend() {
        DbBackend::MySql => " ENGINE=InnoDB",
        _ => "",
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {JOB_CANCEL_TABLE} (\
         job_id BIGINT NOT NULL PRIMARY KEY, \
         requested_at BIGINT NOT NULL){tail}"
    ))
    .await
    .map(drop)
}
