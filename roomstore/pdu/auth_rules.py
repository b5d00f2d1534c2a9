"""The Matrix authorization rules of room versions 1 to 12, as pure code.

Sources: the spec's room version pages (``/rooms/v1`` ... ``/rooms/v12``,
"Authorization rules") and the server-server spec's "Auth events selection".
Rule numbers in docstrings and error messages are the room version's own
(v12's list has a rule 2 that earlier ones lack; v1-v5 have a rule 4 for
``m.room.aliases`` that v6-v11 lack):

==========================================  =====  ======  =====
rule                                        v1-v5  v6-v11  v12
==========================================  =====  ======  =====
``m.room.create``                           1      1       1
room ID is an accepted create event's       -      -       2
auth events (shape)                         2      2       3
``m.federate``                              3      3       4
``m.room.aliases``                          4      -       -
``m.room.member``                           5      4       5
sender joined                               6      5       6
``m.room.third_party_invite``               7      6       7
required power level                        8      7       8
``@`` state keys                            9      8       9
``m.room.power_levels``                     10     9       10
``m.room.redaction`` (v1-v2)                11     -       -
==========================================  =====  ======  =====

Three entry points, for the spec's two checks of an event ("against its auth
events" and "against the state before it"):

* :func:`auth_types_for_event`: the state keys an event's ``auth_events``
  may cite.
* :func:`check_auth_events_shape`: the event's ``auth_events`` themselves
  (rule 2 of v1-v11, 2 and 3 of v12): all known, in the room, none rejected,
  one per state key, each one the selection allows, the create event among
  them.  Returns them as a state map for :func:`check_event_auth`.
* :func:`check_event_auth`: every other rule, against a state map (the auth
  events, or the state before the event, or a state being built by state
  resolution's iterative auth checks).

Readings where the spec leaves room are stated where they apply; the
defaults of power levels in ``roomstore.pdu.auth_levels``, those of member
events in ``roomstore.pdu.auth_membership``.  Here:

* rule 3/4 (``m.federate``): only the JSON value ``false`` makes a room
  unfederated, as the spec says (Synapse: anything but ``true``); the
  target's server of a member event is not looked at (Synapse also checks
  it, the spec does not).
* rule 11 of v1-v2: a redaction without a ``redacts`` string has nothing to
  protect and is allowed (as Synapse does).
* ``content.room_version`` of a create event absent means "1".
* "valid user IDs" as the keys of power levels' ``users`` (rule 10.3 of
  v12): ``@``, a localpart, ``:`` and a server part, the check ``parse_pdu``
  applies to ``sender`` (Synapse's, too): a stricter grammar would refuse
  power levels that servers accepted for historical user IDs, and the
  room's state would part from theirs.  ``additional_creators`` (rule 1.4 of
  v12, new in v12, no history to keep) get the full grammar:
  :func:`roomstore.pdu.auth_common.is_valid_user_id`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from roomstore.pdu import auth_levels
from roomstore.pdu.auth_common import (
    CREATE,
    JOIN_RULES,
    POWER_LEVELS,
    AuthError,
    RoomState,
    StateKey,
    is_user_id_shaped,
    is_valid_user_id,
    server_of,
)
from roomstore.pdu.auth_membership import check_member_event
from roomstore.pdu.parsing import ParsedPdu, create_event_id_of
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, EventIdFormat, RoomVersion

__all__ = ["AuthError", "auth_types_for", "auth_types_for_event", "check_auth_events_shape", "check_event_auth"]

#: Power levels' keys that hold one level each (rule 10.1 of v12).
_NAMED_LEVELS = ("users_default", "events_default", "state_default", "ban", "redact", "kick", "invite")


def _rule(room_version: RoomVersion, name: str) -> int:
    """The number of a top-level rule in ``room_version``'s list (see the module docstring)."""
    v12 = {
        "create": 1,
        "room_id": 2,
        "auth_events": 3,
        "federate": 4,
        "member": 5,
        "joined": 6,
        "third_party_invite": 7,
        "required": 8,
        "state_key": 9,
        "power_levels": 10,
    }
    number = v12[name]
    if room_version.room_id_is_create_hash or name == "create":
        return number
    number -= 1  # no rule 2 before v12
    if room_version.special_case_aliases_auth and number >= 4:
        number += 1  # rule 4: m.room.aliases
    return number


