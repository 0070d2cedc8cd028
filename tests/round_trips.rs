//! Round trips of a `locked_update` under `pg_advisory` on PostgreSQL, counted by a proxy between
//! the pool and the server: the advisory lock is tried by the reload itself (`WHERE … AND (SELECT
//! pg_try_advisory_xact_lock(key))`, a one-time filter), so the write sends `BEGIN`, the reload,
//! the UPDATE and `COMMIT` — four, as under the in-process lock — instead of a fifth statement
//! for the lock. When the try fails (the lock is busy in another process, or there is no row),
//! nothing was read or locked: the attempt runs again with the lock taken by a statement of its
//! own, and the write's outcome and counts are those of any other write.
//!
//! PostgreSQL only (the shared server, a schema of the test's own).

#[cfg(feature = "mysql")]
#[path = "common/expiring.rs"]
mod expiring;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use entity::node;
use freshlock::lock::{LocalLock, PgAdvisoryLock, RowLock, TableLock};
use freshlock::{LockBackend, LockPolicy, Session, UpdateOutcome, lock_name};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DatabaseConnection, Set, TransactionTrait};
use servers::TestDb;

/// Calls measured after the warm-up (prepared statements, the incarnation token).
const CALLS: u32 = 40;

async fn proxied(db: &TestDb, proxy: &Proxy) -> DatabaseConnection {
    proxied_with(db, proxy, |_| {}).await
}

/// [`proxied`], with the connect options changed by `change` first.
async fn proxied_with(
    db: &TestDb,
    proxy: &Proxy,
    change: impl FnOnce(&mut sea_orm::ConnectOptions),
) -> DatabaseConnection {
    // One connection, no checkout ping: every message the proxy sees is a statement of a call.
    proxy::one_connection(proxy, &db.url, db.schema.as_deref(), change).await
}

fn session(pool: &DatabaseConnection) -> Session {
    session_with(pool, Arc::new(PgAdvisoryLock::new()))
}

fn session_with(pool: &DatabaseConnection, lock: Arc<dyn LockBackend>) -> Session {
    Session::builder(pool.clone())
        .lock(lock)
        .policy(LockPolicy::default().with_wait_per_try(Duration::from_secs(30)))
        .build()
        .expect("session")
}

async fn increment(session: &Session, id: i32) -> freshlock::UpdateReport<node::Model> {
    session
        .repository::<node::Entity>()
        .locked_update(id, |n| {
            n.score = Set(Some(n.score.as_ref().unwrap_or(0) + 1));
            Ok(())
        })
        .await
        .expect("locked_update")
}

/// Statement round trips of `CALLS` uncontended increments of node 1 (after a warm-up of 5:
/// prepared statements, the incarnation token), each of them updated under its lock in one
/// attempt.
async fn round_trips_of(session: &Session, proxy: &Proxy) -> u32 {
    for _ in 0..5 {
        increment(session, 1).await;
    }
    let before = proxy.round_trips();
    for _ in 0..CALLS {
        let report = increment(session, 1).await;
        assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
        assert!(report.lock.held, "the lock was had");
        assert_eq!((report.attempts, report.conflicts), (1, 0));
    }
    proxy.round_trips() - before
}

/// Each backend's `CALLS` increments of node 1 on `pool` send `statements` round trips per
/// call, and the row gains exactly the acknowledged increments (warm-ups included).
async fn sends_per_call(
    db: &TestDb,
    pool: &DatabaseConnection,
    proxy: &Proxy,
    backends: impl IntoIterator<Item = (&str, Arc<dyn LockBackend>, u32)>,
) {
    let mut done = 0;
    for (name, lock, statements) in backends {
        let sent = round_trips_of(&session_with(pool, lock), proxy).await;
        done += 5 + CALLS as i32;
        assert_eq!(
            sent,
            CALLS * statements,
            "{name}: round trips for {CALLS} calls"
        );
    }
    assert_eq!(db.score(1).await, Some(done));
}

/// The statements of one uncontended `locked_update` per backend, as a guard on the hot path:
/// a statement added to it fails here. `local`, `pg_advisory` and `row` send four (BEGIN,
/// reload, UPDATE, COMMIT: `pg_advisory` and `row` try their lock in the reload; a lock
/// statement of its own made five); `table` grants its lease before the transaction and checks
/// (and frees) it in the reload itself (five; a check of its own made six). sqlx also pings
/// each connection it is given back, a round trip off the caller's path, which the proxy does
/// not count.
#[tokio::test]
async fn every_backend_sends_the_statements_it_documents() {
    let Some(db) = servers::postgres("round_trips_backends").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let backends: [(&str, Arc<dyn LockBackend>, u32); 4] = [
        ("local", Arc::new(LocalLock::new()), 4),
        ("pg_advisory", Arc::new(PgAdvisoryLock::new()), 4),
        ("row", Arc::new(RowLock::new(pool.clone())), 4),
        ("table", Arc::new(TableLock::new(pool.clone())), 5),
    ];
    sends_per_call(&db, &pool, &proxy, backends).await;
}

