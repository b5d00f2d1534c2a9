"""A sync's rooms as ``/sync`` serves them: each timeline trimmed to its
limit, its ``prev_batch`` pagination token and its state block.

``plan_state`` decides, per room, from the window's visible events (oldest
first, one more than the limit when more exist) what the room's timeline
holds and which state block it needs; ``room_timelines`` reads, in one
transaction, the timeline events' pagination keys and the state groups the
blocks come from (the state before the timeline's first event, the state at
``since`` for a difference, a room's current state for an empty timeline),
then the state events through the event cache.

The state block is given whole to the user, who is (or was, up to the end
of a timeline that ends with their leave) a member of the room: the spec
gives members the room's state whatever its history visibility.

Who calls it: ``roomstore.events.sync``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from roomstore.events.tables.events import stored_events_txn
from roomstore.events.tables.events.timeline_reads import newest_timeline_event_sql
from roomstore.events.timeline import TimelineReader, stream_bound_sql
from roomstore.events.tokens import StreamToken, TopologicalToken
from roomstore.storage.database import Transaction

__all__ = ["RoomTimeline", "TimelinePlan", "plan_state", "room_timelines"]

StateIds = dict[tuple[str, str], str]

#: Which state block a room's timeline needs.
FULL, CHANGES, NONE = "full", "changes", "none"


@attrs.frozen
class RoomTimeline:
    """A room's part of a sync, as the client-server API's ``/sync`` has it.

    ``events``: the newest visible events of the window, oldest first (stream
    order), at most the limit asked. ``limited``: visible events of the
    window were left out. ``prev_batch``: a ``paginate`` token just before
    the timeline (``t`` form: just before its first event in topological
    order; the sync's ``next_token`` when the timeline is empty):
    back-pagination from it serves the visible events before the timeline,
    newest first (where a room's forks make its stream order and its
    topological order differ, the events older in stream order than the
    timeline but after its first event in topological order are in
    neither). ``state``: the state block, state events not in the timeline,
    ordered by ``(type, state_key)``: the full state at the start of the
    timeline (the state before its first event; the current state when it
    is empty) on an initial sync, with ``full_state``, or for a room the user
    joined in the window; otherwise, when ``limited``, the entries of that
    state that differ from the state at ``since`` (the state after the
    room's newest event at or before it); else none.
    """

    events: list[dict]
    limited: bool
    prev_batch: str
    state: list[dict]


@attrs.frozen
class TimelinePlan:
    """A room's timeline before its token and state are read: the events
    kept, whether some were left out, and the state block it needs
    (``FULL``, ``CHANGES`` or ``NONE``)."""

    room_id: str
    events: list[dict]
    limited: bool
    block: str


def plan_state(room_id: str, window: list[dict], limit: int | None, full: bool) -> TimelinePlan:
    """The newest ``limit`` (None: all) of ``window`` (oldest first) and the
    state block: ``full`` (an initial sync, ``full_state``, newly joined),
    else the changes when events were left out, else none."""
    events = window[len(window) - limit :] if limit is not None and len(window) > limit else list(window)
    limited = len(events) < len(window)
    return TimelinePlan(room_id, events, limited, FULL if full else CHANGES if limited else NONE)


async def room_timelines(
    timeline: TimelineReader,
    plans: Mapping[str, TimelinePlan],
    empty_token: str,
    since: StreamToken | None,
    known_keys: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, RoomTimeline]:
    """Each plan's ``RoomTimeline``: one transaction for the keys and state
    ids (none when ``known_keys``, event ID -> (topological, stream) key,
    holds every timeline event's and no plan needs a state block), then the
    state events (event cache, one read for the rest). ``empty_token``: the
    ``prev_batch`` of an empty timeline; ``since``: the position a
    ``CHANGES`` block is measured from."""
    keys = dict(known_keys or {})
    unknown = [e["event_id"] for plan in plans.values() for e in plan.events if e["event_id"] not in keys]
    states: dict[str, StateIds] = {}
    if unknown or any(plan.block != NONE for plan in plans.values()):
        since_bound = None if since is None else timeline.positions.per_writer(since)
        read_keys, states = await timeline.db.run_interaction(
            "sync_state", _keys_and_state_txn, timeline, list(plans.values()), unknown, since_bound
        )
        keys.update(read_keys)
    wanted = {event_id for state in states.values() for event_id in state.values()}
    served = await timeline.events.get_events(sorted(wanted)) if wanted else {}
    result = {}
    for room_id, plan in plans.items():
        found = [keys[e["event_id"]] for e in plan.events if e["event_id"] in keys]
        if found:
            topo, stream = min(found)
            prev_batch = TopologicalToken(topo, stream - 1).to_string()
        else:
            prev_batch = empty_token
        state = states.get(room_id, {})
        block = [served[state[key]] for key in sorted(state) if state[key] in served]
        result[room_id] = RoomTimeline(plan.events, plan.limited, prev_batch, block)
    return result


def _keys_and_state_txn(
    txn: Transaction,
    timeline: TimelineReader,
    plans: list[TimelinePlan],
    unknown: list[str],
    since: tuple[int, dict[str, int]] | None,
) -> tuple[dict[str, tuple[int, int]], dict[str, StateIds]]:
    """``(event ID -> (topological, stream) key of the ``unknown`` events,
    room ID -> its state block's IDs, timeline events left out)``."""
    reader, interners = timeline.events, timeline.interners
    nids = interners.events.lookup(txn, unknown) if unknown else {}
    rows = stored_events_txn(txn, nids.values()) if nids else {}
    keys = {
        event_id: (row.topological_ordering, row.stream_ordering)
        for event_id, nid in nids.items()
        if (row := rows.get(nid)) is not None
    }
    needing = [plan for plan in plans if plan.block != NONE]
    firsts = {plan.room_id: plan.events[0]["event_id"] for plan in needing if plan.events}
    before = reader.state_ids_for_events_txn(txn, list(firsts.values()), True) if firsts else {}
    changes = [plan.room_id for plan in needing if plan.block == CHANGES]
    at_since = _events_at_txn(txn, timeline, changes, since) if changes and since is not None else {}
    after = reader.state_ids_for_events_txn(txn, list(at_since.values()), False) if at_since else {}
    states: dict[str, StateIds] = {}
    for plan in needing:
        if plan.room_id in firsts:
            start = before.get(firsts[plan.room_id], {})
        else:
            start = reader.current_state_txn(txn, plan.room_id, None)
        if plan.block == CHANGES:
            then = after.get(at_since.get(plan.room_id, ""), {})
            start = {key: event_id for key, event_id in start.items() if then.get(key) != event_id}
        shown = {e["event_id"] for e in plan.events}
        states[plan.room_id] = {key: event_id for key, event_id in start.items() if event_id not in shown}
    return keys, states


def _events_at_txn(
    txn: Transaction,
    timeline: TimelineReader,
    room_ids: list[str],
    since: tuple[int, dict[str, int]],
) -> dict[str, str]:
    """Room ID -> its newest timeline event (no outlier, not rejected, not
    soft-failed) at or before the stream position ``since``: the state
    after it is the room's state at that position."""
    room_nids = timeline.interners.rooms.lookup(txn, room_ids)
    at_sql, at_params = stream_bound_sql("e", "<=", since[0], since[1])
    found = {}
    for room_id, room_nid in room_nids.items():
        row = txn.execute(newest_timeline_event_sql(at_sql), [room_nid, False, *at_params]).fetchone()
        if row is not None:
            found[room_id] = row[0]
    return found
