"""Persisting batches of events, atomically.

``EventPersister.persist_txn`` writes a whole batch in the caller's
transaction: event rows, the exact bytes, edges, extremities, state groups,
visibility snapshots, memberships, redactions and current state. Stream IDs
are reserved by the caller (``RoomStore.persist_events``) before the
transaction and completed after it, whether it commits or not.

State before an event comes from the caller (a full map, or a delta against a
known group) or is derived from the prev events' states when they agree or
differ without conflict; a conflicted merge is refused, naming the keys.
Current state follows the forward extremities the same way (the caller may
pass a resolved current state for a room whose extremities conflict).
"""

from __future__ import annotations

import json
import time
from collections import abc
from typing import Any, Mapping, Sequence

import attrs

from roomstore.events.room_versions import RoomVersion, get_room_version
from roomstore.events.validation import InvalidEventError, ParsedPdu, parse_pdu
from roomstore.state.groups import StateGroupStore, StateGroupWrites
from roomstore.state.merge import ConflictedStateError, find_conflicts, merge_states
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners, LruCache, chunks, split_cached
from roomstore.visibility.rules import NO_MEMBERSHIP_CODE, membership_code, visibility_code
from roomstore.visibility.snapshots import DEFAULT_VISIBILITY, VisibilityStore, VisibilityWrites

StateKey = tuple[str, str]

HISTORY_VISIBILITY = ("m.room.history_visibility", "")
MEMBER = "m.room.member"


class MissingStateError(ValueError):
    """The state before an event cannot be derived: pass it explicitly."""


@attrs.frozen
class StateDelta:
    """State given as changes against a state group the store returned earlier."""

    base_state_group: int
    changes: Mapping[StateKey, str] = attrs.field(factory=dict)


@attrs.frozen
class EventToPersist:
    """One event of a batch, as a homeserver hands it over.

    ``raw`` is the PDU exactly as received. ``room_version`` may be left out
    when the room's create event is stored or earlier in the batch.
    ``state_before`` is the state before the event: a full map of
    ``(type, state_key) -> event_id``, a ``StateDelta``, or None to derive it
    from the prev events.
    """

    raw: bytes
    room_version: str | None = None
    outlier: bool = False
    rejected_reason: str | None = None
    backfilled: bool = False
    state_before: Mapping[StateKey, str] | StateDelta | None = None


@attrs.frozen
class PersistedEvent:
    """Where an event landed. ``already_persisted``: it was stored before."""

    event_id: str
    room_id: str
    stream_ordering: int
    topological_ordering: int
    state_group_before: int | None
    state_group: int | None
    already_persisted: bool = False

    @property
    def stream_token(self) -> str:
        return f"s{self.stream_ordering}"

    @property
    def topological_token(self) -> str:
        return f"t{self.topological_ordering}-{self.stream_ordering}"


@attrs.frozen
class PreparedEvent:
    """A validated event with its flags, ready for the transaction."""

    pdu: ParsedPdu
    outlier: bool
    rejected_reason: str | None
    backfilled: bool
    state_before: Mapping[StateKey, str] | StateDelta | None
    event_id: str = attrs.field(init=False, default=attrs.Factory(lambda self: self.pdu.event_id, takes_self=True))


