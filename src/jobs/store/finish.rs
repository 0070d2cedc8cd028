//! How a job's attempt ends in the table: completed, failed (or waiting for its retry), and
//! the next job of each finished key readied.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, QueryResult, Value};

use crate::jobs::state::Stored::{Done, Failed, Leased, Pending};
use crate::{
    commit::Marker,
    lock::sql::{millis, now_ms, statement},
    schema::JOB_TABLE,
};

use super::{
    MAX_ERROR, Taken,
    promote::{Claiming, claimed_in, promotion_within},
};

/// What [`complete`] did.
pub(crate) struct Completed {
    /// The first row the statement returned (its `stamps`), if it returned any.
    pub(crate) row: Option<QueryResult>,
    /// How many queued jobs it readied.
    pub(crate) readied: u64,
    /// How many of the jobs it marked done: fewer than asked when some were asked to stop
    /// ([`crate::jobs::cancel`]), and the transaction must then roll back.
    pub(crate) done: u64,
    /// The job its promotion claimed (see [`Claiming`]).
    pub(crate) claimed: Option<Taken>,
}

/// Marks jobs `ids` done, in the transaction that ran them (their attempts counted, their
/// unique keys free, a leased one's claim ended: its row keeps the claim's token in `owner`,
/// which says which claim finished it), unless a job was asked to stop — or, with
/// `owner`, unless the job is no longer leased by that claim — and makes the
/// first queued job of each key in `promote` ready (see [`fn@super::promote`]). With `stamps`
/// (PostgreSQL), the statement also returns those expressions — the commit's evidence, taken by
/// this statement rather than one of its own: the first row. On PostgreSQL the promotion rides
/// in the same statement (a `WITH` of its own: the two touch different rows), elsewhere it is
/// one more. With `marker` (MySQL/MariaDB), the commit marker's INSERT is sent in the
/// completion's message (see [`marked`]). With `claiming`, the promotion claims the job it
/// readies when it can.
pub(crate) async fn complete(
    txn: &impl ConnectionTrait,
    ids: &[i64],
    stamps: Option<&[&str]>,
    promote: Vec<Vec<u8>>,
    owner: Option<&str>,
    marker: Option<&Marker>,
    claiming: Option<&Claiming<'_>>,
) -> Result<Completed, DbErr> {
    let completion = completion(txn, ids, stamps, promote, owner, claiming).await?;
    if !completion.returns() {
        let done = match marker {
            Some(marker) => marked(txn, marker, &completion.sql, completion.values.clone()).await?,
            None => (txn.execute_raw(completion.statement()).await?).rows_affected(),
        };
        return completion.read(Vec::new(), done);
    }
    let rows = txn.query_all_raw(completion.statement()).await?;
    completion.read(rows, 0)
}

/// [`complete`]'s statement, not sent yet: a keyed job's attempt on a held connection sends it
/// in its `COMMIT`'s message (`jobs/flights.rs`) and reads its reply with [`Completion::read`].
/// On PostgreSQL the promotion is folded into it; elsewhere it is readied here, first, by a
/// statement of its own.
pub(crate) struct Completion {
    backend: DbBackend,
    /// `?` placeholders.
    sql: String,
    values: Vec<Value>,
    /// Whether the promotion is a `WITH` of the statement (it returns the count it readied).
    folds: bool,
    /// Whether the statement returns `stamps` (the commit's evidence).
    stamps: bool,
    claiming: bool,
    /// The first expression of its `RETURNING`, when it has one.
    returning: Option<String>,
    /// Readied and claimed by a promotion of its own.
    readied: u64,
    claimed: Option<Taken>,
}

/// The statement of [`complete`], its promotion sent first where it is not folded in.
pub(crate) async fn completion(
    txn: &impl ConnectionTrait,
    ids: &[i64],
    stamps: Option<&[&str]>,
    promote: Vec<Vec<u8>>,
    owner: Option<&str>,
    claiming: Option<&Claiming<'_>>,
) -> Result<Completion, DbErr> {
    let backend = txn.get_database_backend();
    let folds = backend == DbBackend::Postgres && !promote.is_empty();
    let (mut readied, mut claimed) = (0, None);
    let mut values: Vec<Value> = Vec::with_capacity(promote.len() + ids.len());
    let mut sql = String::new();
    let mut returning: Vec<&str> = stamps.unwrap_or_default().to_vec();
    // The promotion passes over the jobs completed here: a chain's later jobs are still
    // queued as stored (`take_after`).
    if folds {
        let (with, returned, promoted) = promotion_within(promote, ids, claiming);
        sql = with;
        returning.extend(returned);
        values.extend(promoted);
    } else if !promote.is_empty() {
        (readied, claimed) = super::promote_claiming(txn, promote, ids, claiming).await?;
    }
    let now = now_ms(backend);
    let placeholders = vec!["?"; ids.len()].join(", ");
    // A leased job keeps the token of the claim that finished it: a check after the completion
    // (`jobs/flights.rs`) tells its own completion from another claim's.
    let finished_by = match owner {
        Some(owner) => {
            values.push(owner.into());
            "?"
        }
        None => "NULL",
    };
    // A leased job's attempt was counted by its claim. (MySQL assigns left to right, each
    // assignment seeing the ones before it: `attempts` reads `state` before it changes.)
    sql.push_str(&format!(
        "UPDATE {JOB_TABLE} SET \
         attempts = attempts + CASE WHEN state = {Leased} THEN 0 ELSE 1 END, state = {Done}, \
         finished_at = {now}, owner = {finished_by}, lease_until = NULL, unique_hash = NULL \
         WHERE id IN ({placeholders}){}",
        super::cancel::not_requested()
    ));
    values.extend(ids.iter().map(|&id| Value::from(id)));
    if let Some(owner) = owner {
        sql.push_str(&format!(" AND state = {Leased} AND owner = ?"));
        values.push(owner.into());
    }
    let returns = !returning.is_empty();
    if returns {
        sql.push_str(" RETURNING ");
        sql.push_str(&returning.join(", "));
    }
    Ok(Completion {
        backend,
        sql,
        values,
        folds,
        stamps: stamps.is_some(),
        claiming: claiming.is_some(),
        returning: returns.then(|| returning.join(", ")),
        readied,
        claimed,
    })
}

