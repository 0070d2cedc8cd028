//! A silent partition: a TCP proxy forwards a `COMMIT` and then passes nothing more either way,
//! keeping both sockets open (no FIN, no RST), as a firewall or NAT that forgot the connection
//! does. Without a deadline the call waits for TCP keepalive (hours) and its section keeps the
//! row's lock, so every other call on the row waits out the lock policy and goes on without the
//! lock. With [`LockPolicy::reply_timeout`] the commit is in doubt after the bound, resolved by
//! its marker on another connection, and the key serves calls again.
//!
//! 4 tasks × 40 increments of one row, every 25th `COMMIT` black-holed, each backend on
//! PostgreSQL and MariaDB: acknowledged = the counter (± unknown), no call hangs, and no call
//! waited out the lock policy's 30 s behind a frozen key.
//!
//! The same for the statements a locked write sends besides the reload and the `UPDATE`: a
//! black-holed `DELETE` (`locked_delete`) and `INSERT` (`get_or_insert`, and a section's, whose
//! INSERT runs in a savepoint) give up after the bound and run again, and every row is as
//! acknowledged. So do a claim's and a finish's statements, and those of `finish_with`'s work.
//!
//! An operator's `jobs::discard` whose `UPDATE` is black-holed gives up after freshlock's
//! default bound (10 s) instead of waiting for TCP, and made again discards the job once.
//!
//! A guarded `save` whose `UPDATE` is black-holed gives up after the bound too: in doubt on
//! PostgreSQL (its UPDATE is its own commit: `CommitUnknown`), transient on MySQL/MariaDB (its
//! transaction never committed), and the row holds what was acknowledged.

mod common;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::LockName;
use freshlock::{
    DeleteOutcome, Error, LockBackend, LockKind, LockPolicy, OnLockFailure, Repository,
    SectionOutcome, Session, UpdateReport, lock_name, section_work,
};
use proxy::{CutAfter, Proxy, idle_transactions_end};
use sea_orm::DatabaseConnection;
use sea_orm::Set;
use servers::{TestDb, databases};

const TASKS: u32 = 4;
const ROUNDS: u32 = 40;
/// The bound on one reply, far below the lock policy's wait.
const REPLY: Duration = Duration::from_secs(1);
/// The lock policy's wait: what a call behind a frozen key would wait out.
const WAIT: Duration = Duration::from_secs(30);

/// A pool's options through `proxy` to `db`, and its URL.
fn through(proxy: &Proxy, db: &TestDb) -> (sea_orm::ConnectOptions, String) {
    let url = proxy.url(&db.url);
    let mut options = sea_orm::ConnectOptions::new(&url);
    // Each black-holed connection keeps its pool slot (see the library's deadline docs).
    options
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options.set_schema_search_path(schema);
    }
    (options, url)
}

/// `options` with no prepared-statement cache: every statement crosses with its text.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused_mut))]
fn uncached(mut options: sea_orm::ConnectOptions) -> sea_orm::ConnectOptions {
    #[cfg(feature = "postgres")]
    options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0));
    #[cfg(feature = "mysql")]
    options.map_sqlx_mysql_opts(|o| o.statement_cache_capacity(0));
    options
}

/// A session on `db` locking with `backend` under `policy`.
fn session(db: &DatabaseConnection, backend: &Arc<dyn LockBackend>, policy: LockPolicy) -> Session {
    Session::builder(db.clone())
        .lock(Arc::clone(backend))
        .policy(policy)
        .build()
        .unwrap()
}

/// `locked_update` adding 1 to row `id`'s score, which must be acknowledged as an update within
/// 25 s (it never hangs).
async fn increment(
    nodes: &Repository<node::Entity>,
    id: i32,
    what: &str,
) -> UpdateReport<node::Model> {
    let call = nodes.locked_update(id, |n| {
        n.score = Set(Some(n.score.as_ref().unwrap_or(0) + 1));
        Ok(())
    });
    let report = tokio::time::timeout(Duration::from_secs(25), call)
        .await
        .unwrap_or_else(|_| panic!("{what}: a call hung on a black-holed reply"))
        .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    assert!(report.outcome.is_updated(), "{what}: {:?}", report.outcome);
    report
}

