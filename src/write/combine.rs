//! Commit combining for hot rows ([`crate::SessionBuilder::combine_commits`]).
//!
//! The tasks of one process waiting for the lock of the same row each take a *seat* in the row's
//! *room* while they wait. The task that gets the lock (the *holder*) reloads the row, runs its
//! own `apply`, then serves up to [`MAX_BATCH`]` - 1` seated waiters in the order they sat down:
//! each is handed the row as the ones before it changed it, runs its own `apply` in its own
//! caller (closures need not be `'static`: they never leave their task), and answers with its
//! draft. The holder writes the merged change with one guarded UPDATE and commits once; every
//! served waiter then gets its own report with the committed row, before the lock is released.
//!
//! A waiter whose `apply` fails or panics, or whose caller was dropped before its turn,
//! contributes nothing and returns its own error; the others still commit. A waiter the holder
//! could not serve (the holder's own write failed or was refused before its commit was sent) is
//! told to take the lock itself: nothing of it was written, so running it again cannot apply it
//! twice. A commit whose outcome is unknown is reported as [`crate::Error::CommitUnknown`] to
//! every member of the batch, never run again.
//!
//! Rooms belong to the database handle (`crate::Db`: every session made from it shares them),
//! and are keyed there by the lock
//! space that excludes the process's writers from each other (the in-process lock itself, or a
//! backend's in-process queue: by its id, so sessions given the shared `LocalLock` in `Arc`s of
//! their own meet in one room), the lock and
//! the row, the entity type and the session's write settings (version column, commit markers),
//! so only writes that would have run the same statements one after the other are merged.

use std::sync::Arc;

use sea_orm::{ConnectionTrait, DbErr, EntityTrait, IdenStatic, ModelTrait};
use tokio::sync::{mpsc, oneshot};

use super::room::{Call, MAX_BATCH, RoomKey, Served, take_seats};
use crate::{
    error::{Error, Result, database},
    outcome::LockReport,
    write::decision::{Decision, Written},
    write::row::Row,
    write::row_sql as write,
};

/// A waiter served by a holder, and where its turn stands in the current attempt.
struct Member<E: EntityTrait> {
    calls: mpsc::UnboundedSender<Call<E>>,
    state: Turn,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Not (yet) served in this attempt.
    Waiting,
    /// Its change is in this attempt's write (`changed`: it changed something).
    Merged { changed: bool },
    /// It has its answer (a result, or its own error), or is gone.
    Out,
}

impl<E: EntityTrait> Member<E> {
    fn finish(&mut self, result: Result<Served<E::Model>>) {
        self.state = Turn::Out;
        let _ = self.calls.send(Call::Done(result));
    }
}

impl<E: EntityTrait> Drop for Member<E> {
    /// A member the batch did not finish was not written: it takes the lock itself.
    fn drop(&mut self) {
        if self.state != Turn::Out {
            let _ = self.calls.send(Call::Again);
        }
    }
}

/// The holder's side of combining: the waiters it serves, taken from the room on its first
/// attempt that writes. Dropping the batch tells every waiter it did not finish to take the lock
/// itself (nothing of theirs was written): do it before the lock is released, so none of them
/// can take it first.
pub(crate) struct Batch<E: EntityTrait> {
    members: Vec<Member<E>>,
}

