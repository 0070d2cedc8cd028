//! Several rows in one locked transaction, and repositories bound to a section's transaction.
//!
//! - Transfers: 20 accounts of 100, random transfers both ways between random pairs
//!   (`locked_update_pair`), 6 tasks × 150 on in-memory SQLite: the sum is exact, no balance is
//!   negative, no deadlock reaches a caller, no call hangs. (Processes × databases × backends:
//!   `tests/cross_process.rs`.)
//! - Reserve and order: stock decremented and an order inserted in one section, under random
//!   cancellation: every acknowledged order exists with its decrement, no order without one.
//! - Sections on a one-connection `TestDatabase`: repository calls inside complete; the cache
//!   after commit equals the database, after a rollback it is unchanged.
//! - A deadlock inside a section is transient, and a retrying section gets through it.
//! - `SKIP LOCKED` / `NOWAIT`, per-row outcomes, `locked_update_with`, error kinds.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::{account, ham, ham_lock, node, purchase_order, stock};
use freshlock::lock::LocalLock;
use freshlock::{
    ApplyError, Error, ForUpdate, GetOutcome, SaveOutcome, SectionOutcome, Session, UpdateOutcome,
    lock_name,
};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, EntityTrait, IntoActiveModel, QueryFilter,
    QueryOrder, QuerySelect, Set,
};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

const ACCOUNTS: i32 = 20;
const START: i64 = 100;

async fn seed_accounts(db: &DatabaseConnection) {
    let rows = (1..=ACCOUNTS).map(|id| account::ActiveModel {
        id: Set(id),
        balance: Set(START),
    });
    account::Entity::insert_many(rows).exec(db).await.unwrap();
}

/// (sum, lowest balance) as the database has them.
async fn balances(db: &DatabaseConnection) -> (i64, i64) {
    let all = account::Entity::find().all(db).await.unwrap();
    assert_eq!(all.len(), ACCOUNTS as usize);
    (
        all.iter().map(|a| a.balance).sum(),
        all.iter().map(|a| a.balance).min().unwrap_or(0),
    )
}

