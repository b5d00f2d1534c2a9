"""Timeline reads at scale, on SQLite and PostgreSQL side by side.

usage: bench/with-postgres .venv/bin/python bench/timeline_reads.py [--runs R] [--sections pr]

(p) Back-pagination where a user may see 1%: a room of 10,000 events with
    history visibility "joined", which the viewer joins 100 events before the
    end (a late joiner: their join and the 99 messages after it are theirs to
    see, and the room's first three events, from before history visibility
    was set; between them 9,897 events they may not see); and, for comparison, a room of 10,000 events where the
    viewer was joined from the start (everything visible). ``paginate(dir=b,
    limit=L)`` from the end until an empty page: every page must be full or
    the last one before the start of what they may see, and each page must be
    one statement (``Database.query_count``). Time per page: median over the
    pages and R runs, and the slowest page (each page's median over the R
    runs, then the largest: the page that crosses the 9,897 events to reach
    the first three); goal: every page of the 1% room within 2x of the fully
    visible one's median page. PostgreSQL is ANALYZEd after
    the rooms are built.
(r) Recent events for a user in 2,000 rooms: ``recent(user, rooms=20,
    events=10)`` for a user joined to 2,000 rooms (each with a few messages)
    against a user joined to one room; statements per call, the query plan
    (EXPLAIN, shown once per engine), and the median time; goal: <= 10x.
    Also the CPU time with the event cache emptied before each call (recent
    serves cached events without parsing their bytes again), and a third user
    in 20 rooms of 500 messages each (--long-messages): the cost of a page
    must not grow with the length of its rooms.

Timings are medians of R runs (default 7) after one warm-up call.
"""

from __future__ import annotations

import argparse
import os
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

BATCH = 100
ROOM_EVENTS = 10_000
VIEWER = "@viewer:example.org"
LONG = "@long:example.org"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def persist_all(store: RoomStore, room: RoomBuilder, events) -> None:
    for part in chunks(events, BATCH):
        await store.persist_events([room.to_persist(e) for e in part])


async def build_pagination_rooms(store: RoomStore) -> tuple[str, str, int]:
    """(the 1% room, the fully visible room, events the viewer may see in the 1% room)."""
    late = RoomBuilder("!late:example.org")
    events = [
        late.create(),
        late.join(late.creator),
        late.history_visibility("joined"),
        late.join("@other:example.org"),
    ]
    while len(events) < ROOM_EVENTS - 100:
        events.append(late.message(late.creator if len(events) % 2 else "@other:example.org", f"m{len(events)}"))
    events.append(late.join(VIEWER))
    while len(events) < ROOM_EVENTS:
        events.append(late.message(late.creator, f"m{len(events)}"))
    await persist_all(store, late, events)
    full = RoomBuilder("!full:example.org")
    events = [full.create(), full.join(full.creator), full.history_visibility("joined"), full.join(VIEWER)]
    while len(events) < ROOM_EVENTS:
        events.append(full.message(full.creator if len(events) % 2 else VIEWER, f"m{len(events)}"))
    await persist_all(store, full, events)
    # Visible to the viewer: their join and the 99 messages after it, and the
    # room's first three events (from before history visibility became "joined").
    return late.room_id, full.room_id, 103


async def walk_back(store: RoomStore, room_id: str, limit: int) -> tuple[list[float], list[int], list[int]]:
    """Pages from the end until an empty one: (ms per page, events per page, statements per page)."""
    times, sizes, statements = [], [], []
    token = None
    while True:
        before = store.db.query_count
        start = time.perf_counter()
        page = await store.paginate(room_id, VIEWER, token, "b", limit)
        times.append((time.perf_counter() - start) * 1000)
        statements.append(store.db.query_count - before)
        sizes.append(len(page.events))
        if not page.events or len(times) >= 50:
            return times, sizes, statements
        token = page.next_token


