//! PostgreSQL statements with their values written in, for the simple-query messages of a
//! write in two flights (`db/pinned.rs`): a simple query may hold several statements, and
//! takes no parameters.
//!
//! Each value is written as a literal of the type sqlx binds it as, so that it is converted,
//! assigned and compared as the bound value would be, whatever the session's settings:
//! - strings and characters as escape-string constants cast to `text` (`E'…'::text`): every
//!   backslash and quote escaped, read the same whether `standard_conforming_strings` is on or
//!   off (an `E''` string always reads its escapes). A string holding NUL is not written in
//!   (PostgreSQL's text cannot hold it: refused bound, too);
//! - bytes as hexadecimal `bytea` input in an escape string (`E'\\x…'::bytea`);
//! - booleans as `TRUE` / `FALSE`; integers as numbers, negative ones in parentheses (so that no
//!   `-` before them makes a comment); an unsigned value past `i64::MAX` is not written in;
//! - floating-point numbers as their shortest round-trip digits, cast to the type sqlx binds
//!   (`'1e-1'::float8`, `'1e-1'::float4`): read back as the same value. Not finite or subnormal
//!   values: not written in;
//! - chrono's dates, times and date-times (naive, or UTC) as quoted text of digits and
//!   separators cast to `date`, `time`, `timestamp` or `timestamptz` (with `+00`), with
//!   microseconds as sqlx binds them (see `mod.rs`). Not years outside 0–9999, nor leap seconds;
//! - `NULL`.
//!
//! Anything else — JSON, UUIDs, decimals, one-byte integers (sqlx binds `i8` as PostgreSQL's
//! one-byte `"char"`), date-times with an offset, the `time` and `jiff` crates' types — is not
//! written in: [`written`] answers `None`, and the caller sends the statement bound.

use std::fmt::Write as _;

use sea_orm::Value;
#[cfg(test)]
use sea_orm::sea_query::{PostgresQueryBuilder, QueryStatementWriter};

use super::{clock, day, moment};

/// `statement` as PostgreSQL text with every value written in (see the module's doc), or `None`
/// when a value is not one that can be, or the text holds a quoted literal or a `$` of its own.
#[cfg(test)]
pub(crate) fn statement(statement: &impl QueryStatementWriter) -> Option<String> {
    let (sql, values) = statement.build(PostgresQueryBuilder);
    written(&sql, &values.0)
}

/// PostgreSQL text `sql`, written with `$1` … `$n` placeholders, with `values` (the `n` values
/// in order) written in as the module's doc says, or `None` when one cannot be.
pub(crate) fn written(sql: &str, values: &[Value]) -> Option<String> {
    let mut text = String::with_capacity(sql.len() + 16 * values.len());
    let mut used = vec![false; values.len()];
    let mut identifier = false;
    let mut chars = sql.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            // A double quote doubled inside an identifier closes and reopens it: the same state.
            '"' => identifier = !identifier,
            '\'' if !identifier => return None,
            '$' if !identifier => {
                let digits = &sql[at + 1..];
                let len = digits
                    .find(|d: char| !d.is_ascii_digit())
                    .unwrap_or(digits.len());
                // A dollar-quoted string, or a `$` that is not a placeholder: not expected.
                let index = digits[..len].parse::<usize>().ok()?.checked_sub(1)?;
                text.push_str(&literal(values.get(index)?)?);
                *used.get_mut(index)? = true;
                for _ in 0..len {
                    chars.next();
                }
                continue;
            }
            _ => {}
        }
        text.push(c);
    }
    // Every value written in, and no quote left open.
    (used.iter().all(|used| *used) && !identifier).then_some(text)
}

/// Whether `value` is one written in (see the module's doc).
pub(crate) fn writes(value: &Value) -> bool {
    literal(value).is_some()
}

