//! freshlock's own tables, as a sea-orm migration to add to your `Migrator`.
//!
//! - `freshlock_lock` — one row per lock name: owner token, lease expiry (database clock,
//!   milliseconds since the Unix epoch), fence counter, and who holds it (host, pid, label,
//!   acquired-at). The [`TableLock`](crate::TableLock) backend leases these rows; the
//!   other lease backends keep their fence counters here. The row named `''` (no lock has an
//!   empty name) is the **fence floor** ([`FloorMigration`]): a new row's first fence is one
//!   above it, and [`crate::inspect::compact`] raises it to the highest fence of the rows it
//!   deletes, so every name's fences keep growing across deletions.
//! - `freshlock_claim` — claims with a lease ([`crate::claim::Claims`]).
//! - `freshlock_row_lock` — one row per lock name, locked with `SELECT … FOR UPDATE` by the
//!   [`RowLock`](crate::RowLock) backend (the Django report's `HamLock`).
//! - `freshlock_commit` — commit markers: one row per recent locked write, so that a commit whose
//!   reply was lost can be resolved instead of run twice ([`CommitMigration`]); indexed by age
//!   for the sweep of old markers ([`MarkerAgeMigration`]).
//! - `freshlock_incarnation` — PostgreSQL only, an `UNLOGGED` table of one row: the token of the
//!   server's current incarnation. Crash recovery empties unlogged tables, so the row's token
//!   changes exactly when transaction ids may have been handed out twice; with it, a write's
//!   transaction id is evidence of its commit ([`IncarnationMigration`], `commit.rs`).
//!
//! - `freshlock_job` — the keyed job queue ([`crate::jobs`], [`JobMigration`]): kinds, keys and
//!   unique keys are stored as bytes (with a SHA-256 of each key for its index), so they compare
//!   byte for byte on every database.
//!
//! On MySQL/MariaDB every name and token column compares byte for byte ([`CommitMigration`]).

use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{
    MigrationName, MigrationTrait, SchemaManager,
    prelude::{DeriveIden, Table},
    schema::{big_integer, big_integer_null, string_len, string_len_null},
    sea_query::TableCreateStatement,
};

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
/// The stored name of the fence-floor row of `freshlock_lock` (see the module docs).
pub(crate) const FLOOR_NAME: &str = "";
/// The name of the migration that creates them, as it appears in `seaql_migrations`.
pub const MIGRATION_NAME: &str = "m20261130_000100_create_freshlock_tables";
/// Longest lock name stored as it is; longer ones are stored as prefix + hash.
pub(crate) const MAX_STORED_NAME: usize = 255;

#[derive(DeriveIden)]
enum FreshlockLock {
    Table,
    Name,
    Owner,
    Fence,
    ExpiresAt,
    Host,
    Pid,
    Label,
    AcquiredAt,
}

#[derive(DeriveIden)]
enum FreshlockRowLock {
    Table,
    Name,
}

#[derive(DeriveIden)]
enum FreshlockClaim {
    Table,
    Name,
    State,
    Owner,
    Fence,
    ExpiresAt,
    Host,
    Pid,
    Label,
    ClaimedAt,
    FinishedAt,
}

fn claim_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockClaim::Table)
        .if_not_exists()
        .col(string_len(FreshlockClaim::Name, MAX_STORED_NAME as u32).primary_key())
        .col(string_len(FreshlockClaim::State, 16))
        .col(string_len_null(FreshlockClaim::Owner, 64))
        .col(big_integer(FreshlockClaim::Fence).default(0))
        .col(big_integer(FreshlockClaim::ExpiresAt).default(0))
        .col(string_len_null(FreshlockClaim::Host, 255))
        .col(big_integer_null(FreshlockClaim::Pid))
        .col(string_len_null(FreshlockClaim::Label, 255))
        .col(big_integer_null(FreshlockClaim::ClaimedAt))
        .col(big_integer_null(FreshlockClaim::FinishedAt))
        .to_owned()
}