/// `locked_update_pair` runs on the row write of `locked_update` (`rows_step.rs`): under the
/// in-process lock it sends `BEGIN`, one reload per row, one UPDATE per row — the last taking
/// the commit's evidence in its own statement — and `COMMIT`: six round trips, where the
/// section it ran as before sent a seventh for the evidence. Both rows gain exactly the
/// acknowledged increments.
#[tokio::test]
async fn a_pair_update_takes_its_evidence_in_its_last_update() {
    let Some(db) = servers::postgres("round_trips_pair").await else {
        return;
    };
    db.seed_nodes(2).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session_with(&pool, Arc::new(LocalLock::new()));
    let nodes = session.repository::<node::Entity>();
    let pair = || {
        nodes.locked_update_pair(1, 2, |a, b| {
            a.score = Set(Some(a.score.as_ref().unwrap_or(0) + 1));
            b.score = Set(Some(b.score.as_ref().unwrap_or(0) + 1));
            Ok(())
        })
    };
    for _ in 0..5 {
        pair().await.expect("warm-up");
    }
    let before = proxy.round_trips();
    for _ in 0..CALLS {
        let report = pair().await.expect("locked_update_pair");
        assert!(
            (report.outcomes.iter()).all(|o| matches!(o, UpdateOutcome::Updated(_))),
            "{:?}",
            report.outcomes
        );
        assert_eq!((report.attempts, report.conflicts), (1, 0));
    }
    assert_eq!(
        proxy.round_trips() - before,
        CALLS * 6,
        "round trips for {CALLS} calls"
    );
    let done = 5 + CALLS as i32;
    assert_eq!(
        (db.score(1).await, db.score(2).await),
        (Some(done), Some(done))
    );
}

/// `table` on PostgreSQL checks its lease and frees it in the statement that reloads the row (a
/// data-modifying `WITH` before the `SELECT … FOR UPDATE`), so the commit ends the lease: also
/// when the write changed nothing — four round trips (the grant, `BEGIN`, the reload, `COMMIT`),
/// no release statement after it (five before) — and the lease row is free after every call.
#[tokio::test]
async fn a_table_write_that_changes_nothing_ends_its_lease_with_its_commit() {
    let Some(db) = servers::postgres("round_trips_table_unchanged").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session_with(&pool, Arc::new(TableLock::new(pool.clone())));
    let nodes = session.repository::<node::Entity>();
    let unchanged = || async {
        let report = nodes
            .locked_update(1, |_| Ok(()))
            .await
            .expect("locked_update");
        assert!(matches!(report.outcome, UpdateOutcome::Unchanged(_)));
        assert!(report.lock.held && report.lock.release_error.is_none());
        assert_eq!((report.attempts, report.conflicts), (1, 0));
    };
    for _ in 0..5 {
        unchanged().await;
    }
    for _ in 0..CALLS {
        let before = proxy.round_trips();
        unchanged().await;
        assert_eq!(proxy.round_trips() - before, 4, "round trips of one call");
        let held = db
            .query_one("SELECT COUNT(*) AS n FROM freshlock_lock WHERE owner IS NOT NULL")
            .await;
        assert_eq!(
            held.try_get::<i64>("", "n").expect("count"),
            0,
            "lease freed"
        );
    }
    assert_eq!(db.score(1).await, None, "nothing written");
}

/// The same guard on MySQL/MariaDB, where a plain write takes six round trips (`SET
/// TRANSACTION`, `BEGIN`, the reload, the commit marker's INSERT and the UPDATE as one message
/// of two statements — seven round trips when they were sent one by one —, the read-back,
/// `COMMIT`): `row` tries its lock row in the reload (eight before: the lock row was looked up,
/// then locked); `mysql_named` sends `GET_LOCK` and the read of its fence row as one message and
/// `RELEASE_LOCK` on its own connection, and bumps its fence in the transaction, so its grant
/// commits nothing (nine round trips, one commit); `table` grants its lease before the
/// transaction and checks (and frees) it in the UPDATE's message, as its first statement
/// (seven round trips; eight when the check was a statement of its own).
#[cfg(feature = "mysql")]
#[tokio::test]
async fn every_backend_sends_the_statements_it_documents_mysql() {
    use freshlock::lock::MySqlNamedLock;

    let Some(db) = servers::mysql("round_trips_backends").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let locks = proxied(&db, &proxy).await;
    let backends: [(&str, Arc<dyn LockBackend>, u32); 4] = [
        ("local", Arc::new(LocalLock::new()), 6),
        ("row", Arc::new(RowLock::new(pool.clone())), 6),
        (
            "mysql_named",
            Arc::new(MySqlNamedLock::new(locks.clone()).expect("MySQL")),
            9,
        ),
        ("table", Arc::new(TableLock::new(pool.clone())), 7),
    ];
    sends_per_call(&db, &pool, &proxy, backends).await;
}

