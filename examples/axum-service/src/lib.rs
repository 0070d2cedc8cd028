//! A web service on freshlock (the library behind `axum_service`).
//!
//! - A [`Session`] per request: each request starts with an empty identity map, so nothing
//!   cached by one request can leak into another's write (Drupal's static cache, per request).
//! - `PUT /nodes/{id}/{field}` sets one field with [`Repository::locked_update`]: the heavy work
//!   (`?work_ms=`, simulated) runs before, outside the lock; the row is reloaded under the lock and
//!   only that column is written, so concurrent requests setting *other* fields of the same row
//!   never erase each other.
//! - A request timeout ([`TimeoutLayer`]) answers 408. A timed-out `locked_update` is cancelled
//!   cleanly: its transaction either commits (if it got that far) or rolls back, and its lock is
//!   released either way — a 408 means "may or may not have been written", never "half written".
//! - [`check`] is the load script: concurrent requests updating different fields of the same rows,
//!   then a read-back that every acknowledged write is there.
//!
//! [`Repository::locked_update`]: freshlock::Repository::locked_update

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Path, Query, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, put},
};
use entity::node;
use freshlock::{Db, Error, LockBackend, LockPolicy, Session, UpdateOutcome};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use sea_orm::Set;
use serde::Deserialize;
use serde_json::json;
use tower_http::timeout::TimeoutLayer;

/// What every request shares: the database handle, the lock backend and the policy (not the
/// cache).
#[derive(Clone)]
pub struct AppState {
    /// The database: made once at start-up, as the pool is, so that every request's session
    /// shares what freshlock keeps of the pool.
    pub db: Db,
    /// The lock backend all requests' sessions use (in-process here; a table, PostgreSQL or
    /// Redis lock when several service instances write the same rows).
    pub lock: Arc<dyn LockBackend>,
    /// How long to wait for a row's lock, and what to do without it.
    pub policy: LockPolicy,
}

impl AppState {
    /// This request's session: a fresh identity map on the shared database and lock.
    fn session(&self) -> Result<Session, Error> {
        Session::builder(&self.db)
            .lock(Arc::clone(&self.lock))
            .policy(self.policy.clone())
            .build()
    }
}

/// The service: routes, state and a request timeout answering 408.
pub fn app(state: AppState, timeout: Duration) -> Router {
    Router::new()
        .route("/nodes/{id}", get(show))
        .route("/nodes/{id}/{field}", put(set_field))
        .route("/naive/nodes/{id}/{field}", put(set_field_naively))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .with_state(state)
}

fn view(n: &node::Model) -> serde_json::Value {
    json!({
        "id": n.id, "title": n.title, "thumbnail": n.thumbnail, "summary": n.summary,
        "score": n.score, "analysis": n.analysis,
    })
}

fn failure(status: StatusCode, message: impl ToString) -> Response {
    (status, Json(json!({ "error": message.to_string() }))).into_response()
}

/// freshlock's errors as HTTP answers.
fn error_response(error: Error) -> Response {
    let status = match &error {
        Error::LockNotAcquired { .. } => StatusCode::SERVICE_UNAVAILABLE,
        Error::Conflict { .. } => StatusCode::CONFLICT,
        Error::Apply { .. } | Error::InvalidKey { .. } => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::error!(%error, "request failed");
    }
    failure(status, error)
}

async fn show(State(state): State<AppState>, Path(id): Path<i32>) -> Response {
    let session = match state.session() {
        Ok(session) => session,
        Err(error) => return error_response(error),
    };
    match session.repository::<node::Entity>().load(id).await {
        Ok(Some(n)) => Json(view(&n)).into_response(),
        Ok(None) => failure(StatusCode::NOT_FOUND, format!("node {id} not found")),
        Err(error) => error_response(error),
    }
}

/// Query parameters of `PUT /nodes/{id}/{field}`.
#[derive(Deserialize)]
struct Work {
    /// Simulated heavy work before the write, outside the lock (the seed's 15–60 s, scaled).
    #[serde(default)]
    work_ms: u64,
}

