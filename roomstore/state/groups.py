"""State groups: the state of a room at a point, stored as deltas.

A state group maps interned ``(type, state_key)`` ids to event ids. It is
stored as a delta against a predecessor (``state_groups.prev_state_group``)
or, when the chain of predecessors would grow past ``max_chain_length``, as a
full snapshot. A delta row with a NULL event removes the key (only offline
compaction writes those). A group whose delta is one row also keeps a copy of
it in its own row (``sole_*``, schema version 6), which every writer of its
rows keeps in step. The full state of a group is computed by one SQL
statement: a recursive walk up the chain returning each group's rows (packed
into one value per group; on PostgreSQL a one-row delta comes from the
group's row) with its distance from the group, folded so that for each key
the nearest row wins. One statement
sees one snapshot of the database, so a concurrent rewrite of the chain by the
compaction job is seen wholly or not at all.

Every statement naming the tables is in :mod:`roomstore.state.group_tables`
(their one owner); this module is the logic over them. Who calls it: the
event persister (inside its transaction) and the readers.
All methods take a ``Transaction``; computed states are cached once their
groups are committed (groups never change content, only representation).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from operator import itemgetter
from typing import Literal, TypeVar, cast

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from roomstore.state import group_tables as tables
from roomstore.state.group_tables import (  # noqa: F401 (the statements' home; re-exported for the store's callers)
    FULL_STATE_SQL,
    MAX_WALK_HOPS,
    full_state_sql,
    packed_full_state_sql,
    sole_delta,
    sole_deltas_sql,
)
from roomstore.storage.database import Database, Transaction
from roomstore.storage.engines import Row
from roomstore.storage.errors import NotFoundError
from roomstore.storage.interning import LruCache, chunks
from roomstore.storage.maintenance_locks import COMPACTION_LOCK_NAME, lock_row_txn

log = Logger()

StateMap = Mapping[int, int]  # type_key_nid -> event_nid

R = TypeVar("R")
#: The compaction job holds its lock: ``("locked", holder, age_s)``.
Locked = tuple[Literal["locked"], str, float]
#: A lock older than the timeout, ignored: ``(holder, age_s)``; None when there was none.
StaleLock = tuple[str, float] | None
#: What :func:`compaction_lock_txn` found.
LockCheck = Locked | tuple[Literal["free"], StaleLock]
#: One attempt of a deletion that waits for the lock: locked, or done with its result.
Attempt = Locked | tuple[Literal["done"], R, StaleLock]

#: Synapse's MAX_STATE_DELTA_HOPS: a lookup walks at most this many groups.
DEFAULT_MAX_CHAIN_LENGTH = 100

_HOPS = itemgetter(0)


def _without_removals(state: dict[int, int | None]) -> dict[int, int]:
    """``state`` without the keys a nearest row removed (None events)."""
    if None in state.values():
        return {key: event for key, event in state.items() if event is not None}
    return cast(dict[int, int], state)  # no None among its values: checked above


def fold_packed_state(rows: list[Row], unpack: Callable[[object], list[list[int | None]]]) -> dict[int, int]:
    """A group's state from :func:`packed_full_state_sql`'s rows
    ``(hops, key, event, packed)``, in any order: farthest group first, each
    nearer one overwriting its keys (its packed rows, or its one row when
    ``packed`` is NULL); then removals (None events) dropped."""
    rows.sort(key=_HOPS, reverse=True)
    state: dict[int, int | None] = {}
    update = state.update
    for _, key, event, packed in rows:
        if packed is None:
            state[key] = event
        else:
            columns = unpack(packed)
            if columns:
                update(zip(*columns, strict=True))
    return _without_removals(state)


def fold_state(rows: Iterable[tuple[int, int, int | None]]) -> dict[int, int]:
    """A group's state from :data:`FULL_STATE_SQL`'s ``(hops, type_key_nid,
    event_nid)`` rows, in any order: the nearest row (fewest hops) of each key
    wins, and a NULL event (a removal) drops the key. A list is sorted in
    place (nearest first: one pass when it comes so)."""
    if not isinstance(rows, list):
        rows = list(rows)
    rows.sort(key=_HOPS)
    state = {key: event for _, key, event in reversed(rows)}
    return _without_removals(state)


class StateGroupNotFound(NotFoundError):
    """No state for what was asked: a group that does not exist, or an
    outlier's (which has none). A ``NotFoundError``, as an unknown event is,
    so a reader of state needs one ``except``."""


@attrs.frozen
class NewStateGroup:
    """A group created in this transaction, with its full state (for caching)."""

    state_group: int
    state: Mapping[int, int]
    chain_length: int


class StateGroupStore:
    """Creates state groups and computes their full state."""

    def __init__(self, max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH, cache_size: int = 64):
        if max_chain_length < 0:
            raise ValueError("max_chain_length must be >= 0")
        self.max_chain_length = max_chain_length
        self._cache: LruCache[int, dict[int, int]] = LruCache(cache_size)  # committed groups only

    # ------------------------------------------------------------------ reads

    def get_state(
        self, txn: Transaction, state_group: int | None, pending: Mapping[int, StateMap] | None = None
    ) -> dict[int, int]:
        """The full state of ``state_group`` (None: the empty state).

        ``pending`` holds groups created earlier in the same transaction.
        The returned dict is a copy the caller may change.
        """
        if state_group is None:
            return {}
        if pending and state_group in pending:
            return dict(pending[state_group])
        cached = self._cache.get(state_group)
        if cached is not None:
            return dict(cached)
        engine = txn.engine
        rows = txn.execute(packed_full_state_sql(engine), (state_group,), prepare=True).fetchall()
        state = fold_packed_state(rows, engine.unpack_ints)
        if not state and not self.group_exists(txn, state_group):
            raise StateGroupNotFound(f"state group {state_group} does not exist")
        txn.call_after(self._cache.set, state_group, dict(state))
        return state

    def get_state_filtered(self, txn: Transaction, state_group: int | None, type_keys: Iterable[int]) -> dict[int, int]:
        """Only the given keys of a group's state (one statement, no full load)."""
        wanted = list(type_keys)
        if state_group is None or not wanted:
            return {}
        cached = self._cache.get(state_group)
        if cached is not None:
            return {k: cached[k] for k in wanted if k in cached}
        result: dict[int, int] = {}
        for part in chunks(wanted):
            sql = full_state_sql(keys=len(part))
            result.update(fold_state(txn.execute(sql, (state_group, *part)).fetchall()))
        return result

    def get_states_filtered(self, txn: Transaction, asked: Mapping[int, Iterable[int]]) -> dict[int, dict[int, int]]:
        """``get_state_filtered`` of several groups (group -> its keys): the
        cached ones from the cache, the rest in one statement a chunk."""
        result: dict[int, dict[int, int]] = {}
        uncached: dict[int, list[int]] = {}
        for group, keys in asked.items():
            cached = self._cache.get(group)
            if cached is not None:
                result[group] = {k: cached[k] for k in keys if k in cached}
            else:
                uncached[group] = list(keys)
        for part in chunks(sorted(uncached), 100):
            wanted = sorted({key for group in part for key in uncached[group]})
            rows: dict[int, list[tuple[int, int, int | None]]] = {group: [] for group in part}
            for keys in chunks(wanted, 400):
                sql = tables.filtered_states_sql(len(part), len(keys))
                for start, hops, key, event in txn.execute(sql, (*part, *keys)).fetchall():
                    rows[start].append((hops, key, event))
            for group in part:
                state = fold_state(rows[group])
                result[group] = {k: state[k] for k in uncached[group] if k in state}
        return result

    def group_exists(self, txn: Transaction, state_group: int) -> bool:
        return txn.execute(tables.GROUP_EXISTS, (state_group,)).fetchone() is not None

    def chain_length(self, txn: Transaction, state_group: int) -> int:
        value: int | None = txn.select_one_value(tables.CHAIN_LENGTH, (state_group,))
        if value is None:
            raise StateGroupNotFound(f"state group {state_group} does not exist")
        return value

    # ------------------------------------------------------------------ writes

    def create(
        self,
        txn: Transaction,
        room_nid: int,
        event_nid: int | None,
        parent: int | None,
        parent_state: Mapping[int, int],
        delta: Mapping[int, int | None],
        parent_chain_length: int | None = None,
        visibility_snapshot: int | None = None,
        writes: StateGroupWrites | None = None,
    ) -> NewStateGroup:
        """Make the group ``parent_state + delta``, as a delta on ``parent``,
        or as a snapshot when the chain would grow past the bound.

        ``parent_state`` must be the full state of ``parent`` ({} for None); a
        None in ``delta`` removes the key. ``parent_chain_length`` saves a
        query when the caller knows it. With ``writes`` the rows wait there
        until ``writes.flush()`` (the caller keeps the new group's state until
        then); without, they are written now.
        """
        state = dict(parent_state)
        for key, event in delta.items():
            if event is None:
                state.pop(key, None)
            else:
                state[key] = event
        if parent is not None and parent_chain_length is None:
            parent_chain_length = self.chain_length(txn, parent)
        group = tables.next_group_ids_txn(txn, writes.expected if writes else 1)
        prev: int | None
        rows: Mapping[int, int | None]
        if parent is None or parent_chain_length is None or parent_chain_length + 1 > self.max_chain_length:
            prev, length, rows = None, 0, state
        else:
            prev, length, rows = parent, parent_chain_length + 1, delta
        # In key order: PostgreSQL returns a group's rows in the order they
        # were written, and naming a state whose keys come in interning order
        # touches the interners' caches in the order they were filled.
        written = {key: rows[key] for key in sorted(rows) if prev is not None or rows[key] is not None}
        own = writes if writes is not None else StateGroupWrites()
        row, deltas = tables.group_rows(group, room_nid, event_nid, prev, length, written, visibility_snapshot)
        own.groups.append(row)
        own.deltas.extend(deltas)
        if writes is None:
            own.flush(txn)
        txn.call_after(self._cache.set, group, state)
        return NewStateGroup(group, state, length)

    def forget(self, state_group: int) -> None:
        self._cache.pop(state_group)

    def forget_all(self) -> None:
        """Drop every cached state (a purge deleted groups this process may not know)."""
        self._cache.clear()


