//! freshlock's migrations step down and up again, and `create_tables` builds what they build: on
//! SQLite, PostgreSQL and MariaDB.

#[path = "common/servers.rs"]
mod servers;

use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use servers::{TestDb, databases};

/// freshlock's tables, as the migrations leave them.
const TABLES: [&str; 6] = [
    "freshlock_lock",
    "freshlock_row_lock",
    "freshlock_claim",
    "freshlock_commit",
    "freshlock_job",
    "freshlock_periodic",
];

async fn exists(db: &DatabaseConnection, table: &str) -> bool {
    let sql = format!("SELECT COUNT(*) AS n FROM {table}");
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .is_ok()
}

async fn floor_rows(db: &DatabaseConnection) -> i64 {
    let sql = "SELECT COUNT(*) AS n FROM freshlock_lock WHERE name = ''";
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("count the floor")
        .expect("a row")
        .try_get::<i64>("", "n")
        .expect("n")
}

async fn down_and_up(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let conn = &db.db;
    for table in TABLES {
        assert!(exists(conn, table).await, "{table} after the migrations");
    }
    assert_eq!(floor_rows(conn).await, 1);

    Migrator::down(conn, None).await.expect("every step down");
    for table in TABLES {
        assert!(
            !exists(conn, table).await,
            "{table} is dropped by its step down"
        );
    }

    Migrator::up(conn, None).await.expect("every step up again");
    // The shortcut builds nothing more and fails on nothing the migrations built.
    freshlock::schema::create_tables(conn)
        .await
        .expect("create_tables after the migrations");
    for table in TABLES {
        assert!(exists(conn, table).await, "{table} after the steps up");
    }
    assert_eq!(floor_rows(conn).await, 1, "one fence floor");

    // `schema::migrate`, for an application without a migrator of its own: on a database whose
    // migrator already built the tables it fails on nothing and builds nothing more, and it
    // records its steps in a table of its own (the application's `seaql_migrations` untouched).
    let applied = |table: &str| format!("SELECT COUNT(*) AS n FROM {table}");
    let count = async |sql: String| {
        conn.query_one_raw(Statement::from_string(conn.get_database_backend(), sql))
            .await
            .expect("count")
            .expect("a row")
            .try_get::<i64>("", "n")
            .expect("n")
    };
    let theirs = count(applied("seaql_migrations")).await;
    freshlock::schema::migrate(conn).await.expect("migrate");
    freshlock::schema::migrate(conn)
        .await
        .expect("migrate again");
    let ours = count(applied(freshlock::schema::MIGRATIONS_TABLE)).await;
    assert_eq!(ours, freshlock::schema::migrations().len() as i64);
    assert_eq!(count(applied("seaql_migrations")).await, theirs);
    assert_eq!(floor_rows(conn).await, 1, "one fence floor");
    for table in TABLES {
        assert!(exists(conn, table).await, "{table} after migrate");
    }
    conn.execute_unprepared(&format!(
        "DROP TABLE {}",
        freshlock::schema::MIGRATIONS_TABLE
    ))
    .await
    .expect("drop freshlock_migrations");
}

#[tokio::test]
async fn schema_steps_sqlite() {
    down_and_up(databases::sqlite("schema_steps").await).await;
}

#[tokio::test]
async fn schema_steps_postgres() {
    down_and_up(databases::postgres("schema_steps").await).await;
}

#[tokio::test]
async fn schema_steps_mysql() {
    down_and_up(databases::mysql("schema_steps").await).await;
}
