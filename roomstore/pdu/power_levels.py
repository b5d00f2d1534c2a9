"""Room creators and users' power levels, per room version (pure functions).

These functions state who the creators are and what a user's level is, for
what needs it outside the authorization rules, such as the sample generator
(``roomstore.demo.sample``) writing valid room version 12 power levels. The
authorization rules read levels through ``roomstore.pdu.auth_levels``
(``roomstore.pdu.auth_rules``), as does the store where a redaction's power
decides whether it applies (``roomstore.events.write.redaction_authority``).

Room version 12 (MSC4289): the room's creators are the create event's
``sender`` plus the user IDs of its ``content.additional_creators``; they
have an infinitely high power level, and an ``m.room.power_levels`` event may
not list them in ``users``. Before v12 the creator is the create event's
``sender`` (v11) or ``content.creator`` (v1-v10), with no special power once
power levels exist; with none, the creator has 100 and everyone else 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from roomstore.pdu.room_versions import RoomVersion

__all__ = ["CREATOR_POWER_LEVEL", "creators_listed", "room_creators", "user_power_level"]

#: The power level of a room version 12 creator: above any integer.
CREATOR_POWER_LEVEL = math.inf


def room_creators(room_version: RoomVersion, create_event: Mapping[str, Any]) -> frozenset[str]:
    """The creators of a room, from its create event.

    v12: ``sender`` plus every string of ``content.additional_creators``
    (the auth rules reject a create event whose list is not user IDs).
    v11: ``sender``. v1-v10: ``content.creator``, else ``sender``.
    """
    content = create_event.get("content")
    content = content if isinstance(content, Mapping) else {}
    if not room_version.implicit_room_creator:
        creator = content.get("creator")
        return frozenset({creator if isinstance(creator, str) else create_event["sender"]})
    creators = {create_event["sender"]}
    if room_version.creators_have_infinite_power:
        additional = content.get("additional_creators")
        if isinstance(additional, list):
            creators.update(user for user in additional if isinstance(user, str))
    return frozenset(creators)


def user_power_level(
    room_version: RoomVersion,
    create_event: Mapping[str, Any],
    power_levels: Mapping[str, Any] | None,
    user_id: str,
) -> int | float:
    """``user_id``'s power level given the room's create event and the
    content of its current ``m.room.power_levels`` event (None: no such
    event). v12 creators: :data:`CREATOR_POWER_LEVEL` whatever the power
    levels say."""
    creators = room_creators(room_version, create_event)
    if room_version.creators_have_infinite_power and user_id in creators:
        return CREATOR_POWER_LEVEL
    if power_levels is None:
        return 100 if user_id in creators else 0
    users = power_levels.get("users")
    level = users.get(user_id) if type(users) is dict or isinstance(users, Mapping) else None
    if level is None:
        level = power_levels.get("users_default", 0)
    return 0 if level is None else int(level)


def creators_listed(
    room_version: RoomVersion, create_event: Mapping[str, Any], power_levels: Mapping[str, Any]
) -> list[str]:
    """The room's creators that the power levels' ``users`` lists, sorted:
    in room version 12 an ``m.room.power_levels`` event listing any is
    rejected by the auth rules. Always empty before v12."""
    if not room_version.creators_have_infinite_power:
        return []
    users = power_levels.get("users")
    if not isinstance(users, Mapping):
        return []
    return sorted(room_creators(room_version, create_event) & set(users))
