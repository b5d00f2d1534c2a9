"""The events one resolution reads, fetched once from an ``EventSource``.

Every event of a resolution must be in the room being resolved: one from
another room raises :class:`ResolutionError` (as Synapse refuses to
resolve), since its presence means the caller's graph is corrupt.
"""

from __future__ import annotations

from collections.abc import Iterable

from roomstore.pdu.auth_common import CREATE, POWER_LEVELS, StateKey
from roomstore.pdu.auth_levels import Level, user_level
from roomstore.pdu.parsing import ParsedPdu
from roomstore.pdu.room_versions import RoomVersion
from roomstore.resolution.source import EventSource

__all__ = ["EventCache", "ResolutionError"]


class ResolutionError(ValueError):
    """The events handed to state resolution cannot be resolved (an event
    of another room); the message names the event."""


class EventCache:
    """Events by ID and their rejected flags, fetched in batches and kept."""

    def __init__(self, room_id: str | None, source: EventSource) -> None:
        self.room_id = room_id
        self.source = source
        self.events: dict[str, ParsedPdu] = {}
        self.missing: set[str] = set()
        self.rejected_ids: set[str] = set()

    def load(self, event_ids: Iterable[str]) -> None:
        """Fetch those of ``event_ids`` not fetched yet."""
        wanted = {e for e in event_ids if e not in self.events and e not in self.missing}
        if not wanted:
            return
        found = self.source.get_events(wanted)
        for event_id, event in found.items():
            if self.room_id is None:
                self.room_id = event.room_id
            if event.room_id != self.room_id:
                raise ResolutionError(
                    f"events of two rooms in one resolution: {event_id} is in room "
                    f"{event.room_id}, others in {self.room_id}"
                )
            self.events[event_id] = event
        self.missing |= wanted - set(found)
        self.rejected_ids |= self.source.rejected(set(found))

    def load_auth_events(self, event_ids: Iterable[str]) -> None:
        """Fetch the auth events of the (fetched) events ``event_ids``."""
        self.load(a for e in event_ids if e in self.events for a in self.events[e].auth_chain_event_ids)

    def get(self, event_id: str) -> ParsedPdu | None:
        if event_id not in self.events and event_id not in self.missing:
            self.load([event_id])
        return self.events.get(event_id)

    def is_rejected(self, event_id: str) -> bool:
        return event_id in self.rejected_ids

    def auth_event_of(self, event: ParsedPdu, key: StateKey) -> ParsedPdu | None:
        """The first of ``event``'s auth events whose state key is ``key``."""
        for auth_id in event.auth_chain_event_ids:
            auth_event = self.get(auth_id)
            if auth_event is not None and (auth_event.type, auth_event.state_key) == key:
                return auth_event
        return None

    def sender_level(self, room_version: RoomVersion, event: ParsedPdu) -> Level:
        """The sender's power level by the event's own auth events (0 without a create event)."""
        create = self.auth_event_of(event, CREATE)
        if create is None:
            return 0
        return user_level(room_version, create, self.auth_event_of(event, POWER_LEVELS), event.sender)
