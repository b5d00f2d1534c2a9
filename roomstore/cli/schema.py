"""``roomstore init``: create or upgrade the schema, then show where the
store stands (schema version, each stream's positions), which ``demo``
shows first too."""

from __future__ import annotations

from roomstore.cli.common import emit, open_store


def add_parsers(add) -> None:
    """Add the command through the command line's ``add(name, help)``."""
    add("init", "create or upgrade the schema; print schema version and stream positions")


async def cmd_init(reactor, args) -> int:
    """Create or upgrade the schema; print the version and stream positions."""
    store = await open_store(reactor, args, create=True)
    try:
        await report_positions(store)
    finally:
        await store.close()
    return 0


async def report_positions(store) -> None:
    emit({"db": store.describe_database(), "schema_version": store.schema_version})
    for name in store.stream_names:
        stream = store.stream(name)
        emit({"stream": name, "positions": stream.get_positions(), "current": stream.get_current_token()})
