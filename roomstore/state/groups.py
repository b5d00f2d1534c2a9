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

Who calls it: the event persister (inside its transaction) and the readers.
All methods take a ``Transaction``; computed states are cached once their
groups are committed (groups never change content, only representation).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Callable, Iterable, Mapping, Sequence

import attrs

from roomstore.storage.database import Transaction
from roomstore.storage.engines import Engine
from roomstore.storage.interning import LruCache, chunks

StateMap = Mapping[int, int]  # type_key_nid -> event_nid

#: Synapse's MAX_STATE_DELTA_HOPS: a lookup walks at most this many groups.
DEFAULT_MAX_CHAIN_LENGTH = 100

#: The walk up a chain of predecessors, written once for every variant
#: :func:`full_state_sql` builds. Each step looks its predecessor up with a
#: scalar subquery rather than a join: once ``state_groups`` has statistics
#: (ANALYZE), SQLite plans the join with a Bloom filter built from the whole
#: table, on every lookup (6x slower on 46,000 groups). The walk ends with one
#: NULL row (past a snapshot, or past a group that does not exist), which
#: joins nothing.
_CHAIN = """chain({start}state_group, hops) AS (
    SELECT {seed}, 0{seed_from}
    UNION ALL
    SELECT {carry}(SELECT g.prev_state_group FROM state_groups AS g WHERE g.state_group = chain.state_group),
           chain.hops + 1
    FROM chain WHERE chain.state_group IS NOT NULL{guard}
)"""

#: The walk of one group (the first bound parameter), for the store's reads.
_ONE_GROUP_CHAIN = _CHAIN.format(start="", seed="CAST(? AS BIGINT)", seed_from="", carry="", guard="")

#: Longest chain the many-group form walks (a cycle must not walk forever).
MAX_WALK_HOPS = 100_000


def full_state_sql(groups: Sequence[int] | None = None, keys: int = 0) -> str:
    """The recursive full-state statement, in the form a caller needs.

    ``groups`` None (the store's filtered reads, and the walk of the full
    read, :func:`packed_full_state_sql`): one group, the first bound parameter;
    rows ``(hops, type_key_nid, event_nid)``, every delta row of the chain
    with its group's distance from the start, in no particular order: fold
    them with :func:`fold_state` (the row with the fewest hops wins). Folding
    in Python costs less than ranking the rows in SQL (a window function or
    DISTINCT ON sorts every row by key): for 10,000 entries at the end of a
    100-hop chain, measured 0.3x the window function's time on SQLite and
    0.5-0.75x on PostgreSQL. And no ORDER BY: PostgreSQL would sort every
    row by distance, while both engines return them nearest group first as
    the walk finds them, which ``fold_state``'s sort then only checks (one
    run). For the 10,000 entries on PostgreSQL, measured 4.8, 5.2 and 7.5 ms
    against 5.3, 5.7 and 9.2 ms with ORDER BY (three runs, the variants
    taking turns); no different on SQLite, nor for random groups of the
    compaction benchmark's dataset on either engine
    (bench/state_vs_synapse.py times the whole read).

    ``groups`` given (the compaction job's boundary states, read by Spark over
    JDBC, which takes no parameters: the ids are inlined as integers): rows
    ``(boundary_group, type_key_nid, event_nid)``, each group's state folded
    in SQL (the nearest row of a key wins; removals dropped), plus one row with
    NULL key per group whose chain is complete (ends at an existing snapshot),
    so empty states are represented. A group whose chain reaches a missing
    (purged) group gets no rows at all: unknown, not a wrong state.

    ``keys``: that many more bound parameters (after the group's), type_key_nids
    the rows are restricted to.
    """
    key_filter = ""
    if keys:
        key_filter = f" AND d.type_key_nid IN ({', '.join('?' for _ in range(keys))})"
    if groups is None:
        return f"""
WITH RECURSIVE {_ONE_GROUP_CHAIN}
SELECT chain.hops, d.type_key_nid, d.event_nid
FROM chain JOIN state_group_deltas AS d ON d.state_group = chain.state_group{key_filter}
"""
    if not groups:
        raise ValueError("no groups")
    values = ", ".join(f"({int(g)})" for g in groups)
    chain = _CHAIN.format(
        start="start_group, ",
        seed="CAST(start_group AS BIGINT), CAST(start_group AS BIGINT)",
        seed_from=" FROM wanted",
        carry="chain.start_group, ",
        guard=f" AND chain.hops < {MAX_WALK_HOPS}",
    )
    # Complete: the walk ended (its NULL row; not cut by the guard) and every
    # group it walked exists. (EXCEPT measured faster than a GROUP BY over the
    # walk joined to state_groups on PostgreSQL; the whole statement about as
    # fast as the join walk it replaced, on both engines.)
    return f"""
WITH RECURSIVE wanted(start_group) AS (VALUES {values}),
{chain},
complete(start_group) AS (
    SELECT chain.start_group FROM chain WHERE chain.state_group IS NULL
    EXCEPT
    SELECT chain.start_group FROM chain WHERE chain.state_group IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM state_groups AS g WHERE g.state_group = chain.state_group)
)
SELECT start_group AS boundary_group, type_key_nid, event_nid FROM (
    SELECT chain.start_group, d.type_key_nid, d.event_nid,
           ROW_NUMBER() OVER (PARTITION BY chain.start_group, d.type_key_nid ORDER BY chain.hops) AS nearest
    FROM chain JOIN complete ON complete.start_group = chain.start_group
    JOIN state_group_deltas AS d ON d.state_group = chain.state_group{key_filter}
) AS ranked
WHERE nearest = 1 AND event_nid IS NOT NULL
UNION ALL
SELECT start_group, NULL, NULL FROM complete
"""