impl Completion {
    /// Whether the statement returns rows (else its reply is a count).
    pub(crate) fn returns(&self) -> bool {
        self.returning.is_some()
    }

    /// The statement, its values bound.
    pub(crate) fn statement(&self) -> sea_orm::Statement {
        statement(self.backend, &self.sql, self.values.clone())
    }

    /// What the statement did, from its reply: its `rows` when it [`returns`](Self::returns)
    /// them, else the count `affected` (how many jobs it marked done).
    pub(crate) fn read(self, rows: Vec<QueryResult>, affected: u64) -> Result<Completed, DbErr> {
        let (mut readied, mut claimed) = (self.readied, self.claimed);
        if self.returning.is_none() {
            return Ok(Completed {
                row: None,
                readied,
                done: affected,
                claimed,
            });
        }
        let done = rows.len() as u64;
        let first = rows.into_iter().next();
        if self.folds
            && let Some(row) = &first
        {
            readied = u64::try_from(row.try_get::<i64>("", "readied")?).unwrap_or(0);
            if self.claiming {
                claimed = claimed_in(row)?;
            }
        }
        Ok(Completed {
            row: first.filter(|_| self.stamps),
            readied,
            done,
            claimed,
        })
    }
}

/// The completion `sql` (`?` placeholders for `values`) after `marker`'s INSERT, on
/// MySQL/MariaDB in one message — the commit's evidence without a round trip of its own, as a locked
/// write's UPDATE carries it (`write/row_sql/update.rs`) —, or, when a value cannot be written
/// into the text (see `inline.rs`), the two as statements of their own. How many jobs it
/// completed: the reply counts the marker's row and each job the UPDATE found.
async fn marked(
    txn: &impl ConnectionTrait,
    marker: &Marker,
    sql: &str,
    values: Vec<Value>,
) -> Result<u64, DbErr> {
    let backend = txn.get_database_backend();
    #[cfg(feature = "mysql")]
    if backend == DbBackend::MySql
        && let (Some(insert), Some(update)) = (
            crate::db::inline::mysql::statement(&marker.insert(backend, true)),
            crate::db::inline::mysql::written(sql, values.clone()),
        )
    {
        let rows = (txn
            .execute_unprepared(&format!("{insert}; {update}"))
            .await?)
            .rows_affected();
        return rows.checked_sub(1).ok_or_else(|| {
            DbErr::Custom(format!(
                "the commit marker and the completion reported {rows} rows"
            ))
        });
    }
    marker.write(txn).await?;
    let done = txn.execute_raw(statement(backend, sql, values)).await?;
    Ok(done.rows_affected())
}

/// Records a failed attempt of job `id`: due again after `retry`, or failed for good (its error
/// kept, its unique key free) when `retry` is `None`. A leased job's claim ends either way.
pub(crate) async fn failed(
    txn: &impl ConnectionTrait,
    id: i64,
    attempts: i32,
    error: &str,
    retry: Option<Duration>,
) -> Result<(), DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    // PostgreSQL's text cannot hold NUL.
    let error: String = error
        .chars()
        .take(MAX_ERROR)
        .map(|c| if c == '\0' { '\u{fffd}' } else { c })
        .collect();
    let (sql, values) = match retry {
        Some(delay) => (
            format!(
                "UPDATE {JOB_TABLE} SET state = {Pending}, owner = NULL, lease_until = NULL, \
                 attempts = ?, last_error = ?, run_at = {now} + ? WHERE id = ?"
            ),
            vec![
                attempts.into(),
                error.into(),
                millis(delay).into(),
                id.into(),
            ],
        ),
        None => (
            format!(
                "UPDATE {JOB_TABLE} SET state = {Failed}, owner = NULL, lease_until = NULL, \
                 attempts = ?, last_error = ?, finished_at = {now}, unique_hash = NULL WHERE id = ?"
            ),
            vec![attempts.into(), error.into(), id.into()],
        ),
    };
    txn.execute_raw(statement(backend, &sql, values))
        .await
        .map(drop)
}