class StateGroupWrites:
    """Rows of state groups made in one transaction, written together.

    ``expected`` is how many groups the caller may make: that many ids are
    reserved in one statement.
    """

    def __init__(self, expected: int = 1):
        self.expected = expected
        self.groups: list[Row] = []
        self.deltas: list[Row] = []

    def ids_request(self) -> tuple[str, str, int]:
        """The ``expected`` group ids, for ``Transaction.reserve_ids``."""
        return tables.group_ids_request(self.expected)

    def flush(self, txn: Transaction) -> None:
        tables.insert_groups_txn(txn, self.groups, self.deltas)
        self.groups, self.deltas = [], []


# ---------------------------------------------------------------------- writers' SQL
# What the event store (not the read side above) runs against state groups:
# the facts the persister derives a new group from, and deleting groups.

#: A compaction lock whose heartbeat is older than this many seconds is
#: taken to be left behind by a dead job and ignored (with a warning).
COMPACTION_LOCK_TIMEOUT_S = 600.0


def group_facts_txn(txn: Transaction, state_group: int, snapshot_facts: tuple[str, str]) -> Row | None:
    """``(visibility snapshot, chain length, branch, seq, history visibility,
    branch tip seq)`` of a stored group: what the persister needs to make a
    group on top of it (the snapshot columns NULL when it has none); None
    when the group does not exist. ``snapshot_facts``: the visibility owner's
    ``snapshot_facts_sql("g.visibility_snapshot")`` (state may not import it)."""
    return tables.group_facts_txn(txn, state_group, snapshot_facts)


