//! freshlock's own tables: [`migrate`] applies them on its own, or add [`migrations()`] to your
//! `Migrator`.
//!
//! - `freshlock_lock` — one row per lock name: owner token, lease expiry (database clock,
//!   milliseconds since the Unix epoch), fence counter, and who holds it (host, pid, label,
//!   acquired-at). The [`TableLock`](crate::lock::TableLock) backend leases these rows; the
//!   other lease backends keep their fence counters here. The row named `''` (no lock has an
//!   empty name) is the **fence floor** ([`FloorMigration`]): a new row's first fence is one
//!   above it, and [`crate::inspect::compact`] raises it to the highest fence of the rows it
//!   deletes, so every name's fences keep growing across deletions.
//! - `freshlock_claim` — claims with a lease ([`crate::claim::Claims`]).
//! - `freshlock_row_lock` — one row per lock name, locked with `SELECT … FOR UPDATE` by the
//!   [`RowLock`](crate::lock::RowLock) backend (the Django report's `HamLock`).
//! - `freshlock_commit` — commit markers: one row per recent locked write, so that a commit whose
//!   reply was lost can be resolved instead of run twice ([`CommitMigration`]); indexed by age
//!   for the sweep of old markers ([`MarkerAgeMigration`]).
//! - `freshlock_incarnation` — PostgreSQL only, an `UNLOGGED` table of one row: the token of the
//!   server's current incarnation. Crash recovery empties unlogged tables, so the row's token
//!   changes exactly when transaction ids may have been handed out twice; with it, a write's
//!   transaction id is evidence of its commit ([`IncarnationMigration`], `commit/`).
//!
//! - `freshlock_job` — the keyed job queue ([`crate::jobs`], [`JobMigration`]): kinds, keys and
//!   unique keys are stored as bytes (with a SHA-256 of each key for its index), so they compare
//!   byte for byte on every database.
//! - `freshlock_periodic` — the last slot enqueued of each periodic kind
//!   ([`crate::jobs::Periodic`], [`PeriodicMigration`]).
//! - `freshlock_job_cancel` — requests to stop jobs running in their transaction
//!   ([`crate::jobs::cancel`], [`JobCancelMigration`]).
//! - `freshlock_worker_kind` — the kinds running workers take, and when they last said so
//!   ([`crate::jobs::Depth::handled`], [`WorkerKindMigration`]).
//! - `freshlock_job_slot` — the tokens of job limits ([`crate::jobs::Limit`],
//!   [`JobSlotMigration`]).
//!
//! On MySQL/MariaDB every name and token column compares byte for byte ([`CommitMigration`]).

