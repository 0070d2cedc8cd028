//! How a row of any entity is named: its identity-map key, its lock name, its text in errors.

use std::{any::TypeId, fmt, fmt::Write as _};

use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseTransaction, DbBackend, DbErr,
    EntityTrait, Iterable, PrimaryKeyToColumn, QueryFilter, QuerySelect, Select, Statement,
    sea_query::ValueTuple,
};

use crate::{
    error::Error,
    identity_map::Key,
    lock::{LockName, RowLock},
    write::fold::Folded,
};

/// The primary-key value type of entity `E` (`i32` for a single integer key, a tuple for a
/// composite key).
pub type PrimaryKeyOf<E> = <<E as EntityTrait>::PrimaryKey as sea_orm::PrimaryKeyTrait>::ValueType;

/// One row of entity `E`, by primary key.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) key: Key,
    /// The primary key as sea-orm takes it.
    pk: ValueTuple,
    /// `"{schema.}{table}:{key}"`: the row's name in logs and errors.
    pub(crate) name: LockName,
    /// The lock that serializes writers of this row: its own name, or a key it is updated under
    /// (its parent's, for example).
    pub(crate) lock: LockName,
}

impl Row {
    /// Names the row of `E` whose primary key is `pk`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when `pk` does not have one value per primary-key column.
    pub(crate) fn new<E: EntityTrait>(pk: ValueTuple) -> Result<Self, Error> {
        let key = cache_key::<E>(pk.clone())?;
        let entity = E::default();
        let mut name = String::with_capacity(32);
        if let Some(schema) = entity.schema_name() {
            name.push_str(schema);
            name.push('.');
        }
        name.push_str(entity.table_name());
        name.push(':');
        for (i, value) in pk.iter().enumerate() {
            if i > 0 {
                name.push(',');
            }
            // SQL literal text: stable, and it tells 1 from '1'.
            let _ = write!(name, "{value}");
        }
        let name = LockName::trusted(name);
        Ok(Self {
            key,
            pk,
            lock: name.clone(),
            name,
        })
    }

    /// Serializes this row's writers on `lock` instead of the row's own name.
    pub(crate) fn locked_by(mut self, lock: LockName) -> Self {
        self.lock = lock;
        self
    }

    /// The rule every write of a row keeps, checked in this one place: a draft written to the
    /// row still names it. [`Error::PrimaryKeyChanged`] when the caller's closure or a hook
    /// moved (or unset) its primary key: the write would reach another row, or none.
    pub(crate) fn check_key<E: EntityTrait>(&self, draft: &E::ActiveModel) -> Result<(), Error> {
        if draft.get_primary_key_value().as_ref() == Some(self.pk()) {
            return Ok(());
        }
        Err(Error::PrimaryKeyChanged {
            target: self.to_string(),
        })
    }

    pub(crate) fn pk(&self) -> &ValueTuple {
        &self.pk
    }
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.name, f)
    }
}

/// The lock name of the row of `E` whose primary key is `pk`: what `locked_update` of that row
/// locks, and what children updated under it (see
/// [`Repository::locked_update_under`](crate::Repository::locked_update_under)) lock.
///
/// # Errors
/// [`Error::InvalidKey`] when `pk` does not have one value per primary-key column.
pub fn lock_name<E: EntityTrait>(pk: PrimaryKeyOf<E>) -> Result<LockName, Error> {
    use sea_orm::sea_query::IntoValueTuple;
    Row::new::<E>(pk.into_value_tuple()).map(|row| row.name)
}

/// The identity-map key of the row of `E` whose primary key is `pk`: no allocation for keys of
/// fixed-size values, so a cache hit allocates nothing.
///
/// # Errors
/// [`Error::InvalidKey`] when `pk` does not have one value per primary-key column.
pub(crate) fn cache_key<E: EntityTrait>(pk: ValueTuple) -> Result<Key, Error> {
    let columns = E::PrimaryKey::iter().count();
    if pk.arity() != columns {
        return Err(Error::InvalidKey {
            entity: E::default().table_name(),
            reason: format!(
                "{} value(s) given for {columns} primary-key column(s)",
                pk.arity()
            ),
        });
    }
    Ok((TypeId::of::<E>(), pk.into()))
}

/// `SELECT … WHERE pk = …` for `pk` (whose arity [`Row::new`] checked).
pub(crate) fn select_by_key<E: EntityTrait>(pk: &ValueTuple) -> Select<E> {
    E::PrimaryKey::iter()
        .zip(pk.iter())
        .fold(E::find(), |select, (column, value)| {
            select.filter(column.into_column().eq(value.clone()))
        })
}

/// The row, read in `txn` (`FOR UPDATE` where the database has it; SQLite's `BEGIN IMMEDIATE`
/// already excludes other writers). With `folded` (PostgreSQL, MySQL/MariaDB), the same
/// statement first tries that lock — a `pg_advisory_xact_lock` key, a `row` backend's lock row,
/// a lease's fence row, or (PostgreSQL) a lease row it checks and frees — as a one-time filter:
/// no row comes back unless the lock was had (see `Locking::folding`). On MySQL/MariaDB the
/// filter is read as a constant before the row, but the row may be locked already when it fails;
/// the attempt then rolls back at once.
pub(crate) async fn reload_for_update<E: EntityTrait>(
    txn: &DatabaseTransaction,
    pk: &ValueTuple,
    folded: Option<Folded>,
) -> Result<Option<E::Model>, DbErr> {
    let backend = txn.get_database_backend();
    if let Some(Folded::Lease { name, owner, fence }) = folded {
        if backend != DbBackend::Postgres {
            return Err(DbErr::Custom(format!(
                "a lease freed by the reload needs PostgreSQL, not {backend:?}"
            )));
        }
        let lease = crate::lock::lease::lease_values(&name, &owner, fence);
        let statement = freeing_lease(select_by_key::<E>(pk), lease);
        return E::find().from_raw_sql(statement).one(txn).await;
    }
    match reload::<E>(backend, pk, folded.as_ref()) {
        Some(reload) => reload.one(txn).await,
        None => Err(DbErr::Custom("a lease's reload is read on its own".into())),
    }
}

