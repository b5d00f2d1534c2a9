"""PostgreSQL: BEGIN sent with a transaction's first statement vs psycopg2's own BEGIN.

usage: bench/with-postgres .venv/bin/python bench/transaction_begin.py [--interactions N] [--rounds R]

Two pools on one database, side by side in one run: the store's (a pooled
connection sends ``BEGIN`` in the same message as the first statement) and
one whose connections leave ``BEGIN`` to psycopg2 (a round trip of its own).
Each interaction is one statement: a read of one row by primary key, or an
update of one row. The pools take turns, round by round. Printed: the median
time of the first statement inside the transaction, and of the whole
interaction (thread hop, statement, COMMIT), per pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402
from twisted.internet import defer, task  # noqa: E402

from bench._common import bench_databases, print_table  # noqa: E402
from roomstore.storage import Database  # noqa: E402
from roomstore.storage.engines import PostgresEngine  # noqa: E402


@attrs.define
class PsycopgBeginEngine(PostgresEngine):
    """The store's PostgreSQL engine, but psycopg2 sends BEGIN (as before)."""

    def connect(self, pooled: bool = False):
        return super().connect(pooled=False)


def setup_txn(txn) -> None:
    txn.execute("CREATE TABLE bench_rows (id BIGINT PRIMARY KEY, value BIGINT NOT NULL)")
    txn.execute("INSERT INTO bench_rows SELECT g, g FROM generate_series(1, 10000) AS g")


def read_txn(txn, key: int) -> float:
    start = time.perf_counter()
    txn.execute("SELECT value FROM bench_rows WHERE id = ?", (key,), prepare=True).fetchone()
    return time.perf_counter() - start


def write_txn(txn, key: int) -> float:
    start = time.perf_counter()
    txn.execute("UPDATE bench_rows SET value = value + 1 WHERE id = ?", (key,), prepare=True)
    return time.perf_counter() - start


async def main(reactor, args) -> None:
    engines = dict(bench_databases())
    if "postgres" not in engines:
        raise SystemExit("transaction_begin.py needs PostgreSQL: run it through bench/with-postgres")
    url = engines["postgres"]()
    ours = Database.from_url(url)
    await ours.prepare()
    theirs = Database(PsycopgBeginEngine(dsn=ours.engine.dsn, max_connections=1))
    await ours.run_interaction("setup", setup_txn)
    await ours.run_interaction("analyze", lambda txn: txn.execute("ANALYZE bench_rows"))
    pools = {"BEGIN with the first statement": ours, "psycopg2's BEGIN": theirs}
    results = {(pool, kind): ([], []) for pool in pools for kind in ("read", "write")}
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"bench/transaction_begin.py: load average {load} ({os.cpu_count()} cores)", flush=True)
    for round_ in range(args.rounds + 1):  # round 0 warms up
        order = list(pools.items())
        if round_ % 2:
            order.reverse()
        for name, db in order:
            for kind, fn in (("read", read_txn), ("write", write_txn)):
                inner, whole = results[(name, kind)]
                for i in range(args.interactions):
                    start = time.perf_counter()
                    first = await db.run_interaction(f"bench_{kind}", fn, 1 + (i * 7919) % 10000)
                    if round_:
                        whole.append((time.perf_counter() - start) * 1000)
                        inner.append(first * 1000)
    rows = []
    for kind in ("read", "write"):
        base = statistics.median(results[("psycopg2's BEGIN", kind)][1])
        for name in pools:
            inner, whole = results[(name, kind)]
            rows.append(
                [
                    kind,
                    name,
                    f"{statistics.median(inner):.3f}",
                    f"{statistics.median(whole):.3f}",
                    f"{statistics.median(whole) / base:.2f}",
                ]
            )
    print()
    print(
        f"median ms over {args.rounds} rounds x {args.interactions} interactions per pool and kind (after a warm-up"
        " round); the pools take turns going first"
    )
    print_table(["interaction", "pool", "first statement", "whole interaction", "whole vs psycopg2's"], rows)
    print(f"load average at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    await ours.close()
    await theirs.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interactions", type=int, default=500, help="interactions per pool, kind and round")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (default 4)")
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
