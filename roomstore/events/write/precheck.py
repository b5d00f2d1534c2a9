"""Before stream IDs are reserved: which events of a batch are stored
already, and whether the write would refuse the rest.

Runs first in the write's own transaction (``RoomStore.persist_events``,
before ``reserve_in_transaction``'s ``take``): cheap reads over cached state
groups, then a trial run of the write, undone in a savepoint, only for a
batch they find a gap or a version mismatch in (a fork is no refusal: its
states are resolved). Neither stored events nor refused batches take
stream IDs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from roomstore.events.tables.events import rooms_and_types_txn, stored_before_txn, stored_events_txn
from roomstore.events.write.batch import PersistedEvent, PreparedEvent, StateDelta, StateKey, order_batch
from roomstore.events.write.persist import EventPersister
from roomstore.pdu.parsing import InvalidEventError, create_event_id_of
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners, chunks, rooms_and_versions_txn


def stored_results_txn(
    txn: Transaction, interners: Interners, events: Sequence[PreparedEvent]
) -> dict[str, PersistedEvent]:
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
            event_id,
            rooms[event_id],
            row.stream_ordering,
            row.topological_ordering,
            row.state_group_before,
            row.state_group,
            already_persisted=True,
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
    (underivable state, a room version mismatch, a room version 12 room ID
    naming no stored create event, prev or auth events of another room, a
    cycle of prev events), raised now.

    A batch that ``may_fail_txn`` finds risky is written in a trial run that
    is undone; the others cost a few reads. The write transaction still makes
    every check: a writer changing a room between the two may still make a
    batch fail after its IDs are taken (dropped with the transaction, a gap).
    """
    found = stored_results_txn(txn, persister.interners, events)
    new = [ev for ev in events if ev.event_id not in found]
    check_create_events_txn(txn, persister.interners, new)
    check_cited_rooms_txn(txn, persister.interners, new)
    order_batch(new)  # a cycle of prev events is refused here, before any ID
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
    state or room version as the database stands: the versions agree and
    every prev event is in the batch or stored as a graph event. Forks never
    refuse (their states are resolved). True (worth a trial run) otherwise,
    or for a state given as a delta, which may name an unknown group. Reads
    only; a cheap filter, not the judge: the trial run is."""
    interners = persister.interners
    in_batch = {ev.event_id: ev for ev in new}
    graph = [ev for ev in new if not ev.outlier]
    if any(isinstance(ev.state_before, StateDelta) for ev in graph):
        return True
    # A whole state given for an event (a map) is never refused: it stands in
    # for the state derived from its prev events below.
    # Prev events neither in the batch nor stored as graph events leave the
    # state underivable.
    if any(in_batch[p].outlier for ev in graph for p in ev.pdu.prev_event_ids if p in in_batch):
        return True
    if _stored_prev_groups(txn, interners, graph, in_batch) is None:
        return True
    rooms = rooms_and_versions_txn(txn, {ev.pdu.room_id for ev in new})
    return any(rooms.get(ev.pdu.room_id, (None, None))[1] not in (None, ev.pdu.room_version.identifier) for ev in new)


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