/// `locked_delete` on MySQL/MariaDB sends its commit marker's INSERT with the DELETE, as one
/// message: five round trips with `local` (`SET TRANSACTION`, `BEGIN`, the reload, the marker
/// and the DELETE, `COMMIT`), where the marker's INSERT before `COMMIT` made six. Then the reply
/// of every third `COMMIT` is cut: each of those deletes is resolved by its marker, so every
/// delete is reported `Deleted` exactly when its row is gone, and no other row is touched.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_locked_delete_sends_its_marker_with_the_delete_mysql() {
    use freshlock::DeleteOutcome;
    use sea_orm::{EntityTrait, PaginatorTrait};

    let Some(db) = servers::mysql("round_trips_delete").await else {
        return;
    };
    let rows = 2 * CALLS as i32 + 2;
    db.seed_nodes(rows).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session_with(&pool, Arc::new(LocalLock::new()));
    let nodes = session.repository::<node::Entity>();
    let markers = || async {
        let row = db
            .query_one("SELECT COUNT(*) AS n FROM freshlock_commit")
            .await;
        row.try_get::<i64>("", "n").expect("count")
    };
    let delete = |id: i32| {
        let nodes = nodes.clone();
        async move {
            let report = nodes.locked_delete(id).await.expect("delete");
            assert!(
                matches!(report.outcome, DeleteOutcome::Deleted(_)),
                "{id}: {:?}",
                report.outcome
            );
        }
    };
    // The session's first write also makes a check of its own once.
    delete(1).await;
    let (before, marked) = (proxy.round_trips(), markers().await);
    for id in 2..CALLS as i32 + 2 {
        delete(id).await;
    }
    assert_eq!(proxy.round_trips() - before, CALLS * 5, "round trips");
    assert_eq!(
        markers().await - marked,
        i64::from(CALLS),
        "one marker each"
    );
    proxy.cut_every(3);
    for id in CALLS as i32 + 2..rows - 1 {
        delete(id).await;
    }
    assert!(
        proxy.cuts() >= CALLS / 3 - 1,
        "replies cut: {}",
        proxy.cuts()
    );
    let left = node::Entity::find().count(&db.db).await.expect("count");
    assert_eq!(left, 2, "every acknowledged delete gone, nothing else");
    for id in [rows, rows - 1] {
        let kept = node::Entity::find_by_id(id)
            .one(&db.db)
            .await
            .expect("read");
        assert!(kept.is_some(), "{id} was never deleted");
    }
}

/// `locked_delete` under `table` on MySQL/MariaDB checks and frees its lease in the DELETE's
/// message, as its first statement: seven round trips (the grant of a name not held before —
/// its take finds no row, then the INSERT —, `SET TRANSACTION`, `BEGIN`, the reload, the
/// lease's check with the marker and the DELETE, `COMMIT`; eight with the check as a statement
/// of its own), each delete reported `Deleted` exactly when its row is gone, its lease freed by
/// its commit. A lease that ran out before the delete is reported `LeaseLost`:
/// the message's count of rows does not confirm it, the attempt runs again with the check on
/// its own, and the row stays.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_table_delete_checks_its_lease_in_the_delete_mysql() {
    use expiring::ExpiresBeforeUse;
    use freshlock::DeleteOutcome;
    use sea_orm::{EntityTrait, PaginatorTrait};

    let Some(db) = servers::mysql("round_trips_table_delete").await else {
        return;
    };
    let rows = CALLS as i32 + 2;
    db.seed_nodes(rows).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session_with(&pool, Arc::new(TableLock::new(pool.clone())));
    let nodes = session.repository::<node::Entity>();
    let owned = || async {
        let row = db
            .query_one("SELECT COUNT(*) AS n FROM freshlock_lock WHERE owner IS NOT NULL")
            .await;
        row.try_get::<i64>("", "n").expect("count")
    };
    // The session's first write also makes a check of its own once.
    nodes.locked_delete(1).await.expect("delete");
    for id in 2..CALLS as i32 + 2 {
        let before = proxy.round_trips();
        let report = nodes.locked_delete(id).await.expect("delete");
        assert_eq!(proxy.round_trips() - before, 7, "{id}: round trips");
        assert!(matches!(report.outcome, DeleteOutcome::Deleted(_)));
        assert!(report.lock.held && report.lock.release_error.is_none());
        assert_eq!(report.attempts, 1);
        assert_eq!(owned().await, 0, "{id}: the commit freed the lease");
    }
    // A lease of 1 ms, handed over once it has run out.
    let expired = Session::builder(pool.clone())
        .lock(Arc::new(ExpiresBeforeUse(TableLock::new(pool.clone()))))
        .policy(LockPolicy::default().with_ttl(Duration::from_millis(1)))
        .build()
        .expect("session");
    let report = (expired.repository::<node::Entity>())
        .locked_delete(rows)
        .await
        .expect("delete");
    assert!(
        matches!(report.outcome, DeleteOutcome::LeaseLost),
        "{:?}",
        report.outcome
    );
    let left = node::Entity::find().count(&db.db).await.expect("count");
    assert_eq!(
        left, 1,
        "every acknowledged delete gone, the fenced one kept"
    );
    let kept = node::Entity::find_by_id(rows)
        .one(&db.db)
        .await
        .expect("read");
    assert!(kept.is_some(), "the fenced delete wrote nothing");
}