def compaction_lock_txn(txn: Transaction, timeout_s: float, now_ms: int) -> LockCheck:
    """Whether the compaction job holds its lock: ``("locked", holder,
    age_s)`` for a lock younger than ``timeout_s`` (at ``now_ms``), else
    ``("free", (holder, age_s) of a stale lock or None)``. A writer that
    deletes groups asks first, in its deleting transaction."""
    row = lock_row_txn(txn, COMPACTION_LOCK_NAME)
    if row is None:
        return ("free", None)
    holder, acquired_ts, heartbeat_ts = row
    age_s = (now_ms - (heartbeat_ts if heartbeat_ts is not None else acquired_ts)) / 1000
    if age_s <= timeout_s:
        return ("locked", holder, age_s)
    return ("free", (holder, age_s))


def delete_groups_txn(
    txn: Transaction, groups: StateGroupStore, ids: list[int], counts: dict[str, int] | None = None
) -> int:
    """Delete the groups ``ids`` (the caller asked ``compaction_lock_txn``);
    how many existed. Remaining groups stored as a delta against a deleted
    group are first rewritten as snapshots of their full state (read
    through ``groups``). ``counts`` gains the rows deleted per table."""
    doomed = set(ids)
    children = [child for child in tables.child_groups_txn(txn, ids) if child not in doomed]
    # Full states first (they read through the doomed groups), then rewrite.
    states = {child: groups.get_state(txn, child) for child in sorted(set(children))}
    for child, state in states.items():
        tables.rewrite_as_snapshot_txn(txn, child, state)
    return tables.delete_groups_txn(txn, ids, counts)


