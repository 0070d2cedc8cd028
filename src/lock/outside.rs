//! What every backend of freshlock's that reaches outside the process says of itself, written
//! once: it keeps an in-process queue of its own (a [`LocalLock`](super::LocalLock) in its
//! `queue` field, shared by its clones: see [`LockBackend::queue`](super::LockBackend::queue)),
//! it has a [`LockKind`](super::LockKind), and it is one of the two halves
//! ([`LockRole::Lease`](super::LockRole::Lease) or
//! [`LockRole::Transaction`](super::LockRole::Transaction)). A backend that forgot its queue
//! would let every waiter of a hot key in the process poll the shared lock and hold a
//! connection for it.

/// `impl LockBackend` for `$backend`, of kind `LockKind::$kind`, in role `LockRole::$role`, its
/// queue in the field `queue`.
macro_rules! outside_backend {
    ($backend:ty, $kind:ident, $role:ident) => {
        impl $crate::lock::LockBackend for $backend {
            fn queue(&self) -> Option<&dyn $crate::lock::LockBackend> {
                Some(&self.queue)
            }

            fn kind(&self) -> $crate::lock::LockKind {
                $crate::lock::LockKind::$kind
            }

            fn role(&self) -> $crate::lock::LockRole<'_> {
                $crate::lock::LockRole::$role(self)
            }
        }
    };
}

pub(crate) use outside_backend;
