//! The contract every lock backend passes, on every database it supports.
//!
//! SQLite (a file) runs everywhere; PostgreSQL, MariaDB and Redis run when their URLs are set
//! (`.ci/run` sets them and requires them).

#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use freshlock::lock::LockName;
use freshlock::lock::backend::{LockGuard, LockScope};
use freshlock::{LockBackend, LockKind};
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbBackend, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};
use servers::TestDb;
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(30);
/// A hang guard, not a speed target: an operation that should return at once must not block.
const HANG: Duration = Duration::from_secs(10);

/// A held lock of either scope.
enum Held {
    Lease(Box<dyn LockGuard>),
    Txn(DatabaseTransaction),
}

impl Held {
    async fn release(self) {
        match self {
            Held::Lease(guard) => guard.release().await.expect("release"),
            Held::Txn(txn) => txn.commit().await.expect("commit"),
        }
    }
}

struct Subject {
    backend: Arc<dyn LockBackend>,
    db: DatabaseConnection,
    prefix: String,
}

impl Subject {
    fn name(&self, suffix: &str) -> LockName {
        LockName::new(format!("{}:{suffix}", self.prefix)).expect("valid name")
    }

    async fn take(&self, name: &LockName, wait: Duration, ttl: Duration) -> Option<Held> {
        match self.backend.scope() {
            LockScope::Lease => self
                .backend
                .acquire(name, wait, ttl)
                .await
                .expect("acquire")
                .map(Held::Lease),
            _ => {
                let options = if self.db.get_database_backend() == DbBackend::Sqlite {
                    TransactionOptions {
                        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                        ..Default::default()
                    }
                } else {
                    TransactionOptions::default()
                };
                let txn = self.db.begin_with_options(options).await.expect("begin");
                let locked = self
                    .backend
                    .lock_in_transaction(&txn, name, wait)
                    .await
                    .expect("lock in transaction");
                if locked {
                    Some(Held::Txn(txn))
                } else {
                    txn.rollback().await.ok();
                    None
                }
            }
        }
    }

    /// SQLite's row "lock" is BEGIN IMMEDIATE: its waits are SQLite's busy timeout, not ours.
    fn waits_are_ours(&self) -> bool {
        !(self.backend.scope() == LockScope::Transaction
            && self.db.get_database_backend() == DbBackend::Sqlite)
    }

    fn has_ttl(&self) -> bool {
        matches!(self.backend.kind(), LockKind::Table | LockKind::Redis)
    }

    fn has_fence(&self) -> bool {
        matches!(
            self.backend.kind(),
            LockKind::Table | LockKind::Redis | LockKind::MySqlNamed
        )
    }
}