#: One group's chain rows with their hops (see :func:`full_state_sql`).
FULL_STATE_SQL = full_state_sql()

_HOPS = itemgetter(0)

#: The walk of one group that also yields each group's sole delta row
#: (schema version 6: ``state_groups.sole_*``, NULL unless the group's delta
#: is exactly one row), where ``engine.walk_reads_sole_deltas``. A join, not
#: a scalar subquery: a step reads three columns. It ends at a snapshot, or
#: at a group that does not exist.
_SOLE_CHAIN = """chain(state_group, prev_state_group, hops, sole_key, sole_event) AS (
    SELECT g.state_group, g.prev_state_group, 0, g.sole_type_key_nid, g.sole_event_nid
    FROM state_groups AS g WHERE g.state_group = CAST(? AS BIGINT)
    UNION ALL
    SELECT g.state_group, g.prev_state_group, chain.hops + 1, g.sole_type_key_nid, g.sole_event_nid
    FROM chain JOIN state_groups AS g ON g.state_group = chain.prev_state_group
)"""

_PACKED_SQL: dict[type, str] = {}


def packed_full_state_sql(engine: Engine) -> str:
    """The store's full-state read of one group (the bound parameter): rows
    ``(hops, type_key_nid, event_nid, packed)``, one per group of the chain;
    fold them with :func:`fold_packed_state`.

    ``packed`` holds a group's delta rows as ``engine.packed_ints_sql`` packs
    them (the keys, the events), or is NULL when the row's own key and event
    are the group's only delta row. Where ``engine.walk_reads_sole_deltas``
    (PostgreSQL) the walk takes one-row deltas from the group's row, and only
    the other groups (snapshots, larger deltas) probe ``state_group_deltas``;
    elsewhere (SQLite) every group's rows are packed.

    Packed, a 10,000-entry state is ~100 rows instead of ~10,000: SQLite's
    driver spends ~0.3 us a row, psycopg2 more. Measured on the 10,000
    entries at the end of a 100-hop chain, statement and fold: SQLite 2.9 ms
    against 4.7 ms row by row. On PostgreSQL, against the row form, 1,000
    random groups (~33 hops, most of one row): 0.44 against 0.59 ms; the
    chain: 6.4-7.8 against 8.3-9.8 ms (two runs, the forms taking turns). On
    PostgreSQL without the sole rows, packing every group made random groups
    slower (0.68-0.72 against 0.58 ms): an aggregate per hop.
    """
    sql = _PACKED_SQL.get(type(engine))
    if sql is None:
        packed = engine.packed_ints_sql(["d.type_key_nid", "d.event_nid"])
        if engine.walk_reads_sole_deltas:
            sql = f"""
WITH RECURSIVE {_SOLE_CHAIN}
SELECT chain.hops, chain.sole_key, chain.sole_event, NULL FROM chain WHERE chain.sole_key IS NOT NULL
UNION ALL
SELECT chain.hops, NULL, NULL, (SELECT {packed} FROM state_group_deltas AS d WHERE d.state_group = chain.state_group)
FROM chain WHERE chain.sole_key IS NULL
"""
        else:
            sql = f"""
WITH RECURSIVE {_ONE_GROUP_CHAIN}
SELECT chain.hops, NULL, NULL, (SELECT {packed} FROM state_group_deltas AS d WHERE d.state_group = chain.state_group)
FROM chain WHERE chain.state_group IS NOT NULL
"""
        _PACKED_SQL[type(engine)] = sql
    return sql


