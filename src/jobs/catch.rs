//! A handler's future with its panics caught: a panicking job is a failed attempt, reported
//! through `tracing` (not printed by the default panic hook on every attempt).

use std::{
    cell::Cell,
    future::Future,
    panic::{AssertUnwindSafe, PanicHookInfo},
    pin::Pin,
    sync::Once,
    task::{Context, Poll},
};

thread_local! {
    /// Whether this thread is polling a handler (its panics are caught and reported here).
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
}

/// Puts freshlock's panic hook in front of the one the process has, once: a panic while a
/// handler is polled is an `error` event (message and location) of the job's span; any other
/// panic goes to the hook that was there. A hook the application sets later replaces this one
/// (its own choice, then, of what to print).
fn report_handler_panics() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            if IN_HANDLER.with(Cell::get) {
                let message = panic_message(info.payload());
                let location = info.location().map(ToString::to_string);
                tracing::error!(
                    panic = %message,
                    location = location.as_deref().unwrap_or("unknown"),
                    "a job's handler panicked"
                );
            } else {
                previous(info);
            }
        }));
    });
}

/// A panic's message, when it has one.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = panic.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = panic.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// A handler's future with its panics caught: a panicking job is a failed attempt, and the
/// worker goes on.
pub(super) struct CatchUnwind<F> {
    inner: F,
}

impl<F> CatchUnwind<F> {
    /// `inner`, its panics caught and reported through `tracing`.
    pub(super) fn new(inner: F) -> Self {
        report_handler_panics();
        Self { inner }
    }
}

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.get_mut().inner;
        let outer = IN_HANDLER.with(|flag| flag.replace(true));
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut *inner).poll(cx)));
        IN_HANDLER.with(|flag| flag.set(outer));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(ready)) => Poll::Ready(Ok(ready)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
