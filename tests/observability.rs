//! Spans, events and metrics as an operator sees them: a tracing subscriber and a metrics
//! recorder installed by the test, then the situations they exist for.

mod common;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use common::{FakeLock, TestDatabase, node_in_db, seed_nodes, test_db};
use entity::node;
use freshlock::lock::TableLock;
use freshlock::{LockPolicy, OnLockFailure, Session, UpdateOutcome};
use sea_orm::{ConnectionTrait, Set};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Layer, layer::Context, prelude::*, registry::LookupSpan};

type Fields = BTreeMap<String, String>;

/// What the subscriber saw: closed spans and events, with their fields as text.
#[derive(Clone, Default)]
struct Seen {
    spans: Arc<Mutex<Vec<(String, Fields)>>>,
    events: Arc<Mutex<Vec<(tracing::Level, Fields)>>>,
}

struct Text<'a>(&'a mut Fields);

impl Visit for Text<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
}

/// A span's capture: the test that saw it created, and its place in that test's `spans`.
struct Index(Seen, usize);

thread_local! {
    /// The capture of the test running on this thread (each test runs a current-thread runtime).
    static CURRENT: std::cell::RefCell<Option<Seen>> = const { std::cell::RefCell::new(None) };
}

/// One process-wide subscriber that hands spans and events to the current thread's test. (A
/// subscriber per test with `set_default` lost events now and then when tests ran in parallel:
/// tracing caches each callsite's interest process-wide.)
struct Route;

fn current() -> Option<Seen> {
    CURRENT.with(|c| c.borrow().clone())
}

// Spans are captured as they are created and recorded, not when they close: sqlx hands the
// current span to its SQLite worker thread, which may drop it a moment after the call returned.
impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Route {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(seen) = current() else { return };
        let mut fields = Fields::new();
        attrs.record(&mut Text(&mut fields));
        let index = {
            let mut spans = seen.spans.lock().unwrap();
            spans.push((attrs.metadata().name().to_owned(), fields));
            spans.len() - 1
        };
        ctx.span(id)
            .unwrap()
            .extensions_mut()
            .insert(Index(seen, index));
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let extensions = span.extensions();
        if let Some(Index(seen, index)) = extensions.get::<Index>() {
            values.record(&mut Text(&mut seen.spans.lock().unwrap()[*index].1));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let Some(seen) = current() else { return };
        let mut fields = Fields::new();
        event.record(&mut Text(&mut fields));
        seen.events
            .lock()
            .unwrap()
            .push((*event.metadata().level(), fields));
    }
}

/// The current thread's capture, until dropped.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        CURRENT.with(|c| c.borrow_mut().take());
    }
}

impl Seen {
    /// Captures what this thread's test emits (the test's current-thread runtime).
    fn install(&self) -> Installed {
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Route))
                .expect("no other global subscriber in this test binary");
        });
        CURRENT.with(|c| *c.borrow_mut() = Some(self.clone()));
        Installed
    }

    fn updates(&self) -> Vec<Fields> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|(name, _)| name == "locked_update")
            .map(|(_, fields)| fields.clone())
            .collect()
    }

    fn event(&self, message_start: &str) -> Option<(tracing::Level, Fields)> {
        let events = self.events.lock().unwrap();
        events
            .iter()
            .find(|(_, f)| {
                f.get("message")
                    .is_some_and(|m| m.starts_with(message_start))
            })
            .cloned()
    }
}

fn with_lock(db: &TestDatabase, lock: FakeLock, on_failure: OnLockFailure) -> Session {
    db.session_builder()
        .lock(Arc::new(lock))
        .policy(
            LockPolicy::default()
                .with_lock_tries(2)
                .with_on_failure(on_failure),
        )
        .build()
        .unwrap()
}

fn score(n: i32) -> impl FnMut(&mut node::ActiveModel) -> Result<(), freshlock::ApplyError> {
    move |row| {
        row.score = Set(Some(n));
        Ok(())
    }
}

#[tokio::test]
async fn a_span_per_locked_update_with_entity_key_backend_wait_attempts_and_outcome() {
    let seen = Seen::default();
    let _guard = seen.install();
    let db = test_db().await;
    seed_nodes(&db, 2).await;
    let nodes = db.session().repository::<node::Entity>();
    nodes.locked_update(2, score(1)).await.unwrap();
    nodes.locked_update(2, score(1)).await.unwrap();
    nodes.locked_update(99, score(1)).await.unwrap();

    let spans = seen.updates();
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let first = &spans[0];
    assert_eq!(first["entity"], "node");
    assert_eq!(first["key"], "2");
    assert_eq!(first["backend"], "local");
    assert_eq!(first["lock_held"], "true");
    assert_eq!(first["attempts"], "1");
    assert_eq!(first["conflicts"], "0");
    assert_eq!(first["outcome"], "updated");
    assert!(first.contains_key("lock_wait_ms"), "{first:?}");
    assert_eq!(spans[1]["outcome"], "unchanged");
    assert_eq!(spans[2]["outcome"], "not_found");
    assert_eq!(spans[2]["key"], "99");
}