# ---------------------------------------------------------------- auth events


def auth_types_for_event(room_version: RoomVersion, event: ParsedPdu) -> set[StateKey]:
    """The spec's auth events selection: the state keys whose current events
    an event's ``auth_events`` may cite (:func:`auth_types_for`)."""
    if event.is_create:
        return set()
    return auth_types_for(room_version, event.type, event.sender, event.state_key, _selecting_content(event))


#: The content keys of a member event that the selection reads beside
#: ``membership``.
_RARE_MEMBER_KEYS = ("third_party_invite", "join_authorised_via_users_server")


def _selecting_content(event: ParsedPdu) -> Mapping[str, Any]:
    """What of ``event.content`` the selection reads, without decoding it
    where it cannot matter: only member events' content matters, and of
    it beside the parsed ``membership`` only keys most never hold."""
    if event.type != "m.room.member":
        return {}
    if any(event.may_hold_key(key) for key in _RARE_MEMBER_KEYS):
        return event.content
    return {"membership": event.membership}


def auth_types_for(
    room_version: RoomVersion, event_type: str, sender: str, state_key: str | None, content: Mapping[str, Any]
) -> set[StateKey]:
    """The auth events selection of an event with these fields (one being
    built has no ParsedPdu yet).

    None for the create event; else the power levels, the sender's member
    event and, before v12, the create event (v12 implies it: MSC4291).
    A member event adds its target's member event; for ``join``, ``invite``
    and ``knock`` the join rules; for an invite with a well-formed
    ``third_party_invite`` that invite's ``m.room.third_party_invite``; for
    a join with ``join_authorised_via_users_server`` (v8+) that user's
    member event.
    """
    if event_type == "m.room.create" and state_key == "":
        return set()
    types = {POWER_LEVELS, ("m.room.member", sender)}
    if not room_version.room_id_is_create_hash:
        types.add(CREATE)
    if event_type != "m.room.member" or state_key is None:
        return types
    types.add(("m.room.member", state_key))
    membership = content.get("membership")
    if membership in ("join", "invite", "knock"):
        types.add(JOIN_RULES)
    if membership == "invite" and "third_party_invite" in content:
        invite = content["third_party_invite"]
        signed = invite.get("signed") if isinstance(invite, Mapping) else None
        token = signed.get("token") if isinstance(signed, Mapping) else None
        if isinstance(token, str):
            types.add(("m.room.third_party_invite", token))
    authoriser = content.get("join_authorised_via_users_server")
    if room_version.restricted_join_rule and membership == "join" and isinstance(authoriser, str):
        types.add(("m.room.member", authoriser))
    return types


