//! Commit combining ([`freshlock::SessionBuilder::combine_commits`]): the waiters of one hot row
//! are served by the holder's transaction.
//!
//! Every scenario parks 16 `locked_update`s of one account behind a locked section that holds
//! the row's lock, waits until all 16 are seated (`Session::in_flight`, counted after a seat is
//! taken), then lets go: the first of them becomes the holder and serves the 15 others in one
//! commit. Task `i` adds `2^i` to the balance, so the balance says exactly which changes were
//! committed, whatever the order they were served in.
//!
//! - 16 writers, waiters 3 and 9 fail in `apply`: exactly the other 14 changes are committed, in
//!   one commit of 14 (every report says `batch == 14`), on SQLite, PostgreSQL and MariaDB, with
//!   the `local` backend and with a cross-process one (`row`, `table`).
//! - A panicking `apply` and a writer dropped before its turn contribute nothing; the others
//!   commit and are reported once.
//! - Acknowledged writes are counted against the row, and each session's cache holds the
//!   committed row.
//! - A failing `before_save` of one waiter: it gets its error, the batch runs again without it.
//! - A waiter whose `before_save` wrote in the transaction and then failed gets its error, and
//!   the batch runs again without it: its audit row is not committed, every other writer's is,
//!   once.
//! - 40 writers: the batch is bounded — one commit of 32 (the holder and the 31 longest
//!   seated), then one of the 8 left; all 40 committed once.
//! - Without `combine_commits`, the same 16 writers commit one by one (`batch == 1`).
//! - The same with each write in two flights (`SessionBuilder::two_flights`, PostgreSQL and
//!   MariaDB): 14 of 16 in one commit, a failing hook, a panic and a cancel.
//! - 16 writers with a session each, each given the same `table` backend in an `Arc` of its own
//!   (a clone of the backend: its in-process queue comes with it): one commit of 16. Two
//!   backend instances are two queues: 8 writers behind each never share a commit.
//! - 16 writers with a session each, built the usual way (`Session::builder(&db)
//!   .combine_commits(true).build()` from one `Db`, the process-wide lock by default, so each
//!   session holds it in an `Arc` of its own): one commit of 16, on SQLite, PostgreSQL and
//!   MariaDB. Sessions of two `Db` handles never share a commit.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use entity::account;
use freshlock::lock::{LocalLock, LockName};
use freshlock::{
    ApplyError, Db, Error, LockBackend, LockKind, SectionOutcome, Session, UpdateOutcome, lock_name,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, Set, Statement};
use servers::{TestDb, databases};
use tokio::{sync::oneshot, task::JoinHandle};

const WRITERS: usize = 16;

/// A user's entity whose `before_save` writes an audit row through the transaction, then refuses
/// the draft whose note is `writer-4`.
mod tally {
    use sea_orm::{ActiveValue, entity::prelude::*};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "tally")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub total: i64,
        pub note: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn before_save<C: ConnectionTrait>(
            self,
            db: &C,
            _insert: bool,
        ) -> Result<Self, DbErr> {
            let note = match &self.note {
                ActiveValue::Set(note) | ActiveValue::Unchanged(note) => note.clone(),
                ActiveValue::NotSet => String::new(),
            };
            db.execute_unprepared(&format!("INSERT INTO tally_audit (note) VALUES ('{note}')"))
                .await?;
            if note == "writer-4" {
                return Err(DbErr::Custom("writer 4 is refused by before_save".into()));
            }
            Ok(self)
        }
    }
}

/// Polls `condition` until it holds; fails the test after 20 s instead of hanging.
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn seed(db: &DatabaseConnection) {
    account::Entity::insert(account::ActiveModel {
        id: Set(1),
        balance: Set(0),
    })
    .exec(db)
    .await
    .expect("seed");
}

async fn balance(db: &DatabaseConnection) -> i64 {
    account::Entity::find_by_id(1)
        .one(db)
        .await
        .expect("query")
        .expect("row")
        .balance
}

/// The backend of `kind`; `local` gets a lock space of its own (tests run in parallel).
async fn backend(kind: LockKind, test: &TestDb) -> Arc<dyn LockBackend> {
    if kind == LockKind::Local {
        return Arc::new(LocalLock::new());
    }
    kind.connect(&test.db, &test.url, None)
        .await
        .expect("lock backend")
}

fn combining(db: &DatabaseConnection, lock: &Arc<dyn LockBackend>, on: bool) -> Session {
    combining_in(db, lock, on, false)
}

