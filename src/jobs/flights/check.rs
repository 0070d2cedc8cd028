//! The check that ends a job's last message: the statements after its completion that stop
//! the message before its `COMMIT` when a job was not marked done, and what an attempt does
//! when they stopped it.

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use super::Committed;
use crate::{
    commit::Marker,
    db::{deadline::within, held::Held, inline::statement_text},
    error::{Result, database},
    jobs::{
        JobId,
        deferred::Deferred,
        step::{JobStep, Source},
        store,
    },
    schema::JOB_TABLE,
};

/// The statements after the completion: the check that it marked every job of `ids` done
/// (`store::unless_done`: it stops the message otherwise) — or, for a finish's completion whose
/// promotion follows it (`store::Chained`, MySQL/MariaDB), that promotion, which checks first.
/// On MySQL/MariaDB the check reads the completion's own count (`store::unless_counted`, right
/// after it), and `marker`, the commit's marker when it rides, is written by the check itself
/// (`Marker::insert_unless`): one statement where there were two, and no read of the jobs'
/// rows.
pub(super) fn after(
    backend: DbBackend,
    deferred: &Deferred,
    owner: Option<&str>,
    marker: Option<&Marker>,
) -> Vec<sea_orm::Statement> {
    if let Some(chained) = deferred.completion.chained() {
        return vec![
            chained.find.clone(),
            chained.promote.clone(),
            chained.read.clone(),
        ];
    }
    if backend == DbBackend::MySql {
        let check = store::unless_counted(deferred.ids.len());
        return vec![match marker {
            Some(marker) => marker.insert_unless(backend, &check),
            None => {
                let sql = format!("SELECT {check} AS freshlock_all_done");
                crate::lock::sql::statement(backend, &sql, Vec::new())
            }
        }];
    }
    let (unless_done, values) = store::unless_done(&deferred.ids, owner);
    let sql = format!("SELECT {unless_done} AS freshlock_all_done");
    vec![crate::lock::sql::statement(backend, &sql, values)]
}

/// The check stopped the message: rolls back and reads which of `ids` were asked to stop (one
/// message: the read in autocommit, written in, so that a transaction pooler runs it on one
/// server connection), for the next attempt to cancel them (`cancel.rs`).
pub(super) async fn stopped(
    step: &mut JobStep<'_>,
    held: Held,
    ids: &[JobId],
    reply: std::time::Duration,
) -> Result<Committed> {
    let fail = |operation| move |e| database(operation, &JOB_TABLE, e);
    // A finish's completion requires its claim: the next attempt looks at the claim first and
    // says why it is gone (lease lost or cancelled), as in the engine.
    if matches!(step.source, Source::Finish(_)) {
        let rolled_back = within(reply, held.conn().flight("ROLLBACK".to_owned())).await;
        rolled_back.map_err(fail("rolling back"))?;
        held.release();
        step.recheck = true;
        return Ok(Committed::Stopped);
    }
    let read = store::requested_statement(held.get_database_backend(), ids);
    let text = statement_text(&read).ok_or_else(|| {
        let e = DbErr::Custom("the jobs' ids could not be written in".into());
        database("reading the requests to stop jobs of", &JOB_TABLE, e)
    })?;
    let message = format!("ROLLBACK; {text}");
    let replies = within(reply, held.conn().flight(message)).await;
    let mut replies = replies.map_err(fail("rolling back"))?;
    let rows = replies.pop().map(|reply| reply.rows).unwrap_or_default();
    step.cancelling =
        store::read_requested(&rows).map_err(fail("reading the requests to stop jobs of"))?;
    held.release();
    Ok(Committed::Stopped)
}
