"""Persisting batches of events, atomically.

``EventPersister.persist_txn`` writes a whole batch in the caller's
transaction: event rows, the exact bytes, edges, extremities, state groups,
visibility snapshots, memberships, redactions and current state. Stream IDs
are reserved by the caller (``RoomStore.persist_events``) before the
transaction and completed after it, whether it commits or not.

State before an event comes from the caller (a full map, or a delta against a
known group) or is derived from the prev events' states: theirs where they
agree, else their resolution by the room version's algorithm
(``events/resolution_source.py``). Current state follows the forward
extremities the same way (the caller may pass a resolved current state for
a room, which stands in for the resolution there).
"""

from __future__ import annotations

from collections import abc
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import attrs

from roomstore.events.caches import batch_invalidations, write_cache_invalidations
from roomstore.events.resolution_source import ParsedEventCache, TransactionEventSource
from roomstore.events.tables.event_graph import insert_edges
from roomstore.events.tables.events import (
    StoredEvent,
    insert_event_json,
    insert_events,
    insert_redactions,
    queue_flag_redacted,
    stored_before_txn,
    unflagged_targets_txn,
)
from roomstore.events.write.auth_checks import checked_event, prefetch_auth_events, remember_after_commit
from roomstore.events.write.batch import (
    AssumedVersionWrong,
    ClientTxn,
    EventToPersist,
    PersistedEvent,
    PreparedEvent,
    StateDelta,
    StateKey,
    order_batch,
)
from roomstore.events.write.batch_state import HISTORY_VISIBILITY, MEMBER, BatchStateSteps, MissingStateError, Pending
from roomstore.events.write.client_txns import record_client_txns
from roomstore.events.write.current_state import RoomEnds, note_activity, update_current_state, update_extremities
from roomstore.events.write.redaction_authority import redaction_authorised
from roomstore.pdu.parsing import InvalidEventError
from roomstore.pdu.room_versions import UnknownRoomVersion
from roomstore.state.groups import StateGroupStore, StateGroupWrites
from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    Interners,
    LruCache,
    queue_room_version,
    room_versions_txn,
)
from roomstore.visibility.codes import membership_code, visibility_code
from roomstore.visibility.memberships import insert_memberships
from roomstore.visibility.snapshots import VisibilityStore, VisibilityWrites

__all__ = [
    "BatchOutcome",
    "ClientTxn",
    "EVENT_REFUSALS",
    "EventPersister",
    "EventToPersist",
    "MissingStateError",
    "PersistedEvent",
    "StateDelta",
]


#: What ``persist_events`` refuses a batch for because of its events (each
#: message names the event and why); an importer reports them line by line.
EVENT_REFUSALS = (InvalidEventError, MissingStateError, UnknownRoomVersion)


class EventPersister:
    """Writes batches of events; see the module docstring."""

    def __init__(
        self,
        interners: Interners,
        state_groups: StateGroupStore,
        visibility: VisibilityStore,
        instance_name: str,
        clock: Any,
    ):
        self.interners = interners
        # room_id -> room version, once stored (a room's version never
        # changes); RoomStore reads it too, before validating a batch.
        self.room_versions: LruCache[str, str] = LruCache(100_000)
        #: Stored events parsed for the auth checks and state resolution, across batches.
        self.parsed_events = ParsedEventCache()
        #: Auth-event checks passed, by what decides them (``auth_checks._decided_by``).
        self.passed_auth_checks: LruCache[tuple[Any, ...], bool] = LruCache(20_000)
        self.state_groups = state_groups
        self.visibility = visibility
        self.instance_name = instance_name
        #: "now" (``seconds()``) for the received timestamps a batch writes.
        self.clock = clock

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
    ) -> BatchOutcome:
        # Event IDs this transaction interned count as naming no stored event
        # (``fresh_nids``): true only of the transaction's one batch.
        written = txn.memo.setdefault(EventPersister, {})
        if written:
            raise RuntimeError("persist_txn writes one batch per transaction")
        written["batch"] = True
        writer = _BatchWriter(self, txn, resolved_current_state or {}, now_ms)
        outcome = writer.run(batch, stream_ids, backfill_ids)
        if cache_stream_id is not None:
            write_cache_invalidations(txn, cache_stream_id, self.instance_name, outcome.invalidations(), writer.now_ms)
        return outcome


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
        """(cache name, keys) every process must drop after this batch."""
        return batch_invalidations(self.redacted_event_ids, self.current_state_rooms, self.membership_users)