/// The reload of [`reload_for_update`] as a query — with a transaction-scoped lock's try or a
/// lease's fence check as its filter when `folded` says so — or `None` for [`Folded::Lease`],
/// whose reload is a statement of its own ([`freeing_lease`]).
pub(crate) fn reload<E: EntityTrait>(
    backend: DbBackend,
    pk: &ValueTuple,
    folded: Option<&Folded>,
) -> Option<Select<E>> {
    use sea_orm::sea_query::Expr;
    let mut reload = select_by_key::<E>(pk);
    match folded {
        None => {}
        Some(Folded::Advisory(key)) => {
            let try_lock = "(SELECT pg_try_advisory_xact_lock($1))";
            reload = reload.filter(Expr::cust_with_values(try_lock, [*key]));
        }
        Some(Folded::Row(stored)) => {
            let try_lock = RowLock::folded(backend);
            reload = reload.filter(Expr::cust_with_values(try_lock, [stored.clone()]));
        }
        Some(Folded::Fence { name, fence }) => {
            let check = crate::lock::sql::fence_folded(backend);
            let values: [sea_orm::Value; 2] = [name.clone().into(), (*fence).into()];
            reload = reload.filter(Expr::cust_with_values(check, values));
        }
        Some(Folded::Lease { .. }) => return None,
    }
    if backend != DbBackend::Sqlite {
        reload = reload.lock_exclusive();
    }
    Some(reload)
}

/// The reload of [`Folded::Lease`] (PostgreSQL only: MySQL/MariaDB have no data-modifying
/// `WITH`, and `Locking::begin_all` folds no such check there): behind a `WITH` that checks and
/// frees the lease (name, owner token and fence in `lease`), reading the row only when it did.
fn freeing_lease<E: EntityTrait>(reload: Select<E>, lease: [sea_orm::Value; 3]) -> Statement {
    use sea_orm::{QueryTrait, sea_query::Expr};
    let reload = reload
        .filter(Expr::cust("EXISTS (SELECT 1 FROM freed)"))
        .lock_exclusive();
    let built = reload.build(DbBackend::Postgres);
    let mut values = built.values.map(|values| values.0).unwrap_or_default();
    // The reload's own values are `$1` to `$n`; the lease's follow.
    let first = u32::try_from(values.len() + 1).unwrap_or(u32::MAX);
    let with = crate::lock::lease::lease_freed(first);
    values.extend(lease);
    Statement::from_sql_and_values(DbBackend::Postgres, format!("{with}{}", built.sql), values)
}

#[cfg(test)]
mod tests {
    use sea_orm::Value;

    use super::*;

    mod item {
        use sea_orm::entity::prelude::*;

        #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
        #[sea_orm(table_name = "item")]
        pub struct Model {
            #[sea_orm(primary_key, auto_increment = false)]
            pub shop: String,
            #[sea_orm(primary_key, auto_increment = false)]
            pub id: i32,
        }

        #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
        pub enum Relation {}

        impl ActiveModelBehavior for ActiveModel {}
    }

    #[test]
    fn names_are_stable_and_quote_strings() {
        let row =
            Row::new::<item::Entity>(ValueTuple::Two(Value::from("it's"), Value::Int(Some(7))))
                .expect("valid key");
        assert_eq!(row.name.as_str(), r"item:'it\'s',7");
    }

    #[test]
    fn a_freed_lease_is_numbered_after_the_reloads_own_values() {
        let pk = ValueTuple::Two(Value::from("shop"), Value::Int(Some(7)));
        let lease = [
            Value::from("item:x"),
            Value::from("token"),
            Value::BigInt(Some(3)),
        ];
        let statement = freeing_lease(select_by_key::<item::Entity>(&pk), lease.clone());
        let sql = statement.sql.as_str();
        assert!(
            sql.starts_with("WITH freed AS (UPDATE freshlock_lock SET owner = NULL"),
            "{sql}"
        );
        assert!(
            sql.contains("WHERE name = $3 AND owner = $4 AND fence = $5 AND expires_at > "),
            "{sql}"
        );
        assert!(
            sql.contains(r#""shop" = $1"#) && sql.contains(r#""id" = $2"#),
            "{sql}"
        );
        assert!(
            sql.contains("EXISTS (SELECT 1 FROM freed)") && sql.ends_with("FOR UPDATE"),
            "{sql}"
        );
        let values = statement.values.expect("values").0;
        assert_eq!(values[..2], [Value::from("shop"), Value::Int(Some(7))]);
        assert_eq!(values[2..], lease);
    }

    #[test]
    fn wrong_arity_is_a_typed_error() {
        let err = Row::new::<item::Entity>(ValueTuple::One(Value::Int(Some(1))));
        assert!(matches!(err, Err(Error::InvalidKey { entity: "item", .. })));
    }
}
