//! Single statements freshlock sends on a pool outside a transaction of its own ([`Autocommit`])
//! and its upkeep statements ([`upkeep`]).

use sea_orm::{ConnectionTrait, DbBackend, Statement};

use super::{
    deadline::{Bounded, DEFAULT_REPLY, Work},
    own::Own,
    pool::Pool,
};

/// A statement that freshlock runs outside a transaction of its own (a load, a lease, a commit
/// outcome's resolution), as one autocommit statement — or, on a pool behind a transaction
/// pooler, inside `BEGIN` … `COMMIT` so that its prepare and execute reach one server
/// connection. Either way the statement commits alone, as it would in autocommit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Autocommit<'a>(pub(crate) &'a Pool);

/// Runs `stmt`, an `UPDATE` or `DELETE` of freshlock's upkeep that finds its rows among many
/// (the job sweep, lease reclaim and prune; the commit-marker sweep off MySQL), alone on `db`: how many
/// rows it changed. One autocommit statement ([`Autocommit`]), except on MySQL/MariaDB: there it
/// runs in a transaction of its own at READ COMMITTED, which takes no gap locks, unlocks each row
/// it reads and does not change, and (in an `UPDATE`) passes over a locked row whose committed
/// version does not match. Under the server's default REPEATABLE READ a statement that scans
/// keeps every row it read locked, and the gaps between them, while it waits for a locked row —
/// a running job's, a write's marker not yet committed — and meanwhile takes skip the rows it
/// holds and inserts wait (CI's MariaDB demo stopped with jobs left: `jobs::store::sweep`).
pub(crate) async fn upkeep(db: &Pool, stmt: Statement) -> Result<u64, sea_orm::DbErr> {
    if db.get_database_backend() != DbBackend::MySql {
        let done = autocommit(db).execute_raw(stmt).await?;
        return Ok(done.rows_affected());
    }
    let own = Own::new(db, DEFAULT_REPLY).with(read_committed());
    own.run(|txn| {
        let stmt = stmt.clone();
        Box::pin(async move { Ok(txn.execute_raw(stmt).await?.rows_affected()) })
    })
    .await
}

/// A transaction's options for READ COMMITTED.
pub(crate) fn read_committed() -> sea_orm::TransactionOptions {
    sea_orm::TransactionOptions {
        isolation_level: Some(sea_orm::IsolationLevel::ReadCommitted),
        ..sea_orm::TransactionOptions::default()
    }
}

/// [`Autocommit`] on `db`.
pub(crate) fn autocommit(db: &Pool) -> Autocommit<'_> {
    Autocommit(db)
}

impl Autocommit<'_> {
    /// Runs `statement` in a transaction of its own ([`Own`]); a failed statement rolls it back.
    async fn wrapped<T>(
        &self,
        statement: impl for<'t> FnMut(&'t Bounded<'t, sea_orm::DatabaseTransaction>) -> Work<'t, T>,
    ) -> Result<T, sea_orm::DbErr> {
        Own::new(self.0, DEFAULT_REPLY).run(statement).await
    }
}

#[async_trait::async_trait]
impl ConnectionTrait for Autocommit<'_> {
    fn get_database_backend(&self) -> DbBackend {
        self.0.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<sea_orm::ExecResult, sea_orm::DbErr> {
        if !self.0.transaction_pooled() {
            return self.0.execute_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.execute_raw(stmt.clone())))
            .await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<sea_orm::ExecResult, sea_orm::DbErr> {
        // A simple-protocol statement is one exchange: no wrapping needed.
        self.0.execute_unprepared(sql).await
    }

    async fn query_one_raw(
        &self,
        stmt: Statement,
    ) -> Result<Option<sea_orm::QueryResult>, sea_orm::DbErr> {
        if !self.0.transaction_pooled() {
            return self.0.query_one_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.query_one_raw(stmt.clone())))
            .await
    }

    async fn query_all_raw(
        &self,
        stmt: Statement,
    ) -> Result<Vec<sea_orm::QueryResult>, sea_orm::DbErr> {
        if !self.0.transaction_pooled() {
            return self.0.query_all_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.query_all_raw(stmt.clone())))
            .await
    }

    fn support_returning(&self) -> bool {
        self.0.support_returning()
    }

    fn is_mock_connection(&self) -> bool {
        self.0.is_mock_connection()
    }
}