def _remember_all(cache: LruCache, mapping: Mapping) -> None:
    for key, value in mapping.items():
        cache.set(key, value)


@attrs.define
class _Rows:
    """The rows a batch writes, built event by event (``_BatchWriter._event_rows``)."""

    events: list = attrs.Factory(list)
    json: list = attrs.Factory(list)
    edges: list = attrs.Factory(list)
    auth: list = attrs.Factory(list)
    #: event nid -> its auth edges' nids (the auth-edge cache learns them at commit).
    auth_of: dict = attrs.Factory(dict)
    memberships: list = attrs.Factory(list)
    redactions: list = attrs.Factory(list)
    #: room ID -> newest stream ordering of its graph events in the batch.
    room_positions: dict = attrs.Factory(dict)
    #: user ID -> newest stream ordering of their membership events in the batch.
    membership_users: dict = attrs.Factory(dict)


#: An event's state group before and after it, and its visibility snapshots before and after (None: none).
_Groups = tuple[int | None, int | None, int | None, int | None]


class _BatchWriter(BatchStateSteps):
    """One batch inside one transaction. Short-lived; holds the batch's maps."""

    def __init__(self, persister: EventPersister, txn: Transaction, resolved: Mapping, now_ms: int | None):
        self.p = persister
        self.txn = txn
        self.resolved = resolved
        self.now_ms = now_ms if now_ms is not None else int(persister.clock.seconds() * 1000)
        self.pending: dict[int, Pending] = {}
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
        self.pending_events: dict[str, PreparedEvent] = {}
        self._event_source: TransactionEventSource | None = None
        #: The rooms' forward extremities as the batch moves them (soft failure's current state).
        self.ends = RoomEnds(txn)
        #: (room version, sender) -> the auth checks' keys of its events but members (``auth_checks``).
        self.auth_keys_of_sender: dict[tuple[str, str], dict[int, StateKey]] = {}
        #: (what decides an event's checks, its state group before) of the
        #: events the checks' quick path accepted (``auth_checks``).
        self.accepted_alike: set[tuple[tuple, int]] = set()

    # ---------------------------------------------------------------- helpers

    @property
    def event_source(self) -> TransactionEventSource:
        """The batch's events and the stored ones, as the auth checks and
        state resolution read them (one per batch: it keeps what it parsed)."""
        if self._event_source is None:
            self._event_source = TransactionEventSource(
                self.txn, self.p.interners, self.pending_events, self.p.parsed_events
            )
        return self._event_source

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

    # ---------------------------------------------------------------- the batch

    def run(
        self, batch: Sequence[PreparedEvent], stream_ids: Sequence[int], backfill_ids: Sequence[int]
    ) -> BatchOutcome:
        """The batch in named steps: intern its IDs, report what is stored
        already, intern the names of the rest, give them stream orderings,
        build and write their rows, then the rooms' ends and current state."""
        txn = self.txn
        batch = order_batch(batch)
        #: The batch's events by ID, for state resolution (not yet in the tables).
        self.pending_events = {ev.event_id: ev for ev in batch}
        self._intern_event_ids(batch)
        results, new_events = self._already_stored(batch)
        if not new_events:
            return BatchOutcome(results, {}, {}, set(), set(), [])
        room_nids = self._intern_names(new_events)
        ordering = self._orderings(new_events, stream_ids, backfill_ids)
        rows = self._event_rows(new_events, room_nids, ordering, results)
        record_client_txns(self, new_events, room_nids, results)
        redacted_targets = self._write_rows(new_events, rows)
        current_state_rooms = self._update_rooms(new_events, room_nids, ordering)
        self.group_writes.flush(txn)
        self.visibility_writes.flush(txn)
        redacted_ids = (
            set(self.p.interners.events.resolve(txn, redacted_targets).values()) if redacted_targets else set()
        )
        return BatchOutcome(
            results,
            rows.room_positions,
            rows.membership_users,
            current_state_rooms,
            redacted_ids,
            [ev.event_id for ev in new_events],
        )

    def _intern_event_ids(self, batch: Sequence[PreparedEvent]) -> None:
        """Every event ID the batch names, interned; ``fresh_nids``: those new."""
        all_ids = set()
        for ev in batch:
            all_ids.add(ev.event_id)
            all_ids.update(ev.pdu.prev_event_ids)
            all_ids.update(ev.pdu.auth_chain_event_ids)
            if ev.pdu.redacts:
                all_ids.add(ev.pdu.redacts)
            if ev.state_before is None:
                continue
            if isinstance(ev.state_before, abc.Mapping):
                all_ids.update(ev.state_before.values())
            elif isinstance(ev.state_before, StateDelta):
                all_ids.update(ev.state_before.changes.values())
        fresh_ids: set = set()
        self.event_nids = self.p.interners.events.intern(self.txn, all_ids, created=fresh_ids)
        self.fresh_nids = {self.event_nids[e] for e in fresh_ids}

    def _already_stored(self, batch: Sequence[PreparedEvent]) -> tuple[dict[str, PersistedEvent], list[PreparedEvent]]:
        """(results of the events stored before: a no-op that reports their
        positions, the new events)."""
        nid = self.event_nids
        results: dict[str, PersistedEvent] = {}
        stored = self.stored_events([nid[ev.event_id] for ev in batch])
        new_events = [ev for ev in batch if nid[ev.event_id] not in stored]
        for ev in batch:
            row = stored.get(nid[ev.event_id])
            if row is not None:
                results[ev.event_id] = PersistedEvent(
                    ev.event_id,
                    ev.pdu.room_id,
                    row.stream_ordering,
                    row.topological_ordering,
                    row.state_group_before,
                    row.state_group,
                    already_persisted=True,
                )
        return results, new_events

    def _intern_names(self, new_events: Sequence[PreparedEvent]) -> dict[str, int]:
        """Rooms (returned, their versions checked), users and state keys of
        the new events interned; the batch's own membership and history
        visibility facts noted; the state group and snapshot IDs sized."""
        nid = self.event_nids
        room_nids = self.p.interners.rooms.intern(self.txn, {ev.pdu.room_id for ev in new_events})
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
        # A batch of state events makes groups; with a membership or history
        # visibility change, snapshots too: both kinds of ids in one statement.
        state_types = {ev.pdu.type for ev in new_events if ev.pdu.state_key is not None and not ev.outlier}
        if state_types & {MEMBER, HISTORY_VISIBILITY[0]}:
            self.txn.reserve_ids([self.group_writes.ids_request(), self.visibility_writes.ids_request()])
        return room_nids

    @staticmethod
    def _orderings(
        new_events: Sequence[PreparedEvent], stream_ids: Sequence[int], backfill_ids: Sequence[int]
    ) -> dict[str, int]:
        """Stream orderings: arrival order for live events; backfilled events
        count down below zero, the newest (deepest) nearest zero."""
        live = [ev for ev in new_events if not ev.backfilled]
        backfilled = sorted((ev for ev in new_events if ev.backfilled), key=lambda ev: -ev.pdu.depth)
        if len(stream_ids) < len(live) or len(backfill_ids) < len(backfilled):
            raise ValueError("not enough stream IDs reserved for the batch")
        ordering = {ev.event_id: sid for ev, sid in zip(live, stream_ids, strict=True)}
        ordering.update({ev.event_id: -bid for ev, bid in zip(backfilled, backfill_ids, strict=True)})
        return ordering

    def _event_rows(
        self,
        new_events: list[PreparedEvent],
        room_nids: Mapping[str, int],
        ordering: Mapping[str, int],
        results: dict[str, PersistedEvent],
    ) -> _Rows:
        """The rows of the new events (their state groups and snapshots made
        on the way), each event's result added to ``results``."""
        nid = self.event_nids
        # What we know of prev events stored before this batch.
        prev_nids = {nid[p] for ev in new_events for p in ev.pdu.prev_event_ids}
        known = self.stored_events(prev_nids)
        groups_after: dict[int, int | None] = {n: r.state_group for n, r in known.items() if not r.outlier}
        rows = _Rows()
        prefetch_auth_events(self, new_events)
        remember_after_commit(self, new_events)
        for index, ev in enumerate(new_events):
            event_nid = nid[ev.event_id]
            room_nid = room_nids[ev.pdu.room_id]
            if ev.outlier:
                ev = checked_event(self, index, ev, new_events, None)
                groups: _Groups = (None, None, None, None)
            else:
                groups, ev = self._groups_of(index, ev, event_nid, room_nid, groups_after, new_events)
                groups_after[event_nid] = groups[1]
                self.ends.advance(ev, room_nid, event_nid, groups[1], self.event_nids)
            stream = ordering[ev.event_id]
            self._add_rows(rows, ev, event_nid, room_nid, stream, groups)
            results[ev.event_id] = PersistedEvent(
                ev.event_id,
                ev.pdu.room_id,
                stream,
                ev.pdu.depth,
                groups[0],
                groups[1],
                rejected_reason=ev.rejected_reason,
                soft_failed=ev.soft_failed,
            )
        return rows

    def _add_rows(
        self,
        rows: _Rows,
        ev: PreparedEvent,
        event_nid: int,
        room_nid: int,
        stream: int,
        groups: _Groups,
    ) -> None:
        """One event's rows (``groups``: its state groups and visibility
        snapshots before and after) added to the batch's."""
        pdu = ev.pdu
        nid = self.event_nids
        # Accepted in full: neither rejected nor soft-failed (which change
        # no membership and apply no redaction).
        effective = not ev.rejected_reason and not ev.soft_failed
        state_key = pdu.state_key
        type_key = self.key_nids[(pdu.type, state_key)] if state_key is not None else None
        group_before, group_after, visibility_before, visibility_after = groups
        rows.events.append(
            (
                event_nid,
                room_nid,
                pdu.type,
                type_key,
                self.user_nids[pdu.sender],
                pdu.depth,
                pdu.depth,
                stream,
                self.p.instance_name,
                pdu.origin_server_ts,
                self.now_ms,
                ev.outlier,
                ev.rejected_reason,
                ev.backfilled,
                False,
                group_before,
                group_after,
                visibility_before,
                visibility_after,
                ev.soft_failed,
            )
        )
        rows.json.append((event_nid, pdu.room_version.identifier, pdu.raw, ev.content_hash_mismatch))
        prev_ids = pdu.prev_event_ids
        if len(prev_ids) == 1:
            rows.edges.append((event_nid, nid[prev_ids[0]]))
        else:
            rows.edges.extend((event_nid, nid[p]) for p in dict.fromkeys(prev_ids))
        # With v12's implied create event: the auth chain's edges, as Synapse's event_auth.
        auth_nids = tuple([nid[a] for a in dict.fromkeys(pdu.auth_chain_event_ids)])
        rows.auth_of[event_nid] = auth_nids
        rows.auth.extend(zip(repeat(event_nid), auth_nids))
        if pdu.type == MEMBER and state_key is not None and effective:
            user_nids = self.user_nids
            rows.memberships.append(
                (
                    event_nid,
                    room_nid,
                    user_nids[state_key],
                    user_nids[pdu.sender],
                    membership_code(pdu.membership),
                    stream,
                )
            )
            rows.membership_users[state_key] = max(rows.membership_users.get(state_key, stream), stream)
        if pdu.redacts and pdu.type == "m.room.redaction" and effective:
            authorised = redaction_authorised(self, ev, group_before)
            rows.redactions.append((event_nid, nid[pdu.redacts], self.now_ms, authorised))
        if not ev.outlier:
            positions = rows.room_positions
            positions[pdu.room_id] = max(positions.get(pdu.room_id, stream), stream)

    def _groups_of(
        self,
        index: int,
        ev: PreparedEvent,
        event_nid: int,
        room_nid: int,
        groups_after: Mapping[int, int | None],
        new_events: list[PreparedEvent],
    ) -> tuple[_Groups, PreparedEvent]:
        """((state group before, after, visibility snapshot before, after),
        the event after its auth checks) of a graph event."""
        visibility_after = None
        group_before = self.state_before(ev, room_nid, groups_after)
        ev = checked_event(self, index, ev, new_events, group_before, room_nid)
        pdu = ev.pdu
        if group_before is None:
            # The room's first event: state before it is empty.
            visibility_before = self.p.visibility.snapshot_for(
                self.txn, room_nid, None, {}, None, self.visibility_writes
            )
        else:
            visibility_before = self.snapshot_of(group_before)
        group_after = group_before
        if pdu.state_key is not None and not ev.rejected_reason:
            key = self.key_nids[(pdu.type, pdu.state_key)]
            if group_before is None:
                group_after = self.new_group(room_nid, event_nid, None, {key: event_nid}, visibility_before)
            else:
                group_after = self.new_group(room_nid, event_nid, group_before, {key: event_nid})
            if pdu.type == MEMBER or (pdu.type, pdu.state_key) == HISTORY_VISIBILITY:
                visibility_after = self.snapshot_of(group_after)
        return (group_before, group_after, visibility_before, visibility_after), ev

    def _write_rows(self, new_events: Sequence[PreparedEvent], rows: _Rows) -> set[int]:
        """The rows written through their tables' owners; returns the
        targets newly flagged redacted."""
        txn = self.txn
        insert_events(txn, rows.events)
        insert_event_json(txn, rows.json)
        insert_edges(txn, rows.edges, rows.auth)
        # The next writes' auth chain walks find these edges without a read
        # (a create event's none too: it is stored, with every edge it has).
        txn.call_after(self.p.parsed_events.auth_edges.remember, rows.auth_of)
        insert_memberships(txn, rows.memberships)
        insert_redactions(txn, rows.redactions)
        nid = self.event_nids
        return self.flag_redactions([nid[ev.event_id] for ev in new_events], [r[0] for r in rows.redactions])

    def _update_rooms(
        self, new_events: Sequence[PreparedEvent], room_nids: Mapping[str, int], ordering: Mapping[str, int]
    ) -> set[str]:
        """Extremities, current state and activity of the rooms the batch
        touched; returns the rooms whose current state changed."""
        rooms_touched = {room_nids[ev.pdu.room_id] for ev in new_events if not ev.outlier}
        update_extremities(self, new_events, rooms_touched)
        live_rooms = {
            room_nids[ev.pdu.room_id]: ev.pdu.room_id for ev in new_events if not ev.outlier and not ev.backfilled
        }
        current_state_rooms = set()
        for room_nid, room_id in live_rooms.items():
            position = max(
                ordering[ev.event_id] for ev in new_events if ev.pdu.room_id == room_id and not ev.backfilled
            )
            if update_current_state(self, room_nid, room_id, position):
                current_state_rooms.add(room_id)
        note_activity(self.txn, new_events, room_nids, ordering)
        return current_state_rooms

    # ---------------------------------------------------------------- pieces

    def stored_events(self, event_nids) -> dict[int, StoredEvent]:
        """Facts of the events stored before this batch, by nid (others left out)."""
        fresh = self.fresh_nids
        return stored_before_txn(self.txn, [n for n in set(event_nids) if n not in fresh])

    def check_room_versions(self, events: Sequence[PreparedEvent], room_nids: Mapping[str, int]) -> None:
        cache = self.p.room_versions
        versions, unknown = cache.split(room_nids)
        if unknown:
            found = room_versions_txn(self.txn, unknown)
            versions.update(found)
            self.txn.call_after(_remember_all, cache, found)
        for ev in events:
            room_id = ev.pdu.room_id
            given = ev.pdu.room_version.identifier
            known = versions.get(room_id)
            if known is None:
                if ev.pdu.type == "m.room.create" and ev.pdu.state_key == "":
                    queue_room_version(self.txn, room_nids[room_id], given)
                    versions[room_id] = given
                    self.txn.call_after(cache.set, room_id, given)
                elif ev.version_assumed:  # its create event's write failed
                    raise InvalidEventError(
                        f"event {ev.event_id}: no room_version given and the room {room_id!r} is unknown"
                        " (persist its create event first, or pass room_version)"
                    )
            elif known != given:
                if ev.version_assumed:
                    raise AssumedVersionWrong(ev.event_id, room_id, given, known)
                raise InvalidEventError(
                    f"event {ev.event_id} claims room version {given} but room {ev.pdu.room_id} is version {known}"
                )

    def flag_redactions(self, new_event_nids: Sequence[int], new_redaction_nids: Sequence[int]) -> set[int]:
        """Set ``events.redacted`` where both the event and a redaction of it
        in the same room are stored, whichever arrived first."""
        txn = self.txn
        # A pair is flagged by the batch holding the later of its two events:
        # new events as targets of any redaction (never so for a fresh nid,
        # unless its redaction is in this batch too: found by the second
        # search), and this batch's redactions of any target.
        targets = unflagged_targets_txn(
            txn, "redacts_event_nid", [n for n in new_event_nids if n not in self.fresh_nids]
        ) | unflagged_targets_txn(txn, "redaction_event_nid", new_redaction_nids)
        queue_flag_redacted(txn, list(targets))
        return targets