def check_auth_events_shape(
    room_version: RoomVersion,
    event: ParsedPdu,
    auth_events: Mapping[str, ParsedPdu],
    rejected: Container[str] = (),
    selection: set[StateKey] | None = None,
) -> dict[StateKey, ParsedPdu]:
    """Rule 2 (v1-v11; 3 in v12): the event's ``auth_events``, by ID in
    ``auth_events`` (more events may be there), are each known, in the
    event's room, not in ``rejected``, one per state key, each of a state
    key the selection allows, and the create event is among them (v12: the
    create event, ``$`` + the room ID's hash, must be in ``auth_events``
    though it is never listed, and not rejected: rule 2 of v12).

    Returns the auth events as a state map, the create event included.
    Raises AuthError.  For the create event: an empty map, whatever it cites
    (rule 1 allows or rejects it before this rule). ``selection``: the
    event's :func:`auth_types_for_event`, where the caller has it already.
    """
    n = _rule(room_version, "auth_events")
    if event.is_create:
        return {}  # rule 1 decides a create event: this rule is never reached
    allowed = auth_types_for_event(room_version, event) if selection is None else selection
    state: dict[StateKey, ParsedPdu] = {}
    for auth_id in event.auth_event_ids:
        auth_event = auth_events.get(auth_id)
        if auth_event is None:
            raise AuthError(f"rule {n}: auth event {auth_id} is missing")
        if auth_event.state_key is None:
            raise AuthError(f"rule {n}.2: auth event {auth_id} is not a state event")
        key = (auth_event.type, auth_event.state_key)
        _check_one_auth_event(event, auth_event, key, state, allowed, rejected, n)
        state[key] = auth_event
    if room_version.room_id_is_create_hash:
        create_id = create_event_id_of(event.room_id)
        create = auth_events.get(create_id)
        if create is None or not create.is_create or create_id in rejected:
            raise AuthError(f"rule 2: the room ID is not that of an accepted create event ({create_id})")
        state[CREATE] = create
    elif CREATE not in state:
        raise AuthError(f"rule {n}.4: no m.room.create event among the auth events")
    return state


def _check_one_auth_event(
    event: ParsedPdu,
    auth_event: ParsedPdu,
    key: StateKey,
    state: Mapping[StateKey, ParsedPdu],
    allowed: Container[StateKey],
    rejected: Container[str],
    n: int,
) -> None:
    """Rules n.1 (duplicates), n.2 (selection), n.3 (rejected), n.5 (room) for one auth event."""
    if auth_event.room_id != event.room_id:
        raise AuthError(f"rule {n}.5: auth event {auth_event.event_id} is in room {auth_event.room_id}")
    if key in state:
        raise AuthError(f"rule {n}.1: two auth events for {key}: {state[key].event_id}, {auth_event.event_id}")
    if key not in allowed:
        raise AuthError(f"rule {n}.2: auth event {auth_event.event_id} for {key} is not one the rules select")
    if auth_event.event_id in rejected:
        raise AuthError(f"rule {n}.3: auth event {auth_event.event_id} was rejected")


# ---------------------------------------------------------------- the rules against a state


def check_event_auth(room_version: RoomVersion, event: ParsedPdu, auth_state: Mapping[StateKey, ParsedPdu]) -> None:
    """Raise AuthError unless ``event`` is allowed in a room whose state (the
    part the rules read) is ``auth_state``, ``(type, state_key)`` -> event.

    Runs rule 1 (create events; they need no state) and every rule after
    the auth events' shape (:func:`check_auth_events_shape`).  The state
    must hold the room's create event; in v12 it must be the one the
    event's room ID names (rule 2).
    """
    if event.is_create:
        _check_create(room_version, event)
        return
    create = auth_state.get(CREATE)
    if create is None:
        raise AuthError(f"rule {_rule(room_version, 'auth_events')}: no m.room.create event in the state")
    if room_version.room_id_is_create_hash and create.event_id != create_event_id_of(event.room_id):
        raise AuthError(f"rule 2: room ID {event.room_id} is not the create event {create.event_id}'s")
    state = RoomState(room_version, auth_state)
    if create.content.get("m.federate", True) is False and server_of(event.sender) != server_of(create.sender):
        raise AuthError(
            f"rule {_rule(room_version, 'federate')}: the room is not federated and {event.sender} is of another server"
        )
    if event.type == "m.room.aliases" and room_version.special_case_aliases_auth:
        _check_aliases(event)
        return
    if event.type == "m.room.member":
        check_member_event(state, event, _rule(room_version, "member"))
        return
    _check_power(state, event)
    if event.type == "m.room.power_levels":
        _check_power_levels(state, event)
    if event.type == "m.room.redaction" and room_version.event_id_format is EventIdFormat.V1_V2:
        _check_v1_redaction(state, event)


