// W1 on graphile-worker: JOBS no-op jobs added in bulk, then drained by one runner with
// CONCURRENCY workers and batching on (a local queue of 500, completions batched): what its
// documentation recommends for throughput. Prints one JSON line: jobs per second of the drain.
import { Logger, run, makeWorkerUtils } from "graphile-worker";

const quiet = new Logger(() => () => {});

const url = process.env.PEERS_URL;
const jobs = Number(process.env.JOBS ?? 20000);
const concurrency = Number(process.env.CONCURRENCY ?? 8);
const utils = await makeWorkerUtils({ connectionString: url, logger: quiet });
await utils.migrate();
await utils.withPgClient((pg) => pg.query("DELETE FROM graphile_worker._private_jobs"));
for (let at = 0; at < jobs; at += 1000) {
  const batch = Array.from({ length: Math.min(1000, jobs - at) }, () => ({ identifier: "noop", payload: {} }));
  await utils.addJobs(batch);
}
let done = 0;
let finished;
const all = new Promise((resolve) => (finished = resolve));
const started = process.hrtime.bigint();
const runner = await run({
  connectionString: url,
  noHandleSignals: true,
  logger: quiet,
  taskList: { noop: async () => {} },
  preset: {
    worker: {
      concurrentJobs: concurrency,
      maxPoolSize: concurrency + 2,
      pollInterval: 100,
      localQueue: { size: 500 },
      completeJobBatchDelay: 0,
    },
  },
});
runner.events.on("job:success", () => {
  done += 1;
  if (done === jobs) finished();
});
await all;
const seconds = Number(process.hrtime.bigint() - started) / 1e9;
await runner.stop();
await utils.release();
console.log(JSON.stringify({ peer: "graphile-worker 0.18.0", workload: "W1", jobs, concurrency, batch: 500, jobs_per_s: Math.round(jobs / seconds) }));
