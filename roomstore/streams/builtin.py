"""The streams the store writes; their backing tables' owners supply the reads.

- ``events``: every persisted event, by ``events.stream_ordering`` (multi-writer
  capable on PostgreSQL);
- ``backfill``: events fetched from the past, stored with negative
  ``stream_ordering`` and counted here as positive IDs;
- ``caches``: cache invalidations, one row each in ``cache_invalidations``.

The backing tables (with the statements reading their newest IDs) are handed
in by the store (``roomstore/store_opening.py``): the tables' SQL stays in
their owners, which this package may not import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from roomstore.storage.database import Database
from roomstore.streams.id_generators import BackingTable, StreamIdGenerator

#: The built-in streams, by name.
BUILTIN_STREAMS = ("events", "backfill", "caches")


async def open_builtin_generators(
    db: Database,
    instance_name: str,
    backing: Mapping[str, Sequence[BackingTable]],
    writers: Mapping[str, Sequence[str]] | None = None,
    read_only: bool = False,
) -> dict[str, StreamIdGenerator]:
    """One generator per built-in stream, recovered from ``backing`` (stream ->
    its backing tables); ``writers`` maps a stream to its writer instances
    (default: this instance writes every stream). ``read_only``: this process
    writes none of them."""
    writers = writers or {}
    generators = {}
    for name in BUILTIN_STREAMS:
        generators[name] = await StreamIdGenerator.create(
            db,
            name,
            instance_name,
            writers=list(writers.get(name, [instance_name])),
            backing_tables=tuple(backing[name]),
            read_only=read_only,
        )
    return generators
