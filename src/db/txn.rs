//! The transaction a [`crate::Tx`] and a keyed job's attempt run in: sea-orm's, or one on a
//! connection freshlock holds (`held.rs`: a job's attempt in fewer round trips).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::sync::Arc;

use async_trait::async_trait;
use sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, ExecResult, QueryResult, Statement,
};

#[cfg(any(feature = "postgres", feature = "mysql"))]
use super::held::Held;

/// A transaction: sea-orm's, or a held connection's (see the module docs).
#[derive(Debug)]
pub(crate) enum Txn {
    /// sea-orm's transaction (or a savepoint of it).
    Sea(DatabaseTransaction),
    /// A transaction on a held connection, shared with the attempt that ends it.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    Held(Arc<Held>),
}

impl From<DatabaseTransaction> for Txn {
    fn from(txn: DatabaseTransaction) -> Self {
        Self::Sea(txn)
    }
}

impl Txn {
    /// sea-orm's transaction, when it is one.
    pub(crate) fn sea(&self) -> Option<&DatabaseTransaction> {
        match self {
            Self::Sea(txn) => Some(txn),
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Self::Held(_) => None,
        }
    }

    /// sea-orm's transaction that a caller made this of ([`From`]) and takes back.
    ///
    /// # Panics
    /// Never for a transaction made of sea-orm's: only a keyed job's attempt in fewer round
    /// trips (`jobs/flights/`) makes one of a held connection, and it never asks.
    pub(crate) fn into_sea(self) -> DatabaseTransaction {
        match self {
            Self::Sea(txn) => txn,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Self::Held(_) => unreachable!("a held transaction is never handed to sea-orm's owner"),
        }
    }
}

/// Runs `$body` with `$conn` bound to the transaction's connection, whichever it is.
macro_rules! on {
    ($txn:expr, $conn:ident => $body:expr) => {
        match $txn {
            Txn::Sea($conn) => $body,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Txn::Held(held) => {
                let $conn = &**held;
                $body
            }
        }
    };
}

#[async_trait]
impl ConnectionTrait for Txn {
    fn get_database_backend(&self) -> DbBackend {
        on!(self, conn => conn.get_database_backend())
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        on!(self, conn => conn.execute_raw(stmt).await)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        on!(self, conn => conn.execute_unprepared(sql).await)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        on!(self, conn => conn.query_one_raw(stmt).await)
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        on!(self, conn => conn.query_all_raw(stmt).await)
    }

    fn support_returning(&self) -> bool {
        on!(self, conn => conn.support_returning())
    }

    fn is_mock_connection(&self) -> bool {
        on!(self, conn => conn.is_mock_connection())
    }
}
