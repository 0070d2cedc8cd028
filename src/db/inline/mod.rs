//! Statements with their values written into the SQL text, for messages of several statements:
//! such a message is sent as a simple query (PostgreSQL) or a multi-statement packet
//! (MySQL/MariaDB), which cannot be prepared, so its values cannot be bound. Each dialect writes
//! only values whose text reads back as the bound value would (see `mysql.rs`, `postgres.rs`);
//! for any other value it answers `None`, and the caller sends its statements one by one, bound.
//!
//! The text of dates and times is shared: sqlx binds them with microseconds, so that is what is
//! written.

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;

/// `statement` as text with its values written in, in its database's dialect, or `None` when a
/// value cannot be (or the dialect has no text here).
pub(crate) fn statement_text(statement: &sea_orm::Statement) -> Option<String> {
    let values = (statement.values.as_ref()).map_or(&[][..], |values| &values.0[..]);
    match statement.db_backend {
        #[cfg(feature = "postgres")]
        sea_orm::DbBackend::Postgres => postgres::written(&statement.sql, values),
        #[cfg(feature = "mysql")]
        sea_orm::DbBackend::MySql => mysql::written(&statement.sql, values.to_vec()),
        _ => None,
    }
}

/// `UPDATE t SET c0 = <values[0]>, … WHERE id = 7`: the dialects' tests write values into it.
#[cfg(test)]
fn update(values: Vec<sea_orm::Value>) -> sea_orm::sea_query::UpdateStatement {
    use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
    let mut query = Query::update();
    query.table(Alias::new("t"));
    for (i, value) in values.into_iter().enumerate() {
        query.value(Alias::new(format!("c{i}")), value);
    }
    query
        .and_where(Expr::col(Alias::new("id")).eq(7))
        .to_owned()
}

/// A date's text, `YYYY-MM-DD`, or `None` for a year that is not four digits (negative or past
/// 9999: refused by the server either way, and then refused as a bound value is).
pub(super) fn day(date: &sea_orm::prelude::ChronoDate) -> Option<String> {
    let text = date.format("%Y-%m-%d").to_string();
    (text.len() == 10 && text.starts_with(|c: char| c.is_ascii_digit())).then_some(text)
}

/// A time of day's text as sqlx binds it: `HH:MM:SS`, with `.ffffff` (microseconds, the
/// nanoseconds truncated) only when they are not zero. `None` for a leap second (sqlx sends
/// those as they are, which the server refuses).
pub(super) fn clock(time: &sea_orm::prelude::ChronoTime) -> Option<String> {
    let text = time.format("%H:%M:%S%.6f").to_string();
    if text.get(6..8) == Some("60") {
        return None;
    }
    Some(match text.strip_suffix(".000000") {
        Some(whole) => whole.to_owned(),
        None => text,
    })
}

/// A date and time's text, as [`day`] and [`clock`] write them.
pub(super) fn moment(at: &sea_orm::prelude::ChronoDateTime) -> Option<String> {
    Some(format!("{} {}", day(&at.date())?, clock(&at.time())?))
}