fn lock_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockLock::Table)
        .if_not_exists()
        .col(string_len(FreshlockLock::Name, MAX_STORED_NAME as u32).primary_key())
        .col(string_len_null(FreshlockLock::Owner, 64))
        .col(big_integer(FreshlockLock::Fence).default(0))
        .col(big_integer(FreshlockLock::ExpiresAt).default(0))
        .col(string_len_null(FreshlockLock::Host, 255))
        .col(big_integer_null(FreshlockLock::Pid))
        .col(string_len_null(FreshlockLock::Label, 255))
        .col(big_integer_null(FreshlockLock::AcquiredAt))
        .to_owned()
}

fn row_lock_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockRowLock::Table)
        .if_not_exists()
        .col(string_len(FreshlockRowLock::Name, MAX_STORED_NAME as u32).primary_key())
        .to_owned()
}

/// The migration that creates the lease and lock-row tables. Add [`migrations`] to your
/// `Migrator`'s list (it has this one, [`ClaimMigration`] and [`CommitMigration`]).
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(lock_table()).await?;
        manager.create_table(row_lock_table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockRowLock::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockLock::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await
    }
}

/// The name of the migration that creates the claims table.
pub const CLAIM_MIGRATION_NAME: &str = "m20261130_000200_create_freshlock_claim";

/// The migration that creates `freshlock_claim` (claims with a lease).
pub struct ClaimMigration;

impl MigrationName for ClaimMigration {
    fn name(&self) -> &str {
        CLAIM_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for ClaimMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(claim_table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockClaim::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await
    }
}

#[derive(DeriveIden)]
enum FreshlockCommit {
    Table,
    Token,
    CreatedAt,
}

fn commit_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockCommit::Table)
        .if_not_exists()
        .col(string_len(FreshlockCommit::Token, 64).primary_key())
        .col(big_integer(FreshlockCommit::CreatedAt))
        .to_owned()
}

/// The name of the migration that adds commit markers and byte-exact names.
pub const COMMIT_MIGRATION_NAME: &str = "m20261130_000300_freshlock_commit_and_exact_names";

/// The migration that creates `freshlock_commit` (the markers that resolve a commit whose reply
/// was lost) and, on MySQL/MariaDB, makes every name and token column of freshlock's tables
/// compare byte for byte: their default collation there ignores case, accents and trailing
/// spaces, so `job:A`, `job:a`, `job:é` and `job:e  ` would be one claim, one lease, one fence.
/// Existing tables are converted in place (a binary comparison never merges rows).
pub struct CommitMigration;

impl MigrationName for CommitMigration {
    fn name(&self) -> &str {
        COMMIT_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CommitMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(commit_table()).await?;
        exact_names(manager.get_connection()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // The names stay byte-exact: going back to a collation that merges names could fail on
        // rows that are distinct only byte for byte.
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockCommit::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await
    }
}

/// On MySQL/MariaDB, a binary NO PAD collation for every name and token column: MariaDB's
/// `utf8mb4_nopad_bin`, MySQL 8's `utf8mb4_0900_bin` (`utf8mb4_bin` still pads trailing spaces).
async fn exact_names(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    if db.get_database_backend() != sea_orm::DbBackend::MySql {
        return Ok(());
    }
    let version = db
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::MySql,
            "SELECT VERSION() AS v",
        ))
        .await?
        .map(|row| row.try_get::<String>("", "v"))
        .transpose()?
        .unwrap_or_default();
    let collation = if version.contains("MariaDB") {
        "utf8mb4_nopad_bin"
    } else {
        "utf8mb4_0900_bin"
    };
    let text = |column: &str, len: u32, null: &str| {
        format!("MODIFY {column} VARCHAR({len}) CHARACTER SET utf8mb4 COLLATE {collation} {null}")
    };
    let max = MAX_STORED_NAME as u32;
    for (table, columns) in [
        (
            LOCK_TABLE,
            vec![text("name", max, "NOT NULL"), text("owner", 64, "NULL")],
        ),
        (ROW_LOCK_TABLE, vec![text("name", max, "NOT NULL")]),
        (
            CLAIM_TABLE,
            vec![text("name", max, "NOT NULL"), text("owner", 64, "NULL")],
        ),
        (COMMIT_TABLE, vec![text("token", 64, "NOT NULL")]),
    ] {
        db.execute_unprepared(&format!("ALTER TABLE {table} {}", columns.join(", ")))
            .await?;
    }
    Ok(())
}

