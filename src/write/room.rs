//! Commit combining's rooms: the waiters of one hot row each take a seat in the row's room
//! while they wait, and the holder takes the longest seated (see `combine.rs`). Rooms belong to
//! the database handle ([`crate::Db`]).

use std::{
    any::TypeId,
    collections::VecDeque,
    sync::{Arc, Mutex},
};

use sea_orm::EntityTrait;
use tokio::sync::{mpsc, oneshot};

use crate::{
    database::{Rooms, Which},
    erased::Erased,
    error::Result,
    lock::LockName,
    outcome::LockReport,
    write::decision::{Decision, Written},
};

/// The most writes one commit carries (the holder's and `MAX_BATCH - 1` waiters'). Waiters
/// beyond it stay seated, in order, for the next holder, so none starves behind newcomers.
pub(crate) const MAX_BATCH: usize = 32;

/// What the holder says to a seated waiter.
pub(crate) enum Call<E: EntityTrait> {
    /// Run your `apply` on this row and answer with your decision.
    Offer {
        row: E::Model,
        reply: oneshot::Sender<Decision<E>>,
    },
    /// The batch ended, and this is how for you.
    Done(Result<Served<E::Model>>),
    /// You were not served (nothing of yours was written): take the lock yourself.
    Again,
}

/// A served waiter's result: its outcome, the row as committed (for its session's cache) and
/// the lock it rode on.
pub(crate) struct Served<M> {
    pub(crate) outcome: Written<M>,
    pub(crate) stored: Option<Arc<M>>,
    pub(crate) lock: LockReport,
    pub(crate) batch: u32,
}

/// The room of a write: which writes may share its commit, among the rooms of the pool it runs
/// on.
#[derive(Clone)]
pub(crate) struct RoomKey {
    which: Which,
    rooms: Arc<Rooms>,
}

impl RoomKey {
    /// The room of a write among `rooms` (those of its database handle).
    pub(crate) fn new(
        entity: TypeId,
        rooms: &Arc<Rooms>,
        exclusion: u64,
        lock: &LockName,
        row: &LockName,
        version: Option<&'static str>,
        markers: bool,
    ) -> Self {
        let rooms = Arc::clone(rooms);
        Self {
            which: Which {
                entity,
                exclusion,
                lock: lock.as_str().to_owned(),
                row: row.as_str().to_owned(),
                version,
                markers,
            },
            rooms,
        }
    }
}

/// The waiters of one row, in the order they sat down.
struct Room<E: EntityTrait> {
    seats: Mutex<Seats<E>>,
}

struct Seats<E: EntityTrait> {
    next: u64,
    queue: VecDeque<(u64, mpsc::UnboundedSender<Call<E>>)>,
}

impl<E: EntityTrait> Room<E> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Seats<E>> {
        // A panic while holding this mutex cannot leave the queue half-changed.
        self.seats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A waiter's place in a room; leaving (or dropping) it takes it out if no holder took it.
pub(crate) struct Seat<E: EntityTrait> {
    key: RoomKey,
    room: Arc<Room<E>>,
    id: u64,
    seated: bool,
    /// What the holder says, once it took this seat.
    pub(crate) calls: mpsc::UnboundedReceiver<Call<E>>,
}

impl<E: EntityTrait> Seat<E>
where
    E::Model: Sync,
    E::ActiveModel: Send,
{
    /// Sits down in `key`'s room (made on demand).
    pub(crate) fn sit(key: RoomKey) -> Self {
        let room = {
            let entry = key.rooms.0.entry(key.which.clone()).or_insert_with(|| {
                Erased::new(Arc::new(Room::<E> {
                    seats: Mutex::new(Seats {
                        next: 0,
                        queue: VecDeque::new(),
                    }),
                }))
            });
            match entry.value().get::<Room<E>>() {
                Some(room) => room,
                // The key holds the entity's `TypeId`: another type cannot be found here.
                None => unreachable!("a room keyed by one entity type holds another"),
            }
        };
        let (sender, calls) = mpsc::unbounded_channel();
        let id = {
            let mut seats = room.lock();
            let id = seats.next;
            seats.next += 1;
            seats.queue.push_back((id, sender));
            id
        };
        Self {
            key,
            room,
            id,
            seated: true,
            calls,
        }
    }
}

impl<E: EntityTrait> Seat<E> {
    /// Leaves the room: `true` when the seat was still there, `false` when a holder took it (then
    /// its calls must be followed).
    pub(crate) fn leave(&mut self) -> bool {
        if !self.seated {
            return false;
        }
        self.seated = false;
        let mut seats = self.room.lock();
        let before = seats.queue.len();
        seats.queue.retain(|(id, _)| *id != self.id);
        seats.queue.len() != before
    }
}

impl<E: EntityTrait> Drop for Seat<E> {
    fn drop(&mut self) {
        self.leave();
        // The room goes when nobody refers to it but the map (no seat left, no holder in it).
        // Checked under the shard's lock, under which new references are made too.
        let key = &self.key;
        key.rooms
            .0
            .remove_if(&key.which, |_, room| room.holders() == 2);
    }
}

/// Takes up to `max` seats of `key`'s room, the longest seated first.
pub(crate) fn take_seats<E: EntityTrait>(
    key: &RoomKey,
    max: usize,
) -> Vec<mpsc::UnboundedSender<Call<E>>>
where
    E::Model: Sync,
    E::ActiveModel: Send,
{
    let Some(room) = key
        .rooms
        .0
        .get(&key.which)
        .and_then(|entry| entry.value().get::<Room<E>>())
    else {
        return Vec::new();
    };
    let taken: Vec<_> = {
        let mut seats = room.lock();
        let n = seats.queue.len().min(max);
        seats.queue.drain(..n).map(|(_, sender)| sender).collect()
    };
    drop(room);
    // As in `Seat::drop`: a seat that left while we held the room could not remove it.
    key.rooms
        .0
        .remove_if(&key.which, |_, room| room.holders() == 1);
    taken
}
