"""What the look-up of already-stored events costs persist_events, and what it saves.

usage: bench/with-postgres .venv/bin/python bench/persist_precheck.py [--runs R] [--events N]

Since issue 11, ``persist_events`` asks the database which events of a batch
are stored already before it reserves stream IDs (one extra interaction per
batch), so a re-import takes no stream IDs. Side by side in one run, on each
engine: events/s through ``persist_events`` in batches of 100 (a linear room of
N events, fresh database each run) with the look-up as shipped, and with it
short-circuited (the interaction answers "nothing stored" without touching the
database: the code before the change, as far as new events go); and the events
stream's token after importing the same events once and again.
Medians of R runs, the variants alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

from twisted.internet import defer, task

from bench._common import bench_databases, print_table
from roomstore.sample import RoomGraphBuilder
from roomstore.events.persist import EventToPersist
from roomstore.store import RoomStore


def room_events(n: int) -> list[EventToPersist]:
    room = RoomGraphBuilder("!bench:example.org")
    room.create()
    room.join(room.creator)
    while len(room.events) < n:
        room.message(room.creator, f"message {len(room.events)}")
    return [EventToPersist(e.raw, room.version) for e in room.events]


def skip_lookup(store: RoomStore) -> None:
    original = store.db.run_interaction

    def run_interaction(description, fn, *args, **kwargs):
        if description == "persist_events_stored":
            return defer.succeed({})
        return original(description, fn, *args, **kwargs)

    store.db.run_interaction = run_interaction


async def persist_rate(url: str, events: list[EventToPersist], with_lookup: bool) -> float:
    store = await RoomStore.open(url)
    try:
        if not with_lookup:
            skip_lookup(store)
        started = time.perf_counter()
        for start in range(0, len(events), 100):
            await store.persist_events(events[start : start + 100])
        return len(events) / (time.perf_counter() - started)
    finally:
        await store.close()


async def reimport_tokens(url: str, events: list[EventToPersist]) -> tuple[str, str]:
    store = await RoomStore.open(url)
    try:
        tokens = []
        for _ in range(2):
            for start in range(0, len(events), 100):
                await store.persist_events(events[start : start + 100])
            tokens.append(store.get_current_token())
        return tokens[0], tokens[1]
    finally:
        await store.close()


async def main(reactor, argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant (default 5)")
    parser.add_argument("--events", type=int, default=2000, help="events per run (default 2000)")
    args = parser.parse_args(argv)
    events = room_events(args.events)
    rows = []
    for engine, new_url in bench_databases():
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.runs):
            for with_lookup in (True, False):
                rates[with_lookup].append(await persist_rate(new_url(), events, with_lookup))
        with_lookup, without = statistics.median(rates[True]), statistics.median(rates[False])
        first, second = await reimport_tokens(new_url(), events)
        rows.append([engine, with_lookup, without, with_lookup / without, first, second])
    print(f"persist_events, {args.events} events in batches of 100, medians of {args.runs} runs")
    print_table(
        ["engine", "events/s with look-up", "events/s without", "ratio", "token after import", "after re-import"],
        rows,
    )


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1:])))