/// One try of the lock, waiting up to [`WAIT`]; each reply bounded by `reply`.
fn policy(reply: Duration) -> LockPolicy {
    LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(WAIT)
        .with_ttl(Duration::from_secs(30))
        .with_reply_timeout(reply)
}

async fn black_holed_commits(db: Option<TestDb>, kind: LockKind) {
    black_holed_commits_with(db, kind, false).await;
}

/// The same with each `locked_update` in two flights (`local`): the black-holed message is the
/// UPDATE's and its `COMMIT`'s, resolved by the transaction id its reload read (PostgreSQL) or
/// the marker it carried (MariaDB).
async fn black_holed_commits_in_two_flights(db: Option<TestDb>, kind: LockKind) {
    black_holed_commits_with(db, kind, true).await;
}

async fn black_holed_commits_with(db: Option<TestDb>, kind: LockKind, two_flights: bool) {
    let Some(db) = db else { return };
    let redis = match kind {
        LockKind::Redis => match servers::url(servers::REDIS) {
            Some(redis) => Some(redis),
            None => return,
        },
        _ => None,
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let (options, url) = through(&proxy, &db);
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = kind
        .connect(&proxied, &url, redis.as_deref())
        .await
        .unwrap();
    proxy.black_hole(true);
    proxy.cut_every(25);

    let (acknowledged, unknown, slowest_ms) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let policy = policy(REPLY).with_on_failure(OnLockFailure::Proceed);
            let session = Session::builder(proxied.clone())
                .lock(Arc::clone(&backend))
                .policy(policy)
                .two_flights(two_flights)
                .build()
                .unwrap();
            let (acknowledged, unknown, slowest_ms) = (
                Arc::clone(&acknowledged),
                Arc::clone(&unknown),
                Arc::clone(&slowest_ms),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                for _ in 0..ROUNDS {
                    let started = tokio::time::Instant::now();
                    let call = nodes.locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    let result = tokio::time::timeout(Duration::from_secs(25), call)
                        .await
                        .expect("no call hangs on a black-holed reply");
                    let took = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
                    slowest_ms.fetch_max(took, Ordering::SeqCst);
                    match result {
                        Ok(report) => {
                            assert!(report.outcome.is_updated(), "{:?}", report.outcome);
                            // Held, or refused by a lease grant that itself met the black
                            // hole (redis bumps its fence in the database) after its own bound:
                            // never after waiting out the policy's 30 s behind a frozen key.
                            assert!(
                                report.lock.held || report.lock.waited < WAIT,
                                "a call waited out the lock policy: the key was frozen ({report:?})"
                            );
                            acknowledged.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(error) => panic!("{kind}: unexpected failure {error:?}"),
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let (acknowledged, unknown) = (
        acknowledged.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
    );
    let counter = db.score(1).await.unwrap_or(0) as u32;
    let slowest = slowest_ms.load(Ordering::SeqCst);
    eprintln!(
        "{kind}: {} black-holed commits, {acknowledged} acknowledged, {unknown} unknown, \
         counter {counter}, slowest call {slowest} ms",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 2, "the proxy black-holed commits");
    assert!(
        acknowledged <= counter && counter <= acknowledged + unknown,
        "{kind}: counter {counter} outside [{acknowledged}, {}]",
        acknowledged + unknown
    );
}

/// Rows written by the black-holed deletes and inserts.
const ROWS: i32 = 24;
/// Their reply bound: longer than the server's idle-transaction timeout below, so that the
/// abandoned transaction is gone when the write runs again.
const WRITE_REPLY: Duration = Duration::from_secs(2);

/// A black-holed `DELETE` (`cut` = [`CutAfter::NodeDelete`], through `locked_delete`) or
/// `INSERT` (`NodeInsert`, through `get_or_insert`), every 5th: the write's statement reached
/// the server (which ran it, and holds its row locked in a transaction nobody ends) and no
/// reply ever comes. The write's deadline gives up on it, the attempt runs again on another
/// connection, and — once the server ended the abandoned transaction, as its idle-transaction
/// timeout does (`idle_in_transaction_session_timeout`, MariaDB's `idle_transaction_timeout`:
/// what `deadline.rs` tells users to set) — goes through. Every call is acknowledged within
/// the bound, never after waiting out a frozen key, and the rows are exactly what was
/// acknowledged: each deleted row gone, each inserted row there once.
async fn black_holed_writes(db: Option<TestDb>, kind: LockKind, cut: CutAfter, in_section: bool) {
    let Some(db) = db else { return };
    let deleting = cut == CutAfter::NodeDelete;
    if deleting {
        db.seed_nodes(ROWS).await;
    }
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let (options, url) = through(&proxy, &db);
    // Every statement carries its text (no prepared-statement cache), so every write can be
    // matched; the server ends a transaction left idle for a second.
    let options = idle_transactions_end(uncached(options));
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = kind.connect(&proxied, &url, None).await.unwrap();
    proxy.black_hole(true);
    proxy.cut_every(5);

    let slowest_ms = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let session = session(&proxied, &backend, policy(WRITE_REPLY));
            let slowest_ms = Arc::clone(&slowest_ms);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                let mine = (1..=ROWS).filter(|id| id.rem_euclid(TASKS as i32) == task as i32);
                for id in mine {
                    let started = tokio::time::Instant::now();
                    let hang = Duration::from_secs(25);
                    if deleting {
                        let report = tokio::time::timeout(hang, nodes.locked_delete(id))
                            .await
                            .expect("no delete hangs on a black-holed reply")
                            .unwrap_or_else(|e| panic!("{kind}: delete {id} failed: {e:?}"));
                        assert!(
                            matches!(report.outcome, DeleteOutcome::Deleted(_)),
                            "{kind}: {report:?}"
                        );
                        assert!(report.lock.held, "{kind}: {report:?}");
                    } else if in_section {
                        let key = lock_name::<node::Entity>(id).unwrap();
                        let insert = section_work(move |tx| {
                            Box::pin(async move {
                                let nodes = tx.repository::<node::Entity>();
                                Ok(nodes.get_or_insert(id, || node::ActiveModel::fresh(id)).await?)
                            })
                        });
                        let report = tokio::time::timeout(
                            hang,
                            session.section([key]).run_retrying(insert),
                        )
                        .await
                        .expect("no section hangs on a black-holed reply")
                        .unwrap_or_else(|e| panic!("{kind}: insert {id} failed: {e:?}"));
                        assert!(
                            matches!(&report.outcome, SectionOutcome::Committed(freshlock::GetOutcome::Created(m)) if m.id == id),
                            "{kind}: {report:?}"
                        );
                    } else {
                        let insert = nodes.get_or_insert(id, || node::ActiveModel::fresh(id));
                        let got = tokio::time::timeout(hang, insert)
                            .await
                            .expect("no insert hangs on a black-holed reply")
                            .unwrap_or_else(|e| panic!("{kind}: insert {id} failed: {e:?}"));
                        assert!(
                            matches!(&got, freshlock::GetOutcome::Created(m) if m.id == id),
                            "{kind}: {got:?}"
                        );
                    }
                    let took = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
                    slowest_ms.fetch_max(took, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let mut left: Vec<i32> = db.all_nodes().await.into_iter().map(|n| n.id).collect();
    left.sort_unstable();
    let slowest = slowest_ms.load(Ordering::SeqCst);
    eprintln!(
        "{kind} {cut:?}: {} black-holed, rows left {}, slowest call {slowest} ms",
        proxy.cuts(),
        left.len()
    );
    assert!(proxy.cuts() >= 2, "the proxy black-holed writes");
    if deleting {
        assert_eq!(left, Vec::<i32>::new(), "{kind}: every acknowledged delete");
    } else {
        assert_eq!(
            left,
            (1..=ROWS).collect::<Vec<_>>(),
            "{kind}: each insert once"
        );
    }
    // Each black-holed write waited out its bound, not the lock policy's wait.
    assert!(
        u64::from(slowest) < WAIT.as_millis() as u64,
        "{kind}: {slowest} ms"
    );
}

async fn black_holed_deletes(db: Option<TestDb>, kind: LockKind) {
    black_holed_writes(db, kind, CutAfter::NodeDelete, false).await;
}

async fn black_holed_inserts(db: Option<TestDb>, kind: LockKind) {
    black_holed_writes(db, kind, CutAfter::NodeInsert, false).await;
}

/// A section's `get_or_insert` (its INSERT in a savepoint of the section's transaction).
async fn black_holed_section_inserts(db: Option<TestDb>, kind: LockKind) {
    black_holed_writes(db, kind, CutAfter::NodeInsert, true).await;
}

/// A guarded `save` (no lock, one statement; on MySQL/MariaDB a transaction of its own) whose
/// `UPDATE` gets no reply: the call ends after the reply bound, in doubt where the UPDATE was its
/// own commit (PostgreSQL) and transient where it was not (MySQL/MariaDB, whose transaction the
/// server ends); saved again on a fresh read, the row holds each acknowledged write once.
async fn black_holed_saves(db: Option<TestDb>, _kind: LockKind) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::NodeUpdate).await;
    let (options, _) = through(&proxy, &db);
    let proxied = sea_orm::Database::connect(idle_transactions_end(uncached(options)))
        .await
        .unwrap();
    let backend: Arc<dyn LockBackend> = Arc::new(freshlock::lock::LocalLock::new());
    let session = session(&proxied, &backend, policy(REPLY));
    let nodes = session.repository::<node::Entity>();
    let bump = |n: &node::Model| {
        let mut draft = sea_orm::IntoActiveModel::into_active_model(n.clone());
        draft.score = Set(Some(n.score.unwrap_or(0) + 1));
        draft
    };
    proxy.black_hole(true);
    proxy.cut_once();
    let loaded = nodes.load(1).await.unwrap().unwrap();
    let started = tokio::time::Instant::now();
    let first = tokio::time::timeout(Duration::from_secs(25), nodes.save(bump(&loaded)))
        .await
        .expect("a save does not hang on a black-holed reply");
    let took = started.elapsed();
    assert_eq!(proxy.cuts(), 1, "the UPDATE was black-holed");
    assert!(
        took < Duration::from_secs(10),
        "gave up after the bound: {took:?}"
    );
    let in_doubt = match first {
        Err(Error::CommitUnknown { .. }) => true,
        Err(e) if e.is_transient() => false,
        other => panic!("a black-holed save fails as in doubt or transient: {other:?}"),
    };
    let backend_kind = proxied.get_database_backend();
    assert_eq!(
        in_doubt,
        backend_kind == sea_orm::DbBackend::Postgres,
        "in doubt only where the UPDATE was its own commit ({backend_kind:?})"
    );
    // Where it was not its own commit, the server ends its transaction: nothing was written.
    // In doubt, either (here the proxy held back the UPDATE's execute, so it did not run).
    let fresh = nodes.load_fresh(1).await.unwrap().unwrap();
    let before = fresh.score.unwrap_or(0);
    assert!(
        before == 0 || (in_doubt && before == 1),
        "the failed save left {before}"
    );
    let saved = nodes.save(bump(&fresh)).await.unwrap();
    assert!(
        matches!(saved, freshlock::SaveOutcome::Updated(_)),
        "{saved:?}"
    );
    let stored = db.all_nodes().await;
    assert_eq!(
        stored[0].score.unwrap_or(0),
        before + 1,
        "each acknowledged save once"
    );
}

/// `mysql_named` holds its lock on a connection of its own, outside the write's transaction: a
/// grant (`GET_LOCK`) or a release (`RELEASE_LOCK`) whose reply never comes, once. The grant
/// gives up after its wait and a reply's bound, the release after the bound; either closes its
/// connection (so the server frees the names) and the call goes on — unlocked after a lost
/// grant (`Proceed`), acknowledged with a release error after a lost release. No call hangs,
/// every call is acknowledged, and the counter holds each acknowledged increment once.
async fn black_holed_lock_connection(db: Option<TestDb>, cut: CutAfter) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let (options, url) = through(&proxy, &db);
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = LockKind::MySqlNamed
        .connect(&proxied, &url, None)
        .await
        .unwrap();
    proxy.black_hole(true);
    proxy.cut_once();
    const CALLS: u32 = 10;
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            // A try waits 2 s; a reply's bound is a third of the TTL (1 s).
            let policy = LockPolicy::default()
                .with_lock_tries(10)
                .with_wait_per_try(Duration::from_secs(2))
                .with_ttl(Duration::from_secs(3))
                .with_on_failure(OnLockFailure::Proceed)
                .with_reply_timeout(REPLY);
            let session = session(&proxied, &backend, policy);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                let (mut unlocked, mut unreleased) = (0, 0);
                for _ in 0..CALLS {
                    let report = increment(&nodes, 1, "mysql_named").await;
                    unlocked += u32::from(!report.lock.held);
                    unreleased += u32::from(report.lock.release_error.is_some());
                }
                (unlocked, unreleased)
            })
        })
        .collect();
    let (mut unlocked, mut unreleased) = (0, 0);
    for task in tasks {
        let (u, r) = task.await.unwrap();
        (unlocked, unreleased) = (unlocked + u, unreleased + r);
    }
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "mysql_named {cut:?}: {} black-holed, {unlocked} calls unlocked, {unreleased} releases \
         failed, counter {counter}",
        proxy.cuts()
    );
    assert_eq!(
        proxy.cuts(),
        1,
        "the proxy black-holed the lock's connection once"
    );
    assert_eq!(counter, 2 * CALLS, "every call acknowledged, each once");
    match cut {
        CutAfter::GetLock => assert!(unlocked >= 1, "the lost grant's call went on unlocked"),
        _ => assert_eq!(unreleased, 1, "the lost release is reported"),
    }
}

