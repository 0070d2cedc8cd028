//! `freshlock demo` never touches data it did not create: an application's claims (a finished
//! one included) and rows survive a demo run pointed at the application's database — on a SQLite
//! file, PostgreSQL and MariaDB — and `DATABASE_URL` alone never sends the demo there. CLI errors
//! print their causes.

mod common;

use std::{process::Command, time::Duration};

use common::{connect, fresh_database, unique};

use entity::node;
use freshlock::claim::{ClaimOutcome, Claims};
use freshlock::lock::LockName;
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, PaginatorTrait, Statement};

fn freshlock(args: &[&str], env_url: Option<&str>) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_freshlock"));
    command.args(args).env_remove("DATABASE_URL");
    if let Some(url) = env_url {
        command.env("DATABASE_URL", url);
    }
    command.output().expect("run freshlock")
}

/// The application's state: three claims (one finished) and three nodes.
async fn seed_application(db: &DatabaseConnection) {
    Migrator::up(db, None).await.unwrap();
    let claims = Claims::new(db.clone());
    for task in ["job:1", "job:2", "job:3"] {
        let ClaimOutcome::Claimed(claim) = claims
            .claim(&LockName::new(task).unwrap(), Duration::from_secs(3600))
            .await
            .unwrap()
        else {
            panic!("fresh claim");
        };
        if task == "job:1" {
            claims.finish(&claim).await.unwrap();
        }
    }
    let rows: Vec<_> = (1..=3).map(node::ActiveModel::fresh).collect();
    node::Entity::insert_many(rows).exec(db).await.unwrap();
}

async fn claim_states(db: &DatabaseConnection) -> Vec<(String, String)> {
    let rows = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT name, state FROM freshlock_claim ORDER BY name",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            (
                row.try_get::<String>("", "name").unwrap(),
                row.try_get::<String>("", "state").unwrap(),
            )
        })
        .collect()
}

async fn application_survives(url: &str) {
    let db = connect(url).await;
    seed_application(&db).await;
    let claims = claim_states(&db).await;
    let nodes = node::Entity::find().all(&db).await.unwrap();
    assert_eq!(claims.len(), 3);

    // Named on the command line: the demo runs on that server, in a place of its own.
    let output = freshlock(
        &[
            "demo",
            "--nodes",
            "5",
            "--work-ms",
            "0-1",
            "--json",
            "--database-url",
            url,
        ],
        None,
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Only in the environment: ignored, said so.
    let output = freshlock(
        &["demo", "--nodes", "5", "--work-ms", "0-1", "--json"],
        Some(url),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("ignores DATABASE_URL"));

    assert_eq!(
        claim_states(&db).await,
        claims,
        "the application's claims survive"
    );
    assert_eq!(node::Entity::find().all(&db).await.unwrap(), nodes);
    assert_eq!(node::Entity::find().count(&db).await.unwrap(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_on_a_sqlite_file_survives_the_demo() {
    let path = std::env::temp_dir().join(format!("{}.db", unique("demoapp")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    application_survives(&url).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_on_postgres_survives_the_demo() {
    let Some(fresh) = fresh_database("postgres", "demoapp").await else {
        return;
    };
    application_survives(&fresh.url).await;
    let schemas = connect(&fresh.url)
        .await
        .query_all_raw(Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'freshlock_demo_%'",
        ))
        .await
        .unwrap();
    assert!(schemas.is_empty(), "the demo removed its schema");
    fresh.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_on_mariadb_survives_the_demo() {
    let Some(fresh) = fresh_database("mysql", "demoapp").await else {
        return;
    };
    application_survives(&fresh.url).await;
    let leftovers = fresh
        .admin
        .query_all_raw(Statement::from_string(
            sea_orm::DbBackend::MySql,
            "SELECT schema_name FROM information_schema.schemata \
             WHERE schema_name LIKE 'freshlock\\_demo\\_%'",
        ))
        .await
        .unwrap();
    assert!(leftovers.is_empty(), "the demo removed its database");
    fresh.drop_database().await;
}

#[test]
fn errors_print_their_causes() {
    // Nothing listens on port 1: the cause, at once, not "pool timed out" after 30 s.
    for url in [
        "postgres://postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
    ] {
        let scheme = url.split(':').next().unwrap();
        if (scheme == "postgres" && !cfg!(feature = "postgres"))
            || (scheme == "mysql" && !cfg!(feature = "mysql"))
        {
            continue;
        }
        let output = freshlock(&["--database-url", url, "locks"], None);
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("refused"), "{stderr}");
    }
    // A database without freshlock's tables: the hint names the migrations.
    let path = std::env::temp_dir().join(format!("{}.db", unique("empty")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let output = freshlock(&["--database-url", &url, "locks"], None);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("caused by:") && stderr.contains("no such table"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hint:") && stderr.contains("migrations"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(path);
}
