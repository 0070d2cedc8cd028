//! A 3-node MariaDB Galera cluster (multi-primary): writers spread over all three nodes keep
//! every update.
//!
//! The cluster is this test's own: three `mariadbd` on their own ports and data directories
//! (galera-4's `libgalera_smm.so`, rsync state transfer), the first bootstrapped with
//! `--wsrep-new-cluster`; the shared server is never touched. On Galera a row lock is local to
//! its node: two nodes can both "hold" a row, and only certification stands between their
//! writes. Galera does not make that a lost-update guarantee (MDEV-29044): with a lock per node
//! (`local` per node, as separate processes would have), this test's transfers once ended with
//! the accounts' sum at 825 and once at 773 instead of 800, every node agreeing. So exclusion
//! across nodes must come from a lease the cluster itself orders: `table` (or `redis`); `row` and
//! `mysql_named` (node-local row locks and `GET_LOCK`) are refused on a cluster. Checked here:
//! - no lost update: one row incremented by 2 tasks per node, with `local` shared by all the
//!   nodes' sessions (one process writing through every node) and with `table` (a lease per
//!   node's process): the row holds exactly the acknowledged increments;
//! - transfers between 8 accounts with `locked_update_pair` on all nodes, under `table`: the sum
//!   is exact, no balance negative;
//! - claims: 40 jobs claimed and finished by workers on all nodes: each finished exactly once;
//! - a node killed (`kill -9`) mid-run, under `table`: the other two keep going; nothing
//!   acknowledged is lost, nothing is applied twice (the counter is between the acknowledged and
//!   the acknowledged plus the unknown outcomes of writes that were in flight on the killed
//!   node);
//! - `row` and `mysql_named` are refused there at connect with `LockError::Unsupported`
//!   (`GET_LOCK` is node-local too: two nodes both get it).
//!
//! The nodes run with `wsrep_sync_wait = 1` (causal reads): a read on one node waits until that
//! node has applied what the cluster committed before it, so a reload under `local` never misses
//! a write another node already acknowledged. `FRESHLOCK_GALERA_SYNC_WAIT=0` runs the nodes
//! without it, to study what freshlock's own reads meet there. The checks themselves always read
//! causally (a connection of their own with `wsrep_sync_wait = 1`): a check read on another node
//! right after the writers finish could otherwise miss the last acknowledged write (seen here
//! without causal reads: the counter +119 for 120 acknowledged).
//!
//! Needs root (mariadbd runs as `mysql`) and galera-4; runs where `DATABASE_URL_MYSQL` is set
//! (the server suites), skips elsewhere with a message.
#![cfg(feature = "mysql")]

#[path = "common/servers.rs"]
mod servers;

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use entity::{account, node};
use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::LocalLock;
use freshlock::{Error, LockBackend, LockError, LockKind, LockPolicy, OnLockFailure, Session};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityTrait, Set,
    Statement,
};

const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// One node: its directory, client port and process.
struct Node {
    dir: PathBuf,
    port: u16,
    child: Mutex<Option<Child>>,
}