/// A transaction-scoped lock (`row`) taken by statements of its own — as it is the first time
/// a name is used, before its lock row exists — whose lock-wait setting (sent before the lock
/// statement, and on MySQL/MariaDB reset after it) gets no reply, every 5th: the lock gives up
/// after its wait and a reply's bound, its transaction's rollback after a bound too, and the
/// call goes on unlocked (`Proceed`). Every row gains exactly its one acknowledged increment.
async fn black_holed_lock_statements(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    db.seed_nodes(ROWS).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::LockWait).await;
    let (options, url) = through(&proxy, &db);
    // Every statement carries its text: the PostgreSQL setting is a bound statement.
    let options = uncached(options);
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = kind.connect(&proxied, &url, None).await.unwrap();
    proxy.black_hole(true);
    proxy.cut_every(5);
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let policy = LockPolicy::default()
                .with_lock_tries(1)
                .with_wait_per_try(Duration::from_secs(2))
                .with_on_failure(OnLockFailure::Proceed)
                .with_reply_timeout(REPLY);
            let session = session(&proxied, &backend, policy);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                let mut unlocked = 0;
                let mine = (1..=ROWS).filter(|id| id.rem_euclid(TASKS as i32) == task as i32);
                for id in mine {
                    let report = increment(&nodes, id, kind.as_str()).await;
                    unlocked += u32::from(!report.lock.held);
                }
                unlocked
            })
        })
        .collect();
    let mut unlocked = 0;
    for task in tasks {
        unlocked += task.await.unwrap();
    }
    let scores: Vec<_> = db.all_nodes().await.into_iter().map(|n| n.score).collect();
    eprintln!(
        "{kind} lock statements: {} black-holed, {unlocked} calls unlocked",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 2, "the proxy black-holed lock statements");
    assert!(
        unlocked >= 1,
        "a call whose lock got no reply went on unlocked"
    );
    assert_eq!(scores.len(), ROWS as usize);
    assert!(
        scores.iter().all(|score| *score == Some(1)),
        "{kind}: each row gained its one acknowledged increment: {scores:?}"
    );
}