/// The text of one value, or `None` when it is not one written in (see the module's doc).
fn literal(value: &Value) -> Option<String> {
    if *value == value.as_null() {
        return Some("NULL".to_owned());
    }
    let text = match value {
        Value::Bool(Some(b)) => (if *b { "TRUE" } else { "FALSE" }).to_owned(),
        Value::SmallInt(Some(n)) => integer(i64::from(*n)),
        Value::Int(Some(n)) => integer(i64::from(*n)),
        Value::BigInt(Some(n)) => integer(*n),
        Value::TinyUnsigned(Some(n)) => integer(i64::from(*n)),
        Value::SmallUnsigned(Some(n)) => integer(i64::from(*n)),
        Value::Unsigned(Some(n)) => integer(i64::from(*n)),
        Value::BigUnsigned(Some(n)) => integer(i64::try_from(*n).ok()?),
        Value::Float(Some(x)) => format!("'{}'::float4", float(*x, x.is_normal())?),
        Value::Double(Some(x)) => format!("'{}'::float8", float(*x, x.is_normal())?),
        Value::String(Some(s)) => format!("{}::text", escaped(s)?),
        Value::Char(Some(c)) => format!("{}::text", escaped(&c.to_string())?),
        Value::Bytes(Some(bytes)) => bytea(bytes),
        Value::ChronoDate(Some(date)) => format!("'{}'::date", day(date)?),
        Value::ChronoTime(Some(time)) => format!("'{}'::time", clock(time)?),
        Value::ChronoDateTime(Some(at)) => format!("'{}'::timestamp", moment(at)?),
        Value::ChronoDateTimeUtc(Some(at)) => {
            format!("'{}+00'::timestamptz", moment(&at.naive_utc())?)
        }
        _ => return None,
    };
    Some(text)
}

/// The type sqlx binds `value` as (of its variant, `NULL` included), as a `PREPARE` names it:
/// `None` for one not written in (see the module's doc).
pub(crate) fn type_name(value: &Value) -> Option<&'static str> {
    Some(match value {
        Value::Bool(_) => "bool",
        Value::SmallInt(_) | Value::TinyUnsigned(_) => "int2",
        Value::Int(_) | Value::SmallUnsigned(_) => "int4",
        Value::BigInt(_) | Value::Unsigned(_) | Value::BigUnsigned(_) => "int8",
        Value::Float(_) => "float4",
        Value::Double(_) => "float8",
        Value::String(_) | Value::Char(_) => "text",
        Value::Bytes(_) => "bytea",
        Value::ChronoDate(_) => "date",
        Value::ChronoTime(_) => "time",
        Value::ChronoDateTime(_) => "timestamp",
        Value::ChronoDateTimeUtc(_) => "timestamptz",
        _ => return None,
    })
}

/// An integer, in parentheses when negative.
fn integer(n: i64) -> String {
    if n < 0 {
        format!("({n})")
    } else {
        n.to_string()
    }
}

/// A float's shortest round-trip digits with an exponent (`1e-1`, `-0e0`); `None` unless zero
/// or `normal`.
fn float<F: std::fmt::LowerExp + PartialEq + Default>(x: F, normal: bool) -> Option<String> {
    (x == F::default() || normal).then(|| format!("{x:e}"))
}

/// An escape-string constant of `s` (`E'…'`), or `None` when it holds NUL.
fn escaped(s: &str) -> Option<String> {
    if s.contains('\0') {
        return None;
    }
    let mut text = String::with_capacity(s.len() + 4);
    text.push_str("E'");
    for c in s.chars() {
        match c {
            '\\' => text.push_str("\\\\"),
            '\'' => text.push_str("''"),
            c => text.push(c),
        }
    }
    text.push('\'');
    Some(text)
}

/// `bytes` as `bytea`'s hexadecimal input in an escape string.
fn bytea(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len() * 2 + 16);
    text.push_str("E'\\\\x");
    for byte in bytes {
        // Writing to a String cannot fail.
        let _ = write!(text, "{byte:02x}");
    }
    text.push_str("'::bytea");
    text
}

#[cfg(test)]
mod tests {
    use sea_orm::sea_query::{Alias, Expr, Query};

    use super::super::update;
    use super::*;