/// A handler's panic is a failed attempt reported through `tracing` — an `error` event with the
/// panic's message and where it happened — not printed by the default hook on every attempt.
#[tokio::test]
async fn a_handler_panic_is_a_tracing_event() {
    use freshlock::jobs::{self, Job, JobFailure, JobOutcome, Jobs, NewJob, RetryPolicy, Worker};
    let seen = Seen::default();
    let _guard = seen.install();
    let db = test_db().await;
    let zero = std::time::Duration::ZERO;
    let policy = RetryPolicy::default()
        .with_max_attempts(2)
        .with_backoff(zero, zero);
    let handlers = Jobs::new().handle(
        "boom",
        policy,
        async |_tx: &freshlock::Tx, job: Job<u32>| {
            assert!(job.payload > 100, "payload {} too small", job.payload);
            Ok(())
        },
    );
    jobs::enqueue(db.connection(), NewJob::new("boom", &7_u32).unwrap())
        .await
        .unwrap();
    let runs = Worker::new(db.session(), handlers)
        .drain(zero)
        .await
        .unwrap();
    assert_eq!(runs.len(), 2, "{runs:#?}");
    assert!(
        matches!(&runs[1].outcome, JobOutcome::Failed(JobFailure::Panicked(m)) if m == "payload 7 too small")
    );
    let events = seen.events.lock().unwrap();
    let panics: Vec<&Fields> = (events.iter())
        .filter(|(level, f)| {
            *level == tracing::Level::ERROR
                && f.get("message")
                    .is_some_and(|m| m == "a job's handler panicked")
        })
        .map(|(_, f)| f)
        .collect();
    assert_eq!(panics.len(), 2, "one per attempt: {events:#?}");
    assert_eq!(panics[0]["panic"], "payload 7 too small");
    assert!(
        panics[0]["location"].contains("observability.rs"),
        "{:?}",
        panics[0]
    );
}

/// The span's `lock_wait_ms` is the time spent waiting for a held lock: a writer queued behind a
/// holder that keeps the lock 40 ms longer waited at least that long (a lower bound: never
/// flaky), and its report says the same.
#[tokio::test]
async fn the_span_records_the_time_waited_for_a_held_lock() {
    use freshlock::lock::LocalLock;
    use freshlock::lock::backend::LeaseLock;
    use freshlock::lock_name;
    use std::time::Duration;

    let seen = Seen::default();
    let _guard = seen.install();
    let db = test_db().await;
    seed_nodes(&db, 2).await;
    let lock = LocalLock::new();
    let session = db
        .session_builder()
        .lock(Arc::new(lock.clone()))
        .build()
        .unwrap();
    let name = lock_name::<node::Entity>(2).unwrap();
    let held = lock
        .acquire(&name, Duration::from_secs(1), Duration::from_secs(60))
        .await
        .unwrap()
        .expect("free");
    let writer = tokio::spawn(async move {
        session
            .repository::<node::Entity>()
            .locked_update(2, score(7))
            .await
            .unwrap()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while lock.queue_len(&name) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the writer never queued"
        );
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(40)).await;
    held.release().await.unwrap();
    let report = writer.await.unwrap();
    assert!(
        report.lock.waited >= Duration::from_millis(40),
        "{report:?}"
    );

    let spans = seen.updates();
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let waited: f64 = spans[0]["lock_wait_ms"].parse().unwrap();
    assert!(waited >= 40.0, "lock_wait_ms = {waited}");
    assert_eq!(spans[0]["outcome"], "updated");
}