/// Claims through a proxy cutting after `cut`, each reply bounded by [`REPLY`], on a pool whose
/// sessions the server ends after a second idle in a transaction.
async fn proxied_claims(db: &TestDb, cut: CutAfter) -> (Proxy, Claims) {
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let (options, _) = through(&proxy, db);
    let proxied = sea_orm::Database::connect(idle_transactions_end(uncached(options)))
        .await
        .unwrap();
    (proxy, Claims::new(proxied).with_reply_timeout(REPLY))
}

/// The claims' table holds one claim, done.
async fn one_claim_done(db: &TestDb) {
    let row = db
        .query_one("SELECT COUNT(*) AS n, MIN(state) AS state FROM freshlock_claim")
        .await;
    let (rows, state) = (
        row.try_get::<i64>("", "n").unwrap(),
        row.try_get::<String>("", "state").unwrap(),
    );
    assert_eq!((rows, state.as_str()), (1, "done"));
}

/// A claim's statement, then a finish's, whose reply never comes: each call fails within the
/// claims' reply bound (1 s here) as transient (nothing was committed), the server ends the abandoned
/// transaction (its idle-transaction timeout), and the call made again claims, then finishes:
/// one claim, done once.
async fn black_holed_claims(db: Option<TestDb>, _kind: LockKind) {
    claims_through(db, CutAfter::Claim).await;
}

