"""Reading power levels as the authorization rules do (pure functions).

The auth rules (``roomstore.pdu.auth_rules``) compare power levels: a
user's, an event type's required level and the named levels (``ban``,
``kick``, ``invite``, ``redact``). This module reads them from the room
state handed to the rules, per room version:

* v1-v9 ("``m.room.power_levels`` events accept values as strings", and
  before v6 "as floats"): a level is an integer, a string holding one
  (base 10, an optional ``+``/``-``, leading zeroes and surrounding
  whitespace allowed), or a float truncated towards zero.  Booleans are not
  levels in any version (JSON has no integer ``true``).
* v10+ (``enforce_int_power_levels``): only integers.

An ``m.room.power_levels`` event carrying a value that is not a level in
its version is rejected (``auth_rules``, rule 10 of v12; before v10 the
spec only says so of ``users``, but a value no server can compare is no
level).  Levels already in the state are read leniently, strings and floats
in every version as Synapse reads them (such an event cannot pass the rules
from v10, but a state handed in may hold one); a value that is no number at
all reads as the default.  The string format is the spec's ("base 10, an
optional sign, leading zeroes and surrounding whitespace"): Python's
``int()`` would also take ``"1_000"``, the spec does not.

Defaults, as Synapse applies them (the client-server spec's
``m.room.power_levels``): ``users_default``, ``events_default`` and
``invite`` 0; ``state_default``, ``ban``, ``kick`` and ``redact`` 50.  With
no ``m.room.power_levels`` event at all the creator has 100 and everyone
else 0; the spec's client section would make ``state_default`` 0 then, but
Synapse keeps 50, and so do we (a room's state must not depend on whose
server computed it).  Room version 12 (MSC4289): the creators have an
infinite level, whatever the power levels say.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from roomstore.pdu.parsing import ParsedPdu
from roomstore.pdu.power_levels import CREATOR_POWER_LEVEL, room_creators
from roomstore.pdu.room_versions import RoomVersion

__all__ = [
    "NAMED_LEVEL_DEFAULTS",
    "Level",
    "creators_of",
    "named_level",
    "parse_level",
    "required_level",
    "user_level",
]

#: A power level: an integer, or ``math.inf`` for a room version 12 creator.
Level = int | float

#: The named levels and their defaults when the power levels omit them.
NAMED_LEVEL_DEFAULTS: Mapping[str, int] = {
    "users_default": 0,
    "events_default": 0,
    "state_default": 50,
    "ban": 50,
    "kick": 50,
    "redact": 50,
    "invite": 0,
}

_STRINGY_INT = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def parse_level(room_version: RoomVersion, value: Any, *, lenient: bool = False) -> int | None:
    """``value`` as a power level of ``room_version``, or None when it is not
    one.  ``lenient``: read strings and floats in every room version (how
    levels already in the state are read)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if room_version.enforce_int_power_levels and not lenient:
        return None
    if isinstance(value, str) and _STRINGY_INT.fullmatch(value):
        return int(value.strip())
    if isinstance(value, float) and math.isfinite(value):
        return int(value)  # truncated, as "floaty power levels" says
    return None


def _content(event: ParsedPdu | None) -> Mapping[str, Any]:
    return event.content if event is not None else {}


#: A level's default: a level, or None for "no level" (``event_level``'s absent entry).
_Default = TypeVar("_Default", int, None)


def _read(room_version: RoomVersion, holder: Any, key: str, default: _Default) -> int | _Default:
    """``holder[key]`` as a level, or ``default`` when absent or unreadable."""
    # ``type(..) is dict`` first: typing's isinstance is slow, and parsed JSON is dicts.
    if not (type(holder) is dict or isinstance(holder, Mapping)) or key not in holder:
        return default
    level = parse_level(room_version, holder[key], lenient=True)
    return default if level is None else level


#: Creators by create event: every check reads them, of few rooms at a
#: time. Keyed by the event's ID and bytes (bytes cache their hash), so two
#: events claiming one v1/v2 ID cannot share an entry.
_CREATORS: dict[tuple[str, str, bytes], frozenset[str]] = {}
_CREATORS_KEPT = 1024


def creators_of(room_version: RoomVersion, create: ParsedPdu) -> frozenset[str]:
    """The room's creators: v12 the create event's sender and its
    ``additional_creators``; v11 its sender; v1-v10 ``content.creator``."""
    key = (room_version.identifier, create.event_id, create.raw)
    creators = _CREATORS.get(key)
    if creators is None:
        if len(_CREATORS) >= _CREATORS_KEPT:
            _CREATORS.clear()
        creators = _CREATORS[key] = room_creators(room_version, create.event_dict)
    return creators


def user_level(room_version: RoomVersion, create: ParsedPdu, power_levels: ParsedPdu | None, user_id: str) -> Level:
    """``user_id``'s power level given the room's create and power levels events."""
    if room_version.creators_have_infinite_power and user_id in creators_of(room_version, create):
        return CREATOR_POWER_LEVEL
    if power_levels is None:
        return 100 if user_id in creators_of(room_version, create) else 0
    content = power_levels.content
    default = _read(room_version, content, "users_default", 0)
    return _read(room_version, content.get("users"), user_id, default)


def named_level(room_version: RoomVersion, power_levels: ParsedPdu | None, name: str) -> int:
    """The level named ``name`` (``ban``, ``kick``, ``invite``, ``redact``, ...)."""
    return _read(room_version, _content(power_levels), name, NAMED_LEVEL_DEFAULTS[name])


def required_level(room_version: RoomVersion, power_levels: ParsedPdu | None, event: ParsedPdu) -> int:
    """The event type's *required power level*: ``events[type]``, else
    ``state_default`` for a state event and ``events_default`` for others."""
    content = _content(power_levels)
    default_name = "state_default" if event.is_state else "events_default"
    default = named_level(room_version, power_levels, default_name)
    return _read(room_version, content.get("events"), event.type, default)
