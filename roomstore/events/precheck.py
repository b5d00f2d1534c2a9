"""Before stream IDs are reserved: which events of a batch are stored
already, and whether the write would refuse the rest.

Runs first in the write's own transaction (``RoomStore.persist_events``,
before ``reserve_in_transaction``'s ``take``): cheap reads over cached state
groups, then a trial run of the write, undone in a savepoint, only for a
batch they find a conflict or a gap in. Neither stored events nor refused
batches take stream IDs.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from roomstore.events.batch import PersistedEvent, PreparedEvent, StateDelta, StateKey, order_batch
from roomstore.events.persist import EventPersister
from roomstore.pdu.parsing import InvalidEventError, create_event_id_of
from roomstore.state.merge import find_conflicts, merge_states
from roomstore.storage.database import Transaction
from roomstore.events.tables.events import rooms_and_types_txn, stored_before_txn, stored_events_txn
from roomstore.events.tables.room_state import forward_groups_txn
from roomstore.storage.interning import Interners, chunks, rooms_and_versions_txn


def stored_results_txn(txn: Transaction, interners: Interners, events: Sequence[PreparedEvent]) -> dict[str, PersistedEvent]:
    """``already_persisted`` results for those of ``events`` stored before,
    by event ID (asked before any stream ID is reserved).

    Where several writers share the database (PostgreSQL) the event IDs are
    interned here rather than looked up: the write interns them anyway, and
    the insert answers both questions in one statement (the nids reach the
    write through ``txn.memo``); the IDs it inserts name no stored event.
    """
    ids = {ev.event_id for ev in events}
    if txn.engine.single_writer:
        nids = interners.events.lookup(txn, ids)
    else:
        inserted: set = set()
        nids = interners.events.intern(txn, ids, created=inserted)
        nids = {event_id: nid for event_id, nid in nids.items() if event_id not in inserted}
    by_nid = {nid: event_id for event_id, nid in nids.items()}
    rooms = {ev.event_id: ev.pdu.room_id for ev in events}
    found: dict[str, PersistedEvent] = {}
    for nid, row in stored_events_txn(txn, by_nid).items():
        event_id = by_nid[nid]
        found[event_id] = PersistedEvent(
            event_id, rooms[event_id], row.stream_ordering, row.topological_ordering, row.state_group_before,
            row.state_group, already_persisted=True,
        )
    return found


#: Stream orderings of a trial run (``precheck_txn``): far above any real
#: position, so they collide with no stored row; never committed.
TRIAL_STREAM_BASE = 2**62


def precheck_txn(
    txn: Transaction,
    persister: EventPersister,
    events: Sequence[PreparedEvent],
    resolved_current_state: Mapping[str, Mapping[StateKey, str]] | None,
) -> dict[str, PersistedEvent]:
    """Before stream IDs are reserved: ``already_persisted`` results for the
    events stored before (as ``stored_results_txn``), and the refusal the
    write would meet for a reason that does not depend on the write itself
    (conflicted or underivable state, a room version mismatch, a room
    version 12 room ID naming no stored create event), raised now.

    A batch that ``may_fail_txn`` finds risky is written in a trial run that
    is undone; the others cost a few reads. The write transaction still makes
    every check: a writer changing a room between the two may still make a
    batch fail after its IDs are taken (dropped with the transaction, a gap).
    """
    found = stored_results_txn(txn, persister.interners, events)
    new = [ev for ev in events if ev.event_id not in found]
    check_create_events_txn(txn, persister.interners, new)
    check_cited_rooms_txn(txn, persister.interners, new)
    if new and may_fail_txn(txn, persister, new, resolved_current_state):
        live = sum(1 for ev in new if not ev.backfilled)
        trial = range(TRIAL_STREAM_BASE, TRIAL_STREAM_BASE + len(new))
        txn.undone(persister.persist_txn, new, trial[:live], trial[live:], resolved_current_state)
    return found


def may_fail_txn(
    txn: Transaction,
    persister: EventPersister,
    new: Sequence[PreparedEvent],
    resolved_current_state: Mapping[str, Mapping[StateKey, str]] | None = None,
) -> bool:
    """False when the write of ``new`` (none stored) cannot be refused by its
    state or room version as the database stands: the versions agree, every
    prev event is there, and where prev events' states or a room's forward
    extremities' states meet they agree. True (worth a trial run) otherwise,
    or for a state given by the caller. Reads only, over cached state groups;
    a cheap filter, not the judge: the trial run is."""
    interners = persister.interners
    in_batch = {ev.event_id: ev for ev in new}
    graph = [ev for ev in new if not ev.outlier]
    if any(isinstance(ev.state_before, StateDelta) for ev in graph):
        return True  # a given delta may name an unknown group: let the trial say
    # A whole state given for an event (a map) is never refused: it stands in
    # for the state derived from its prev events below.
    # Prev events neither in the batch nor stored as graph events leave the
    # state underivable.
    if any(in_batch[p].outlier for ev in graph for p in ev.pdu.prev_event_ids if p in in_batch):
        return True
    stored_prevs = _stored_prev_groups(txn, interners, graph, in_batch)
    if stored_prevs is None:
        return True
    prev_nids, group_of = stored_prevs
    # Room versions, and each live room's forward extremities after the batch.
    rooms = rooms_and_versions_txn(txn, {ev.pdu.room_id for ev in new})
    if any(rooms.get(ev.pdu.room_id, (None, None))[1] not in (None, ev.pdu.room_version.identifier) for ev in new):
        return True
    ends = _room_ends(txn, graph, rooms, prev_nids, resolved_current_state or {})
    if not ends and all(len(set(ev.pdu.prev_event_ids)) < 2 for ev in graph):
        return False  # plain chains, one end per room: nothing can conflict
    after = _states_after(txn, persister, graph, in_batch, group_of, prev_nids)
    if after is None:
        return True
    stored_state = persister.state_groups.get_state
    for stored, news in ends.values():
        states = [stored_state(txn, g) for g in set(stored) if g is not None] + [after[e] for e in news]
        if find_conflicts(states):
            return True  # the current state is a conflicted merge of the ends
    return False


def _stored_prev_groups(
    txn: Transaction, interners: Interners, graph: Sequence[PreparedEvent], in_batch: Mapping[str, PreparedEvent]
) -> tuple[dict[str, int], dict[int, int | None]] | None:
    """(nid of each prev event outside the batch, state group of each such
    nid); None when one is not stored as a graph event (the state would be
    underivable)."""
    outside = {p for ev in graph for p in ev.pdu.prev_event_ids if p not in in_batch}
    prev_nids = interners.events.lookup(txn, outside)
    if len(prev_nids) < len(outside):
        return None
    # stored graph prev event nid -> its state group (the write asks the same, through the memo)
    group_of = {
        nid: facts.state_group for nid, facts in stored_before_txn(txn, prev_nids.values()).items() if not facts.outlier
    }
    if len(group_of) < len(prev_nids):
        return None
    return prev_nids, group_of


def _room_ends(
    txn: Transaction,
    graph: Sequence[PreparedEvent],
    rooms: Mapping[str, tuple[int, str | None]],
    prev_nids: Mapping[str, int],
    resolved: Mapping[str, object],
) -> dict[str, tuple[list, list[str]]]:
    """room -> (stored ends' groups, new ends) of each live room that will
    have several forward extremities after the batch (and no resolved state)."""
    # As the write's update_extremities: rejected events are no room's ends.
    live = [ev for ev in graph if not ev.backfilled and not ev.rejected_reason]
    pointed_at = {p for ev in graph if not ev.rejected_reason for p in ev.pdu.prev_event_ids}
    live_prevs = {prev_nids[p] for ev in live for p in ev.pdu.prev_event_ids if p in prev_nids}
    ends: dict[str, tuple[list, list[str]]] = {}
    for room_id in {ev.pdu.room_id for ev in live}:
        stored = []
        if room_id in rooms:
            stored = [
                group for nid, group in forward_groups_txn(txn, rooms[room_id][0]) if nid not in live_prevs
            ]
        news = [ev.event_id for ev in live if ev.pdu.room_id == room_id and ev.event_id not in pointed_at]
        if len(stored) + len(news) > 1 and room_id not in resolved:
            ends[room_id] = (stored, news)
    return ends


def _states_after(
    txn: Transaction,
    persister: EventPersister,
    graph: Sequence[PreparedEvent],
    in_batch: Mapping[str, PreparedEvent],
    group_of: Mapping[int, int | None],
    prev_nids: Mapping[str, int],
) -> dict[str, dict] | None:
    """The state after each graph event of the batch, derived as the write
    would; None where prev events' states conflict."""
    interners = persister.interners
    # Keys and events as nids where interned (a new key or event is its own
    # name: it equals no nid).
    given = [ev.state_before for ev in graph if ev.state_before is not None]
    key_nids = interners.state_keys.lookup(
        txn, {(ev.pdu.type, ev.pdu.state_key) for ev in graph if ev.pdu.state_key is not None}
        | {key for state in given for key in state}
    )
    event_nids = interners.events.lookup(txn, set(in_batch) | {e for state in given for e in state.values()})
    stored_state = persister.state_groups.get_state
    after: dict[str, dict] = {}
    for ev in order_batch(graph):
        if ev.state_before is not None:
            state = {key_nids.get(k, k): event_nids.get(e, e) for k, e in ev.state_before.items()}
        else:
            state = _derived_state(txn, ev, after, stored_state, group_of, prev_nids)
            if state is None:
                return None
        if ev.pdu.state_key is not None and not ev.rejected_reason:
            key = (ev.pdu.type, ev.pdu.state_key)
            state = {**state, key_nids.get(key, key): event_nids.get(ev.event_id, ev.event_id)}
        after[ev.event_id] = state
    return after


def check_create_events_txn(txn: Transaction, interners: Interners, events: Sequence[PreparedEvent]) -> None:
    """Room version 12 (MSC4291): an event's room ID is ``!`` + its room's
    create event's hash, so it names that create event (``$`` + the same
    hash), which must be stored in that room as its ``m.room.create`` or come
    in the same batch. ``InvalidEventError`` for the first event whose room
    ID names none: a room ID that matches no create event's hash. Outliers
    and rejected events too: every event of such a room has its create event
    in its auth chain. A read; nothing for rooms of other versions."""
    in_batch = {ev.event_id for ev in events if ev.pdu.is_create}
    wanted: dict[str, PreparedEvent] = {}
    for ev in events:
        pdu = ev.pdu
        if pdu.room_version.room_id_is_create_hash and not pdu.is_create:
            create_id = create_event_id_of(pdu.room_id)
            if create_id not in in_batch:
                wanted.setdefault(create_id, ev)
    if not wanted:
        return
    nids = interners.events.lookup(txn, wanted)
    creates: dict[int, tuple[str, str]] = {}
    for part in chunks(sorted(nids.values())):
        for nid, room_id, event_type in rooms_and_types_txn(txn, part):
            creates[nid] = (room_id, event_type)
    for create_id, ev in wanted.items():
        stored = creates.get(nids.get(create_id, -1))
        if stored is None:
            raise InvalidEventError(
                f"event {ev.event_id} names room {ev.pdu.room_id}, but no create event {create_id} is stored: "
                f"a room version {ev.pdu.room_version.identifier} room ID is '!' + its create event's hash; "
                "persist the room's create event first (or in the same batch)",
                "room_id",
            )
        if stored != (ev.pdu.room_id, "m.room.create"):
            raise InvalidEventError(
                f"event {ev.event_id} names room {ev.pdu.room_id}, but the stored event {create_id} is not "
                f"that room's create event: a room version {ev.pdu.room_version.identifier} room ID is '!' + "
                "its create event's hash",
                "room_id",
            )


def check_cited_rooms_txn(txn: Transaction, interners: Interners, events: Sequence[PreparedEvent]) -> None:
    """An event's ``prev_events`` and ``auth_events`` are of its own room:
    ``InvalidEventError`` for the first that cites one of another room,
    stored or in the batch (it would inherit that room's state, and its
    sender that room's membership). Events not stored are left to the
    state and auth checks. A read, before any stream ID."""
    room_of = {ev.event_id: ev.pdu.room_id for ev in events}
    cited = {i for ev in events for i in (*ev.pdu.prev_event_ids, *ev.pdu.auth_event_ids) if i not in room_of}
    stored_rooms: dict[str, int] = {}
    if cited:
        nids = interners.events.lookup(txn, cited)
        facts = stored_before_txn(txn, nids.values())
        stored_rooms = {event_id: facts[nid].room_nid for event_id, nid in nids.items() if nid in facts}
    room_nids = interners.rooms.lookup(txn, set(room_of.values())) if stored_rooms else {}
    for ev in events:
        for key, ids in (("prev_events", ev.pdu.prev_event_ids), ("auth_events", ev.pdu.auth_event_ids)):
            for cited_id in ids:
                if cited_id in room_of:
                    other = room_of[cited_id] != ev.pdu.room_id
                else:
                    other = cited_id in stored_rooms and stored_rooms[cited_id] != room_nids.get(ev.pdu.room_id)
                if other:
                    raise InvalidEventError(
                        f"event {ev.event_id} cites {cited_id} in {key!r}, an event of another room: an event's "
                        "prev and auth events are of its own room",
                        key,
                    )


def _derived_state(txn, ev: PreparedEvent, after: Mapping[str, dict], stored_state, group_of, prev_nids) -> dict | None:
    """The state before ``ev`` as the write derives it from its prev events
    (in the batch or stored), or None where their states conflict."""
    states = {}
    for p in dict.fromkeys(ev.pdu.prev_event_ids):
        state = after[p] if p in after else stored_state(txn, group_of[prev_nids[p]])
        states[id(state)] = state
    if len(states) > 1 and find_conflicts(list(states.values())):
        return None
    return merge_states(list(states.values()))[1] if len(states) > 1 else next(iter(states.values()), {})