async fn mutual_exclusion(subject: &Arc<Subject>) {
    let name = subject.name("exclusion");
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (subject, name) = (Arc::clone(subject), name.clone());
            let (inside, entries) = (Arc::clone(&inside), Arc::clone(&entries));
            tokio::spawn(async move {
                for _ in 0..10 {
                    let held = subject
                        .take(&name, Duration::from_secs(60), TTL)
                        .await
                        .expect("taken within a minute");
                    assert!(
                        !inside.swap(true, Ordering::SeqCst),
                        "two holders inside at once"
                    );
                    entries.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    held.release().await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    assert_eq!(entries.load(Ordering::SeqCst), 40);
}

async fn try_does_not_wait_and_budget_is_honoured(subject: &Subject) {
    if !subject.waits_are_ours() {
        return;
    }
    let name = subject.name("budget");
    let held = subject
        .take(&name, Duration::ZERO, TTL)
        .await
        .expect("free");
    let other = Subject {
        backend: Arc::clone(&subject.backend),
        db: subject.db.clone(),
        prefix: subject.prefix.clone(),
    };
    let tried = tokio::time::timeout(HANG, other.take(&name, Duration::ZERO, TTL)).await;
    assert!(
        matches!(tried, Ok(None)),
        "a try on a held lock returns None at once"
    );
    let budget = Duration::from_millis(300);
    let started = Instant::now();
    let waited = tokio::time::timeout(HANG, other.take(&name, budget, TTL)).await;
    assert!(matches!(waited, Ok(None)));
    assert!(
        started.elapsed() >= budget,
        "gave up before the budget: {:?}",
        started.elapsed()
    );
    held.release().await;
}

async fn release_then_reacquire(subject: &Subject) {
    let name = subject.name("again");
    for _ in 0..3 {
        let held = subject
            .take(&name, Duration::ZERO, TTL)
            .await
            .expect("free after release");
        held.release().await;
    }
}

async fn expiry_lets_the_next_holder_in_and_only_the_owner_releases(subject: &Subject) {
    if !subject.has_ttl() {
        return;
    }
    let name = subject.name("expiry");
    let Some(Held::Lease(stale)) = subject
        .take(&name, Duration::ZERO, Duration::from_millis(200))
        .await
    else {
        panic!("lease expected");
    };
    let Some(Held::Lease(fresh)) = subject.take(&name, Duration::from_secs(5), TTL).await else {
        panic!("the expired lease lets the next holder in");
    };
    assert!(fresh.fence() > stale.fence(), "fences grow");
    assert!(
        !stale.extend(TTL).await.expect("extend"),
        "the stale holder cannot extend"
    );
    stale.release().await.expect("release is harmless");
    assert!(
        subject.take(&name, Duration::ZERO, TTL).await.is_none(),
        "the stale holder's release did not free the new holder's lease"
    );
    assert!(
        fresh.extend(TTL).await.expect("extend"),
        "the owner can extend"
    );
    fresh.release().await.expect("release");
}

async fn fences_strictly_increase(subject: &Subject) {
    if !subject.has_fence() {
        return;
    }
    let name = subject.name("fence");
    let mut last = 0;
    for _ in 0..5 {
        let Some(Held::Lease(guard)) = subject.take(&name, Duration::ZERO, TTL).await else {
            panic!("lease expected");
        };
        let mut fence = guard.fence().expect("a fence");
        if fence == 0 {
            // Issued by the check of the write's transaction (`mysql_named`): a checked
            // transaction that commits has it.
            let txn = subject.db.begin().await.expect("begin");
            assert!(guard.verify(&txn).await.expect("verify"), "still held");
            txn.commit().await.expect("commit");
            fence = guard.fence().expect("a fence");
        }
        assert!(fence > last, "{fence} after {last}");
        last = fence;
        guard.release().await.expect("release");
    }
}

async fn odd_names_work(subject: &Subject) {
    let long = "x".repeat(300);
    let suffixes = [
        "it's \"quoted\"".to_owned(),
        "with spaces and ; semicolons".to_owned(),
        "ロック 🔒 Ünïcode".to_owned(),
        format!("{long}a"),
        format!("{long}b"),
    ];
    // Held all at once: distinct names (even the long ones sharing a prefix) do not collide.
    let mut held = Vec::new();
    for suffix in &suffixes {
        let name = subject.name(suffix);
        if subject.backend.scope() == LockScope::Transaction
            && subject.db.get_database_backend() == DbBackend::Sqlite
        {
            // One write transaction at a time on SQLite: take and release one by one.
            subject
                .take(&name, Duration::ZERO, TTL)
                .await
                .expect("odd name")
                .release()
                .await;
            continue;
        }
        held.push(
            subject
                .take(&name, Duration::ZERO, TTL)
                .await
                .expect("odd name"),
        );
    }
    for h in held {
        h.release().await;
    }
}

async fn contract(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    let backend = kind
        .connect(&db.handle, &db.url, redis.as_deref())
        .await
        .expect("backend");
    let subject = Arc::new(Subject {
        backend,
        db: db.db.clone(),
        prefix: servers::unique(kind.as_str()),
    });
    mutual_exclusion(&subject).await;
    try_does_not_wait_and_budget_is_honoured(&subject).await;
    release_then_reacquire(&subject).await;
    expiry_lets_the_next_holder_in_and_only_the_owner_releases(&subject).await;
    fences_strictly_increase(&subject).await;
    odd_names_work(&subject).await;
}

use servers::databases;

servers::server_tests! {
    local_on_sqlite: contract, LockKind::Local, sqlite;
    table_on_sqlite: contract, LockKind::Table, sqlite;
    row_on_sqlite: contract, LockKind::Row, sqlite;
    table_on_postgres: contract, LockKind::Table, postgres;
    row_on_postgres: contract, LockKind::Row, postgres;
    pg_advisory_on_postgres: contract, LockKind::PgAdvisory, postgres;
    table_on_mysql: contract, LockKind::Table, mysql;
    row_on_mysql: contract, LockKind::Row, mysql;
    mysql_named_on_mysql: contract, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    redis_with_sqlite_fences: contract, LockKind::Redis, sqlite;
    redis_with_postgres_fences: contract, LockKind::Redis, postgres;
    redis_with_mysql_fences: contract, LockKind::Redis, mysql;
}

/// A `mysql_named` lock on a fresh database, and the name it is tested with.
#[cfg(feature = "mysql")]
struct Named {
    db: TestDb,
    name: LockName,
    lock: freshlock::lock::MySqlNamedLock,
}

#[cfg(feature = "mysql")]
impl Named {
    async fn start(tag: &str) -> Option<Self> {
        let db = servers::mysql(tag).await?;
        let database = db.url.rsplit('/').next().unwrap_or_default().to_owned();
        let name = LockName::new(format!("{database}/{tag}")).unwrap();
        let locks = servers::connect(&db.url, None, 3).await;
        let lock = freshlock::lock::MySqlNamedLock::new(locks).unwrap();
        Some(Self { db, name, lock })
    }

    async fn grant(&self, wait: Duration) -> Option<Box<dyn LockGuard>> {
        freshlock::lock::backend::LeaseLock::acquire(&self.lock, &self.name, wait, TTL)
            .await
            .unwrap()
    }

    /// The first column of `sql`'s row, an integer, with the name for each `?`.
    async fn scalar(&self, sql: &str) -> i64 {
        use sea_orm::ConnectionTrait;
        let values = vec![self.name.as_str().into(); sql.matches('?').count()];
        let statement = sea_orm::Statement::from_sql_and_values(DbBackend::MySql, sql, values);
        let row = self.db.db.query_one_raw(statement).await.unwrap().unwrap();
        row.try_get_by_index::<i64>(0).unwrap()
    }

    /// The server ends the session holding the name (as it ends a killed or partitioned
    /// client's), and frees its locks.
    async fn kill_holder(&self) {
        use sea_orm::ConnectionTrait;
        let owner = self.scalar("SELECT IS_USED_LOCK(?)").await;
        self.db
            .db
            .execute_unprepared(&format!("KILL CONNECTION {owner}"))
            .await
            .unwrap();
        self.until(
            "SELECT IS_USED_LOCK(?) IS NULL",
            "the holder's locks were freed",
        )
        .await;
    }

    /// Polls `sql` (with the name for each `?`) until it is not 0.
    async fn until(&self, sql: &str, what: &str) {
        let mut polls = 0;
        while self.scalar(sql).await == 0 {
            polls += 1;
            assert!(polls < 3000, "never: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A statement of another connection that is running now, seen in the process list (MariaDB
/// lists a wait in a constant table's read in no lock view).
#[cfg(feature = "mysql")]
fn running(info: &str) -> String {
    format!(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE info LIKE '{info}%' \
         AND id <> CONNECTION_ID()"
    )
}

/// `mysql_named` writes nothing at a grant: each transaction it protects bumps the name's fence
/// when checked, only while the grant's connection still holds its locks, and keeps the fence
/// row locked until it ends. When that connection dies (the holder's session killed) after the
/// check, the next grant of the name is had at once but waits, in its own reply, for the
/// checked transaction to end — so its holder reads nothing that transaction had not committed
/// — and the lost grant's next check is refused.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_lost_named_lock_is_fenced_out_and_its_successor_waits_mysql() {
    let Some(named) = Named::start("lost_named_lock").await else {
        return;
    };
    let db = &named.db;
    let fence_rows = "SELECT COUNT(*) FROM freshlock_lock WHERE name = ?";
    let lost = named.grant(Duration::ZERO).await.expect("free");
    assert_eq!(
        lost.fence(),
        Some(0),
        "no fence before a checked transaction"
    );
    assert_eq!(named.scalar(fence_rows).await, 0, "a grant writes nothing");

    let checked = db.db.begin().await.unwrap();
    assert!(lost.verify(&checked).await.unwrap(), "held");
    let first = lost.fence().expect("a fence");
    assert!(first > 0);
    named.kill_holder().await;

    let successor = {
        let (lock, name) = (named.lock.clone(), named.name.clone());
        tokio::spawn(async move {
            freshlock::lock::backend::LeaseLock::acquire(&lock, &name, Duration::from_secs(30), TTL)
                .await
        })
    };
    // Its grant waits in the read of the fence row the checked transaction holds.
    let waiting = running("SELECT fence FROM freshlock_lock WHERE name = CONVERT(");
    named
        .until(&waiting, "the successor's grant waited for the fence row")
        .await;
    assert!(
        !successor.is_finished(),
        "granted while the checked transaction runs"
    );
    checked.commit().await.unwrap();
    let successor = successor
        .await
        .unwrap()
        .unwrap()
        .expect("granted once the transaction ended");

    let txn = db.db.begin().await.unwrap();
    assert!(
        !lost.verify(&txn).await.unwrap(),
        "the lost grant's next check is refused"
    );
    txn.rollback().await.unwrap();
    assert_eq!(lost.fence(), Some(first), "a refused check issues no fence");
    let txn = db.db.begin().await.unwrap();
    assert!(
        successor.verify(&txn).await.unwrap(),
        "the successor holds it"
    );
    txn.commit().await.unwrap();
    assert!(successor.fence().expect("a fence") > first, "fences grow");
    successor.release().await.unwrap();
    // Its connection is gone: the release reports it (or finds nothing to release).
    let _ = lost.release().await;

    // A write reports the fence its own transaction was given, the one stored.
    db.seed_nodes(1).await;
    let session = freshlock::Session::builder(&db.handle)
        .lock(Arc::new(named.lock.clone()))
        .build()
        .unwrap();
    let report = session
        .repository::<entity::node::Entity>()
        .locked_update(1, |n| {
            n.title = sea_orm::Set("fenced".into());
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());
    let row = freshlock::lock_name::<entity::node::Entity>(1).unwrap();
    let stored = Named { name: row, ..named }
        .scalar("SELECT fence FROM freshlock_lock WHERE name = ?")
        .await;
    assert_eq!(report.lock.fence, Some(stored as u64));
}

/// `LockKind::connect`'s `mysql_named` pool does not ping a connection when it hands it out (a
/// round trip per grant): a grant whose pooled connection died while it idled (the server
/// killed it, as a restart or `wait_timeout` does) is asked again on another, and granted.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_dead_pooled_lock_connection_does_not_fail_a_grant_mysql() {
    use sea_orm::ConnectionTrait;

    let Some(db) = servers::mysql("dead_lock_connection").await else {
        return;
    };
    let tag = db.url.rsplit('/').next().unwrap_or_default().to_owned();
    let backend = LockKind::MySqlNamed
        .connect(&db.handle, &db.url, None)
        .await
        .unwrap();
    let names: Vec<_> = (0..3)
        .map(|i| LockName::new(format!("{tag}/dead{i}")).unwrap())
        .collect();
    // Three connections in the lock pool, idle.
    let mut held = Vec::new();
    for name in &names {
        held.push(
            backend
                .acquire(name, Duration::ZERO, TTL)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    for guard in held {
        guard.release().await.unwrap();
    }
    // The server ends every idle connection to this test's database (the lock pool's three
    // among them).
    let idle = format!(
        "SELECT id FROM information_schema.PROCESSLIST WHERE db = '{tag}' \
         AND command = 'Sleep' AND id <> CONNECTION_ID()"
    );
    let admin = servers::connect(&db.url, None, 1).await;
    let ids = admin
        .query_all_raw(sea_orm::Statement::from_string(DbBackend::MySql, idle))
        .await
        .unwrap();
    assert!(
        ids.len() >= 3,
        "the lock pool's connections idle: {}",
        ids.len()
    );
    for row in ids {
        let id = row.try_get_by_index::<i64>(0).unwrap();
        admin
            .execute_unprepared(&format!("KILL CONNECTION {id}"))
            .await
            .ok();
    }
    for name in &names {
        let guard = backend
            .acquire(name, Duration::ZERO, TTL)
            .await
            .expect("no error: the dead connections are skipped")
            .expect("granted");
        let txn = admin.begin().await.unwrap();
        assert!(guard.verify(&txn).await.unwrap(), "held");
        txn.commit().await.unwrap();
        guard.release().await.unwrap();
    }
}

/// The `mysql_named` check of a transaction is made under the fence row's lock: a check that
/// found the grant held, then waited for the row while the grant's connection died, is refused
/// once it has the row (a check made before the lock would have let the write through, while a
/// new grant of the name could already be reading).
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_grant_lost_while_its_check_waits_for_the_row_is_refused_mysql() {
    use sea_orm::{ConnectionTrait, Statement};

    let Some(named) = Named::start("lost_while_waiting").await else {
        return;
    };
    let db = &named.db;
    let lost = named.grant(Duration::ZERO).await.expect("free");
    // The fence row exists (a first checked transaction made it).
    let txn = db.db.begin().await.unwrap();
    assert!(lost.verify(&txn).await.unwrap());
    txn.commit().await.unwrap();
    let first = lost.fence().unwrap();

    // Another transaction holds the row: the next check waits for it.
    let other = servers::connect(&db.url, None, 1).await;
    let holder = other.begin().await.unwrap();
    holder
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::MySql,
            "SELECT fence FROM freshlock_lock WHERE name = ? FOR UPDATE",
            [named.name.as_str().into()],
        ))
        .await
        .unwrap();
    let check = {
        let data = db.db.clone();
        tokio::spawn(async move {
            let txn = data.begin().await.unwrap();
            let held = lost.verify(&txn).await.unwrap();
            txn.rollback().await.unwrap();
            (held, lost)
        })
    };
    named
        .until(
            &running("INSERT INTO freshlock_lock"),
            "the check waited for the row",
        )
        .await;
    // The grant's connection dies while its check waits.
    named.kill_holder().await;
    holder.rollback().await.unwrap();
    let (held, lost) = check.await.unwrap();
    assert!(
        !held,
        "a check that got the row after the grant was lost is refused"
    );
    assert_eq!(lost.fence(), Some(first), "and issues no fence");
    let _ = lost.release().await;
}
