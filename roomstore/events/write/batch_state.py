"""The state a batch's write reads and makes: state groups (the batch's
own, pending until it commits, and stored ones), their visibility snapshots,
and the state before each event, given by the caller or derived from its
prev events (their resolution where they differ).

``BatchStateSteps`` is a base of the batch writer (``events/write/persist.py``),
apart because it is one concern: what the state is, where the writer's own
steps are which rows to write. It uses the writer's transaction, persister,
interned names and pending groups, which the writer sets.
"""

from __future__ import annotations

import json
from collections import abc
from collections.abc import Mapping
from typing import Any

import attrs

from roomstore.events.resolution_source import resolve_interned
from roomstore.events.tables.events import history_visibility_json_txn
from roomstore.events.write.batch import PreparedEvent, StateDelta
from roomstore.state.deltas import state_diff
from roomstore.state.groups import group_facts_txn
from roomstore.storage.interning import chunks
from roomstore.visibility.codes import NO_MEMBERSHIP_CODE, visibility_code
from roomstore.visibility.memberships import membership_codes_txn
from roomstore.visibility.snapshots import DEFAULT_VISIBILITY, snapshot_facts_sql

__all__ = ["BatchStateSteps", "HISTORY_VISIBILITY", "MEMBER", "MissingStateError", "Pending"]

MEMBER = "m.room.member"
HISTORY_VISIBILITY = ("m.room.history_visibility", "")
#: A stored group's snapshot facts, joined into the state owner's read of the group.
_SNAPSHOT_FACTS = snapshot_facts_sql("g.visibility_snapshot")


class MissingStateError(ValueError):
    """The state before an event cannot be derived: pass it explicitly."""


@attrs.define
class Pending:
    """A state group created in this transaction."""

    state: dict
    chain_length: int
    snapshot: int


class BatchStateSteps:
    """State groups, snapshots and the state before events, for one batch
    in one transaction (see the module docstring)."""

    p: Any
    txn: Any
    pending: dict[int, Pending]
    stored_groups: dict[int, tuple[int | None, int]]
    event_nids: dict[str, int]
    key_nids: dict
    key_names: dict
    user_nids: dict[str, int]
    membership_of_event: dict[int, int]
    visibility_of_event: dict[int, int]
    group_writes: Any
    visibility_writes: Any

    def names_of_keys(self, nids) -> None:  # the writer's
        raise NotImplementedError

    def intern_users(self, users) -> None:  # the writer's
        raise NotImplementedError

    def full_state(self, group: int | None) -> dict[int, int]:
        if group is not None and group in self.pending:
            return dict(self.pending[group].state)
        return self.p.state_groups.get_state(self.txn, group)

    def state_view(self, group: int | None) -> Mapping[int, int]:
        """``full_state`` to read only: a group of this batch is not copied."""
        if group is not None and group in self.pending:
            return self.pending[group].state
        return self.p.state_groups.get_state(self.txn, group)

    def _stored_group(self, group: int) -> tuple[int | None, int]:
        """(visibility snapshot, chain length) of a stored group, once per batch."""
        facts = self.stored_groups.get(group)
        if facts is None:
            # With its snapshot's facts, which the next snapshot derives from.
            row = group_facts_txn(self.txn, group, _SNAPSHOT_FACTS)
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

    def load_event_facts(self, event_nids) -> None:
        """Membership / history visibility codes of stored state events."""
        missing = [
            n for n in set(event_nids) if n not in self.membership_of_event and n not in self.visibility_of_event
        ]
        if not missing:
            return
        for part in chunks(missing):
            for nid, code in membership_codes_txn(self.txn, part):
                self.membership_of_event[nid] = code
            for nid, raw in history_visibility_json_txn(self.txn, part):
                content = json.loads(bytes(raw).decode("utf-8")).get("content")
                value = content.get("history_visibility") if isinstance(content, dict) else None
                self.visibility_of_event[nid] = visibility_code(value)

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
            snapshot = self.p.visibility.snapshot_for(
                self.txn, room_nid, None, changes, visibility, self.visibility_writes
            )
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
        self.pending[created.state_group] = Pending(dict(created.state), created.chain_length, snapshot)
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
            changes[user] = (
                NO_MEMBERSHIP_CODE if event is None else self.membership_of_event.get(event, NO_MEMBERSHIP_CODE)
            )
        visibility = None
        if hv_key is not None and hv_key in delta:
            event = delta[hv_key]
            visibility = (
                DEFAULT_VISIBILITY if event is None else self.visibility_of_event.get(event, DEFAULT_VISIBILITY)
            )
        elif full:
            visibility = DEFAULT_VISIBILITY
        return changes, visibility

    def state_before(self, ev: PreparedEvent, room_nid: int, groups_after: Mapping[int, int | None]) -> int | None:
        """The state group before ``ev``: given by the caller, or derived."""
        nid = self.event_nids
        given = ev.state_before
        prev_event_ids = ev.pdu.prev_event_ids
        if given is None and len(prev_event_ids) == 1:
            # The common case: one prev event, stored as a graph event.
            group = groups_after.get(nid[prev_event_ids[0]], "missing")
            if group != "missing":
                return group
        prev_groups = [groups_after.get(nid[p], "missing") for p in prev_event_ids]
        if isinstance(given, StateDelta):
            if given.base_state_group not in self.pending and not self.p.state_groups.group_exists(
                self.txn, given.base_state_group
            ):
                raise MissingStateError(f"state_before of {ev.event_id}: unknown state group {given.base_state_group}")
            delta = {self.key_nids[k]: nid[e] for k, e in given.changes.items()}
            if not delta:
                return given.base_state_group
            return self.new_group(room_nid, None, given.base_state_group, delta)
        if isinstance(given, abc.Mapping):
            wanted = {self.key_nids[k]: nid[e] for k, e in given.items()}
            base = next((g for g in prev_groups if isinstance(g, int)), None)
            if base is None:
                return self.new_group(room_nid, None, None, wanted)
            base_state = self.full_state(base)
            if base_state == wanted:
                return base
            return self.new_group(room_nid, None, base, state_diff(wanted, base_state))
        # Derive from the prev events.
        if not ev.pdu.prev_event_ids:
            return None
        missing = [p for p, g in zip(ev.pdu.prev_event_ids, prev_groups, strict=True) if g == "missing"]
        if missing:
            raise MissingStateError(
                f"cannot derive the state at {ev.event_id}: prev events {sorted(missing)} are not stored "
                "(or only as outliers); pass state_before"
            )
        distinct = list(dict.fromkeys(prev_groups))
        if len(distinct) == 1:
            return distinct[0]
        states = [self.full_state(g) for g in distinct]
        if all(state == states[0] for state in states[1:]):
            return distinct[0]
        # The prev events' states differ (a key of different events, or of
        # some and not others): the room version's state resolution decides,
        # as the spec and Synapse do; a plain union would keep an event of one
        # branch that the other branch's state no longer allows.
        delta = state_diff(resolve_interned(self, ev.pdu.room_version, states), states[0])
        return self.new_group(room_nid, None, distinct[0], delta) if delta else distinct[0]
