"""The store's streams as replication sees them, and a worker that applies them.

Server side: ``EventsStream``, ``BackfillStream`` and ``CachesStream``
implement the protocol's ``Stream`` over a ``RoomStore``: tokens and writers
come from the store's ID generators, rows from its tables (``get_updates``
reads the rows between two tokens, in bounded pages, never splitting a token).
``store_stream_registry(store)`` registers all three; ``wire_server`` tells a
server factory whenever a batch commits.

Worker side: ``StoreReplicationHandler`` feeds what arrives into the worker's
own ``RoomStore``: it advances the ID generators (``advance``), updates the
change caches and drops the cache entries named by the rows, so the worker's
reads see what the writer persisted.

Rows (JSON arrays on the wire):
- events: ``["ev", event_id, room_id, type, state_key, redacts, membership, sender]`` for every event, and
  ``["state", room_id, type, state_key, event_id or null]`` for every current-state change;
- backfill: ``["ev", ...]`` as above, tokens are the positive form of the
  negative stream orderings;
- caches: ``[cache_name, keys or null, invalidation_ts]``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from twisted.logger import Logger

from roomstore.events.persist import CURRENT_STATE_CACHE, EVENT_CACHE, ROOMS_FOR_USER_CACHE, BatchOutcome
from roomstore.replication.client import ReplicationClientHandler
from roomstore.replication.streams import Stream, StreamRegistry, StreamUpdates
from roomstore.store import RoomStore
from roomstore.storage.database import Transaction
from roomstore.visibility.rules import MEMBERSHIP_BY_CODE

log = Logger()

EVENT_ROW_SQL = """
SELECT {token}, i.event_id, r.room_id, e.type, k.state_key, red_i.event_id, m.membership, u.user_id
FROM events AS e
JOIN event_ids AS i ON i.event_nid = e.event_nid
JOIN rooms AS r ON r.room_nid = e.room_nid
JOIN users AS u ON u.user_nid = e.sender_nid
LEFT JOIN state_keys AS k ON k.type_key_nid = e.type_key_nid
LEFT JOIN redactions AS red ON red.redaction_event_nid = e.event_nid
LEFT JOIN event_ids AS red_i ON red_i.event_nid = red.redacts_event_nid
LEFT JOIN room_memberships AS m ON m.event_nid = e.event_nid
WHERE e.instance_name = ? AND {range}
ORDER BY {token}
LIMIT ?
"""


def _event_row(row: tuple) -> tuple[int, tuple]:
    token, event_id, room_id, event_type, state_key, redacts, membership, sender = row
    name = MEMBERSHIP_BY_CODE.get(membership) if membership is not None else None
    return token, ("ev", event_id, room_id, event_type, state_key, redacts, name, sender)


class _GeneratorStream(Stream):
    """A stream whose writers and tokens are one of the store's ID generators."""

    def __init__(self, store: RoomStore, name: str, generator_name: str):
        self.store = store
        self.name = name
        self._generator = store.generators[generator_name]

    def writers(self) -> Sequence[str]:
        return list(self._generator.writers)

    def current_token(self, instance_name: str) -> int:
        return self._generator.get_current_token_for_writer(instance_name)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int) -> StreamUpdates:
        if from_token >= upto_token:
            return StreamUpdates([], upto_token, False)
        return await self.store.db.run_interaction(
            f"replication_{self.name}", self._updates_txn, instance_name, from_token, upto_token, limit
        )

    def _updates_txn(self, txn: Transaction, instance: str, from_token: int, upto: int, limit: int) -> StreamUpdates:
        raise NotImplementedError


class EventsStream(_GeneratorStream):
    """Events in arrival order, with the current-state changes they made."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "events", "events")

    def _updates_txn(self, txn, instance, from_token, upto, limit):
        rows = txn.execute(
            EVENT_ROW_SQL.format(token="e.stream_ordering", range="e.stream_ordering > ? AND e.stream_ordering <= ?"),
            (instance, from_token, upto, limit),
        ).fetchall()
        # One event per stream ordering, so a full page ends on a whole token.
        limited = len(rows) >= limit
        upto_token = rows[-1][0] if limited else upto
        updates = [_event_row(r) for r in rows]
        state_rows = txn.execute(
            "SELECT d.stream_ordering, r.room_id, k.type, k.state_key, i.event_id"
            " FROM current_state_deltas AS d JOIN rooms AS r ON r.room_nid = d.room_nid"
            " JOIN state_keys AS k ON k.type_key_nid = d.type_key_nid"
            " LEFT JOIN event_ids AS i ON i.event_nid = d.event_nid"
            " WHERE d.instance_name = ? AND d.stream_ordering > ? AND d.stream_ordering <= ?"
            " ORDER BY d.stream_ordering, k.type, k.state_key",
            (instance, from_token, upto_token),
        ).fetchall()
        updates.extend((token, ("state", room, typ, key, event)) for token, room, typ, key, event in state_rows)
        updates.sort(key=lambda u: (u[0], u[1][0] != "ev"))  # stable: an event before its state rows
        return StreamUpdates(updates, upto_token, limited)


class BackfillStream(_GeneratorStream):
    """Backfilled events; stored with negative stream orderings, sent positive."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "backfill", "backfill")

    def _updates_txn(self, txn, instance, from_token, upto, limit):
        rows = txn.execute(
            EVENT_ROW_SQL.format(token="-e.stream_ordering", range="-e.stream_ordering > ? AND -e.stream_ordering <= ?"),
            (instance, from_token, upto, limit),
        ).fetchall()
        limited = len(rows) >= limit
        return StreamUpdates([_event_row(r) for r in rows], rows[-1][0] if limited else upto, limited)


