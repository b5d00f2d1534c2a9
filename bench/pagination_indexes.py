"""What the pagination indexes of schema delta 4/01 cost the persister, on SQLite and PostgreSQL.

usage: bench/with-postgres .venv/bin/python bench/pagination_indexes.py [--events N] [--runs R]

``persist_events`` throughput (events/s, batches of 100; bench/event_store.py's
workload (a): a linear room, 90% messages, 5% topic changes, 5% joins) on a
fresh database with every index of ``roomstore/schema/deltas/4/01_pagination_by_snapshot.sql``,
with none of them (dropped after the schema is made), and with each one
alone. The variants run in turn within each of R rounds (so the machine's
load falls on all alike); the table gives the median events/s of each and
its ratio to "none". Back-pagination across events the viewer may not see
needs them (bench/timeline_reads.py, section p).
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
from bench.event_store import persist_workload
from roomstore.storage.interning import chunks
from roomstore.store import RoomStore

BATCH = 100
#: The indexes of delta 4/01.
INDEXES = ("visibility_snapshots_room", "events_vis_before", "events_vis_after")


def _drop_txn(txn, names) -> None:
    for name in names:
        txn.execute(f"DROP INDEX {name}")


async def persist_rate(url: str, keep: tuple[str, ...], setup, events) -> float:
    """events/s of persisting ``events`` on a fresh database holding only the
    delta's indexes in ``keep``."""
    store = await RoomStore.open(url)
    try:
        await store.db.run_interaction("drop", _drop_txn, [n for n in INDEXES if n not in keep])
        await store.persist_events(setup)
        start = time.perf_counter()
        for part in chunks(events, BATCH):
            await store.persist_events(part)
        return len(events) / (time.perf_counter() - start)
    finally:
        await store.close()


async def main(reactor, args) -> None:
    variants = [("all three", INDEXES), ("none", ())] + [(f"{name} alone", (name,)) for name in INDEXES]
    _, setup, events = persist_workload(args.events)
    print(f"bench/pagination_indexes.py: persist_events of {args.events:,} events, {args.runs} rounds", flush=True)
    rows = []
    for engine, new_url in bench_databases():
        rates: dict[str, list[float]] = {name: [] for name, _ in variants}
        await persist_rate(new_url(), INDEXES, setup, events)  # warm-up
        for _ in range(args.runs):
            for name, keep in variants:
                rates[name].append(await persist_rate(new_url(), keep, setup, events))
        none = statistics.median(rates["none"])
        for name, _ in variants:
            median = statistics.median(rates[name])
            rows.append([engine, name, median, f"{median / none:.3f}", " ".join(f"{r:,.0f}" for r in rates[name])])
        print(f"  {engine} done", flush=True)
    print()
    print_table(["engine", "delta 4/01 indexes", "events/s (median)", "/ none", "each round"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, options)))
