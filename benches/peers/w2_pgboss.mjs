// W2 on pg-boss: JOBS jobs, each one UPDATE of one of JOBS counter rows, done by the handler on
// a pool of its own (pg-boss completes the job in a transaction of its own: not exactly once),
// CONCURRENCY local workers fetching BATCH jobs at a time. Checks that the counters gained one
// update per job, then prints one JSON line: jobs per second from the first fetch to the last
// completion.
import { PgBoss } from "pg-boss";
import pg from "pg";

const url = process.env.PEERS_URL;
const jobs = Number(process.env.JOBS ?? 5000);
const concurrency = Number(process.env.CONCURRENCY ?? 8);
const batchSize = Number(process.env.BATCH ?? 32);
const pool = new pg.Pool({ connectionString: url, max: concurrency + 2 });
await pool.query("DROP TABLE IF EXISTS peer_counter");
await pool.query("CREATE TABLE peer_counter (id INT PRIMARY KEY, n INT NOT NULL)");
await pool.query("INSERT INTO peer_counter SELECT g, 0 FROM generate_series(1, $1) g", [jobs]);
const boss = new PgBoss({ connectionString: url, max: concurrency + 2 });
boss.on("error", (e) => console.error(e));
await boss.start();
await boss.deleteQueue("w2").catch(() => {});
await boss.createQueue("w2");
for (let at = 0; at < jobs; at += 1000) {
  const batch = Array.from({ length: Math.min(1000, jobs - at) }, (_, i) => ({ data: { id: at + i + 1 } }));
  await boss.insert("w2", batch);
}
let done = 0;
let finished;
const all = new Promise((resolve) => (finished = resolve));
const started = process.hrtime.bigint();
await boss.work("w2", { batchSize, localConcurrency: concurrency, pollingIntervalSeconds: 0.5, burstWhenBatchFull: true }, async (batch) => {
  for (const job of batch) {
    await pool.query("UPDATE peer_counter SET n = n + 1 WHERE id = $1", [job.data.id]);
  }
  done += batch.length;
  if (done >= jobs) finished();
});
await all;
// The last batch's completion is pg-boss's own statement after the handler: wait for it.
for (;;) {
  const { rows } = await pool.query("SELECT count(*)::int AS n FROM pgboss.job WHERE name = 'w2' AND state = 'completed'");
  if (rows[0].n >= jobs) break;
  await new Promise((r) => setTimeout(r, 5));
}
const seconds = Number(process.hrtime.bigint() - started) / 1e9;
const { rows } = await pool.query("SELECT sum(n)::int AS total, min(n) AS lo, max(n) AS hi FROM peer_counter");
await boss.stop({ graceful: false });
await pool.end();
if (rows[0].total !== jobs || rows[0].lo !== 1 || rows[0].hi !== 1) {
  console.error(`counters gained ${rows[0].total} of ${jobs} (min ${rows[0].lo}, max ${rows[0].hi})`);
  process.exit(1);
}
console.log(JSON.stringify({ peer: "pg-boss 12.38.0", workload: "W2", jobs, concurrency, batch: batchSize, jobs_per_s: Math.round(jobs / seconds) }));