/// The name of the migration that adds the fence floor.
pub const FLOOR_MIGRATION_NAME: &str = "m20261130_000400_freshlock_lock_floor";

/// The migration that adds the fence-floor row to `freshlock_lock` (see the module docs), so
/// that lock rows nobody needs can be deleted without a name's fences ever going back. Without
/// it the floor is taken as 0 (and created by the first [`crate::inspect::compact`]); on
/// MySQL/MariaDB a present floor row also keeps new names' first grants from gap-locking.
pub struct FloorMigration;

impl MigrationName for FloorMigration {
    fn name(&self) -> &str {
        FLOOR_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for FloorMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        insert_floor(manager.get_connection()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // The floor stays: removing it could let a deleted name's fences start over.
        let _ = manager;
        Ok(())
    }
}

/// Inserts the fence-floor row at 0 unless it is there.
pub(crate) async fn insert_floor(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let insert = insert_ignore(
        backend,
        LOCK_TABLE,
        "name, fence, expires_at",
        &format!("'{FLOOR_NAME}', 0, 0"),
    );
    db.execute_raw(sea_orm::Statement::from_string(backend, insert))
        .await
        .map(drop)
}

/// The name of the migration that adds PostgreSQL's server-incarnation table.
pub const INCARNATION_MIGRATION_NAME: &str = "m20261201_000500_freshlock_incarnation";

/// On PostgreSQL, the migration that creates `freshlock_incarnation`: an `UNLOGGED` table that
/// holds one row, the token of the server's current incarnation (written by the first locked
/// write that finds it empty). PostgreSQL empties unlogged tables in crash recovery (and a
/// promoted standby starts with them empty), which are exactly the events after which a
/// transaction id can be handed out a second time. A write whose transaction saw token `t` and
/// got id `x` is therefore resolved by `txid_status(x)` only while `t` is still the row's token;
/// afterwards its outcome is unknown, never guessed. With this table a PostgreSQL write needs
/// no marker row (see `freshlock::commit` in the crate's source); without it, writes keep
/// writing markers. Nothing on MySQL/MariaDB and SQLite.
pub struct IncarnationMigration;

impl MigrationName for IncarnationMigration {
    fn name(&self) -> &str {
        INCARNATION_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for IncarnationMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        create_incarnation_table(manager.get_connection()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        if db.get_database_backend() != sea_orm::DbBackend::Postgres {
            return Ok(());
        }
        db.execute_unprepared(&format!("DROP TABLE IF EXISTS {INCARNATION_TABLE}"))
            .await
            .map(drop)
    }
}

/// `CREATE UNLOGGED TABLE IF NOT EXISTS freshlock_incarnation` on PostgreSQL; nothing elsewhere.
async fn create_incarnation_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    if db.get_database_backend() != sea_orm::DbBackend::Postgres {
        return Ok(());
    }
    db.execute_unprepared(&format!(
        "CREATE UNLOGGED TABLE IF NOT EXISTS {INCARNATION_TABLE} \
         (id INTEGER PRIMARY KEY CHECK (id = 1), token VARCHAR(64) NOT NULL)"
    ))
    .await
    .map(drop)
}

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
    ]
}

/// Creates freshlock's tables if they do not exist, without the migration machinery (for tests
/// and tools; applications should prefer [`Migration`]).
///
/// # Errors
/// The database's error when a statement fails.
pub async fn create_tables(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    db.execute(&lock_table()).await?;
    db.execute(&row_lock_table()).await?;
    db.execute(&claim_table()).await?;
    db.execute(&commit_table()).await?;
    exact_names(db).await?;
    insert_floor(db).await?;
    create_incarnation_table(db).await?;
    create_job_table(db).await?;
    create_index(db, COMMIT_TABLE, MARKER_AGE_INDEX, "created_at").await
}

