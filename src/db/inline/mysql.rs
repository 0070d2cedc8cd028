//! Statements with their values written into the SQL text, for MySQL/MariaDB messages of several
//! statements: a message of several statements cannot be prepared, so its values cannot be bound.
//!
//! Only values whose text reads the same under every `sql_mode` are written in (anything else
//! makes [`statement`] answer `None`, and the caller sends its statements one by one, bound):
//! - strings and characters as hexadecimal literals with a character set introducer
//!   (`_utf8mb4 X'…'`): the value's bytes whatever they hold (quotes, backslashes, NUL), read
//!   the same under `NO_BACKSLASH_ESCAPES` and `ANSI_QUOTES`, where an escaped string literal
//!   (sea-query's) would not be; like a bound string, a literal of the connection's character
//!   set that takes the column's collation in a comparison (coercible);
//! - bytes as hexadecimal literals (`X'…'`), integers and booleans as numbers, `NULL`;
//! - floating-point numbers as exponent literals (a double): the shortest digits that read back
//!   as the same double, so an `f64` is stored and compared as bound, and an `f32` is written
//!   as the double it widens to, which is what the server compares a `FLOAT` column with. Not
//!   finite or subnormal values: not written in.
//!
//! - chrono's dates, times and date-times (naive, or UTC as its naive UTC: sqlx binds it so) as
//!   quoted text of digits and separators, with microseconds — the nanoseconds truncated, as
//!   sqlx binds them — only when they are not zero; a server converts that text to the column's
//!   type, and compares a temporal column with it as a date, as it does a bound value. Not years
//!   outside 0–9999, nor leap seconds.
//!
//! Decimals, JSON, UUIDs, enums, date-times with an offset and the `time` and `jiff` crates'
//! types are not written in: how a bound value of those types is converted is the driver's,
//! and a literal could compare differently in a guard.

use std::fmt::Write as _;

use super::{clock, day, moment};

use sea_orm::{
    Value,
    sea_query::{MysqlQueryBuilder, QueryStatementWriter},
};

/// `statement` as MySQL/MariaDB text with every value written in (see the module's doc), or
/// `None` when a value is not one that can be, or the text holds a quoted literal of its own
/// (only backquoted identifiers and `?` placeholders are expected from sea-query).
pub(crate) fn statement(statement: &impl QueryStatementWriter) -> Option<String> {
    let (sql, values) = statement.build(MysqlQueryBuilder);
    written(&sql, values)
}

/// MySQL/MariaDB text `sql`, written with `?` placeholders, with `values` written in as
/// [`statement`] writes a statement's, or `None` as it answers.
pub(crate) fn written(sql: &str, values: impl IntoIterator<Item = Value>) -> Option<String> {
    let mut values = values.into_iter();
    let mut text = String::with_capacity(sql.len() + 32);
    let mut identifier = false;
    for c in sql.chars() {
        match c {
            // A backquote doubled inside an identifier closes and reopens it: the same state.
            '`' => identifier = !identifier,
            '\'' | '"' if !identifier => return None,
            '?' if !identifier => {
                text.push_str(&literal(&values.next()?)?);
                continue;
            }
            _ => {}
        }
        text.push(c);
    }
    // Every value written in, and no quote left open.
    (values.next().is_none() && !identifier).then_some(text)
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
        Value::Bool(Some(b)) => u8::from(*b).to_string(),
        Value::TinyInt(Some(n)) => n.to_string(),
        Value::SmallInt(Some(n)) => n.to_string(),
        Value::Int(Some(n)) => n.to_string(),
        Value::BigInt(Some(n)) => n.to_string(),
        Value::TinyUnsigned(Some(n)) => n.to_string(),
        Value::SmallUnsigned(Some(n)) => n.to_string(),
        Value::Unsigned(Some(n)) => n.to_string(),
        Value::BigUnsigned(Some(n)) => n.to_string(),
        Value::Float(Some(x)) => double(f64::from(*x))?,
        Value::Double(Some(x)) => double(*x)?,
        Value::String(Some(s)) => format!("_utf8mb4 {}", hex(s.as_bytes())),
        Value::Char(Some(c)) => format!("_utf8mb4 {}", hex(c.to_string().as_bytes())),
        Value::Bytes(Some(bytes)) => hex(bytes),
        Value::ChronoDate(Some(date)) => quoted(day(date)?),
        Value::ChronoTime(Some(time)) => quoted(clock(time)?),
        Value::ChronoDateTime(Some(at)) => quoted(moment(at)?),
        Value::ChronoDateTimeUtc(Some(at)) => quoted(moment(&at.naive_utc())?),
        _ => return None,
    };
    Some(text)
}

