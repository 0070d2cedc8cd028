//! The fence check before a write is a round trip like any other: a lease server whose answer
//! never comes (a silent partition) must not freeze the write forever. `locked_update` always
//! bounded it by the policy's reply deadline; a section (`with_lock`, `locked_update_many`) ran
//! the same check without one until the two engines became one. Both are checked here, with a
//! lease backend whose fence check never answers, and a write that holds a lease whose check
//! does answer (the deadline must not cost a healthy section anything).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use entity::node;
use freshlock::lock::LockName;
use freshlock::lock::backend::{Fencing, LeaseLock, LockGuard, LockRole};
use freshlock::{
    Error, LockBackend, LockError, LockKind, LockPolicy, OnLockFailure, Session, lock_name,
    testing::TestDatabase,
};
use migration::Migrator;
use sea_orm::{DatabaseTransaction, EntityTrait, Set};

/// A lease backend whose fence check never answers while `hang` is on.
#[derive(Debug, Default)]
struct SilentFence {
    hang: Arc<AtomicBool>,
}

impl LockBackend for SilentFence {
    fn kind(&self) -> LockKind {
        LockKind::Other("silent-fence")
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for SilentFence {
    async fn acquire(
        &self,
        _: &LockName,
        _: Duration,
        _: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        Ok(Some(Box::new(SilentGuard {
            hang: Arc::clone(&self.hang),
        })))
    }
}

#[derive(Debug)]
struct SilentGuard {
    hang: Arc<AtomicBool>,
}

#[async_trait]
impl LockGuard for SilentGuard {
    fn fencing(&self) -> Option<&dyn Fencing> {
        Some(self)
    }

    async fn release(self: Box<Self>) -> Result<(), LockError> {
        Ok(())
    }
}

#[async_trait]
impl Fencing for SilentGuard {
    fn fence(&self) -> u64 {
        1
    }

    async fn verify(&self, _: &DatabaseTransaction) -> Result<bool, LockError> {
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(true)
    }
}

/// How long a test waits before calling a write frozen: far above the policy's bound.
const FROZEN: Duration = Duration::from_secs(20);

async fn setup(hang: bool) -> (TestDatabase, Session) {
    let db = TestDatabase::with_migrator::<Migrator>()
        .await
        .expect("database");
    for id in 1..=2 {
        node::Entity::insert(node::ActiveModel::fresh(id))
            .exec(db.connection())
            .await
            .expect("seed");
    }
    let backend = SilentFence::default();
    backend.hang.store(hang, Ordering::SeqCst);
    let session = Session::builder(db.connection().clone())
        .lock(Arc::new(backend))
        .policy(
            LockPolicy::default()
                .with_reply_timeout(Duration::from_millis(300))
                .with_on_failure(OnLockFailure::Fail),
        )
        .build()
        .expect("session");
    (db, session)
}

async fn score(db: &TestDatabase, id: i32) -> Option<i32> {
    node::Entity::find_by_id(id)
        .one(db.connection())
        .await
        .expect("read")
        .and_then(|n| n.score)
}

/// Awaits `write` (a write whose fence check goes unanswered) and asserts that it fails with
/// the lock error within [`FROZEN`] instead of hanging.
async fn assert_unanswered<T: std::fmt::Debug>(
    what: &str,
    write: impl std::future::Future<Output = Result<T, Error>>,
) {
    let result = tokio::time::timeout(FROZEN, write)
        .await
        .unwrap_or_else(|_| panic!("{what} froze on an unanswered fence check"));
    let error = result.expect_err("an unanswered fence check is an error");
    assert!(is_unanswered(&error), "{what}: {error:?}");
}

/// The error of a write whose fence check went unanswered: a lock error, not a hang.
fn is_unanswered(error: &Error) -> bool {
    matches!(
        error,
        Error::Lock {
            source: LockError::Backend {
                backend: "silent-fence",
                ..
            },
            ..
        }
    )
}

#[tokio::test]
async fn a_section_whose_fence_check_never_answers_fails_within_the_deadline() {
    let (db, session) = setup(true).await;
    let key = lock_name::<node::Entity>(1).expect("name");
    let section = session.with_lock(&key, |tx| {
        Box::pin(async move {
            let nodes = tx.repository::<node::Entity>();
            let found = nodes.load(1).await?.expect("node 1");
            let mut draft: node::ActiveModel = (*found).clone().into();
            draft.score = Set(Some(7));
            nodes.save(draft).await?;
            Ok(())
        })
    });
    assert_unanswered("the section", section).await;
    assert_eq!(score(&db, 1).await, None, "nothing written");

    // And several rows, through the same engine.
    let nodes = session.repository::<node::Entity>();
    let many = nodes.locked_update_many([1, 2], |rows| {
        for row in rows {
            row.score = Set(Some(9));
        }
        Ok(())
    });
    assert_unanswered("locked_update_many", many).await;
    assert_eq!((score(&db, 1).await, score(&db, 2).await), (None, None));
}

#[tokio::test]
async fn a_locked_update_whose_fence_check_never_answers_fails_within_the_deadline() {
    let (db, session) = setup(true).await;
    let nodes = session.repository::<node::Entity>();
    let update = nodes.locked_update(1, |n| {
        n.score = Set(Some(7));
        Ok(())
    });
    assert_unanswered("locked_update", update).await;
    assert_eq!(score(&db, 1).await, None, "nothing written");
}

#[tokio::test]
async fn answered_fence_checks_cost_sections_nothing() {
    let (db, session) = setup(false).await;
    let key = lock_name::<node::Entity>(1).expect("name");
    let mut acknowledged = 0;
    for _ in 0..5 {
        session
            .with_lock(&key, |tx| {
                Box::pin(async move {
                    let nodes = tx.repository::<node::Entity>();
                    let found = nodes.load(1).await?.expect("node 1");
                    let mut draft: node::ActiveModel = (*found).clone().into();
                    draft.score = Set(Some(found.score.unwrap_or(0) + 1));
                    nodes.save(draft).await?;
                    Ok(())
                })
            })
            .await
            .expect("a section with a healthy lease");
        acknowledged += 1;
    }
    assert_eq!(
        score(&db, 1).await,
        Some(acknowledged),
        "acknowledged = stored"
    );
}
