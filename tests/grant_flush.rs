//! A `table` lease granted for `locked_update` on PostgreSQL commits without waiting for its log
//! flush (`LeaseLock::acquire_checked`): a crash can lose the grant, and then the write it
//! guarded is reported `LeaseLost`, never applied, and never lost once acknowledged.
//!
//! On a private server whose WAL writer runs every 10 s (so an unflushed commit stays in shared
//! memory for seconds) the write's closure reads its lease row, kills every process of the
//! server (`kill -9`) and starts it again. The write's statements then fail on the dead
//! connection, the attempt is run again on a new one, and its lease check finds the row without
//! the grant's token: `LeaseLost`. Were the grant flushed at its commit (as before), it would
//! survive the crash and the retry would write: `Updated` in every round, and this test fails.

#[path = "common/private_pg.rs"]
mod private_pg;
#[path = "common/servers.rs"]
mod servers;

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use entity::node;
use freshlock::lock::TableLock;
use freshlock::{LockBackend, Session, UpdateOutcome};
use migration::{Migrator, MigratorTrait};
use private_pg::PrivatePostgres;
use sea_orm::{EntityTrait, Set};

/// One SQL query's text output on the private server, by `psql` (a process of its own: the
/// write's closure is synchronous).
fn psql(server: &PrivatePostgres, sql: &str) -> String {
    let out = Command::new("psql")
        .args(["-h", "127.0.0.1", "-p", &server.port.to_string()])
        .args(["-U", "postgres", "-Atc", sql, "postgres"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Kills the postmaster and every child (the WAL writer too) at once, as a machine crash or
/// the OOM killer would, then starts the server again and waits until it accepts connections.
fn crash(server: &PrivatePostgres) {
    let pid = std::fs::read_to_string(server.dir.join("postmaster.pid")).unwrap();
    let pid = pid.lines().next().unwrap().trim().to_owned();
    let run = |cmd: &str, args: &[&str]| Command::new(cmd).args(args).status().unwrap();
    // Stopped first, so it starts no child (nor restarts one) while its children are killed.
    run("kill", &["-STOP", &pid]);
    run("pkill", &["-9", "-P", &pid]);
    run("kill", &["-9", &pid]);
    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.accepting() {
        assert!(Instant::now() < deadline, "the server did not come back");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_with_a_crash_is_reported_lease_lost_postgres() {
    if servers::url(servers::POSTGRES).is_none() {
        return;
    }
    let server = tokio::task::spawn_blocking(|| {
        let server = PrivatePostgres::start();
        let conf = server.dir.join("postgresql.conf");
        let text = std::fs::read_to_string(&conf).unwrap();
        std::fs::write(
            &conf,
            text + "\nwal_writer_delay = 10000ms\nautovacuum = off\n",
        )
        .unwrap();
        assert!(server.pg_ctl("-m fast -w restart"));
        server
    })
    .await
    .unwrap();
    let server = Arc::new(server);
    let db = servers::crashable_pool(&server.url(), 2).await;
    Migrator::up(&db, None).await.unwrap();
    node::Entity::insert(node::ActiveModel::fresh(1))
        .exec(&db)
        .await
        .unwrap();
    let lock: Arc<dyn LockBackend> = Arc::new(TableLock::new(db.clone()));
    let policy = freshlock::LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(Duration::from_secs(30));

    const ROUNDS: usize = 3;
    let (mut updated, mut lost) = (0, 0);
    for round in 0..ROUNDS {
        let session = Session::builder(db.clone())
            .lock(Arc::clone(&lock))
            .policy(policy.clone())
            .build()
            .unwrap();
        // The grant's token, read just before the crash (none: no crash yet).
        let crashed = Arc::new(std::sync::Mutex::new(None::<String>));
        let (server_in, crashed_in) = (Arc::clone(&server), Arc::clone(&crashed));
        let report = session
            .repository::<node::Entity>()
            .locked_update(1, move |n| {
                let mut crashed = crashed_in.lock().unwrap();
                if crashed.is_none() {
                    // The lease is granted (and not flushed), the row reloaded in the write's
                    // transaction: now the crash.
                    let owner = psql(
                        &server_in,
                        "SELECT owner FROM freshlock_lock WHERE owner IS NOT NULL",
                    );
                    assert!(!owner.is_empty(), "round {round}: the lease is held");
                    crash(&server_in);
                    *crashed = Some(owner);
                }
                let score = n.score.as_ref().unwrap_or(0);
                n.score = Set(Some(score + 1));
                Ok(())
            })
            .await
            .expect("the write is retried on a new connection and ends");
        let token = (crashed.lock().unwrap().take())
            .unwrap_or_else(|| panic!("round {round}: the crash happened"));
        let kept = psql(
            &server,
            &format!("SELECT count(*) FROM freshlock_lock WHERE owner = '{token}'"),
        );
        match report.outcome {
            UpdateOutcome::Updated(_) => updated += 1,
            UpdateOutcome::LeaseLost => {
                // The grant did not survive the crash: nothing holds its token.
                assert_eq!(kept, "0", "round {round}");
                lost += 1;
            }
            other => panic!("round {round}: {other:?}"),
        }
        let score = psql(&server, "SELECT COALESCE(score, 0) FROM node WHERE id = 1");
        assert_eq!(
            score,
            updated.to_string(),
            "round {round}: acknowledged writes"
        );
    }
    // The WAL writer may write a grant out in the few milliseconds before a crash (it runs every
    // 10 s): one round in a few hundred. Three rounds all flushed would be the old grant.
    assert!(
        lost >= 1,
        "every grant survived its crash ({updated} of {ROUNDS} written): it waited for its flush"
    );
}
