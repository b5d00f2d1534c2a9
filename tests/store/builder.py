"""Building signed-shaped Matrix events for tests (room version 10 by default).

``RoomBuilder`` keeps a room's graph: ``create()``, ``join(user)``,
``message(user, text)``, ``state(type, key, content)`` append events whose
prev events are the current leaves (or those given), with correct depths and
auth events, and return the raw bytes' event. Event IDs are the spec's
reference hashes, computed by roomstore.events (so v3+ IDs are real).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from roomstore.events.hashing import compute_content_hash, compute_event_id
from roomstore.events.persist import EventToPersist
from roomstore.events.room_versions import get_room_version


def fake_event_id(seed: str) -> str:
    """A well-formed v4+ event ID of an event nobody has."""
    import hashlib

    from roomstore.events.hashing import unpadded_base64

    return "$" + unpadded_base64(hashlib.sha256(seed.encode()).digest(), urlsafe=True)


class BuiltEvent:
    def __init__(self, event_id: str, raw: bytes, event: dict):
        self.event_id = event_id
        self.raw = raw
        self.event = event

    def to_persist(self, **flags) -> EventToPersist:
        return EventToPersist(self.raw, self.event.get("_version", None) or "10", **flags)


class RoomBuilder:
    def __init__(self, room_id: str = "!room:example.org", version: str = "10", creator: str = "@alice:example.org"):
        self.room_id = room_id
        self.version = version
        self.creator = creator
        self.room_version = get_room_version(version)
        self.leaves: list[str] = []
        self.depth_of: dict[str, int] = {}
        self.clock = 1_700_000_000_000
        self.events: list[BuiltEvent] = []

    def build(self, event_type: str, sender: str, content: dict, state_key: str | None = None,
              prev: Sequence[str] | None = None, extra: dict | None = None, set_leaves: bool = True) -> BuiltEvent:
        prev_ids = list(self.leaves if prev is None else prev)
        depth = max([self.depth_of[p] for p in prev_ids if p in self.depth_of] or [0]) + 1
        self.clock += 1000
        event: dict[str, Any] = {
            "auth_events": [],
            "content": content,
            "depth": depth,
            "origin": "example.org",
            "origin_server_ts": self.clock,
            "prev_events": prev_ids,
            "room_id": self.room_id,
            "sender": sender,
            "type": event_type,
        }
        if state_key is not None:
            event["state_key"] = state_key
        if extra:
            event.update(extra)
        event["hashes"] = {"sha256": compute_content_hash(event)}
        event["signatures"] = {"example.org": {"ed25519:a": "c2lnbmF0dXJl"}}
        event_id = compute_event_id(self.room_version, event)
        raw = json.dumps(event).encode("utf-8")
        built = BuiltEvent(event_id, raw, event)
        self.depth_of[event_id] = depth
        if set_leaves:
            self.leaves = [l for l in self.leaves if l not in prev_ids] + [event_id]
        self.events.append(built)
        return built

    def to_persist(self, built: BuiltEvent, **flags) -> EventToPersist:
        return EventToPersist(built.raw, self.version, **flags)

    def create(self) -> BuiltEvent:
        return self.build("m.room.create", self.creator, {"creator": self.creator, "room_version": self.version}, "")

    def member(self, user: str, membership: str, sender: str | None = None, **kw) -> BuiltEvent:
        return self.build("m.room.member", sender or user, {"membership": membership}, user, **kw)

    def join(self, user: str, **kw) -> BuiltEvent:
        return self.member(user, "join", **kw)

    def message(self, sender: str, body: str, **kw) -> BuiltEvent:
        return self.build("m.room.message", sender, {"msgtype": "m.text", "body": body}, **kw)

    def state(self, event_type: str, state_key: str, content: dict, sender: str | None = None, **kw) -> BuiltEvent:
        return self.build(event_type, sender or self.creator, content, state_key, **kw)

    def history_visibility(self, value: str, **kw) -> BuiltEvent:
        return self.state("m.room.history_visibility", "", {"history_visibility": value}, **kw)

    def redact(self, sender: str, target: str, **kw) -> BuiltEvent:
        extra = {"redacts": target} if int(self.version) < 11 else None
        content = {"reason": "spam"}
        if int(self.version) >= 11:
            content["redacts"] = target
        return self.build("m.room.redaction", sender, content, extra=extra, **kw)