/// A MySQL/MariaDB pool whose connections default to READ COMMITTED
/// (`freshlock::db::mysql_read_committed`) needs no `SET TRANSACTION` before each `BEGIN`: five
/// round trips per write under `local` instead of six; the application's own transactions on
/// it run at that level too.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_read_committed_pool_skips_set_transaction_mysql() {
    let Some(db) = servers::mysql("round_trips_read_committed").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied_with(&db, &proxy, |options| {
        freshlock::db::mysql_read_committed(options);
    })
    .await;
    let sent = round_trips_of(&session_with(&pool, Arc::new(LocalLock::new())), &proxy).await;
    assert_eq!(sent, CALLS * 5, "round trips for {CALLS} calls");
    assert_eq!(db.score(1).await, Some(5 + CALLS as i32));
    let txn = pool.begin().await.expect("begin");
    let level = txn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::MySql,
            "SELECT @@tx_isolation AS level",
        ))
        .await
        .expect("level")
        .expect("a row");
    assert_eq!(
        level.try_get::<String>("", "level").unwrap(),
        "READ-COMMITTED"
    );
    txn.commit().await.expect("commit");
}

/// Polls `waiting` (a count `n`, a BIGINT on either database) until it is not 0: the write
/// waits for a lock.
async fn until_waiting(db: &TestDb, waiting: &str) {
    let mut polls = 0;
    while db.query_one(waiting).await.try_get::<i64>("", "n").unwrap() == 0 {
        polls += 1;
        assert!(polls < 3000, "the write never waited for the lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A write whose try in the reload failed: updated, its lock had, and the failed try not an
/// attempt of the write (nothing was read or written in it).
fn updated_in_one_attempt(report: &freshlock::UpdateReport<node::Model>) {
    assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
    assert!(report.lock.held);
    assert_eq!((report.attempts, report.conflicts), (1, 0));
}

#[tokio::test]
async fn a_busy_advisory_lock_is_waited_for_in_a_second_try_and_counted_once() {
    let Some(db) = servers::postgres("round_trips_busy").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session(&pool);
    // Another process holds the row's advisory lock (a session-level lock on a connection of
    // its own).
    let key = PgAdvisoryLock::key(&lock_name::<node::Entity>(1).expect("name"));
    let other = servers::connect(&db.url, db.schema.as_deref(), 1).await;
    let holder = sea_orm::Statement::from_string(
        sea_orm::DbBackend::Postgres,
        format!("SELECT pg_advisory_lock({key})"),
    );
    other.execute_raw(holder).await.expect("hold the lock");

    let writer = tokio::spawn(async move { increment(&session, 1).await });
    // The write's try in the reload failed; its second attempt waits in `pg_advisory_xact_lock`.
    let waiting = format!(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND ((classid::bigint << 32) | objid::bigint) = {key}"
    );
    until_waiting(&db, &waiting).await;
    let row = db.score(1).await;
    assert_eq!(
        row, None,
        "nothing written while the lock is held elsewhere"
    );
    let release = sea_orm::Statement::from_string(
        sea_orm::DbBackend::Postgres,
        format!("SELECT pg_advisory_unlock({key})"),
    );
    other.execute_raw(release).await.expect("release");

    updated_in_one_attempt(&writer.await.expect("writer"));
    assert_eq!(db.score(1).await, Some(1));
}

#[tokio::test]
async fn a_busy_lock_row_is_waited_for_in_a_second_try_and_counted_once() {
    let Some(db) = servers::postgres("round_trips_busy_row").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let session = session_with(&pool, Arc::new(RowLock::new(pool.clone())));
    // The first write makes the row's lock row (a statement of its own: there was none to try).
    increment(&session, 1).await;
    // Another transaction holds the lock row.
    let name = lock_name::<node::Entity>(1).expect("name");
    let other = servers::connect(&db.url, db.schema.as_deref(), 1).await;
    let holder = other.begin().await.expect("begin");
    let pid: i32 = holder
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT pg_backend_pid() AS pid",
        ))
        .await
        .expect("pid")
        .expect("a row")
        .try_get("", "pid")
        .expect("pid");
    let held = holder
        .query_one_raw(sea_orm::Statement::from_sql_and_values(
            sea_orm::DbBackend::Postgres,
            "SELECT name FROM freshlock_row_lock WHERE name = $1 FOR UPDATE",
            [name.as_str().into()],
        ))
        .await
        .expect("lock the lock row");
    assert!(held.is_some(), "the lock row exists");

    let writer = tokio::spawn(async move { increment(&session, 1).await });
    // The write's try in the reload skipped the held row; its second attempt waits for it (for
    // this holder: not any lock wait of the server).
    let waiting = format!(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE {pid} = ANY(pg_blocking_pids(pid))"
    );
    until_waiting(&db, &waiting).await;
    assert_eq!(
        db.score(1).await,
        Some(1),
        "nothing written while the lock row is held elsewhere"
    );
    holder.commit().await.expect("release");

    updated_in_one_attempt(&writer.await.expect("writer"));
    assert_eq!(db.score(1).await, Some(2));
}

/// An update of a missing row under a lock tried in the reload: the try cannot tell a busy lock
/// from a missing row, so a second try takes the lock with statements of its own and finds no
/// row either; one attempt, nothing written (and, for `row`, no lock row left behind: each call
/// tries again). For `table` the reload's `WITH` freed the lease in the rolled-back try: the
/// lease is still held in the second, which finds no row and retires it — no lease is left held.
#[tokio::test]
async fn a_folded_update_of_a_missing_row_is_not_found_once() {
    let Some(db) = servers::postgres("round_trips_missing").await else {
        return;
    };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let backends: [Arc<dyn LockBackend>; 3] = [
        Arc::new(PgAdvisoryLock::new()),
        Arc::new(RowLock::new(pool.clone())),
        Arc::new(TableLock::new(pool.clone())),
    ];
    for lock in backends {
        let session = session_with(&pool, lock);
        for _ in 0..2 {
            let report = session
                .repository::<node::Entity>()
                .locked_update(404, |n| {
                    n.score = Set(Some(1));
                    Ok(())
                })
                .await
                .expect("locked_update");
            assert!(matches!(report.outcome, UpdateOutcome::NotFound));
            assert_eq!(report.attempts, 1);
            assert!(report.lock.held && report.lock.release_error.is_none());
        }
    }
    assert!(db.all_nodes().await.is_empty());
    let leases = db
        .query_one("SELECT COUNT(*) AS n FROM freshlock_lock WHERE name <> ''")
        .await;
    let leases = leases.try_get::<i64>("", "n").expect("count");
    // (The row named '' is the fence floor a retired row raises: not a lease.)
    assert_eq!(leases, 0, "the missing key's lease row retired");
}

/// Runs `n` no-op jobs of kind `noop` (keyed by `key(i)` when it gives one) through a worker on
/// the proxied pool taking `batch` at a time, twice: the round trips of the second time (the
/// first prepares the statements).
async fn job_round_trips(
    db: &TestDb,
    pool: &DatabaseConnection,
    proxy: &Proxy,
    n: usize,
    batch: u32,
    key: impl Fn(usize) -> Option<String>,
) -> u32 {
    use freshlock::jobs::{self, Jobs, NewJob, RetryPolicy, Worker};
    let handlers = Jobs::new().handle(
        "noop",
        RetryPolicy::default(),
        jobs::handler(|_tx, _job: jobs::Job<u32>| Box::pin(async { Ok(()) })),
    );
    let worker = Worker::new(Session::new(pool.clone()), handlers).with_batch(batch);
    let mut sent = 0;
    for _ in 0..2 {
        for i in 0..n {
            let job = NewJob::new("noop", &0u32).unwrap();
            let job = match key(i) {
                Some(key) => job.key(key),
                None => job,
            };
            jobs::enqueue(&db.db, job).await.unwrap();
        }
        let before = proxy.round_trips();
        let mut ran = 0;
        while ran < n {
            let runs = worker.run_batch().await.unwrap();
            assert!(!runs.is_empty(), "{ran} of {n} ran");
            assert!(
                runs.iter()
                    .all(|r| r.outcome == jobs::JobOutcome::Completed)
            );
            ran += runs.len();
        }
        sent = proxy.round_trips() - before;
    }
    sent
}

/// Enqueues `n` jobs of `kind` keyed `hot` and runs them with `worker` until idle, twice: the
/// statements each time sent through `proxy`, and the second time's runs (the first prepares
/// the statements).
async fn hot_key_round_trips(
    db: &TestDb,
    proxy: &Proxy,
    worker: &freshlock::jobs::Worker,
    kind: &str,
    n: u32,
) -> (Vec<u32>, Vec<freshlock::jobs::JobRun>) {
    use freshlock::jobs::{self, NewJob};
    let (mut sent, mut last) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        for i in 0..n {
            let job = NewJob::new(kind, &i).unwrap().key("hot");
            jobs::enqueue(&db.db, job).await.unwrap();
        }
        let before = proxy.round_trips();
        last = worker.run_until_idle().await.unwrap();
        sent.push(proxy.round_trips() - before);
    }
    (sent, last)
}

