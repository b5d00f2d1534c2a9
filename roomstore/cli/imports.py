"""``roomstore import``: its options, how many validation worker processes
a file is worth, and the run around the import loop (``import_loop``):
opening the store, announcing the rows on Redis, the summary line, and the
one-line errors of a file, a keys file or a full disk."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from roomstore.cli.common import CliError, bulk_load_gc, emit, open_store
from roomstore.cli.import_loop import import_file
from roomstore.cli.redis_bus import add_redis_tls_options, connect_redis, flush_redis

#: ``import --validation-processes auto``: a worker process from this many
#: lines. It takes about 0.4 s to start: at 10,000 events the import was no
#: faster with one, at 40,000 1.2x (docs/benchmarks.md, ``roomstore import`` timed whole).
AUTO_WORKER_LINES = 20_000


def add_parsers(add) -> None:
    """Add the command through the command line's ``add(name, help)``."""
    p = add("import", "import events from a JSON-lines file")
    p.add_argument("file", help='JSON lines: one event a line, a bare PDU or {"room_version": ..., "event": {...}}')
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=1000,
        metavar="N",
        help="events per persist_events call, stored whole or not at all (default 1000; the store may"
        " commit several in one transaction; a refused batch is retried in halves, then event by event)",
    )
    p.add_argument(
        "--in-flight",
        type=at_least(1),
        default=8,
        metavar="N",
        help="batches handed to the store at once: it validates the next while it writes, and commits"
        " several in one transaction (default 8; 1: one batch at a time)",
    )
    p.add_argument(
        "--validation-processes",
        type=at_least(0, also=("auto",)),
        default="auto",
        metavar="N",
        help="validate events in N worker processes, on other cores; 0: on a thread of this process"
        f" (default auto: 1 for a file of {AUTO_WORKER_LINES:,} lines or more on two cores or more,"
        " else 0; a worker takes about half a second to start)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse an event whose content hash does not match (default: store it redacted);"
        " exit 1 if any event failed",
    )
    p.add_argument(
        "--trust-source",
        action="store_true",
        help="store the events unchecked against their rooms' authorization rules: only for a file from a"
        " server that checked them (default: an event breaking the rules is stored rejected and"
        " reported)",
    )
    p.add_argument(
        "--keys",
        metavar="FILE",
        help='check signatures against these verify keys: a JSON object, server name -> {"ed25519:ID":'
        ' "<unpadded base64 public key>"} (or the server\'s /_matrix/key/v2/server response);'
        " a bad signature refuses the event; without it signatures are not checked",
    )
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p.add_argument(
        "--redis",
        help="announce the imported rows on this Redis (redis://[:PASSWORD@]host:port;"
        " rediss:// for TLS) to live followers",
    )
    p.add_argument("--server-name", default="localhost", help="the homeserver's name: the Redis channel")
    add_redis_tls_options(p)


def at_least(least: int, also: tuple[str, ...] = ()) -> Callable[[str], int | str]:
    """An argparse type: an integer no smaller than ``least`` (or one of the words ``also``)."""

    def parse(text: str) -> int | str:
        if text in also:
            return text
        try:
            value = int(text)
        except ValueError:
            words = "".join(f" or {word}" for word in also)
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{words}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}: give {least} or more")
        return value

    return parse


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_validation_processes(path: str) -> int:
    """``workers_for`` a file's lines (counted up to ``AUTO_WORKER_LINES``)."""
    if usable_cores() < 2:
        return 0
    lines = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            lines += chunk.count(b"\n")
            if lines >= AUTO_WORKER_LINES:
                break
    return workers_for(lines)


def workers_for(events: int) -> int:
    """Validation worker processes for an import of ``events``: 1 from
    ``AUTO_WORKER_LINES`` where this process may use two cores or more, else 0."""
    return 1 if events >= AUTO_WORKER_LINES and usable_cores() >= 2 else 0


def _verify_keys(args):
    """The verify keys of ``--keys`` (None without it: signatures are not checked)."""
    if not args.keys:
        return None
    from roomstore.pdu.signatures import KeysFileError, load_verify_keys

    try:
        return load_verify_keys(args.keys)
    except (OSError, KeysFileError) as exc:
        raise CliError(f"--keys: {exc}") from None


async def cmd_import(reactor, args) -> int:
    if not os.path.exists(args.file):
        raise CliError(f"no such file: {args.file}")
    if os.path.isdir(args.file):
        raise CliError(f"{args.file} is a directory: give a JSON-lines file")
    verify_keys = _verify_keys(args)
    from roomstore.storage import StorageFullError

    try:
        processes = args.validation_processes
        if processes == "auto":
            processes = auto_validation_processes(args.file)
        store = await open_store(reactor, args, create=True, validation_processes=processes)
    except StorageFullError as exc:
        raise CliError(f"{exc}: free space and run it again") from None
    redis = None
    summary: dict = {}
    try:
        if args.redis:
            redis = await connect_redis(reactor, store, args)
        started = time.monotonic()
        try:
            with bulk_load_gc():
                await import_file(
                    store,
                    args.file,
                    args.batch_size,
                    args.progress,
                    args.strict,
                    verify_keys,
                    summary,
                    in_flight=args.in_flight,
                    trust_source=args.trust_source,
                )
        except StorageFullError as exc:
            # What committed stays (each batch is one transaction); the same
            # import run again skips it as already present.
            emit(dict(summary, complete=False))
            raise CliError(
                f"stopped at line {summary.get('next_line')}: {exc}; {summary['imported']} events"
                " were imported before it and are stored: free space and run the same import again"
                " (what is stored is skipped)"
            ) from None
        if redis is not None:
            await flush_redis(reactor, redis, args)
        summary["seconds"] = round(time.monotonic() - started, 3)
        summary["current_token"] = store.get_current_token()
        emit(summary)
    finally:
        if redis is not None:
            await redis.stop()
        await store.close()
    return 1 if summary["failed"] and args.strict else 0
