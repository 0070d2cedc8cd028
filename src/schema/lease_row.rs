//! The columns of a lease row, written once for the two tables that hold one (see
//! `lock/lease_row.rs` and `lock/lease.rs`): `freshlock_lock` and `freshlock_claim`.

use sea_orm_migration::{
    prelude::{Alias, Table},
    schema::{big_integer, big_integer_null, string_len, string_len_null},
    sea_query::TableCreateStatement,
};

use super::MAX_STORED_NAME;

/// `table` of lease rows: its key `name`, then `state` (claims: `processing` / `done`) where
/// `state` says, the holder's columns — owner token, fence, expiry (ms, database clock), host,
/// pid, label — and the time of the grant in `granted_at`. The caller may add columns after.
pub(super) fn lease_table(
    table: &'static str,
    state: bool,
    granted_at: &'static str,
) -> TableCreateStatement {
    let mut create = Table::create();
    create
        .table(Alias::new(table))
        .if_not_exists()
        .col(string_len(Alias::new("name"), MAX_STORED_NAME as u32).primary_key());
    if state {
        create.col(string_len(Alias::new("state"), 16));
    }
    create
        .col(string_len_null(Alias::new("owner"), 64))
        .col(big_integer(Alias::new("fence")).default(0))
        .col(big_integer(Alias::new("expires_at")).default(0))
        .col(string_len_null(Alias::new("host"), 255))
        .col(big_integer_null(Alias::new("pid")))
        .col(string_len_null(Alias::new("label"), 255))
        .col(big_integer_null(Alias::new(granted_at)));
    create
}

#[cfg(test)]
mod tests {
    use sea_orm_migration::sea_query::PostgresQueryBuilder;

    /// The tables are created as they were when each was written by hand: users' databases
    /// hold these columns, and a migration that ran once never runs again.
    #[test]
    fn lease_tables_are_created_with_the_columns_they_always_had() {
        let claim = super::super::claim::claim_table().to_string(PostgresQueryBuilder);
        assert_eq!(
            claim,
            r#"CREATE TABLE IF NOT EXISTS "freshlock_claim" ( "name" varchar(255) NOT NULL PRIMARY KEY, "state" varchar(16) NOT NULL, "owner" varchar(64) NULL, "fence" bigint NOT NULL DEFAULT 0, "expires_at" bigint NOT NULL DEFAULT 0, "host" varchar(255) NULL, "pid" bigint NULL, "label" varchar(255) NULL, "claimed_at" bigint NULL, "finished_at" bigint NULL )"#
        );
        let lock = super::super::locks::lock_table().to_string(PostgresQueryBuilder);
        assert_eq!(
            lock,
            r#"CREATE TABLE IF NOT EXISTS "freshlock_lock" ( "name" varchar(255) NOT NULL PRIMARY KEY, "owner" varchar(64) NULL, "fence" bigint NOT NULL DEFAULT 0, "expires_at" bigint NOT NULL DEFAULT 0, "host" varchar(255) NULL, "pid" bigint NULL, "label" varchar(255) NULL, "acquired_at" bigint NULL )"#
        );
    }
}
