//! A lock statement's deadline: a lock backend's statements that get no reply within their
//! bound fail as a lost connection (see `db/deadline.rs`), as the backend's own error.

use std::{future::Future, time::Duration};

use crate::{db::failure::no_reply, error::LockError};

/// `lock`'s statements of the backend `backend`, or the backend's failure as a lost connection
/// when they got no reply within `bound` (the future is dropped then).
pub(crate) async fn lock_within<T>(
    backend: &'static str,
    bound: Duration,
    lock: impl Future<Output = Result<T, LockError>>,
) -> Result<T, LockError> {
    match tokio::time::timeout(bound, lock).await {
        Ok(result) => result,
        Err(_) => Err(lock_no_reply(backend, bound)),
    }
}

/// The failure of the lock backend `backend` whose statement got no reply within `bound`: read
/// as a lost connection, as [`no_reply`].
pub(crate) fn lock_no_reply(backend: &'static str, bound: Duration) -> LockError {
    LockError::Backend {
        backend,
        source: Box::new(no_reply(bound)),
    }
}
