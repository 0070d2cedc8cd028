//! The writers' sweep of old commit markers (every 1,024 markers of a process) never waits for a
//! write in flight.
//!
//! On MySQL/MariaDB, where every locked write carries a marker, its `DELETE … WHERE created_at <
//! …` scanned every marker (no index on their age), in autocommit at the server's REPEATABLE
//! READ: it waited for each marker not committed yet — a write in flight, or one whose `COMMIT`
//! reply a silent partition lost, until the server drops its connection — while holding the rows
//! and gaps it had read, which other writers' marker inserts wait for. The writer that ran the
//! sweep waited with it: here for `innodb_lock_wait_timeout`, 50 s. Now the sweep locks the old
//! markers it can have (`SKIP LOCKED`, on the age index of `schema::MarkerAgeMigration`) and
//! deletes those. On PostgreSQL (markers without `freshlock_incarnation`) the same statement
//! runs, in one `DELETE`; SQLite has one writer.
//!
//! The sweep's count is process-wide: this binary holds one test, which writes 1,024 markers on
//! MariaDB and then 1,024 on PostgreSQL, so that each database gets one sweep of its own.

#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use entity::node;
use freshlock::{Session, UpdateOutcome};
use sea_orm::{ConnectionTrait, DbBackend, Set, Statement, TransactionTrait};
use servers::{TestDb, databases};

/// Markers a process writes between two sweeps (`commit::SWEEP_EVERY`).
const SWEEP_EVERY: i32 = 1024;

async fn the_sweep_passes_a_write_in_flight(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let test = db;
    let db = test.db.clone();
    let backend = db.get_database_backend();
    // Old markers for the sweep to delete (committed), and a write in flight: its marker
    // inserted, its transaction open.
    for n in 1..=10 {
        db.execute_unprepared(&format!(
            "INSERT INTO freshlock_commit (token, created_at) VALUES ('old-{n}', {n})"
        ))
        .await
        .unwrap();
    }
    let now = match backend {
        DbBackend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        _ => "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
    };
    if backend == DbBackend::Postgres {
        // Without the incarnation table every write carries a marker, as on MySQL.
        db.execute_unprepared("DROP TABLE freshlock_incarnation")
            .await
            .unwrap();
    }
    let in_flight = db.begin().await.unwrap();
    in_flight
        .execute_raw(Statement::from_string(
            backend,
            format!("INSERT INTO freshlock_commit (token, created_at) VALUES ('in-flight', {now})"),
        ))
        .await
        .unwrap();
    let session = Session::new(db.clone());
    let nodes = session.repository::<node::Entity>();
    let writes = async {
        let mut acknowledged = 0;
        for _ in 0..SWEEP_EVERY {
            let report = nodes
                .locked_update(1, |n| {
                    let score = n.score.as_ref().unwrap_or(0);
                    n.score = Set(Some(score + 1));
                    Ok(())
                })
                .await
                .unwrap();
            assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
            acknowledged += 1;
        }
        acknowledged
    };
    // A bound, not a timing: the sweep that waited for the marker in flight held its writer
    // for 50 s.
    let acknowledged = tokio::time::timeout(Duration::from_secs(30), writes)
        .await
        .expect("the sweep does not wait for the write in flight");
    assert_eq!(acknowledged, SWEEP_EVERY);
    // Every acknowledged write is in the row once.
    assert_eq!(test.score(1).await, Some(SWEEP_EVERY));
    in_flight.rollback().await.unwrap();
    let old = test
        .query_one("SELECT COUNT(*) AS n FROM freshlock_commit WHERE token LIKE 'old-%'")
        .await;
    let old: i64 = old.try_get("", "n").unwrap();
    assert_eq!(old, 0, "the sweep ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_marker_sweep_passes_a_write_in_flight() {
    the_sweep_passes_a_write_in_flight(databases::mysql("marker_sweep").await).await;
    the_sweep_passes_a_write_in_flight(databases::postgres("marker_sweep").await).await;
}