async def section_p(engines, runs: int, limit: int) -> None:
    rows = []
    for engine, new_url in engines:
        store = await RoomStore.open(new_url())
        try:
            late, full, visible = await build_pagination_rooms(store)
            if engine == "postgres":
                # As autovacuum would after 20,000 new rows: the planner needs
                # the rooms' statistics (tests/store/test_timeline_plans does
                # the same).
                await store.db.run_interaction("analyze", lambda txn: txn.execute("ANALYZE"))
            await walk_back(store, late, limit)  # warm-up
            await walk_back(store, full, limit)
            late_times, full_times = [], []
            late_by_page: dict[int, list[float]] = {}
            full_by_page: dict[int, list[float]] = {}
            for _ in range(runs):
                t, sizes, statements = await walk_back(store, late, limit)
                late_times += t
                for index, ms in enumerate(t):
                    late_by_page.setdefault(index, []).append(ms)
                late_sizes, late_statements = sizes, statements
                # The fully visible room: as many pages as the 1% room has.
                ft, fsizes, fstatements = [], [], []
                token = None
                for _ in range(len(sizes)):
                    before = store.db.query_count
                    start = time.perf_counter()
                    page = await store.paginate(full, VIEWER, token, "b", limit)
                    ft.append((time.perf_counter() - start) * 1000)
                    fsizes.append(len(page.events))
                    fstatements.append(store.db.query_count - before)
                    token = page.next_token
                full_times += ft
                for index, ms in enumerate(ft):
                    full_by_page.setdefault(index, []).append(ms)
            seen = sum(late_sizes)
            full_pages = all(s == limit for s in late_sizes[:-2]) and late_sizes[-1] == 0
            assert seen == visible, f"{engine}: the late joiner saw {seen} events, expected {visible}"
            assert full_pages, f"{engine}: pages not full before the start: {late_sizes}"
            late_median, full_median = statistics.median(late_times), statistics.median(full_times)
            # The slowest page: each page's median over the runs, then the
            # largest (a single run's maximum measures the machine's hiccups).
            late_pages = [statistics.median(v) for _, v in sorted(late_by_page.items())]
            full_page_medians = [statistics.median(v) for _, v in sorted(full_by_page.items())]
            slowest = max(range(len(late_pages)), key=late_pages.__getitem__)
            rows.append(
                [
                    engine,
                    f"{len(late_sizes)} ({'/'.join(map(str, late_sizes))})",
                    max(late_statements),
                    max(fstatements),
                    late_median,
                    full_median,
                    f"{late_median / full_median:.2f}",
                    f"{late_pages[slowest]:.3g} (page {slowest + 1})",
                    max(full_page_medians),
                    f"{late_pages[slowest] / full_median:.2f}",
                ]
            )
            print(f"  {engine}: 1% room, median ms of each page: {' '.join(f'{x:.2f}' for x in late_pages)}")
            print(f"  {engine}: 1% room {late_median:.2f} ms/page, fully visible {full_median:.2f} ms/page", flush=True)
        finally:
            await store.close()
    print(
        f"\n(p) back-pagination, limit {limit}, a 10,000-event room where the viewer may see 1% ({100} events)"
        f" (and the room's first 3) vs one they may see whole; median ms per page over the pages of {runs} walks"
    )
    print_table(
        [
            "engine",
            "pages (events each)",
            "statements/page (1%)",
            "statements/page (full)",
            "1% ms/page",
            "full ms/page",
            "1% / full",
            "1% slowest page ms",
            "full slowest page ms",
            "1% slowest / full",
        ],
        rows,
    )


async def build_recent_rooms(store: RoomStore, rooms: int) -> None:
    many, one = "@many:example.org", "@one:example.org"
    builders = []
    for r in range(rooms):
        room = RoomBuilder(f"!r{r}:example.org")
        events = [room.create(), room.join(room.creator), room.join(many)]
        if r == 0:
            events.append(room.join(one))
        events += [room.message(room.creator, f"hello {i}") for i in range(5)]
        builders.append((room, events))
    # Rooms persisted in batches, interleaved so activity is spread over the stream.
    for part in chunks(builders, 20):
        batch = [room.to_persist(e) for room, events in part for e in events]
        await store.persist_events(batch)


def explain_txn(txn, store, user_id):
    """The plan of recent()'s statement, captured by running it under EXPLAIN."""
    captured = []
    original = txn.execute

    def execute(sql, args=(), prepare=False):
        captured.append((sql, args))
        return original(sql, args, prepare)

    txn.execute = execute
    timeline = store.timeline
    now = timeline.positions.per_writer(timeline.positions.now())
    timeline._recent_txn(txn, timeline.cached_viewer(user_id), 20, 10, None, now)
    txn.execute = original
    sql, args = captured[-1]  # the viewer's nids are cached: recent's one statement
    prefix = "EXPLAIN QUERY PLAN " if txn.engine.name == "sqlite" else "EXPLAIN "
    return [" | ".join(str(c) for c in row) for row in txn.execute(prefix + sql, args).fetchall()]


async def build_long_rooms(store: RoomStore, rooms: int, messages: int) -> None:
    """``@long`` joined to ``rooms`` rooms of ``messages`` messages each."""
    for r in range(rooms):
        room = RoomBuilder(f"!long{r}:example.org")
        events = [room.create(), room.join(room.creator), room.join(LONG)]
        events += [room.message(room.creator, f"hello {i}") for i in range(messages)]
        await persist_all(store, room, events)


