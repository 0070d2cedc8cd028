//! The locked-write engine and its steps: the one attempt loop every locked write runs on
//! (`engine.rs`), the lock it takes (`locking.rs`), the row step (`row_step.rs`) and the rows'
//! step (`rows_step.rs`) with the one row write they share (`row_write.rs`) and the SQL under it
//! (`row_sql/`, `save.rs`), commit combining around the row step (`combine.rs`), sections
//! (`section.rs`), `locked_update` in two round trips (`flights/`), and the words they share
//! (`decision.rs`, `row.rs`).

pub(crate) mod combine;
pub(crate) mod decision;
pub(crate) mod engine;
pub(crate) mod entity;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod flights;
pub(crate) mod fold;
pub(crate) mod locked_update;
pub(crate) mod locking;
pub(crate) mod room;
pub(crate) mod row;
pub(crate) mod row_sql;
pub(crate) mod row_step;
pub(crate) mod row_write;
pub(crate) mod rows_step;
pub(crate) mod save;
pub(crate) mod section;
