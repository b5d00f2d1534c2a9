"""What state resolution reads: events by ID, which of them were rejected,
and two questions about the auth graph, behind :class:`EventSource`.

The store answers them from its tables (``event_auth_edges`` for the graph);
:class:`MemoryEventSource` answers them from a dict of events, with the pure
walks below, for tests and for callers holding the events in memory.

Auth chains here include the events they start from, as Synapse's store
computes them: the *full auth chain* of a state set is its events and every
event reachable from them through ``auth_events`` (and, from room version
12, the implied create event: ``ParsedPdu.auth_chain_event_ids``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from roomstore.pdu.parsing import ParsedPdu

__all__ = ["EventSource", "MemoryEventSource", "auth_chain", "auth_chain_difference", "conflicted_subgraph"]

#: event ID -> the IDs of its auth events (empty for an unknown event).
AuthEdges = Callable[[str], Iterable[str]]


class EventSource(Protocol):
    """What the resolution algorithms ask of a store.  Synchronous: a store
    built on Twisted runs the resolution in a thread."""

    def get_events(self, event_ids: Iterable[str]) -> Mapping[str, ParsedPdu]:
        """The events of ``event_ids`` that are known (unknown ones left out),
        rejected ones included."""

    def rejected(self, event_ids: Iterable[str]) -> set[str]:
        """Those of ``event_ids`` stored as rejected."""

    def auth_chain_difference(self, state_sets: Sequence[set[str]]) -> set[str]:
        """The union less the intersection of the state sets' full auth
        chains (each chain including the set's own events).  An event's
        auth edges are ``ParsedPdu.auth_chain_event_ids``: in room version
        12 the implied create event is one."""

    def conflicted_subgraph(self, conflicted: set[str]) -> set[str]:
        """The events on some ``auth_events`` path between two events of
        ``conflicted``, the endpoints included (state resolution v2.1)."""


def auth_chain(start: Iterable[str], auth_of: AuthEdges) -> set[str]:
    """``start`` and every event reachable from it through auth events."""
    seen: set[str] = set()
    stack = list(start)
    while stack:
        event_id = stack.pop()
        if event_id in seen:
            continue
        seen.add(event_id)
        stack.extend(auth_id for auth_id in auth_of(event_id) if auth_id not in seen)
    return seen


def auth_chain_difference(state_sets: Sequence[set[str]], auth_of: AuthEdges) -> set[str]:
    """The spec's *auth difference*: ∪ Cᵢ − ∩ Cᵢ over the full auth chains Cᵢ."""
    if not state_sets:
        return set()
    chains = [auth_chain(state_set, auth_of) for state_set in state_sets]
    return set[str]().union(*chains) - chains[0].intersection(*chains[1:])


def conflicted_subgraph(conflicted: set[str], auth_of: AuthEdges) -> set[str]:
    """The spec's *conflicted state subgraph* (room version 12): the events
    reachable from a conflicted event that themselves reach a conflicted
    event, through ``auth_events``; the conflicted events included."""
    below = auth_chain(conflicted, auth_of)
    reaches: dict[str, bool] = {}
    entered: set[str] = set()  # a (malformed, v1/v2) cycle is walked once
    for root in below:
        # Iterative post-order: an event reaches a conflicted event if it is
        # one, or one of its auth events does.
        stack = [(root, False)]
        while stack:
            event_id, expanded = stack.pop()
            if event_id in reaches or (not expanded and event_id in entered):
                continue
            parents = [a for a in auth_of(event_id) if a in below]
            if not expanded:
                entered.add(event_id)
                stack.append((event_id, True))
                stack.extend((a, False) for a in parents if a not in entered)
                continue
            reaches[event_id] = event_id in conflicted or any(reaches.get(a, False) for a in parents)
    return {event_id for event_id, hit in reaches.items() if hit}


class MemoryEventSource:
    """An :class:`EventSource` over events held in memory."""

    def __init__(self, events: Mapping[str, ParsedPdu], rejected: Iterable[str] = ()) -> None:
        self.events = events
        self._rejected = frozenset(rejected)

    def _auth_of(self, event_id: str) -> Iterable[str]:
        event = self.events.get(event_id)
        return () if event is None else event.auth_chain_event_ids

    def get_events(self, event_ids: Iterable[str]) -> Mapping[str, ParsedPdu]:
        return {event_id: self.events[event_id] for event_id in event_ids if event_id in self.events}

    def rejected(self, event_ids: Iterable[str]) -> set[str]:
        return {event_id for event_id in event_ids if event_id in self._rejected}

    def auth_chain_difference(self, state_sets: Sequence[set[str]]) -> set[str]:
        return auth_chain_difference(state_sets, self._auth_of)

    def conflicted_subgraph(self, conflicted: set[str]) -> set[str]:
        return conflicted_subgraph(conflicted, self._auth_of)
