"""What persist_events' precheck costs, and what it saves.

usage: bench/with-postgres .venv/bin/python bench/persist_precheck.py [--runs R] [--events N]

Since issue 11, ``persist_events`` runs one interaction before it reserves
stream IDs: it finds the events of a batch stored already, and the batches
the write would refuse whatever IDs it is given (conflicted or underivable
state: cheap reads, then a trial run of the write, undone, for a batch with a
merge, a fork or a missing prev event). Side by side in one run, on each
engine, three variants of that interaction: as shipped ("precheck"); the
stored-events look-up alone ("look-up only", the first fix); and none at all
("none": it answers "nothing stored" without touching the database, the code
before issue 11 as far as new events go). Two workloads: a linear room of N
events in batches of 100 (fresh database each run), and the bundled sample
imported with the importer (forks, merges and its two refused events; each
failing batch is retried event by event). Events/s, medians of R runs, the
variants alternating; and the events stream's token after importing the
bundled sample once and again, per variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

from twisted.internet import defer, task

from bench._common import bench_databases, print_table
from roomstore.cli.demo import SAMPLE_PATH
from roomstore.cli.import_loop import import_file
from roomstore.demo.sample import RoomGraphBuilder
from roomstore.events import precheck
from roomstore.events.write.persist import EventToPersist
from roomstore.events.write.precheck import stored_results_txn
from roomstore.store import RoomStore

VARIANTS = ("precheck", "look-up only", "none")


def room_events(n: int) -> list[EventToPersist]:
    room = RoomGraphBuilder("!bench:example.org")
    room.create()
    room.join(room.creator)
    while len(room.events) < n:
        room.message(room.creator, f"message {len(room.events)}")
    return [EventToPersist(e.raw, room.version) for e in room.events]


def use_variant(store: RoomStore, variant: str) -> None:
    if variant == "none":
        store.writes.precheck = lambda txn, persister, events, resolved: {}
    elif variant == "look-up only":
        store.writes.precheck = lambda txn, persister, events, resolved: stored_results_txn(
            txn, persister.interners, events
        )


async def persist_rate(url: str, events: list[EventToPersist], variant: str) -> float:
    store = await RoomStore.open(url)
    try:
        use_variant(store, variant)
        started = time.perf_counter()
        for start in range(0, len(events), 100):
            await store.persist_events(events[start : start + 100])
        return len(events) / (time.perf_counter() - started)
    finally:
        await store.close()


async def import_rate(url: str, variant: str) -> float:
    store = await RoomStore.open(url)
    try:
        use_variant(store, variant)
        started = time.perf_counter()
        summary = await import_file(store, SAMPLE_PATH)
        return (summary["imported"] + summary["failed"]) / (time.perf_counter() - started)
    finally:
        await store.close()


async def reimport_tokens(url: str, variant: str) -> tuple[str, str]:
    store = await RoomStore.open(url)
    try:
        use_variant(store, variant)
        tokens = []
        for _ in range(2):
            await import_file(store, SAMPLE_PATH)
            tokens.append(store.get_current_token())
        return tokens[0], tokens[1]
    finally:
        await store.close()


class TrialCounter:
    """Counts the batches ``precheck_txn`` gives a trial run."""

    def __init__(self):
        self.batches = self.trials = 0
        self._may_fail = precheck.may_fail_txn
        precheck.may_fail_txn = self

    def __call__(self, *args):
        self.batches += 1
        risky = self._may_fail(*args)
        self.trials += risky
        return risky


async def main(reactor, argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant (default 5)")
    parser.add_argument("--events", type=int, default=2000, help="events per run (default 2000)")
    args = parser.parse_args(argv)
    events = room_events(args.events)
    # The importer's one-line reports of the sample's refused events: not wanted here.
    from roomstore.cli import import_loop

    import_loop.emit = lambda obj: None
    rows, token_rows = [], []
    for engine, new_url in bench_databases():
        for workload in ("linear", "sample"):
            rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.runs):
                for variant in VARIANTS:
                    if workload == "linear":
                        rate = await persist_rate(new_url(), events, variant)
                    else:
                        rate = await import_rate(new_url(), variant)
                    rates[variant].append(rate)
            medians = [statistics.median(rates[v]) for v in VARIANTS]
            rows.append([engine, workload, *medians, medians[0] / medians[1], medians[0] / medians[2]])
        for variant in VARIANTS:
            token_rows.append([engine, variant, *await reimport_tokens(new_url(), variant)])
        counter = TrialCounter()
        store = await RoomStore.open(new_url())
        try:
            await import_file(store, SAMPLE_PATH)
        finally:
            await store.close()
            precheck.may_fail_txn = counter._may_fail
        trials = f"{counter.trials} of {counter.batches} prechecked batches"
    print(
        f"events/s through persist_events: linear room of {args.events} events in batches of 100;"
        f" the bundled sample through the importer. Medians of {args.runs} runs"
    )
    print_table(
        ["engine", "workload", *VARIANTS, "precheck/look-up only", "precheck/none"],
        rows,
    )
    print(f"\nimporting the bundled sample had a trial run in {trials} (last engine)\n")
    print_table(["engine", "variant", "token after import", "after re-import"], token_rows)


if __name__ == "__main__":
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, sys.argv[1:])))