/// One random transfer through `session`: `Ok(true)` committed, `Ok(false)` refused for lack of
/// funds; any other error fails the test.
async fn transfer(session: &Session, rng: &mut fastrand::Rng) -> bool {
    let from = rng.i32(1..=ACCOUNTS);
    let mut to = rng.i32(1..ACCOUNTS);
    if to >= from {
        to += 1;
    }
    let amount = rng.i64(1..=40);
    let accounts = session.repository::<account::Entity>();
    let call = accounts.locked_update_pair(from, to, move |a, b| {
        let balance = *a.balance.as_ref();
        if balance < amount {
            return Err(ApplyError::msg("insufficient funds"));
        }
        a.balance = Set(balance - amount);
        b.balance = Set(*b.balance.as_ref() + amount);
        Ok(())
    });
    match tokio::time::timeout(Duration::from_secs(60), call)
        .await
        .expect("no transfer hangs")
    {
        Ok(report) => {
            assert!(report.committed(), "{:?}", report.outcomes);
            true
        }
        Err(Error::Apply { .. }) => false,
        Err(error) => panic!("a transfer failed: {error} ({error:?})"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_in_memory_sqlite() {
    let db = common::memory_db().await;
    seed_accounts(&db).await;
    let session = common::session(&db, &LocalLock::new());
    let committed = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..6)
        .map(|t| {
            let (session, committed) = (session.clone(), Arc::clone(&committed));
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(t + 1);
                for _ in 0..150 {
                    if transfer(&session, &mut rng).await {
                        committed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let (sum, lowest) = balances(&db).await;
    eprintln!(
        "{} of 900 transfers committed",
        committed.load(Ordering::SeqCst)
    );
    assert_eq!(sum, i64::from(ACCOUNTS) * START, "money was made or lost");
    assert!(lowest >= 0, "a balance went negative");
    assert!(committed.load(Ordering::SeqCst) > 0);
    // The cache holds the committed rows: what the session has cached agrees with the database.
    let accounts = session.repository::<account::Entity>();
    for id in 1..=ACCOUNTS {
        let cached = accounts.load(id).await.unwrap().unwrap();
        let stored = account::Entity::find_by_id(id).one(&db).await.unwrap();
        assert_eq!(Some((*cached).clone()), stored);
    }
}

/// Transfers whose callers give up after a random 0.1–20 ms: the section goes on in its own task,
/// so no statement is cut in half (on in-memory SQLite that would destroy the database), and
/// once every section has finished the sum is exact and no balance is negative.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_whose_callers_give_up() {
    let db = common::memory_db().await;
    seed_accounts(&db).await;
    let session = common::session(&db, &LocalLock::new());
    let gave_up = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let (session, gave_up) = (session.clone(), Arc::clone(&gave_up));
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(50 + t);
                for _ in 0..100 {
                    let budget = Duration::from_micros(rng.u64(100..20_100));
                    if tokio::time::timeout(budget, transfer(&session, &mut rng))
                        .await
                        .is_err()
                    {
                        gave_up.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // The abandoned sections finish by themselves: wait for them (bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while session.in_flight() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sections never finished"
        );
        tokio::task::yield_now().await;
    }
    let (sum, lowest) = balances(&db).await;
    eprintln!("{} of 400 callers gave up", gave_up.load(Ordering::SeqCst));
    assert!(
        gave_up.load(Ordering::SeqCst) > 0,
        "some callers gave up mid-section"
    );
    assert_eq!(sum, i64::from(ACCOUNTS) * START);
    assert!(lowest >= 0);
}

/// Reserve `quantity` of stock 1 and insert order `order`, in one section.
async fn reserve(session: &Session, order: i64, quantity: i32) -> freshlock::Result<bool> {
    let report = session
        .section([lock_name::<stock::Entity>(1).unwrap()])
        .run_retrying(move |tx| {
            Box::pin(async move {
                let stocks = tx.repository::<stock::Entity>();
                let stock = stocks
                    .load_locked(1, ForUpdate::Wait)
                    .await?
                    .ok_or_else(|| ApplyError::msg("no stock row"))?;
                if stock.quantity < quantity {
                    return Ok(false);
                }
                let mut draft = (*stock).clone().into_active_model();
                draft.quantity = Set(stock.quantity - quantity);
                match stocks.save(draft).await? {
                    SaveOutcome::Updated(_) => {}
                    other => return Err(ApplyError::msg(format!("stock save: {other:?}"))),
                }
                tx.repository::<purchase_order::Entity>()
                    .insert(purchase_order::ActiveModel {
                        id: Set(order),
                        stock_id: Set(1),
                        quantity: Set(quantity),
                    })
                    .await?;
                Ok(true)
            })
        })
        .await?;
    match report.outcome {
        SectionOutcome::Committed(done) => Ok(done),
        other => panic!("{other:?}"),
    }
}

/// 6 tasks × 60 reservations, each under a random timeout (some are cancelled mid-section).
async fn reserve_and_order(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    stock::Entity::insert(stock::ActiveModel {
        id: Set(1),
        quantity: Set(1_000),
    })
    .exec(&db.db)
    .await
    .unwrap();
    let session = common::session(&db.db, &LocalLock::new());
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let cancelled = Arc::new(AtomicU32::new(0));
    let tasks: Vec<_> = (0..6)
        .map(|t| {
            let session = session.clone();
            let (acknowledged, cancelled) = (Arc::clone(&acknowledged), Arc::clone(&cancelled));
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(100 + t);
                for i in 0..60 {
                    let order = t as i64 * 1_000 + i;
                    let quantity = rng.i32(1..=3);
                    let budget = Duration::from_micros(rng.u64(500..30_500));
                    match tokio::time::timeout(budget, reserve(&session, order, quantity)).await {
                        Ok(Ok(true)) => acknowledged.lock().unwrap().push((order, quantity)),
                        Ok(Ok(false)) => {}
                        Ok(Err(error)) => panic!("a reservation failed: {error} ({error:?})"),
                        Err(_) => {
                            cancelled.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // Let cancelled sections' locks and rollbacks settle, then read what is there.
    let left = stock::Entity::find_by_id(1)
        .one(&db.db)
        .await
        .unwrap()
        .unwrap()
        .quantity;
    let orders = purchase_order::Entity::find().all(&db.db).await.unwrap();
    let ordered: i32 = orders.iter().map(|o| o.quantity).sum();
    let acknowledged = acknowledged.lock().unwrap().clone();
    eprintln!(
        "{} acknowledged, {} cancelled, {} orders stored, {left} left",
        acknowledged.len(),
        cancelled.load(Ordering::SeqCst),
        orders.len()
    );
    assert_eq!(
        1_000 - left,
        ordered,
        "no order without its decrement, and none twice"
    );
    for (order, quantity) in &acknowledged {
        assert!(
            orders
                .iter()
                .any(|o| o.id == *order && o.quantity == *quantity),
            "acknowledged order {order} is missing"
        );
    }
    assert!(!acknowledged.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_on_a_one_connection_test_database() {
    let (db, recorder) = common::memory_db_recorded().await;
    common::seed_nodes(&db, 1).await;
    let session = common::session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    let before = nodes.load(1).await.unwrap().unwrap();

    // Commit: a save, an insert and a get-or-insert, all through the section's one connection.
    let key = lock_name::<node::Entity>(1).unwrap();
    let report = tokio::time::timeout(
        Duration::from_secs(10),
        session.with_lock(&key, |tx| {
            Box::pin(async move {
                let nodes = tx.repository::<node::Entity>();
                let node = nodes
                    .load(1)
                    .await?
                    .ok_or_else(|| ApplyError::msg("gone"))?;
                let mut draft = (*node).clone().into_active_model();
                draft.title = Set("in a section".into());
                assert!(matches!(nodes.save(draft).await?, SaveOutcome::Updated(_)));
                let hams = tx.repository::<ham::Entity>();
                hams.insert(ham::ActiveModel {
                    id: Set(1),
                    name: Set("one".into()),
                    updated_at: Set(0),
                })
                .await?;
                let got = hams
                    .get_or_insert(2, || ham::ActiveModel {
                        name: Set("two".into()),
                        updated_at: Set(0),
                        ..Default::default()
                    })
                    .await?;
                assert!(matches!(&got, GetOutcome::Created(two) if two.name == "two"));
                Ok(())
            })
        }),
    )
    .await
    .expect("a section on a one-connection pool completes")
    .unwrap();
    assert!(matches!(report.outcome, SectionOutcome::Committed(())));
    recorder.clear();
    let cached = nodes.load(1).await.unwrap().unwrap();
    let ham = session
        .repository::<ham::Entity>()
        .load(2)
        .await
        .unwrap()
        .unwrap();
    assert!(
        recorder.statements().is_empty(),
        "served from the cache the commit filled: {:?}",
        recorder.statements()
    );
    assert_eq!(*cached, common::node_in_db(&db, 1).await);
    assert_eq!(cached.title, "in a section");
    assert_eq!(ham.name, "two");
    assert_ne!(before.title, cached.title);

    // Rollback: the cache keeps what it had, the database too.
    let failed = session
        .with_lock(&key, |tx| {
            Box::pin(async move {
                let nodes = tx.repository::<node::Entity>();
                let node = nodes
                    .load(1)
                    .await?
                    .ok_or_else(|| ApplyError::msg("gone"))?;
                let mut draft = (*node).clone().into_active_model();
                draft.title = Set("rolled back".into());
                nodes.save(draft).await?;
                Err::<(), _>(ApplyError::msg("changed my mind"))
            })
        })
        .await;
    let Err(Error::SectionAborted { lock, .. }) = failed else {
        panic!("{failed:?}");
    };
    assert_eq!(lock, key.as_str());
    let cached = nodes.load(1).await.unwrap().unwrap();
    assert_eq!(cached.title, "in a section");
    assert_eq!(common::node_in_db(&db, 1).await.title, "in a section");
}

async fn bump(tx: &freshlock::Tx, id: i32) -> Result<(), sea_orm::DbErr> {
    let sql = format!("UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = {id}");
    let backend = tx.get_database_backend();
    tx.execute_raw(sea_orm::Statement::from_string(backend, sql))
        .await
        .map(drop)
}

/// Bumps `first`, waits for the other section (first attempt only: a retry must not), bumps
/// `second`.
fn crossing(
    first: i32,
    second: i32,
    barrier: Arc<Barrier>,
) -> impl for<'t> FnMut(&'t freshlock::Tx) -> freshlock::SectionWork<'t, ()> + Send {
    let waited = Arc::new(AtomicBool::new(false));
    move |tx| {
        let (barrier, waited) = (Arc::clone(&barrier), Arc::clone(&waited));
        Box::pin(async move {
            bump(tx, first).await?;
            if !waited.swap(true, Ordering::SeqCst) {
                barrier.wait().await;
            }
            bump(tx, second).await?;
            Ok(())
        })
    }
}

/// Two sections under different locks update nodes 1 and 2 in opposite orders: the database
/// breaks the deadlock by failing one. A plain section reports it as a transient database error;
/// a retrying one runs again and both commit.
async fn deadlock_in_a_section(db: Option<TestDb>, retrying: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let session = common::session(&db.db, &LocalLock::new());
    let barrier = Arc::new(Barrier::new(2));
    let run = |first: i32, second: i32| {
        let (session, barrier) = (session.clone(), Arc::clone(&barrier));
        tokio::spawn(async move {
            let section =
                session.section([freshlock::lock::LockName::new(format!("dl:{first}")).unwrap()]);
            let work = crossing(first, second, barrier);
            if retrying {
                section.run_retrying(work).await
            } else {
                section.run(work).await
            }
        })
    };
    let (a, b) = (run(1, 2), run(2, 1));
    let results = [a.await.unwrap(), b.await.unwrap()];
    let scores = (
        db.score(1).await.unwrap_or(0),
        db.score(2).await.unwrap_or(0),
    );
    if retrying {
        for result in &results {
            assert!(result.is_ok(), "{result:?}");
        }
        assert_eq!(scores, (2, 2));
    } else {
        let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(failed.len(), 1, "{results:?}");
        assert!(
            matches!(failed[0], Error::Database { .. }) && failed[0].is_transient(),
            "a deadlock is a transient database error: {:?}",
            failed[0]
        );
        assert_eq!(scores, (1, 1));
    }
}

/// Worker A takes the first free node with SKIP LOCKED and holds it; worker B's same query
/// gets the second; a NOWAIT read of A's row fails at once, as a transient error.
async fn skip_locked_and_no_wait(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(3).await;
    let session = common::session(&db.db, &LocalLock::new());
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<i32>();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let next_free = || node::Entity::find().order_by_asc(node::Column::Id).limit(1);
    let a = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .with_lock(
                    &freshlock::lock::LockName::new("worker-a").unwrap(),
                    move |tx| {
                        Box::pin(async move {
                            let taken = tx
                                .repository::<node::Entity>()
                                .find_locked(next_free(), ForUpdate::SkipLocked)
                                .await?;
                            let _ = held_tx.send(taken[0].id);
                            let _ = done_rx.await;
                            Ok(())
                        })
                    },
                )
                .await
                .unwrap();
        })
    };
    let held = held_rx.await.unwrap();
    let seen = session
        .with_lock(
            &freshlock::lock::LockName::new("worker-b").unwrap(),
            move |tx| {
                Box::pin(async move {
                    let nodes = tx.repository::<node::Entity>();
                    let next = nodes
                        .find_locked(next_free(), ForUpdate::SkipLocked)
                        .await?;
                    let skipped = nodes.load_locked(held, ForUpdate::SkipLocked).await?;
                    let no_wait = nodes.load_locked(held, ForUpdate::NoWait).await;
                    Ok((next[0].id, skipped.is_none(), no_wait.map(|_| ())))
                })
            },
        )
        .await;
    let _ = done_tx.send(());
    a.await.unwrap();
    let SectionOutcome::Committed((next, skipped, no_wait)) = seen.unwrap().outcome else {
        panic!("lease lost");
    };
    assert_eq!((held, next), (1, 2), "B moved on to the next free row");
    assert!(skipped, "a locked row reads as missing with SKIP LOCKED");
    let Err(error) = no_wait else {
        panic!("NOWAIT on a locked row must fail");
    };
    assert!(error.is_transient(), "{error:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_rows_report_each_row() {
    let db = common::memory_db().await;
    seed_accounts(&db).await;
    let session = common::session(&db, &LocalLock::new());
    let accounts = session.repository::<account::Entity>();
    let called = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&called);
    let report = accounts
        .locked_update_many([1, 999, 2], move |drafts| {
            flag.store(true, Ordering::SeqCst);
            drafts[0].balance = Set(0);
            Ok(())
        })
        .await
        .unwrap();
    assert!(
        !called.load(Ordering::SeqCst),
        "apply runs only when every row exists"
    );
    assert!(matches!(
        report.outcomes.as_slice(),
        [
            UpdateOutcome::Unchanged(_),
            UpdateOutcome::NotFound,
            UpdateOutcome::Unchanged(_)
        ]
    ));
    assert_eq!(balances(&db).await.0, i64::from(ACCOUNTS) * START);

    let twice = accounts.locked_update_many([3, 3], |_| Ok(())).await;
    assert!(matches!(twice, Err(Error::InvalidKey { .. })), "{twice:?}");
    let refused = accounts
        .locked_update_pair(1, 2, |a, _| {
            a.balance = Set(-1);
            Err(ApplyError::msg("no"))
        })
        .await;
    assert!(matches!(refused, Err(Error::Apply { .. })), "{refused:?}");
    assert_eq!(balances(&db).await, (i64::from(ACCOUNTS) * START, START));

    // Three rows, given out of order: each gets its own draft; the locks were taken sorted.
    let report = accounts
        .locked_update_many([3, 1, 2], |drafts| {
            for (i, draft) in drafts.iter_mut().enumerate() {
                draft.balance = Set(START + i as i64);
            }
            Ok(())
        })
        .await
        .unwrap();
    let stored: Vec<i64> = report
        .outcomes
        .iter()
        .map(|o| o.model().unwrap().balance)
        .collect();
    assert_eq!(stored, [START, START + 1, START + 2]);
    let names: Vec<&str> = report.locks.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(
        names,
        ["bank_account:1", "bank_account:2", "bank_account:3"]
    );
    let three = account::Entity::find_by_id(3)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(three.balance, START);

    // A draft that moves its row's key fails the whole write, after the row before it in the
    // canonical order was updated: rolled back, nothing written.
    let before = account::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    let moved = accounts
        .locked_update_pair(1, 2, |a, b| {
            a.balance = Set(7);
            b.id = Set(999);
            Ok(())
        })
        .await;
    assert!(
        matches!(moved, Err(Error::PrimaryKeyChanged { .. })),
        "{moved:?}"
    );
    let one = account::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one, before, "the first row's UPDATE was rolled back");
    assert!(
        account::Entity::find_by_id(999)
            .one(&db)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_apply_reads_and_writes_in_the_same_transaction() {
    let db = common::memory_db().await;
    common::seed_nodes(&db, 1).await;
    ham::Entity::insert(ham::ActiveModel {
        id: Set(7),
        name: Set("parent".into()),
        updated_at: Set(0),
    })
    .exec(&db)
    .await
    .unwrap();
    let session = common::session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    let report = nodes
        .locked_update_with(1, |node, tx| {
            Box::pin(async move {
                let parent = tx.repository::<ham::Entity>().load(7).await?;
                node.title = Set(parent.map(|h| h.name.to_string()).unwrap_or_default());
                tx.repository::<ham_lock::Entity>()
                    .insert(ham_lock::ActiveModel {
                        ham_id: Set(7),
                        updated_at: Set(1),
                    })
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());
    assert_eq!(common::node_in_db(&db, 1).await.title, "parent");
    assert!(
        ham_lock::Entity::find_by_id(7)
            .one(&db)
            .await
            .unwrap()
            .is_some()
    );

    // An error after the audit insert: neither the row nor the insert is committed.
    ham::Entity::insert(ham::ActiveModel {
        id: Set(8),
        name: Set("other".into()),
        updated_at: Set(0),
    })
    .exec(&db)
    .await
    .unwrap();
    let failed = nodes
        .locked_update_with(1, |node, tx| {
            Box::pin(async move {
                node.title = Set("never".into());
                tx.repository::<ham_lock::Entity>()
                    .insert(ham_lock::ActiveModel {
                        ham_id: Set(8),
                        updated_at: Set(1),
                    })
                    .await?;
                Err(ApplyError::msg("abort"))
            })
        })
        .await;
    assert!(matches!(failed, Err(Error::Apply { .. })), "{failed:?}");
    assert_eq!(common::node_in_db(&db, 1).await.title, "parent");
    assert!(
        ham_lock::Entity::find_by_id(8)
            .one(&db)
            .await
            .unwrap()
            .is_none()
    );
    let missing = nodes
        .locked_update_with(99, |_, _| Box::pin(async { Ok(()) }))
        .await
        .unwrap();
    assert!(matches!(missing.outcome, UpdateOutcome::NotFound));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn section_errors_mean_what_they_say() {
    let db = common::memory_db().await;
    let session = common::session(&db, &LocalLock::new());
    let key = freshlock::lock::LockName::new("report:1").unwrap();
    let db_error = session
        .with_lock(&key, |tx| {
            Box::pin(async move {
                tx.execute_unprepared("SELECT * FROM no_such_table").await?;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(db_error, Err(Error::Database { .. })),
        "{db_error:?}"
    );
    let own = session
        .with_lock(&key, |_| {
            Box::pin(async { Err::<(), _>(ApplyError::msg("no")) })
        })
        .await
        .unwrap_err();
    assert!(matches!(own, Error::SectionAborted { .. }));
    assert!(own.to_string().contains("report:1"), "{own}");
    assert!(!own.to_string().contains("update"), "{own}");
    // A freshlock error from inside comes back as it is.
    let inner = session
        .with_lock(&key, |tx| {
            Box::pin(async move {
                tx.repository::<node::Entity>()
                    .save(node::ActiveModel::fresh(1))
                    .await?;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(
            inner,
            Err(Error::InvalidKey { .. } | Error::NoSnapshot { .. })
        ),
        "{inner:?}"
    );
    let _ = node::Entity::find().filter(node::Column::Id.eq(1));
}

servers::server_tests! {
    reserve_sqlite: reserve_and_order, (), sqlite;
    reserve_postgres: reserve_and_order, (), postgres;
    reserve_mysql: reserve_and_order, (), mysql;
    deadlock_postgres: deadlock_in_a_section, false, postgres;
    deadlock_mysql: deadlock_in_a_section, false, mysql;
    deadlock_retried_postgres: deadlock_in_a_section, true, postgres;
    deadlock_retried_mysql: deadlock_in_a_section, true, mysql;
    skip_locked_postgres: skip_locked_and_no_wait, (), postgres;
    skip_locked_mysql: skip_locked_and_no_wait, (), mysql;
}
