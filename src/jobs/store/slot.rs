//! The tokens of job limits (`freshlock_job_slot`, see [`crate::jobs::Limit`]): locked with
//! `SKIP LOCKED` by the transaction that takes a job, so a worker never waits for one.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::jobs::state::Stored::Leased;
use crate::{
    db::{autocommit::upkeep, pool::Pool},
    lock::sql::{for_update_skip_locked, now_ms, statement},
    schema::{JOB_SLOT_TABLE, JOB_TABLE},
};

/// How a limit's tokens are used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tokens {
    /// Held (locked) while the job's transaction runs: at most `n` at once.
    Held,
    /// Used once per period (milliseconds): a token is free again a period after its use.
    Rate(i64),
}

impl Tokens {
    /// A new row's `free_at`: a rate's token is free at once (`0`); a held token's row is
    /// never pruned (`-1`, see [`forget_unused`]).
    fn fresh(self) -> i64 {
        match self {
            Self::Held => -1,
            Self::Rate(_) => 0,
        }
    }
}

/// Locks up to `wanted` free tokens among the first `n` of `scope`, skipping those other
/// transactions hold; a rate's tokens are marked used now. Returns how many it got. Tokens a
/// scope lacks (its first use, a larger `n`) are made first, inserting only the missing rows
/// (an existing row another transaction holds would make the insert wait on MySQL).
pub(crate) async fn acquire(
    txn: &impl ConnectionTrait,
    scope: &[u8],
    n: u32,
    wanted: u32,
    tokens: Tokens,
) -> Result<u32, DbErr> {
    if wanted == 0 || n == 0 {
        return Ok(0);
    }
    let got = lock_free(txn, scope, n, wanted, tokens).await?;
    if got.len() as u32 == wanted || !make_missing(txn, scope, n, tokens).await? {
        return use_tokens(txn, scope, got, tokens).await;
    }
    let more = lock_free(txn, scope, n, wanted, tokens).await?;
    use_tokens(txn, scope, more, tokens).await
}

/// The free tokens' slots: up to `wanted`, locked.
async fn lock_free(
    txn: &impl ConnectionTrait,
    scope: &[u8],
    n: u32,
    wanted: u32,
    tokens: Tokens,
) -> Result<Vec<i32>, DbErr> {
    let backend = txn.get_database_backend();
    let skip = for_update_skip_locked(backend);
    let values = vec![Value::Bytes(Some(scope.to_vec())), i64::from(n).into()];
    let used = match tokens {
        Tokens::Held => String::new(),
        Tokens::Rate(_) => format!(" AND free_at <= {}", now_ms(backend)),
    };
    let sql = format!(
        "SELECT slot FROM {JOB_SLOT_TABLE} WHERE scope = ? AND slot < ?{used} \
         ORDER BY slot LIMIT {wanted}{skip}"
    );
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    rows.iter().map(|row| row.try_get("", "slot")).collect()
}

/// Marks a rate's tokens `slots` used now: free a period from now (held tokens need nothing
/// more). Returns how many.
async fn use_tokens(
    txn: &impl ConnectionTrait,
    scope: &[u8],
    slots: Vec<i32>,
    tokens: Tokens,
) -> Result<u32, DbErr> {
    let got = slots.len() as u32;
    let Tokens::Rate(per) = tokens else {
        return Ok(got);
    };
    if got == 0 {
        return Ok(got);
    }
    let backend = txn.get_database_backend();
    let marks = vec!["?"; slots.len()].join(", ");
    let sql = format!(
        "UPDATE {JOB_SLOT_TABLE} SET free_at = {} + ? WHERE scope = ? AND slot IN ({marks})",
        now_ms(backend)
    );
    let mut values = vec![per.into(), Value::Bytes(Some(scope.to_vec()))];
    values.extend(slots.into_iter().map(Value::from));
    txn.execute_raw(statement(backend, &sql, values)).await?;
    Ok(got)
}

