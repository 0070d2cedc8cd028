//! A TCP proxy between the tests and a database server that can cut a connection right after
//! forwarding a chosen message: the only way to make "the commit happened but its reply was lost"
//! reproducible.
#![allow(dead_code)]

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// Which client message a cut follows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CutAfter {
    /// A `COMMIT` (forwarded to the server, then both sides are dropped: the server commits,
    /// the client never hears).
    Commit,
    /// The locked reload (`… FOR UPDATE`): the transaction never reaches its commit.
    Reload,
    /// The first statement of a `table` lease grant (the server takes the lease, the client
    /// never hears). A statement with parameters crosses in two exchanges (prepare, then
    /// execute): the cut follows the client's next message after the one naming the table.
    Grant,
    /// A statement that deletes from the `node` table (with its statement cache off, every
    /// execution carries the text).
    NodeDelete,
    /// A statement that inserts into the `node` table (same).
    NodeInsert,
    /// A statement that updates the `node` table (same).
    NodeUpdate,
    /// A savepoint's statement (`SAVEPOINT`, `RELEASE SAVEPOINT`, `ROLLBACK TO SAVEPOINT`).
    Savepoint,
    /// The writers' sweep of old commit markers (its statement that finds them by age).
    MarkerSweep,
    /// A `BEGIN` (a text query: every transaction's crosses).
    Begin,
    /// A lock wait set for a transaction-scoped lock's statements (PostgreSQL `lock_timeout`,
    /// MySQL/MariaDB `innodb_lock_wait_timeout`).
    LockWait,
    /// A statement on the claims' table (`freshlock_claim`).
    Claim,
    /// A statement that changes a job's row (`UPDATE freshlock_job`).
    JobUpdate,
    /// A `mysql_named` grant (`GET_LOCK`, a text query: every grant carries it).
    GetLock,
    /// A `mysql_named` release (`RELEASE_LOCK`; prepared, so its text crosses once per
    /// connection: in its prepare).
    ReleaseLock,
}

impl CutAfter {
    /// Whether `chunk` (client to server) holds the message: the `COMMIT` statement itself
    /// (not `READ COMMITTED`: the word must end there), a locking read, a write of `node`, a
    /// claim's statement, or a named lock's grant or release.
    fn matches(self, chunk: &[u8]) -> bool {
        let patterns: &[&[u8]] = match self {
            Self::Commit => &[b"COMMIT"],
            Self::Reload => &[b"FOR UPDATE"],
            Self::Grant => &[b"freshlock_lock"],
            Self::NodeDelete => &[b"DELETE FROM \"node\"", b"DELETE FROM `node`"],
            Self::NodeInsert => &[b"INSERT INTO \"node\"", b"INSERT INTO `node`"],
            Self::NodeUpdate => &[b"UPDATE \"node\"", b"UPDATE `node`"],
            Self::Savepoint => &[b"SAVEPOINT"],
            Self::JobUpdate => &[b"UPDATE freshlock_job"],
            Self::MarkerSweep => &[b"FROM freshlock_commit WHERE created_at"],
            Self::Begin => &[b"BEGIN"],
            Self::LockWait => &[b"'lock_timeout'", b"innodb_lock_wait_timeout"],
            Self::Claim => &[b"freshlock_claim"],
            Self::GetLock => &[b"GET_LOCK"],
            Self::ReleaseLock => &[b"RELEASE_LOCK"],
        };
        patterns.iter().any(|pattern| {
            chunk
                .windows(pattern.len())
                .enumerate()
                .any(|(at, window)| {
                    window == *pattern
                        && chunk
                            .get(at + pattern.len())
                            .is_none_or(|next| !next.is_ascii_alphabetic())
                })
        })
    }
}

