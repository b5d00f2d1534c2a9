"""The rooms a batch names, before it is written: their stored versions (to
parse bare PDUs by) and the orphans that would start a room without a
create event. ``RoomStore.persist_events`` asks; the versions are cached
(``EventPersister.room_versions``: a room's version never changes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roomstore.events.batch import EventToPersist, PreparedEvent, is_orphan, peek_room_version
from roomstore.pdu.parsing import InvalidEventError
from roomstore.storage.database import Database
from roomstore.storage.interning import room_versions_txn


class BatchRooms:
    """Room versions by room ID, from the cache or the database."""

    def __init__(self, db: Database, cache: Any) -> None:
        self.db = db
        self.cache = cache

    async def versions(self, room_ids: Sequence[str]) -> dict[str, str]:
        """room_id -> version of the rooms among ``room_ids`` with a stored create event."""
        known, unknown = self.cache.split(room_ids)
        if unknown:
            found = await self.db.run_interaction("room_versions", room_versions_txn, unknown)
            for room_id, version in found.items():
                self.cache.set(room_id, version)
            known.update(found)
        return known

    async def needed_by(self, events: Sequence[EventToPersist]) -> tuple[dict[str, str], bool]:
        """(room_id -> stored version of the rooms whose version the events
        leave to the store, whether any of them is unknown)."""
        rooms = set()
        for ev in events:
            if isinstance(ev, EventToPersist) and ev.room_version is None:
                room_id, event_type, _ = peek_room_version(ev.raw)
                if room_id and event_type != "m.room.create":
                    rooms.add(room_id)
        known = await self.versions(sorted(rooms))
        return known, len(known) < len(rooms)

    async def refuse_orphans(self, prepared: Sequence[PreparedEvent], rooms: Sequence[str]) -> None:
        """``InvalidEventError`` for a live non-create event without prev
        events in a room that has no create event (stored or in the batch):
        it would start a room without one. Outliers may. ``rooms``: the
        batch's ``orphan_rooms``, to look up."""
        if not rooms:
            return
        known = await self.versions(rooms)
        for ev in prepared:
            if ev.pdu.room_id in rooms and is_orphan(ev) and ev.pdu.room_id not in known:
                raise InvalidEventError(
                    f"event {ev.event_id} has no prev events and room {ev.pdu.room_id} is unknown: "
                    "persist the room's create event first, or flag the event an outlier"
                )
