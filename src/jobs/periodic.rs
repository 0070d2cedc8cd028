//! Periodic jobs: a kind enqueued on a cron schedule, each slot once across every worker and
//! process (River's periodic jobs, Oban's Cron, Celery beat).

use std::{str::FromStr, sync::Arc};

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, Value};
use serde::Serialize;
use tracing::debug;

use super::{enqueue::NewJob, store};
use crate::{
    db::{deadline::Bounded, own::Own},
    error::{Error, Result},
    lock::sql::{now_ms, statement},
    schema::{PERIODIC_TABLE, insert_ignore},
};

/// The most missed slots one pass of a worker enqueues with [`Missed::CatchUp`] (the next pass
/// enqueues more).
const CATCH_UP_AT_MOST: usize = 100;

/// What a periodic kind does with the slots that passed while no worker ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missed {
    /// Run the latest missed slot once and skip the ones before it (River's and Celery beat's
    /// behaviour).
    #[default]
    Skip,
    /// Run every missed slot, oldest first (at most 100 per pass of a worker).
    CatchUp,
}

/// A kind enqueued on a schedule ([`Jobs::periodic`](super::Jobs::periodic)): a cron expression
/// with seconds (`sec min hour day-of-month month day-of-week [year]`, UTC, on the database's
/// clock), the payload of each slot's job, and what to do with missed slots.
///
/// Every running [`Worker::run`](super::Worker::run) looks once a second; the worker that gets
/// there first enqueues the slot's job, moving the kind's row of `freshlock_periodic` to the
/// slot in the same transaction — so each slot is enqueued **once** across every worker and
/// process, and again never after a restart. A schedule seen for the first time starts with
/// its next slot. The job is a job like any other: retries, keys and leases as its kind says;
/// its handler needs registering too.
///
/// ```
/// use freshlock::{ApplyError, Tx, jobs::{Job, Jobs, Missed, Periodic, RetryPolicy}};
///
/// async fn report(_tx: &Tx, job: Job<String>) -> Result<(), ApplyError> {
///     tracing::info!(scope = %job.payload, "nightly report");
///     Ok(())
/// }
///
/// # fn main() -> freshlock::Result<()> {
/// let nightly = Periodic::new("report", "0 0 3 * * *")?  // 03:00:00 UTC every day
///     .payload(&"all accounts")?
///     .missed(Missed::Skip);
/// let jobs = Jobs::new()
///     .handle("report", RetryPolicy::default(), report)
///     .periodic(nightly);
/// # let _ = jobs;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Periodic {
    kind: String,
    schedule: Arc<cron::Schedule>,
    payload: String,
    missed: Missed,
}

impl Periodic {
    /// Jobs of `kind` on the cron `schedule` (with seconds; UTC), with the payload `null`
    /// (a handler of `Job<()>` takes it) and missed slots skipped.
    ///
    /// # Errors
    /// [`Error::InvalidJob`] when `schedule` is not a cron expression, or has no slot to come.
    pub fn new(kind: impl Into<String>, schedule: &str) -> Result<Self> {
        let kind = kind.into();
        let invalid = |reason: String| Error::InvalidJob {
            kind: kind.clone(),
            reason,
        };
        let parsed = cron::Schedule::from_str(schedule).map_err(|e| {
            invalid(format!(
                "the schedule {schedule:?} is not a cron expression: {e}"
            ))
        })?;
        if parsed.upcoming(Utc).next().is_none() {
            return Err(invalid(format!(
                "the schedule {schedule:?} has no slot to come"
            )));
        }
        Ok(Self {
            kind,
            schedule: Arc::new(parsed),
            payload: "null".to_owned(),
            missed: Missed::Skip,
        })
    }

    /// Each slot's job carries `payload` (serialized as JSON now).
    ///
    /// # Errors
    /// [`Error::InvalidJob`] when `payload` does not serialize.
    pub fn payload(mut self, payload: &impl Serialize) -> Result<Self> {
        self.payload = NewJob::new(self.kind.clone(), payload)?.payload;
        Ok(self)
    }

    crate::setters::setters! {
        /// What to do with slots that passed while no worker ran (default [`Missed::Skip`]).
        missed(missed: Missed) => missed = missed;
    }

    /// The kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The slots to enqueue after `last` (milliseconds since the Unix epoch) up to `now`: the
    /// latest only, or each (at most [`CATCH_UP_AT_MOST`]).
    fn due(&self, last: i64, now: i64) -> Vec<i64> {
        let (Some(last), Some(now)) = (at(last), at(now)) else {
            return Vec::new();
        };
        match self.missed {
            Missed::CatchUp => (self.schedule.after(&last))
                .take_while(|slot| *slot <= now)
                .take(CATCH_UP_AT_MOST)
                .map(|slot| slot.timestamp_millis())
                .collect(),
            Missed::Skip => {
                // The latest slot at or before `now` (the iterator runs backwards from it).
                let after_now = now + chrono::Duration::milliseconds(1);
                let latest = self.schedule.after(&after_now).next_back();
                latest
                    .filter(|slot| *slot > last)
                    .map(|slot| vec![slot.timestamp_millis()])
                    .unwrap_or_default()
            }
        }
    }