def delete_state_groups_txn(
    txn: Transaction, groups: StateGroupStore, ids: list[int], timeout_s: float, now_ms: int
) -> Attempt[int]:
    """Delete the groups ``ids`` unless the compaction job holds its lock.

    Returns ``("locked", holder, age_s)`` while a lock younger than
    ``timeout_s`` (at ``now_ms``) is held, writing nothing; otherwise
    ``("done", how many existed, (holder, age_s) of a stale lock or None)``
    (``delete_groups_txn`` says what is deleted and rewritten).
    """
    lock = compaction_lock_txn(txn, timeout_s, now_ms)
    if lock[0] == "locked":
        return lock
    return ("done", delete_groups_txn(txn, groups, ids), lock[1])


async def run_when_unlocked(
    attempt: Callable[[int], Awaitable[Attempt[R]]],
    timeout_s: float,
    poll_interval_s: float,
    clock: IReactorTime,
    now_ms: Callable[[], int],
    what: str,
) -> R:
    """``await attempt(now_ms)`` (one transaction) until it is done: it
    returns ``("locked", holder, age_s)`` (``compaction_lock_txn``, having
    written nothing) or ``("done", result, stale lock or None)``. While the
    compaction job holds its lock, a line says so once and the attempt is
    made again every ``poll_interval_s`` on ``clock``; a stale lock ignored
    is a warning. Returns the result. ``what``: the deletion, for the lines."""
    waiting_logged = False
    while True:
        outcome = await attempt(now_ms())
        if outcome[0] == "locked":
            if not waiting_logged:
                log.info(
                    "waiting for state compaction ({holder}) to finish before deleting {what}",
                    holder=outcome[1],
                    what=what,
                )
                waiting_logged = True
            await deferLater(clock, poll_interval_s, lambda: None)
            continue
        _, result, stale = outcome
        if stale is not None:
            log.warn(
                "ignoring stale state compaction lock held by {holder} (last heartbeat {age:.0f}s ago,"
                " timeout {timeout:.0f}s) to delete {what}",
                holder=stale[0],
                age=stale[1],
                timeout=timeout_s,
                what=what,
            )
        return result


async def delete_when_unlocked(
    db: Database,
    groups: StateGroupStore,
    ids: list[int],
    timeout_s: float,
    poll_interval_s: float,
    clock: IReactorTime,
    now_ms: Callable[[], int],
) -> int:
    """``delete_state_groups_txn`` until it deletes (``RoomStore.delete_state_groups``,
    through ``run_when_unlocked``). Returns how many of ``ids`` existed."""

    def attempt(now: int) -> Awaitable[Attempt[int]]:
        return db.run_interaction("delete_state_groups", delete_state_groups_txn, groups, ids, timeout_s, now)

    return await run_when_unlocked(attempt, timeout_s, poll_interval_s, clock, now_ms, f"{len(ids)} state group(s)")
