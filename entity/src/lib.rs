//! Example sea-orm entities mirroring the two field reports freshlock was built from.
//!
//! - [`node`]: the Drupal report. One row per content node, one column per queue worker
//!   (`thumbnail`, `summary`, `score`, `analysis`) — the columns the workers erased for each other.
//! - [`ham`], [`spam`], [`ham_lock`]: the Django report. Spams are children of a Ham; work on the
//!   Spams of one Ham is serialized through the 1:1 `ham_lock` row instead of the Ham row itself.
//!
//! - [`account`], [`stock`], [`purchase_order`]: several rows in one locked transaction — a
//!   transfer between two accounts, a reservation that decrements stock and inserts an order.
//!
//! These serve freshlock's tests, examples, demo and docs. The library itself does not depend on
//! them: any plain sea-orm entity works with it.

pub mod account;
pub mod ham;
pub mod ham_lock;
pub mod node;
pub mod purchase_order;
pub mod spam;
pub mod stock;