#[tokio::test]
async fn events_for_conflicts_proceeding_without_the_lock_and_a_lost_lease() {
    let seen = Seen::default();
    let _guard = seen.install();
    let db = test_db().await;
    seed_nodes(&db, 1).await;

    let fake = FakeLock::new();
    fake.interfere("UPDATE node SET score = 100 WHERE id = 1", 1);
    let report = with_lock(&db, fake.clone(), OnLockFailure::Fail)
        .repository::<node::Entity>()
        .locked_update(1, score(5))
        .await
        .unwrap();
    assert_eq!((report.attempts, report.conflicts), (2, 1));
    let (level, _) = seen.event("conflict").expect("a conflict event");
    assert_eq!(level, tracing::Level::WARN);
    assert_eq!(seen.updates()[0]["conflicts"], "1");

    fake.never_acquire(true);
    with_lock(&db, fake.clone(), OnLockFailure::Proceed)
        .repository::<node::Entity>()
        .locked_update(1, score(6))
        .await
        .unwrap();
    let (level, fields) = seen
        .event("proceeding without the lock")
        .expect("a proceeding event");
    assert_eq!(
        (level, fields["tries"].as_str()),
        (tracing::Level::WARN, "2")
    );
    assert_eq!(seen.updates()[1]["lock_held"], "false");

    fake.never_acquire(false).lose_lease(true);
    let report = with_lock(&db, fake, OnLockFailure::Fail)
        .repository::<node::Entity>()
        .locked_update(1, score(7))
        .await
        .unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::LeaseLost));
    assert!(seen.event("lease lost").is_some());
    assert_eq!(seen.updates()[2]["outcome"], "lease_lost");
    assert_eq!(node_in_db(&db, 1).await.score, Some(6));
}

