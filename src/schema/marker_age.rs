//! The age index of `freshlock_commit`, for the writers' sweep of old markers.

use sea_orm::{ConnectionTrait, DbErr};

use super::COMMIT_TABLE;
use super::statements::create_index;

/// The index of `freshlock_commit` by `created_at` ([`MarkerAgeMigration`]).
const MARKER_AGE_INDEX: &str = "freshlock_commit_age";

super::freshlock_migration! {
    /// The name of the migration that indexes the commit markers by age.
    const MARKER_AGE_MIGRATION_NAME = "m20261202_000700_freshlock_commit_age";
    /// The migration that indexes `freshlock_commit` by `created_at`, so that the writers' sweep of
    /// old markers (every 1,024 markers of a process) reads only the markers it deletes. Without
    /// it the sweep scans every marker of the last ten minutes: on MySQL/MariaDB it then also waits
    /// for each write whose marker is not committed yet (one whose `COMMIT` reply is lost in a
    /// silent partition: until the server drops its connection), and the writer that runs the
    /// sweep waits with it.
    struct MarkerAgeMigration { up: create_age_index, down: drop_index }
}

/// Indexes `freshlock_commit` by age unless it is.
pub(super) async fn create_age_index(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    create_index(db, COMMIT_TABLE, MARKER_AGE_INDEX, "created_at").await
}

/// Drops the age index.
async fn drop_index(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let sql = match db.get_database_backend() {
        sea_orm::DbBackend::MySql => format!("DROP INDEX {MARKER_AGE_INDEX} ON {COMMIT_TABLE}"),
        _ => format!("DROP INDEX IF EXISTS {MARKER_AGE_INDEX}"),
    };
    db.execute_unprepared(&sql).await.map(drop)
}
