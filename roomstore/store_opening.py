"""Opening a store's database: the writer lock, the schema, the streams.

``RoomStore.open`` calls :func:`open_database` and builds the store's
objects on what it returns. Kept apart from the store's face because it is
its own concern: the order of taking the lock, migrating and recovering
stream positions, and leaving nothing held when any step fails.
"""

from __future__ import annotations

from typing import Any

import attrs

from roomstore.events.caches import NEWEST_CACHE_STREAM_IDS
from roomstore.events.tables.events import NEWEST_BACKFILL_STREAM_IDS, NEWEST_LIVE_STREAM_IDS
from roomstore.storage.database import Database
from roomstore.storage.writer_lock import WriterLock
from roomstore.store_config import StoreConfig
from roomstore.streams.builtin import open_builtin_generators
from roomstore.streams.id_generators import BackingTable

#: The built-in streams' backing tables, each with its owner's statement for the newest IDs.
BUILTIN_BACKING = {
    "events": (BackingTable("events", "stream_ordering", "instance_name", newest_ids_sql=NEWEST_LIVE_STREAM_IDS),),
    "backfill": (
        BackingTable(
            "events", "stream_ordering", "instance_name", negate=True, newest_ids_sql=NEWEST_BACKFILL_STREAM_IDS
        ),
    ),
    "caches": (
        BackingTable("cache_invalidations", "stream_id", "instance_name", newest_ids_sql=NEWEST_CACHE_STREAM_IDS),
    ),
}


@attrs.frozen
class OpenedDatabase:
    """A database ready for a store: ``owns_db`` (the store closes it),
    the ``writer_lock`` a writing store holds (None otherwise), the
    ``schema_version`` it is at, and the built-in stream generators."""

    db: Database
    owns_db: bool
    writer_lock: WriterLock | None
    schema_version: int
    generators: dict[str, Any]


async def open_database(database: str | Database, config: StoreConfig, reactor: Any, create: bool) -> OpenedDatabase:
    """Connect (a URL) or take ``database``; for a writing store take the
    instance's writer lock first (recovery assumes no other live process is
    this instance); create or migrate the schema (a read-only store only
    checks it); recover the stream positions. On any failure the lock is
    released and a database opened here closed."""
    if isinstance(database, str):
        # A read-only store's connections cannot write: it never creates
        # or migrates the schema, and refuses a database without one.
        db = Database.from_url(database, reactor, create and not config.read_only, read_only=config.read_only)
        owns_db = True
    else:
        db, owns_db = database, False
    writer_lock = None
    try:
        if config.writes_anything():
            writer_lock = await WriterLock.acquire(db, config.instance_name)
        if config.read_only:
            version = await db.check_schema(config.embedder_schemas)
        else:
            version = await db.prepare(embedder_schemas=config.embedder_schemas)
        generators = await open_builtin_generators(
            db, config.instance_name, BUILTIN_BACKING, config.stream_writers, read_only=config.read_only
        )
    except BaseException:
        if writer_lock is not None:
            await writer_lock.release()
        if owns_db:
            await db.close()
        raise
    return OpenedDatabase(db, owns_db, writer_lock, version, dict(generators))
