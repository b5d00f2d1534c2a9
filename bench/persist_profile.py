"""Where ``persist_events`` spends its CPU: cProfile of the reactor thread and,
apart, of the validator's thread (``prepare_events``) and of the database
threads (every interaction of the timed batches).

usage: bench/with-postgres .venv/bin/python bench/persist_profile.py [--events N] [--top K] [--engines sqlite,postgres]

The workload is bench/event_store.py's section (a) (a linear room, batches
of 100). The reactor thread's profile includes its waits (``poll``); the
database threads' profile is the interactions' functions run inside a
profiler enabled on the pool thread for each interaction. Also measures an
older checkout when copied into its bench/ and run there (it puts its own
checkout first on sys.path): it only uses ``RoomStore`` and
``Database._run_in_thread``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from twisted.internet import defer, task

from bench._common import bench_databases
from bench.event_store import BATCH, persist_workload
from roomstore.storage.interning import chunks
from roomstore.store import RoomStore


def _per_thread_profiled(fn, profilers: list, lock: threading.Lock):
    """``fn`` run under a profiler of the calling thread's own (each new one added to ``profilers``)."""
    local = threading.local()

    def profiled(*args, **kwargs):
        profiler = getattr(local, "profiler", None)
        if profiler is None:
            profiler = local.profiler = cProfile.Profile()
            with lock:
                profilers.append(profiler)
        profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.disable()

    return profiled


def _profiled_pool(db, profilers: list, lock: threading.Lock) -> None:
    """Every interaction of ``db`` from now on runs under a per-thread profiler."""
    db._run_in_thread = _per_thread_profiled(db._run_in_thread, profilers, lock)


def _profiled_validation(profilers: list, lock: threading.Lock) -> None:
    """``prepare_events`` on the validator's thread from now on runs under a profiler (absent in old checkouts)."""
    try:
        from roomstore.events import pipeline
    except ImportError:
        return
    pipeline.prepare_events = _per_thread_profiled(pipeline.prepare_events, profilers, lock)


def _merged(profilers: list):
    stats = None
    for profiler in profilers:
        if stats is None:
            stats = pstats.Stats(profiler, stream=io.StringIO())
        else:
            stats.add(profiler)
    return stats


def _top(profiler_or_stats, top: int, sort: str) -> str:
    out = io.StringIO()
    stats = (
        profiler_or_stats
        if isinstance(profiler_or_stats, pstats.Stats)
        else pstats.Stats(profiler_or_stats, stream=out)
    )
    stats.stream = out
    stats.sort_stats(sort).print_stats(top)
    text = out.getvalue()
    # Keep the table only (drop the header lines pstats prints first).
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text


async def profile_engine(engine: str, url: str, events, setup, top: int) -> None:
    store = await RoomStore.open(url)
    try:
        await store.persist_events(setup)
        profilers: list = []
        validation_profilers: list = []
        _profiled_pool(store.db, profilers, threading.Lock())
        _profiled_validation(validation_profilers, threading.Lock())
        reactor_profiler = cProfile.Profile()
        cpu0, start = time.process_time(), time.perf_counter()
        reactor_profiler.enable()
        for part in chunks(events, BATCH):
            await store.persist_events(part)
        reactor_profiler.disable()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    finally:
        await store.close()
    print(
        f"\n=== {engine}: {len(events):,} events, {len(events) / wall:,.0f} events/s under the profilers"
        f" (wall {wall:.2f} s, process CPU {cpu:.2f} s)"
    )
    print(f"--- reactor thread, by own time (top {top})")
    print(_top(reactor_profiler, top, "tottime"))
    print(f"--- reactor thread, by cumulative time (top {top})")
    print(_top(reactor_profiler, top, "cumulative"))
    validation = _merged(validation_profilers)
    if validation is not None:
        print(f"--- validator's thread, by own time (top {top})")
        print(_top(validation, top, "tottime"))
    stats = _merged(profilers)
    if stats is not None:
        print(f"--- database threads, by own time (top {top})")
        print(_top(stats, top, "tottime"))
        print(f"--- database threads, by cumulative time (top {top})")
        print(_top(stats, top, "cumulative"))


async def main(reactor, args) -> None:
    import roomstore

    print(f"persist_profile: roomstore from {os.path.dirname(roomstore.__file__)}")
    _room, setup, events = persist_workload(args.events)
    wanted = set(args.engines.split(","))
    for engine, new_url in bench_databases():
        if engine in wanted:
            await profile_engine(engine, new_url(), events, setup, args.top)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2_000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--engines", default="sqlite,postgres")
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
