"""``POST /createRoom``: a new room's first events, built and stored in one
``persist_events`` call (all or nothing).

The events, in the spec's order: the create event (room version
``room_version``, default 12; in version 12 the room ID is its hash), the
creator's join, the power levels (``power_level_content_override`` on top),
the join rules, history visibility and guest access the preset gives,
``initial_state``, ``name``, ``topic``, then an invite per ``invite``. In
room version 12 the creator's power is implied (never listed in ``users``),
and ``trusted_private_chat`` makes the invitees additional creators.
"""

from __future__ import annotations

import secrets
from typing import Any

from roomstore.homeserver.errors import MatrixError, bad_json
from roomstore.homeserver.events import EventCreator, local_auth_events
from roomstore.homeserver.http import ClientRequest, Router
from roomstore.pdu import BuiltPdu

__all__ = ["RoomCreator", "SUPPORTED_ROOM_VERSIONS", "DEFAULT_ROOM_VERSION"]

#: Room versions this server creates and joins (1 and 2 name events by the server, not by hash: not offered).
SUPPORTED_ROOM_VERSIONS = tuple(str(v) for v in range(3, 13))
DEFAULT_ROOM_VERSION = "12"

_PRESETS: dict[str, dict[str, str | None]] = {
    "private_chat": {"join_rule": "invite", "history": "shared", "guests": "can_join"},
    "trusted_private_chat": {"join_rule": "invite", "history": "shared", "guests": "can_join"},
    "public_chat": {"join_rule": "public", "history": "shared", "guests": None},
}


def power_levels(creator: str, room_version: str, trusted: list[str], override: dict) -> dict:
    """The preset's power levels; a version 12 room lists no creator in ``users``."""
    users = {} if room_version == "12" else {creator: 100, **{user: 100 for user in trusted}}
    content: dict[str, Any] = {
        "users": users,
        "users_default": 0,
        "events_default": 0,
        "state_default": 50,
        "ban": 50,
        "kick": 50,
        "redact": 50,
        "invite": 0,
        "events": {
            "m.room.name": 50,
            "m.room.power_levels": 100,
            "m.room.history_visibility": 100,
            "m.room.canonical_alias": 50,
            "m.room.avatar": 50,
            "m.room.tombstone": 100,
            "m.room.server_acl": 100,
            "m.room.encryption": 100,
        },
        "notifications": {"room": 50},
    }
    content.update(override)
    return content


def _invitees(body: dict, server_name: str) -> list[str]:
    invite = body.get("invite", [])
    if not isinstance(invite, list) or not all(isinstance(u, str) and u.startswith("@") for u in invite):
        raise bad_json("invite must be a list of user IDs")
    for user in invite:
        if user.partition(":")[2] != server_name:
            raise MatrixError(403, "M_FORBIDDEN", f"{user} is on another server: this server does not federate")
    return invite


def initial_state_events(body: dict, preset: dict) -> list[tuple[str, str, dict]]:
    """``(type, state_key, content)`` of the state after the power levels."""
    events = [
        ("m.room.join_rules", "", {"join_rule": preset["join_rule"]}),
        ("m.room.history_visibility", "", {"history_visibility": preset["history"]}),
    ]
    if preset["guests"]:
        events.append(("m.room.guest_access", "", {"guest_access": preset["guests"]}))
    initial = body.get("initial_state", [])
    if not isinstance(initial, list):
        raise bad_json("initial_state must be a list")
    for item in initial:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("type"), str)
            or not isinstance(item.get("content"), dict)
            or not isinstance(item.get("state_key", ""), str)
        ):
            raise bad_json("each initial_state event needs a type, a content object and a string state_key")
        events.append((item["type"], item.get("state_key", ""), item["content"]))
    for key, event_type in (("name", "m.room.name"), ("topic", "m.room.topic")):
        if key in body:
            if not isinstance(body[key], str):
                raise bad_json(f"{key} must be a string")
            events.append((event_type, "", {key: body[key]}))
    return events


class RoomCreator:
    """``/createRoom``; see the module docstring."""

    def __init__(self, events: EventCreator, profile_of):
        self._events = events
        self._profile_of = profile_of  # async user_id -> {"displayname", "avatar_url"}

    def register_routes(self, router: Router) -> None:
        router.add("POST", "/createRoom", self.create_room)

    async def create_room(self, request: ClientRequest) -> dict:
        body, user = request.body, request.user.user_id
        version = body.get("room_version", DEFAULT_ROOM_VERSION)
        if version not in SUPPORTED_ROOM_VERSIONS:
            raise MatrixError(400, "M_UNSUPPORTED_ROOM_VERSION", f"room version {version!r} is not supported")
        preset_name = body.get("preset") or ("public_chat" if body.get("visibility") == "public" else "private_chat")
        if preset_name not in _PRESETS:
            raise bad_json(f"unknown preset {preset_name!r}")
        invitees = _invitees(body, self._events.server_name)
        trusted = invitees if preset_name == "trusted_private_chat" else []
        override = body.get("power_level_content_override", {})
        creation = body.get("creation_content", {})
        if not isinstance(override, dict) or not isinstance(creation, dict):
            raise bad_json("power_level_content_override and creation_content must be objects")
        create_content = {**creation, "room_version": version}
        if int(version) <= 10:
            create_content["creator"] = user
        if version == "12" and trusted:
            create_content["additional_creators"] = trusted
        join = {"membership": "join", **await self._profile_of(user)}
        plan = [
            ("m.room.create", "", create_content),
            ("m.room.member", user, join),
            ("m.room.power_levels", "", power_levels(user, version, trusted, override)),
            *initial_state_events(body, _PRESETS[preset_name]),
            *[
                (
                    "m.room.member",
                    invitee,
                    {"membership": "invite", **({"is_direct": True} if body.get("is_direct") else {})},
                )
                for invitee in invitees
            ],
        ]
        built = self._build_chain(version, user, plan)
        await self._events.persist(built, version)
        return {"room_id": built[0].room_id}

    def _build_chain(self, version: str, sender: str, plan: list) -> list:
        """Each event on the one before, citing the state so far."""
        room_id = None if version == "12" else f"!{secrets.token_urlsafe(18)}:{self._events.server_name}"
        state: dict[tuple[str, str], str] = {}
        built: list[BuiltPdu] = []
        for depth, (event_type, state_key, content) in enumerate(plan, start=1):
            auth = local_auth_events(version, state, event_type, sender, state_key, content)
            event = self._events.build(
                version, room_id, sender, event_type, content, state_key, built[-1:], auth, depth
            )
            room_id = event.room_id
            state[(event_type, state_key)] = event.event_id
            built.append(event)
        return built