    #[test]
    fn values_are_written_in_as_the_types_sqlx_binds() {
        let text = statement(&update(vec![
            Value::String(Some("O'Brien \\ \" $1 ? `".to_owned())),
            Value::Char(Some('✓')),
            Value::Bytes(Some(vec![0, 0xff])),
            Value::Bytes(Some(Vec::new())),
            Value::Bool(Some(true)),
            Value::BigInt(Some(i64::MIN)),
            Value::BigUnsigned(Some(7)),
            Value::Double(Some(0.1)),
            Value::Float(Some(0.1)),
            Value::Double(Some(-0.0)),
            Value::Int(None),
            Value::String(None),
        ]))
        .expect("written in");
        assert_eq!(
            text,
            "UPDATE \"t\" SET \"c0\" = E'O''Brien \\\\ \" $1 ? `'::text, \"c1\" = E'✓'::text, \
             \"c2\" = E'\\\\x00ff'::bytea, \"c3\" = E'\\\\x'::bytea, \"c4\" = TRUE, \
             \"c5\" = (-9223372036854775808), \"c6\" = 7, \"c7\" = '1e-1'::float8, \
             \"c8\" = '1e-1'::float4, \"c9\" = '-0e0'::float8, \"c10\" = NULL, \"c11\" = NULL \
             WHERE \"id\" = 7"
        );
    }

    #[test]
    fn dates_and_times_are_written_as_sqlx_binds_them() {
        use sea_orm::prelude::{ChronoDate, ChronoDateTime, ChronoTime};

        let day = ChronoDate::from_ymd_opt(2026, 12, 3).expect("a day");
        let at = |nanos| {
            ChronoDateTime::new(
                day,
                ChronoTime::from_hms_nano_opt(7, 5, 9, nanos).expect("t"),
            )
        };
        let text = statement(&update(vec![
            Value::ChronoDate(Some(day)),
            Value::ChronoTime(ChronoTime::from_hms_micro_opt(23, 59, 1, 5)),
            Value::ChronoDateTime(Some(at(123_456_789))),
            Value::ChronoDateTimeUtc(Some(at(1_000).and_utc())),
        ]))
        .expect("written in");
        assert_eq!(
            text,
            "UPDATE \"t\" SET \"c0\" = '2026-12-03'::date, \"c1\" = '23:59:01.000005'::time, \
             \"c2\" = '2026-12-03 07:05:09.123456'::timestamp, \
             \"c3\" = '2026-12-03 07:05:09.000001+00'::timestamptz WHERE \"id\" = 7"
        );
    }

    #[test]
    fn a_value_that_is_not_written_in_leaves_the_statement_bound() {
        for value in [
            Value::Double(Some(f64::NAN)),
            Value::Double(Some(f64::INFINITY)),
            Value::Double(Some(f64::MIN_POSITIVE / 2.0)),
            Value::String(Some("a\0b".to_owned())),
            Value::TinyInt(Some(1)),
            Value::BigUnsigned(Some(u64::MAX)),
            Value::Json(Some(Box::new(serde_json::json!({"a": 1})))),
        ] {
            assert_eq!(statement(&update(vec![value.clone()])), None, "{value:?}");
        }
    }

    #[test]
    fn a_dollar_in_an_identifier_is_not_a_placeholder() {
        let query = Query::update()
            .table(Alias::new("t$1\"x"))
            .value(Alias::new("c$2"), 5)
            .to_owned();
        assert_eq!(
            statement(&query).as_deref(),
            Some("UPDATE \"t$1\"\"x\" SET \"c$2\" = 5")
        );
    }

    #[test]
    fn a_quoted_literal_or_a_stray_dollar_leaves_it_bound() {
        for text in ["'text'", "$$x$$", "$0"] {
            let query = Query::update()
                .table(Alias::new("t"))
                .value(Alias::new("c"), Expr::cust(text))
                .to_owned();
            assert_eq!(statement(&query), None, "{text}");
        }
        // A value without its placeholder.
        assert_eq!(written("SELECT 1", &[Value::Int(Some(1))]), None);
    }
}
