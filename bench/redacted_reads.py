"""Reading redacted events: pagination of a room where many events are redacted.

usage: bench/with-postgres .venv/bin/python bench/redacted_reads.py [--events N] [--runs R]

Two rooms of N events each (default 3,000) on each engine: a plain one (all
messages) and one where every other message is redacted (a message, its
redaction, ...). ``paginate(dir=b, limit=100)`` walks each from the end to
the start; the time per page is the median over the pages of R runs
(default 5), after one warm-up walk. Each served redacted event carries its
first same-room redaction (``roomstore.events.tables.events.first_redaction_sql``).
Goal: the redacted room's pages within 5x of the plain room's (a redacted
event is pruned in Python and its redaction looked up: some cost is
expected), whatever the room's size. PostgreSQL runs once without and once
with fresh statistics (ANALYZE), as a new database has none.
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
from roomstore.storage.interning import chunks
from roomstore.store import RoomStore
from tests.store.builder import RoomBuilder

PAGE = 100


async def build(store: RoomStore, room_id: str, events: int, redacted: bool) -> str:
    room = RoomBuilder(room_id)
    built = [room.create(), room.join(room.creator)]
    while len(built) < events:
        message = room.message(room.creator, f"m{len(built)}")
        built.append(message)
        if redacted and len(built) < events:
            built.append(room.redact(room.creator, message.event_id))
    for part in chunks(built, 100):
        await store.persist_events([room.to_persist(e) for e in part])
    return room.creator


async def walk(store: RoomStore, room_id: str, user: str) -> list[float]:
    """Seconds per page of one walk from the end to the start."""
    times, token = [], None
    while True:
        start = time.perf_counter()
        page = await store.paginate(room_id, user, token, "b", PAGE)
        times.append(time.perf_counter() - start)
        if page.next_token is None:
            return times
        token = page.next_token


async def per_page_ms(store: RoomStore, room_id: str, user: str, runs: int) -> float:
    await walk(store, room_id, user)  # warm-up
    samples: list[float] = []
    for _ in range(runs):
        samples += await walk(store, room_id, user)
    return statistics.median(samples) * 1000


async def main(reactor, args) -> None:
    rows = []
    for engine, new_url in bench_databases():
        store = await RoomStore.open(new_url())
        try:
            user = await build(store, "!plain:example.org", args.events, redacted=False)
            await build(store, "!redacted:example.org", args.events, redacted=True)
            settings = [("", False)] + ([(" (ANALYZE)", True)] if engine == "postgres" else [])
            for label, analyze in settings:
                if analyze:
                    await store.db.run_interaction("analyze", lambda txn: txn.execute("ANALYZE"))
                plain = await per_page_ms(store, "!plain:example.org", user, args.runs)
                redacted = await per_page_ms(store, "!redacted:example.org", user, args.runs)
                rows.append([engine + label, plain, redacted, redacted / plain])
        finally:
            await store.close()
    print(
        f"paginate(dir=b, limit={PAGE}) over a room of {args.events:,} events; ms per page, median of"
        f" {args.runs} walks; the redacted room has every other message redacted"
    )
    print_table(["engine", "plain ms/page", "redacted ms/page", "ratio (goal <= 5)"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=3_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
