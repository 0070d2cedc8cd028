//! A job's state as the job table stores it (`freshlock_job.state`), named once: every
//! statement writes and compares these codes, and the public [`JobState`](super::JobState)
//! maps onto them.

use std::fmt;

/// A job's stored state. Waiting jobs are `Pending` (ready: keyless, or first of their key
/// when enqueued or promoted) or `Queued` (behind an unfinished job of their key): a take scans
/// the ready ones only, so a hot key's backlog costs nothing per take. `Queued` is a hint,
/// never trusted for order: a take still checks that no earlier job of the key is unfinished.
/// A job of a leased kind is `Leased` while it works outside any transaction: `owner` holds
/// the claim's token and `lease_until` its expiry (database clock); its key stays busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    /// Ready to run.
    Pending,
    /// Claimed under a lease; its work runs outside any transaction.
    Leased,
    /// Completed.
    Done,
    /// Failed for good.
    Failed,
    /// Discarded by an operator.
    Discarded,
    /// Waiting behind an unfinished job of its key.
    Queued,
    /// Cancelled ([`crate::jobs::cancel`]): before it ran, or while it ran (its writes rolled
    /// back, or its leased work's finish refused).
    Cancelled,
}

impl Stored {
    /// Every state, in code order.
    const ALL: [Self; 7] = [
        Self::Pending,
        Self::Leased,
        Self::Done,
        Self::Failed,
        Self::Discarded,
        Self::Queued,
        Self::Cancelled,
    ];

    /// The code stored in the `state` column. Never change one: rows in users' databases hold
    /// them.
    pub(crate) const fn code(self) -> i16 {
        match self {
            Self::Pending => 0,
            Self::Leased => 1,
            Self::Done => 2,
            Self::Failed => 3,
            Self::Discarded => 4,
            Self::Queued => 5,
            Self::Cancelled => 6,
        }
    }

    /// The state stored as `code`, if it is one.
    pub(crate) fn from_code(code: i16) -> Option<Self> {
        Self::ALL.into_iter().find(|state| state.code() == code)
    }
}

impl From<Stored> for sea_orm::Value {
    fn from(state: Stored) -> Self {
        state.code().into()
    }
}

/// In SQL text, a state is its code.
impl fmt::Display for Stored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.code())
    }
}

/// A list of states as SQL (`0, 1, 5`), for `state IN (…)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct States(&'static [Stored]);

/// Every state of a job that has not finished: its key is still busy, or it still waits.
pub(crate) const UNFINISHED: States = States(&[Stored::Pending, Stored::Leased, Stored::Queued]);

impl States {
    /// Whether `state` is one of these.
    pub(crate) fn contains(&self, state: Stored) -> bool {
        self.0.contains(&state)
    }

    /// These states, one by one.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Stored> + '_ {
        self.0.iter().copied()
    }
}

impl fmt::Display for States {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, state) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{state}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_pinned_and_read_back() {
        // Stored in users' databases: these must never change.
        let codes: Vec<i16> = Stored::ALL.iter().map(|s| s.code()).collect();
        assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6]);
        for state in Stored::ALL {
            assert_eq!(Stored::from_code(state.code()), Some(state));
        }
        assert_eq!(Stored::from_code(7), None);
        assert_eq!(UNFINISHED.to_string(), "0, 1, 5");
    }
}
