"""State resolution, pure: the algorithms of room version 1 (v1), 2-11 (v2)
and 12 (v2.1), over an :class:`EventSource` the caller hands in.

Imports only ``roomstore.pdu`` (its auth rules decide what each algorithm's
auth checks allow); the store implements :class:`EventSource` from its tables,
:class:`MemoryEventSource` from events in memory.

    resolve_state(room_version, [state_a, state_b], source) -> resolved state

A state is ``(event type, state key) -> event ID``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from roomstore.pdu.auth_common import StateKey
from roomstore.pdu.room_versions import RoomVersion
from roomstore.resolution.events import ResolutionError
from roomstore.resolution.source import EventSource, MemoryEventSource, auth_chain_difference, conflicted_subgraph
from roomstore.resolution.v1 import resolve_v1
from roomstore.resolution.v2 import resolve_v2

__all__ = [
    "EventSource",
    "MemoryEventSource",
    "ResolutionError",
    "auth_chain_difference",
    "conflicted_subgraph",
    "resolve_state",
]


def resolve_state(
    room_version: RoomVersion, state_sets: Sequence[Mapping[StateKey, str]], source: EventSource
) -> dict[StateKey, str]:
    """The resolution of ``state_sets`` (the states after each prev event)
    by ``room_version``'s algorithm.  No set: the empty state; one: itself.

    Raises ResolutionError when an event read is of another room.
    """
    if not state_sets:
        return {}
    if len(state_sets) == 1:
        return dict(state_sets[0])
    if room_version.state_res == 1:
        return resolve_v1(room_version, state_sets, source)
    return resolve_v2(room_version, state_sets, source)
