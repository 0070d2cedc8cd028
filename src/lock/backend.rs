//! What a lock backend is made of, for those who write one: the two halves of
//! [`LockBackend`](crate::LockBackend) ([`LeaseLock`], [`TransactionLock`]), what a lease grant
//! returns ([`Acquired`], [`LockGuard`]) and may offer ([`Fencing`], [`Renewal`]), and the words they speak
//! ([`LockRole`], [`LockScope`], [`LeaseCheck`], [`ReleaseError`]).
//!
//! An application that only picks one of freshlock's backends never names these: it passes a
//! backend to [`SessionBuilder::lock`](crate::SessionBuilder::lock) or picks one by name with
//! [`LockKind`](crate::LockKind). `testing::FakeLock` (feature `testing`) is a small backend
//! written against this module.

pub use super::traits::{
    Acquired, Fencing, LeaseCheck, LeaseLock, LockGuard, LockRole, LockScope, Renewal,
    TransactionLock,
};
pub use crate::error::ReleaseError;