/// A claim, then a finish, each with one message after `cut` black-holed; each made again.
async fn claims_through(db: Option<TestDb>, cut: CutAfter) {
    let Some(db) = db else { return };
    let (proxy, claims) = proxied_claims(&db, cut).await;
    let key = LockName::new("ham:7").unwrap();
    let hang = Duration::from_secs(25);
    proxy.black_hole(true);
    proxy.cut_once();
    let lost = tokio::time::timeout(hang, claims.claim(&key, Duration::from_secs(60)))
        .await
        .unwrap_or_else(|_| panic!("no claim hangs on a black-holed reply ({cut:?})"));
    assert!(
        matches!(&lost, Err(e) if e.is_transient()),
        "a claim without reply is transient: {lost:?}"
    );
    let claimed = tokio::time::timeout(hang, claims.claim(&key, Duration::from_secs(60)))
        .await
        .expect("the claim made again does not hang")
        .unwrap();
    let ClaimOutcome::Claimed(claim) = claimed else {
        panic!("the claim made again claims: {claimed:?}");
    };
    proxy.cut_once();
    let lost = tokio::time::timeout(hang, claims.finish(&claim))
        .await
        .unwrap_or_else(|_| panic!("no finish hangs on a black-holed reply ({cut:?})"));
    assert!(
        matches!(&lost, Err(e) if e.is_transient()),
        "a finish without reply is transient: {lost:?}"
    );
    let finished = tokio::time::timeout(hang, claims.finish(&claim))
        .await
        .expect("the finish made again does not hang")
        .unwrap();
    assert_eq!(finished, FinishOutcome::Finished);
    assert_eq!(proxy.cuts(), 2);
    one_claim_done(&db).await;
}

