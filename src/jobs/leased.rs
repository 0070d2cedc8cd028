//! A leased kind's parts: the [`Lease`] its work watches, its type-erased work and finish,
//! and a claimed job on its way from the take to its finish (see `lease.rs`, which runs them).

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::sync::watch;

use super::{
    job::{JobFailure, JobId, Raw},
    retry::Retry,
};
use crate::{error::ApplyError, tx::Tx, write::section::SectionWork};

/// The shortest lease a kind gets: the heartbeat beats every third of it.
pub(super) const MIN_LEASE: Duration = Duration::from_millis(300);

/// A leased job's claim, as its work sees it: whether the claim still holds.
///
/// The claim is lost when its lease expired (a heartbeat could not reach the database in time,
/// or the work was stalled longer than the lease) and another worker reclaimed the job: the
/// job runs again there, and this attempt's finish will be refused. Long work may watch
/// [`lost`](Self::lost) to stop early.
#[derive(Clone, Debug)]
pub struct Lease {
    pub(super) id: JobId,
    pub(super) lost: watch::Receiver<bool>,
}

impl Lease {
    /// The job's id.
    pub fn job(&self) -> JobId {
        self.id
    }

    /// Whether a heartbeat found the claim gone (it never comes back).
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Completes when a heartbeat finds the claim gone; never while it holds.
    pub async fn lost(&self) {
        let mut lost = self.lost.clone();
        if lost.wait_for(|lost| *lost).await.is_err() {
            // The heartbeat stopped with the claim held: the work has ended.
            std::future::pending::<()>().await;
        }
    }
}

/// What a leased kind's work gives its finish: the work's output together with the kind's
/// finish, behind one trait object, so the output keeps its type (the kind's `R`) and nothing
/// is downcast.
pub(super) trait Finishable: Send + Sync {
    /// Starts the kind's finish of job `raw` with the work's output, in `tx`: `Err` when the
    /// payload does not read as the kind's.
    fn finish<'t>(
        &'t self,
        tx: &'t Tx,
        raw: Raw<'_>,
    ) -> std::result::Result<SectionWork<'t, ()>, String>;
}

/// A leased job's work's output, ready to be finished.
pub(super) type Output = Arc<dyn Finishable>;

/// A kind's work: deserializes the payload (or says why not) and starts the work.
pub(super) type WorkRunner = dyn Fn(
        Raw<'_>,
        Lease,
    ) -> std::result::Result<
        Pin<Box<dyn Future<Output = std::result::Result<Output, ApplyError>> + Send>>,
        String,
    > + Send
    + Sync;

/// A leased kind's handlers (its finish travels with the work's output: [`Finishable`]).
pub(super) struct Leased {
    pub(super) lease: Duration,
    pub(super) work: Box<WorkRunner>,
}

/// A job claimed under a lease by a take that committed.
pub(super) struct Claimed {
    pub(super) id: JobId,
    pub(super) kind: Vec<u8>,
    pub(super) key: Option<Vec<u8>>,
    pub(super) payload: String,
    pub(super) attempt: u32,
    pub(super) owner: String,
    pub(super) lease: Duration,
    /// Milliseconds since the job was due, at the take.
    pub(super) waited: i64,
}

impl Claimed {
    pub(super) fn kind_name(&self) -> String {
        String::from_utf8_lossy(&self.kind).into_owned()
    }

    pub(super) fn key_text(&self) -> Option<String> {
        (self.key.as_ref()).map(|k| String::from_utf8_lossy(k).into_owned())
    }
}

/// A claimed job whose work ended, to finish.
pub(super) struct Finishing {
    pub(super) claim: Claimed,
    /// The work's output, or why it failed and whether that retries.
    pub(super) worked: std::result::Result<Output, (JobFailure, Retry)>,
    /// How long the work ran.
    pub(super) ran: Duration,
    /// Whether the finish claims its key's next job when it can (`store::Claiming`):
    /// a worker's run loop chains a key's leased jobs; `run_one` / `run_batch` never chain.
    pub(super) chain: bool,
}