/// A hot key's chain sends nothing between its jobs: 16 jobs of one key, run by a worker that
/// follows the key, lock the key's next jobs in one statement after the first job and complete
/// together — `BEGIN`, the take, the chain's take, the completion, `COMMIT` — where a chain
/// used to send a completion and a take per job (35 statements). A keyed job with nothing
/// behind it sends the four of any job.
#[tokio::test]
async fn a_hot_keys_chain_sends_nothing_between_its_jobs() {
    use freshlock::jobs::{self, Jobs, NewJob, RetryPolicy, Worker};
    let Some(db) = servers::postgres("round_trips_chain").await else {
        return;
    };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let handlers = Jobs::new().handle(
        "noop",
        RetryPolicy::default(),
        jobs::handler(|_tx, _job: jobs::Job<u32>| Box::pin(async { Ok(()) })),
    );
    let worker = Worker::new(Session::new(pool.clone()), handlers);
    let (sent, runs) = hot_key_round_trips(&db, &proxy, &worker, "noop", 16).await;
    assert_eq!(runs.len(), 16);
    // The second time (the first prepares the statements): the chain's five, then the last
    // look's three (and the sweep's one, when a second went by since the first time's). A
    // chain that a slow machine cut at its 100 ms goes on with a transaction of its own: five
    // more statements per cut.
    assert!(
        sent[1] >= 8 && (sent[1] - 8) % 5 <= 1,
        "{sent:?} statements for 16 jobs of one key"
    );
    assert!(sent[1] < 16, "{sent:?}: not a statement per job");
    // A keyed job with nothing queued behind it asks for no chain: still four statements.
    for i in 0..10u32 {
        let job = NewJob::new("noop", &i).unwrap().key(format!("k{i}"));
        jobs::enqueue(&db.db, job).await.unwrap();
    }
    let before = proxy.round_trips();
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 10);
    let alone = proxy.round_trips() - before;
    assert!(
        alone == 10 * 4 + 3 || alone == 10 * 4 + 4,
        "{alone} statements for 10 keyed jobs and the last look"
    );
}

