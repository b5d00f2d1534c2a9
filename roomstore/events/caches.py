"""The store's caches: their names, what a batch invalidates, and how an
invalidation is applied.

One place answers "which cache entries does this change drop?":

* ``batch_invalidations`` turns a committed batch into the caches-stream
  rows every other process applies (cache name, keys), and
  ``write_cache_invalidations`` writes them (``cache_invalidations``) in the
  batch's own transaction;
* ``StoreCaches`` applies changes to one process's caches: the event
  reader's (parsed events, each user's joined rooms) and the change caches
  (which rooms and users changed since a position). The writer applies a
  batch with ``batch_committed`` (the same rows the others get, plus its
  change-cache positions); a worker applies what replication brings with the
  same methods (``roomstore.replication.store_handler``; the store never
  imports replication).

Cache names are Synapse's, as they cross the wire in the caches stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from roomstore.events.read.event_reader import EventReader
from roomstore.storage.database import Transaction
from roomstore.storage.interning import LruCache
from roomstore.streams.change_cache import StreamChangeCache

__all__ = [
    "CURRENT_STATE_CACHE",
    "EVENT_CACHE",
    "HISTORY_PURGED",
    "ROOM_PURGED",
    "ROOMS_FOR_USER_CACHE",
    "StoreCaches",
    "batch_invalidations",
    "invalidation_rows_txn",
    "write_cache_invalidations",
]

#: Cache names written to the caches stream. ``cs_cache_fake`` with a room
#: ID invalidates every current-state cache of that room (Synapse's name).
CURRENT_STATE_CACHE = "cs_cache_fake"
EVENT_CACHE = "get_event"
ROOMS_FOR_USER_CACHE = "get_rooms_for_user"
#: A purge (``roomstore.events.purge``), keys ``[room_id]``: events of the
#: room were deleted with their interned IDs (``HISTORY_PURGED``), or the
#: whole room (``ROOM_PURGED``). Each process drops every cache that may hold what
#: went (purges are rare; the caches refill), so no key list of deleted
#: events need cross the wire. Synapse's processes ignore the names.
HISTORY_PURGED = "roomstore_history_purged"
ROOM_PURGED = "roomstore_room_purged"


def batch_invalidations(
    redacted_event_ids: Iterable[str], current_state_rooms: Iterable[str], membership_users: Iterable[str]
) -> list[tuple[str, list]]:
    """(cache name, keys) a process must drop after a batch that redacted
    those events, changed those rooms' current state and those users'
    memberships."""
    rows: list[tuple[str, list]] = []
    rows.extend((EVENT_CACHE, [event_id]) for event_id in sorted(redacted_event_ids))
    rows.extend((CURRENT_STATE_CACHE, [room_id]) for room_id in sorted(current_state_rooms))
    rows.extend((ROOMS_FOR_USER_CACHE, [user_id]) for user_id in sorted(membership_users))
    return rows


def write_cache_invalidations(
    txn: Transaction, stream_id: int, instance_name: str, invalidations: Sequence[tuple[str, list | None]], now_ms: int
) -> None:
    """Rows of the caches stream, all at one stream ID (one fact)."""
    txn.insert_many(
        "cache_invalidations",
        ("stream_id", "instance_name", "cache_name", "keys", "invalidation_ts"),
        [
            (stream_id, instance_name, name, None if keys is None else json.dumps(keys), now_ms)
            for name, keys in invalidations
        ],
        queue=True,
    )


#: The caches stream's newest IDs per writer, read at start-up by its ID generator.
NEWEST_CACHE_STREAM_IDS = (
    "SELECT instance_name, MAX(stream_id) FROM cache_invalidations WHERE stream_id > 0 GROUP BY instance_name"
)

_INVALIDATION_ROWS = (
    "SELECT stream_id, cache_name, keys, invalidation_ts FROM cache_invalidations"
    " WHERE instance_name = ? AND stream_id > ? AND stream_id <= ?"
    # COALESCE: SQLite sorts NULL first, PostgreSQL last; rows must come
    # out the same on both.
    " ORDER BY stream_id, cache_name, COALESCE(keys, '')"
)


def invalidation_rows_txn(
    txn: Transaction, instance_name: str, from_id: int, upto: int, limit: int | None = None
) -> list[tuple]:
    """``(stream_id, cache_name, keys JSON or None, invalidation_ts)`` of
    ``instance_name`` with ``from_id < stream_id <= upto``, in a fixed order,
    at most ``limit`` (None: all)."""
    if limit is None:
        return txn.execute(_INVALIDATION_ROWS, (instance_name, from_id, upto)).fetchall()
    return txn.execute(_INVALIDATION_ROWS + " LIMIT ?", (instance_name, from_id, upto, limit)).fetchall()


class StoreCaches:
    """One process's caches of the store, and what each change drops.

    Who calls it: ``RoomStore`` after a committed batch (``batch_committed``)
    and the replication handler of a worker for every row it applies.
    Collaborators: the event reader (its event and rooms-for-user caches) and
    the change caches of rooms and of users' memberships.
    """

    def __init__(
        self,
        reader: EventReader,
        room_changes: StreamChangeCache,
        membership_changes: StreamChangeCache,
        parsed_events: LruCache | None = None,
        room_versions: LruCache | None = None,
    ):
        self.reader = reader
        #: The writer's room ID -> version cache (the persister's), where there is one.
        self.room_versions = room_versions
        self.room_changes = room_changes
        self.membership_changes = membership_changes
        #: Stored events as the auth checks and state resolution read them
        #: (``events.resolution_source.ParsedEventCache``).
        self.parsed_events = parsed_events

    def room_changed(self, room_id: str, position: int) -> None:
        """A new event in the room at ``position``."""
        self.room_changes.entity_has_changed(room_id, position)

    def membership_changed(self, user_id: str, position: int) -> None:
        """The user's membership somewhere moved at ``position``."""
        self.membership_changes.entity_has_changed(user_id, position)
        self.reader.invalidate_rooms_for_users([user_id])

    def changes_replicated(self, rooms: dict[str, int], members: dict[str, int], redacted: Sequence[str]) -> None:
        """``room_changed`` for each room at its position, ``membership_changed``
        for each user, ``event_changed`` for each event: a worker's page of rows."""
        for room_id, position in rooms.items():
            self.room_changes.entity_has_changed(room_id, position)
        if members:
            for user_id, position in members.items():
                self.membership_changes.entity_has_changed(user_id, position)
            self.reader.invalidate_rooms_for_users(members)
        for event_id in redacted:
            self.event_changed(event_id)

    def event_changed(self, event_id: str) -> None:
        """The event's served form changed (redacted, censored)."""
        self.reader.invalidate_event(event_id)
        if self.parsed_events is not None:
            self.parsed_events.pop(event_id)

    def purged(self, room_ids: Sequence[str], whole_room: bool) -> None:
        """Events of ``room_ids`` were purged, their interned IDs too
        (``whole_room``: the rooms as well): every served, parsed, state and
        event ID cache goes, and for a room its ID, version and memberships."""
        self.reader.invalidate_all()
        self.reader.state_groups.forget_all()
        if self.parsed_events is not None:
            self.parsed_events.clear()
        self.reader.interners.events.forget_all()
        if whole_room:
            self.reader.interners.rooms.forget_all()
            if self.room_versions is not None:
                for room_id in room_ids:
                    self.room_versions.pop(room_id)

    def all_memberships_changed(self) -> None:
        """Anyone's membership may have moved (a current-state change)."""
        self.reader.invalidate_all_memberships()

    def apply_invalidation(self, cache_name: str, keys: list | None) -> None:
        """Drop what a caches-stream row names (``keys`` None: the whole
        cache); a name this store does not cache is ignored."""
        if cache_name == EVENT_CACHE:
            if keys is None:
                self.reader.invalidate_all()
                if self.parsed_events is not None:
                    self.parsed_events.clear()
            else:
                for event_id in keys:
                    self.event_changed(event_id)
        elif cache_name == ROOMS_FOR_USER_CACHE:
            if keys is None:
                self.all_memberships_changed()
            else:
                self.reader.invalidate_rooms_for_users(keys)
        elif cache_name in (HISTORY_PURGED, ROOM_PURGED):
            self.purged(keys or [], whole_room=cache_name == ROOM_PURGED)
        elif cache_name == CURRENT_STATE_CACHE:
            # Keys are room IDs; any current-state change may move anyone's
            # rooms, and None means every room.
            if keys is None or keys:
                self.all_memberships_changed()

    def batch_committed(self, outcome: Any) -> None:
        """A batch this process wrote (a ``BatchOutcome``) committed: the
        change caches learn its positions, and the caches drop what
        ``batch_invalidations`` names, as every other process does."""
        for room_id, position in outcome.room_positions.items():
            self.room_changes.entity_has_changed(room_id, position)
        for user_id, position in outcome.membership_users.items():
            self.membership_changes.entity_has_changed(user_id, position)
        for cache_name, keys in outcome.invalidations():
            self.apply_invalidation(cache_name, keys)
