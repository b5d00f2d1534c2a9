"""The streams the store writes, with the tables that back them.

- ``events``: every persisted event, by ``events.stream_ordering`` (multi-writer
  capable on PostgreSQL);
- ``backfill``: events fetched from the past, stored with negative
  ``stream_ordering`` and counted here as positive IDs;
- ``caches``: cache invalidations, one row each in ``cache_invalidations``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from roomstore.storage.database import Database
from roomstore.streams.id_generators import BackingTable, StreamIdGenerator

BUILTIN_STREAMS: dict[str, tuple[BackingTable, ...]] = {
    "events": (BackingTable("events", "stream_ordering", "instance_name"),),
    "backfill": (BackingTable("events", "stream_ordering", "instance_name", negate=True),),
    "caches": (BackingTable("cache_invalidations", "stream_id", "instance_name"),),
}


async def open_builtin_generators(
    db: Database, instance_name: str, writers: Mapping[str, Sequence[str]] | None = None, read_only: bool = False
) -> dict[str, StreamIdGenerator]:
    """One generator per built-in stream; ``writers`` maps a stream to its
    writer instances (default: this instance writes every stream).
    ``read_only``: this process writes none of them."""
    writers = writers or {}
    generators = {}
    for name, tables in BUILTIN_STREAMS.items():
        generators[name] = await StreamIdGenerator.create(
            db,
            name,
            instance_name,
            writers=list(writers.get(name, [instance_name])),
            backing_tables=tables,
            read_only=read_only,
        )
    return generators
