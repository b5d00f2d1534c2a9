"""The rooms a batch names, before it is written: their stored versions (to
parse bare PDUs by) and the orphans that would start a room without a
create event. ``RoomStore.persist_events`` asks; the versions are cached
(``EventPersister.room_versions``: a room's version never changes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from roomstore.events.write.batch import EventToPersist, PreparedEvent, is_orphan, peek_room_version
from roomstore.pdu.parsing import InvalidEventError
from roomstore.storage.database import Database
from roomstore.storage.interning import room_versions_txn


@attrs.frozen
class BatchVersions:
    """What ``BatchRooms.needed_by`` found: ``versions`` (room ID -> version)
    to validate the batch by, the ``assumed`` among them (rooms an earlier
    call in flight creates, not stored yet), whether any room is
    ``unknown`` (neither stored nor being created, nor created by the batch
    itself), and whether the batch must be validated ``whole``: some of its
    events take their version from its own create event (or none)."""

    versions: dict[str, str]
    assumed: dict[str, str]
    unknown: bool
    whole: bool


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

    async def needed_by(self, events: Sequence[EventToPersist], turn: Any = None) -> BatchVersions:
        """The versions of the rooms whose version the events leave to the
        store. ``turn`` (the call's ``WriteTurns`` turn): a room not stored yet
        whose create event is in an earlier call still in flight is validated
        by that event's version (``assumed``) rather than after its write,
        without a look in the database first, which would wait behind their
        writes on the database thread while validation waited for it (a room
        stored already at another version, whose create event in flight is a
        second one, makes the write raise ``AssumedVersionWrong``: the caller
        validates the batch again by the stored version); a room neither
        stored nor being created waits for every earlier call to be
        written, then is looked up again. The write refuses an event
        of an assumed room whose create event was not stored after all
        (``PreparedEvent.version_assumed``)."""
        rooms = set()
        own = set()  # rooms whose create event the batch holds (v12's carry no room ID: not found here)
        versioned = []
        for ev in events:
            if not isinstance(ev, EventToPersist):
                continue
            if ev.room_version is None:
                room_id, event_type, _ = peek_room_version(ev.raw)
                if room_id and event_type != "m.room.create":
                    rooms.add(room_id)
                elif room_id:
                    own.add(room_id)
            else:
                versioned.append(ev)
        known, uncached = self.cache.split(sorted(rooms))
        if uncached and versioned:
            own.update(_created_rooms(versioned, uncached))
        if uncached and turn is not None and turn.earlier_in_flight():
            wanted = set(uncached) - own
            created = await turn.created_earlier(wanted)
            ahead = {room: created[room] for room in wanted if room in created}
            if len(ahead) == len(wanted):
                return BatchVersions({**known, **ahead}, ahead, False, bool(own.intersection(uncached)))
        known = await self.versions(sorted(rooms))
        missing = rooms - known.keys()
        whole = bool(missing & own)  # some events take their version from the batch's own create event
        missing -= own
        if not missing:
            return BatchVersions(known, {}, False, whole)
        if turn is None or not turn.earlier_in_flight():
            return BatchVersions(known, {}, True, True)
        created = await turn.created_earlier(missing)
        assumed = {room_id: created[room_id] for room_id in missing if room_id in created}
        if len(assumed) == len(missing):
            return BatchVersions({**known, **assumed}, assumed, False, whole)
        # An earlier call may be storing it still some other way: after them.
        await turn.ready()
        known = await self.versions(sorted(rooms))
        missing = rooms - known.keys()
        return BatchVersions(known, {}, bool(missing - own), bool(missing))

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


def _created_rooms(versioned: Sequence[EventToPersist], rooms: Sequence[str]) -> set[str]:
    """The rooms among ``rooms`` whose create event is among ``versioned``
    (events given with their room version, as an import's wrapped lines are):
    the batch's bare events of such a room take its version, as they do
    from a bare create event, instead of waiting for the calls before to be
    written and looking in the database. An event that cannot be read is
    passed over here: validation refuses it."""
    wanted = set(rooms)
    created = set()
    for ev in versioned:
        if b"m.room.create" not in ev.raw:  # most events: no parse
            continue
        try:
            room_id, event_type, _ = peek_room_version(ev.raw)
        except InvalidEventError:
            continue
        if event_type == "m.room.create" and room_id in wanted:
            created.add(room_id)
    return created