#[derive(Debug)]
struct Counters {
    /// While true, every connection is dropped and new ones are closed at once: the server is
    /// "down" as far as the client can tell.
    down: tokio::sync::watch::Sender<bool>,
    /// Cut every n-th matching message (0: never).
    every: AtomicU32,
    seen: AtomicU32,
    cuts: AtomicU32,
    /// Round trips of the clients' statements: their first message after each reply of the
    /// server (messages a client sends without waiting in between are one round trip), not
    /// counting pings (PostgreSQL: a `Sync` alone; MySQL: `COM_PING`).
    messages: AtomicU32,
    /// Replies that listed statements freshlock prepared (see [`Proxy::names_listed`]).
    names: AtomicU32,
    /// Client messages that asked for them (see [`Proxy::names_asked`]).
    asked: AtomicU32,
    /// Instead of cutting, black-hole the connection: after the message, nothing passes either
    /// way and both sockets stay open (no FIN, no RST), as behind a firewall that forgot it.
    hole: std::sync::atomic::AtomicBool,
    /// At most this many cuts (`u32::MAX`: no limit).
    limit: AtomicU32,
    /// Spoil a locking take sent after a `COMMIT` in the same message (see
    /// [`Proxy::spoil_after_commit`]), and how many were.
    spoil: std::sync::atomic::AtomicBool,
    spoiled: AtomicU32,
}

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    pub port: u16,
    cut_after: CutAfter,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr, cut_after: CutAfter) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let counters = Arc::new(Counters {
            down: tokio::sync::watch::Sender::new(false),
            every: AtomicU32::new(0),
            seen: AtomicU32::new(0),
            cuts: AtomicU32::new(0),
            messages: AtomicU32::new(0),
            names: AtomicU32::new(0),
            asked: AtomicU32::new(0),
            hole: std::sync::atomic::AtomicBool::new(false),
            limit: AtomicU32::new(u32::MAX),
            spoil: std::sync::atomic::AtomicBool::new(false),
            spoiled: AtomicU32::new(0),
        });
        let shared = Arc::clone(&counters);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *shared.down.borrow() {
                    drop(client);
                    continue;
                }
                let counters = Arc::clone(&shared);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        // Small request/response messages: Nagle's delay would add ~40 ms to
                        // each round trip.
                        let _ = (client.set_nodelay(true), server.set_nodelay(true));
                        let _ = forward(client, server, cut_after, &counters).await;
                    }
                });
            }
        });
        Self {
            port,
            cut_after,
            counters,
            task,
        }
    }

    /// Cuts the connection after every `n`-th matching message (0: never).
    pub fn cut_every(&self, n: u32) {
        self.counters.every.store(n, Ordering::SeqCst);
    }

    /// Cuts after the next matching message only (then no more, until called again).
    pub fn cut_once(&self) {
        let cuts = self.counters.cuts.load(Ordering::SeqCst);
        self.counters.limit.store(cuts + 1, Ordering::SeqCst);
        self.cut_every(1);
    }

    /// Black-holes (`true`) instead of cutting: a silent partition, not a closed connection.
    pub fn black_hole(&self, on: bool) {
        self.counters.hole.store(on, Ordering::SeqCst);
    }

    /// While `on`, a client message that sends a locking take after a `COMMIT` reaches the
    /// server with that take's text spoiled, the same length (the message's framing holds):
    /// `SKIP LOCKEX`, or on PostgreSQL a statement name no statement has (`EXECUTE
    /// freshlock_g…`) — so the server commits and then fails the take.
    pub fn spoil_after_commit(&self, on: bool) {
        self.counters.spoil.store(on, Ordering::SeqCst);
    }

    /// How many messages [`spoil_after_commit`](Self::spoil_after_commit) spoiled.
    pub fn spoiled(&self) -> u32 {
        self.counters.spoiled.load(Ordering::SeqCst)
    }

    /// Takes the "server" down (every connection dropped, new ones closed at once) or back up.
    pub fn set_down(&self, down: bool) {
        self.counters.down.send_replace(down);
    }

    /// How many replies so far listed the names of statements freshlock prepared on their
    /// connection (`freshlock_` and 16 hex digits): PostgreSQL's `pg_prepared_statements` read.
    pub fn names_listed(&self) -> u32 {
        self.counters.names.load(Ordering::SeqCst)
    }

    /// How many client messages so far asked the server which statements their connection
    /// prepared (named `pg_prepared_statements`), read or not: the server plans the read in
    /// every message that names it.
    pub fn names_asked(&self) -> u32 {
        self.counters.asked.load(Ordering::SeqCst)
    }

    /// How many round trips the clients' statements made so far (see `Counters::messages`).
    pub fn round_trips(&self) -> u32 {
        self.counters.messages.load(Ordering::SeqCst)
    }

    /// How many connections were cut.
    pub fn cuts(&self) -> u32 {
        self.counters.cuts.load(Ordering::SeqCst)
    }

    /// `url` with its host and port replaced by this proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let user = authority
            .rsplit_once('@')
            .map_or(String::new(), |(user, _)| format!("{user}@"));
        format!("{scheme}://{user}127.0.0.1:{}/{path}", self.port)
    }
}

