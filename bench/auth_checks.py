"""What the authorization checks cost an import (issue 39: at most 15%).

usage: bench/with-postgres .venv/bin/python bench/auth_checks.py [--rooms N] [--events-per-room N] [--runs R]

One generated history (``roomstore generate-sample``: membership churn, forks
that merge, redactions, history visibility changes, rooms of versions 12,
11, 9, 10 and 6; every event citing its real auth events) is imported with
the command a user runs, ``roomstore import FILE --db URL``, into a fresh
database each time, with the checks (the default) and with
``--trust-source`` (none), taking turns within each round so the machine's
load falls on both alike. Per engine: events/s of each (the import's own
``seconds``: the events' import, not the process start), the median of
``--runs``, and checked/unchecked as a ratio. Both imports must store every
event and the checked one reject none (the history keeps the rules).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench._common import bench_databases, print_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMSTORE = os.path.join(os.path.dirname(sys.executable), "roomstore")


def run_import(path: str, url: str, trust: bool) -> dict:
    args = [ROOMSTORE, "import", path, "--db", url] + (["--trust-source"] if trust else [])
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"import failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1]
    if summary["failed"] or summary.get("rejected"):
        raise SystemExit(f"the history should import whole and unrejected: {summary}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=20)
    parser.add_argument("--events-per-room", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="roomstore-bench-auth-")
    path = os.path.join(directory, "history.jsonl")
    subprocess.run(
        [
            ROOMSTORE,
            "generate-sample",
            path,
            "--rooms",
            str(args.rooms),
            "--events-per-room",
            str(args.events_per_room),
            "--seed",
            "7",
        ],
        check=True,
        capture_output=True,
    )
    with open(path, encoding="utf-8") as handle:
        events = sum(1 for _ in handle)
    print(f"history: {events:,} events in {args.rooms} rooms ({path}); {args.runs} rounds, turns alternate")
    rows = []
    for engine, new_url in bench_databases():
        rates: dict[bool, list[float]] = {True: [], False: []}
        for round_index in range(args.runs):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for trust in order:
                summary = run_import(path, new_url(), trust)
                rates[trust].append(summary["imported"] / summary["seconds"])
        checked, unchecked = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append(
            (
                engine,
                checked,
                unchecked,
                checked / unchecked,
                " ".join(f"{r:,.0f}" for r in rates[False]),
                " ".join(f"{r:,.0f}" for r in rates[True]),
            )
        )
    print_table(
        ["engine", "checked ev/s", "unchecked ev/s", "checked/unchecked", "checked runs", "unchecked runs"], rows
    )
    print("goal (issue 39): the checks cost at most 15%: checked/unchecked >= 0.85")


if __name__ == "__main__":
    main()
