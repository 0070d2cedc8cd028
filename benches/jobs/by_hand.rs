//! W3's hot key by hand: the floor its leased form is measured against.
//!
//! A hand-written queue that does what `handle_leased` does for a hot key with the least a
//! client can send: the same 10 ms of work (the same `spawn_blocking` sleep, on the same
//! runtime), then **one message** per job — `BEGIN`, the finished job marked done, the key's
//! next job claimed and read back, `COMMIT` — on a connection from the pool (as freshlock's
//! finish takes one), its values written into the text. No commit evidence, no look at whether
//! the claim still holds, no other keys, no second worker: what freshlock adds is left out, so
//! the gap between this row and W3's leased row is what that costs, and this row is what the
//! machine allows.

use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, sqlx};

/// The floor's own table (not the job table: nothing of freshlock's reads it).
const TABLE: &str = "freshlock_bench_by_hand";

/// Runs `n` jobs of one key by hand and prints the row.
pub async fn hot_key(db: &DatabaseConnection, n: usize) {
    let backend = db.get_database_backend();
    setup(db, n).await;
    let start = Instant::now();
    let mut current: i64 = 1;
    let mut done = 0;
    loop {
        tokio::task::spawn_blocking(|| std::thread::sleep(Duration::from_millis(10)))
            .await
            .expect("the work");
        done += 1;
        let next = finish_and_claim(db, backend, current, done).await;
        match next {
            Some(id) => current = id,
            None => break,
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let sql = format!("SELECT COUNT(*) AS n FROM {TABLE} WHERE state = 2");
    let row = db.query_one_raw(sea_orm::Statement::from_string(backend, sql));
    let finished: i64 = (row.await.expect("count").expect("a row"))
        .try_get("", "n")
        .expect("n");
    assert_eq!(
        (done, finished),
        (n, n as i64),
        "every job ran and finished once"
    );
    println!(
        "\nW3's hot key by hand ({n} jobs of 10 ms on one key, one worker, one message per job: \
         the finish and the next claim, no evidence, no check): wall {seconds:.2} s (the floor \
         {:.1} s)",
        n as f64 * 0.010
    );
}

/// The table, `n` jobs of one key (state 1: queued), the first claimed (state 0; 2 is done).
async fn setup(db: &DatabaseConnection, n: usize) {
    let bytes = match db.get_database_backend() {
        DbBackend::Postgres => "BYTEA",
        _ => "VARBINARY(32)",
    };
    let create = format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (id BIGINT PRIMARY KEY, key_hash {bytes} NOT NULL, \
         state INT NOT NULL, owner VARCHAR(64), attempts INT NOT NULL, payload TEXT NOT NULL)"
    );
    db.execute_unprepared(&create).await.expect("the table");
    // The index exists after the first run: its `CREATE` fails then.
    let index = format!("CREATE INDEX {TABLE}_key ON {TABLE} (key_hash, state, id)");
    let _ = db.execute_unprepared(&index).await;
    let empty = format!("DELETE FROM {TABLE}");
    db.execute_unprepared(&empty).await.expect("emptied");
    let rows: Vec<String> = (1..=n)
        .map(|id| format!("({id}, 'hot', {}, NULL, 0, 'true')", u8::from(id > 1)))
        .collect();
    for chunk in rows.chunks(1_000) {
        let sql = format!(
            "INSERT INTO {TABLE} (id, key_hash, state, owner, attempts, payload) VALUES {}",
            chunk.join(", ")
        );
        db.execute_unprepared(&sql).await.expect("fill");
    }
}

/// Job `id` marked done (by id, while claimed) and the key's next job claimed by token `claim`,
/// as one message: the next job's id, `None` when the key has none left.
async fn finish_and_claim(
    db: &DatabaseConnection,
    backend: DbBackend,
    id: i64,
    claim: usize,
) -> Option<i64> {
    let done = format!("UPDATE {TABLE} SET state = 2, owner = NULL WHERE id = {id} AND state = 0");
    let next = format!(
        "(SELECT id FROM {TABLE} WHERE key_hash = 'hot' AND state = 1 ORDER BY id LIMIT 1)"
    );
    let set = format!("state = 0, owner = 'by-hand-{claim}', attempts = attempts + 1");
    match backend {
        DbBackend::Postgres => {
            let sql = format!(
                "BEGIN; {done}; UPDATE {TABLE} SET {set} WHERE id = {next} RETURNING id, payload; \
                 COMMIT"
            );
            first_id(db, sql).await
        }
        _ => {
            // MySQL cannot read the table an UPDATE writes in its subquery: the claim takes
            // the key's first queued job by its own ORDER BY, then reads it back by its token.
            let sql = format!(
                "START TRANSACTION; {done}; UPDATE {TABLE} SET {set} WHERE key_hash = 'hot' AND \
                 state = 1 ORDER BY id LIMIT 1; SELECT id, payload FROM {TABLE} WHERE \
                 owner = 'by-hand-{claim}' AND state = 0; COMMIT"
            );
            first_id(db, sql).await
        }
    }
}

/// Sends `sql` as one text message (sqlx's `raw_sql`): the first column of the first row it
/// returned, if any.
async fn first_id(db: &DatabaseConnection, sql: String) -> Option<i64> {
    let sql = sqlx::AssertSqlSafe(sql);
    match db.get_database_backend() {
        #[cfg(feature = "postgres")]
        DbBackend::Postgres => {
            let rows = sqlx::raw_sql(sql).fetch_all(db.get_postgres_connection_pool());
            let rows = rows.await.expect("the message");
            rows.first().map(|row| sqlx::Row::get::<i64, _>(row, 0))
        }
        #[cfg(feature = "mysql")]
        DbBackend::MySql => {
            let rows = sqlx::raw_sql(sql).fetch_all(db.get_mysql_connection_pool());
            let rows = rows.await.expect("the message");
            rows.first().map(|row| sqlx::Row::get::<i64, _>(row, 0))
        }
        other => panic!("no server driver for {other:?} in this build"),
    }
}
