//! A job step run to its end: on a held connection in as few round trips as its handlers allow
//! (`flights/`, with [`crate::SessionBuilder::two_flights`]), else on the engine — each again
//! on a transient failure. The step itself (take, run, record) is `step.rs`.

use super::{
    context::Context,
    job::JobRun,
    leased::Claimed,
    step::{JobStep, Source},
};
use crate::{
    error::Result,
    schema::JOB_TABLE,
    write::engine::{self, Engine, Retries},
};

/// What one step did: the jobs that ended, those the take claimed under a lease (their work
/// is still to run), and the key whose next job it readied (see `Source::Take`'s `follow`).
pub(super) struct Stepped {
    pub(super) runs: Vec<JobRun>,
    pub(super) claimed: Vec<Claimed>,
    pub(super) follow: Option<Vec<u8>>,
}

/// One step from `source`, its attempt run again on a transient failure.
pub(super) async fn run_step(cx: &Context, source: Source<'_>) -> Result<Stepped> {
    super::admit::prepare(cx).await;
    let mut step = JobStep::new(cx, source);
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    if super::flights::applies(&step) {
        let runs = super::flights::run(&mut step).await?;
        return Ok(Stepped {
            runs,
            claimed: step.claimed,
            follow: step.follow,
        });
    }
    let session = &cx.session;
    let engine = Engine {
        db: session.pool(),
        map: session.map(),
        markers: session.commit_markers(),
    };
    let attempts = session.policy().write_attempts;
    let mut retries = Retries::new(JOB_TABLE.to_owned(), attempts, true, None);
    let runs = engine::run(engine, &mut [], &mut retries, JOB_TABLE, false, &mut step).await?;
    Ok(Stepped {
        runs,
        claimed: step.claimed,
        follow: step.follow,
    })
}