/// Makes the rows of `scope`'s first `n` tokens that do not exist: `false` when none was
/// missing. (Read without locks, so a row another transaction holds is seen, not waited for.)
/// A row another transaction made and has not committed is waited for: a worker makes the
/// tokens of its kinds' limits before it takes anything ([`crate::jobs::Limit`]'s `prepare`),
/// so only a per-key rate's first job of a key makes rows in its transaction, and a key's jobs
/// run one at a time.
pub(crate) async fn make_missing(
    txn: &impl ConnectionTrait,
    scope: &[u8],
    n: u32,
    tokens: Tokens,
) -> Result<bool, DbErr> {
    let backend = txn.get_database_backend();
    let sql = format!("SELECT slot FROM {JOB_SLOT_TABLE} WHERE scope = ? AND slot < ?");
    let scope_value = || Value::Bytes(Some(scope.to_vec()));
    let rows = txn
        .query_all_raw(statement(
            backend,
            &sql,
            vec![scope_value(), i64::from(n).into()],
        ))
        .await?;
    let mut have = vec![false; n as usize];
    for row in &rows {
        let slot: i32 = row.try_get("", "slot")?;
        if let Some(have) = usize::try_from(slot).ok().and_then(|s| have.get_mut(s)) {
            *have = true;
        }
    }
    let missing: Vec<i64> = (0..i64::from(n))
        .filter(|&slot| !have[slot as usize])
        .collect();
    if missing.is_empty() {
        return Ok(false);
    }
    let rows = vec!["(?, ?, ?)"; missing.len()].join(", ");
    let sql = match backend {
        DbBackend::MySql => {
            format!("INSERT IGNORE INTO {JOB_SLOT_TABLE} (scope, slot, free_at) VALUES {rows}")
        }
        _ => format!(
            "INSERT INTO {JOB_SLOT_TABLE} (scope, slot, free_at) VALUES {rows} \
             ON CONFLICT DO NOTHING"
        ),
    };
    let mut values = Vec::with_capacity(missing.len() * 3);
    for slot in missing {
        values.extend([scope_value(), slot.into(), tokens.fresh().into()]);
    }
    txn.execute_raw(statement(backend, &sql, values)).await?;
    Ok(true)
}

/// How many jobs of `kind` work under a live lease now (a leased kind's running jobs), read
/// after the caller locked the kind's gate token so that no other claim of the kind counts at
/// the same time.
pub(crate) async fn leased_now(txn: &impl ConnectionTrait, kind: &[u8]) -> Result<u32, DbErr> {
    let backend = txn.get_database_backend();
    let sql = format!(
        "SELECT COUNT(*) AS live FROM {JOB_TABLE} \
         WHERE state = {Leased} AND lease_until > {} AND kind = ?",
        now_ms(backend)
    );
    let row = txn
        .query_one_raw(statement(
            backend,
            &sql,
            vec![Value::Bytes(Some(kind.to_vec()))],
        ))
        .await?;
    let live: i64 = match row {
        Some(row) => row.try_get("", "live")?,
        None => 0,
    };
    Ok(u32::try_from(live).unwrap_or(u32::MAX))
}

/// Deletes the tokens of rates that have all been free for `older_than_ms` or longer (a per-key
/// rate makes rows for every key it meets): a free token's row holds nothing a new row would
/// not. Held tokens' rows stay (one set per kind). Whole scopes go, so a scope's rows stay
/// numbered from 0. Returns how many rows it deleted.
pub(crate) async fn forget_unused(db: &Pool, older_than_ms: i64) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    // MySQL cannot read the table it deletes from but through a derived table.
    let sql = format!(
        "DELETE FROM {JOB_SLOT_TABLE} WHERE free_at >= 0 AND scope IN (SELECT scope FROM (\
         SELECT scope FROM {JOB_SLOT_TABLE} GROUP BY scope \
         HAVING MIN(free_at) >= 0 AND MAX(free_at) <= {now} - ?) AS unused)"
    );
    upkeep(db, statement(backend, &sql, vec![older_than_ms.into()])).await
}
