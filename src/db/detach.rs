//! Futures that are never cut in half: polled in place by their caller, and moved to a task of
//! their own if the caller is dropped before they end (a cancelled request, a deadline of
//! `deadline.rs`). A locked section's driver is one (its transaction ends in a commit or a
//! rollback, its lock is released after); a `BEGIN` is another ([`begin`]: sqlx counts the
//! transaction only once `BEGIN`'s reply is read, so a cut `BEGIN` would leave its connection in
//! a transaction nobody ends, and the next borrower's writes would wait in it uncommitted).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, TransactionOptions, TransactionTrait,
};
use tracing::error;

/// A future polled in place by its caller; if the caller is dropped before it finished, `Drop`
/// moves it (it is boxed, so it does not move in memory) to a task of its own, which runs it to
/// its end (a locked section's commit or rollback and lock release; a `BEGIN`'s reply). A
/// statement is thus never cut in half by a cancellation, without paying for a task and thread
/// hops on every call.
pub(crate) struct Detachable<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> Detachable<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<T: Send + 'static> Future for Detachable<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending; // Finished already: never polled again by our callers.
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for Detachable<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        // While unwinding from a panic inside the future it cannot be polled again; dropping it
        // rolls its transaction back (queued on the connection) and frees its lock.
        if std::thread::panicking() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = future.await;
                });
            }
            Err(_) => {
                error!("a database round trip dropped outside a tokio runtime; rolled back on drop")
            }
        }
    }
}

/// `BEGIN` (with `options`) on a connection of `db`, never cut in half: if the caller is dropped
/// while it is in flight, it ends in a task of its own and the transaction it began is dropped,
/// which rolls it back. Polled in place: no task on the way that is not cut. (`live::begin` is
/// this, tried on another connection when the pool hands out a dead one.)
pub(crate) async fn begin(
    db: &DatabaseConnection,
    options: TransactionOptions,
) -> Result<DatabaseTransaction, DbErr> {
    let db = db.clone();
    Detachable::new(async move { db.begin_with_options(options).await }).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_future_dropped_by_its_caller_still_ends() {
        let (finished, done) = tokio::sync::oneshot::channel();
        let late = Detachable::new(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let _ = finished.send(());
        });
        // A deadline drops it half-way…
        assert!(
            tokio::time::timeout(Duration::from_secs(3), late)
                .await
                .is_err()
        );
        // …and it still runs to its end, in a task of its own.
        done.await.expect("the dropped future finished");
    }
}
