//! freshlock's migrations run on their own, for applications without a sea-orm `Migrator`.

use sea_orm::{DatabaseConnection, DbErr, DynIden, sea_query::Alias};
use sea_orm_migration::{MigrationTrait, MigratorTrait};

/// The table that records which of freshlock's migrations [`migrate`] applied: its own, so
/// that it never meets the migrations of an application's `seaql_migrations` (a migrator fails
/// on applied migrations it does not list).
pub const MIGRATIONS_TABLE: &str = "freshlock_migrations";

/// A migrator of freshlock's migrations alone, recorded in [`MIGRATIONS_TABLE`].
struct Freshlock;

#[async_trait::async_trait]
impl MigratorTrait for Freshlock {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        super::migrations()
    }

    fn migration_table_name() -> DynIden {
        Alias::new(MIGRATIONS_TABLE).into()
    }
}

/// Applies freshlock's migrations that `db` has not had yet, recorded in a table of their own
/// ([`MIGRATIONS_TABLE`]): no `sea-orm-migration` dependency and no `Migrator` of your own
/// needed. Run it from one process (a deploy step, or start-up before sessions and workers use
/// the database). Safe to run again, and on a database whose own `Migrator` already applied
/// [`migrations()`](super::migrations) (each table is created only if it does not exist).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), sea_orm::DbErr> {
/// let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// freshlock::schema::migrate(&db).await?;
/// freshlock::schema::migrate(&db).await?; // nothing left to apply
/// freshlock::jobs::enqueue(&db, freshlock::jobs::NewJob::new("hello", &()).unwrap())
///     .await
///     .unwrap();
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// The database's error when a statement fails.
pub async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    Freshlock::up(db, None).await
}