/// A pool of one connection to `url` through `proxy` (`schema` on the search path), without
/// the checkout ping — every message the proxy sees is a call's — with `change` made to its
/// options last.
pub async fn one_connection(
    proxy: &Proxy,
    url: &str,
    schema: Option<&str>,
    change: impl FnOnce(&mut sea_orm::ConnectOptions),
) -> sea_orm::DatabaseConnection {
    let mut options = sea_orm::ConnectOptions::new(proxy.url(url));
    options
        .max_connections(1)
        .min_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(std::time::Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = schema {
        options.set_schema_search_path(schema);
    }
    change(&mut options);
    sea_orm::Database::connect(options).await.expect("connect")
}

/// The address a URL's host and port name (loopback only in these tests).
pub fn target(url: &str) -> SocketAddr {
    let rest = url.split_once("://").expect("a URL").1;
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port.parse().expect("host:port as an address")
}

async fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    cut_after: CutAfter,
    counters: &Counters,
) -> std::io::Result<()> {
    let (mut up, mut down) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let mut outage = counters.down.subscribe();
    // A grant was prepared: cut after the next client message (its execution).
    let mut armed = false;
    // The server answered since the client last wrote (see `Counters::messages`).
    let mut replied = true;
    loop {
        tokio::select! {
            changed = outage.changed() => {
                if changed.is_err() || *outage.borrow() {
                    return Ok(()); // the outage drops every connection
                }
            }
            read = client.read(&mut up) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                if counters.spoil.load(Ordering::SeqCst) && spoil_after_commit(&mut up[..n]) {
                    counters.spoiled.fetch_add(1, Ordering::SeqCst);
                }
                let chunk = &up[..n];
                // A round trip starts with the client's first message after a reply.
                // A PostgreSQL `Sync` alone is sqlx's ping (it pings every connection it is given
                // back, in a task of its own): not a statement.
                // A MySQL `COM_PING` (sequence 0, command 0x0e) is sqlx's ping there.
                let ping = chunk == b"S\0\0\0\x04" || chunk == b"\x01\0\0\0\x0e";
                if std::mem::take(&mut replied) && !ping {
                    counters.messages.fetch_add(1, Ordering::SeqCst);
                }
                const ASKS: &[u8] = b"pg_prepared_statements";
                if (chunk.windows(ASKS.len())).any(|window| window == ASKS) {
                    counters.asked.fetch_add(1, Ordering::SeqCst);
                }
                let every = counters.every.load(Ordering::SeqCst);
                let under_limit =
                    counters.cuts.load(Ordering::SeqCst) < counters.limit.load(Ordering::SeqCst);
                let mut cut = std::mem::take(&mut armed)
                    || every > 0
                        && under_limit
                        && cut_after.matches(chunk)
                        && (counters.seen.fetch_add(1, Ordering::SeqCst) + 1)
                            .is_multiple_of(every);
                if cut && cut_after == CutAfter::Grant && cut_after.matches(chunk) {
                    (armed, cut) = (true, false);
                }
                server.write_all(chunk).await?;
                if cut && cut_after == CutAfter::Reload {
                    counters.cuts.fetch_add(1, Ordering::SeqCst);
                    return Ok(()); // both sockets dropped mid-transaction
                }
                if cut && counters.hole.load(Ordering::SeqCst) {
                    counters.cuts.fetch_add(1, Ordering::SeqCst);
                    // Both sockets stay open; whatever either side sends is swallowed. The
                    // server may end its side (its idle-transaction timeout): the client is not
                    // told either, as behind a real partition.
                    let mut server_open = true;
                    loop {
                        tokio::select! {
                            read = client.read(&mut up) => if read? == 0 { return Ok(()) },
                            read = server.read(&mut down), if server_open => {
                                server_open = matches!(read, Ok(n) if n > 0);
                            }
                        }
                    }
                }
                if cut {
                    // The server gets the message and then the end of the stream (no reset that
                    // could discard it); its reply is read here and thrown away, and the client
                    // sees its connection close instead.
                    server.flush().await?;
                    server.shutdown().await?;
                    counters.cuts.fetch_add(1, Ordering::SeqCst);
                    let drain = async {
                        while server.read(&mut down).await.is_ok_and(|n| n > 0) {}
                    };
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
                    return Ok(());
                }
            }
            read = server.read(&mut down) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                client.write_all(&down[..n]).await?;
                replied = true;
                if lists_prepared_names(&down[..n]) {
                    counters.names.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// Spoils the first take after a `COMMIT` in `chunk` (see [`Proxy::spoil_after_commit`]):
/// whether there was one.
fn spoil_after_commit(chunk: &mut [u8]) -> bool {
    const COMMIT: &[u8] = b"COMMIT";
    // MySQL/MariaDB's take, or PostgreSQL's `PREPARE` of it.
    const SKIP: &[u8] = b"SKIP LOCKED";
    // PostgreSQL's take by name.
    const EXECUTE: &[u8] = b"EXECUTE freshlock_";
    let find = |chunk: &[u8], what: &[u8]| chunk.windows(what.len()).position(|w| w == what);
    // The word `COMMIT`, not `READ COMMITTED`.
    let Some(commit) = (chunk.windows(COMMIT.len() + 1))
        .position(|w| w.starts_with(COMMIT) && !w[COMMIT.len()].is_ascii_alphabetic())
    else {
        return false;
    };
    let after = commit + COMMIT.len();
    // `SKIP LOCKEX` (a syntax error), or a name no statement has (`freshlock_g…`).
    let skip = find(&chunk[after..], SKIP).map(|at| at + SKIP.len() - 1);
    let execute = find(&chunk[after..], EXECUTE).map(|at| at + EXECUTE.len());
    let (at, spoilt) = match (skip, execute) {
        (Some(skip), Some(execute)) if execute < skip => (execute, b'g'),
        (Some(skip), _) => (skip, b'X'),
        (None, Some(execute)) => (execute, b'g'),
        (None, None) => return false,
    };
    chunk[after + at] = spoilt;
    true
}

/// Whether a reply holds the name of a statement freshlock prepared: `freshlock_` and 16 hex
/// digits.
fn lists_prepared_names(chunk: &[u8]) -> bool {
    const PREFIX: &[u8] = b"freshlock_";
    chunk.windows(PREFIX.len() + 16).any(|window| {
        window.starts_with(PREFIX)
            && (window[PREFIX.len()..].iter())
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    })
}

/// `options` whose sessions the server ends once they sit in a transaction for a second (what
/// the library's `deadline.rs` tells users to set), with no prepared-statement cache on
/// PostgreSQL (its server options replace an earlier statement-cache setting).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(unused_mut))]
pub fn idle_transactions_end(mut options: sea_orm::ConnectOptions) -> sea_orm::ConnectOptions {
    #[cfg(feature = "postgres")]
    options.map_sqlx_postgres_opts(|o| {
        o.statement_cache_capacity(0)
            .options([("idle_in_transaction_session_timeout", "1000")])
    });
    #[cfg(feature = "mysql")]
    options.map_sqlx_mysql_pool_opts(|pool| {
        use sea_orm::sqlx::Executor;
        pool.after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION idle_transaction_timeout = 1")
                    .await
                    .map(|_| ())
            })
        })
    });
    options
}
