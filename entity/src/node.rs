//! A content node, written by four independent workers (one column each).

use sea_orm::{Set, entity::prelude::*};

/// One node row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "node")]
pub struct Model {
    /// Primary key.
    #[sea_orm(primary_key)]
    pub id: i32,
    /// Title, set when the node is created.
    pub title: String,
    /// Written by the thumbnail worker.
    pub thumbnail: Option<String>,
    /// Written by the summary worker.
    pub summary: Option<String>,
    /// Written by the score worker.
    pub score: Option<i32>,
    /// Written by the analysis worker.
    pub analysis: Option<String>,
    /// Last change, in milliseconds since the Unix epoch (Drupal's `changed`).
    pub changed: i64,
}

/// No relations.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}

impl ActiveModel {
    /// Node `id` as created, before any worker ran: a title, every worker column empty.
    pub fn fresh(id: i32) -> Self {
        Self {
            id: Set(id),
            title: Set(format!("node {id}")),
            thumbnail: Set(None),
            summary: Set(None),
            score: Set(None),
            analysis: Set(None),
            changed: Set(0),
        }
    }
}
