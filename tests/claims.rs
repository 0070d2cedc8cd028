//! Claim / finish with a lease (the lock inspector's tests are in `inspector.rs`).

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use common::memory_db;
use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::LockName;
use sea_orm::ConnectionTrait;

fn key(s: &str) -> LockName {
    LockName::new(s).unwrap()
}

/// How many claim rows `db` holds, and the least of their states.
async fn claim_rows(db: &sea_orm::DatabaseConnection) -> (i64, Option<String>) {
    let row = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n, MIN(state) AS state FROM freshlock_claim",
        ))
        .await
        .unwrap()
        .unwrap();
    (
        row.try_get("", "n").unwrap(),
        row.try_get("", "state").unwrap(),
    )
}

/// `claims`' claim of the new key `name`.
async fn claimed(claims: &Claims, name: &str) -> freshlock::claim::Claim {
    match claims.claim(&key(name), Duration::from_secs(60)).await {
        Ok(ClaimOutcome::Claimed(claim)) => claim,
        other => panic!("{name} is claimed: {other:?}"),
    }
}

#[tokio::test]
async fn a_claim_without_a_lease_is_refused_and_writes_nothing() {
    let db = memory_db().await;
    let claims = Claims::new(db.clone());
    for lease in [Duration::ZERO, Duration::from_micros(999)] {
        assert!(matches!(
            claims.claim(&key("spam:0"), lease).await,
            Err(freshlock::Error::InvalidLease { .. })
        ));
    }
    assert_eq!(claim_rows(&db).await, (0, None));
    // The shortest real lease still works.
    assert!(matches!(
        claims
            .claim(&key("spam:0"), Duration::from_millis(1))
            .await
            .unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}

#[tokio::test]
async fn a_zero_reply_timeout_is_refused_and_writes_nothing() {
    let db = memory_db().await;
    let claim = claimed(&Claims::new(db.clone()), "spam:1").await;
    let zero = Claims::new(db.clone()).with_reply_timeout(Duration::ZERO);
    let invalid = |error: freshlock::Error| {
        matches!(error, freshlock::Error::InvalidPolicy { reason }
            if reason.contains("reply_timeout"))
    };
    let claimed = zero.claim(&key("spam:0"), Duration::from_secs(60)).await;
    assert!(invalid(claimed.unwrap_err()));
    let finished = zero.finish(&claim).await;
    assert!(invalid(finished.unwrap_err()));
    let extended = zero.extend(&claim, Duration::from_secs(60)).await;
    assert!(invalid(extended.unwrap_err()));
    let finished = zero
        .finish_with(&claim, |_| Box::pin(async { Ok(()) }))
        .await;
    assert!(invalid(finished.unwrap_err()));
    assert_eq!(
        claim_rows(&db).await,
        (1, Some("processing".to_owned())),
        "spam:0 not claimed, spam:1 not finished"
    );
    // A short bound works.
    let short = Claims::new(db).with_reply_timeout(Duration::from_millis(500));
    assert_eq!(short.finish(&claim).await.unwrap(), FinishOutcome::Finished);
}

#[tokio::test]
async fn claim_is_idempotent_and_finish_is_once() {
    let db = memory_db().await;
    let claims = Claims::new(db.clone()).with_label("worker-1");
    let ClaimOutcome::Claimed(claim) = claims
        .claim(&key("spam:1"), Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("first claim wins");
    };
    assert_eq!(claim.fence, 1);
    // The queue delivers the same task again while it is being processed: busy, not an error.
    assert_eq!(
        claims
            .claim(&key("spam:1"), Duration::from_secs(60))
            .await
            .unwrap(),
        ClaimOutcome::Busy
    );
    assert_eq!(
        claims.finish(&claim).await.unwrap(),
        FinishOutcome::Finished
    );
    assert_eq!(
        claims.finish(&claim).await.unwrap(),
        FinishOutcome::Stale,
        "finishing twice"
    );
    // …and again after it is done: done, processed once.
    assert_eq!(
        claims
            .claim(&key("spam:1"), Duration::from_secs(60))
            .await
            .unwrap(),
        ClaimOutcome::Done
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_delivery_is_processed_once() {
    let db = servers::sqlite_file("double").await.db;
    let claims = Claims::new(db.clone());
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (claims, barrier) = (claims.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                match claims
                    .claim(&key("spam:7"), Duration::from_secs(60))
                    .await
                    .unwrap()
                {
                    ClaimOutcome::Claimed(claim) => {
                        assert_eq!(
                            claims.finish(&claim).await.unwrap(),
                            FinishOutcome::Finished
                        );
                        1
                    }
                    _ => 0,
                }
            })
        })
        .collect();
    let mut processed = 0;
    for task in tasks {
        processed += task.await.unwrap();
    }
    assert_eq!(processed, 1);
}

/// A claim of `name` whose worker "dies" at once (a 1 ms lease), and the claim of another
/// worker that takes it over once the lease has run out by the database clock (polled every
/// millisecond, never finished meanwhile).
async fn taken_over(
    claims: &Claims,
    name: &str,
) -> (freshlock::claim::Claim, freshlock::claim::Claim) {
    let ClaimOutcome::Claimed(dead) = claims
        .claim(&key(name), Duration::from_millis(1))
        .await
        .unwrap()
    else {
        panic!("claimed");
    };
    let retry = loop {
        match claims
            .claim(&key(name), Duration::from_secs(60))
            .await
            .unwrap()
        {
            ClaimOutcome::Claimed(claim) => break claim,
            ClaimOutcome::Busy => tokio::time::sleep(Duration::from_millis(1)).await,
            ClaimOutcome::Done => panic!("nobody finished it"),
            other => panic!("{other:?}"),
        }
    };
    (dead, retry)
}

#[tokio::test]
async fn an_expired_claim_is_claimed_again_and_the_late_finish_is_refused() {
    let db = memory_db().await;
    let claims = Claims::new(db.clone());
    // The worker "dies" after claiming. Once the lease has run out (database clock), the work
    // can be claimed again — in the report's code it would stay "processing" forever.
    let (dead, retry) = taken_over(&claims, "spam:2").await;
    assert!(retry.fence > dead.fence);
    assert_eq!(
        claims.finish(&dead).await.unwrap(),
        FinishOutcome::Stale,
        "the late finish is refused"
    );
    assert_eq!(
        claims.finish(&retry).await.unwrap(),
        FinishOutcome::Finished
    );
}

/// Where the claim row of `name` expires (ms since the epoch, database clock).
async fn expires_at(db: &sea_orm::DatabaseConnection, name: &str) -> i64 {
    let row = db
        .query_one_raw(sea_orm::Statement::from_sql_and_values(
            db.get_database_backend(),
            "SELECT expires_at FROM freshlock_claim WHERE name = ?",
            [name.into()],
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get("", "expires_at").unwrap()
}

#[tokio::test]
async fn an_extended_claim_stays_ours_until_its_new_expiry() {
    let db = memory_db().await;
    let claims = Claims::new(db.clone());
    let ClaimOutcome::Claimed(claim) = claims
        .claim(&key("spam:5"), Duration::from_millis(1))
        .await
        .unwrap()
    else {
        panic!("claimed");
    };
    let before = expires_at(&db, "spam:5").await;
    // Whether or not its 1 ms lease has run out by now, nobody claimed it again: still ours.
    assert!(
        claims
            .extend(&claim, Duration::from_secs(60))
            .await
            .unwrap()
    );
    let after = expires_at(&db, "spam:5").await;
    assert!(
        after >= before + 59_000,
        "moved on by a minute: {before} -> {after}"
    );
    assert_eq!(
        claims
            .claim(&key("spam:5"), Duration::from_secs(60))
            .await
            .unwrap(),
        ClaimOutcome::Busy,
        "a live claim is not taken over"
    );
    assert_eq!(
        claims.finish(&claim).await.unwrap(),
        FinishOutcome::Finished
    );
    assert!(
        !claims
            .extend(&claim, Duration::from_secs(60))
            .await
            .unwrap(),
        "a finished claim is not extended"
    );
    assert_eq!(claim_rows(&db).await, (1, Some("done".to_owned())));
}

#[tokio::test]
async fn a_claim_taken_over_is_not_extended() {
    let db = memory_db().await;
    let claims = Claims::new(db.clone());
    let (dead, retry) = taken_over(&claims, "spam:6").await;
    let live = expires_at(&db, "spam:6").await;
    assert!(
        !claims
            .extend(&dead, Duration::from_secs(600))
            .await
            .unwrap()
    );
    assert_eq!(
        expires_at(&db, "spam:6").await,
        live,
        "the new holder's lease is untouched"
    );
    assert!(
        claims
            .extend(&retry, Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert!(matches!(
        claims.extend(&retry, Duration::ZERO).await,
        Err(freshlock::Error::InvalidLease { .. })
    ));
    assert_eq!(claims.finish(&dead).await.unwrap(), FinishOutcome::Stale);
    assert_eq!(
        claims.finish(&retry).await.unwrap(),
        FinishOutcome::Finished
    );
}

#[tokio::test]
async fn finish_with_commits_the_users_change_with_the_claim() {
    let db = memory_db().await;
    common::seed_nodes(&db, 1).await;
    let claims = Claims::new(db.clone());
    let claim = claimed(&claims, "node:1").await;
    // Work that fails: nothing it wrote commits, the claim is not finished.
    let failed = claims
        .finish_with(&claim, |txn| {
            Box::pin(async move {
                txn.execute_unprepared("UPDATE node SET summary = 'half' WHERE id = 1")
                    .await?;
                Err(freshlock::ApplyError::msg("the result did not validate"))
            })
        })
        .await;
    assert!(
        matches!(&failed, Err(freshlock::Error::FinishAborted { claim, .. }) if claim == "node:1"),
        "{failed:?}"
    );
    assert_eq!(common::node_in_db(&db, 1).await.summary, None);
    // Work whose statement fails: a database error, as from a section's work.
    let failed = claims
        .finish_with(&claim, |txn| {
            Box::pin(async move {
                txn.execute_unprepared("UPDATE node SET summary = 'half' WHERE id = 1")
                    .await?;
                txn.execute_unprepared("UPDATE no_such_table SET x = 1")
                    .await?;
                Ok(())
            })
        })
        .await;
    assert!(
        matches!(
            &failed,
            Err(freshlock::Error::Database { operation: "finishing", target, .. }) if target == "node:1"
        ),
        "a sea-orm error of the work reads as a database error: {failed:?}"
    );
    assert!(
        !failed.unwrap_err().is_transient(),
        "a missing table is not"
    );
    assert_eq!(common::node_in_db(&db, 1).await.summary, None);
    // The claim is still held: the finish made again commits, its work under the reply bound.
    let outcome = claims
        .finish_with(&claim, |txn| {
            Box::pin(async move {
                assert_eq!(txn.bound(), Duration::from_secs(10));
                txn.execute_unprepared("UPDATE node SET summary = 'done' WHERE id = 1")
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap();
    assert_eq!(outcome, FinishOutcome::Finished);
    assert_eq!(
        common::node_in_db(&db, 1).await.summary.as_deref(),
        Some("done")
    );
}