/// A double as an exponent literal (MySQL reads a number with an exponent as a double; without,
/// as an exact decimal): the shortest digits that read back as `x`. Zero and normal values only.
fn double(x: f64) -> Option<String> {
    (x == 0.0 || x.is_normal()).then(|| format!("{x:e}"))
}

/// A quoted literal of `text`, which holds only digits, `-`, `:`, `.` and spaces: no character
/// any `sql_mode` reads otherwise.
fn quoted(text: String) -> String {
    debug_assert!(
        text.chars()
            .all(|c| c.is_ascii_digit() || "-:. ".contains(c))
    );
    format!("'{text}'")
}

/// A hexadecimal literal of `bytes` (`X''` when empty).
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len() * 2 + 3);
    text.push_str("X'");
    for byte in bytes {
        // Writing to a String cannot fail.
        let _ = write!(text, "{byte:02X}");
    }
    text.push('\'');
    text
}

#[cfg(test)]
mod tests {
    use sea_orm::sea_query::{Alias, Expr, Query};

    use super::super::update;
    use super::*;

    #[test]
    fn values_are_written_in_as_literals_that_no_sql_mode_reads_otherwise() {
        let text = statement(&update(vec![
            Value::String(Some("O'Brien \\ \" ? `\0".to_owned())),
            Value::Char(Some('✓')),
            Value::Bytes(Some(vec![0, 0xff])),
            Value::Bytes(Some(Vec::new())),
            Value::Bool(Some(true)),
            Value::BigInt(Some(i64::MIN)),
            Value::BigUnsigned(Some(u64::MAX)),
            Value::Double(Some(0.1)),
            Value::Float(Some(0.1)),
            Value::Double(Some(-0.0)),
            Value::Int(None),
            Value::String(None),
        ]))
        .expect("written in");
        assert_eq!(
            text,
            "UPDATE `t` SET `c0` = _utf8mb4 X'4F27427269656E205C2022203F206000', \
             `c1` = _utf8mb4 X'E29C93', `c2` = X'00FF', `c3` = X'', `c4` = 1, \
             `c5` = -9223372036854775808, `c6` = 18446744073709551615, `c7` = 1e-1, \
             `c8` = 1.0000000149011612e-1, `c9` = -0e0, `c10` = NULL, `c11` = NULL \
             WHERE `id` = 7"
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
            Value::ChronoDateTime(Some(at(0))),
            Value::ChronoDateTimeUtc(Some(at(1_000).and_utc())),
        ]))
        .expect("written in");
        assert_eq!(
            text,
            "UPDATE `t` SET `c0` = '2026-12-03', `c1` = '23:59:01.000005', \
             `c2` = '2026-12-03 07:05:09.123456', `c3` = '2026-12-03 07:05:09', \
             `c4` = '2026-12-03 07:05:09.000001' WHERE `id` = 7"
        );
        let leap = ChronoTime::from_hms_nano_opt(23, 59, 59, 1_500_000_000);
        let far = ChronoDate::from_ymd_opt(12_026, 1, 1);
        for value in [Value::ChronoTime(leap), Value::ChronoDate(far)] {
            assert_eq!(statement(&update(vec![value.clone()])), None, "{value:?}");
        }
    }

    #[test]
    fn a_value_that_is_not_written_in_leaves_the_statement_bound() {
        for value in [
            Value::Double(Some(f64::NAN)),
            Value::Double(Some(f64::INFINITY)),
            Value::Double(Some(f64::MIN_POSITIVE / 2.0)),
            Value::Json(Some(Box::new(serde_json::json!({"a": 1})))),
        ] {
            assert_eq!(statement(&update(vec![value.clone()])), None, "{value:?}");
        }
    }

    #[test]
    fn a_question_mark_in_an_identifier_is_not_a_placeholder() {
        let query = Query::update()
            .table(Alias::new("t?`x"))
            .value(Alias::new("c?"), 5)
            .to_owned();
        assert_eq!(
            statement(&query).as_deref(),
            Some("UPDATE `t?``x` SET `c?` = 5")
        );
    }

    #[test]
    fn a_quoted_literal_of_the_statement_leaves_it_bound() {
        let query = Query::update()
            .table(Alias::new("t"))
            .value(Alias::new("c"), Expr::cust("'text'"))
            .to_owned();
        assert_eq!(statement(&query), None);
    }
}
