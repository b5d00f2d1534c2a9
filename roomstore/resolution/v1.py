"""State resolution v1 (room version 1), as the spec's room version 1 page
defines it, with the details the spec leaves open read as Synapse reads
them (its rooms are the ones to converge with):

* A key is conflicted when two state sets hold different events for it; a
  key only some sets hold is not conflicted.
* *R*, the state the conflicted events are checked against, starts as the
  unconflicted events of the keys the conflicted events' auth rules select.
* Power levels, then join rules, then members: each key's events sorted by
  ascending ``depth`` then descending ``sha1(event_id)``; the first is taken,
  then each next one replaces it while the auth rules allow it against *R*
  holding the one taken so far.  Every member key is resolved against the
  same *R* (the power levels and join rules chosen), then *R* takes them.
* Other keys: the event of highest depth (then lowest sha1) that the rules
  allow against *R*; when none is allowed, the one of lowest depth.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from roomstore.pdu.auth_common import POWER_LEVELS, AuthError, StateKey
from roomstore.pdu.auth_rules import auth_types_for_event, check_event_auth
from roomstore.pdu.parsing import ParsedPdu
from roomstore.pdu.room_versions import RoomVersion
from roomstore.resolution.events import EventCache
from roomstore.resolution.source import EventSource

__all__ = ["resolve_v1"]

StateMap = Mapping[StateKey, str]


def _split(state_sets: Sequence[StateMap]) -> tuple[dict[StateKey, str], dict[StateKey, set[str]]]:
    unconflicted: dict[StateKey, str] = {}
    conflicted: dict[StateKey, set[str]] = {}
    for state_set in state_sets:
        for key, event_id in state_set.items():
            if key in conflicted:
                conflicted[key].add(event_id)
            elif key in unconflicted and unconflicted[key] != event_id:
                conflicted[key] = {unconflicted.pop(key), event_id}
            elif key not in unconflicted:
                unconflicted[key] = event_id
    return unconflicted, conflicted


def resolve_v1(room_version: RoomVersion, state_sets: Sequence[StateMap], source: EventSource) -> dict[StateKey, str]:
    """The resolution of ``state_sets`` by the original algorithm."""
    unconflicted, conflicted_ids = _split(state_sets)
    if not conflicted_ids:
        return unconflicted
    cache = EventCache(None, source)
    cache.load(set().union(*conflicted_ids.values()))
    needed = set()
    for ids in conflicted_ids.values():
        for event_id in ids:
            if event_id in cache.events:
                needed |= auth_types_for_event(room_version, cache.events[event_id])
    cache.load(unconflicted[key] for key in needed if key in unconflicted)
    auth = {
        key: cache.events[unconflicted[key]]
        for key in needed
        if key in unconflicted and unconflicted[key] in cache.events
    }
    conflicted: dict[StateKey, list[ParsedPdu]] = {}
    for key, ids in conflicted_ids.items():
        events = [cache.events[e] for e in ids if e in cache.events]
        if len(events) > 1:
            conflicted[key] = events
        elif events:
            unconflicted[key] = events[0].event_id
    resolved = _resolve(room_version, conflicted, auth)
    return {**unconflicted, **{key: event.event_id for key, event in resolved.items()}}


def _resolve(
    room_version: RoomVersion, conflicted: Mapping[StateKey, list[ParsedPdu]], auth: dict[StateKey, ParsedPdu]
) -> dict[StateKey, ParsedPdu]:
    resolved: dict[StateKey, ParsedPdu] = {}
    if POWER_LEVELS in conflicted:
        resolved[POWER_LEVELS] = _resolve_auth_key(room_version, POWER_LEVELS, conflicted[POWER_LEVELS], auth)
    auth.update(resolved)
    for event_type in ("m.room.join_rules", "m.room.member"):
        for key, events in conflicted.items():
            if key[0] == event_type:
                resolved[key] = _resolve_auth_key(room_version, key, events, auth)
        auth.update(resolved)
    for key, events in conflicted.items():
        if key not in resolved:
            resolved[key] = _resolve_other_key(room_version, events, auth)
    return resolved


def _order(events: list[ParsedPdu]) -> list[ParsedPdu]:
    """Highest depth first, then lowest sha1 of the event ID."""
    return sorted(events, key=lambda e: (-e.depth, hashlib.sha1(e.event_id.encode("utf-8")).hexdigest()))


def _allowed(room_version: RoomVersion, event: ParsedPdu, auth: Mapping[StateKey, ParsedPdu]) -> bool:
    try:
        check_event_auth(room_version, event, auth)
    except AuthError:
        return False
    return True


def _resolve_auth_key(
    room_version: RoomVersion, key: StateKey, events: list[ParsedPdu], auth: Mapping[StateKey, ParsedPdu]
) -> ParsedPdu:
    """Power levels, join rules or a member key (``key``, which every one
    of ``events`` fills): the chain of allowed replacements."""
    ordered = list(reversed(_order(events)))
    keys = set().union(*(auth_types_for_event(room_version, event) for event in events))
    state = {key: auth[key] for key in keys if key in auth}
    taken = ordered[0]
    for event in ordered[1:]:
        state[key] = taken
        if not _allowed(room_version, event, state):
            return taken
        taken = event
    return taken


def _resolve_other_key(
    room_version: RoomVersion, events: list[ParsedPdu], auth: Mapping[StateKey, ParsedPdu]
) -> ParsedPdu:
    ordered = _order(events)
    for event in ordered:
        if _allowed(room_version, event, auth):
            return event
    return ordered[-1]