/// [`combining`], each write in two flights when `two_flights` (PostgreSQL).
fn combining_in(
    db: &DatabaseConnection,
    lock: &Arc<dyn LockBackend>,
    on: bool,
    two_flights: bool,
) -> Session {
    Session::builder(db.clone())
        .lock(Arc::clone(lock))
        .combine_commits(on)
        .two_flights(two_flights)
        .build()
        .expect("session")
}

/// A scenario's lock backend, and whether its writes go in two flights.
#[derive(Clone, Copy, Debug)]
struct How {
    kind: LockKind,
    two_flights: bool,
}

impl From<LockKind> for How {
    fn from(kind: LockKind) -> Self {
        Self {
            kind,
            two_flights: false,
        }
    }
}

/// `kind`, each write in two flights.
const fn two_flights(kind: LockKind) -> How {
    How {
        kind,
        two_flights: true,
    }
}

/// What a writer does in `apply`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writer {
    Adds,
    Fails,
}

/// Holds the row's lock in a section until the returned sender fires (or is dropped).
async fn hold(session: &Session, key: LockName) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (release, released) = oneshot::channel::<()>();
    let (held, is_held) = oneshot::channel::<()>();
    let session = session.clone();
    let holder = tokio::spawn(async move {
        let report = session
            .with_lock(&key, move |_tx| {
                Box::pin(async move {
                    let _ = held.send(());
                    let _ = released.await;
                    Ok(())
                })
            })
            .await
            .expect("blocking section");
        assert!(matches!(report.outcome, SectionOutcome::Committed(())));
    });
    is_held.await.expect("the blocking section runs");
    (release, holder)
}

/// One task per writer, writer `i` in `sessions[i]`: it adds `2^i` to account 1's balance (or
/// fails in `apply`).
fn spawn_writers(
    sessions: &[Session],
    writers: &[Writer],
) -> Vec<JoinHandle<freshlock::Result<freshlock::UpdateReport<account::Model>>>> {
    sessions
        .iter()
        .zip(writers)
        .enumerate()
        .map(|(i, (session, writer))| {
            let (session, writer) = (session.clone(), *writer);
            tokio::spawn(async move {
                session
                    .repository::<account::Entity>()
                    .locked_update(1, move |row| {
                        if writer == Writer::Fails {
                            return Err(ApplyError::msg("refused"));
                        }
                        let balance = *row.balance.as_ref();
                        row.balance = Set(balance + (1 << i));
                        Ok(())
                    })
                    .await
            })
        })
        .collect()
}

/// Parks `writers` behind a held lock, lets go, and returns each writer's result, in task order.
async fn park_and_release(
    db: &DatabaseConnection,
    lock: &Arc<dyn LockBackend>,
    combine: bool,
    two_flights: bool,
    writers: &[Writer],
) -> (
    Session,
    Vec<std::thread::Result<freshlock::Result<freshlock::UpdateReport<account::Model>>>>,
) {
    let blocker = combining(db, lock, false);
    let (release, holder) = hold(&blocker, lock_name::<account::Entity>(1).expect("key")).await;
    let session = combining_in(db, lock, combine, two_flights);
    let tasks = spawn_writers(&vec![session.clone(); writers.len()], writers);
    eventually("every writer is seated", || {
        session.in_flight() == writers.len()
    })
    .await;
    release.send(()).expect("blocker waits");
    holder.await.expect("blocker");
    let mut results = Vec::new();
    for task in tasks {
        results.push(match task.await {
            Ok(result) => Ok(result),
            Err(e) => Err(e.into_panic()),
        });
    }
    (session, results)
}

/// 16 writers, 3 and 9 fail: the other 14 commit together, each acknowledged once.
async fn fourteen_of_sixteen(db: Option<TestDb>, how: impl Into<How>) {
    let Some(test) = db else { return };
    let How { kind, two_flights } = how.into();
    let db = &test.db;
    seed(db).await;
    let lock = backend(kind, &test).await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|i| {
            if i == 3 || i == 9 {
                Writer::Fails
            } else {
                Writer::Adds
            }
        })
        .collect();
    let (session, results) = park_and_release(db, &lock, true, two_flights, &writers).await;

    let mut acknowledged = 0;
    let mut expected = 0_i64;
    for (i, result) in results.into_iter().enumerate() {
        let result = result.expect("no writer panics");
        if i == 3 || i == 9 {
            assert!(
                matches!(result, Err(Error::Apply { .. })),
                "writer {i}: {result:?}"
            );
            continue;
        }
        let report = result.unwrap_or_else(|e| panic!("writer {i}: {e}"));
        assert!(
            matches!(report.outcome, UpdateOutcome::Updated(_)),
            "writer {i}: {:?}",
            report.outcome
        );
        assert_eq!(report.batch, 14, "writer {i} shared one commit of 14");
        assert!(report.lock.held);
        acknowledged += 1;
        expected += 1 << i;
    }
    assert_eq!(acknowledged, 14);
    let stored = balance(db).await;
    assert_eq!(
        stored, expected,
        "exactly the 14 acknowledged changes, once each"
    );
    // The session caches the committed row.
    let cached = session
        .repository::<account::Entity>()
        .load(1)
        .await
        .expect("load")
        .expect("row");
    assert_eq!(cached.balance, stored);
}