/// A claim's `BEGIN`, then a finish's, whose reply never comes: as [`black_holed_claims`] (the
/// `BEGIN` ends in a task of its own).
async fn black_holed_claim_begins(db: Option<TestDb>, _kind: LockKind) {
    claims_through(db, CutAfter::Begin).await;
}

/// The work of `finish_with` whose statement's reply never comes: the finish fails within the
/// claims' reply bound as transient, its silent connection is dropped (no rollback waits on
/// it), the server ends the abandoned transaction, and the finish made again commits the work
/// once with the claim.
async fn black_holed_finish_work(db: Option<TestDb>, _kind: LockKind) {
    use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, sea_query::Expr};

    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (proxy, claims) = proxied_claims(&db, CutAfter::NodeUpdate).await;
    let key = LockName::new("node:1").unwrap();
    let hang = Duration::from_secs(25);
    let ClaimOutcome::Claimed(claim) = claims.claim(&key, Duration::from_secs(60)).await.unwrap()
    else {
        panic!("claimed");
    };
    let finish = || {
        claims.finish_with(&claim, |txn| {
            Box::pin(async move {
                node::Entity::update_many()
                    .col_expr(node::Column::Score, Expr::cust("COALESCE(score, 0) + 1"))
                    .filter(node::Column::Id.eq(1))
                    .exec(txn)
                    .await?;
                Ok(())
            })
        })
    };
    proxy.black_hole(true);
    proxy.cut_once();
    let started = std::time::Instant::now();
    let lost = tokio::time::timeout(hang, finish())
        .await
        .expect("no finish hangs on its work's black-holed reply");
    eprintln!(
        "black-holed finish work: {lost:?} after {:?}",
        started.elapsed()
    );
    assert!(
        matches!(&lost, Err(e @ Error::Database { .. }) if e.is_transient()),
        "a finish whose work got no reply is transient: {lost:?}"
    );
    let finished = tokio::time::timeout(hang, finish())
        .await
        .expect("the finish made again does not hang")
        .unwrap();
    assert_eq!(finished, FinishOutcome::Finished);
    assert_eq!(proxy.cuts(), 1);
    let scores: Vec<_> = db.all_nodes().await.into_iter().map(|n| n.score).collect();
    assert_eq!(
        scores,
        [Some(1)],
        "the work committed once, with the finish"
    );
    one_claim_done(&db).await;
}