def peek_room_version(raw: bytes) -> tuple[str | None, str | None, str | None]:
    """(room_id, type, content.room_version) from raw bytes, for version lookup."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidEventError(f"event is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidEventError("event is not a JSON object")
    content = obj.get("content")
    version = content.get("room_version") if isinstance(content, dict) else None
    room_id = obj.get("room_id") if isinstance(obj.get("room_id"), str) else None
    event_type = obj.get("type") if isinstance(obj.get("type"), str) else None
    return room_id, event_type, version if isinstance(version, str) else None


def prepare_events(events: Sequence[EventToPersist], known_versions: Mapping[str, str]) -> list[PreparedEvent]:
    """Validate a batch; resolve room versions from the batch's create events
    and ``known_versions`` (room_id -> version) where not given."""
    versions = dict(known_versions)
    prepared = []
    for index, item in enumerate(events):
        if not isinstance(item, EventToPersist):
            raise TypeError(f"event {index} is {type(item).__name__}, not EventToPersist")
        version_id = item.room_version
        if version_id is None:
            room_id, event_type, create_version = peek_room_version(item.raw)
            if event_type == "m.room.create":
                version_id = create_version or "1"
            elif room_id in versions:
                version_id = versions[room_id]
            else:
                raise InvalidEventError(
                    f"event {index}: no room_version given and the room {room_id!r} is unknown "
                    "(persist its create event first, or pass room_version)"
                )
        pdu = parse_pdu(item.raw, get_room_version(version_id))
        if pdu.type == "m.room.create" and pdu.state_key == "":
            versions[pdu.room_id] = version_id
        prepared.append(PreparedEvent(pdu, item.outlier, item.rejected_reason, item.backfilled, item.state_before))
    return prepared


def stored_results_txn(txn: Transaction, interners: Interners, events: Sequence[PreparedEvent]) -> dict[str, "PersistedEvent"]:
    """``already_persisted`` results for those of ``events`` stored before,
    by event ID (a read only: asked before any stream ID is reserved)."""
    nids = interners.events.lookup(txn, {ev.event_id for ev in events})
    by_nid = {nid: event_id for event_id, nid in nids.items()}
    rooms = {ev.event_id: ev.pdu.room_id for ev in events}
    found: dict[str, PersistedEvent] = {}
    for part in chunks(sorted(by_nid)):
        marks = ", ".join("?" for _ in part)
        for nid, stream, topo, before, after in txn.execute(
            "SELECT event_nid, stream_ordering, topological_ordering, state_group_before, state_group"
            f" FROM events WHERE event_nid IN ({marks})",
            list(part),
        ).fetchall():
            event_id = by_nid[nid]
            found[event_id] = PersistedEvent(event_id, rooms[event_id], stream, topo, before, after, already_persisted=True)
    return found


#: Stream orderings of a trial run (``precheck_txn``): far above any real
#: position, so they collide with no stored row; never committed.
TRIAL_STREAM_BASE = 2**62


def precheck_txn(
    txn: Transaction,
    persister: "EventPersister",
    events: Sequence[PreparedEvent],
    resolved_current_state: Mapping[str, Mapping[StateKey, str]] | None,
) -> dict[str, "PersistedEvent"]:
    """Before stream IDs are reserved: ``already_persisted`` results for the
    events stored before (as ``stored_results_txn``), and the refusal the
    write would meet for a reason that does not depend on the write itself
    (conflicted or underivable state, a room version mismatch), raised now.

    A batch that ``may_fail_txn`` finds risky is written in a trial run that
    is undone; the others cost a few reads. The write transaction still makes
    every check: a writer changing a room between the two may still make a
    batch fail after its IDs are reserved (they complete unused, a gap).
    """
    found = stored_results_txn(txn, persister.interners, events)
    new = [ev for ev in events if ev.event_id not in found]
    if new and may_fail_txn(txn, persister, new, resolved_current_state):
        live = sum(1 for ev in new if not ev.backfilled)
        trial = range(TRIAL_STREAM_BASE, TRIAL_STREAM_BASE + len(new))
        txn.undone(persister.persist_txn, new, trial[:live], trial[live:], resolved_current_state)
    return found


def may_fail_txn(
    txn: Transaction,
    persister: "EventPersister",
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
    if any(ev.state_before is not None for ev in graph):
        return True  # a given state may name an unknown group: let the trial say
    # Prev events neither in the batch nor stored as graph events leave the
    # state underivable.
    if any(in_batch[p].outlier for ev in graph for p in ev.pdu.prev_event_ids if p in in_batch):
        return True
    outside = {p for ev in graph for p in ev.pdu.prev_event_ids if p not in in_batch}
    prev_nids = interners.events.lookup(txn, outside)
    if len(prev_nids) < len(outside):
        return True
    group_of: dict[int, int | None] = {}  # stored graph prev event nid -> its state group
    for part in chunks(sorted(prev_nids.values())):
        marks = ", ".join("?" for _ in part)
        group_of.update(txn.execute(
            f"SELECT event_nid, state_group FROM events WHERE event_nid IN ({marks}) AND outlier = ?", (*part, False)
        ).fetchall())
    if len(group_of) < len(prev_nids):
        return True
    # Room versions, and each live room's forward extremities after the batch.
    rooms: dict[str, tuple[int, str | None]] = {}
    for part in chunks(sorted({ev.pdu.room_id for ev in new})):
        marks = ", ".join("?" for _ in part)
        for room_id, room_nid, version in txn.execute(
            f"SELECT room_id, room_nid, room_version FROM rooms WHERE room_id IN ({marks})", list(part)
        ).fetchall():
            rooms[room_id] = (room_nid, version)
    if any(rooms.get(ev.pdu.room_id, (None, None))[1] not in (None, ev.pdu.room_version.identifier) for ev in new):
        return True
    live = [ev for ev in graph if not ev.backfilled]
    pointed_at = {p for ev in graph for p in ev.pdu.prev_event_ids}
    live_prevs = {prev_nids[p] for ev in live for p in ev.pdu.prev_event_ids if p in prev_nids}
    ends: dict[str, tuple[list, list[str]]] = {}  # room -> (stored ends' groups, new ends)
    for room_id in {ev.pdu.room_id for ev in live}:
        stored = []
        if room_id in rooms:
            stored = [group for nid, group in txn.execute(
                "SELECT f.event_nid, e.state_group FROM forward_extremities AS f"
                " JOIN events AS e ON e.event_nid = f.event_nid WHERE f.room_nid = ?",
                (rooms[room_id][0],),
            ).fetchall() if nid not in live_prevs]
        news = [ev.event_id for ev in live if ev.pdu.room_id == room_id and ev.event_id not in pointed_at]
        if len(stored) + len(news) > 1 and room_id not in (resolved_current_state or {}):
            ends[room_id] = (stored, news)
    if not ends and all(len(set(ev.pdu.prev_event_ids)) < 2 for ev in graph):
        return False  # plain chains, one end per room: nothing can conflict
    # Derive the states as the write would, keys and events as nids where
    # interned (a new key or event is its own name: it equals no nid).
    key_nids = interners.state_keys.lookup(
        txn, {(ev.pdu.type, ev.pdu.state_key) for ev in graph if ev.pdu.state_key is not None}
    )
    event_nids = interners.events.lookup(txn, in_batch)
    stored_state = persister.state_groups.get_state
    after: dict[str, dict] = {}
    for ev in order_batch(graph):
        prevs = list(dict.fromkeys(ev.pdu.prev_event_ids))
        states = {}
        for p in prevs:
            state = after[p] if p in after else stored_state(txn, group_of[prev_nids[p]])
            states[id(state)] = state
        if len(states) > 1 and find_conflicts(list(states.values())):
            return True
        state = merge_states(list(states.values()))[1] if len(states) > 1 else next(iter(states.values()), {})
        if ev.pdu.state_key is not None and not ev.rejected_reason:
            key = (ev.pdu.type, ev.pdu.state_key)
            state = {**state, key_nids.get(key, key): event_nids.get(ev.event_id, ev.event_id)}
        after[ev.event_id] = state
    for stored, news in ends.values():
        states = [stored_state(txn, g) for g in set(stored) if g is not None] + [after[e] for e in news]
        if find_conflicts(states):
            return True  # the current state is a conflicted merge of the ends
    return False


def is_orphan(ev: PreparedEvent) -> bool:
    """A live event with nothing to hang it on: not a create event, no prev
    events, no state given. It may only start a room it is the create of."""
    return (
        not ev.outlier and not ev.pdu.prev_event_ids and ev.state_before is None
        and not (ev.pdu.type == "m.room.create" and ev.pdu.state_key == "")
    )


def order_batch(batch: Sequence[PreparedEvent]) -> list[PreparedEvent]:
    """The batch with each event after its prev events that are in the batch
    (stable otherwise); duplicates dropped."""
    by_id: dict[str, PreparedEvent] = {}
    for ev in batch:
        by_id.setdefault(ev.event_id, ev)
    if len(by_id) == len(batch):
        # Usually already in order: check that before sorting.
        seen: set[str] = set()
        for ev in batch:
            if any(p in by_id and p not in seen for p in ev.pdu.prev_event_ids):
                break
            seen.add(ev.event_id)
        else:
            return list(batch)
    ordered: list[PreparedEvent] = []
    placed: set[str] = set()
    visiting: set[str] = set()

    def place(ev: PreparedEvent) -> None:
        stack = [(ev, iter(ev.pdu.prev_event_ids))]
        visiting.add(ev.event_id)
        while stack:
            node, prevs = stack[-1]
            advanced = False
            for prev_id in prevs:
                prev = by_id.get(prev_id)
                if prev is not None and prev_id not in placed and prev_id not in visiting:
                    visiting.add(prev_id)
                    stack.append((prev, iter(prev.pdu.prev_event_ids)))
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                visiting.discard(node.event_id)
                if node.event_id not in placed:
                    placed.add(node.event_id)
                    ordered.append(node)

    for ev in by_id.values():
        if ev.event_id not in placed:
            place(ev)
    return ordered


@attrs.define
class _Pending:
    """A state group created in this transaction."""

    state: dict
    chain_length: int
    snapshot: int


class EventPersister:
    """Writes batches of events; see the module docstring."""

    def __init__(self, interners: Interners, state_groups: StateGroupStore, visibility: VisibilityStore, instance_name: str):
        self.interners = interners
        # room_id -> room version, once stored (a room's version never
        # changes); RoomStore reads it too, before validating a batch.
        self.room_versions = LruCache(100_000)
        self.state_groups = state_groups
        self.visibility = visibility
        self.instance_name = instance_name

    # ------------------------------------------------------------------ entry

    def persist_txn(
        self,
        txn: Transaction,
        batch: Sequence[PreparedEvent],
        stream_ids: Sequence[int],
        backfill_ids: Sequence[int],
        resolved_current_state: Mapping[str, Mapping[StateKey, str]] | None = None,
        cache_stream_id: int | None = None,
        now_ms: int | None = None,
    ) -> "BatchOutcome":
        writer = _BatchWriter(self, txn, resolved_current_state or {}, now_ms)
        outcome = writer.run(batch, stream_ids, backfill_ids)
        if cache_stream_id is not None:
            write_cache_invalidations(txn, cache_stream_id, self.instance_name, outcome.invalidations(), writer.now_ms)
        return outcome


#: Cache names written to the caches stream. ``cs_cache_fake`` with a room
#: ID invalidates every current-state cache of that room (Synapse's name).
CURRENT_STATE_CACHE = "cs_cache_fake"
EVENT_CACHE = "get_event"
ROOMS_FOR_USER_CACHE = "get_rooms_for_user"


def write_cache_invalidations(
    txn: Transaction, stream_id: int, instance_name: str, invalidations: Sequence[tuple[str, list | None]], now_ms: int
) -> None:
    """Rows of the caches stream, all at one stream ID (one fact)."""
    txn.insert_many(
        "cache_invalidations",
        ("stream_id", "instance_name", "cache_name", "keys", "invalidation_ts"),
        [
            (stream_id, instance_name, name, None if keys is None else json.dumps(keys), now_ms)
            for name, keys in invalidations
        ],
        queue=True,
    )


@attrs.define
class BatchOutcome:
    """What a committed batch did, for callers' caches and replies."""

    results: dict[str, PersistedEvent]
    room_positions: dict[str, int]  # room_id -> newest stream ordering written
    membership_users: dict[str, int]  # user_id -> newest membership stream ordering
    current_state_rooms: set[str]
    redacted_event_ids: set[str]
    new_event_ids: list[str]

    def invalidations(self) -> list[tuple[str, list]]:
        """(cache name, keys) a worker must drop after this batch."""
        rows: list[tuple[str, list]] = []
        rows.extend((EVENT_CACHE, [event_id]) for event_id in sorted(self.redacted_event_ids))
        rows.extend((CURRENT_STATE_CACHE, [room_id]) for room_id in sorted(self.current_state_rooms))
        rows.extend((ROOMS_FOR_USER_CACHE, [user_id]) for user_id in sorted(self.membership_users))
        return rows