/// A panicking `apply` and a writer dropped before its turn contribute nothing.
async fn panic_and_cancel(db: Option<TestDb>, how: impl Into<How>) {
    let Some(test) = db else { return };
    let How { kind, two_flights } = how.into();
    let db = &test.db;
    seed(db).await;
    let lock = backend(kind, &test).await;
    let blocker = combining(db, &lock, false);
    let (release, holder) = hold(&blocker, lock_name::<account::Entity>(1).expect("key")).await;
    let session = combining_in(db, &lock, true, two_flights);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let session = session.clone();
        tasks.push(tokio::spawn(async move {
            session
                .repository::<account::Entity>()
                .locked_update(1, move |row| {
                    assert!(i != 5, "writer 5 panics");
                    let balance = *row.balance.as_ref();
                    row.balance = Set(balance + (1 << i));
                    Ok(())
                })
                .await
        }));
    }
    eventually("every writer is seated", || session.in_flight() == 8).await;
    // Writer 2 is dropped while seated (its section goes on in a task of its own, which finds
    // its caller gone whether it is served or gets the lock).
    tasks[2].abort();
    let dropped = (&mut tasks[2]).await;
    assert!(dropped.is_err_and(|e| e.is_cancelled()));
    release.send(()).expect("blocker waits");
    holder.await.expect("blocker");
    let mut expected = 0_i64;
    let mut panics = 0;
    let mut batches = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        if i == 2 {
            continue; // Awaited above.
        }
        match (i, task.await) {
            (5, Err(e)) => {
                assert!(e.is_panic());
                panics += 1;
            }
            (_, Ok(Ok(report))) => {
                assert!(report.outcome.is_updated());
                batches.push(report.batch);
                expected += 1 << i;
            }
            (i, other) => panic!("writer {i}: {other:?}"),
        }
    }
    assert_eq!(panics, 1, "the panic happened and reached its caller");
    assert_eq!(batches, vec![6; 6], "one commit of the 6 writers left");
    assert_eq!(balance(db).await, expected);
    eventually("every section ended", || session.in_flight() == 0).await;
}

/// Without combining, each writer commits alone.
async fn one_by_one(db: Option<TestDb>, kind: LockKind) {
    let Some(test) = db else { return };
    let db = &test.db;
    seed(db).await;
    let lock = backend(kind, &test).await;
    let (_, results) = park_and_release(db, &lock, false, false, &[Writer::Adds; WRITERS]).await;
    for result in results {
        assert_eq!(result.expect("no panic").expect("written").batch, 1);
    }
    assert_eq!(balance(db).await, (1 << WRITERS) - 1);
}

