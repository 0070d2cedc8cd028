"""Django's own locked write, for the floor script's comparison (issue 26; kept out of CI).

One client increments `node.score` of one row for a given time, the way a Django 5.2 user
writes it:

    with transaction.atomic():
        node = Node.objects.select_for_update().get(id=...)
        node.score = (node.score or 0) + 1
        node.save(update_fields=["score"])

against the `node` table the Rust benches use (made by freshlock's migrations), through psycopg
3, and prints `updates/s: N`. It checks its own count: the row's score moved by exactly the
number of transactions it made.

Set-up (outside CI):

    python3 -m venv /tmp/djvenv
    /tmp/djvenv/bin/pip install "Django>=5.2,<5.3" "psycopg[binary]>=3.1"

then run the floor script with `FRESHLOCK_BENCH_DJANGO=/tmp/djvenv/bin/python` (BENCHMARKS.md
§7), which runs this in its interleaved rounds, or alone:

    /tmp/djvenv/bin/python benches/django/select_for_update.py \
        --url postgres://postgres@127.0.0.1:5432/test --seconds 3
"""

import argparse
import sys
import time
from urllib.parse import urlparse


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="postgres://user@host:port/database")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--id", type=int, default=2, help="the node row to increment")
    args = parser.parse_args()

    url = urlparse(args.url)
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.path.lstrip("/") or "postgres",
                "USER": url.username or "postgres",
                "PASSWORD": url.password or "",
                "HOST": url.hostname or "127.0.0.1",
                "PORT": str(url.port or 5432),
                # One connection kept for the whole run, as a worker process keeps it.
                "CONN_MAX_AGE": None,
            }
        },
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()

    from django.db import models, transaction

    class Node(models.Model):
        id = models.IntegerField(primary_key=True)
        title = models.TextField()
        thumbnail = models.TextField(null=True)
        summary = models.TextField(null=True)
        score = models.IntegerField(null=True)
        analysis = models.TextField(null=True)
        changed = models.BigIntegerField()

        class Meta:
            app_label = "freshlock_bench"
            db_table = "node"
            managed = False

    def score() -> int:
        return Node.objects.get(id=args.id).score or 0

    before = score()
    done = 0
    started = time.perf_counter()
    deadline = started + args.seconds
    while time.perf_counter() < deadline:
        with transaction.atomic():
            node = Node.objects.select_for_update().get(id=args.id)
            node.score = (node.score or 0) + 1
            node.save(update_fields=["score"])
        done += 1
    elapsed = time.perf_counter() - started
    after = score()
    if after - before != done:
        print(f"lost or doubled: {done} transactions, score moved by {after - before}", file=sys.stderr)
        return 1
    print(f"updates/s: {done / elapsed:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