    /// The job of `slot`: unique to the slot, so that a slot is never waiting twice even if
    /// the slot table were reset.
    fn job(&self, slot: i64) -> NewJob {
        NewJob {
            kind: self.kind.clone(),
            payload: self.payload.clone(),
            key: None,
            unique: Some(format!("freshlock:periodic:{}:{slot}", self.kind)),
            priority: 0,
            delay: std::time::Duration::ZERO,
        }
    }
}

/// A time in milliseconds since the Unix epoch, as a UTC date.
fn at(ms: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_millis(ms)
}

/// Enqueues the due slots of `periodic` on `db` (one transaction: the slot row moved forward
/// only from the value read, and the slots' jobs added with it), returning how many. A schedule
/// seen for the first time is recorded at its latest slot, which does not run.
pub(super) async fn enqueue_due(
    db: &DatabaseConnection,
    periodic: &Periodic,
    reply: std::time::Duration,
) -> std::result::Result<usize, DbErr> {
    let own = Own::new(db, reply);
    own.run(|txn| {
        let periodic = periodic.clone();
        Box::pin(async move { enqueue_due_in(txn, &periodic).await })
    })
    .await
}

async fn enqueue_due_in(
    txn: &Bounded<'_, sea_orm::DatabaseTransaction>,
    periodic: &Periodic,
) -> std::result::Result<usize, DbErr> {
    let backend = txn.get_database_backend();
    let now_sql = now_ms(backend);
    let hash = Value::Bytes(Some(store::hash(&periodic.kind)));
    let read = format!("SELECT slot, {now_sql} AS now FROM {PERIODIC_TABLE} WHERE kind_hash = ?");
    let row = txn
        .query_one_raw(statement(backend, &read, vec![hash.clone()]))
        .await?;
    let Some(row) = row else {
        let first = format!("SELECT {now_sql} AS now");
        let now: i64 = match txn
            .query_one_raw(statement(backend, &first, Vec::new()))
            .await?
        {
            Some(row) => row.try_get("", "now")?,
            None => return Ok(0),
        };
        // Recorded at now: the next slot is the first to run.
        let start = now;
        let sql = insert_ignore(backend, PERIODIC_TABLE, "kind_hash, kind, slot", "?, ?, ?");
        let values = vec![
            hash,
            Value::Bytes(Some(periodic.kind.as_bytes().to_vec())),
            start.into(),
        ];
        txn.execute_raw(statement(backend, &sql, values)).await?;
        return Ok(0);
    };
    let (last, now): (i64, i64) = (row.try_get("", "slot")?, row.try_get("", "now")?);
    let slots = periodic.due(last, now);
    let Some(&latest) = slots.last() else {
        return Ok(0);
    };
    // Moved only from the slot read: of two workers that read it, one moves it.
    let advance = format!("UPDATE {PERIODIC_TABLE} SET slot = ? WHERE kind_hash = ? AND slot = ?");
    let moved = txn
        .execute_raw(statement(
            backend,
            &advance,
            vec![latest.into(), hash, last.into()],
        ))
        .await?;
    if moved.rows_affected() != 1 {
        return Ok(0);
    }
    let jobs: Vec<NewJob> = slots.iter().map(|slot| periodic.job(*slot)).collect();
    let inserts: Vec<store::Insert<'_>> = jobs.iter().map(NewJob::insert).collect();
    let rows: Vec<&store::Insert<'_>> = inserts.iter().collect();
    store::insert_many(txn, &rows).await?;
    debug!(kind = %periodic.kind, slots = slots.len(), latest, "periodic slots enqueued");
    Ok(slots.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: i64 = 60_000;

    fn every_minute(missed: Missed) -> Periodic {
        Periodic::new("tick", "0 * * * * *").unwrap().missed(missed)
    }

    #[test]
    fn skip_runs_the_latest_missed_slot_only() {
        let at_noon = 1_764_936_000_000; // 2025-12-05 12:00:00 UTC, a slot
        let p = every_minute(Missed::Skip);
        assert_eq!(
            p.due(at_noon, at_noon + 30_000),
            Vec::<i64>::new(),
            "none yet"
        );
        assert_eq!(
            p.due(at_noon, at_noon + MINUTE),
            [at_noon + MINUTE],
            "a slot at now"
        );
        assert_eq!(
            p.due(at_noon, at_noon + 5 * MINUTE + 1),
            [at_noon + 5 * MINUTE]
        );
    }

    #[test]
    fn catch_up_runs_each_missed_slot_at_most_a_hundred_a_pass() {
        let at_noon = 1_764_936_000_000;
        let p = every_minute(Missed::CatchUp);
        let slots = p.due(at_noon, at_noon + 3 * MINUTE + 5);
        assert_eq!(slots, [1, 2, 3].map(|m| at_noon + m * MINUTE));
        let day = p.due(at_noon, at_noon + 24 * 60 * MINUTE);
        assert_eq!(day.len(), CATCH_UP_AT_MOST);
        assert_eq!(day[0], at_noon + MINUTE);
    }

    #[test]
    fn a_bad_schedule_is_a_typed_error() {
        for bad in ["", "every minute", "* * *", "61 * * * * *"] {
            assert!(
                matches!(Periodic::new("tick", bad), Err(Error::InvalidJob { .. })),
                "{bad:?}"
            );
        }
        // A schedule whose every slot is past.
        assert!(Periodic::new("tick", "0 0 0 1 1 * 2001").is_err());
    }
}