/// Writer 4's `before_save` writes its audit row, then fails: it alone gets the error, and the
/// audit holds exactly the 15 committed writers' rows.
async fn failing_hook(db: Option<TestDb>, how: impl Into<How>) {
    let Some(test) = db else { return };
    let How { kind, two_flights } = how.into();
    let db = &test.db;
    for ddl in [
        "CREATE TABLE tally (id integer PRIMARY KEY, total bigint NOT NULL, note varchar(32) NOT NULL)",
        "CREATE TABLE tally_audit (note varchar(32) NOT NULL)",
    ] {
        db.execute_unprepared(ddl).await.expect("create table");
    }
    tally::Entity::insert(tally::ActiveModel {
        id: Set(1),
        total: Set(0),
        note: Set(String::new()),
    })
    .exec(db)
    .await
    .expect("seed");
    let lock = backend(kind, &test).await;
    let blocker = combining(db, &lock, false);
    let (release, holder) = hold(&blocker, lock_name::<tally::Entity>(1).expect("key")).await;
    let session = combining_in(db, &lock, true, two_flights);
    let tasks: Vec<_> = (0..WRITERS)
        .map(|i| {
            let session = session.clone();
            tokio::spawn(async move {
                session
                    .repository::<tally::Entity>()
                    .locked_update(1, move |row| {
                        let total = *row.total.as_ref();
                        row.total = Set(total + (1 << i));
                        row.note = Set(format!("writer-{i}"));
                        Ok(())
                    })
                    .await
            })
        })
        .collect();
    eventually("every writer is seated", || session.in_flight() == WRITERS).await;
    release.send(()).expect("blocker waits");
    holder.await.expect("blocker");
    let mut expected = 0_i64;
    for (i, task) in tasks.into_iter().enumerate() {
        match (i, task.await.expect("no panic")) {
            (4, Err(Error::Database { .. })) => {}
            (_, Ok(report)) if i != 4 => {
                assert!(report.outcome.is_updated());
                expected += 1 << i;
            }
            (i, other) => panic!("writer {i}: {other:?}"),
        }
    }
    let row = tally::Entity::find_by_id(1)
        .one(db)
        .await
        .expect("query")
        .expect("row");
    assert_eq!(row.total, expected);
    let audit: Vec<String> = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT note FROM tally_audit ORDER BY note",
        ))
        .await
        .expect("audit")
        .iter()
        .map(|row| row.try_get::<String>("", "note").expect("note"))
        .collect();
    let mut committed: Vec<String> = (0..WRITERS)
        .filter(|i| *i != 4)
        .map(|i| format!("writer-{i}"))
        .collect();
    committed.sort();
    assert_eq!(
        audit, committed,
        "each committed writer's hook ran once in the committed batch"
    );
}

/// 40 writers: batches of at most 32, the rest served by the next holder; nothing lost.
async fn bounded_batches(db: Option<TestDb>, kind: LockKind) {
    let Some(test) = db else { return };
    let db = &test.db;
    seed(db).await;
    let lock = backend(kind, &test).await;
    let (_, results) = park_and_release(db, &lock, true, false, &[Writer::Adds; 40]).await;
    let mut batches: Vec<u32> = results
        .into_iter()
        .map(|result| result.expect("no panic").expect("written").batch)
        .collect();
    batches.sort_unstable();
    let expected: Vec<u32> = [vec![8; 8], vec![32; 32]].concat();
    assert_eq!(
        batches, expected,
        "one commit of 32, then one of the 8 left"
    );
    assert_eq!(balance(db).await, (1_i64 << 40) - 1, "all 40, once each");
}

/// 16 writers, each with a session of its own on one pool and the default lock: one commit.
async fn a_session_each(db: Option<TestDb>, _: ()) {
    let Some(test) = db else { return };
    // One `Db` kept as the application keeps its pool; a session per writer made from it.
    let shared = Db::new(test.db.clone());
    let batches = writers_each_in(&test.db, |_| {
        Session::builder(&shared)
            .combine_commits(true)
            .build()
            .expect("session")
    })
    .await;
    assert!(
        batches.iter().all(|batch| *batch == WRITERS as u32),
        "sessions of their own share one commit: {batches:?}"
    );
}

/// 16 sessions, writer `i` in `session(i)`, parked behind a held lock and let go. Returns each
/// writer's batch.
async fn writers_each_in(db: &DatabaseConnection, session: impl Fn(usize) -> Session) -> Vec<u32> {
    seed(db).await;
    let (release, holder) = hold(&session(0), lock_name::<account::Entity>(1).expect("key")).await;
    let sessions: Vec<Session> = (0..WRITERS).map(session).collect();
    let tasks = spawn_writers(&sessions, &[Writer::Adds; WRITERS]);
    eventually("every writer is seated", || {
        sessions.iter().map(Session::in_flight).sum::<usize>() == WRITERS
    })
    .await;
    release.send(()).expect("blocker waits");
    holder.await.expect("blocker");
    let mut batches = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        let report = task
            .await
            .expect("no panic")
            .unwrap_or_else(|e| panic!("writer {i}: {e}"));
        assert!(report.outcome.is_updated(), "writer {i}");
        batches.push(report.batch);
    }
    assert_eq!(
        balance(db).await,
        (1_i64 << WRITERS) - 1,
        "all 16, once each"
    );
    batches
}

/// Sessions of one `Db`, writer `i` given `backends[i % backends.len()]` in an `Arc` of its own.
async fn backend_per_session(
    db: &DatabaseConnection,
    backends: &[freshlock::lock::TableLock],
) -> Vec<u32> {
    let shared = Db::new(db.clone());
    writers_each_in(db, |i| {
        Session::builder(&shared)
            .lock(Arc::new(backends[i % backends.len()].clone()))
            .combine_commits(true)
            .build()
            .expect("session")
    })
    .await
}