/// `INSERT … ` that does nothing when the key exists.
pub(crate) fn insert_ignore(
    backend: sea_orm::DbBackend,
    table: &str,
    columns: &str,
    values: &str,
) -> String {
    match backend {
        sea_orm::DbBackend::MySql => {
            format!("INSERT IGNORE INTO {table} ({columns}) VALUES ({values})")
        }
        _ => format!("INSERT INTO {table} ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING"),
    }
}

/// The name of the migration that adds the job table.
pub const JOB_MIGRATION_NAME: &str = "m20261202_000600_freshlock_job";

/// The migration that creates `freshlock_job`, the table of [`crate::jobs`]: one row per job
/// (kind, payload, serialization key, unique key, priority, run-at time on the database clock,
/// attempts, last error, state). Kinds and keys are bytes: PostgreSQL's text cannot hold NUL,
/// and MySQL's default collations merge case and trailing spaces. A key's index holds its
/// SHA-256, so a 10 kB key indexes like a short one; the unique key's hash is set only while
/// its job waits, so a finished job never blocks a new one.
pub struct JobMigration;

impl MigrationName for JobMigration {
    fn name(&self) -> &str {
        JOB_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for JobMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        create_job_table(manager.get_connection()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(&format!("DROP TABLE IF EXISTS {JOB_TABLE}"))
            .await
            .map(drop)
    }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_job` and its indexes, per dialect.
async fn create_job_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
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

/// `CREATE INDEX index ON table (columns)` unless `table` has an index of that name.
async fn create_index(
    db: &impl ConnectionTrait,
    table: &str,
    index: &str,
    columns: &str,
) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let create = if backend == sea_orm::DbBackend::MySql {
        // MySQL has no `IF NOT EXISTS` for indexes (MariaDB has): look first.
        let exists = db
            .query_one_raw(sea_orm::Statement::from_sql_and_values(
                backend,
                "SELECT 1 AS one FROM information_schema.statistics \
                 WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?",
                [table.into(), index.into()],
            ))
            .await?
            .is_some();
        if exists {
            return Ok(());
        }
        format!("CREATE INDEX {index} ON {table} ({columns})")
    } else {
        format!("CREATE INDEX IF NOT EXISTS {index} ON {table} ({columns})")
    };
    db.execute_unprepared(&create).await.map(drop)
}

/// The name of the migration that indexes the commit markers by age.
pub const MARKER_AGE_MIGRATION_NAME: &str = "m20261202_000700_freshlock_commit_age";

/// The index of `freshlock_commit` by `created_at` ([`MarkerAgeMigration`]).
const MARKER_AGE_INDEX: &str = "freshlock_commit_age";

/// The migration that indexes `freshlock_commit` by `created_at`, so that the writers' sweep of
/// old markers (every 1,024 markers of a process) reads only the markers it deletes. Without
/// it the sweep scans every marker of the last ten minutes: on MySQL/MariaDB it then also waits
/// for each write whose marker is not committed yet (one whose `COMMIT` reply is lost in a
/// silent partition: until the server drops its connection), and the writer that runs the
/// sweep waits with it.
pub struct MarkerAgeMigration;

impl MigrationName for MarkerAgeMigration {
    fn name(&self) -> &str {
        MARKER_AGE_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for MarkerAgeMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        create_index(db, COMMIT_TABLE, MARKER_AGE_INDEX, "created_at").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        let sql = match db.get_database_backend() {
            sea_orm::DbBackend::MySql => format!("DROP INDEX {MARKER_AGE_INDEX} ON {COMMIT_TABLE}"),
            _ => format!("DROP INDEX IF EXISTS {MARKER_AGE_INDEX}"),
        };
        db.execute_unprepared(&sql).await.map(drop)
    }
}
