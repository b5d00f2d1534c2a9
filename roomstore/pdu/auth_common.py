"""What every group of the authorization rules shares: the error they raise,
the room state as they read it, and the identifier checks.

``roomstore.pdu.auth_rules`` is the public face; this module and
``roomstore.pdu.auth_membership`` hold its parts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from roomstore.pdu import auth_levels
from roomstore.pdu.parsing import MAX_IDENTIFIER_BYTES, ParsedPdu
from roomstore.pdu.room_versions import RoomVersion

__all__ = [
    "AuthError",
    "CREATE",
    "JOIN_RULES",
    "POWER_LEVELS",
    "RoomState",
    "StateKey",
    "is_user_id_shaped",
    "is_valid_user_id",
    "server_of",
]

#: A state key: ``(event type, state key)``.
StateKey = tuple[str, str]

CREATE: StateKey = ("m.room.create", "")
POWER_LEVELS: StateKey = ("m.room.power_levels", "")
JOIN_RULES: StateKey = ("m.room.join_rules", "")


class AuthError(Exception):
    """An event is not allowed by the authorization rules.

    ``str(error)`` is one line naming the rule (its number in the spec's
    list for the event's room version, e.g. "rule 5.3.2") and why.
    """


def server_of(identifier: str) -> str:
    """The server name of a user, room (v1-v11) or event (v1-v2) ID: all
    after the first colon ("" when there is none)."""
    return identifier.partition(":")[2]


# Server name grammar (appendices, "Server name"): a DNS name, an IPv4
# address or a bracketed IPv6 address, then an optional port.
_SERVER_NAME = re.compile(
    r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[0-9]{1,3}(?:\.[0-9]{1,3}){3}|[A-Za-z0-9.-]{1,255})(?::[0-9]{1,5})?",
    re.ASCII,
)


def is_user_id_shaped(value: object) -> bool:
    """``@``, a localpart, ``:`` and a server part (the shape ``parse_pdu``
    requires of ``sender``)."""
    return isinstance(value, str) and value.startswith("@") and ":" in value[1:]


def is_valid_user_id(value: object) -> bool:
    """``@localpart:server_name`` of at most 255 bytes, the localpart
    non-empty and without a colon (historical localparts allow any other
    character), the server name in the spec's grammar."""
    if not isinstance(value, str) or not value.startswith("@"):
        return False
    if len(value.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES:
        return False
    localpart, colon, server = value[1:].partition(":")
    return bool(localpart and colon) and _SERVER_NAME.fullmatch(server) is not None


class RoomState:
    """The room state the rules read: ``(type, state_key)`` -> event, and
    the readings of it that several rules share.

    Made by ``check_event_auth`` once per check; the create event must be in
    the state (the caller's check).
    """

    def __init__(self, room_version: RoomVersion, state: Mapping[StateKey, ParsedPdu]) -> None:
        self.room_version = room_version
        self.state = state
        self.create: ParsedPdu = state[CREATE]
        self.power_levels = state.get(POWER_LEVELS)

    def membership(self, user_id: str) -> str | None:
        """The user's current membership (None when the state has no member event for them)."""
        member = self.state.get(("m.room.member", user_id))
        return None if member is None else member.membership

    def join_rule(self) -> str:
        """The current join rule: ``invite`` when the room has no join rules
        event or its ``join_rule`` is missing (as Synapse reads it), ""
        (no rule at all) when it is not a string."""
        event = self.state.get(JOIN_RULES)
        rule = "invite" if event is None else event.content.get("join_rule", "invite")
        return rule if isinstance(rule, str) else ""

    def level_of(self, user_id: str) -> auth_levels.Level:
        return auth_levels.user_level(self.room_version, self.create, self.power_levels, user_id)

    def named(self, name: str) -> int:
        return auth_levels.named_level(self.room_version, self.power_levels, name)

    def creator(self) -> str | None:
        """The creator in the sense of the "creator's first join" rule: the
        create event's sender from v11, its ``content.creator`` before."""
        if self.room_version.implicit_room_creator:
            return self.create.sender
        creator = self.create.content.get("creator")
        return creator if isinstance(creator, str) else None