impl Node {
    fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    fn mariadb(&self, sql: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args(["-h", "127.0.0.1", "-P", &self.port.to_string(), "-uroot"])
            .args(["-N", "-B", "-e", sql])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn launch(&self, bootstrap: bool) {
        let mut command = Command::new("mariadbd");
        command.arg(format!("--defaults-file={}/my.cnf", self.dir.display()));
        if bootstrap {
            command.arg("--wsrep-new-cluster");
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd");
        *self.child.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        while self
            .mariadb("SHOW STATUS LIKE 'wsrep_local_state_comment'")
            .as_deref()
            != Some("wsrep_local_state_comment\tSynced")
        {
            assert!(
                Instant::now() < deadline,
                "Galera node on {} did not sync; its log: {}",
                self.port,
                std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three nodes, killed and removed on drop.
struct Cluster {
    nodes: Vec<Node>,
}

impl Cluster {
    fn start() -> Self {
        let galera: Vec<u16> = (0..3).map(|_| servers::free_port()).collect();
        let address = galera
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let nodes: Vec<Node> = galera
            .iter()
            .map(|&g| {
                let (port, ist, sst) = (
                    servers::free_port(),
                    servers::free_port(),
                    servers::free_port(),
                );
                let dir = std::env::temp_dir().join(servers::unique("galera"));
                let data = dir.join("data");
                std::fs::create_dir_all(&data).unwrap();
                // A temporary directory of its own (see `private_mariadb::private_tmpdir`).
                let tmp = dir.join("tmp");
                std::fs::create_dir_all(&tmp).unwrap();
                std::fs::set_permissions(
                    &tmp,
                    std::os::unix::fs::PermissionsExt::from_mode(0o1777),
                )
                .unwrap();
                let installed = Command::new("mariadb-install-db")
                    .args([
                        "--user=mysql",
                        &format!("--datadir={}", data.display()),
                        "--auth-root-authentication-method=normal",
                        "--skip-test-db",
                        &format!("--tmpdir={}", tmp.display()),
                    ])
                    .output()
                    .unwrap();
                assert!(installed.status.success(), "mariadb-install-db");
                let d = dir.display();
                // `FRESHLOCK_GALERA_SYNC_WAIT=0` runs the nodes without causal reads, to study
                // what freshlock sees there (the tests' own check reads then may be stale).
                let sync_wait =
                    std::env::var("FRESHLOCK_GALERA_SYNC_WAIT").unwrap_or_else(|_| "1".to_owned());
                std::fs::write(
                    dir.join("my.cnf"),
                    format!(
                        "[mysqld]\nport = {port}\nsocket = {d}/sock\npid-file = {d}/pid\n\
                         datadir = {d}/data\nbind-address = 127.0.0.1\nuser = mysql\n\
                         log-error = {d}/log\ntmpdir = {d}/tmp\n\
                         innodb_flush_log_at_trx_commit = 2\n\
                         binlog_format = ROW\ninnodb_autoinc_lock_mode = 2\n\
                         default_storage_engine = InnoDB\nwsrep_on = ON\n\
                         wsrep_provider = {PROVIDER}\nwsrep_cluster_name = freshlock\n\
                         wsrep_cluster_address = gcomm://{address}\n\
                         wsrep_node_address = 127.0.0.1:{g}\n\
                         wsrep_node_incoming_address = 127.0.0.1:{port}\n\
                         wsrep_provider_options = \"base_port={g};ist.recv_addr=127.0.0.1:{ist}\"\n\
                         wsrep_sst_method = rsync\nwsrep_sst_receive_address = 127.0.0.1:{sst}\n\
                         wsrep_sync_wait = {sync_wait}\n"
                    ),
                )
                .unwrap();
                assert!(
                    Command::new("chown")
                        .args(["-R", "mysql:mysql", &d.to_string()])
                        .status()
                        .unwrap()
                        .success()
                );
                Node {
                    dir,
                    port,
                    child: Mutex::new(None),
                }
            })
            .collect();
        let cluster = Self { nodes };
        for (i, node) in cluster.nodes.iter().enumerate() {
            node.launch(i == 0);
        }
        assert_eq!(
            cluster.nodes[0]
                .mariadb("SHOW STATUS LIKE 'wsrep_cluster_size'")
                .as_deref(),
            Some("wsrep_cluster_size\t3")
        );
        assert!(
            cluster.nodes[0]
                .mariadb("CREATE DATABASE test CHARACTER SET utf8mb4")
                .is_some()
        );
        cluster
    }

    /// One pool per node, the schema migrated through the first. A connection is waited for
    /// at most 2 s: the killed node's writers give up soon (nothing else waits that long here).
    async fn pools(&self) -> Vec<DatabaseConnection> {
        let mut pools = Vec::new();
        for node in &self.nodes {
            let mut options = ConnectOptions::new(node.url());
            options
                .max_connections(6)
                .acquire_timeout(Duration::from_secs(2))
                .sqlx_logging(false);
            pools.push(Database::connect(options).await.expect("connect a node"));
        }
        Migrator::up(&pools[0], None).await.expect("migrate");
        // DDL is replicated in total order: every node has the tables now.
        pools
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &self.nodes {
            node.kill();
        }
        for node in &self.nodes {
            let _ = std::fs::remove_dir_all(&node.dir);
        }
    }
}

/// The lock of one node's writers: `local` is `shared` (one process writing through every
/// node); any other kind is connected per node, as each node's own process would.
async fn backend(
    kind: LockKind,
    db: &DatabaseConnection,
    url: &str,
    shared: &Arc<dyn LockBackend>,
) -> Arc<dyn LockBackend> {
    match kind {
        LockKind::Local => Arc::clone(shared),
        kind => kind.connect(db, url, None).await.expect("backend"),
    }
}

/// The writers' policy: certification conflicts run again (up to 30 attempts).
fn policy() -> LockPolicy {
    LockPolicy::default()
        .with_write_attempts(30)
        .with_on_failure(OnLockFailure::Proceed)
}

fn session(db: &DatabaseConnection, lock: Arc<dyn LockBackend>, policy: LockPolicy) -> Session {
    Session::builder(db.clone())
        .lock(lock)
        .policy(policy)
        .build()
        .expect("session")
}

#[derive(Default)]
struct Tally {
    /// Attempts beyond the first (certification failures, deadlocks: run again).
    retried: AtomicU32,
    acknowledged: AtomicU32,
    unknown: AtomicU32,
    failed: AtomicU32,
}

/// 2 tasks per node × `rounds` increments of node 1; `kill_after`: kill node 3 once that many
/// increments were acknowledged.
async fn increments(
    cluster: &Cluster,
    pools: &[DatabaseConnection],
    kind: LockKind,
    rounds: u32,
    kill_after: Option<u32>,
) -> (Arc<Tally>, i32) {
    let before = score(&cluster.nodes[0].url()).await;
    let tally = Arc::new(Tally::default());
    let shared: Arc<dyn LockBackend> = Arc::new(LocalLock::new());
    let policy = match kill_after {
        // Under `table`, a lease held by a writer of the killed node runs out in 6 s, and the
        // killed node's writers give up after 10 attempts (each waits for a connection).
        Some(_) => policy()
            .with_ttl(Duration::from_secs(6))
            .with_reply_timeout(Duration::from_secs(10))
            .with_write_attempts(10),
        None => policy(),
    };
    let mut tasks = Vec::new();
    for (node, db) in pools.iter().enumerate() {
        let lock = backend(kind, db, &cluster.nodes[node].url(), &shared).await;
        for _ in 0..2 {
            let (session, tally) = (
                session(db, Arc::clone(&lock), policy.clone()),
                Arc::clone(&tally),
            );
            tasks.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let result = session
                        .repository::<node::Entity>()
                        .locked_update(1, |n| {
                            let s = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(s + 1));
                            Ok(())
                        })
                        .await;
                    match result {
                        Ok(report) if report.outcome.is_updated() => {
                            tally.acknowledged.fetch_add(1, Ordering::SeqCst);
                            tally
                                .retried
                                .fetch_add(report.attempts - 1, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            tally.unknown.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        Err(_) if node == 2 && kill_after.is_some() => {
                            tally.failed.fetch_add(1, Ordering::SeqCst);
                            return; // The killed node's writers stop.
                        }
                        other => panic!("node {node}: {other:?}"),
                    }
                }
            }));
        }
    }
    if let Some(after) = kill_after {
        let deadline = Instant::now() + Duration::from_secs(120);
        while tally.acknowledged.load(Ordering::SeqCst) < after {
            assert!(Instant::now() < deadline, "no progress before the kill");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster.nodes[2].kill();
    }
    for task in tasks {
        task.await.expect("writer");
    }
    let after = score(&cluster.nodes[0].url()).await;
    (tally, after - before)
}

async fn score(url: &str) -> i32 {
    let score = causal(
        url,
        "SELECT CAST(COALESCE(score, 0) AS SIGNED) FROM node WHERE id = 1",
    );
    i32::try_from(score.await).expect("a score")
}

/// One number read by `select` on the node at `url` with causal reads: a connection of its own
/// (`SET SESSION wsrep_sync_wait = 1`, then closed), so the node first applies what the cluster
/// committed before the read, the tests' checks are exact whatever the nodes' own setting (see
/// `FRESHLOCK_GALERA_SYNC_WAIT`), and no pooled session is changed.
async fn causal(url: &str, select: &str) -> i64 {
    let mut options = ConnectOptions::new(url);
    options.max_connections(1).sqlx_logging(false);
    let db = Database::connect(options).await.expect("connect a node");
    db.execute_unprepared("SET SESSION wsrep_sync_wait = 1")
        .await
        .expect("causal reads");
    let value = db
        .query_one_raw(Statement::from_string(DbBackend::MySql, select))
        .await
        .expect("read")
        .expect("a row")
        .try_get_by_index::<i64>(0)
        .expect("a number");
    db.close().await.expect("close");
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_on_every_node_lose_nothing() {
    if servers::url(servers::MYSQL).is_none() {
        return;
    }
    let cluster = Cluster::start();
    let pools = cluster.pools().await;
    node::Entity::insert(node::ActiveModel::fresh(1))
        .exec(&pools[0])
        .await
        .expect("seed node");

    // No lost update, per backend.
    for kind in [LockKind::Local, LockKind::Table] {
        let (tally, gained) = increments(&cluster, &pools, kind, 20, None).await;
        let acknowledged = tally.acknowledged.load(Ordering::SeqCst);
        let retried = tally.retried.load(Ordering::SeqCst);
        eprintln!(
            "galera {kind}: {acknowledged} acknowledged, counter +{gained}, {retried} attempts run again"
        );
        assert_eq!(acknowledged, 120, "{kind}: every call acknowledged");
        assert_eq!(
            gained as u32, acknowledged,
            "{kind}: nothing lost, nothing doubled"
        );
    }

    // Transfers on all nodes.
    let accounts = (1..=8).map(|id| account::ActiveModel {
        id: Set(id),
        balance: Set(100),
    });
    account::Entity::insert_many(accounts)
        .exec(&pools[0])
        .await
        .expect("seed accounts");
    // Every transfer's last attempt, as it ran: on a failure, two transfers that read the same
    // balance of one account (a stale read) show in it.
    let journal = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (node, db) in pools.iter().enumerate() {
        // A `table` lease per node, as each node's own process would take it.
        let lock = LockKind::Table
            .connect(db, &cluster.nodes[node].url(), None)
            .await
            .expect("backend");
        let session = session(db, lock, policy());
        let journal = Arc::clone(&journal);
        tasks.push(tokio::spawn(async move {
            let mut seed = 7 + node as u64;
            for _ in 0..30 {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let from = (seed >> 33) % 8 + 1;
                let to = (from + (seed >> 40) % 7) % 8 + 1;
                let amount = ((seed >> 20) % 30) as i64 + 1;
                let read = Arc::new(Mutex::new((0, 0)));
                let seen = Arc::clone(&read);
                let report = session
                    .repository::<account::Entity>()
                    .locked_update_pair(from as i32, to as i32, move |a, b| {
                        let (have, get) = (*a.balance.as_ref(), *b.balance.as_ref());
                        *seen.lock().unwrap() = (have, get);
                        if have >= amount {
                            a.balance = Set(have - amount);
                            b.balance = Set(get + amount);
                        }
                        Ok(())
                    })
                    .await
                    .unwrap_or_else(|e| panic!("transfer on node {node}: {e}"));
                let (have, get) = *read.lock().unwrap();
                journal.lock().unwrap().push(format!(
                    "node {node}: {from}->{to} {amount}, read ({have}, {get}), {} attempts",
                    report.attempts
                ));
            }
        }));
    }
    for task in tasks {
        task.await.expect("transfers");
    }
    // On a failure, what every node holds: nodes that disagree are a stale read (a node behind
    // the others), nodes that agree on a wrong sum are a lost update.
    let mut per_node = Vec::new();
    for db in &pools {
        let mut balances: Vec<(i32, i64)> = account::Entity::find()
            .all(db)
            .await
            .expect("accounts")
            .iter()
            .map(|a| (a.id, a.balance))
            .collect();
        balances.sort_unstable();
        per_node.push(balances);
    }
    let sum = causal(
        &cluster.nodes[1].url(),
        "SELECT CAST(SUM(balance) AS SIGNED) FROM bank_account",
    )
    .await;
    assert_eq!(
        sum,
        800,
        "the sum is exact; balances on each node: {per_node:?}; transfers:\n{}",
        journal.lock().unwrap().join("\n")
    );
    let negative = causal(
        &cluster.nodes[1].url(),
        "SELECT COUNT(*) FROM bank_account WHERE balance < 0",
    )
    .await;
    assert_eq!(negative, 0, "no balance negative: {per_node:?}");

    // Claims: every job finished exactly once.
    let finished = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for db in &pools {
        for _ in 0..2 {
            let (claims, finished) = (Claims::new(db.clone()), Arc::clone(&finished));
            tasks.push(tokio::spawn(async move {
                for job in 0..40 {
                    let key = freshlock::lock::LockName::new(format!("job:{job}")).expect("name");
                    loop {
                        match claims.claim(&key, Duration::from_secs(60)).await {
                            Ok(ClaimOutcome::Claimed(claim)) => match claims.finish(&claim).await {
                                Ok(FinishOutcome::Finished) => {
                                    finished.fetch_add(1, Ordering::SeqCst);
                                    break;
                                }
                                Ok(other) => panic!("finish: {other:?}"),
                                Err(e) if e.is_transient() => continue,
                                Err(e) => panic!("finish: {e}"),
                            },
                            Ok(ClaimOutcome::Done) => break,
                            Ok(ClaimOutcome::Busy) => {
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                            Ok(other) => panic!("claim: {other:?}"),
                            Err(e) if e.is_transient() => {}
                            Err(e) => panic!("claim: {e}"),
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("claims");
    }
    assert_eq!(
        finished.load(Ordering::SeqCst),
        40,
        "each job finished exactly once"
    );

    // GET_LOCK is node-local: two nodes both hold one name.
    let get = |db: &DatabaseConnection| {
        let db = db.clone();
        async move {
            db.query_one_raw(Statement::from_string(
                DbBackend::MySql,
                "SELECT GET_LOCK('freshlock_galera_probe', 0) AS got",
            ))
            .await
            .expect("GET_LOCK")
            .expect("row")
            .try_get::<i64>("", "got")
            .expect("got")
        }
    };
    assert_eq!(
        (get(&pools[0]).await, get(&pools[1]).await),
        (1, 1),
        "GET_LOCK is per node"
    );
    // Node-local locks are refused on a cluster: `GET_LOCK`'s and a row's alike.
    for kind in [LockKind::MySqlNamed, LockKind::Row] {
        let refused = kind.connect(&pools[0], &cluster.nodes[0].url(), None).await;
        assert!(
            matches!(refused, Err(LockError::Unsupported { .. })),
            "{kind}: {refused:?}"
        );
    }

    // A node killed mid-run.
    let (tally, gained) = increments(&cluster, &pools, LockKind::Table, 60, Some(60)).await;
    let (acknowledged, unknown, failed) = (
        tally.acknowledged.load(Ordering::SeqCst),
        tally.unknown.load(Ordering::SeqCst),
        tally.failed.load(Ordering::SeqCst),
    );
    eprintln!(
        "galera, node 3 killed: {acknowledged} acknowledged, {unknown} unknown, {failed} failed, counter +{gained}"
    );
    let gained = gained as u32;
    assert!(
        acknowledged <= gained && gained <= acknowledged + unknown,
        "nothing acknowledged lost, nothing doubled: +{gained} for {acknowledged} acknowledged and {unknown} unknown"
    );
    assert!(
        acknowledged >= 4 * 60,
        "the two live nodes' writers finished"
    );
}
