"""How much slower one core's work runs while the other cores are busy too.

usage: .venv/bin/python bench/core_contention.py [--rounds R] [--seconds S]

Two CPU-bound jobs, each measured alone and then with the same job running at
once on every other usable core (separate processes, no shared data): a
pure-Python loop, and SQLite inserts into an in-memory table (C code, as the
writer's ``executemany``). Rounds alternate alone and together; medians.

Why it is here: the writer's fastest set-up runs validation in a worker
process beside its database thread (``bench/event_store.py`` (a)), while the
bulk path it is compared with runs alone. On a VM whose cores share the
host's caches or physical cores, two busy cores do less than twice one's
work, and this measures by how much.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sqlite3
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from bench._common import print_table
from roomstore.cli.imports import usable_cores


def python_loop(n: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i % 7
    return time.perf_counter() - start


def sqlite_inserts(n: int) -> float:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a INTEGER PRIMARY KEY, b INTEGER NOT NULL, c TEXT NOT NULL)")
    conn.execute("CREATE INDEX t_b ON t (b, a)")
    rows = [(i, (i * 7919) % 100_003, "x" * 40) for i in range(n)]
    start = time.perf_counter()
    conn.executemany("INSERT INTO t VALUES (?, ?, ?)", rows)
    conn.commit()
    return time.perf_counter() - start


JOBS = {"Python loop": python_loop, "SQLite inserts": sqlite_inserts}


def _size_for(job, seconds: float) -> int:
    """The job's size that takes about ``seconds`` alone here."""
    n = 10_000
    while True:
        took = job(n)
        if took >= seconds / 4:
            return max(1, int(n * seconds / took))
        n *= 4


def _timed(args) -> float:
    name, n = args
    return JOBS[name](n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="each job's length alone (default 1 s)")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (medians)")
    cores = usable_cores()
    if cores < 2:
        sys.exit("core_contention: this process may use one core only; nothing to compare")
    print(
        f"bench/core_contention.py: {cores} usable cores, {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}"
    )
    rows = []
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        for name, job in JOBS.items():
            n = _size_for(job, args.seconds)
            alone, together = [], []
            for _ in range(args.rounds):
                alone.append(pool.apply(_timed, ((name, n),)))
                together.append(statistics.median(pool.map(_timed, [(name, n)] * cores, chunksize=1)))
            a, t = statistics.median(alone), statistics.median(together)
            rows.append([name, f"{a:.3f}", f"{t:.3f}", f"{t / a:.2f}x", f"{cores * a / t:.2f}"])
    print_table(["job", "alone s", f"{cores} at once s (each)", "slowdown", "cores' worth of work"], rows)


if __name__ == "__main__":
    main()