async def section_r(engines, runs: int, rooms: int, long_messages: int) -> None:
    rows, long_rows = [], []
    for engine, new_url in engines:
        store = await RoomStore.open(new_url())
        try:
            start = time.perf_counter()
            await build_recent_rooms(store, rooms)
            await build_long_rooms(store, 20, long_messages)
            print(
                f"  {engine}: {rooms:,} rooms and 20 of {long_messages:,} messages persisted"
                f" in {time.perf_counter() - start:.0f}s",
                flush=True,
            )
            users = ("@one:example.org", "@many:example.org", LONG)
            times: dict[str, list[float]] = {u: [] for u in users}
            cpu: dict[str, list[float]] = {u: [] for u in users}
            cold: dict[str, list[float]] = {u: [] for u in users}
            statements: dict[str, list[int]] = {u: [] for u in users}
            for user in users:
                await store.recent(user, 20, 10)  # warm-up
            # Each user's calls in a row, in blocks that alternate (so both
            # see the same stretches of this shared machine's load), the first
            # call of a block not counted: a call right after the other
            # user's pays for SQLite freeing that statement's larger temporary
            # tables when the shared prepared statement is reset.
            for _block in range(runs):
                for user in users:
                    await store.recent(user, 20, 10)
                    for _ in range(5):
                        before = store.db.query_count
                        t0, c0 = time.perf_counter(), time.process_time()
                        result = await store.recent(user, 20, 10)
                        times[user].append((time.perf_counter() - t0) * 1000)
                        cpu[user].append((time.process_time() - c0) * 1000)
                        statements[user].append(store.db.query_count - before)
                        expected_rooms = 1 if user.startswith("@one") else 20
                        assert len(result.rooms) == expected_rooms, (user, len(result.rooms))
                        assert all(0 < len(events) <= 10 for _, events in result.rooms), [
                            len(e) for _, e in result.rooms
                        ]
                    # The same with the event cache emptied before each call
                    # (every event's bytes parsed again).
                    for _ in range(3):
                        store.reader.invalidate_all()
                        c0 = time.process_time()
                        await store.recent(user, 20, 10)
                        cold[user].append((time.process_time() - c0) * 1000)
            figures = {
                u: (
                    statistics.median(times[u]),
                    max(statements[u]),
                    statistics.median(cpu[u]),
                    statistics.median(cold[u]),
                )
                for u in users
            }
            plan = await store.db.run_interaction("explain", explain_txn, store, "@many:example.org")
            print(f"\n  {engine}: plan of recent()'s statement for the user in {rooms:,} rooms:")
            for line in plan:
                print(f"    {line}")
            one, many, long = figures["@one:example.org"], figures["@many:example.org"], figures[LONG]
            rows.append(
                [
                    engine,
                    one[1],
                    many[1],
                    one[0],
                    many[0],
                    f"{many[0] / one[0]:.1f}",
                    one[2],
                    many[2],
                    f"{many[2] / one[2]:.1f}",
                    one[3],
                    many[3],
                    f"{many[3] / one[3]:.1f}",
                ]
            )
            long_rows.append([engine, long[1], long[0], f"{long[0] / one[0]:.1f}", long[2], f"{long[2] / one[2]:.1f}"])
        finally:
            await store.close()
    print(
        f"\n(r) recent(user, rooms=20, events=10): a user in 1 room vs a user in {rooms:,} rooms,"
        f" median of {runs * 5} calls each ({runs} alternating blocks of 5, after one uncounted call);"
        f" cold: median of {runs * 3} calls, each after emptying the event cache"
    )
    print_table(
        [
            "engine",
            "statements (1 room)",
            f"statements ({rooms:,} rooms)",
            "1 room ms",
            f"{rooms:,} rooms ms",
            "ratio",
            "1 room CPU ms",
            f"{rooms:,} rooms CPU ms",
            "CPU ratio",
            "cold 1 room CPU ms",
            f"cold {rooms:,} rooms CPU ms",
            "cold CPU ratio",
        ],
        rows,
    )
    print(
        f"\n(r) the same call for a user in 20 rooms of {long_messages:,} messages each (ratios to the user in 1 room)"
    )
    print_table(["engine", "statements", "long rooms ms", "ratio", "long rooms CPU ms", "CPU ratio"], long_rows)


async def main(reactor, args) -> None:
    engines = bench_databases()
    started = time.perf_counter()
    print(
        f"bench/timeline_reads.py: engines {', '.join(e for e, _ in engines)}; load average {load_average()}"
        f" ({os.cpu_count()} cores)",
        flush=True,
    )
    if "p" in args.sections:
        await section_p(engines, args.runs, args.limit)
    if "r" in args.sections:
        await section_r(engines, args.runs, args.rooms, args.long_messages)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average at end {load_average()})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--limit", type=int, default=10, help="page size of (p) (default 10)")
    parser.add_argument("--rooms", type=int, default=2000, help="rooms of the busy user in (r) (default 2000)")
    parser.add_argument(
        "--long-messages",
        type=int,
        default=500,
        help="messages in each of the 20 rooms of the third user of (r) (default 500)",
    )
    parser.add_argument("--sections", default="pr")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be at least 3 (medians)")
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