def _without_removals(state: dict[int, int | None]) -> dict[int, int]:
    """``state`` without the keys a nearest row removed (None events)."""
    if None in state.values():
        return {key: event for key, event in state.items() if event is not None}
    return state


def fold_packed_state(rows: list[tuple], unpack: Callable[[object], list]) -> dict[int, int]:
    """A group's state from :func:`packed_full_state_sql`'s rows
    ``(hops, key, event, packed)``, in any order: farthest group first, each
    nearer one overwriting its keys (its packed rows, or its one row when
    ``packed`` is NULL); then removals (None events) dropped."""
    rows.sort(key=_HOPS, reverse=True)
    state: dict[int, int] = {}
    update = state.update
    for _, key, event, packed in rows:
        if packed is None:
            state[key] = event
        else:
            columns = unpack(packed)
            if columns:
                update(zip(*columns))
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


def sole_delta(rows: Mapping[int, int | None]) -> tuple[int | None, int | None]:
    """``(type_key_nid, event_nid)`` of a group's delta rows when there is
    exactly one (a None event: a removal), else ``(None, None)``: what the
    group's ``state_groups.sole_*`` columns hold (schema version 6; the same
    rule in SQL: :func:`sole_deltas_sql`)."""
    if len(rows) == 1:
        return next(iter(rows.items()))
    return None, None


class StateGroupNotFound(LookupError):
    pass


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
        self._cache = LruCache(cache_size)  # state_group -> dict (committed groups only)

    # ------------------------------------------------------------------ reads

    def get_state(self, txn: Transaction, state_group: int | None, pending: Mapping[int, Mapping] | None = None) -> dict[int, int]:
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

    def group_exists(self, txn: Transaction, state_group: int) -> bool:
        return txn.execute("SELECT 1 FROM state_groups WHERE state_group = ?", (state_group,)).fetchone() is not None

    def chain_length(self, txn: Transaction, state_group: int) -> int:
        value = txn.select_one_value("SELECT chain_length FROM state_groups WHERE state_group = ?", (state_group,))
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
        writes: "StateGroupWrites | None" = None,
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
        group = txn.next_id("state_groups", "state_group", writes.expected if writes else 1)
        if parent is None or parent_chain_length + 1 > self.max_chain_length:
            prev, length, rows = None, 0, state
        else:
            prev, length, rows = parent, parent_chain_length + 1, delta
        # In key order: PostgreSQL returns a group's rows in the order they
        # were written, and naming a state whose keys come in interning order
        # touches the interners' caches in the order they were filled.
        written = {key: rows[key] for key in sorted(rows) if prev is not None or rows[key] is not None}
        own = writes if writes is not None else StateGroupWrites()
        own.groups.append((group, room_nid, event_nid, prev, length, visibility_snapshot, *sole_delta(written)))
        own.deltas.extend((group, key, event) for key, event in written.items())
        if writes is None:
            own.flush(txn)
        txn.call_after(self._cache.set, group, state)
        return NewStateGroup(group, state, length)

    def forget(self, state_group: int) -> None:
        self._cache.pop(state_group)


