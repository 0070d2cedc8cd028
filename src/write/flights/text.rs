//! The text of a write's two messages and how their replies read: the reload (with the
//! transaction's id and a lock's try), the UPDATE's message on each database, the `BEGIN` the
//! engine would send, the values written in (`db/inline/`).

use sea_orm::{
    DbBackend, QueryResult, QuerySelect, QueryTrait,
    sea_query::{Expr, InsertStatement},
};

use crate::{
    db::{inline::statement_text, pinned::Reply, prepared::Prepared},
    write::entity::Writable,
    write::fold::Folded,
    write::row::{reload, select_by_key},
    write::row_step::RowStep,
};

/// The reload: `SELECT <columns>, <stamps> FROM … WHERE <key> [AND <the lock's try>] FOR
/// UPDATE`.
pub(super) fn reload_statement<E: Writable>(
    step: &RowStep<E>,
    backend: DbBackend,
    stamps: &[&'static str],
    folded: Option<&Folded>,
) -> Option<sea_orm::Statement> {
    let reload = reload::<E>(backend, step.row.pk(), folded)?;
    let select = (stamps.iter()).fold(reload, |select, stamp| select.expr(Expr::cust(*stamp)));
    Some(select.build(backend))
}

/// Whether every value of the key `pk` is written in by `backend`'s dialect (`inline/`): then
/// the reload's text can be (its other values — a lock's name or key — always are).
pub(super) fn key_written_in(backend: DbBackend, pk: &sea_orm::sea_query::ValueTuple) -> bool {
    pk.iter().all(|value| match backend {
        #[cfg(feature = "postgres")]
        DbBackend::Postgres => crate::db::inline::postgres::writes(value),
        #[cfg(feature = "mysql")]
        DbBackend::MySql => crate::db::inline::mysql::writes(value),
        _ => false,
    })
}

/// Flight 2's statements before its `COMMIT`, values written in: PostgreSQL's UPDATE (which
/// returns the row, behind a riding marker's INSERT; by name, `prepared/`); MySQL/MariaDB's
/// marker INSERT (when one rides), the UPDATE, and the read of the row by key (no `RETURNING`
/// there; the row is this transaction's, locked). `None` when a value cannot be written in.
pub(super) fn message<E: Writable>(
    prepared: &Prepared,
    backend: DbBackend,
    update: &sea_orm::Statement,
    marker: Option<&InsertStatement>,
    pk: &sea_orm::sea_query::ValueTuple,
) -> Option<String> {
    if backend != DbBackend::MySql {
        return Some(prepared.text(update)?.statements().join("; "));
    }
    let update = statement_text(update)?;
    let mut statements = Vec::with_capacity(3);
    if let Some(marker) = marker {
        statements.push(statement_text(&backend.build(marker))?);
    }
    statements.push(update);
    statements.push(statement_text(&select_by_key::<E>(pk).build(backend))?);
    Some(statements.join("; "))
}

/// The row flight 2's message stored, from its replies (`…; COMMIT`): `None` when the guard
/// refused (the UPDATE found no row).
pub(super) fn stored_of(
    backend: DbBackend,
    replies: &mut [Reply],
) -> Result<Option<QueryResult>, sea_orm::DbErr> {
    // … UPDATE; COMMIT (after the UPDATE's `PREPARE`, the first time on a connection).
    if backend != DbBackend::MySql {
        return Ok(nth(replies, 1, true)?.rows.into_iter().next());
    }
    // … UPDATE; SELECT; COMMIT: the UPDATE's count of found rows says whether it wrote.
    let updated = nth(replies, 2, true)?;
    let read = nth(replies, 1, true)?;
    match (updated.affected, read.rows.into_iter().next()) {
        (0, _) => Ok(None),
        (1, Some(row)) => Ok(Some(row)),
        (found, _) => Err(sea_orm::DbErr::Custom(format!(
            "the UPDATE found {found} rows and its read back none: not one row"
        ))),
    }
}

/// The reply of a message's statement at `index` (from the end when `from_end`), or a protocol
/// error.
pub(super) fn nth(
    replies: &mut [Reply],
    index: usize,
    from_end: bool,
) -> Result<Reply, sea_orm::DbErr> {
    let at = match from_end {
        true => replies.len().checked_sub(index + 1),
        false => Some(index),
    };
    at.and_then(|at| replies.get_mut(at))
        .map(std::mem::take)
        .ok_or_else(|| sea_orm::DbErr::Custom(format!("no reply to statement {}", index + 1)))
}
