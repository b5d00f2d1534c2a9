"""Prepared statements' plans on PostgreSQL: the hot reads run plain, as
prepared statements with a custom plan each time, and with the generic plan.

usage: bench/with-postgres .venv/bin/python bench/prepared_plans.py [--runs R]

``txn.execute(sql, args, prepare=True)`` keeps a statement prepared on its
connection; PostgreSQL (plan_cache_mode=auto) plans the first five executions
for their values (custom plans) and may then switch to one plan for all values
(generic), if its estimated cost is not much above the custom ones'. A generic
plan is sound when it runs as fast as the custom plan for every room size.

Statements: the back-pagination page (``roomstore/events/read/pagination.py``),
first and sixth page, in bench/timeline_reads.py's rooms of 10,000 events
where the viewer sees all or 1%, and in a room of 20 events; ``recent()``'s
statement (``roomstore/events/read/timeline.py``) for bench/timeline_reads.py's
users in 1 room, in 2,000 rooms and in 20 rooms of 500 messages. For each,
per execution, median of R (default 15) in one transaction (and of R EXPLAINs): plain execute
(parse, plan, run), prepared with force_custom_plan (plan, run), with
force_generic_plan (run), with auto after those (and the plans the server
chose, from pg_prepared_statements); and the generic plan's
and the custom plan's execution time by EXPLAIN ANALYZE (the server's own
clock, no round trip). After ANALYZE, as bench/timeline_reads.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisted.internet import defer, task

from bench._common import bench_databases, print_table
from bench.timeline_reads import LONG, VIEWER, build_long_rooms, build_pagination_rooms, build_recent_rooms, persist_all
from roomstore.storage.transaction import Transaction
from roomstore.store import RoomStore
from tests.store.builder import RoomBuilder


async def captured(call) -> tuple[str, list]:
    """The statement (sql, args) that ``call()`` runs with ``prepare=True``."""
    seen = []
    original = Transaction.execute

    def spy(self, sql, args=(), prepare=False):
        if prepare:
            seen.append((sql, list(args)))
        return original(self, sql, args, prepare)

    Transaction.execute = spy
    try:
        await call()
    finally:
        Transaction.execute = original
    return seen[-1]


def measure_txn(txn, sql: str, args: list, runs: int) -> list:
    def timed(prepare: bool) -> float:
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            txn.execute(sql, args, prepare=prepare).fetchall()
            samples.append((time.perf_counter() - t0) * 1000)
        return statistics.median(samples)

    def explain(mode: str) -> float:
        txn.execute(f"SET LOCAL plan_cache_mode = {mode}")
        marks = ", ".join("%s" for _ in args)
        samples = []
        for _ in range(runs):
            txn._cursor.execute(f"EXPLAIN (ANALYZE, TIMING OFF) EXECUTE {name} ({marks})", args)
            lines = [r[0] for r in txn._cursor.fetchall()]
            samples.append(float(next(line for line in lines if line.startswith("Execution Time")).split()[2]))
        return statistics.median(samples)

    plain = timed(False)
    txn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
    custom = timed(True)
    txn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    generic = timed(True)
    txn.execute("SET LOCAL plan_cache_mode = auto")
    counts = "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = ?"
    # The engine's name for the statement (bench only: reaching into the
    # connection's memory of what it prepared).
    name = txn._cursor.connection.prepared[sql]
    generic_before, custom_before = txn.execute(counts, (name,)).fetchone()
    auto = timed(True)
    generic_after, custom_after = txn.execute(counts, (name,)).fetchone()
    chose = f"{generic_after - generic_before} generic, {custom_after - custom_before} custom"
    generic_exec = explain("force_generic_plan")
    custom_exec = explain("force_custom_plan")
    return [plain, custom, generic, auto, chose, custom_exec, generic_exec]


async def main(reactor, runs: int) -> None:
    engines = [(e, u) for e, u in bench_databases() if e == "postgres"]
    if not engines:
        print("bench/prepared_plans.py needs PostgreSQL: run it under bench/with-postgres")
        return
    store = await RoomStore.open(engines[0][1]())
    try:
        late, full, _ = await build_pagination_rooms(store)
        small = RoomBuilder("!small:example.org")
        events = [small.create(), small.join(small.creator), small.history_visibility("joined"), small.join(VIEWER)]
        events += [small.message(small.creator, f"m{i}") for i in range(16)]
        await persist_all(store, small, events)
        await build_recent_rooms(store, 2000)
        await build_long_rooms(store, 20, 500)
        await store.db.run_interaction("analyze", lambda txn: txn.execute("ANALYZE"))

        async def sixth_page(room_id):
            token = None
            for _ in range(5):
                token = (await store.paginate(room_id, VIEWER, token, "b", 10)).next_token
            return await store.paginate(room_id, VIEWER, token, "b", 10)

        cases = []
        for label, room_id in (
            ("page 1, fully visible", full),
            ("page 1, 1% room", late),
            ("page 1, 20 events", small.room_id),
        ):
            cases.append((label, await captured(lambda r=room_id: store.paginate(r, VIEWER, None, "b", 10))))
        for label, room_id in (("page 6, fully visible", full), ("page 6, 1% room", late)):
            cases.append((label, await captured(lambda r=room_id: sixth_page(r))))
        for label, user in (
            ("recent, 1 room", "@one:example.org"),
            ("recent, 2,000 rooms", "@many:example.org"),
            ("recent, 20 long rooms", LONG),
        ):
            cases.append((label, await captured(lambda u=user: store.recent(u, 20, 10))))
        rows = []
        for label, (sql, args) in cases:
            rows.append([label, *await store.db.run_interaction("measure", measure_txn, sql, args, runs)])
    finally:
        await store.close()
    print(
        f"\nms per execution, median of {runs} in one transaction (client wall); exec: EXPLAIN ANALYZE's Execution Time"
    )
    print_table(["statement", "plain", "custom", "generic", "auto", "auto chose", "custom exec", "generic exec"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args.runs)))