class StateGroupWrites:
    """Rows of state groups made in one transaction, written together.

    ``expected`` is how many groups the caller may make: that many ids are
    reserved in one statement.
    """

    def __init__(self, expected: int = 1):
        self.expected = expected
        self.groups: list[tuple] = []
        self.deltas: list[tuple] = []

    def flush(self, txn: Transaction) -> None:
        txn.insert_many("state_groups", GROUP_COLUMNS, self.groups, queue=True)
        txn.insert_many("state_group_deltas", DELTA_COLUMNS, self.deltas, queue=True)
        self.groups, self.deltas = [], []


#: The columns of a ``state_groups`` row and of a ``state_group_deltas`` row,
#: in the order of :func:`group_rows`' tuples.
GROUP_COLUMNS = ("state_group", "room_nid", "event_nid", "prev_state_group", "chain_length", "visibility_snapshot",
                 "sole_type_key_nid", "sole_event_nid")
DELTA_COLUMNS = ("state_group", "type_key_nid", "event_nid")


def group_rows(
    state_group: int, room_nid: int, event_nid: int | None, prev_state_group: int | None, chain_length: int,
    delta: Mapping[int, int | None], visibility_snapshot: int | None = None,
) -> tuple[tuple, list[tuple]]:
    """The ``state_groups`` row (with its copy of a one-row delta) and the
    ``state_group_deltas`` rows of one group, in :data:`GROUP_COLUMNS` and
    :data:`DELTA_COLUMNS` order: for a writer that loads groups in bulk
    (:func:`bulk_insert_groups`)."""
    row = (state_group, room_nid, event_nid, prev_state_group, chain_length, visibility_snapshot, *sole_delta(delta))
    return row, [(state_group, key, event) for key, event in delta.items()]


def bulk_insert_groups(
    engine: Engine, cursor, groups: Sequence[tuple], deltas: Sequence[tuple], text: Callable[[object], str] = str
) -> None:
    """Load :func:`group_rows`' rows on a cursor outside the store (the
    engine's bulk insert: COPY on PostgreSQL), groups first."""
    engine.bulk_insert(cursor, "state_groups", ", ".join(GROUP_COLUMNS), groups, text)
    engine.bulk_insert(cursor, "state_group_deltas", ", ".join(DELTA_COLUMNS), deltas, text)


def move_group_ids_past(engine: Engine, cursor) -> None:
    """After :func:`bulk_insert_groups`: ids the database generates continue
    after the highest group loaded."""
    engine.move_sequence_past(cursor, "state_groups", "state_group")


#: The highest state group id stored (0 when none).
MAX_STATE_GROUP = "SELECT COALESCE(MAX(state_group), 0) FROM state_groups"


# ---------------------------------------------------------------------- writers' SQL
# What the event store (not the read side above) runs against state groups:
# the facts the persister derives a new group from, and deleting groups.

#: The ``maintenance_locks`` row the offline compaction job holds while it
#: runs (``roomstore.compaction.writer.LOCK_NAME``; the store never imports
#: the compaction package, so the name is repeated here).
COMPACTION_LOCK_NAME = "state_compaction"
#: A compaction lock whose heartbeat is older than this many seconds is
#: taken to be left behind by a dead job and ignored (with a warning).
COMPACTION_LOCK_TIMEOUT_S = 600.0


