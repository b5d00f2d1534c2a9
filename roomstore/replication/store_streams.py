"""The store's streams as replication serves them (stream sources over a ``RoomStore``).

Server side: ``EventsStream``, ``BackfillStream`` and ``CachesStream``
implement the protocol's ``Stream`` over a ``RoomStore``: tokens and writers
come from the store's streams (``RoomStore.stream``), rows from its stream
reads (``get_updates`` reads the rows between two tokens, in bounded pages,
never splitting a token). The events and backfill streams read their pages
in the rows' layout (``RoomStore.read_events_stream_rows`` and
``read_backfill_stream_rows``, one statement a page), and the server's pages
as the rows' JSON text, written from the fields with no Python object per
row but the text (``get_encoded_updates``); the caches stream reads fields
(``read_caches_stream``) and is encoded by ``Stream``'s default.
``store_stream_registry(store)`` registers all three; ``wire_server`` tells a
server factory whenever one of them advances.

The worker side, which applies these rows to a worker's store, is
:mod:`.store_handler`.

Rows are Synapse's (matrix-synapse 1.163, ``synapse.replication.tcp.streams``;
``tests/replication/test_interop.py`` parses every row with its parsers):

- events: ``["ev", [event_id, room_id, type, state_key, redacts, relates_to,
  membership, rejected, outlier]]`` for every event (``redacts``: the event a
  stored redaction redacts; ``membership``: ``join``/``leave``/... for member
  events; ``relates_to`` is always null: the store keeps no relations
  table), and ``["state", [room_id, type, state_key, event_id or null]]`` for
  every current-state change. A token's ``ev`` row comes before its ``state``
  rows; state rows sit at the token of the newest event of their room in the
  batch. A worker also accepts Synapse's ``["state-all", [room_id]]``.
- backfill: ``[event_id, room_id, type, state_key, redacts, relates_to]``;
  tokens are the positive form of the negative stream orderings (the first
  backfilled event is token 1).
- caches: ``[cache_func, keys or null, invalidation_ts]``; all the rows of one
  batch share one token. A row whose line would pass the line limit is split
  by ``CachesStream.split_row`` into rows with fewer keys, at the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.logger import Logger

from roomstore.replication.stream_interface import RdataText, Stream, StreamRegistry, StreamUpdates
from roomstore.store import RoomStore

__all__ = [
    "STORE_STREAMS",
    "BackfillStream",
    "CachesStream",
    "EventsStream",
    "store_stream_registry",
    "wire_server",
]

log = Logger()

#: The streams a store writes, in the order a server answers REPLICATE.
STORE_STREAMS = ("events", "backfill", "caches")


def _whole_token_page(updates: list[tuple], limit: int, upto: int, bound: int, more: bool) -> StreamUpdates:
    """Cut ``updates`` (every row with a token in ``(from, bound]``, sorted) to
    at most ``limit`` rows without splitting a token, per the ``Stream`` contract.

    ``more``: rows exist after ``bound`` (up to ``upto``). A first token with
    more than ``limit`` rows is returned whole.
    """
    if len(updates) <= limit:
        if more:
            return StreamUpdates(updates, bound, True)
        return StreamUpdates(updates, upto, False)
    cut = limit
    last = updates[cut - 1][0]
    if updates[cut][0] == last:
        # The cut would split `last`: end the page before it, or, if it is
        # the first token, after all of it.
        while cut > 0 and updates[cut - 1][0] == last:
            cut -= 1
        if cut == 0:
            while cut < len(updates) and updates[cut][0] == last:
                cut += 1
    page = updates[:cut]
    if cut == len(updates) and not more:
        return StreamUpdates(page, upto, False)
    return StreamUpdates(page, page[-1][0], True)


class _GeneratorStream(Stream):
    """A stream whose writers and tokens are one of the store's streams.

    ``get_updates`` reads one consistent snapshot (one transaction) and honours
    the whole contract of ``Stream.get_updates``: token order, at most
    ``limit`` rows unless one token holds more, ``limited`` exactly when rows
    in the range were left out.
    """

    def __init__(self, store: RoomStore, name: str):
        self.store = store
        self.name = name
        self._positions = store.stream(name)

    def writers(self) -> Sequence[str]:
        return list(self._positions.writers)

    def current_token(self, instance_name: str) -> int:
        return self._positions.get_current_token_for_writer(instance_name)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int) -> StreamUpdates:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if from_token >= upto_token:
            return StreamUpdates([], upto_token, False)
        return await self._page(instance_name, from_token, upto_token, limit)

    async def _page(self, instance: str, from_token: int, upto: int, limit: int) -> StreamUpdates:
        raise NotImplementedError


class _EventRowsStream(_GeneratorStream):
    """A stream whose pages the store reads in Synapse's layout, as rows or
    as their JSON text (``read_rows``: the store's
    ``read_*_stream_rows``): the server sends a page's text as it came."""

    async def read_rows(self, instance: str, from_token: int, upto: int, limit: int, encoded: bool):
        raise NotImplementedError

    async def get_encoded_updates(
        self, instance_name: str, from_token: int, upto_token: int, limit: int
    ) -> StreamUpdates:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if from_token >= upto_token:
            return StreamUpdates([], upto_token, False)
        return await self._page(instance_name, from_token, upto_token, limit, True)

    async def get_rdata_page(
        self, instance_name: str, from_token: int, upto_token: int, limit: int, prefix: str
    ) -> StreamUpdates:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if from_token >= upto_token:
            return StreamUpdates([], upto_token, False)
        page = await self.store.read_stream_lines(self.name, instance_name, from_token, upto_token, limit, prefix)
        if page is None:  # PostgreSQL, or characters SQLite leaves as they are
            return await self._page(instance_name, from_token, upto_token, limit, True)
        lines, upto, limited = page
        return StreamUpdates(RdataText(*lines) if lines[1] else [], upto, limited)

    async def _page(self, instance, from_token, upto, limit, encoded=False):
        rows, more = await self.read_rows(instance, from_token, upto, limit, encoded)
        # State rows can push a page of events over `limit`: cut it on a
        # token boundary (a page that is `more` ends with its last event's token).
        return _whole_token_page(rows, limit, upto, rows[-1][0] if more else upto, more)