/// A hot key's leased jobs: each finish completes its job under the claim (no look at the
/// claim first) and, in the same statement, readies the key's next job and claims it, so the
/// key's jobs send one transaction of three statements each — `BEGIN`, the completion,
/// `COMMIT` — instead of a take's four and a finish's four (and five while the next job's take
/// and claim were statements of their own).
#[tokio::test]
async fn a_hot_keys_leased_jobs_send_one_transaction_each() {
    use freshlock::jobs::{self, Job, Jobs, Lease, RetryPolicy, Worker};
    let Some(db) = servers::postgres("round_trips_leased_chain").await else {
        return;
    };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let handlers = Jobs::new().handle_leased(
        "render",
        RetryPolicy::default(),
        Duration::from_secs(30),
        |job: Job<u32>, _lease: Lease| async move { Ok(job.payload) },
        async |_tx: &freshlock::Tx, _job: Job<u32>, _: &u32| Ok(()),
    );
    let worker = Worker::new(Session::new(pool.clone()), handlers);
    let (sent, runs) = hot_key_round_trips(&db, &proxy, &worker, "render", 8).await;
    assert_eq!(runs.len(), 8);
    assert!(
        runs.iter()
            .all(|r| r.outcome == jobs::JobOutcome::Completed)
    );
    let ids: Vec<i64> = runs.iter().map(|r| r.id).collect();
    assert!(
        ids.windows(2).all(|pair| pair[0] < pair[1]),
        "each job once, in order"
    );
    // The second time: the first take's four, eight finishes of three (seven of them claim
    // the next job in their completion), then the last looks (three or four, and the sweep's
    // and the lease reclaim's one each when a second went by). A take and a finish per job
    // sent eight per job: 64; a take and a claim of their own in each finish, 45 to 48.
    let chained = 4 + 8 * 3;
    assert!(
        (chained + 3..=chained + 6).contains(&sent[1]),
        "{sent:?} statements for 8 leased jobs of one key"
    );
}

/// The statements of a job's run, as a guard on the queue's hot path: `BEGIN`, the take, the
/// completion (which also returns the commit's evidence) and `COMMIT` — the handler runs in the
/// job's transaction itself, with no `SAVEPOINT`/`RELEASE` pair; a keyed job readies its key's
/// next job in the completion's statement. A batch sends the same four for all its jobs.
#[tokio::test]
async fn a_job_sends_four_statements_keyed_or_not_and_a_batch_too() {
    let Some(db) = servers::postgres("round_trips_jobs").await else {
        return;
    };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy).await;
    let one = job_round_trips(&db, &pool, &proxy, 10, 1, |_| None).await;
    assert_eq!(one, 10 * 4, "keyless jobs, one at a time");
    let keyed = job_round_trips(&db, &pool, &proxy, 10, 1, |i| Some(format!("k{i}"))).await;
    assert_eq!(keyed, 10 * 4, "keyed jobs, one at a time");
    let batched = job_round_trips(&db, &pool, &proxy, 32, 8, |_| None).await;
    assert_eq!(batched, 4 * 4, "keyless jobs, 8 at a time");
    // An enqueue is one statement, keyed or not: the INSERT decides whether the job waits
    // behind its key itself.
    for round in 0..2 {
        let before = proxy.round_trips();
        for i in 0..10 {
            let job = freshlock::jobs::NewJob::new("noop", &0u32).unwrap();
            let job = if i % 2 == 0 { job.key("k") } else { job };
            freshlock::jobs::enqueue(&pool, job).await.unwrap();
        }
        if round == 1 {
            assert_eq!(proxy.round_trips() - before, 10, "ten enqueues");
        }
    }
}