def _check_create(room_version: RoomVersion, event: ParsedPdu) -> None:
    """Rule 1: the create event."""
    if event.prev_event_ids:
        raise AuthError("rule 1.1: the create event has prev_events")
    if room_version.room_id_is_create_hash:
        if "room_id" in event.event_dict:
            raise AuthError("rule 1.2: a room version 12 create event has a room_id")
    elif server_of(event.room_id) != server_of(event.sender):
        raise AuthError(f"rule 1.2: room ID {event.room_id} is not of the sender's server")
    declared = event.content.get("room_version", "1")
    if not isinstance(declared, str) or declared not in KNOWN_ROOM_VERSIONS:
        raise AuthError(f"rule 1.3: unknown room version {event.content.get('room_version')!r}")
    if not room_version.implicit_room_creator and "creator" not in event.content:
        raise AuthError("rule 1.4: the create event has no content.creator")
    if room_version.creators_have_infinite_power and "additional_creators" in event.content:
        additional = event.content["additional_creators"]
        if not isinstance(additional, list) or not all(is_valid_user_id(user) for user in additional):
            raise AuthError("rule 1.4: additional_creators is not an array of user IDs")


def _check_aliases(event: ParsedPdu) -> None:
    """Rule 4 of v1-v5: ``m.room.aliases``, allowed from the server its state key names."""
    if event.state_key is None:
        raise AuthError("rule 4.1: m.room.aliases without a state_key")
    if event.state_key != server_of(event.sender):
        raise AuthError(f"rule 4.2: the state_key {event.state_key!r} is not {event.sender}'s server")


def _check_power(state: RoomState, event: ParsedPdu) -> None:
    """Rules 6-9 (v12 numbering): the sender is joined; third-party invites
    need the invite level; the event type's required level; ``@`` state keys."""
    version = state.room_version
    if state.membership(event.sender) != "join":
        raise AuthError(f"rule {_rule(version, 'joined')}: {event.sender} is not joined")
    level = state.level_of(event.sender)
    if event.type == "m.room.third_party_invite":
        if level < state.named("invite"):
            raise AuthError(
                f"rule {_rule(version, 'third_party_invite')}.1: {event.sender}'s power is below the invite level"
            )
        return
    required = auth_levels.required_level(version, state.power_levels, event)
    if required > level:
        raise AuthError(
            f"rule {_rule(version, 'required')}: {event.type} needs power {required}, {event.sender} has {level}"
        )
    if event.state_key is not None and event.state_key.startswith("@") and event.state_key != event.sender:
        raise AuthError(f"rule {_rule(version, 'state_key')}: state_key {event.state_key!r} is another user's")


def _check_v1_redaction(state: RoomState, event: ParsedPdu) -> None:
    """Rule 11 of v1-v2: the redact level, or the redacted event's server is the redaction's."""
    if state.level_of(event.sender) >= state.named("redact"):
        return
    if event.redacts is None or server_of(event.redacts) == server_of(event.event_id):
        return
    raise AuthError(f"rule 11.3: {event.sender} may not redact {event.redacts}, another server's event")


# ---------------------------------------------------------------- m.room.power_levels