async fn set_field(
    State(state): State<AppState>,
    Path((id, field)): Path<(i32, String)>,
    Query(work): Query<Work>,
    value: String,
) -> Response {
    // Validate before any work or lock.
    let score = if field == "score" {
        match value.trim().parse::<i32>() {
            Ok(score) => Some(score),
            Err(e) => return failure(StatusCode::BAD_REQUEST, format!("score: {e}")),
        }
    } else if matches!(field.as_str(), "thumbnail" | "summary" | "analysis") {
        None
    } else {
        return failure(StatusCode::NOT_FOUND, format!("no field {field:?}"));
    };
    tokio::time::sleep(Duration::from_millis(work.work_ms)).await;

    let session = match state.session() {
        Ok(session) => session,
        Err(error) => return error_response(error),
    };
    let nodes = session.repository::<node::Entity>();
    let written = nodes
        .locked_update(id, |n| {
            match field.as_str() {
                "thumbnail" => n.thumbnail = Set(Some(value.clone())),
                "summary" => n.summary = Set(Some(value.clone())),
                "analysis" => n.analysis = Set(Some(value.clone())),
                _ => n.score = Set(score),
            }
            Ok(())
        })
        .await;
    match written {
        Ok(report) => {
            let lock = json!({
                "held": report.lock.held, "tries": report.lock.tries,
                "waited_ms": report.lock.waited.as_secs_f64() * 1e3,
            });
            match report.outcome {
                UpdateOutcome::Updated(n) | UpdateOutcome::Unchanged(n) => Json(json!({
                    "node": view(&n), "attempts": report.attempts, "lock": lock,
                }))
                .into_response(),
                UpdateOutcome::NotFound => {
                    failure(StatusCode::NOT_FOUND, format!("node {id} not found"))
                }
                // Not written: the lease expired and another worker took over. Retryable.
                UpdateOutcome::LeaseLost => {
                    failure(StatusCode::CONFLICT, "lock lease lost; nothing written")
                }
                _ => failure(StatusCode::INTERNAL_SERVER_ERROR, "unknown outcome"),
            }
        }
        Err(error) => error_response(error),
    }
}

/// The seed's bug, for comparison (do not copy): load the row, do the work, set the field and
/// save the *whole* row. Concurrent requests for other fields of the same row erase each other.
async fn set_field_naively(
    State(state): State<AppState>,
    Path((id, field)): Path<(i32, String)>,
    Query(work): Query<Work>,
    value: String,
) -> Response {
    use sea_orm::{ActiveModelTrait, EntityTrait, IntoActiveModel};
    let loaded = match node::Entity::find_by_id(id)
        .one(state.db.connection())
        .await
    {
        Ok(Some(n)) => n,
        Ok(None) => return failure(StatusCode::NOT_FOUND, format!("node {id} not found")),
        Err(error) => return failure(StatusCode::INTERNAL_SERVER_ERROR, error),
    };
    tokio::time::sleep(Duration::from_millis(work.work_ms)).await;
    let mut row = loaded.clone();
    match field.as_str() {
        "thumbnail" => row.thumbnail = Some(value),
        "summary" => row.summary = Some(value),
        "analysis" => row.analysis = Some(value),
        "score" => row.score = value.trim().parse().ok(),
        _ => return failure(StatusCode::NOT_FOUND, format!("no field {field:?}")),
    }
    // Every column written, as `save()` in the field report.
    let all = row.into_active_model().reset_all();
    match all.update(state.db.connection()).await {
        Ok(n) => Json(json!({ "node": view(&n) })).into_response(),
        Err(error) => failure(StatusCode::INTERNAL_SERVER_ERROR, error),
    }
}

/// One HTTP/1.1 request through hyper-util's client: the status and the body. A new client
/// (and connection pool) per call, so no connection outlives the runtime that made it.
///
/// # Errors
/// Connection and protocol errors (the service is not reachable, the answer is not HTTP), as
/// I/O errors.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let call = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header(hyper::header::CONTENT_TYPE, "text/plain")
        .body(Full::from(body.to_owned()))
        .map_err(std::io::Error::other)?;
    let answer = client.request(call).await.map_err(std::io::Error::other)?;
    let status = answer.status().as_u16();
    let bytes = answer
        .into_body()
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

/// The four fields, one writer each (the seed's four queue workers).
pub const FIELDS: [&str; 4] = ["thumbnail", "summary", "score", "analysis"];

