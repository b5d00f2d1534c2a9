"""Building Matrix events for tests (room version 10 by default).

``RoomBuilder`` is the package's ``RoomGraphBuilder`` (real content hashes and
reference-hash event IDs) plus ``to_persist`` for handing its events to the
store.
"""

from __future__ import annotations

import hashlib

from roomstore.demo.sample import BuiltEvent, RoomGraphBuilder
from roomstore.events.write.persist import EventToPersist
from roomstore.pdu.hashing import unpadded_base64
from roomstore.pdu.parsing import parse_pdu
from roomstore.resolution import MemoryEventSource, resolve_state

__all__ = ["BuiltEvent", "RoomBuilder", "UncheckedRoomBuilder", "fake_event_id", "pure_resolution", "skip_precheck"]


def fake_event_id(seed: str) -> str:
    """A well-formed v4+ event ID of an event nobody has."""
    return "$" + unpadded_base64(hashlib.sha256(seed.encode()).digest(), urlsafe=True)


class RoomBuilder(RoomGraphBuilder):
    #: Whether ``to_persist`` marks events as checked by their source, so
    #: the store stores them unchecked against the auth rules.
    auth_checked = False

    def to_persist(self, built: BuiltEvent, **flags) -> EventToPersist:
        flags.setdefault("auth_checked", self.auth_checked)
        return EventToPersist(built.raw, self.version, **flags)


class UncheckedRoomBuilder(RoomBuilder):
    """A ``RoomBuilder`` whose events the store takes as checked by their
    source (``EventToPersist.auth_checked``): for model-based tests of state,
    visibility and the room graph, whose models (a replay, a walk) know
    nothing of the authorization rules and whose random histories do not
    keep them (a state event by a user who never joined). What the rules
    decide is tested where they are the subject (tests/store/test_rejected.py,
    test_room_boundaries.py, tests/pdu)."""

    auth_checked = True


def skip_precheck(store) -> None:
    """Make ``store``'s precheck find nothing, as when another writer changes
    a room after it: a batch the write refuses then fails after its stream
    IDs are reserved (they complete unused)."""
    store.writes.precheck = lambda txn, persister, events, resolved: {}


def pure_resolution(room: RoomGraphBuilder, state_sets, rejected=()) -> dict:
    """The pure resolution (``roomstore.resolution``, checked against
    Synapse's in tests/resolution) of ``state_sets`` over every event
    ``room`` built: what the store's resolution must equal."""
    events = {e.event_id: parse_pdu(e.raw, room.room_version) for e in room.events}
    return resolve_state(room.room_version, state_sets, MemoryEventSource(events, rejected))