/// On MySQL/MariaDB a job sends the same four as on PostgreSQL (on a pool at READ COMMITTED:
/// no `SET TRANSACTION`): `BEGIN`, the take, the completion with the commit marker's INSERT in
/// its message, `COMMIT` — the marker is not a statement of its own before `COMMIT`. A keyed
/// job's promotion of its key's next job is one more there (no `WITH … UPDATE`); a batch sends
/// the four for all its jobs.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_job_sends_four_statements_on_mysql_too() {
    let Some(db) = servers::mysql("round_trips_jobs").await else {
        return;
    };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied_with(&db, &proxy, |options| {
        freshlock::db::mysql_read_committed(options);
    })
    .await;
    let one = job_round_trips(&db, &pool, &proxy, 10, 1, |_| None).await;
    assert_eq!(one, 10 * 4, "keyless jobs, one at a time");
    let keyed = job_round_trips(&db, &pool, &proxy, 10, 1, |i| Some(format!("k{i}"))).await;
    assert_eq!(
        keyed,
        10 * 5,
        "keyed jobs, one at a time: the promotion too"
    );
    let batched = job_round_trips(&db, &pool, &proxy, 32, 8, |_| None).await;
    assert_eq!(batched, 4 * 4, "keyless jobs, 8 at a time");
    let markers = db
        .query_one("SELECT COUNT(*) AS n FROM freshlock_commit")
        .await
        .try_get::<i64>("", "n")
        .unwrap();
    assert!(
        markers >= 2 * (10 + 10 + 4),
        "every job transaction left its marker: {markers}"
    );
}

/// A lease whose fence lives in `freshlock_lock` (as `redis`'s does), told
/// through [`freshlock::lock::backend::Fencing::fence_row`], granted `behind` fences behind the stored one
/// (1: a grant that another holder has since overtaken). Its own check, a statement of its
/// own, is counted: a write whose reload checked the fence does not call it.
#[derive(Debug)]
struct StoredFence {
    behind: u64,
    checks: Arc<std::sync::atomic::AtomicU32>,
}

#[derive(Debug)]
struct StoredFenceGuard {
    name: String,
    fence: u64,
    checks: Arc<std::sync::atomic::AtomicU32>,
}

/// What the test lock's grant reads as the stored fence.
const STORED_FENCE: u64 = 5;

impl LockBackend for StoredFence {
    fn kind(&self) -> freshlock::LockKind {
        freshlock::LockKind::Other("stored_fence")
    }

    fn role(&self) -> freshlock::lock::backend::LockRole<'_> {
        freshlock::lock::backend::LockRole::Lease(self)
    }
}

#[async_trait::async_trait]
impl freshlock::lock::backend::LeaseLock for StoredFence {
    async fn acquire(
        &self,
        name: &freshlock::lock::LockName,
        _wait: Duration,
        _ttl: Duration,
    ) -> Result<Option<Box<dyn freshlock::lock::backend::LockGuard>>, freshlock::LockError> {
        Ok(Some(Box::new(StoredFenceGuard {
            name: name.as_str().to_owned(),
            fence: STORED_FENCE - self.behind,
            checks: Arc::clone(&self.checks),
        })))
    }
}

#[async_trait::async_trait]
impl freshlock::lock::backend::LockGuard for StoredFenceGuard {
    fn fencing(&self) -> Option<&dyn freshlock::lock::backend::Fencing> {
        Some(self)
    }

    async fn release(self: Box<Self>) -> Result<(), freshlock::LockError> {
        Ok(())
    }
}

#[async_trait::async_trait]
impl freshlock::lock::backend::Fencing for StoredFenceGuard {
    fn fence(&self) -> u64 {
        self.fence
    }

    async fn verify(
        &self,
        txn: &sea_orm::DatabaseTransaction,
    ) -> Result<bool, freshlock::LockError> {
        self.checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let backend = txn.get_database_backend();
        let sql = if backend == sea_orm::DbBackend::Postgres {
            "SELECT fence FROM freshlock_lock WHERE name = $1 AND fence = $2 FOR UPDATE"
        } else {
            "SELECT fence FROM freshlock_lock WHERE name = ? AND fence = ? FOR UPDATE"
        };
        let fence = i64::try_from(self.fence).expect("small");
        let check = sea_orm::Statement::from_sql_and_values(
            backend,
            sql,
            [self.name.clone().into(), fence.into()],
        );
        let row = txn
            .query_one_raw(check)
            .await
            .map_err(|e| freshlock::LockError::Backend {
                backend: "stored_fence",
                source: Box::new(e),
            })?;
        Ok(row.is_some())
    }

    fn fence_row(&self) -> Option<&str> {
        Some(&self.name)
    }
}

