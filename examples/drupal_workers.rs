//! The Drupal report in one minute: four workers write their own column of the same nodes.
//!
//! `cargo run --example drupal_workers` — on an embedded SQLite file in a temporary directory.
//! First the seed's code (load → heavy work → save the whole row), then the same workers with
//! `locked_update`. The first loses fields; the second loses none.

use std::{sync::Arc, time::Duration};

use entity::node;
use freshlock::Session;
use freshlock::lock::LocalLock;
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ActiveModelTrait, ConnectOptions, Database, DatabaseConnection, EntityTrait, IntoActiveModel,
    Set,
    sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode},
};

const NODES: i32 = 50;
const FIELDS: [&str; 4] = ["thumbnail", "summary", "score", "analysis"];

fn set_field(n: &mut node::ActiveModel, field: &str, id: i32) {
    let value = format!("{field} of node {id}");
    match field {
        "thumbnail" => n.thumbnail = Set(Some(value)),
        "summary" => n.summary = Set(Some(value)),
        "score" => n.score = Set(Some(id)),
        _ => n.analysis = Set(Some(value)),
    }
}

async fn heavy_work(id: i32, field: &str) {
    // 2–6 ms instead of the seed's 15–60 s, different per worker so the windows overlap.
    let ms = 2 + (id as u64 * 7 + field.len() as u64 * 3) % 5;
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

async fn run(db: &DatabaseConnection, locked: bool) -> Result<usize, Box<dyn std::error::Error>> {
    node::Entity::delete_many().exec(db).await?;
    for id in 1..=NODES {
        node::ActiveModel::fresh(id).insert(db).await?;
    }
    let lock = LocalLock::new();
    let workers = FIELDS.map(|field| {
        let session = Session::builder(db.clone())
            .lock(Arc::new(lock.clone()))
            .build();
        tokio::spawn(async move {
            let session = session?;
            let nodes = session.repository::<node::Entity>();
            for id in 1..=NODES {
                let loaded = nodes.load(id).await?.ok_or("node vanished")?;
                heavy_work(id, field).await;
                if locked {
                    nodes
                        .locked_update(id, |n| {
                            set_field(n, field, id);
                            Ok(())
                        })
                        .await?;
                } else {
                    // The seed's save(): every column of the loaded snapshot goes back.
                    let mut whole = (*loaded).clone().into_active_model().reset_all();
                    set_field(&mut whole, field, id);
                    whole.update(session.connection()).await?;
                }
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        })
    });
    for worker in workers {
        worker.await?.map_err(|e| e.to_string())?;
    }
    let mut lost = 0;
    for row in node::Entity::find().all(db).await? {
        lost += [
            row.thumbnail.is_none(),
            row.summary.is_none(),
            row.score.is_none(),
            row.analysis.is_none(),
        ]
        .into_iter()
        .filter(|&missing| missing)
        .count();
    }
    Ok(lost)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("freshlock-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("demo.db");
    let sqlite = SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let mut options = ConnectOptions::new(format!("sqlite://{}", file.display()));
    options
        .max_connections(4)
        .sqlx_logging(false)
        .map_sqlx_sqlite_opts(move |_| sqlite.clone());
    let db = Database::connect(options).await?;
    Migrator::up(&db, None).await?;

    let expected = NODES as usize * FIELDS.len();
    let naive = run(&db, false).await?;
    let fresh = run(&db, true).await?;
    println!(
        "{NODES} nodes × {} workers = {expected} fields written",
        FIELDS.len()
    );
    println!(
        "{:<40} {:>6} lost",
        "load → work → save() (the seed)", naive
    );
    println!("{:<40} {:>6} lost", "load → work → locked_update", fresh);
    db.close().await?;
    std::fs::remove_dir_all(&dir)?;
    if fresh > 0 {
        return Err("locked_update lost fields".into());
    }
    Ok(())
}
