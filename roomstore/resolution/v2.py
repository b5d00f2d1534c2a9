"""State resolution v2 (room versions 2-11) and v2.1 (room version 12,
MSC4297), as the spec's room version 2 and 12 pages define them.

1. Split the state sets into the unconflicted state map and the conflicted
   state set (a key missing from some set is conflicted).
2. The *full conflicted set*: the conflicted events, the auth difference,
   and in v2.1 the conflicted state subgraph.
3. The power events of the full conflicted set, with the events of their
   auth chains that are in it, in *reverse topological power ordering*
   (Kahn's algorithm; ties: the sender's power level by the event's own auth
   events, higher first, then ``origin_server_ts``, then ``event_id``).
4. Iterative auth checks of those, from the unconflicted state (v2) or an
   empty state (v2.1).
5. The other events in *mainline ordering* of the resulting power levels,
   and iterative auth checks of them from that state.
6. The unconflicted state map applied over the result.

Readings, each as Synapse reads the spec:

* The create event is a power event (the spec lists power levels, join
  rules and kicks/bans); in v2.1 it thereby comes first.  Only state key
  ``""`` makes power levels or join rules events power events.
* Iterative auth checks skip events stored *rejected*; the spec would admit
  an event rejected for the state at it when it passes against the partial
  state, Synapse keeps it out (its issue 13797), and converging with the
  servers of the room matters more.
* Events the source does not know are left out of the full conflicted set
  and of an event's auth events.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from roomstore.pdu.auth_common import CREATE, POWER_LEVELS, AuthError, StateKey
from roomstore.pdu.auth_rules import auth_types_for_event, check_event_auth
from roomstore.pdu.parsing import ParsedPdu
from roomstore.pdu.room_versions import RoomVersion
from roomstore.resolution.events import EventCache
from roomstore.resolution.source import EventSource

__all__ = [
    "is_power_event",
    "iterative_auth_checks",
    "mainline_order",
    "resolve_v2",
    "reverse_topological_power_order",
    "split_conflicts",
]

StateMap = Mapping[StateKey, str]


def split_conflicts(state_sets: Sequence[StateMap]) -> tuple[dict[StateKey, str], dict[StateKey, set[str]]]:
    """(unconflicted state map, conflicted event IDs by key): a key is
    unconflicted when every set has it with the same event."""
    keys = set().union(*state_sets)
    unconflicted: dict[StateKey, str] = {}
    conflicted: dict[StateKey, set[str]] = {}
    for key in keys:
        values = {state_set.get(key) for state_set in state_sets}
        present = {value for value in values if value is not None}
        if len(values) == 1 and present:
            unconflicted[key] = present.pop()
        else:
            conflicted[key] = present
    return unconflicted, conflicted


def is_power_event(event: ParsedPdu) -> bool:
    """Power levels, join rules, the create event, a kick or a ban."""
    if (event.type, event.state_key) in (POWER_LEVELS, ("m.room.join_rules", ""), CREATE):
        return True
    return event.type == "m.room.member" and event.membership in ("leave", "ban") and event.sender != event.state_key


def resolve_v2(room_version: RoomVersion, state_sets: Sequence[StateMap], source: EventSource) -> dict[StateKey, str]:
    """The resolution of ``state_sets`` by state resolution v2 or v2.1."""
    unconflicted, conflicted = split_conflicts(state_sets)
    if not conflicted:
        return unconflicted
    conflicted_ids = set().union(*conflicted.values())
    full = conflicted_ids | source.auth_chain_difference([set(s.values()) for s in state_sets])
    if room_version.state_res_v2_1:
        full |= source.conflicted_subgraph(conflicted_ids)
    cache = EventCache(None, source)
    cache.load(full)
    full = {event_id for event_id in full if event_id in cache.events}
    cache.load_auth_events(full)
    base = {} if room_version.state_res_v2_1 else dict(unconflicted)
    # The base events the auth checks will read, in one fetch.
    cache.load(
        {
            base[key]
            for event_id in full
            for key in auth_types_for_event(room_version, cache.events[event_id])
            if key in base
        }
    )
    power = reverse_topological_power_order(
        room_version, [e for e in full if is_power_event(cache.events[e])], full, cache
    )
    state = iterative_auth_checks(room_version, power, base, cache)
    taken = set(power)
    rest = mainline_order([e for e in full if e not in taken], state.get(POWER_LEVELS), cache)
    state = iterative_auth_checks(room_version, rest, state, cache)
    state.update(unconflicted)
    return state


def reverse_topological_power_order(
    room_version: RoomVersion, power_ids: Iterable[str], full: set[str], cache: EventCache
) -> list[str]:
    """The power events and the events of their auth chains in ``full``,
    earliest first: Kahn's algorithm picking, among the events whose auth
    events are all placed, the sender of highest power, then the lowest
    ``origin_server_ts``, then the lowest ``event_id``."""
    graph: dict[str, set[str]] = {}
    stack = list(power_ids)
    while stack:
        event_id = stack.pop()
        if event_id in graph:
            continue
        event = cache.events[event_id]
        graph[event_id] = {a for a in event.auth_chain_event_ids if a in full}
        stack.extend(a for a in graph[event_id] if a not in graph)
    children: dict[str, list[str]] = {event_id: [] for event_id in graph}
    for event_id, parents in graph.items():
        for parent in parents:
            children[parent].append(event_id)

    def key(event_id: str) -> tuple[float, int, str]:
        event = cache.events[event_id]
        return (-cache.sender_level(room_version, event), event.origin_server_ts, event_id)

    waiting = {event_id: len(parents) for event_id, parents in graph.items()}
    ready = [key(event_id) for event_id, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        event_id = heapq.heappop(ready)[2]
        order.append(event_id)
        for child in children[event_id]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, key(child))
    return order


def iterative_auth_checks(
    room_version: RoomVersion, event_ids: Sequence[str], base: Mapping[StateKey, str], cache: EventCache
) -> dict[StateKey, str]:
    """Apply each event in turn to a copy of ``base`` if the auth rules
    allow it against that state, completed by the event's own (not
    rejected) auth events for the keys the state lacks."""
    state = dict(base)
    for event_id in event_ids:
        if cache.is_rejected(event_id):
            continue
        event = cache.events[event_id]
        if event.state_key is None:  # a non-state event (an auth chain may cite one) fills no state key
            continue
        auth: dict[StateKey, ParsedPdu] = {}
        for auth_id in event.auth_chain_event_ids:
            auth_event = cache.get(auth_id)
            if auth_event is not None and auth_event.state_key is not None and not cache.is_rejected(auth_id):
                auth[(auth_event.type, auth_event.state_key)] = auth_event
        for key in auth_types_for_event(room_version, event) | {CREATE}:
            current = state.get(key)
            if current is None or cache.is_rejected(current):
                continue
            current_event = cache.get(current)
            if current_event is not None:
                auth[key] = current_event
        try:
            check_event_auth(room_version, event, auth)
        except AuthError:
            continue
        state[(event.type, event.state_key)] = event_id
    return state


def mainline_order(event_ids: Sequence[str], power_levels_id: str | None, cache: EventCache) -> list[str]:
    """``event_ids`` in mainline ordering based on the power levels event
    ``power_levels_id``: the event whose power levels chain meets the
    mainline earlier first, then ``origin_server_ts``, then ``event_id``."""
    mainline: list[str] = []
    current = cache.get(power_levels_id) if power_levels_id else None
    while current is not None:
        mainline.append(current.event_id)
        current = cache.auth_event_of(current, POWER_LEVELS)
    # Depth counted from the mainline's oldest event (1); an event whose
    # chain never meets it gets 0, so sorts first.
    depth_of = {event_id: len(mainline) - index for index, event_id in enumerate(mainline)}

    def depth(event: ParsedPdu | None) -> int:
        walked: list[str] = []
        found = 0
        while event is not None and event.event_id not in walked:
            if event.event_id in depth_of:
                found = depth_of[event.event_id]
                break
            walked.append(event.event_id)
            event = cache.auth_event_of(event, POWER_LEVELS)
        for event_id in walked:  # every event of the walk meets the mainline there too
            depth_of[event_id] = found
        return found

    def key(event_id: str) -> tuple[int, int, str]:
        event = cache.events[event_id]
        return (depth(event), event.origin_server_ts, event_id)

    return sorted(event_ids, key=key)