/// A lease whose fence row is in the database has its fence checked by the reload: a current
/// grant writes without a check of its own; one overtaken by a newer grant finds no row in
/// the reload, is checked by a statement of its own in a second try, and is refused —
/// `LeaseLost`, nothing written. A missing row is not found, once.
async fn a_fence_is_checked_by_the_reload(db: TestDb) {
    db.seed_nodes(1).await;
    let name = lock_name::<node::Entity>(1).expect("name");
    let insert = format!(
        "INSERT INTO freshlock_lock (name, fence, expires_at) VALUES ('{name}', {STORED_FENCE}, 0)"
    );
    db.db.execute_unprepared(&insert).await.expect("fence row");
    let checks = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let with = |behind| {
        let lock = StoredFence {
            behind,
            checks: Arc::clone(&checks),
        };
        session_with(&db.db, Arc::new(lock))
    };
    let checked = || checks.load(std::sync::atomic::Ordering::SeqCst);

    let current = with(0);
    for _ in 0..3 {
        updated_in_one_attempt(&increment(&current, 1).await);
    }
    assert_eq!(checked(), 0, "the reload checked the fence");
    assert_eq!(db.score(1).await, Some(3));

    let overtaken = with(1);
    let report = overtaken
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.score = Set(Some(100));
            Ok(())
        })
        .await
        .expect("locked_update");
    assert!(
        matches!(report.outcome, UpdateOutcome::LeaseLost),
        "{:?}",
        report.outcome
    );
    assert_eq!(checked(), 1, "the second try checked it by itself");
    assert_eq!(db.score(1).await, Some(3), "nothing written");

    let report = current
        .repository::<node::Entity>()
        .locked_update(404, |n| {
            n.score = Set(Some(1));
            Ok(())
        })
        .await
        .expect("locked_update");
    assert!(matches!(report.outcome, UpdateOutcome::NotFound));
    assert_eq!(report.attempts, 1);
    assert_eq!(db.all_nodes().await.len(), 1);
}

#[tokio::test]
async fn a_fence_is_checked_by_the_reload_postgres() {
    if let Some(db) = servers::postgres("round_trips_fence").await {
        a_fence_is_checked_by_the_reload(db).await;
    }
}

#[tokio::test]
async fn a_fence_is_checked_by_the_reload_mysql() {
    if let Some(db) = servers::mysql("round_trips_fence").await {
        a_fence_is_checked_by_the_reload(db).await;
    }
}

/// `row` on MySQL/MariaDB tries its lock row in the reload too (`FOR UPDATE SKIP LOCKED` in a
/// sub-select): a lock row held by another transaction is skipped, and the second try waits
/// for it with a statement of its own; one attempt. A missing row and a lock row not made yet
/// cannot be told apart by the try: not found, once, by the second.
#[tokio::test]
async fn a_busy_lock_row_is_waited_for_in_a_second_try_mysql() {
    let Some(db) = servers::mysql("round_trips_busy_row").await else {
        return;
    };
    db.seed_nodes(1).await;
    let pool = servers::connect(&db.url, None, 2).await;
    let session = session_with(&pool, Arc::new(RowLock::new(pool.clone())));
    // The first write makes the row's lock row (a statement of its own: there was none to try).
    updated_in_one_attempt(&increment(&session, 1).await);
    let name = lock_name::<node::Entity>(1).expect("name");
    let other = servers::connect(&db.url, None, 1).await;
    let holder = other.begin().await.expect("begin");
    let held = holder
        .query_one_raw(sea_orm::Statement::from_sql_and_values(
            sea_orm::DbBackend::MySql,
            "SELECT name FROM freshlock_row_lock WHERE name = ? FOR UPDATE",
            [name.as_str().into()],
        ))
        .await
        .expect("lock the lock row");
    assert!(held.is_some(), "the lock row exists");

    let writer = tokio::spawn(async move { increment(&session, 1).await });
    // The write's try in the reload skipped the held row; its second attempt waits for it in a
    // statement of its own (MariaDB lists a wait in a constant table's read in no lock view).
    let waiting = "SELECT COUNT(*) AS n FROM information_schema.PROCESSLIST \
        WHERE db = DATABASE() AND info = 'SELECT name FROM freshlock_row_lock WHERE name = ? FOR UPDATE'";
    until_waiting(&db, waiting).await;
    assert_eq!(
        db.score(1).await,
        Some(1),
        "nothing written while the lock row is held elsewhere"
    );
    holder.commit().await.expect("release");
    updated_in_one_attempt(&writer.await.expect("writer"));
    assert_eq!(db.score(1).await, Some(2));

    let session = session_with(&pool, Arc::new(RowLock::new(pool.clone())));
    for _ in 0..2 {
        let report = session
            .repository::<node::Entity>()
            .locked_update(404, |n| {
                n.score = Set(Some(1));
                Ok(())
            })
            .await
            .expect("locked_update");
        assert!(matches!(report.outcome, UpdateOutcome::NotFound));
        assert_eq!(report.attempts, 1);
    }
    assert_eq!(db.all_nodes().await.len(), 1);
}
