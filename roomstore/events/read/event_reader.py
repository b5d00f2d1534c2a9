"""Reads of the event store: events, bytes, state, extremities, membership.

``EventReader`` holds the read caches (parsed events in a bounded LRU, rooms
for each user) and the transaction functions ``RoomStore`` runs. Events are
returned as dicts parsed from the stored bytes, with ``event_id`` added for
room versions whose PDUs do not carry it (and ``room_id`` for a room version
12 create event: ``add_derived_ids``), and pruned by the room version's
redaction algorithm (``unsigned.redacted_because`` set) when a redaction of
them in the same room is stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from roomstore.events.resolution_source import TransactionEventSource
from roomstore.events.tables.client_txns import txn_records_of_events_txn
from roomstore.events.tables.event_graph import auth_chain_nids_txn
from roomstore.events.tables.events import (
    json_txn,
    redactions_of_txn,
    served_rows_txn,
    state_groups_row_txn,
    stored_events_txn,
)
from roomstore.events.tables.room_state import (
    EXTREMITY_TABLES,
    extremity_nids_txn,
    member_nids_txn,
    rooms_of_user_txn,
)
from roomstore.events.tables.room_state import (
    current_state_txn as current_state_rows_txn,
)
from roomstore.events.tokens import StreamToken, TopologicalToken
from roomstore.pdu.hashing import add_derived_ids
from roomstore.pdu.redaction_algorithm import redacted_copy
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, get_room_version
from roomstore.state.groups import StateGroupNotFound, StateGroupStore
from roomstore.storage.database import Database, Transaction
from roomstore.storage.errors import NotFoundError
from roomstore.storage.interning import Interners, LruCache, chunks, key_nids_of_types_txn
from roomstore.visibility.codes import MEMBERSHIP_CODES

JOIN = MEMBERSHIP_CODES["join"]


def _parse(raw) -> dict:
    return json.loads(bytes(raw).decode("utf-8"))


@attrs.frozen
class EventFlags:
    """What the store knows of a stored event beside its JSON."""

    outlier: bool
    rejected_reason: str | None
    #: A redaction of it, in its room, is stored too.
    redacted: bool
    stream_ordering: int
    #: Accepted but soft-failed: not served in timelines, no extremity.
    soft_failed: bool = False


class EventReader:
    """Read paths of the store.

    Who calls it: ``RoomStore``, the other readers for events in their
    served form, and ``StoreCaches`` (``roomstore.events.caches``), which
    decides what its caches drop. Collaborators: the database, the interners, the state
    groups (state at an event) and the events stream's ID generator (the
    current token).
    """

    def __init__(
        self,
        db: Database,
        interners: Interners,
        state_groups: StateGroupStore,
        events_stream: Any,
        event_cache_size: int,
    ):
        self.db = db
        self.interners = interners
        self.state_groups = state_groups
        self.events_stream = events_stream
        self._events: LruCache[str, dict[str, Any]] = LruCache(event_cache_size)  # as served
        self._rooms_for_user: LruCache[str, frozenset[str]] = LruCache(50_000)  # joined room ids
        # What the client format adds to a stored event, fixed once it is
        # stored (its state before, its client transaction are written with
        # it); only a purge (or anything else that drops every cache) takes
        # them away. State event ID -> the event it replaced ("" none);
        # event ID -> the client transactions recorded with it.
        self._replaced: LruCache[str, str] = LruCache(event_cache_size)
        self._txn_records: LruCache[str, tuple[tuple[str, str, str], ...]] = LruCache(event_cache_size)
        self._format_generation = 0
        # Bumped by every invalidation: a read whose transaction began before
        # an invalidation may have seen the old rows, so it must not fill the
        # cache (else the stale answer would stay until the next change).
        self._events_generation = 0
        self._memberships_generation = 0

    # ------------------------------------------------------------------ caches

    def invalidate_event(self, event_id: str) -> None:
        self._events_generation += 1
        self._events.pop(event_id)

    def invalidate_rooms_for_users(self, user_ids: Iterable[str]) -> None:
        self._memberships_generation += 1
        for user_id in user_ids:
            self._rooms_for_user.pop(user_id)

    def invalidate_all_memberships(self) -> None:
        # A current-state change can change anybody's rooms (e.g. a resolved
        # state); such batches are rare enough to drop it all.
        self._memberships_generation += 1
        self._rooms_for_user.clear()

    def invalidate_all(self) -> None:
        self._events_generation += 1
        self._memberships_generation += 1
        self._format_generation += 1
        self._events.clear()
        self._rooms_for_user.clear()
        self._replaced.clear()
        self._txn_records.clear()

    @property
    def events_generation(self) -> int:
        """Read before a transaction, handed back to ``cache_events`` after it."""
        return self._events_generation

    def cached_event(self, event_id: str) -> dict | None:
        """The served event if the event cache holds it (never a fetch)."""
        return self._events.get(event_id)

    def cache_events(self, generation: int, events: Mapping[str, dict]) -> None:
        """Cache served events read by another reader in a transaction begun
        at ``generation``: dropped if an invalidation came since."""
        if generation == self._events_generation:
            for event_id, event in events.items():
                self._events.set(event_id, event)

    def cached_replaced(self, event_ids: Iterable[str]) -> tuple[dict[str, str | None], list[str]]:
        """``({event_id: replaced_id or None}, not cached)``: what
        ``replaced_state_txn`` answered before, for the events it knew."""
        known, unknown = self._replaced.split(event_ids)
        return {event_id: replaced or None for event_id, replaced in known.items()}, unknown

    def cached_txn_records(self, event_ids: Iterable[str]) -> tuple[dict[str, tuple], list[str]]:
        """``({event_id: records}, not cached)``: what ``txn_records_txn`` answered before."""
        known: dict[str, tuple] = {}
        unknown = []
        for event_id in event_ids:
            records = self._txn_records.get(event_id)
            if records is None:
                unknown.append(event_id)
            else:
                known[event_id] = records
        return known, unknown

    @property
    def format_generation(self) -> int:
        """Read before the client format's lookups, handed back to ``cache_format_answers``."""
        return self._format_generation

    def cache_format_answers(
        self, generation: int, replaced: Mapping[str, str | None], txn_records: Mapping[str, tuple]
    ) -> None:
        """Keep ``replaced_state_txn``'s and ``txn_records_txn``'s answers,
        unless a purge came since ``generation``."""
        if generation == self._format_generation:
            for event_id, replaced_id in replaced.items():
                self._replaced.set(event_id, replaced_id or "")
            for event_id, records in txn_records.items():
                self._txn_records.set(event_id, records)

    # ------------------------------------------------------------------ events

    async def get_events(
        self, event_ids: Sequence[str], redact: bool = True, allow_rejected: bool = False
    ) -> dict[str, dict]:
        """Served events by ID; rejected ones only with ``allow_rejected``
        (the cache holds no rejected event, so a hit serves either way)."""
        result: dict[str, dict] = {}
        missing = []
        for event_id in dict.fromkeys(event_ids):
            cached = self._events.get(event_id) if redact else None
            if cached is not None:
                result[event_id] = cached
            else:
                missing.append(event_id)
        if missing:
            generation = self._events_generation
            rejected: set[str] = set()
            fetched = await self.db.run_interaction(
                "get_events", self.events_txn, missing, redact, allow_rejected, rejected
            )
            cacheable = redact and generation == self._events_generation
            for event_id, event in fetched.items():
                if cacheable and event_id not in rejected:
                    self._events.set(event_id, event)
                result[event_id] = event
        return result

    def events_txn(
        self,
        txn: Transaction,
        event_ids: Sequence[str],
        redact: bool = True,
        allow_rejected: bool = True,
        rejected_found: set | None = None,
    ) -> dict[str, dict]:
        """Served events by ID; rejected ones left out unless ``allow_rejected``
        (then their IDs are added to ``rejected_found`` when given)."""
        nids = self.interners.events.lookup(txn, event_ids)
        by_nid = {n: e for e, n in nids.items()}
        result: dict[str, dict] = {}
        redacted: dict[int, str] = {}  # event nid -> its room version
        for part in chunks(sorted(by_nid)):
            rows = served_rows_txn(txn, part)
            for nid, version, raw, is_redacted, _outlier, rejected, _stream in rows:
                if rejected is not None:
                    if not allow_rejected:
                        continue
                    if rejected_found is not None:
                        rejected_found.add(by_nid[nid])
                event = add_derived_ids(_parse(raw), by_nid[nid], KNOWN_ROOM_VERSIONS.get(version))
                result[by_nid[nid]] = event
                if is_redacted and redact:
                    redacted[nid] = version
        if redacted:
            self._apply_redactions(txn, result, by_nid, redacted)
        return result

    def flags_txn(self, txn: Transaction, event_ids: Sequence[str]) -> dict[str, EventFlags]:
        """The stored flags of those of ``event_ids`` that are stored (no JSON read)."""
        nids = self.interners.events.lookup(txn, event_ids)
        by_nid = {n: e for e, n in nids.items()}
        return {
            by_nid[nid]: EventFlags(
                row.outlier, row.rejected_reason, row.redacted, row.stream_ordering, row.soft_failed
            )
            for nid, row in stored_events_txn(txn, by_nid).items()
        }

    def topological_token_txn(self, txn: Transaction, event_id: str) -> str:
        """``t<topological_ordering>-<stream_ordering>`` of a stored event
        of a room's graph: the pagination position just after it.
        ``NotFoundError`` for an event not stored, or stored as an outlier."""
        nid = self.interners.events.lookup(txn, [event_id]).get(event_id)
        row = None if nid is None else stored_events_txn(txn, [nid]).get(nid)
        if row is None or row.outlier:
            what = "is not stored" if row is None else "is an outlier: it has no place in a timeline"
            raise NotFoundError(f"event {event_id} {what}")
        return TopologicalToken(row.topological_ordering, row.stream_ordering).to_string()

    def _apply_redactions(self, txn, result, by_nid, redacted: Mapping[int, str]) -> None:
        done = set()
        for target, raw, redaction_id in redactions_of_txn(txn, list(redacted)):
            if target in done:
                continue  # the first redaction is the one reported
            done.add(target)
            event_id = by_nid[target]
            redaction = _parse(raw)
            redaction.setdefault("event_id", redaction_id)
            version = get_room_version(redacted[target])
            pruned = add_derived_ids(redacted_copy(result[event_id], version, redaction), event_id, version)
            result[event_id] = pruned

    def json_bytes_txn(self, txn: Transaction, event_id: str) -> bytes | None:
        nid = self.interners.events.lookup(txn, [event_id]).get(event_id)
        if nid is None:
            return None
        raw = json_txn(txn, nid)
        return None if raw is None else bytes(raw)

    # ------------------------------------------------------------------ state

    def _key_filter(self, txn: Transaction, room_nid: int | None, types) -> list[int] | None:
        """Interned keys matching ``(type, state_key)`` filters (state_key None: any)."""
        if types is None:
            return None
        exact = [t for t in types if t[1] is not None]
        wildcard = sorted({t[0] for t in types if t[1] is None})
        keys = set(self.interners.state_keys.lookup(txn, exact).values())
        keys.update(key_nids_of_types_txn(txn, wildcard))
        return sorted(keys)

    def _named_state(self, txn: Transaction, state: Mapping[int, int]) -> dict[tuple[str, str], str]:
        """``(type, state_key) -> event_id`` of an interned state: two bulk
        lookups in the interners' caches and one ``dict(zip())``."""
        keys = self.interners.state_keys.resolve_list(txn, list(state))
        events = self.interners.events.resolve_list(txn, list(state.values()))
        return dict(zip(keys, events, strict=True))

    def state_ids_txn(self, txn: Transaction, event_id: str, before: bool, types) -> dict[tuple[str, str], str]:
        nid = self.interners.events.lookup(txn, [event_id]).get(event_id)
        row = None if nid is None else state_groups_row_txn(txn, nid)
        if row is None:
            raise NotFoundError(f"unknown event {event_id}: it is not stored")
        group_before, group_after, outlier, room_nid = row
        if outlier:
            raise StateGroupNotFound(f"{event_id} is an outlier: the store has no state for it")
        group = group_before if before else group_after
        keys = self._key_filter(txn, room_nid, types)
        if keys is None:
            state = self.state_groups.get_state(txn, group)
        else:
            state = self.state_groups.get_state_filtered(txn, group, keys)
        return self._named_state(txn, state)

    def replaced_state_txn(self, txn: Transaction, events: Sequence[tuple[str, str, str]]) -> dict[str, str | None]:
        """``{event_id: replaced_id or None}``: for each ``(event_id, type,
        state_key)`` of a stored graph event, the state event of its key in
        the state before it (None: there is none); events not stored, or
        outliers, are left out (their answer may change). The state groups
        are read for the keys asked of them alone, in one statement."""
        nids = self.interners.events.lookup(txn, [event_id for event_id, _, _ in events])
        rows = stored_events_txn(txn, nids.values())
        key_nids = self.interners.state_keys.lookup(txn, list({(t, k) for _, t, k in events}))
        by_group: dict[int, list[tuple[str, int]]] = {}
        found: dict[str, int | None] = {}
        for event_id, event_type, state_key in events:
            row = rows.get(nids.get(event_id, -1))
            key = key_nids.get((event_type, state_key))
            if row is None or row.outlier or key is None:
                continue
            if row.state_group_before is None:
                found[event_id] = None  # nothing before it: a create event
            else:
                by_group.setdefault(row.state_group_before, []).append((event_id, key))
        states = self.state_groups.get_states_filtered(
            txn, {group: sorted({key for _, key in asked}) for group, asked in by_group.items()}
        )
        for group, asked in by_group.items():
            found.update((event_id, states[group].get(key)) for event_id, key in asked)
        names = self.interners.events.resolve(txn, {nid for nid in found.values() if nid is not None})
        return {
            event_id: None if nid is None else names[nid]
            for event_id, nid in found.items()
            if nid is None or nid in names
        }

    def txn_records_txn(self, txn: Transaction, event_ids: Sequence[str]) -> dict[str, tuple]:
        """``{event_id: ((user_id, device_id, txn_id), ...)}``: the client
        transactions each stored event was recorded with (none: ``()``);
        events not stored are left out (a record may come with them)."""
        records = txn_records_of_events_txn(txn, event_ids)
        nids = self.interners.events.lookup(txn, [e for e in event_ids if e not in records])
        stored = stored_events_txn(txn, nids.values())
        answers: dict[str, tuple] = {event_id: () for event_id, nid in nids.items() if nid in stored}
        answers.update((event_id, tuple(found)) for event_id, found in records.items())
        return answers

    def state_ids_for_events_txn(
        self, txn: Transaction, event_ids: Sequence[str], before: bool
    ) -> dict[str, dict[tuple[str, str], str]]:
        """The state after (or before) each of ``event_ids`` in one
        transaction, each distinct state group read once; events not stored,
        or stored as outliers, are absent from the result."""
        nids = self.interners.events.lookup(txn, event_ids)
        rows = stored_events_txn(txn, nids.values())
        group_of = {
            event_id: (row.state_group_before if before else row.state_group)
            for event_id, nid in nids.items()
            if (row := rows.get(nid)) is not None and not row.outlier
        }
        named = {
            group: self._named_state(txn, self.state_groups.get_state(txn, group)) for group in set(group_of.values())
        }
        return {event_id: dict(named[group]) for event_id, group in group_of.items()}

    # ------------------------------------------------------------------ auth chains

    def auth_chain_ids_txn(self, txn: Transaction, event_ids: Sequence[str]) -> set[str]:
        """The IDs of the auth chain of ``event_ids`` (``auth_chain_nids_txn``)."""
        nids = self.interners.events.lookup(txn, event_ids)
        return set(self.interners.events.resolve(txn, auth_chain_nids_txn(txn, nids.values())).values())

    def auth_chain_difference_txn(self, txn: Transaction, state_sets: Sequence[Iterable[str]]) -> set[str]:
        """State resolution v2's auth difference: the events in some but not
        every set's closure, a set's closure being its events and their auth
        chains (as Synapse counts it). An event not stored is its own closure.
        The write's state resolution asks the same of the same source."""
        return TransactionEventSource(txn, self.interners, {}).auth_chain_difference([set(s) for s in state_sets])

    def current_state_txn(self, txn: Transaction, room_id: str, types) -> dict[tuple[str, str], str]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return {}
        keys = self._key_filter(txn, room_nid, types)
        return self._named_state(txn, current_state_rows_txn(txn, room_nid, keys))

    def extremities_txn(self, txn: Transaction, room_id: str, which: str) -> list[str]:
        EXTREMITY_TABLES[which]  # KeyError for anything but "forward" or "backward"
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        nids = extremity_nids_txn(txn, room_nid, which)
        return sorted(self.interners.events.resolve(txn, nids).values())

    # ------------------------------------------------------------------ membership

    def users_in_room_txn(self, txn: Transaction, room_id: str) -> list[str]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        nids = member_nids_txn(txn, room_nid, JOIN)
        return sorted(self.interners.users.resolve(txn, nids).values())

    async def get_rooms_for_user(self, user_id: str) -> frozenset[str]:
        cached = self._rooms_for_user.get(user_id)
        if cached is not None:
            return cached
        generation = self._memberships_generation
        rooms = frozenset(await self.db.run_interaction("get_rooms_for_user", self.rooms_for_user_txn, user_id))
        if generation == self._memberships_generation:
            self._rooms_for_user.set(user_id, rooms)
        return rooms

    def rooms_for_user_txn(self, txn: Transaction, user_id: str) -> list[str]:
        return rooms_of_user_txn(txn, user_id, JOIN)

    # ------------------------------------------------------------------ tokens

    def current_token(self) -> StreamToken:
        """The position every read 'up to now' stops at."""
        return StreamToken.create(self.events_stream.get_current_token(), {})