def _remember_all(cache: LruCache, mapping: Mapping) -> None:
    for key, value in mapping.items():
        cache.set(key, value)


def delete_pairs(txn: Transaction, table: str, columns: tuple[str, str], pairs, queue: bool = False) -> None:
    """DELETE rows matching any of ``pairs`` in one statement per chunk
    (row-value IN lists work on PostgreSQL and SQLite 3.15+); ``queue``: see
    ``Transaction.queue``."""
    pairs = sorted(set(pairs))
    for part in chunks(pairs):
        values = ", ".join("(?, ?)" for _ in part)
        (txn.queue if queue else txn.execute)(
            f"DELETE FROM {table} WHERE ({columns[0]}, {columns[1]}) IN (VALUES {values})",
            [v for pair in part for v in pair],
        )


class _BatchWriter:
    """One batch inside one transaction. Short-lived; holds the batch's maps."""

    def __init__(self, persister: EventPersister, txn: Transaction, resolved: Mapping, now_ms: int | None):
        self.p = persister
        self.txn = txn
        self.resolved = resolved
        self.now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        self.pending: dict[int, _Pending] = {}
        self.stored_groups: dict[int, tuple[int | None, int]] = {}
        self.event_nids: dict[str, int] = {}
        self.key_nids: dict[StateKey, int] = {}
        self.key_names: dict[int, StateKey] = {}
        self.user_nids: dict[str, int] = {}
        # Facts about events needed for visibility: membership / visibility codes.
        self.membership_of_event: dict[int, int] = {}
        self.visibility_of_event: dict[int, int] = {}
        # New state groups and visibility rows, written together at the end
        # of the batch (``run`` sizes them).
        self.group_writes = StateGroupWrites()
        self.visibility_writes = VisibilityWrites()
        # Event nids interned by this batch: no stored row can mention them.
        self.fresh_nids: set[int] = set()
        self.stored_cache: dict[int, dict | None] = {}

    # ---------------------------------------------------------------- helpers

    def full_state(self, group: int | None) -> dict[int, int]:
        if group is not None and group in self.pending:
            return dict(self.pending[group].state)
        return self.p.state_groups.get_state(self.txn, group)

    def _stored_group(self, group: int) -> tuple[int | None, int]:
        """(visibility snapshot, chain length) of a stored group, once per batch."""
        facts = self.stored_groups.get(group)
        if facts is None:
            # With its snapshot's facts, which the next snapshot derives from.
            row = self.txn.execute(
                "SELECT g.visibility_snapshot, g.chain_length, s.branch_nid, s.seq, s.history_visibility, b.tip_seq"
                " FROM state_groups AS g"
                " LEFT JOIN visibility_snapshots AS s ON s.snapshot_nid = g.visibility_snapshot"
                " LEFT JOIN visibility_branches AS b ON b.branch_nid = s.branch_nid"
                " WHERE g.state_group = ?",
                (group,),
            ).fetchone()
            if row is None:
                raise MissingStateError(f"state group {group} does not exist")
            facts = self.stored_groups[group] = (row[0], row[1])
            if row[2] is not None:
                self.visibility_writes.learn(row[0], row[2], row[3], row[4], row[5])
        return facts

    def chain_length(self, group: int) -> int:
        if group in self.pending:
            return self.pending[group].chain_length
        return self._stored_group(group)[1]

    def snapshot_of(self, group: int) -> int:
        if group in self.pending:
            return self.pending[group].snapshot
        snapshot = self._stored_group(group)[0]
        if snapshot is None:
            raise MissingStateError(f"state group {group} has no visibility snapshot")
        return snapshot

    def intern_keys(self, keys) -> None:
        missing = [k for k in set(keys) if k not in self.key_nids]
        if missing:
            found = self.p.interners.state_keys.intern(self.txn, missing)
            self.key_nids.update(found)
            self.key_names.update({n: k for k, n in found.items()})

    def names_of_keys(self, nids) -> None:
        missing = [n for n in set(nids) if n not in self.key_names]
        if missing:
            found = self.p.interners.state_keys.resolve(self.txn, missing)
            self.key_names.update(found)
            self.key_nids.update({k: n for n, k in found.items()})

    def intern_users(self, users) -> None:
        missing = [u for u in set(users) if u not in self.user_nids]
        if missing:
            self.user_nids.update(self.p.interners.users.intern(self.txn, missing))

    def load_event_facts(self, event_nids) -> None:
        """Membership / history visibility codes of stored state events."""
        missing = [n for n in set(event_nids) if n not in self.membership_of_event and n not in self.visibility_of_event]
        if not missing:
            return
        for part in chunks(missing):
            marks = ", ".join("?" for _ in part)
            for nid, code in self.txn.execute(
                f"SELECT event_nid, membership FROM room_memberships WHERE event_nid IN ({marks})", list(part)
            ).fetchall():
                self.membership_of_event[nid] = code
            for nid, raw in self.txn.execute(
                f"SELECT e.event_nid, j.json FROM events AS e JOIN event_json AS j ON j.event_nid = e.event_nid"
                f" WHERE e.event_nid IN ({marks}) AND e.type = 'm.room.history_visibility'",
                list(part),
            ).fetchall():
                content = json.loads(bytes(raw).decode("utf-8")).get("content")
                value = content.get("history_visibility") if isinstance(content, dict) else None
                self.visibility_of_event[nid] = visibility_code(value)

    def conflict_error(
        self, event_id: str, conflicts: Mapping[int, set], what: str | None = None, advice: str | None = None
    ) -> ConflictedStateError:
        self.names_of_keys(conflicts)
        names = self.p.interners.events.resolve(self.txn, {e for events in conflicts.values() for e in events})
        described = {
            self.key_names[key]: sorted(names.get(e, str(e)) for e in events) for key, events in conflicts.items()
        }
        keys = ", ".join(f"({t!r}, {s!r})" for t, s in sorted(described))
        what = what or f"the state at {event_id}: its prev events' states"
        advice = advice or "resolve the state and pass it as state_before"
        return ConflictedStateError(f"cannot derive {what} conflict on {keys}; {advice}", described)

    # ---------------------------------------------------------------- groups

    def new_group(
        self,
        room_nid: int,
        event_nid: int | None,
        parent: int | None,
        delta: Mapping[int, int | None],
        empty_snapshot: int | None = None,
    ) -> int:
        """Create ``parent + delta`` with its visibility snapshot; returns the group.

        ``empty_snapshot``: with no parent, the snapshot of the empty state
        to derive from (a room's first state), instead of a fresh branch.
        """
        parent_state = self.full_state(parent)
        if parent is None and empty_snapshot is not None:
            changes, visibility = self.visibility_changes(delta, full=False)
            snapshot = self.p.visibility.snapshot_for(
                self.txn, room_nid, empty_snapshot, changes, visibility, self.visibility_writes
            )
            parent_length = None
        elif parent is None:
            # No parent: a fresh snapshot lists every member.
            state = {k: v for k, v in delta.items() if v is not None}
            changes, visibility = self.visibility_changes(state, full=True)
            snapshot = self.p.visibility.snapshot_for(self.txn, room_nid, None, changes, visibility, self.visibility_writes)
            parent_length = None
        else:
            changes, visibility = self.visibility_changes(delta, full=False)
            snapshot = self.p.visibility.snapshot_for(
                self.txn, room_nid, self.snapshot_of(parent), changes, visibility, self.visibility_writes
            )
            parent_length = self.chain_length(parent)
        created = self.p.state_groups.create(
            self.txn, room_nid, event_nid, parent, parent_state, delta, parent_length, snapshot, self.group_writes
        )
        self.pending[created.state_group] = _Pending(dict(created.state), created.chain_length, snapshot)
        return created.state_group

    def visibility_changes(self, delta: Mapping[int, int | None], full: bool) -> tuple[dict[int, int], int | None]:
        """Membership and history visibility changes a state delta makes."""
        self.names_of_keys(delta)
        member_keys = {k: v for k, v in delta.items() if self.key_names[k][0] == MEMBER}
        hv_key = self.key_nids.get(HISTORY_VISIBILITY)
        self.load_event_facts([v for v in member_keys.values() if v is not None])
        if hv_key in delta and delta[hv_key] is not None:
            self.load_event_facts([delta[hv_key]])
        self.intern_users(self.key_names[k][1] for k in member_keys)
        changes = {}
        for key, event in member_keys.items():
            user = self.user_nids[self.key_names[key][1]]
            changes[user] = NO_MEMBERSHIP_CODE if event is None else self.membership_of_event.get(event, NO_MEMBERSHIP_CODE)
        visibility = None
        if hv_key is not None and hv_key in delta:
            event = delta[hv_key]
            visibility = DEFAULT_VISIBILITY if event is None else self.visibility_of_event.get(event, DEFAULT_VISIBILITY)
        elif full:
            visibility = DEFAULT_VISIBILITY
        return changes, visibility

    # ---------------------------------------------------------------- the batch

    def run(self, batch: Sequence[PreparedEvent], stream_ids: Sequence[int], backfill_ids: Sequence[int]) -> BatchOutcome:
        txn = self.txn
        batch = order_batch(batch)
        all_ids = set()
        for ev in batch:
            all_ids.add(ev.event_id)
            all_ids.update(ev.pdu.prev_event_ids)
            all_ids.update(ev.pdu.auth_event_ids)
            if ev.pdu.redacts:
                all_ids.add(ev.pdu.redacts)
            if ev.state_before is None:
                continue
            if isinstance(ev.state_before, abc.Mapping):
                all_ids.update(ev.state_before.values())
            elif isinstance(ev.state_before, StateDelta):
                all_ids.update(ev.state_before.changes.values())
        fresh_ids: set = set()
        self.event_nids = self.p.interners.events.intern(txn, all_ids, created=fresh_ids)
        nid = self.event_nids
        self.fresh_nids = {nid[e] for e in fresh_ids}

        # Events stored before: a no-op that reports their positions.
        results: dict[str, PersistedEvent] = {}
        stored = self.stored_events([nid[ev.event_id] for ev in batch])
        new_events = [ev for ev in batch if nid[ev.event_id] not in stored]
        for ev in batch:
            row = stored.get(nid[ev.event_id])
            if row is not None:
                results[ev.event_id] = PersistedEvent(
                    ev.event_id, ev.pdu.room_id, row["stream_ordering"], row["topological_ordering"],
                    row["state_group_before"], row["state_group"], already_persisted=True,
                )
        if not new_events:
            return BatchOutcome(results, {}, {}, set(), set(), [])

        room_nids = self.p.interners.rooms.intern(txn, {ev.pdu.room_id for ev in new_events})
        self.check_room_versions(new_events, room_nids)
        self.intern_users(
            {ev.pdu.sender for ev in new_events}
            | {ev.pdu.state_key for ev in new_events if ev.pdu.type == MEMBER and ev.pdu.state_key is not None}
        )
        keys = {(ev.pdu.type, ev.pdu.state_key) for ev in new_events if ev.pdu.state_key is not None}
        keys.add(HISTORY_VISIBILITY)
        for ev in new_events:
            if ev.state_before is None:
                continue
            if isinstance(ev.state_before, abc.Mapping):
                keys.update(ev.state_before)
            elif isinstance(ev.state_before, StateDelta):
                keys.update(ev.state_before.changes)
        self.intern_keys(keys)
        for ev in new_events:
            if ev.pdu.type == MEMBER and ev.pdu.state_key is not None and not ev.rejected_reason:
                self.membership_of_event[nid[ev.event_id]] = membership_code(ev.pdu.membership)
            if (ev.pdu.type, ev.pdu.state_key) == HISTORY_VISIBILITY and not ev.rejected_reason:
                value = ev.pdu.content.get("history_visibility")
                self.visibility_of_event[nid[ev.event_id]] = visibility_code(value)

        # At most one group (and snapshot) per state event and per given
        # state, plus merges: reserve their ids at once.
        expected = 2 + sum(
            1 for ev in new_events if ev.state_before is not None or (ev.pdu.state_key is not None and not ev.outlier)
        )
        self.group_writes.expected = self.visibility_writes.expected = expected

        # Stream orderings: arrival order for live events; backfilled events
        # count down below zero, the newest (deepest) nearest zero.
        live = [ev for ev in new_events if not ev.backfilled]
        backfilled = sorted((ev for ev in new_events if ev.backfilled), key=lambda ev: -ev.pdu.depth)
        if len(stream_ids) < len(live) or len(backfill_ids) < len(backfilled):
            raise ValueError("not enough stream IDs reserved for the batch")
        ordering = {ev.event_id: sid for ev, sid in zip(live, stream_ids)}
        ordering.update({ev.event_id: -bid for ev, bid in zip(backfilled, backfill_ids)})

        # What we know of prev events stored before this batch.
        prev_nids = {nid[p] for ev in new_events for p in ev.pdu.prev_event_ids}
        known = self.stored_events(prev_nids)
        groups_after: dict[int, int | None] = {n: r["state_group"] for n, r in known.items() if not r["outlier"]}

        event_rows, json_rows, edge_rows, auth_rows, membership_rows, redaction_rows = [], [], [], [], [], []
        room_positions: dict[str, int] = {}
        membership_users: dict[str, int] = {}
        for ev in new_events:
            pdu = ev.pdu
            event_nid = nid[ev.event_id]
            room_nid = room_nids[pdu.room_id]
            stream = ordering[ev.event_id]
            group_before = group_after = None
            visibility_before = visibility_after = None
            if not ev.outlier:
                group_before = self.state_before(ev, room_nid, groups_after)
                if group_before is None:
                    # The room's first event: state before it is empty.
                    empty = self.p.visibility.snapshot_for(txn, room_nid, None, {}, None, self.visibility_writes)
                    visibility_before = empty
                else:
                    visibility_before = self.snapshot_of(group_before)
                group_after = group_before
                is_state = pdu.state_key is not None and not ev.rejected_reason
                if is_state:
                    key = self.key_nids[(pdu.type, pdu.state_key)]
                    if group_before is None:
                        group_after = self.new_group(room_nid, event_nid, None, {key: event_nid}, visibility_before)
                    else:
                        group_after = self.new_group(room_nid, event_nid, group_before, {key: event_nid})
                    if pdu.type == MEMBER or (pdu.type, pdu.state_key) == HISTORY_VISIBILITY:
                        visibility_after = self.snapshot_of(group_after)
                groups_after[event_nid] = group_after

            type_key = self.key_nids[(pdu.type, pdu.state_key)] if pdu.state_key is not None else None
            event_rows.append((
                event_nid, room_nid, pdu.type, type_key, self.user_nids[pdu.sender], pdu.depth, pdu.depth,
                stream, self.p.instance_name, pdu.origin_server_ts, self.now_ms, ev.outlier,
                ev.rejected_reason, ev.backfilled, False, group_before, group_after,
                visibility_before, visibility_after,
            ))
            json_rows.append((event_nid, pdu.room_version.identifier, pdu.raw))
            edge_rows.extend((event_nid, nid[p]) for p in dict.fromkeys(pdu.prev_event_ids))
            auth_rows.extend((event_nid, nid[a]) for a in dict.fromkeys(pdu.auth_event_ids))
            if pdu.type == MEMBER and pdu.state_key is not None and not ev.rejected_reason:
                membership_rows.append((
                    event_nid, room_nid, self.user_nids[pdu.state_key], self.user_nids[pdu.sender],
                    membership_code(pdu.membership), stream,
                ))
                membership_users[pdu.state_key] = max(membership_users.get(pdu.state_key, stream), stream)
            if pdu.type == "m.room.redaction" and pdu.redacts and not ev.rejected_reason:
                redaction_rows.append((event_nid, nid[pdu.redacts], self.now_ms))
            if not ev.outlier:
                room_positions[pdu.room_id] = max(room_positions.get(pdu.room_id, stream), stream)
            results[ev.event_id] = PersistedEvent(
                ev.event_id, pdu.room_id, stream, pdu.depth, group_before, group_after
            )

        txn.insert_many(
            "events",
            ("event_nid", "room_nid", "type", "type_key_nid", "sender_nid", "depth", "topological_ordering",
             "stream_ordering", "instance_name", "origin_server_ts", "received_ts", "outlier", "rejected_reason",
             "backfilled", "redacted", "state_group_before", "state_group", "visibility_before", "visibility_after"),
            event_rows,
            queue=True,
        )
        txn.insert_many("event_json", ("event_nid", "room_version", "json"), json_rows, queue=True)
        txn.insert_many("event_edges", ("event_nid", "prev_event_nid"), edge_rows, queue=True)
        txn.insert_many("event_auth_edges", ("event_nid", "auth_event_nid"), auth_rows, queue=True)
        txn.insert_many(
            "room_memberships",
            ("event_nid", "room_nid", "user_nid", "sender_nid", "membership", "stream_ordering"),
            membership_rows,
            queue=True,
        )
        txn.insert_many(
            "redactions", ("redaction_event_nid", "redacts_event_nid", "received_ts"), redaction_rows, queue=True
        )
        redacted_targets = self.flag_redactions([nid[ev.event_id] for ev in new_events], [r[0] for r in redaction_rows])

        rooms_touched = {room_nids[ev.pdu.room_id] for ev in new_events if not ev.outlier}
        self.update_extremities(new_events, rooms_touched)
        live_rooms = {room_nids[ev.pdu.room_id]: ev.pdu.room_id for ev in new_events if not ev.outlier and not ev.backfilled}
        current_state_rooms = set()
        for room_nid, room_id in live_rooms.items():
            position = max(ordering[ev.event_id] for ev in new_events if ev.pdu.room_id == room_id and not ev.backfilled)
            if self.update_current_state(room_nid, room_id, position):
                current_state_rooms.add(room_id)

        self.group_writes.flush(txn)
        self.visibility_writes.flush(txn)
        redacted_ids = set(self.p.interners.events.resolve(txn, redacted_targets).values()) if redacted_targets else set()
        return BatchOutcome(
            results, room_positions, membership_users, current_state_rooms, redacted_ids,
            [ev.event_id for ev in new_events],
        )

    # ---------------------------------------------------------------- pieces

    def stored_events(self, event_nids) -> dict[int, dict]:
        """Facts of the events stored before this batch, by nid (others left out)."""
        wanted = set(event_nids)
        unknown = [n for n in wanted if n not in self.stored_cache and n not in self.fresh_nids]
        for part in chunks(unknown):
            marks = ", ".join("?" for _ in part)
            for row in self.txn.execute(
                "SELECT event_nid, stream_ordering, topological_ordering, state_group_before, state_group, outlier"
                f" FROM events WHERE event_nid IN ({marks})",
                list(part),
            ).fetchall():
                self.stored_cache[row[0]] = {
                    "stream_ordering": row[1], "topological_ordering": row[2],
                    "state_group_before": row[3], "state_group": row[4], "outlier": bool(row[5]),
                }
        found = {}
        for n in wanted - self.fresh_nids:
            facts = self.stored_cache.setdefault(n, None)  # None: known not to be stored
            if facts is not None:
                found[n] = facts
        return found

    def check_room_versions(self, events: Sequence[PreparedEvent], room_nids: Mapping[str, int]) -> None:
        cache = self.p.room_versions
        versions, unknown = split_cached(cache, room_nids)
        for part in chunks(unknown):
            marks = ", ".join("?" for _ in part)
            found = dict(self.txn.execute(
                f"SELECT room_id, room_version FROM rooms WHERE room_id IN ({marks}) AND room_version IS NOT NULL",
                list(part),
            ).fetchall())
            versions.update(found)
            self.txn.call_after(_remember_all, cache, found)
        for ev in events:
            room_id = ev.pdu.room_id
            given = ev.pdu.room_version.identifier
            known = versions.get(room_id)
            if known is None:
                if ev.pdu.type == "m.room.create" and ev.pdu.state_key == "":
                    self.txn.queue("UPDATE rooms SET room_version = ? WHERE room_nid = ?", (given, room_nids[room_id]))
                    versions[room_id] = given
                    self.txn.call_after(cache.set, room_id, given)
            elif known != given:
                raise InvalidEventError(
                    f"event {ev.event_id} claims room version {given} but room {ev.pdu.room_id} is version {known}"
                )

    def state_before(self, ev: PreparedEvent, room_nid: int, groups_after: Mapping[int, int | None]) -> int | None:
        """The state group before ``ev``: given by the caller, or derived."""
        nid = self.event_nids
        given = ev.state_before
        prev_groups = [groups_after.get(nid[p], "missing") for p in ev.pdu.prev_event_ids]
        base = next((g for g in prev_groups if isinstance(g, int)), None)
        if isinstance(given, StateDelta):
            if given.base_state_group not in self.pending and not self.p.state_groups.group_exists(self.txn, given.base_state_group):
                raise MissingStateError(f"state_before of {ev.event_id}: unknown state group {given.base_state_group}")
            delta = {self.key_nids[k]: nid[e] for k, e in given.changes.items()}
            if not delta:
                return given.base_state_group
            return self.new_group(room_nid, None, given.base_state_group, delta)
        if isinstance(given, abc.Mapping):
            wanted = {self.key_nids[k]: nid[e] for k, e in given.items()}
            if base is None:
                return self.new_group(room_nid, None, None, wanted)
            base_state = self.full_state(base)
            if base_state == wanted:
                return base
            delta: dict[int, int | None] = {k: v for k, v in wanted.items() if base_state.get(k) != v}
            delta.update({k: None for k in base_state if k not in wanted})
            return self.new_group(room_nid, None, base, delta)
        # Derive from the prev events.
        if not ev.pdu.prev_event_ids:
            return None
        missing = [p for p, g in zip(ev.pdu.prev_event_ids, prev_groups) if g == "missing"]
        if missing:
            raise MissingStateError(
                f"cannot derive the state at {ev.event_id}: prev events {sorted(missing)} are not stored "
                "(or only as outliers); pass state_before"
            )
        distinct = list(dict.fromkeys(prev_groups))
        if len(distinct) == 1:
            return distinct[0]
        states = [self.full_state(g) for g in distinct]
        conflicts = find_conflicts(states)
        if conflicts:
            raise self.conflict_error(ev.event_id, conflicts)
        index, merged = merge_states(states)
        parent = distinct[index]
        delta = {k: v for k, v in merged.items() if states[index].get(k) != v}
        return self.new_group(room_nid, None, parent, delta)

    def flag_redactions(self, new_event_nids: Sequence[int], new_redaction_nids: Sequence[int]) -> set[int]:
        """Set ``events.redacted`` where both the event and a redaction of it
        in the same room are stored, whichever arrived first."""
        txn = self.txn
        targets: set[int] = set()
        sql_tail = (
            " FROM redactions AS r JOIN events AS red ON red.event_nid = r.redaction_event_nid"
            " JOIN events AS target ON target.event_nid = r.redacts_event_nid AND target.room_nid = red.room_nid"
        )
        # A pair is flagged by the batch holding the later of its two events:
        # new events as targets of any redaction (never so for a fresh nid,
        # unless its redaction is in this batch too: found by the second
        # search), and this batch's redactions of any target.
        searches = (
            ("r.redacts_event_nid", [n for n in new_event_nids if n not in self.fresh_nids]),
            ("r.redaction_event_nid", list(new_redaction_nids)),
        )
        for column, nids in searches:
            for part in chunks(nids):
                marks = ", ".join("?" for _ in part)
                rows = txn.execute(
                    f"SELECT r.redacts_event_nid{sql_tail} WHERE {column} IN ({marks}) AND target.redacted = ?",
                    (*part, False),
                ).fetchall()
                targets.update(r[0] for r in rows)
        for part in chunks(sorted(targets)):
            marks = ", ".join("?" for _ in part)
            txn.queue(f"UPDATE events SET redacted = ? WHERE event_nid IN ({marks})", (True, *part))
        return targets

    def update_extremities(self, new_events: Sequence[PreparedEvent], rooms: set[int]) -> None:
        txn = self.txn
        nid = self.event_nids
        graph_events = [ev for ev in new_events if not ev.outlier]
        if not graph_events:
            return
        new_nids = {nid[ev.event_id] for ev in graph_events}
        backfilled = {nid[ev.event_id] for ev in graph_events if ev.backfilled}
        room_nids = self.p.interners.rooms.lookup(txn, {ev.pdu.room_id for ev in graph_events})
        room_of = {nid[ev.event_id]: room_nids[ev.pdu.room_id] for ev in graph_events}
        referenced = {(room_of[nid[ev.event_id]], nid[p]) for ev in graph_events for p in ev.pdu.prev_event_ids}

        # Forward: prev events of live events stop being extremities; a live
        # event is one unless something stored already points at it (it
        # arrived late). Backfilled events are history, never the room's leaves.
        live_referenced = {
            (room_of[nid[ev.event_id]], nid[p]) for ev in graph_events if not ev.backfilled for p in ev.pdu.prev_event_ids
        }
        # (A fresh nid was never stored, so never an extremity.)
        delete_pairs(
            txn, "forward_extremities", ("room_nid", "event_nid"),
            [pair for pair in live_referenced if pair[1] not in self.fresh_nids],
            queue=True,
        )
        # Fresh nids: only this batch's events can point at them.
        pointed_at = {nid[p] for ev in graph_events for p in ev.pdu.prev_event_ids}
        for part in chunks(sorted(new_nids - self.fresh_nids)):
            marks = ", ".join("?" for _ in part)
            pointed_at.update(r[0] for r in txn.execute(
                f"SELECT DISTINCT prev_event_nid FROM event_edges AS ed JOIN events AS e ON e.event_nid = ed.event_nid"
                f" WHERE ed.prev_event_nid IN ({marks}) AND e.outlier = ?",
                (*part, False),
            ).fetchall())
        txn.insert_many(
            "forward_extremities", ("room_nid", "event_nid"),
            sorted({(room_of[n], n) for n in new_nids - backfilled if n not in pointed_at}),
            queue=True,
        )
        # Backward: prev events we do not have as graph events; a new event
        # fills the gap it was.
        prev_nids = {p for _, p in referenced}
        have = {n for n, r in self.stored_events(prev_nids).items() if not r["outlier"]} | new_nids
        missing = sorted({(room, p) for room, p in referenced if p not in have})
        txn.insert_many(
            "backward_extremities", ("room_nid", "event_nid"), missing, on_conflict="ON CONFLICT DO NOTHING",
            queue=True,
        )
        delete_pairs(
            txn, "backward_extremities", ("room_nid", "event_nid"),
            [(room_of[n], n) for n in new_nids if n not in self.fresh_nids],
            queue=True,
        )

    def update_current_state(self, room_nid: int, room_id: str, position: int) -> bool:
        """Recompute current state from the forward extremities; True if it changed."""
        txn = self.txn
        # The room's current group and its extremities' groups, in one go.
        rows = txn.execute(
            "SELECT r.current_state_group, e.state_group FROM rooms AS r"
            " LEFT JOIN forward_extremities AS f ON f.room_nid = r.room_nid"
            " LEFT JOIN events AS e ON e.event_nid = f.event_nid"
            " WHERE r.room_nid = ?",
            (room_nid,),
        ).fetchall()
        groups = sorted({r[1] for r in rows if r[1] is not None})
        if not groups:
            return False
        old_group = rows[0][0]
        if len(groups) == 1:
            new_group = groups[0]
            new_state = self.full_state(new_group)
        else:
            states = [self.full_state(g) for g in groups]
            conflicts = find_conflicts(states)
            if conflicts and room_id in self.resolved:
                resolved = self.resolved[room_id]
                self.intern_keys(resolved)
                ids = self.p.interners.events.intern(txn, resolved.values())
                new_state = {self.key_nids[k]: ids[e] for k, e in resolved.items()}
                base = groups[-1]
                base_state = self.full_state(base)
                delta: dict[int, int | None] = {k: v for k, v in new_state.items() if base_state.get(k) != v}
                delta.update({k: None for k in base_state if k not in new_state})
                new_group = self.new_group(room_nid, None, base, delta) if delta else base
            elif conflicts:
                raise self.conflict_error(
                    room_id, conflicts,
                    what=f"the current state of {room_id}: its forward extremities' states",
                    advice="pass a resolved current state for the room (resolved_current_state)",
                )
            else:
                index, new_state = merge_states(states)
                base = groups[index]
                delta = {k: v for k, v in new_state.items() if states[index].get(k) != v}
                new_group = self.new_group(room_nid, None, base, delta) if delta else base
        if new_group == old_group:
            return False
        old_state = self.full_state(old_group)
        changed = {k for k in set(old_state) | set(new_state) if old_state.get(k) != new_state.get(k)}
        txn.queue("UPDATE rooms SET current_state_group = ? WHERE room_nid = ?", (new_group, room_nid))
        if not changed:
            return False
        self.names_of_keys(changed)
        removed = [(room_nid, k) for k in changed if k not in new_state]
        delete_pairs(txn, "current_state", ("room_nid", "type_key_nid"), removed, queue=True)
        upserts = sorted((room_nid, k, new_state[k]) for k in changed if k in new_state)
        txn.insert_many(
            "current_state", ("room_nid", "type_key_nid", "event_nid"), upserts,
            on_conflict="ON CONFLICT (room_nid, type_key_nid) DO UPDATE SET event_nid = excluded.event_nid",
            queue=True,
        )
        txn.insert_many(
            "current_state_deltas",
            ("stream_ordering", "instance_name", "room_nid", "type_key_nid", "event_nid", "prev_event_nid"),
            [(position, self.p.instance_name, room_nid, k, new_state.get(k), old_state.get(k)) for k in sorted(changed)],
            queue=True,
        )
        # Current memberships follow the member keys of current state.
        member_changes = [k for k in changed if self.key_names[k][0] == MEMBER]
        if member_changes:
            self.intern_users(self.key_names[k][1] for k in member_changes)
            self.load_event_facts([new_state[k] for k in member_changes if k in new_state])
            gone = [(room_nid, self.user_nids[self.key_names[k][1]]) for k in member_changes if k not in new_state]
            delete_pairs(txn, "current_memberships", ("room_nid", "user_nid"), gone, queue=True)
            rows = []
            for k in member_changes:
                if k in new_state:
                    event = new_state[k]
                    rows.append((room_nid, self.user_nids[self.key_names[k][1]],
                                 self.membership_of_event.get(event, NO_MEMBERSHIP_CODE), event, position))
            txn.insert_many(
                "current_memberships", ("room_nid", "user_nid", "membership", "event_nid", "stream_ordering"),
                sorted(rows),
                on_conflict="ON CONFLICT (room_nid, user_nid) DO UPDATE SET membership = excluded.membership,"
                " event_nid = excluded.event_nid, stream_ordering = excluded.stream_ordering",
                queue=True,
            )
        return True
