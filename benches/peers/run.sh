#!/usr/bin/env bash
# Keyed jobs beside the peers, in one run: graphile-worker on W1 (20,000 no-op jobs) and pg-boss
# on W2 (5,000 jobs, one UPDATE each) on the local PostgreSQL, each in its fastest documented
# setting (batched fetches), then freshlock's W1, W2 and W3 (`benches/jobs.rs`, both handler
# forms) on PostgreSQL and MariaDB, rounds interleaved.
#   bash benches/peers/run.sh [ROUNDS]      (default 3; about 3 minutes per round after the build)
# Needs node and npm (the peers are installed into benches/peers/node_modules from the lock file).
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-3}
server=${DATABASE_URL_POSTGRES:-postgres://postgres@127.0.0.1:5432/test}
mysql=${DATABASE_URL_MYSQL:-mysql://root@127.0.0.1:3306/test}
base=${server%/*}
[[ -d node_modules ]] || npm ci --no-audit --no-fund --loglevel=error
psql "$base/postgres" -qc "DROP DATABASE IF EXISTS peers_bench" -c "CREATE DATABASE peers_bench"
export PEERS_URL="$base/peers_bench"
cd ../..
cargo bench --all-features --bench jobs --no-run -q
for round in $(seq 1 "$rounds"); do
    echo "round $round"
    node benches/peers/w1_graphile.mjs
    node benches/peers/w2_pgboss.mjs
    for workload in w1 w2 w3; do
        FRESHLOCK_BENCH_ONLY=$workload DATABASE_URL_POSTGRES="$server" DATABASE_URL_MYSQL="$mysql" \
            cargo bench -q --all-features --bench jobs
    done
done
psql "$base/postgres" -qc "DROP DATABASE IF EXISTS peers_bench"