/// One backend, cloned into an `Arc` per session: one queue, so one commit of 16.
async fn a_backend_clone_each(db: Option<TestDb>, _: ()) {
    let Some(test) = db else { return };
    let table = freshlock::lock::TableLock::new(test.db.clone());
    let batches = backend_per_session(&test.db, &[table]).await;
    assert!(
        batches.iter().all(|batch| *batch == WRITERS as u32),
        "clones of one backend share its queue and combine: {batches:?}"
    );
}

/// Two backend instances on one database: two queues, whose writers never share a commit.
async fn two_backends(db: Option<TestDb>, _: ()) {
    let Some(test) = db else { return };
    let (a, b) = (
        freshlock::lock::TableLock::new(test.db.clone()),
        freshlock::lock::TableLock::new(test.db.clone()),
    );
    let batches = backend_per_session(&test.db, &[a, b]).await;
    assert!(
        batches.iter().all(|batch| *batch <= (WRITERS / 2) as u32),
        "writers of two backends never share a commit: {batches:?}"
    );
}

/// Two `Db` handles (each a pool to freshlock) with one lock space: their writers exclude each
/// other, and never share a room, so never a commit.
async fn two_handles(db: Option<TestDb>, _: ()) {
    let Some(test) = db else { return };
    let handles = [Db::new(test.db.clone()), Db::new(test.db.clone())];
    let lock: Arc<dyn LockBackend> = Arc::new(LocalLock::new());
    let batches = writers_each_in(&test.db, |i| {
        Session::builder(&handles[i % 2])
            .lock(Arc::clone(&lock))
            .combine_commits(true)
            .build()
            .expect("session")
    })
    .await;
    assert!(
        batches.iter().all(|batch| *batch <= (WRITERS / 2) as u32),
        "writers of two handles never share a room: {batches:?}"
    );
}

servers::server_tests! {
    backend_clone_each_sqlite: a_backend_clone_each, (), sqlite;
    backend_clone_each_postgres: a_backend_clone_each, (), postgres;
    two_backends_sqlite: two_backends, (), sqlite;
    two_backends_mysql: two_backends, (), mysql;
    two_handles_sqlite: two_handles, (), sqlite;
    two_handles_postgres: two_handles, (), postgres;
}

servers::server_tests! {
    session_each_sqlite: a_session_each, (), sqlite;
    session_each_postgres: a_session_each, (), postgres;
    session_each_mysql: a_session_each, (), mysql;
}

servers::server_tests! {
    bounded_sqlite: bounded_batches, LockKind::Local, sqlite;
    hook_sqlite: failing_hook, LockKind::Local, sqlite;
    hook_postgres: failing_hook, LockKind::Row, postgres;
    hook_mysql: failing_hook, LockKind::Local, mysql;
    fourteen_sqlite_local: fourteen_of_sixteen, LockKind::Local, sqlite;
    fourteen_sqlite_table: fourteen_of_sixteen, LockKind::Table, sqlite;
    fourteen_postgres_local: fourteen_of_sixteen, LockKind::Local, postgres;
    fourteen_postgres_row: fourteen_of_sixteen, LockKind::Row, postgres;
    fourteen_postgres_advisory: fourteen_of_sixteen, LockKind::PgAdvisory, postgres;
    fourteen_postgres_two_flights_local: fourteen_of_sixteen, two_flights(LockKind::Local), postgres;
    fourteen_postgres_two_flights_advisory: fourteen_of_sixteen, two_flights(LockKind::PgAdvisory), postgres;
    hook_postgres_two_flights: failing_hook, two_flights(LockKind::Local), postgres;
    panic_cancel_postgres_two_flights: panic_and_cancel, two_flights(LockKind::Row), postgres;
    fourteen_mysql_two_flights_local: fourteen_of_sixteen, two_flights(LockKind::Local), mysql;
    hook_mysql_two_flights: failing_hook, two_flights(LockKind::Local), mysql;
    fourteen_mysql_local: fourteen_of_sixteen, LockKind::Local, mysql;
    fourteen_mysql_named: fourteen_of_sixteen, LockKind::MySqlNamed, mysql;
    panic_cancel_sqlite: panic_and_cancel, LockKind::Local, sqlite;
    panic_cancel_postgres: panic_and_cancel, LockKind::Row, postgres;
    panic_cancel_mysql: panic_and_cancel, LockKind::Local, mysql;
    alone_sqlite: one_by_one, LockKind::Local, sqlite;
}