def _check_power_levels(state: RoomState, event: ParsedPdu) -> None:
    """Rule 10 (v12 numbering): the new power levels are readable, list no
    v12 creator, and change nothing above the sender's own level."""
    version = state.room_version
    n = _rule(version, "power_levels")
    new = _readable_levels(version, event, n)
    subrule = 4 if version.enforce_int_power_levels else 2  # "no previous power levels"
    if version.creators_have_infinite_power:
        listed = sorted(auth_levels.creators_of(version, state.create) & set(new["users"]))
        if listed:
            raise AuthError(f"rule {n}.4: power levels list the room's creators {listed} in users")
        subrule += 1
    if state.power_levels is None:
        return
    old = _levels(version, state.power_levels.content)
    sender_level = state.level_of(event.sender)
    for name in _NAMED_LEVELS:
        before, after = old["named"].get(name), new["named"].get(name)
        if before != after and (_above(before, sender_level) or _above(after, sender_level)):
            raise AuthError(
                f"rule {n}.{subrule + 1}: {event.sender} may not change {name} "
                f"from {before} to {after} with power {sender_level}"
            )
    groups = ("events", "notifications") if version.limit_notifications_power_levels else ("events",)
    for group in groups:
        _check_changes(old[group], new[group], sender_level, f"rule {n}.{subrule + 2}", group)
    for user in sorted(set(old["users"]) | set(new["users"])):
        before, after = old["users"].get(user), new["users"].get(user)
        if before == after:
            continue
        if user != event.sender and before is not None and before >= sender_level:
            raise AuthError(
                f"rule {n}.{subrule + 4}: {event.sender} may not change the level of {user} "
                f"({before}), not below their own ({sender_level})"
            )
        if _above(after, sender_level):
            raise AuthError(
                f"rule {n}.{subrule + 5}: {event.sender} may not give {user} {after}, "
                f"above their own power {sender_level}"
            )


def _above(level: int | None, sender_level: auth_levels.Level) -> bool:
    return level is not None and level > sender_level


def _check_changes(
    before_map: Mapping[str, int], after_map: Mapping[str, int], sender_level: auth_levels.Level, rule: str, group: str
) -> None:
    """Rules 10.7/10.8 (v12): entries of ``events`` or ``notifications``
    changed or removed must not be above the sender, nor added or changed to be."""
    for key in sorted(set(before_map) | set(after_map)):
        before, after = before_map.get(key), after_map.get(key)
        if before != after and (_above(before, sender_level) or _above(after, sender_level)):
            raise AuthError(f"{rule}: {group}.{key} may not change from {before} to {after} with power {sender_level}")


def _readable_levels(version: RoomVersion, event: ParsedPdu, n: int) -> dict[str, Any]:
    """Rules 10.1-10.3 (v12 numbering; 10.1 of v1-v9): the event's levels,
    every one readable in its version, ``users`` keyed by user IDs."""
    content = event.content
    users = content.get("users", {})
    if not isinstance(users, Mapping):
        raise AuthError(f"rule {n}.{3 if version.enforce_int_power_levels else 1}: users is not an object")
    for user, value in users.items():
        if not is_user_id_shaped(user) or auth_levels.parse_level(version, value) is None:
            raise AuthError(
                f"rule {n}.{3 if version.enforce_int_power_levels else 1}: "
                f"users.{user} = {value!r} is not a user ID with a level"
            )
    for name in _NAMED_LEVELS:
        if name in content and auth_levels.parse_level(version, content[name]) is None:
            raise AuthError(f"rule {n}.1: {name} = {content[name]!r} is not a power level")
    for group in ("events", "notifications"):
        if group not in content:
            continue
        values = content[group]
        if not isinstance(values, Mapping) or any(auth_levels.parse_level(version, v) is None for v in values.values()):
            raise AuthError(f"rule {n}.2: {group} is not an object of power levels")
    return _levels(version, content)


def _levels(version: RoomVersion, content: Mapping[str, Any]) -> dict[str, Any]:
    """The levels of power levels' content, read: unreadable ones left out."""

    def read(holder: object) -> dict[str, int]:
        if not isinstance(holder, Mapping):
            return {}
        values = {key: auth_levels.parse_level(version, value, lenient=True) for key, value in holder.items()}
        return {key: value for key, value in values.items() if value is not None}

    named = read({name: content[name] for name in _NAMED_LEVELS if name in content})
    return {
        "named": named,
        "users": read(content.get("users")),
        "events": read(content.get("events")),
        "notifications": read(content.get("notifications")),
    }
