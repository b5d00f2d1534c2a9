"""A room's ends after a batch: its extremities and the current state that
follows them (the rows of ``forward_extremities``, ``backward_extremities``,
``current_state``, ``current_state_deltas`` and ``current_memberships``,
written through their owner ``roomstore.events.tables.room_state``).

These run inside the batch's transaction; most take ``w``, the
persister's batch writer (``roomstore.events.write.persist._BatchWriter``), for its
interned maps, its pending state groups and its helpers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from roomstore.events.resolution_source import resolve_interned
from roomstore.events.tables.event_graph import pointed_at_txn
from roomstore.events.tables.room_state import (
    current_and_forward_groups_txn,
    forward_groups_txn,
    queue_current_state_changes,
    queue_extremity_changes,
    queue_membership_changes,
)
from roomstore.events.write.batch import PreparedEvent
from roomstore.state.deltas import state_diff
from roomstore.storage.database import Transaction
from roomstore.storage.interning import queue_activity, queue_current_state_group
from roomstore.visibility.codes import NO_MEMBERSHIP_CODE

MEMBER = "m.room.member"


class RoomEnds:
    """The forward extremities of the rooms a batch touches, and their state
    groups, as the batch's events move them: read once per room, then kept
    up to date event by event (the tables change only at the batch's end).
    The room's current state as each event arrives, for soft failure
    (``roomstore.events.write.auth_checks``)."""

    def __init__(self, txn: Transaction) -> None:
        self.txn = txn
        self._rooms: dict[int, dict[int, int | None]] = {}
        #: Moves of rooms not read yet: (prev nids, event nid, its group),
        #: replayed on the read, so a batch no check needs the ends of
        #: (a trusted import) never reads them.
        self._moves: dict[int, list[tuple[list[int], int, int | None]]] = {}

    def of(self, room_nid: int) -> dict[int, int | None]:
        """``{extremity nid: its state group}`` of the room now."""
        ends = self._rooms.get(room_nid)
        if ends is None:
            ends = self._rooms[room_nid] = dict(forward_groups_txn(self.txn, room_nid))
            for prevs, event_nid, group_after in self._moves.pop(room_nid, ()):
                self._move(ends, prevs, event_nid, group_after)
        return ends

    def advance(
        self, ev: PreparedEvent, room_nid: int, event_nid: int, group_after: int | None, event_nids: Mapping[str, int]
    ) -> None:
        """A live, accepted graph event replaces its prev events among the room's ends."""
        if ev.backfilled or ev.rejected_reason or ev.soft_failed:
            return
        prevs = [event_nids[p] for p in ev.pdu.prev_event_ids]
        ends = self._rooms.get(room_nid)
        if ends is None:
            self._moves.setdefault(room_nid, []).append((prevs, event_nid, group_after))
        else:
            self._move(ends, prevs, event_nid, group_after)

    @staticmethod
    def _move(ends: dict[int, int | None], prevs: list[int], event_nid: int, group_after: int | None) -> None:
        for prev in prevs:
            ends.pop(prev, None)
        ends[event_nid] = group_after


def update_extremities(w: Any, new_events: Sequence[PreparedEvent], rooms: set[int]) -> None:
    """Forward and backward extremities after the batch's ``new_events``."""
    txn = w.txn
    nid = w.event_nids
    graph_events = [ev for ev in new_events if not ev.outlier]
    if not graph_events:
        return
    new_nids = {nid[ev.event_id] for ev in graph_events}
    backfilled = {nid[ev.event_id] for ev in graph_events if ev.backfilled}
    room_nids = w.p.interners.rooms.lookup(txn, {ev.pdu.room_id for ev in graph_events})
    room_of = {nid[ev.event_id]: room_nids[ev.pdu.room_id] for ev in graph_events}
    referenced = {(room_of[nid[ev.event_id]], nid[p]) for ev in graph_events for p in ev.pdu.prev_event_ids}

    # Forward: prev events of live events stop being extremities; a live
    # event is one unless something stored already points at it (it
    # arrived late). Backfilled events are history, never the room's leaves;
    # a rejected event is never one, nor does it end its prev events' turn
    # (as Synapse: a room's leaves are events a new event may build on).
    accepted = [ev for ev in graph_events if not ev.rejected_reason and not ev.soft_failed]
    live_referenced = {
        (room_of[nid[ev.event_id]], nid[p]) for ev in accepted if not ev.backfilled for p in ev.pdu.prev_event_ids
    }
    # (A fresh nid was never stored, so never an extremity.)
    forward_gone = [pair for pair in live_referenced if pair[1] not in w.fresh_nids]
    # Fresh nids: only this batch's events can point at them.
    pointed_at = {nid[p] for ev in accepted for p in ev.pdu.prev_event_ids}
    pointed_at |= pointed_at_txn(txn, new_nids - w.fresh_nids)
    rejected = {nid[ev.event_id] for ev in graph_events if ev.rejected_reason or ev.soft_failed}
    forward_new = sorted({(room_of[n], n) for n in new_nids - backfilled - rejected if n not in pointed_at})
    # Backward: prev events we do not have as graph events; a new event
    # fills the gap it was.
    prev_nids = {p for _, p in referenced}
    have = {n for n, r in w.stored_events(prev_nids).items() if not r.outlier} | new_nids
    missing = sorted({(room, p) for room, p in referenced if p not in have})
    backward_gone = [(room_of[n], n) for n in new_nids if n not in w.fresh_nids]
    queue_extremity_changes(txn, forward_gone, forward_new, missing, backward_gone)


def update_current_state(w: Any, room_nid: int, room_id: str, position: int) -> bool:
    """Recompute current state from the forward extremities; True if it changed."""
    txn = w.txn
    # The room's current group and its extremities' groups, in one go.
    rows = current_and_forward_groups_txn(txn, room_nid)
    groups = sorted({r[1] for r in rows if r[1] is not None})
    if not groups:
        return False
    old_group = rows[0][0]
    new_group, new_state = _current_group(w, room_nid, room_id, groups)
    if new_group == old_group:
        return False
    old_state = w.full_state(old_group)
    changed = {k for k in set(old_state) | set(new_state) if old_state.get(k) != new_state.get(k)}
    queue_current_state_group(txn, room_nid, new_group)
    if not changed:
        return False
    w.names_of_keys(changed)
    removed = [(room_nid, k) for k in changed if k not in new_state]
    upserts = sorted((room_nid, k, new_state[k]) for k in changed if k in new_state)
    deltas = [(position, w.p.instance_name, room_nid, k, new_state.get(k), old_state.get(k)) for k in sorted(changed)]
    queue_current_state_changes(txn, removed, upserts, deltas)
    _update_current_memberships(w, room_nid, changed, new_state, position)
    return True


def _current_group(w: Any, room_nid: int, room_id: str, groups: list[int]) -> tuple[int, dict[int, int]]:
    """(group, state) of the room's current state from its extremities'
    ``groups``: the one state they hold, or where they differ the room
    version's state resolution of them, or the room's resolved state where
    the caller gave one (an importer carrying its source's resolution)."""
    if len(groups) == 1:
        return groups[0], w.full_state(groups[0])
    states = [w.full_state(g) for g in groups]
    if all(state == states[0] for state in states[1:]):
        return groups[0], states[0]
    if room_id in w.resolved:
        resolved = w.resolved[room_id]
        w.intern_keys(resolved)
        ids = w.p.interners.events.intern(w.txn, resolved.values())
        new_state = {w.key_nids[k]: ids[e] for k, e in resolved.items()}
        base = groups[-1]
        base_state = w.full_state(base)
    else:
        room_version = next(ev.pdu.room_version for ev in w.pending_events.values() if ev.pdu.room_id == room_id)
        new_state = resolve_interned(w, room_version, states)
        base = groups[0]
        base_state = states[0]
    delta = state_diff(new_state, base_state)
    return (w.new_group(room_nid, None, base, delta) if delta else base), new_state


def _update_current_memberships(w: Any, room_nid: int, changed: set[int], new_state: dict, position: int) -> None:
    """Current memberships follow the member keys of current state."""
    member_changes = [k for k in changed if w.key_names[k][0] == MEMBER]
    if not member_changes:
        return
    w.intern_users(w.key_names[k][1] for k in member_changes)
    w.load_event_facts([new_state[k] for k in member_changes if k in new_state])
    gone = [(room_nid, w.user_nids[w.key_names[k][1]]) for k in member_changes if k not in new_state]
    rows = []
    for k in member_changes:
        if k in new_state:
            event = new_state[k]
            rows.append(
                (
                    room_nid,
                    w.user_nids[w.key_names[k][1]],
                    w.membership_of_event.get(event, NO_MEMBERSHIP_CODE),
                    event,
                    position,
                )
            )
    queue_membership_changes(w.txn, gone, sorted(rows))


def note_activity(
    txn: Transaction, new_events: Sequence[PreparedEvent], room_nids: Mapping[str, int], ordering: Mapping[str, int]
) -> None:
    """Move ``rooms.activity`` up to each room's newest timeline event in the batch.

    The column only grows: a batch of backfilled (negative) orderings, or
    a writer whose IDs trail another's, never moves it down.
    """
    newest: dict[int, int] = {}
    for ev in new_events:
        if ev.outlier or ev.rejected_reason or ev.soft_failed:
            continue
        room_nid, stream = room_nids[ev.pdu.room_id], ordering[ev.event_id]
        if newest.get(room_nid, stream) <= stream:
            newest[room_nid] = stream
    for room_nid, stream in newest.items():
        queue_activity(txn, room_nid, stream)