class EventsStream(_EventRowsStream):
    """Events in arrival order, with the current-state changes they made."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "events")
        self.read_rows = store.read_events_stream_rows


class BackfillStream(_EventRowsStream):
    """Backfilled events; stored with negative stream orderings, sent positive."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "backfill")
        self.read_rows = store.read_backfill_stream_rows


class CachesStream(_GeneratorStream):
    """Cache invalidations; several rows may share one stream ID."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "caches")

    async def _page(self, instance, from_token, upto, limit):
        rows, more = await self.store.read_caches_stream(instance, from_token, upto, limit)
        updates = [(sid, (name, keys, ts)) for sid, name, keys, ts in rows]
        if more:
            return StreamUpdates(updates, updates[-1][0], True)
        return StreamUpdates(updates, upto, False)

    def split_row(self, row: tuple, fits: Callable[[tuple], bool]) -> list[tuple] | None:
        """Split an invalidation into rows of the same cache and timestamp
        whose keys together are the row's keys, each accepted by ``fits``
        (the feed's line-length check), or None if one key alone is too long.

        Greedy: as many keys per row as fit, so a big invalidation costs
        about its size in bytes divided by the line limit.
        """
        cache_name, keys, ts = row
        if not keys:
            return None
        parts: list[tuple] = []
        start = 0
        while start < len(keys):
            if not fits((cache_name, keys[start : start + 1], ts)):
                return None
            # Largest end with keys[start:end] fitting: double, then bisect.
            good, step = start + 1, 1
            while good < len(keys) and fits((cache_name, keys[start : min(good + step, len(keys))], ts)):
                good = min(good + step, len(keys))
                step *= 2
            bad = min(good + step, len(keys) + 1)
            while bad - good > 1:
                middle = (good + bad) // 2
                if fits((cache_name, keys[start:middle], ts)):
                    good = middle
                else:
                    bad = middle
            parts.append((cache_name, keys[start:good], ts))
            start = good
        return parts


def store_stream_registry(store: RoomStore) -> StreamRegistry:
    """``events``, ``backfill`` and ``caches`` over ``store``, in that order."""
    registry = StreamRegistry()
    for stream in (EventsStream(store), BackfillStream(store), CachesStream(store)):
        registry.register(stream)
    return registry


def wire_server(store: RoomStore, notify: Callable[[str], None]) -> Callable[[], None]:
    """Call ``notify(stream_name)`` whenever one of ``store``'s streams
    advances (e.g. with a server factory's ``notify_new_rows``); returns a
    function that stops it.

    It watches the ID generators' positions rather than the store's commit
    hooks: a position moves only once what is at or below it has committed,
    which is when a worker can be sent it; the store runs its hooks before
    its IDs complete (so local readers find caches updated first), and not
    at all for ``invalidate_cache`` or a failed batch, whose IDs complete
    with no rows.
    """
    watching = [True]

    def watch(name: str, positions: Any, writer: str) -> None:
        def moved(position: int) -> None:
            if not watching[0]:
                return
            try:
                notify(name)
            except Exception:
                log.failure("replication notification for {stream} failed", stream=name)
            arm(position)

        def arm(position: int) -> None:
            positions.wait_for_position(position + 1, writer).addCallback(moved)

        arm(positions.get_current_token_for_writer(writer))

    for name in STORE_STREAMS:
        positions = store.stream(name)
        for writer in positions.writers:
            watch(name, positions, writer)

    def stop() -> None:
        watching[0] = False

    return stop