/// The writers' sweep of old commit markers (run by the write that commits a process's
/// 1,024th marker, with the write's lock still held; MySQL/MariaDB, where every locked write
/// commits with a marker — on PostgreSQL it commits with its transaction id) whose reply never
/// comes: the sweep gives up
/// after the reply bound, the write is acknowledged, and the key serves the next call. The count
/// is process-wide (other tests of this binary may write markers in the same process): the
/// test writes until its own proxy saw the sweep.
async fn black_holed_marker_sweep(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::MarkerSweep).await;
    let (options, url) = through(&proxy, &db);
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = kind.connect(&proxied, &url, None).await.unwrap();
    let nodes = session(&proxied, &backend, policy(REPLY)).repository::<node::Entity>();
    proxy.black_hole(true);
    proxy.cut_once();
    let mut acknowledged = 0;
    // Two sweeps' worth, and the other tests' markers: the sweep comes well before.
    while proxy.cuts() == 0 && acknowledged < 4 * 1024 {
        increment(&nodes, 1, "the sweeping write").await;
        acknowledged += 1;
    }
    // One more call on the key after the sweep: it is free.
    increment(&nodes, 1, "the write after the sweep").await;
    acknowledged += 1;
    eprintln!("marker sweep black-holed after {acknowledged} writes");
    assert_eq!(proxy.cuts(), 1, "the sweep's statement was black-holed");
    let scores: Vec<_> = db.all_nodes().await.into_iter().map(|n| n.score).collect();
    assert_eq!(
        scores,
        [Some(acknowledged)],
        "every write acknowledged, once"
    );
}

async fn black_holed_grants(db: Option<TestDb>, _kind: LockKind) {
    black_holed_lock_connection(db, CutAfter::GetLock).await;
}

async fn black_holed_releases(db: Option<TestDb>, _kind: LockKind) {
    black_holed_lock_connection(db, CutAfter::ReleaseLock).await;
}

/// `jobs::discard` whose `UPDATE`'s reply never comes: the call fails within freshlock's
/// default reply bound (10 s) as transient instead of hanging, the server ends the abandoned
/// transaction, and the call made again discards the job: discarded once.
async fn black_holed_job_admin(db: Option<TestDb>, _kind: LockKind) {
    let Some(db) = db else { return };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::JobUpdate).await;
    let (options, _) = through(&proxy, &db);
    let proxied = sea_orm::Database::connect(idle_transactions_end(uncached(options)))
        .await
        .unwrap();
    let job = freshlock::jobs::NewJob::new("admin", &()).unwrap();
    let freshlock::jobs::Enqueued::Added(id) = freshlock::jobs::enqueue(&db.db, job).await.unwrap()
    else {
        panic!("the job is added");
    };
    proxy.black_hole(true);
    proxy.cut_once();
    let hang = Duration::from_secs(25);
    let lost = tokio::time::timeout(hang, freshlock::jobs::discard(&proxied, id))
        .await
        .expect("a discard does not hang on a black-holed reply");
    assert!(
        matches!(&lost, Err(e) if e.is_transient()),
        "a discard without reply is transient: {lost:?}"
    );
    let again = tokio::time::timeout(hang, freshlock::jobs::discard(&proxied, id))
        .await
        .expect("the discard made again does not hang")
        .unwrap();
    assert!(again, "the discard made again discards the job");
    assert_eq!(proxy.cuts(), 1);
    let row = db
        .query_one("SELECT COUNT(*) AS n FROM freshlock_job WHERE state = 4")
        .await;
    assert_eq!(row.try_get::<i64>("", "n").unwrap(), 1, "discarded once");
}