/// Declares one of freshlock's migrations: its name constant, its unit struct and the two
/// sea-orm-migration impls. Its step up is the `create` function of its own file (the same one
/// [`create_tables`] runs, so the migrations and the shortcut cannot drift apart); its step down
/// drops the tables it lists, or runs the `down` function its file names.
macro_rules! freshlock_migration {
    (
        $(#[$name_doc:meta])* const $name:ident = $value:literal;
        $(#[$doc:meta])* struct $ty:ident { up: $up:path, drops: [$($table:expr),*] }
    ) => {
        crate::schema::freshlock_migration!(@declare $(#[$name_doc])* $name = $value, $(#[$doc])* $ty);
        crate::schema::freshlock_migration!(@impls $name $ty, $up, |db| crate::schema::statements::drop_tables(db, &[$($table),*]));
    };
    (
        $(#[$name_doc:meta])* const $name:ident = $value:literal;
        $(#[$doc:meta])* struct $ty:ident { up: $up:path, down: $down:path }
    ) => {
        crate::schema::freshlock_migration!(@declare $(#[$name_doc])* $name = $value, $(#[$doc])* $ty);
        crate::schema::freshlock_migration!(@impls $name $ty, $up, |db| $down(db));
    };
    (@declare $(#[$name_doc:meta])* $name:ident = $value:literal, $(#[$doc:meta])* $ty:ident) => {
        $(#[$name_doc])*
        pub const $name: &str = $value;

        $(#[$doc])*
        pub struct $ty;
    };
    (@impls $name:ident $ty:ident, $up:path, |$db:ident| $down:expr) => {
        impl sea_orm_migration::MigrationName for $ty {
            fn name(&self) -> &str {
                $name
            }
        }

        #[async_trait::async_trait]
        impl sea_orm_migration::MigrationTrait for $ty {
            async fn up(
                &self,
                manager: &sea_orm_migration::SchemaManager,
            ) -> Result<(), sea_orm::DbErr> {
                $up(manager.get_connection()).await
            }

            async fn down(
                &self,
                manager: &sea_orm_migration::SchemaManager,
            ) -> Result<(), sea_orm::DbErr> {
                let $db = manager.get_connection();
                $down.await
            }
        }
    };
}
use freshlock_migration;

mod claim;
mod commit;
mod floor;
mod incarnation;
mod job;
mod job_cancel;
mod job_slot;
mod lease_row;
mod locks;
mod marker_age;
mod migrate;
mod periodic;
mod statements;
mod worker_kind;

pub use claim::{CLAIM_MIGRATION_NAME, ClaimMigration};
pub use commit::{COMMIT_MIGRATION_NAME, CommitMigration};
pub(crate) use floor::insert_floor;
pub use floor::{FLOOR_MIGRATION_NAME, FloorMigration};
pub use incarnation::{INCARNATION_MIGRATION_NAME, IncarnationMigration};
pub use job::{JOB_MIGRATION_NAME, JobMigration};
pub use job_cancel::{JOB_CANCEL_MIGRATION_NAME, JobCancelMigration};
pub use job_slot::{JOB_SLOT_MIGRATION_NAME, JobSlotMigration};
pub use locks::{MIGRATION_NAME, Migration};
pub use marker_age::{MARKER_AGE_MIGRATION_NAME, MarkerAgeMigration};
pub use migrate::{MIGRATIONS_TABLE, migrate};
pub use periodic::{PERIODIC_MIGRATION_NAME, PeriodicMigration};
pub(crate) use statements::insert_ignore;
pub use worker_kind::{WORKER_KIND_MIGRATION_NAME, WorkerKindMigration};

use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::MigrationTrait;

/// The name of the lease table.
pub const LOCK_TABLE: &str = "freshlock_lock";

/// The name of the lock-row table.
pub const ROW_LOCK_TABLE: &str = "freshlock_row_lock";

/// The name of the claims table.
pub const CLAIM_TABLE: &str = "freshlock_claim";

/// The name of the commit-marker table (see [`CommitMigration`]).
pub const COMMIT_TABLE: &str = "freshlock_commit";

/// The name of PostgreSQL's server-incarnation table (see [`IncarnationMigration`]).
pub const INCARNATION_TABLE: &str = "freshlock_incarnation";

/// The name of the job table (see [`JobMigration`]).
pub const JOB_TABLE: &str = "freshlock_job";
/// The name of the periodic-slot table (see [`PeriodicMigration`]).
pub const PERIODIC_TABLE: &str = "freshlock_periodic";
/// The name of the table of requests to stop running jobs (see [`JobCancelMigration`]).
pub const JOB_CANCEL_TABLE: &str = "freshlock_job_cancel";
/// The name of the table of the kinds running workers take (see [`WorkerKindMigration`]).
pub const WORKER_KIND_TABLE: &str = "freshlock_worker_kind";
/// The name of the table of job limits' tokens (see [`JobSlotMigration`]).
pub const JOB_SLOT_TABLE: &str = "freshlock_job_slot";

/// The stored name of the fence-floor row of `freshlock_lock` (see the module docs).
pub(crate) const FLOOR_NAME: &str = "";

/// Longest lock name stored as it is; longer ones are stored as prefix + hash.
pub(crate) const MAX_STORED_NAME: usize = 255;

/// All of freshlock's migrations, oldest first: append them to your `Migrator`'s list.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![
        Box::new(Migration),
        Box::new(ClaimMigration),
        Box::new(CommitMigration),
        Box::new(FloorMigration),
        Box::new(IncarnationMigration),
        Box::new(JobMigration),
        Box::new(MarkerAgeMigration),
        Box::new(PeriodicMigration),
        Box::new(JobCancelMigration),
        Box::new(WorkerKindMigration),
        Box::new(JobSlotMigration),
    ]
}

/// Creates freshlock's tables if they do not exist, without the migration machinery (for tests
/// and tools; applications should prefer [`Migration`]).
///
/// # Errors
/// The database's error when a statement fails.
pub async fn create_tables(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    locks::create_lock_tables(db).await?;
    claim::create_claim_table(db).await?;
    commit::create_commit_table(db).await?;
    insert_floor(db).await?;
    incarnation::create_incarnation_table(db).await?;
    job::create_job_table(db).await?;
    marker_age::create_age_index(db).await?;
    periodic::create_periodic_table(db).await?;
    job_cancel::create_job_cancel_table(db).await?;
    worker_kind::create_worker_kind_table(db).await?;
    job_slot::create_job_slot_table(db).await
}