impl<E> Batch<E>
where
    E: EntityTrait,
    E::Model: Sync,
    E::ActiveModel: Send,
{
    /// Takes the waiters seated in `room` (up to [`MAX_BATCH`]` - 1`).
    pub(crate) fn take(room: &RoomKey) -> Self {
        let members = take_seats::<E>(room, MAX_BATCH - 1)
            .into_iter()
            .map(|calls| Member {
                calls,
                state: Turn::Waiting,
            })
            .collect();
        Self { members }
    }

    /// Serves the batch: each waiter runs its `apply` on the row as the ones before it left it
    /// (`original` with `changes`), and its change is merged into `changes`. `Ok(false)`: a
    /// waiter's `before_save` failed, or changed the primary key, after it may have written in
    /// the transaction; that waiter got its error, and the attempt must run again without it.
    pub(crate) async fn serve(
        &mut self,
        txn: &impl ConnectionTrait,
        original: &E::Model,
        changes: &mut Vec<write::ColumnValue<E>>,
        row: &Row,
    ) -> std::result::Result<bool, DbErr> {
        let mut current = original.clone();
        for (column, value) in changes.iter() {
            current.try_set(*column, value.clone())?;
        }
        for member in &mut self.members {
            if member.state == Turn::Out {
                continue;
            }
            member.state = Turn::Waiting;
            let (reply, answer) = oneshot::channel();
            let offer = Call::Offer {
                row: current.clone(),
                reply,
            };
            // A closed channel or a dropped reply: the waiter is gone, or its `apply` failed or
            // panicked. It contributes nothing and returns its own error.
            if member.calls.send(offer).is_err() {
                member.state = Turn::Out;
                continue;
            }
            let Ok(decision) = answer.await else {
                member.state = Turn::Out;
                continue;
            };
            match decision {
                Decision::Update {
                    original: seen,
                    draft,
                } => {
                    let mut draft = match write::before_save::<E, _>(draft, txn, false).await {
                        Ok(draft) => draft,
                        Err(e) => {
                            member.finish(Err(database("running before_save for", row, e)));
                            return Ok(false);
                        }
                    };
                    if let Err(moved) = row.check_key::<E>(&draft) {
                        member.finish(Err(moved));
                        return Ok(false);
                    }
                    let theirs = write::changed_columns::<E>(&seen, &mut draft);
                    member.state = Turn::Merged {
                        changed: !theirs.is_empty(),
                    };
                    for (column, value) in theirs {
                        current.try_set(column, value.clone())?;
                        match changes
                            .iter_mut()
                            .find(|(changed, _)| changed.as_str() == column.as_str())
                        {
                            Some(slot) => slot.1 = value,
                            None => changes.push((column, value)),
                        }
                    }
                }
                Decision::Keep(_) => member.state = Turn::Merged { changed: false },
                // Not an update of this row: it runs alone, after this batch.
                Decision::NotFound | Decision::Insert(_) | Decision::Delete(_) => {
                    member.state = Turn::Out;
                    let _ = member.calls.send(Call::Again);
                }
            }
        }
        Ok(true)
    }

    /// Each served waiter that changed something gets its own `after_save` of `stored`: what
    /// it returned, by member index. `None`: one failed; that waiter got its error, and the
    /// attempt must run again without it.
    pub(crate) async fn after_saves(
        &mut self,
        stored: &E::Model,
        txn: &impl ConnectionTrait,
        row: &Row,
    ) -> Option<Vec<(usize, E::Model)>> {
        self.each_after_save(stored, txn, row, false).await
    }

    /// [`after_saves`](Self::after_saves) after the batch committed (a write in two flights,
    /// `flights.rs`): a waiter whose `after_save` fails gets its error while its write stands,
    /// and the others still get theirs.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) async fn after_saves_committed(
        &mut self,
        stored: &E::Model,
        txn: &impl ConnectionTrait,
        row: &Row,
    ) -> Vec<(usize, E::Model)> {
        (self.each_after_save(stored, txn, row, true).await).unwrap_or_default()
    }

    async fn each_after_save(
        &mut self,
        stored: &E::Model,
        txn: &impl ConnectionTrait,
        row: &Row,
        committed: bool,
    ) -> Option<Vec<(usize, E::Model)>> {
        let mut theirs = Vec::new();
        for (index, member) in self.members.iter_mut().enumerate() {
            if member.state != (Turn::Merged { changed: true }) {
                continue;
            }
            match write::after_save::<E, _>(stored.clone(), txn, false).await {
                Ok(reported) => theirs.push((index, reported)),
                Err(e) if committed => {
                    let operation = "running after_save (after the commit) for";
                    member.finish(Err(database(operation, row, e)));
                }
                Err(e) => {
                    member.finish(Err(database("running after_save for", row, e)));
                    return None;
                }
            }
        }
        Some(theirs)
    }

    /// The commit's outcome is unknown: every write of the batch is in doubt alike, and none may
    /// run again blindly.
    pub(crate) fn in_doubt(&mut self, row: &Row, why: &str) {
        for member in &mut self.members {
            if let Turn::Merged { .. } = member.state {
                member.finish(Err(Error::CommitUnknown {
                    target: row.to_string(),
                    source: why.to_owned().into(),
                }));
            }
        }
    }

    /// After the commit: every waiter merged into it gets its report, with the committed row
    /// (`theirs`: the rows their own `after_save` returned, by member index; `lock`: the holder's
    /// lock). How many writes the commit carried, the holder's included.
    pub(crate) fn committed(
        &mut self,
        lock: &LockReport,
        stored: &Arc<E::Model>,
        theirs: Vec<(usize, E::Model)>,
    ) -> u32 {
        let merged = self
            .members
            .iter()
            .filter(|member| matches!(member.state, Turn::Merged { .. }))
            .count();
        let batch = u32::try_from(merged + 1).unwrap_or(u32::MAX);
        let mut theirs = theirs.into_iter().peekable();
        for (index, member) in self.members.iter_mut().enumerate() {
            let Turn::Merged { changed } = member.state else {
                continue;
            };
            let outcome = match theirs.next_if(|(at, _)| *at == index) {
                Some((_, reported)) => Written::Updated(Arc::new(reported)),
                None if changed => Written::Updated(Arc::clone(stored)),
                None => Written::Unchanged(Arc::clone(stored)),
            };
            let lock = LockReport {
                tries: 0,
                waited: std::time::Duration::ZERO,
                release_error: None,
                ..lock.clone()
            };
            member.finish(Ok(Served {
                outcome,
                stored: Some(Arc::clone(stored)),
                lock,
                batch,
            }));
        }
        batch
    }
}