class CachesStream(_GeneratorStream):
    """Cache invalidations; several rows may share one stream ID."""

    def __init__(self, store: RoomStore):
        super().__init__(store, "caches", "caches")

    def _updates_txn(self, txn, instance, from_token, upto, limit):
        # Page on whole tokens: the first `limit` distinct stream IDs.
        tokens = [r[0] for r in txn.execute(
            "SELECT DISTINCT stream_id FROM cache_invalidations WHERE instance_name = ?"
            " AND stream_id > ? AND stream_id <= ? ORDER BY stream_id LIMIT ?",
            (instance, from_token, upto, limit),
        ).fetchall()]
        limited = len(tokens) >= limit
        upto_token = tokens[-1] if limited else upto
        rows = txn.execute(
            "SELECT stream_id, cache_name, keys, invalidation_ts FROM cache_invalidations"
            " WHERE instance_name = ? AND stream_id > ? AND stream_id <= ? ORDER BY stream_id, cache_name, keys",
            (instance, from_token, upto_token),
        ).fetchall()
        updates = [(sid, (name, None if keys is None else json.loads(keys), ts)) for sid, name, keys, ts in rows]
        return StreamUpdates(updates, upto_token, limited)


def store_stream_registry(store: RoomStore) -> StreamRegistry:
    registry = StreamRegistry()
    for stream in (EventsStream(store), BackfillStream(store), CachesStream(store)):
        registry.register(stream)
    return registry


def wire_server(store: RoomStore, notify: Callable[[str], None]) -> None:
    """Call ``notify(stream_name)`` after each committed batch (e.g. a server
    factory's ``notify_new_rows``)."""

    def after_batch(outcome: BatchOutcome) -> None:
        for name in ("events", "backfill", "caches"):
            notify(name)

    store.add_invalidation_hook(after_batch)


class StoreReplicationHandler(ReplicationClientHandler):
    """Applies replicated rows to a worker's ``RoomStore``.

    ``on_applied(stream, instance, token, rows)``, if given, is called after
    each applied token (the ``follow`` command logs it; tests count rows).
    Homeserver code registers handlers for its own cache names with
    ``add_cache_handler``.
    """

    def __init__(self, store: RoomStore, on_applied: Callable[..., Any] | None = None):
        super().__init__(store_stream_registry(store))
        self.store = store
        self.on_applied = on_applied
        self._cache_handlers: dict[str, list[Callable[[list | None], None]]] = {}

    def add_cache_handler(self, cache_name: str, handler: Callable[[list | None], None]) -> None:
        self._cache_handlers.setdefault(cache_name, []).append(handler)

    def on_rdata(self, stream_name: str, instance_name: str, token: int, rows: list[Any]) -> None:
        if stream_name == "events":
            self._apply_events(token, rows)
        elif stream_name == "caches":
            for row in rows:
                self._apply_invalidation(row[0], row[1])
        elif stream_name != "backfill":
            return
        self._advance(stream_name, instance_name, token)
        if self.on_applied is not None:
            self.on_applied(stream_name, instance_name, token, rows)

    def on_position(self, stream_name: str, instance_name: str, prev_token: int, new_token: int) -> None:
        if stream_name in ("events", "backfill", "caches"):
            self._advance(stream_name, instance_name, new_token)

    def _advance(self, stream_name: str, instance_name: str, token: int) -> None:
        self.store.generators[stream_name].advance(instance_name, token)

    def _apply_events(self, token: int, rows: list) -> None:
        reader = self.store.reader
        for row in rows:
            kind = row[0]
            if kind == "ev":
                _, event_id, room_id, event_type, state_key, redacts, membership, sender = row
                self.store.room_changes.entity_has_changed(room_id, token)
                if event_type == "m.room.member" and state_key is not None:
                    self.store.membership_changes.entity_has_changed(state_key, token)
                    reader.invalidate_memberships((), [state_key])
                if redacts:
                    reader.invalidate_event(redacts)
            elif kind == "state":
                _, room_id, event_type, state_key, event_id = row
                if event_type == "m.room.member":
                    reader.invalidate_memberships((), [state_key])

    def _apply_invalidation(self, cache_name: str, keys: list | None) -> None:
        reader = self.store.reader
        if cache_name == EVENT_CACHE:
            if keys is None:
                reader.invalidate_all()
            else:
                for event_id in keys:
                    reader.invalidate_event(event_id)
        elif cache_name == ROOMS_FOR_USER_CACHE:
            reader.invalidate_memberships((), keys or []) if keys is not None else reader.invalidate_all()
        elif cache_name == CURRENT_STATE_CACHE:
            reader.invalidate_memberships(keys or [], ())
        for handler in self._cache_handlers.get(cache_name, ()):
            handler(keys)