/// What a [`check`] run saw.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Requests sent.
    pub sent: usize,
    /// Answered 200: acknowledged, so they must be in the database.
    pub ok: usize,
    /// Answered 408: cancelled by the timeout; written or not, never half-written.
    pub timed_out: usize,
    /// Any other answer (status, path): a failure of the check.
    pub unexpected: Vec<(u16, String)>,
    /// Acknowledged writes missing from the row read back afterwards: lost updates.
    pub lost: Vec<String>,
    /// Fields holding a value no request sent (half-applied or corrupted writes).
    pub corrupt: Vec<String>,
}

impl CheckReport {
    /// No lost, corrupt or unexpected answers.
    pub fn passed(&self) -> bool {
        self.lost.is_empty() && self.corrupt.is_empty() && self.unexpected.is_empty()
    }
}

/// The load script: for each of `nodes` rows (ids 1..=nodes), four concurrent requests, one per
/// field, each with `0..=max_work_ms` of simulated work (spread deterministically by `round`),
/// writing a value unique to (round, node, field); then reads every row back. `prefix` is `""`
/// for the service's handler, `"/naive"` for the lossy one.
///
/// # Errors
/// Connection errors (the service is not reachable).
pub async fn check(
    addr: SocketAddr,
    prefix: &str,
    nodes: i32,
    round: u32,
    max_work_ms: u64,
) -> std::io::Result<CheckReport> {
    // The value a request sends: unique to (round, node, field); scores are numbers.
    let value = move |id: i32, field: &str| {
        if field == "score" {
            (i64::from(round) * 1_000_000 + i64::from(id) * 10 + 7).to_string()
        } else {
            format!("r{round}-n{id}-{field}")
        }
    };
    let mut calls = tokio::task::JoinSet::new();
    for id in 1..=nodes {
        for (f, field) in FIELDS.into_iter().enumerate() {
            let body = value(id, field);
            let work = (u64::from(round) * 7 + id as u64 * 13 + f as u64 * 29) % (max_work_ms + 1);
            let path = format!("{prefix}/nodes/{id}/{field}?work_ms={work}");
            calls.spawn(async move {
                let answer = request(addr, "PUT", &path, &body).await;
                (id, field, body, path, answer)
            });
        }
    }
    let mut report = CheckReport::default();
    let mut acknowledged = Vec::new();
    while let Some(joined) = calls.join_next().await {
        let (id, field, body, path, answer) = joined.map_err(std::io::Error::other)?;
        report.sent += 1;
        match answer?.0 {
            200 => {
                report.ok += 1;
                acknowledged.push((id, field, body));
            }
            408 => report.timed_out += 1,
            status => report.unexpected.push((status, path)),
        }
    }
    for id in 1..=nodes {
        // A read cut by the timeout (the pool busy finishing cancelled sections) is retried.
        let mut read = request(addr, "GET", &format!("/nodes/{id}"), "").await?;
        for _ in 0..100 {
            if read.0 != 408 {
                break;
            }
            read = request(addr, "GET", &format!("/nodes/{id}"), "").await?;
        }
        let (status, body) = read;
        if status != 200 {
            report.unexpected.push((status, format!("/nodes/{id}")));
            continue;
        }
        let row: serde_json::Value = serde_json::from_str(&body).map_err(std::io::Error::other)?;
        for field in FIELDS {
            let held = match &row[field] {
                serde_json::Value::Null => None,
                serde_json::Value::String(s) => Some(s.clone()),
                other => Some(other.to_string()),
            };
            let sent = value(id, field);
            let ours = held.as_deref() == Some(sent.as_str());
            if acknowledged
                .iter()
                .any(|(i, f, b)| *i == id && *f == field && *b == sent)
                && !ours
            {
                report
                    .lost
                    .push(format!("node {id} {field}: sent {sent}, row has {held:?}"));
            }
            // A field holds this round's value, an earlier round's, or nothing: anything else
            // would be a corrupted write.
            if let Some(held) = held
                && !ours
                && !held.starts_with('r')
                && held.parse::<i64>().is_err()
            {
                report.corrupt.push(format!("node {id} {field}: {held}"));
            }
        }
    }
    Ok(report)
}
