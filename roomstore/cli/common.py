"""What every command of the command line shares: the options each takes
(``--db``, ``--instance``, ``--stream-writers``, ``-v``), opening the store
they name, JSON output and the error a person can fix."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from collections.abc import Iterator
from typing import Any

import attrs

from roomstore.processes import BULK_GC_THRESHOLDS, tune_collector

DEFAULT_DB = "sqlite:///var/roomstore.db"


def emit(obj: Any) -> None:
    """Print ``obj`` as one JSON line on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, ensure_ascii=False) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def bulk_load_gc() -> Iterator[None]:
    """The cyclic garbage collector set for a bulk load (``import``,
    ``import-synapse``), as it was again afterwards.

    A load allocates millions of short-lived objects (rows, parsed events)
    beside long-lived ones (the store's caches). With the default thresholds
    the collector runs every 700 allocations and, every few thousand, walks
    the caches again, though nearly nothing there is garbage: 5-15% of an
    import's time (``docs/benchmarks.md``, issue 42). Here what start-up made
    is frozen out of every collection (``gc.freeze``), and collections come
    far less often; the few reference cycles a load makes (Twisted failures)
    are still collected, a little later. Synapse tunes its collector for the
    same reason (its ``gc_thresholds`` option)."""
    thresholds = gc.get_threshold()
    tune_collector(BULK_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class CliError(Exception):
    """A problem the operator can fix; printed without a traceback."""


def add_common_options(p: argparse.ArgumentParser) -> None:
    """The options every command takes."""
    p.add_argument("--db", default=DEFAULT_DB, help=f"database URL (default {DEFAULT_DB})")
    p.add_argument("--instance", default="master", help="this process's instance name")
    p.add_argument(
        "--stream-writers",
        action="append",
        metavar="STREAM=NAME[,NAME...]",
        help="the writer instances of a stream (repeatable; default: --instance writes every stream)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at info level to stderr")


async def open_store(
    reactor,
    args,
    create: bool = False,
    read_only: bool = False,
    validation_processes: int = 0,
    server_name: str | None = None,
    bulk_writer_process: bool = False,
):
    """The store at ``--db``. Only commands that write (``create=True``)
    create a missing SQLite file: for the others it is a mistyped path.
    ``read_only`` (the read commands): no writer lock, so it runs beside a
    live writer. ``bulk_writer_process``: the writes in a child process of
    their own (``StoreConfig.writer_process``), at this process's priority
    and with the collector set for a bulk load, so that what this process
    does meanwhile (reading another database) takes no turn of the GIL from
    them; not for an in-memory database, which a child cannot open."""
    from roomstore.store import RoomStore, StoreConfig

    writers = stream_writers(args)
    if not read_only:
        check_multi_writer(writers, args)
    config = StoreConfig(
        instance_name=args.instance,
        stream_writers=writers,
        read_only=read_only,
        validation_processes=validation_processes,
        server_name=server_name,
    )
    from roomstore.writer_process.parent import opens_apart

    if bulk_writer_process and not read_only and opens_apart(args.db):
        config = attrs.evolve(
            config,
            writer_process=True,
            writer_process_priority=0,
            writer_process_gc=BULK_GC_THRESHOLDS,
            writer_process_log_level="info" if args.verbose else "warn",
        )
    return await RoomStore.open(args.db, config, reactor=reactor, create=create)


def check_multi_writer(writers: dict[str, list[str]], args) -> None:
    """Several writers of a stream must hear each other: refuse without Redis."""
    shared = {name: names for name, names in writers.items() if len(names) > 1}
    if shared and not getattr(args, "redis", None):
        name, names = next(iter(sorted(shared.items())))
        raise CliError(
            f"stream {name} has writers {','.join(names)}: a multi-writer deployment needs"
            " PostgreSQL and --redis URL, so that writers and readers hear each other"
        )


def stream_writers(args) -> dict[str, list[str]]:
    """``--stream-writers STREAM=NAME[,NAME...]`` (repeatable) as a mapping."""
    writers: dict[str, list[str]] = {}
    for spec in getattr(args, "stream_writers", None) or ():
        stream, sep, names = spec.partition("=")
        listed = [n.strip() for n in names.split(",") if n.strip()]
        if not sep or not stream.strip() or not listed:
            raise CliError(f"--stream-writers {spec!r}: write STREAM=NAME[,NAME...], e.g. events=w1,w2")
        writers[stream.strip()] = listed
    return writers
