//! Leased jobs' claim, its check at the finish, its heartbeat, and the reclaim of expired
//! leases.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbErr};

use crate::jobs::state::Stored::{Leased, Pending};
use crate::{
    db::{autocommit::upkeep, pool::Pool},
    lock::{
        lease::{Held, Lapse, Leases},
        sql::{millis, now_ms, statement},
    },
    schema::JOB_TABLE,
};

/// Claims job `id` (locked by `txn`'s take) for attempt `attempts` under a lease of `lease`
/// held by `owner`: once `txn` commits, the job works outside any transaction and its key stays
/// busy until the claim ends ([`hold`], [`complete`], [`failed`]) or expires ([`reclaim`]).
pub(crate) async fn claim(
    txn: &impl ConnectionTrait,
    id: i64,
    attempts: i32,
    owner: &str,
    lease: Duration,
) -> Result<(), DbErr> {
    let claim = claim_statement(txn.get_database_backend(), id, attempts, owner, lease);
    txn.execute_raw(claim).await.map(drop)
}

/// [`claim`]'s statement, not sent: a held attempt sends it in its `COMMIT`'s message
/// (`jobs/flights/`; the take's lock on the row makes it claim the job).
pub(crate) fn claim_statement(
    backend: sea_orm::DbBackend,
    id: i64,
    attempts: i32,
    owner: &str,
    lease: Duration,
) -> sea_orm::Statement {
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {Leased}, owner = ?, lease_until = {now} + ?, \
         attempts = ? WHERE id = ?"
    );
    let values = vec![
        owner.into(),
        millis(lease).into(),
        attempts.into(),
        id.into(),
    ];
    statement(backend, &sql, values)
}

/// Leased jobs' leases: in the job's own row (see `lock/lease.rs` for why), held while the job
/// is `LEASED` and until another worker reclaims it.
const JOB_LEASES: Leases = Leases {
    table: JOB_TABLE,
    key: "id",
    expires: "lease_until",
    leased: LEASED,
    fence: false,
    lapse: Lapse::WhenTaken,
};

/// The condition of a leased job (its state's code is pinned: see `state.rs`).
const LEASED: &str = "state = 1";

/// `owner`'s lease on job `id`.
fn held(id: i64, owner: &str) -> Held<'_> {
    Held {
        key: id.into(),
        owner,
        fence: None,
    }
}

/// Locks job `id` in `txn` if `owner`'s claim on it still holds (the fence of a leased job's
/// finish): `false` when its lease expired and was reclaimed, whether or not another worker
/// took it since. An expired lease that nobody reclaimed yet still holds: the row's lock keeps
/// [`reclaim`] out until `txn` ends.
pub(crate) async fn hold(txn: &impl ConnectionTrait, id: i64, owner: &str) -> Result<bool, DbErr> {
    JOB_LEASES.check(txn, &held(id, owner)).await
}

/// Extends `owner`'s lease on job `id` to `lease` from now (a heartbeat): `false` when the
/// claim no longer holds. (The expiry moves by a third of the lease between beats, so the row
/// always changes: MySQL counts changed rows only.)
pub(crate) async fn extend(
    db: &impl ConnectionTrait,
    id: i64,
    owner: &str,
    lease: Duration,
) -> Result<bool, DbErr> {
    JOB_LEASES.extend(db, &held(id, owner), lease).await
}

/// Makes every leased job whose lease expired wait again, due now (its worker stopped, hung or
/// lost the database; a late finish is refused by [`hold`]). Returns how many.
pub(crate) async fn reclaim(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {Pending}, owner = NULL, lease_until = NULL, \
         run_at = {now}, last_error = ? WHERE state = {Leased} AND lease_until < {now}"
    );
    let why = "the lease expired before the job finished (its worker stopped, hung or lost the \
               database)";
    upkeep(db, statement(backend, &sql, vec![why.into()])).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leased_job_is_told_by_its_state_code() {
        assert_eq!(LEASED, format!("state = {Leased}"));
    }
}