/// A holder that died with its lease: the row is owned, its lease ran out long ago.
async fn dead_holder(db: &TestDatabase, name: &str) {
    db.execute_unprepared(&format!(
        "INSERT INTO freshlock_lock (name, owner, fence, expires_at, host, pid, label, acquired_at) \
         VALUES ('{name}', 'dead-worker', 7, 0, 'elsewhere', 1, NULL, 0)"
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn taking_over_an_expired_lease_is_an_event() {
    let seen = Seen::default();
    let _guard = seen.install();
    let db = test_db().await;
    seed_nodes(&db, 1).await;
    dead_holder(&db, "node:1").await;
    let session = db
        .session_builder()
        .lock(Arc::new(TableLock::new(db.connection().clone())))
        .build()
        .unwrap();
    let report = session
        .repository::<node::Entity>()
        .locked_update(1, score(3))
        .await
        .unwrap();
    assert_eq!(
        report.lock.fence,
        Some(8),
        "the fence grows past the dead holder's"
    );
    let (level, fields) = seen
        .event("stale lock taken over")
        .expect("a takeover event");
    assert_eq!(
        (level, fields["fence"].as_str()),
        (tracing::Level::WARN, "8")
    );

    // A released lease taken again is not a takeover.
    session
        .repository::<node::Entity>()
        .locked_update(1, score(4))
        .await
        .unwrap();
    let takeovers = seen
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, f)| {
            f.get("message")
                .is_some_and(|m| m.starts_with("stale lock"))
        })
        .count();
    assert_eq!(takeovers, 1);
}

#[cfg(feature = "metrics")]
mod metrics_facade {
    use std::collections::BTreeMap;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// What the debugging recorder held, keyed `name{k=v,…}` (labels sorted): counter totals and
    /// histogram sample counts.
    #[derive(Debug, Default)]
    struct Recorded {
        counters: BTreeMap<String, u64>,
        samples: BTreeMap<String, usize>,
        gauges: BTreeMap<String, f64>,
    }

    impl Recorded {
        fn of(recorder: &DebuggingRecorder) -> Self {
            let mut recorded = Self::default();
            for (key, _, _, value) in recorder.snapshotter().snapshot().into_vec() {
                let key = key.key();
                let mut labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                labels.sort();
                let name = if labels.is_empty() {
                    key.name().to_owned()
                } else {
                    format!("{}{{{}}}", key.name(), labels.join(","))
                };
                match value {
                    DebugValue::Counter(n) => *recorded.counters.entry(name).or_default() += n,
                    DebugValue::Histogram(values) => {
                        *recorded.samples.entry(name).or_default() += values.len();
                    }
                    DebugValue::Gauge(value) => {
                        recorded.gauges.insert(name, value.into_inner());
                    }
                }
            }
            recorded
        }

        fn counter(&self, key: &str) -> u64 {
            self.counters.get(key).copied().unwrap_or(0)
        }

        fn gauge(&self, key: &str) -> Option<f64> {
            self.gauges.get(key).copied()
        }

        fn samples(&self, key: &str) -> usize {
            self.samples.get(key).copied().unwrap_or(0)
        }
    }

    #[test]
    fn lock_waits_failures_conflicts_takeovers_and_cache_traffic_are_counted() {
        let recorder = DebuggingRecorder::new();
        // A recorder for this thread only; the runtime below runs everything on it.
        metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(workload())
        });
        let m = &Recorded::of(&recorder);
        let c = |key: &str| m.counter(key);
        assert_eq!(c("freshlock_cache_misses_total"), 1, "{:#?}", m.counters);
        assert_eq!(c("freshlock_cache_hits_total"), 1);
        assert_eq!(c("freshlock_cache_evictions_total"), 1, "the reset");
        assert_eq!(c("freshlock_conflicts_total{entity=node}"), 1);
        assert_eq!(
            c("freshlock_lock_acquire_failures_total{backend=fake,policy=fail,reason=busy}"),
            1
        );
        assert_eq!(
            c("freshlock_lock_acquire_failures_total{backend=fake,policy=proceed,reason=error}"),
            1
        );
        assert_eq!(c("freshlock_leases_lost_total{backend=fake}"), 1);
        assert_eq!(
            c("freshlock_stale_locks_taken_over_total{backend=table}"),
            1
        );
        assert_eq!(
            c("freshlock_locked_updates_total{entity=node,outcome=updated}"),
            4
        );
        assert_eq!(
            c("freshlock_locked_updates_total{entity=node,outcome=lock_not_acquired}"),
            1
        );
        assert_eq!(
            c("freshlock_locked_updates_total{entity=node,outcome=lease_lost}"),
            1
        );
        assert_eq!(
            m.samples("freshlock_lock_wait_seconds{backend=local,held=true}"),
            1
        );
        assert_eq!(
            m.samples("freshlock_lock_wait_seconds{backend=fake,held=true}"),
            2
        );
        assert_eq!(
            m.samples("freshlock_lock_wait_seconds{backend=fake,held=false}"),
            2
        );
        assert_eq!(
            m.samples("freshlock_lock_wait_seconds{backend=table,held=true}"),
            1
        );
    }

    /// A job that completes on its second attempt and one whose payload is not its kind's: two attempts
    /// counted per outcome, the attempt each ended on, their waits and run times.
    #[test]
    fn jobs_are_counted_by_kind_and_outcome() {
        let recorder = DebuggingRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(jobs_workload())
        });
        let m = &Recorded::of(&recorder);
        let c = |key: &str| m.counter(key);
        assert_eq!(
            c("freshlock_jobs_total{kind=twice,outcome=retrying}"),
            1,
            "{:#?}",
            m.counters
        );
        assert_eq!(c("freshlock_jobs_total{kind=twice,outcome=completed}"), 1);
        assert_eq!(c("freshlock_jobs_total{kind=bad,outcome=failed}"), 1);
        assert_eq!(m.samples("freshlock_job_wait_seconds{kind=twice}"), 2);
        assert_eq!(m.samples("freshlock_job_run_seconds{kind=twice}"), 2);
        assert_eq!(m.samples("freshlock_job_attempts{kind=twice}"), 1);
        assert_eq!(m.samples("freshlock_job_attempts{kind=bad}"), 1);
    }

    /// The depth gauge per kind and state: set from the queue, summed over keys, and back to 0
    /// for a kind that left the queue.
    #[test]
    fn the_queue_depth_is_a_gauge_per_kind_and_state() {
        let recorder = DebuggingRecorder::new();
        let (before, after, running) = metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    use freshlock::jobs::{self, Job, Jobs, NewJob, RetryPolicy, Worker};
                    let db = test_db().await;
                    let hour = std::time::Duration::from_secs(3600);
                    let jobs = [
                        NewJob::new("a", &()).unwrap(),
                        NewJob::new("a", &()).unwrap().key("k1"),
                        NewJob::new("a", &()).unwrap().delay(hour),
                        NewJob::new("b", &()).unwrap().key("k2"),
                        NewJob::new("c", &()).unwrap(),
                    ];
                    for job in jobs {
                        jobs::enqueue(db.connection(), job).await.unwrap();
                    }
                    jobs::record_depth(db.connection()).await.unwrap();
                    let before = Recorded::of(&recorder);
                    fn ok(_tx: &freshlock::Tx, _job: Job<()>) -> freshlock::SectionWork<'_, ()> {
                        Box::pin(async { Ok(()) })
                    }
                    let handlers = Jobs::new().handle("a", RetryPolicy::default(), ok).handle(
                        "b",
                        RetryPolicy::default(),
                        ok,
                    );
                    // "c" has no handler here: it waits.
                    let worker = Worker::new(db.session(), handlers);
                    assert_eq!(worker.run_until_idle().await.unwrap().len(), 3);
                    jobs::record_depth(db.connection()).await.unwrap();
                    let after = Recorded::of(&recorder);
                    // A running worker records it by itself (every 10 s, first at its start).
                    let later = NewJob::new("d", &()).unwrap().delay(hour);
                    jobs::enqueue(db.connection(), later).await.unwrap();
                    assert_eq!(worker.run(tokio::task::yield_now()).await.unwrap(), 0);
                    (before, after, Recorded::of(&recorder))
                })
        });
        let g = |m: &Recorded, kind: &str, state: &str| {
            m.gauge(&format!("freshlock_job_depth{{kind={kind},state={state}}}"))
        };
        assert_eq!(
            g(&before, "a", "waiting"),
            Some(3.0),
            "{:#?}",
            before.gauges
        );
        assert_eq!(g(&before, "a", "due"), Some(2.0));
        assert_eq!(g(&before, "b", "waiting"), Some(1.0));
        assert_eq!(g(&before, "c", "waiting"), Some(1.0));
        assert_eq!(g(&before, "a", "no_worker"), Some(3.0), "no worker ran yet");
        assert_eq!(g(&after, "a", "waiting"), Some(1.0), "{:#?}", after.gauges);
        assert_eq!(g(&after, "a", "due"), Some(0.0));
        assert_eq!(g(&after, "b", "waiting"), Some(0.0), "b left the queue");
        assert_eq!(
            g(&after, "c", "waiting"),
            Some(1.0),
            "no worker has c's handler"
        );
        assert_eq!(
            g(&running, "d", "waiting"),
            Some(1.0),
            "{:#?}",
            running.gauges
        );
        // The running worker said it takes a and b: c and d wait for a worker.
        assert_eq!(g(&running, "a", "no_worker"), Some(0.0));
        assert_eq!(g(&running, "c", "no_worker"), Some(1.0));
        assert_eq!(g(&running, "d", "no_worker"), Some(1.0));
    }

    async fn jobs_workload() {
        use freshlock::jobs::{self, Job, Jobs, NewJob, RetryPolicy, Worker};
        let db = test_db().await;
        let zero = std::time::Duration::ZERO;
        let policy = RetryPolicy::default().with_backoff(zero, zero);
        let handlers = Jobs::new()
            .handle(
                "twice",
                policy,
                jobs::handler(|_tx, job: Job<()>| {
                    Box::pin(async move {
                        if job.attempt == 1 {
                            return Err(freshlock::ApplyError::msg("not yet"));
                        }
                        Ok(())
                    })
                }),
            )
            .handle(
                "bad",
                RetryPolicy::default(),
                async |_tx: &freshlock::Tx, _job: Job<i64>| Ok(()),
            );
        for kind in ["twice", "bad"] {
            jobs::enqueue(db.connection(), NewJob::new(kind, &()).unwrap())
                .await
                .unwrap();
        }
        let worker = Worker::new(db.session(), handlers);
        assert_eq!(worker.run_until_idle().await.unwrap().len(), 3);
    }

    async fn workload() {
        freshlock::metrics::describe();
        let db = test_db().await;
        seed_nodes(&db, 2).await;
        let session = db.session();
        let nodes = session.repository::<node::Entity>();
        nodes.load(2).await.unwrap(); // miss
        nodes.load(2).await.unwrap(); // hit
        nodes.reset_cache([2]).unwrap(); // eviction
        nodes.locked_update(2, score(1)).await.unwrap(); // local, updated

        let fake = FakeLock::new();
        fake.interfere("UPDATE node SET score = 100 WHERE id = 1", 1);
        // fake, held, one conflict then updated
        with_lock(&db, fake.clone(), OnLockFailure::Fail)
            .repository::<node::Entity>()
            .locked_update(1, score(5))
            .await
            .unwrap();
        fake.never_acquire(true);
        // fake, busy, refused
        let refused = with_lock(&db, fake.clone(), OnLockFailure::Fail)
            .repository::<node::Entity>()
            .locked_update(1, score(6))
            .await;
        assert!(refused.is_err());
        fake.never_acquire(false).fail_after(0);
        // fake, backend error, proceeded: updated
        with_lock(&db, fake.clone(), OnLockFailure::Proceed)
            .repository::<node::Entity>()
            .locked_update(1, score(7))
            .await
            .unwrap();
        fake.recover().lose_lease(true);
        // fake, held, lease lost
        with_lock(&db, fake, OnLockFailure::Fail)
            .repository::<node::Entity>()
            .locked_update(1, score(8))
            .await
            .unwrap();

        dead_holder(&db, "node:2").await;
        db.session_builder()
            .lock(Arc::new(TableLock::new(db.connection().clone())))
            .build()
            .unwrap()
            .repository::<node::Entity>()
            .locked_update(2, score(9))
            .await
            .unwrap();
    }
}