/// How following a holder ended, for a seated waiter.
pub(crate) enum Followed<M> {
    /// The batch committed (or failed) with this write in it.
    Finished(Result<Served<M>>),
    /// Not served: take the lock.
    Again,
    /// The waiter's own caller is gone, or its `apply` failed or panicked (its caller returns
    /// its own error).
    Gone,
}

/// The waiter's side of combining: it follows the holder that took its seat, relaying each
/// offered row to its caller's `apply` (through `reloaded`; `offered` runs first, to evict the
/// session's cached row) and the decision back (from `decisions`), until the holder says how the
/// batch ended.
pub(crate) async fn follow<E: EntityTrait>(
    first: Option<Call<E>>,
    calls: &mut mpsc::UnboundedReceiver<Call<E>>,
    reloaded: &mpsc::Sender<Option<E::Model>>,
    decisions: &mut mpsc::Receiver<Decision<E>>,
    mut offered: impl FnMut(),
) -> Followed<E::Model> {
    let mut next = first;
    loop {
        let call = match next.take() {
            Some(call) => call,
            None => heard(calls.recv().await),
        };
        match call {
            Call::Again => return Followed::Again,
            Call::Done(result) => return Followed::Finished(result),
            Call::Offer { row, reply } => {
                offered();
                if reloaded.send(Some(row)).await.is_err() {
                    return Followed::Gone;
                }
                // `None`: our caller's `apply` failed or panicked, or it is gone. Dropping
                // `reply` tells the holder; the caller returns its own error.
                let Some(decision) = decisions.recv().await else {
                    return Followed::Gone;
                };
                let _ = reply.send(decision);
            }
        }
    }
}

/// A seated waiter's next call: a holder that vanished without a word (its channel closed) wrote
/// nothing of ours — it panicked before its commit, and its transaction rolled back — so that is
/// [`Call::Again`].
pub(crate) fn heard<E: EntityTrait>(call: Option<Call<E>>) -> Call<E> {
    call.unwrap_or(Call::Again)
}
