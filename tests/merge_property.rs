//! Property: under random interleavings of writers on random columns, with random lock failures
//! and random conflicting changes, the final row is exactly the merge of the writes reported as
//! committed — none missing, none extra. Each case runs in one of four modes: one commit per
//! write, commits combined (`combine_commits`: waiters served by the holder's transaction), and
//! either of them with the one-statement optimistic write tried first (`optimistic_first`, with
//! a version column).

mod common;

use std::sync::Arc;

use common::FakeLock;
use common::TestDatabase;
use freshlock::{Error, LockPolicy, OnLockFailure, Session};
use proptest::prelude::*;
use sea_orm::{ConnectionTrait, EntityTrait, Schema, Set};

mod counters {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "counters")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub c0: i32,
        pub c1: i32,
        pub c2: i32,
        pub c3: i32,
        pub version: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

#[derive(Clone, Debug)]
struct Op {
    column: usize,
    lock_fails: bool,
    conflicts: u32,
}

fn op() -> impl Strategy<Value = Op> {
    (0..4usize, any::<bool>(), 0..4u32).prop_map(|(column, lock_fails, conflicts)| Op {
        column,
        lock_fails,
        conflicts,
    })
}

async fn run(
    ops: Vec<Op>,
    writers: usize,
    combine: bool,
    optimistic: bool,
) -> Result<(), TestCaseError> {
    let db = TestDatabase::new().await.unwrap().connection().clone();
    let schema = Schema::new(db.get_database_backend());
    db.execute(&schema.create_table_from_entity(counters::Entity))
        .await
        .unwrap();
    db.execute_unprepared("INSERT INTO counters VALUES (1, 0, 0, 0, 0, 0)")
        .await
        .unwrap();

    let fake = FakeLock::new();
    let mut builder = Session::builder(db.clone())
        .lock(Arc::new(fake.clone()))
        .combine_commits(combine)
        .optimistic_first(optimistic);
    if optimistic {
        builder = builder.version_column::<counters::Entity>(counters::Column::Version);
    }
    let session = builder
        .policy(
            LockPolicy::default()
                .with_lock_tries(1)
                .with_write_attempts(3)
                .with_on_failure(OnLockFailure::Proceed),
        )
        .build()
        .unwrap();
    let chunks: Vec<Vec<Op>> = (0..writers)
        .map(|w| ops.iter().skip(w).step_by(writers).cloned().collect())
        .collect();
    let tasks: Vec<_> = chunks
        .into_iter()
        .map(|ops| {
            let (repo, fake) = (session.repository::<counters::Entity>(), fake.clone());
            tokio::spawn(async move {
                let mut committed = [0i32; 4];
                for op in ops {
                    fake.never_acquire(op.lock_fails);
                    if op.conflicts > 0 {
                        // A concurrent writer touching every column right before the write.
                        fake.interfere(
                            "UPDATE counters SET c0 = c0 + 1000, c1 = c1 + 1000, c2 = c2 + 1000, \
                             c3 = c3 + 1000, version = version + 1",
                            op.conflicts,
                        );
                    }
                    let result = repo
                        .locked_update(1, |row| {
                            match op.column {
                                0 => row.c0 = Set(row.c0.as_ref() + 1),
                                1 => row.c1 = Set(row.c1.as_ref() + 1),
                                2 => row.c2 = Set(row.c2.as_ref() + 1),
                                _ => row.c3 = Set(row.c3.as_ref() + 1),
                            }
                            Ok(())
                        })
                        .await;
                    match result {
                        Ok(report) if report.outcome.is_updated() => committed[op.column] += 1,
                        Ok(report) => panic!("unexpected outcome {:?}", report.outcome),
                        Err(Error::Conflict { .. }) => {}
                        Err(other) => panic!("unexpected error {other}"),
                    }
                }
                committed
            })
        })
        .collect();
    let mut expected = [0i32; 4];
    for task in tasks {
        let committed = task.await.unwrap();
        for (e, c) in expected.iter_mut().zip(committed) {
            *e += c;
        }
    }
    // Pending interference (not consumed by any write) never ran: drop it.
    fake.interfere("", 0);
    let row = counters::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    prop_assert_eq!([row.c0, row.c1, row.c2, row.c3], expected);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_final_row_is_the_merge_of_the_reported_commits(
        ops in proptest::collection::vec(op(), 1..40),
        writers in 1..5usize,
        combine in any::<bool>(),
        optimistic in any::<bool>(),
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(run(ops, writers, combine, optimistic))?;
    }
}
