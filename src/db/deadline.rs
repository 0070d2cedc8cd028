//! Every round trip of a locked write has a deadline.
//!
//! A reply that never comes — a silent network partition, a firewall or NAT that forgot the
//! connection, a primary that vanished — leaves no error on the socket: the read would wait for
//! TCP keepalive (two hours on Linux), holding the section's lock all that while. And the peer
//! may be a proxy whose kernel still acknowledges every byte, so no socket option
//! (`TCP_USER_TIMEOUT`, keepalive) would notice; sqlx sets none anyway. So the deadline is the
//! client's own: a statement, `BEGIN`, `COMMIT` or `ROLLBACK` whose reply does not come within
//! [`crate::LockPolicy::reply_timeout`] fails with an error that reads as a lost connection —
//! freshlock's own statements and those the entity's hooks (`before_save`, `after_delete`, …)
//! send on the write's transaction alike ([`Bounded`]); the bound is per round trip, so a hook
//! may send several.
//! Before a `COMMIT` that is transient (the section runs again on another connection); for a
//! `COMMIT` it leaves the outcome in doubt, and the commit marker resolves it on another
//! connection (see `commit/`), as after a cut. The section then ends and releases its lock, so
//! the key serves calls again within the bound.
//!
//! A `BEGIN` is never cut by a deadline: it ends in a task of its own (`detach.rs`), since a
//! connection whose `BEGIN` reply was not read would go back to the pool inside a transaction
//! nobody ends. Every other statement may be cut: sea-orm then queues a rollback on its
//! connection, and a lost `COMMIT` is resolved by its marker.
//!
//! The abandoned connection is dropped, not reused: sea-orm queues a rollback on it and sqlx's
//! release check waits on the same dead socket, so its pool slot stays taken until the OS gives
//! up on the socket (TCP retransmissions, about 15 minutes when the peer is really gone). Size
//! pools with headroom where partitions happen; and set the server's
//! `idle_in_transaction_session_timeout` (PostgreSQL), `idle_transaction_timeout` (MariaDB) or
//! `wait_timeout` (MySQL) so that a transaction whose client vanished before its `COMMIT` does
//! not keep its row locks (the write's next attempt waits for them until then).

use std::{
    future::Future,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DbBackend, DbErr, ExecResult, QueryResult, Statement};

use super::failure::{is_no_reply, no_reply};

/// The bound used where no policy applies (claims): [`crate::LockPolicy`]'s default.
pub(crate) const DEFAULT_REPLY: Duration = Duration::from_secs(10);

/// The bound on one reply for a lease of `ttl`: a third of it, between 1 s and
/// [`DEFAULT_REPLY`] (the same as [`crate::LockPolicy::reply_deadline`]'s default).
pub(crate) fn reply_bound(ttl: Duration) -> Duration {
    (ttl / 3).clamp(Duration::from_secs(1), DEFAULT_REPLY)
}

/// `round_trip`, or a lost-connection error when its reply does not come within `bound` (the
/// future is dropped then, with whatever connection it held).
pub(crate) async fn within<T>(
    bound: Duration,
    round_trip: impl Future<Output = Result<T, DbErr>>,
) -> Result<T, DbErr> {
    match tokio::time::timeout(bound, round_trip).await {
        Ok(result) => result,
        Err(_) => Err(no_reply(bound)),
    }
}

/// Work given a connection whose every round trip is bounded ([`Bounded`]): a transaction of
/// its own (`own.rs`), a savepoint, a statement that commits alone.
pub(crate) type Work<'c, T> = std::pin::Pin<Box<dyn Future<Output = Result<T, DbErr>> + Send + 'c>>;

/// A connection whose every round trip waits at most a bound: a statement whose reply does
/// not come within it fails as a lost connection instead of waiting on a silent partition.
///
/// A write hands it to the statements it does not send itself — the entity's hooks, a combined
/// batch's, the generic insert and delete — so that none of them can wait with the key's lock
/// held; [`crate::claim::Claims::finish_with`] hands its work the claim's transaction as one. It is a
/// [`ConnectionTrait`], so sea-orm's queries and `ActiveModel` writes take it as they take the
/// transaction; [`inner`](Self::inner) is the connection itself, for what needs more (a
/// savepoint's `begin`), with no bound.
#[derive(Debug)]
pub struct Bounded<'c, C> {
    on: &'c C,
    bound: Duration,
    /// Whether a round trip went without reply: nothing more is to be sent on the connection.
    silent: AtomicBool,
}

impl<'c, C> Bounded<'c, C> {
    /// `on`, each of its round trips bounded by `bound`.
    pub(crate) fn new(on: &'c C, bound: Duration) -> Self {
        Self {
            on,
            bound,
            silent: AtomicBool::new(false),
        }
    }

    /// The connection itself (its round trips are not bounded).
    pub fn inner(&self) -> &'c C {
        self.on
    }

    /// How long each round trip may wait for its reply.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Whether a round trip got no reply within the bound: the connection has gone silent,
    /// and nothing more (a rollback included) is to be sent on it.
    pub(crate) fn went_silent(&self) -> bool {
        self.silent.load(Ordering::Relaxed)
    }

    /// `round_trip` within the bound, noting a reply that did not come.
    async fn trip<T>(
        &self,
        round_trip: impl Future<Output = Result<T, DbErr>>,
    ) -> Result<T, DbErr> {
        let result = within(self.bound, round_trip).await;
        if matches!(&result, Err(e) if is_no_reply(e)) {
            self.silent.store(true, Ordering::Relaxed);
        }
        result
    }
}

#[async_trait]
impl<C: ConnectionTrait> ConnectionTrait for Bounded<'_, C> {
    fn get_database_backend(&self) -> DbBackend {
        self.on.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.trip(self.on.execute_raw(stmt)).await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.trip(self.on.execute_unprepared(sql)).await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        self.trip(self.on.query_one_raw(stmt)).await
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        self.trip(self.on.query_all_raw(stmt)).await
    }

    fn support_returning(&self) -> bool {
        self.on.support_returning()
    }

    fn is_mock_connection(&self) -> bool {
        self.on.is_mock_connection()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::failure::{Failure, classify, in_doubt};

    #[tokio::test(start_paused = true)]
    async fn a_reply_that_never_comes_is_a_lost_connection() {
        let never = std::future::pending::<Result<(), DbErr>>();
        let error = within(Duration::from_secs(3), never).await.unwrap_err();
        assert_eq!(classify(&error), Failure::ConnectionLost);
        assert!(in_doubt(&error), "a COMMIT without reply is in doubt");
        assert!(
            is_no_reply(&error),
            "told from a connection that failed at once"
        );
        assert!(
            error
                .to_string()
                .contains("no reply from the database within 3s")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_in_time_is_passed_through() {
        let late = async {
            tokio::time::sleep(Duration::from_millis(2_999)).await;
            Ok::<_, DbErr>(7)
        };
        assert_eq!(within(Duration::from_secs(3), late).await.unwrap(), 7);
    }
}
