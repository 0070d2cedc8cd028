//! Commits whose reply was lost: never applied twice.
//!
//! When the connection breaks while `COMMIT` is in flight, the transaction may or may not have
//! committed, and running the write again would apply it twice if it had. So every locked write
//! carries **evidence** of its commit ([`Evidence`]), and a lost reply is resolved on another
//! connection with it.
//!
//! **A commit marker** (MySQL/MariaDB; PostgreSQL without `freshlock_incarnation`): a row with a
//! token no other write has, inserted into `freshlock_commit` in the write's own transaction,
//! just before `COMMIT`. It is resolved by inserting the *same* token:
//!
//! - the insert fails on the key and the row is the writer's → the write committed: report it;
//! - the insert succeeds → the write did not commit, and now never can (its own insert of the
//!   token would fail): it is provably absent and safe to run again. The resolver's row is
//!   marked as its own (`created_at = 0`), because its insert can lose its reply too: a retried
//!   resolution that finds its own row knows the write is absent, not committed;
//! - while the old transaction is still finishing on the server, the insert waits for it (a
//!   unique-key check waits for the transaction that inserted the same key, on PostgreSQL,
//!   InnoDB and SQLite alike), so the answer is never read too early.
//!
//! A marker is one short INSERT in the transaction that commits anyway (no extra flush);
//! markers older than [`KEEP_MARKERS`] are deleted now and then by the writers themselves. A
//! marker row is durable exactly when the write is: it is in the same transaction, so crash
//! recovery keeps both or neither. On PostgreSQL it rides in the guarded UPDATE's own statement
//! (a data-modifying CTE): no round trip, but a second row, index entry and later deletion per
//! write (7–14 % of a `locked_update`'s rate, measured when it was chosen; history in git).
//!
//! **The transaction id within a server incarnation** (PostgreSQL with `freshlock_incarnation`):
//! `txid_current()`, returned by the guarded UPDATE beside the row (or one `SELECT` before the
//! commit of a section), resolved by `txid_status` — waiting while the transaction is still in
//! progress. The id alone is not evidence: a transaction whose WAL never reached disk before a
//! crash leaves no trace of its id, and after crash recovery the server hands the same id to a
//! new transaction — once that one commits, `txid_status` says `committed` for a write that never
//! was (measured: 8 of 8 tries after a `kill -9` of a backend). Ids are given out twice only
//! across crash recovery (or a failover to a standby), and those empty every `UNLOGGED` table.
//! So the server's incarnation is the token in `freshlock_incarnation`'s one row, an `UNLOGGED`
//! table (`schema::IncarnationMigration`): a pool sees the token (`Pool::incarnation`) before it
//! begins the write, hence before the id is given out; the resolution asks `txid_status` in the
//! same statement that checks the token is still there — then no crash recovery happened since
//! the id was given out, and the answer is this write's. With the token gone only `committed`
//! is ambiguous (the id may be another transaction's): [`Error::CommitUnknown`], never a guess;
//! `aborted` or an id "in the future" still prove the write absent (see `try_resolve_xid`). A
//! write that finds the table empty (new, or just emptied by crash recovery) carries a marker
//! instead and starts the new incarnation.
//!
//! If the database does not answer within [`RESOLVE_WITHIN`], the outcome stays unknown and the
//! caller gets [`Error::CommitUnknown`] — never a second `apply`.
//!
//! Why a token rather than the version column or the lease's fence: both can be moved on by a
//! later writer (an ABA: version v+1 may be someone else's write from v when ours did not
//! commit), so they cannot prove that *this* write committed. A token can.

mod evidence;
mod marker;
mod resolve;
mod transaction;

pub(crate) use evidence::{Evidence, Plan, Stamped};
pub(crate) use marker::Marker;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use resolve::Resolution;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use transaction::committed;
pub(crate) use transaction::{commit, commit_write, write_error};
