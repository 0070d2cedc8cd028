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
    promote::{Chained, Claiming, chained, claimed_in, promotion_within},
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
    #[cfg(feature = "mysql")]
    if completion.chained.is_some() {
        return complete_chained(txn, completion, ids.len() as u64, marker).await;
    }
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
/// in its `COMMIT`'s message (`jobs/flights/`) and reads its reply with [`Completion::read`].
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
    /// MySQL/MariaDB, a finish that claims: its promotion, sent after the statement.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    chained: Option<Chained>,
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
    let (mut readied, mut claimed, mut chained_after) = (0, None, None);
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
    } else if let (DbBackend::MySql, [key_hash], Some(claiming), Some(_)) =
        (backend, promote.as_slice(), claiming, owner)
    {
        chained_after = Some(chained(key_hash.clone(), ids, claiming));
    } else if !promote.is_empty() {
        (readied, claimed) = super::promote_claiming(txn, promote, ids, claiming).await?;
    }
    let now = now_ms(backend);
    let placeholders = vec!["?"; ids.len()].join(", ");
    // A leased job keeps the token of the claim that finished it: a check after the completion
    // (`jobs/flights/`) tells its own completion from another claim's.
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
        chained: chained_after,
    })
}

impl Completion {
    /// Its promotion that follows it, when it has one (see [`Chained`]).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn chained(&self) -> Option<&Chained> {
        self.chained.as_ref()
    }

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

/// [`complete`] with a [`Chained`] promotion (MySQL/MariaDB): `marker`'s INSERT, the completion
/// and the promotion as one message when their values can be written in (else each bound, in
/// order), then the read of the job it claimed when it readied one. Completes `jobs` jobs, or
/// none when its check stopped it (the transaction must then roll back).
#[cfg(feature = "mysql")]
async fn complete_chained(
    txn: &impl ConnectionTrait,
    completion: Completion,
    jobs: u64,
    marker: Option<&Marker>,
) -> Result<Completed, DbErr> {
    let Some(chained) = completion.chained.clone() else {
        return Err(DbErr::Custom("a completion without its promotion".into()));
    };
    let backend = txn.get_database_backend();
    let marked = u64::from(marker.is_some());
    let marker = marker.map(|marker| backend.build(&marker.insert(backend, true)));
    let statements = [
        completion.statement(),
        chained.find.clone(),
        chained.promote.clone(),
    ];
    let texts = (marker.iter().chain(&statements)).map(crate::db::inline::statement_text);
    let affected = match texts.collect::<Option<Vec<_>>>() {
        Some(texts) => {
            (txn.execute_unprepared(&texts.join("; ")).await).map(|r| Some(r.rows_affected()))
        }
        None => bound_each(txn, marker, statements, jobs, &chained).await,
    };
    let affected = match affected {
        Ok(affected) => affected,
        Err(e) if crate::db::failure::is_cardinality_violation(&e) => {
            return completion.read(Vec::new(), 0);
        }
        Err(e) => return Err(e),
    };
    let Some(affected) = affected else {
        return completion.read(Vec::new(), 0);
    };
    // The check passed: every job was completed; the marker's row and the promotion's count too.
    let readied = affected
        .checked_sub(jobs + marked)
        .ok_or_else(|| DbErr::Custom(format!("the completion reported {affected} rows")))?;
    let rows = match readied {
        0 => Vec::new(),
        _ => txn.query_all_raw(chained.read.clone()).await?,
    };
    let claimed = chained.claimed(&rows)?;
    Ok(Completed {
        row: None,
        readied,
        done: jobs,
        claimed,
    })
}

/// [`complete_chained`]'s `marker` and `statements` (the completion, the promotion's find and
/// promote) one after another, bound: how many rows they changed in all. The completion's count
/// is checked here, and the head found without a check (see [`Chained::head`]): `None` when
/// the completion did not mark its `jobs` jobs done (nothing after it is sent).
#[cfg(feature = "mysql")]
async fn bound_each(
    txn: &impl ConnectionTrait,
    marker: Option<sea_orm::Statement>,
    [completion, _, promote]: [sea_orm::Statement; 3],
    jobs: u64,
    chained: &Chained,
) -> Result<Option<u64>, DbErr> {
    let mut affected = 0;
    if let Some(marker) = marker {
        affected += txn.execute_raw(marker).await?.rows_affected();
    }
    let done = txn.execute_raw(completion).await?.rows_affected();
    if done < jobs {
        return Ok(None);
    }
    txn.execute_raw(chained.head.clone()).await?;
    affected += done + txn.execute_raw(promote).await?.rows_affected();
    Ok(Some(affected))
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