servers::server_tests! {
    black_hole_local_postgres: black_holed_commits, LockKind::Local, postgres;
    black_hole_row_postgres: black_holed_commits, LockKind::Row, postgres;
    black_hole_two_flights_postgres: black_holed_commits_in_two_flights, LockKind::Local, postgres;
    black_hole_two_flights_mysql: black_holed_commits_in_two_flights, LockKind::Local, mysql;
    black_hole_pg_advisory_postgres: black_holed_commits, LockKind::PgAdvisory, postgres;
    black_hole_table_postgres: black_holed_commits, LockKind::Table, postgres;
    black_hole_local_mysql: black_holed_commits, LockKind::Local, mysql;
    black_hole_row_mysql: black_holed_commits, LockKind::Row, mysql;
    black_hole_table_mysql: black_holed_commits, LockKind::Table, mysql;
    black_hole_mysql_named_mysql: black_holed_commits, LockKind::MySqlNamed, mysql;
    black_hole_delete_local_postgres: black_holed_deletes, LockKind::Local, postgres;
    black_hole_delete_row_postgres: black_holed_deletes, LockKind::Row, postgres;
    black_hole_delete_local_mysql: black_holed_deletes, LockKind::Local, mysql;
    black_hole_delete_table_mysql: black_holed_deletes, LockKind::Table, mysql;
    black_hole_insert_local_postgres: black_holed_inserts, LockKind::Local, postgres;
    black_hole_insert_local_mysql: black_holed_inserts, LockKind::Local, mysql;
    black_hole_section_insert_local_postgres: black_holed_section_inserts, LockKind::Local, postgres;
    black_hole_section_insert_table_mysql: black_holed_section_inserts, LockKind::Table, mysql;
    black_hole_lock_statement_row_postgres: black_holed_lock_statements, LockKind::Row, postgres;
    black_hole_lock_statement_row_mysql: black_holed_lock_statements, LockKind::Row, mysql;
    black_hole_claims_postgres: black_holed_claims, LockKind::Local, postgres;
    black_hole_claims_mysql: black_holed_claims, LockKind::Local, mysql;
    black_hole_claim_begin_postgres: black_holed_claim_begins, LockKind::Local, postgres;
    black_hole_claim_begin_mysql: black_holed_claim_begins, LockKind::Local, mysql;
    black_hole_finish_work_postgres: black_holed_finish_work, LockKind::Local, postgres;
    black_hole_finish_work_mysql: black_holed_finish_work, LockKind::Local, mysql;
    black_hole_marker_sweep_mysql: black_holed_marker_sweep, LockKind::Local, mysql;
    black_hole_grant_mysql_named_mysql: black_holed_grants, LockKind::MySqlNamed, mysql;
    black_hole_release_mysql_named_mysql: black_holed_releases, LockKind::MySqlNamed, mysql;
    black_hole_save_postgres: black_holed_saves, LockKind::Local, postgres;
    black_hole_save_mysql: black_holed_saves, LockKind::Local, mysql;
    black_hole_job_admin_postgres: black_holed_job_admin, LockKind::Local, postgres;
    black_hole_job_admin_mysql: black_holed_job_admin, LockKind::Local, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    black_hole_redis_postgres: black_holed_commits, LockKind::Redis, postgres;
}
