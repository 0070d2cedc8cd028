#!/usr/bin/env python3
"""Draws BENCHMARKS.md's headline chart from the floor benchmark's JSON.

    FRESHLOCK_BENCH_JSON=benches/floor.json FRESHLOCK_BENCH_ONLY=floor \
        DATABASE_URL_POSTGRES=postgres://postgres@127.0.0.1:5432/test \
        cargo bench --all-features --bench scenarios
    python3 benches/chart.py benches/floor.json benches/floor.svg

One client, one row, PostgreSQL: updates per second of each way to write it, beside pgbench
running the same four statements. Standard library only.
"""

import json
import sys
from xml.sax.saxutils import escape

# (label in the chart, the bench's row label or a pgbench key)
BARS = [
    ("pgbench: BEGIN, SELECT FOR UPDATE, UPDATE, COMMIT", "pgbench"),
    ("pgbench: the same, pipelined as two flights", "pgbench_pipelined"),
    ("sea-orm, the four statements by hand", "the four statements by hand in sea-orm, 1 task"),
    ("freshlock locked_update (local)", "`locked_update` (local), 1 task"),
    ("freshlock locked_update (row)", "`locked_update` (row), 1 task"),
    ("freshlock locked_update (pg_advisory)", "`locked_update` (pg_advisory), 1 task"),
    ("freshlock locked_update (table)", "`locked_update` (table), 1 task"),
    ("freshlock optimistic_first (one statement)", "`locked_update` optimistic-first (local), 1 task"),
]


def values(report):
    rows = {row["row"]: row["no_ping"] for row in report["rows"]}
    for label, key in BARS:
        value = report.get(key) if key.startswith("pgbench") else rows.get(key)
        if value is not None:
            yield label, key.startswith("pgbench"), value


def svg(report):
    bars = list(values(report))
    top = max(value for _, _, value in bars)
    floor = report["pgbench"]
    width, label_w, bar_w, row_h = 900, 370, 400, 26
    height = 70 + row_h * len(bars) + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="13">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        '<text x="10" y="24" font-size="16" font-weight="bold">'
        "One locked write of one row, PostgreSQL, one client (updates/s)</text>",
        f'<text x="10" y="46" fill="#555">medians of {report["rounds"]} interleaved rounds; '
        "no checkout ping; ratio = against pgbench's four statements</text>",
    ]
    for i, (label, is_floor, value) in enumerate(bars):
        y = 62 + i * row_h
        length = bar_w * value / top
        colour = "#9aa5b1" if is_floor else "#2b6cb0"
        out.append(f'<text x="10" y="{y + 17}">{escape(label)}</text>')
        out.append(
            f'<rect x="{label_w}" y="{y + 4}" width="{length:.1f}" height="{row_h - 8}" '
            f'fill="{colour}"/>'
        )
        out.append(
            f'<text x="{label_w + length + 6:.1f}" y="{y + 17}">{value:,.0f} '
            f'({value / floor:.2f}×)</text>'
        )
    x = label_w + bar_w * floor / top
    out.append(
        f'<line x1="{x:.1f}" y1="58" x2="{x:.1f}" y2="{height - 28}" stroke="#c53030" '
        'stroke-dasharray="4 3"/>'
    )
    out.append(
        f'<text x="{x + 4:.1f}" y="{height - 12}" fill="#c53030">pgbench floor</text>'
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: chart.py FLOOR_JSON OUT_SVG")
    with open(sys.argv[1], encoding="utf-8") as f:
        report = json.load(f)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(svg(report))


if __name__ == "__main__":
    main()
