"""``roomstore import-synapse`` and ``verify-synapse``: the command line of
``roomstore.synapse_db``. ``roomstore.cli`` registers them."""

from __future__ import annotations

from roomstore.cli.common import CliError, bulk_load_gc, emit, open_store
from roomstore.cli.imports import workers_for


def add_parsers(add) -> None:
    """Add the two commands through the command line's ``add(name, help)``."""
    p = add("import-synapse", "import the rooms of a Synapse database (read only; safe while Synapse runs)")
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="URL",
        help="Synapse's database: sqlite:///path/homeserver.db (or a plain path) or postgresql://...",
    )
    p.add_argument("--rooms", help="comma-separated room IDs to import (default: every room)")
    p.add_argument("--batch-size", type=int, default=1000, help="events persisted per transaction (default 1000)")
    p.add_argument(
        "--trust-source",
        action="store_true",
        help="store the events as Synapse judged them, unchecked against the rooms' authorization rules"
        " (default: checked; an event breaking them is stored rejected and counted)",
    )
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p = add(
        "verify-synapse", "check the store's state and redactions against a Synapse database; exit 1 on a difference"
    )
    p.add_argument(
        "--from", dest="source", required=True, metavar="URL", help="Synapse's database, as for import-synapse"
    )
    p.add_argument("--rooms", help="comma-separated room IDs to check (default: every room)")


def room_selection(spec: str | None) -> list[str] | None:
    """``--rooms``: comma-separated room IDs (None: every room)."""
    if spec is None:
        return None
    rooms = [r.strip() for r in spec.split(",") if r.strip()]
    if not rooms or any(not r.startswith("!") for r in rooms):
        raise CliError(f"--rooms {spec!r}: give comma-separated room IDs, each starting with !")
    return rooms


async def open_synapse(reactor, args):
    from roomstore.synapse_db import SynapseDatabaseError, SynapseReader

    try:
        return await SynapseReader.open(args.source, reactor)
    except SynapseDatabaseError as exc:
        raise CliError(str(exc)) from None


async def cmd_import_synapse(reactor, args) -> int:
    """Import a Synapse database's rooms: one JSON line per skipped event, then the summary."""
    from roomstore.progress import progress_bar
    from roomstore.synapse_db import import_synapse

    rooms = room_selection(args.rooms)
    if args.batch_size < 1:
        raise CliError("--batch-size must be at least 1")
    reader = await open_synapse(reactor, args)
    try:
        total = await reader.run(reader.source.count_events, rooms)
        # The writes in a process of their own: this one reads Synapse's
        # database meanwhile, and its Python would take turns of the GIL
        # from them (12% of the time on SQLite, docs/benchmarks.md).
        store = await open_store(
            reactor, args, create=True, validation_processes=workers_for(total), bulk_writer_process=True
        )
        try:
            bar = progress_bar(total, "import-synapse", "event", force=args.progress)
            with bulk_load_gc():
                summary = await import_synapse(
                    store, reader, rooms, args.batch_size, report=emit, progress=bar, trust_source=args.trust_source
                )
            bar.close()
            emit({**summary.as_json(), "current_token": store.get_current_token()})
        finally:
            await store.close()
    finally:
        await reader.close()
    return 0


async def cmd_verify_synapse(reactor, args) -> int:
    """Compare the store with a Synapse database; exit 1 on any difference."""
    from roomstore.synapse_db import verify_synapse

    rooms = room_selection(args.rooms)
    reader = await open_synapse(reactor, args)
    try:
        store = await open_store(reactor, args, read_only=True)
        try:
            summary = await verify_synapse(store, reader, rooms, report=emit)
            emit(summary.as_json())
        finally:
            await store.close()
    finally:
        await reader.close()
    return 1 if summary.differences else 0