def sole_deltas_sql(rows_sql: str) -> str:
    """``(state_group, sole_type_key_nid, sole_event_nid)`` of each group in
    ``rows_sql``'s ``(state_group, type_key_nid, event_nid)`` rows (a
    subquery): its one row when it has exactly one, else NULLs. The rule of
    ``state_groups.sole_*`` (schema version 6; in Python: :func:`sole_delta`),
    for a writer that has a set of groups' new rows at hand (the compaction
    swap, from its staging table)."""
    only = "CASE WHEN COUNT(*) = 1 THEN MAX(r.{column}) END AS sole_{column}"
    return (f"SELECT r.state_group, {only.format(column='type_key_nid')}, {only.format(column='event_nid')}"
            f" FROM ({rows_sql}) AS r GROUP BY r.state_group")


def group_facts_txn(txn: Transaction, state_group: int) -> tuple | None:
    """``(visibility snapshot, chain length, branch, seq, history visibility,
    branch tip seq)`` of a stored group: what the persister needs to make a
    group on top of it (the snapshot columns NULL when it has none); None
    when the group does not exist."""
    return txn.execute(
        "SELECT g.visibility_snapshot, g.chain_length, s.branch_nid, s.seq, s.history_visibility, b.tip_seq"
        " FROM state_groups AS g"
        " LEFT JOIN visibility_snapshots AS s ON s.snapshot_nid = g.visibility_snapshot"
        " LEFT JOIN visibility_branches AS b ON b.branch_nid = s.branch_nid"
        " WHERE g.state_group = ?",
        (state_group,),
    ).fetchone()


def delete_state_groups_txn(
    txn: Transaction, groups: StateGroupStore, ids: list[int], timeout_s: float, now_ms: int
) -> tuple:
    """Delete the groups ``ids`` unless the compaction job holds its lock.

    Returns ``("locked", holder, age_s)`` while a lock younger than
    ``timeout_s`` (at ``now_ms``) is held, writing nothing; otherwise
    ``("deleted", how many existed, (holder, age_s) of a stale lock or None)``.
    Remaining groups stored as a delta against a deleted group are first
    rewritten as snapshots of their full state (read through ``groups``).
    """
    row = txn.execute(
        "SELECT holder, acquired_ts, heartbeat_ts FROM maintenance_locks WHERE lock_name = ?",
        (COMPACTION_LOCK_NAME,),
    ).fetchone()
    stale = None
    if row is not None:
        holder, acquired_ts, heartbeat_ts = row
        age_s = (now_ms - (heartbeat_ts if heartbeat_ts is not None else acquired_ts)) / 1000
        if age_s <= timeout_s:
            return ("locked", holder, age_s)
        stale = (holder, age_s)
    doomed = set(ids)
    children: list[int] = []
    for part in chunks(ids):
        marks = ", ".join("?" for _ in part)
        children += [
            r[0]
            for r in txn.execute(
                f"SELECT state_group FROM state_groups WHERE prev_state_group IN ({marks})", part
            ).fetchall()
            if r[0] not in doomed
        ]
    # Full states first (they read through the doomed groups), then rewrite.
    states = {child: groups.get_state(txn, child) for child in sorted(set(children))}
    for child, state in states.items():
        txn.execute("DELETE FROM state_group_deltas WHERE state_group = ?", (child,))
        txn.insert_many(
            "state_group_deltas", ("state_group", "type_key_nid", "event_nid"),
            [(child, key, event) for key, event in sorted(state.items())],
        )
        txn.execute(
            "UPDATE state_groups SET prev_state_group = NULL, chain_length = 0,"
            " sole_type_key_nid = ?, sole_event_nid = ? WHERE state_group = ?",
            (*sole_delta(state), child),
        )
    deleted = 0
    for part in chunks(ids):
        marks = ", ".join("?" for _ in part)
        # The group rows first: that takes their row locks before anything else.
        txn.execute(f"DELETE FROM state_groups WHERE state_group IN ({marks})", part)
        deleted += txn.rowcount
        txn.execute(f"DELETE FROM state_group_deltas WHERE state_group IN ({marks})", part)
    return ("deleted", deleted, stale)
