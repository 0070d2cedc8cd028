//! What a lock adds to a row step's first statement or to its UPDATE message — the lock
//! *folded* into a statement the step sends anyway, one round trip less: a
//! transaction-scoped lock tried by the reload, a lease's fence checked (and on PostgreSQL the
//! lease freed) by it, or on MySQL/MariaDB a lease's check-and-free sent first in the write's
//! message. In this one file: what the statement tries ([`Folded`]) and how it went; whether a
//! lock may fold is its [`Fold`] state, kept by the lock (`locking.rs`).

use std::time::Duration;

use sea_orm::DbBackend;

use super::locking::{Fold, Locking};
use crate::lock::{Fencing, LockKind};

/// The lock a step's first statement tries, as a one-time filter evaluated before any row is
/// read or locked (see [`Locking::folding`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Folded {
    /// `(SELECT pg_try_advisory_xact_lock(key))`.
    Advisory(i64),
    /// `EXISTS (SELECT 1 FROM freshlock_row_lock WHERE name = … FOR NO KEY UPDATE SKIP
    /// LOCKED)`: the lock row of that stored name, when it exists and is free.
    Row(String),
    /// `EXISTS (SELECT 1 FROM freshlock_lock WHERE name = … AND fence = … FOR UPDATE SKIP
    /// LOCKED)`: a held lease's fence check (see [`crate::lock::Fencing::fence_row`]), locking
    /// the fence row until the transaction ends as the check by a statement of its own does.
    Fence {
        /// The fence row's (stored) name.
        name: String,
        /// The grant's fence.
        fence: i64,
    },
    /// `WITH freed AS (UPDATE freshlock_lock SET owner = NULL … WHERE name = … AND owner = … AND
    /// fence = … AND expires_at > now RETURNING 1)` before the statement, and `EXISTS (SELECT 1
    /// FROM freed)` in its `WHERE` (PostgreSQL only): a held lease's check that also frees it,
    /// so the commit ends the lease (see [`crate::lock::Fencing::owned_row`]), its row locked
    /// until the transaction ends as the check by a statement of its own does.
    Lease {
        /// The lease row's (stored) name.
        name: String,
        /// The grant's owner token.
        owner: String,
        /// The grant's fence.
        fence: i64,
    },
}

impl Locking {
    /// The lock the step's first statement is to try in its `WHERE` (a one-time filter,
    /// evaluated before any row is read or locked; see [`Folded`]), when
    /// [`begin_all`](Self::begin_all) left this lock to it: `pg_advisory`'s key, `row`'s lock
    /// row, or a held lease's fence row. A try that fails — the lock busy, (`row`) its lock row
    /// not made yet, or the fence moved on — runs the attempt again with the lock taken (the
    /// fence checked) by statements of its own.
    pub(crate) fn folding(&self) -> Option<Folded> {
        if self.fold != Fold::Pending {
            return None;
        }
        if let Some(guard) = &self.guard {
            let fencing = guard.fencing()?;
            let fence = fence_of(fencing);
            if let Some(name) = fencing.fence_row() {
                let name = name.to_owned();
                return Some(Folded::Fence { name, fence });
            }
            let (name, owner) = fencing.owned_row()?;
            let (name, owner) = (name.to_owned(), owner.to_owned());
            return Some(Folded::Lease { name, owner, fence });
        }
        let name = &self.report.name;
        Some(match self.report.backend {
            LockKind::Row => Folded::Row(crate::lock::RowLock::stored_name(name)),
            _ => Folded::Advisory(crate::lock::PgAdvisoryLock::key(name)),
        })
    }

    /// How the try of [`folding`](Self::folding) went (`waited`: the statement's time).
    /// Not held — the lock is busy, or the statement found no row and so cannot tell — means
    /// the attempt is to be run again, the lock then taken by a statement of its own.
    pub(crate) fn folded(&mut self, held: bool, waited: Duration) {
        if self.guard.is_some() {
            // A lease's fence: the lease itself was had before the transaction. A lease row
            // freed by the statement is freed by this transaction's commit.
            self.fence_checked = held;
            self.release_rides = held && self.frees_in_fold();
            self.fold = if held { Fold::Allowed } else { Fold::Never };
            return;
        }
        self.report.tries = 1;
        self.report.waited += waited;
        if held {
            self.report.held = true;
            self.fold = Fold::Allowed;
        } else {
            self.fold = Fold::Never;
        }
    }

    /// The values of the lease's check-and-free ([`crate::lock::lease::lease_values`]) for a row
    /// write under `lockings` on MySQL/MariaDB to send first in the message of its commit marker
    /// (`marked`: it has one) and its UPDATE or DELETE (see
    /// [`crate::write::row_sql::update_with_evidence`]), where no statement before it can free the lease
    /// (no data-modifying `WITH` there): a single held `table` lease this transaction has not
    /// checked, whose check-and-free has not failed to ride before. The write then reports how
    /// it went with [`rode`](Self::rode); a check that did not confirm the lease runs the
    /// attempt again with the lease checked by a statement of its own.
    pub(crate) fn riding_write(
        lockings: &mut [Locking],
        backend: DbBackend,
        marked: bool,
    ) -> Option<[sea_orm::Value; 3]> {
        let [locking] = lockings else {
            return None;
        };
        let rides = marked && backend == DbBackend::MySql && locking.fold == Fold::Allowed;
        if !rides || locking.fence_checked || !locking.frees_in_fold() {
            return None;
        }
        let fencing = locking.guard.as_ref()?.fencing()?;
        let (name, owner) = fencing.owned_row()?;
        let values = crate::lock::lease::lease_values(name, owner, fence_of(fencing));
        locking.fold = Fold::Pending;
        Some(values)
    }

    /// How the row write that a lease rode in went ([`riding_write`](Self::riding_write), the
    /// one thing that leaves a lock `Pending` past the reload): `held`, it found the lease and
    /// its transaction frees it. Nothing when no lease rode.
    pub(crate) fn rode(lockings: &mut [Locking], held: bool) {
        if let [locking] = lockings
            && locking.fold == Fold::Pending
        {
            locking.folded(held, Duration::ZERO);
        }
    }

    /// Whether this lease is checked by a statement that frees its row ([`Folded::Lease`] on
    /// PostgreSQL, [`Self::riding_write`] on MySQL/MariaDB), not by reading its fence row
    /// ([`Folded::Fence`]).
    pub(super) fn frees_in_fold(&self) -> bool {
        let fencing = self.guard.as_ref().and_then(|guard| guard.fencing());
        fencing.is_some_and(|f| f.fence_row().is_none() && f.owned_row().is_some())
    }
}

/// A fence as the lock tables store it (BIGINT).
pub(super) fn fence_of(fencing: &dyn Fencing) -> i64 {
    i64::try_from(fencing.fence()).unwrap_or(i64::MAX)
}
