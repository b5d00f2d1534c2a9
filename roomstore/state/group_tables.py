"""The state-group tables, ``state_groups`` and ``state_group_deltas``: every
statement that names them, and nothing else.

A group's row (``room_nid``, ``event_nid``, ``prev_state_group``,
``chain_length``, ``visibility_snapshot``, and ``sole_*``: its copy of a
one-row delta, schema version 6) and its delta rows (interned
``type_key_nid`` -> ``event_nid``, NULL event: a removal). What a group means
and when one is made is :mod:`roomstore.state.groups`' (the store's reads,
creation and deletion, built on the functions here), and the benchmark's
loader writes through :func:`group_rows` and :func:`bulk_insert_groups`.
The offline compaction job's own statements on these tables (its planning
and JDBC reads, its swap) are its own, in :mod:`roomstore.compaction.roomstore_sql`
(the tables' second home, tests/test_architecture.py): the store never runs
them. What they share with the store is here: the full state of a group
(:func:`full_state_sql`), the rule of a group's copy of a one-row delta
(:func:`sole_deltas_sql`), deleting groups' rows (:func:`delete_deltas_of`).
Statements use ``?`` placeholders (the engine converts them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from roomstore.storage.engines import Row
from roomstore.storage.interning import chunks
from roomstore.storage.transaction import Transaction


def _marks(part: Sequence[Any]) -> str:
    return ", ".join("?" for _ in part)


# ---------------------------------------------------------------------------
# the full state of a group: one recursive statement

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

#: The walk of every group of ``wanted(start_group)``, each row carrying its start.
_MANY_GROUPS_CHAIN = _CHAIN.format(
    start="start_group, ",
    seed="CAST(start_group AS BIGINT), CAST(start_group AS BIGINT)",
    seed_from=" FROM wanted",
    carry="chain.start_group, ",
    guard=f" AND chain.hops < {MAX_WALK_HOPS}",
)


def _key_filter(keys: int) -> str:
    """The join condition keeping ``keys`` bound type_key_nids ("" for none)."""
    return f" AND d.type_key_nid IN ({', '.join('?' for _ in range(keys))})" if keys else ""


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
    key_filter = _key_filter(keys)
    if groups is None:
        return f"""
WITH RECURSIVE {_ONE_GROUP_CHAIN}
SELECT chain.hops, d.type_key_nid, d.event_nid
FROM chain JOIN state_group_deltas AS d ON d.state_group = chain.state_group{key_filter}
"""
    if not groups:
        raise ValueError("no groups")
    values = ", ".join(f"({int(g)})" for g in groups)
    # Complete: the walk ended (its NULL row; not cut by the guard) and every
    # group it walked exists. (EXCEPT measured faster than a GROUP BY over the
    # walk joined to state_groups on PostgreSQL; the whole statement about as
    # fast as the join walk it replaced, on both engines.)
    return f"""
WITH RECURSIVE wanted(start_group) AS (VALUES {values}),
{_MANY_GROUPS_CHAIN},
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


def filtered_states_sql(groups: int, keys: int) -> str:
    """Several groups' chains in one statement, restricted to some keys:
    ``groups`` bound parameters (the groups), then ``keys`` (type_key_nids);
    rows ``(start_group, hops, type_key_nid, event_nid)``, each group's to fold
    as :func:`full_state_sql`'s. The groups of a page of state events lie on
    one or a few chains: one walk of each, not one statement a group."""
    if groups < 1 or keys < 1:
        raise ValueError("filtered_states_sql needs a group and a key")
    return f"""
WITH RECURSIVE wanted(start_group) AS (VALUES {", ".join("(?)" for _ in range(groups))}),
{_MANY_GROUPS_CHAIN}
SELECT chain.start_group, chain.hops, d.type_key_nid, d.event_nid
FROM chain JOIN state_group_deltas AS d ON d.state_group = chain.state_group{_key_filter(keys)}
"""


#: The walk of one group that also yields each group's sole delta row
#: (schema version 6: ``state_groups.sole_*``, NULL unless the group's delta
#: is exactly one row), on the engines of :data:`_WALKS_SOLE_DELTAS`. A join, not
#: a scalar subquery: a step reads three columns. It ends at a snapshot, or
#: at a group that does not exist.
_SOLE_CHAIN = """chain(state_group, prev_state_group, hops, sole_key, sole_event) AS (
    SELECT g.state_group, g.prev_state_group, 0, g.sole_type_key_nid, g.sole_event_nid
    FROM state_groups AS g WHERE g.state_group = CAST(? AS BIGINT)
    UNION ALL
    SELECT g.state_group, g.prev_state_group, chain.hops + 1, g.sole_type_key_nid, g.sole_event_nid
    FROM chain JOIN state_groups AS g ON g.state_group = chain.prev_state_group
)"""

#: Engines (by name) whose full-state walk joins ``state_groups`` and takes
#: each one-row group's delta from the group's own row (``sole_*``;
#: PostgreSQL: from the primary key's index alone, see
#: ``02_state_group_walk.postgres.sql``). SQLite walks with a scalar subquery
#: instead (a join there is planned with a Bloom filter over the whole table)
#: and reads every group's rows. A choice of this one statement, so it is made
#: here rather than as a flag on the engine.
_WALKS_SOLE_DELTAS = frozenset({"postgres"})

_PACKED_SQL: dict[str, str] = {}


def packed_full_state_sql(engine: Any) -> str:
    """The store's full-state read of one group (the bound parameter): rows
    ``(hops, type_key_nid, event_nid, packed)``, one per group of the chain;
    fold them with :func:`fold_packed_state`.

    ``packed`` holds a group's delta rows as ``engine.packed_ints_sql`` packs
    them (the keys, the events), or is NULL when the row's own key and event
    are the group's only delta row. On the engines of :data:`_WALKS_SOLE_DELTAS`
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
    sql = _PACKED_SQL.get(engine.name)
    if sql is None:
        packed = engine.packed_ints_sql(["d.type_key_nid", "d.event_nid"])
        if engine.name in _WALKS_SOLE_DELTAS:
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
        _PACKED_SQL[engine.name] = sql
    return sql


def sole_delta(rows: Mapping[int, int | None]) -> tuple[int | None, int | None]:
    """``(type_key_nid, event_nid)`` of a group's delta rows when there is
    exactly one (a None event: a removal), else ``(None, None)``: what the
    group's ``state_groups.sole_*`` columns hold (schema version 6; the same
    rule in SQL: :func:`sole_deltas_sql`)."""
    if len(rows) == 1:
        return next(iter(rows.items()))
    return None, None


def sole_deltas_sql(rows_sql: str) -> str:
    """``(state_group, sole_type_key_nid, sole_event_nid)`` of each group in
    ``rows_sql``'s ``(state_group, type_key_nid, event_nid)`` rows (a
    subquery): its one row when it has exactly one, else NULLs. The rule of
    ``state_groups.sole_*`` (schema version 6; in Python: :func:`sole_delta`),
    for a writer that has a set of groups' new rows at hand (the compaction
    swap, from its staging table)."""
    only = "CASE WHEN COUNT(*) = 1 THEN MAX(r.{column}) END AS sole_{column}"
    return (
        f"SELECT r.state_group, {only.format(column='type_key_nid')}, {only.format(column='event_nid')}"
        f" FROM ({rows_sql}) AS r GROUP BY r.state_group"
    )


# ---------------------------------------------------------------------------
# the store's statements: one group's row, new groups, deleting groups

GROUP_EXISTS = "SELECT 1 FROM state_groups WHERE state_group = ?"
CHAIN_LENGTH = "SELECT chain_length FROM state_groups WHERE state_group = ?"
#: The highest state group id stored (0 when none).
MAX_STATE_GROUP = "SELECT COALESCE(MAX(state_group), 0) FROM state_groups"

#: The columns of a ``state_groups`` row and of a ``state_group_deltas`` row,
#: in the order of :func:`group_rows`' tuples.
GROUP_COLUMNS = (
    "state_group",
    "room_nid",
    "event_nid",
    "prev_state_group",
    "chain_length",
    "visibility_snapshot",
    "sole_type_key_nid",
    "sole_event_nid",
)
DELTA_COLUMNS = ("state_group", "type_key_nid", "event_nid")


def next_group_ids_txn(txn: Transaction, count: int) -> int:
    """The first of ``count`` new group ids, reserved in one statement."""
    return txn.next_id("state_groups", "state_group", count)


def group_ids_request(count: int) -> tuple[str, str, int]:
    """``count`` group ids, for ``Transaction.reserve_ids`` (with other tables' ids, at once)."""
    return ("state_groups", "state_group", count)


def insert_groups_txn(txn: Transaction, groups: Sequence[Row], deltas: Sequence[Row]) -> None:
    """Queue :func:`group_rows`' rows for insertion in ``txn`` (the store's
    batched writes, see ``Transaction.insert_many``)."""
    txn.insert_many("state_groups", GROUP_COLUMNS, groups, queue=True)
    txn.insert_many("state_group_deltas", DELTA_COLUMNS, deltas, queue=True)


def group_rows(
    state_group: int,
    room_nid: int,
    event_nid: int | None,
    prev_state_group: int | None,
    chain_length: int,
    delta: Mapping[int, int | None],
    visibility_snapshot: int | None = None,
) -> tuple[Row, list[Row]]:
    """The ``state_groups`` row (with its copy of a one-row delta) and the
    ``state_group_deltas`` rows of one group, in :data:`GROUP_COLUMNS` and
    :data:`DELTA_COLUMNS` order, ``delta`` in the order given."""
    row = (state_group, room_nid, event_nid, prev_state_group, chain_length, visibility_snapshot, *sole_delta(delta))
    return row, [(state_group, key, event) for key, event in delta.items()]


def bulk_insert_groups(
    engine: Any, cursor: Any, groups: Sequence[Row], deltas: Sequence[Row], text: Callable[[object], str] = str
) -> None:
    """Load :func:`group_rows`' rows on a cursor outside the store (the
    engine's bulk insert: COPY on PostgreSQL), groups first."""
    engine.bulk_insert(cursor, "state_groups", ", ".join(GROUP_COLUMNS), groups, text)
    engine.bulk_insert(cursor, "state_group_deltas", ", ".join(DELTA_COLUMNS), deltas, text)


def move_group_ids_past(engine: Any, cursor: Any) -> None:
    """After :func:`bulk_insert_groups`: ids the database generates continue
    after the highest group loaded."""
    engine.move_sequence_past(cursor, "state_groups", "state_group")


def group_facts_txn(txn: Transaction, state_group: int, snapshot_facts: tuple[str, str]) -> Row | None:
    """``(visibility snapshot, chain length, *snapshot facts)`` of a stored
    group, or None when it does not exist. ``snapshot_facts``: ``(columns,
    joins)`` over ``g.visibility_snapshot`` built by the visibility owner
    (``roomstore.visibility.snapshots.snapshot_facts_sql``): one statement."""
    columns, joins = snapshot_facts
    return txn.execute(
        f"SELECT g.visibility_snapshot, g.chain_length, {columns} FROM state_groups AS g{joins}"
        " WHERE g.state_group = ?",
        (state_group,),
    ).fetchone()


def child_groups_txn(txn: Transaction, ids: Sequence[int]) -> list[int]:
    """Groups stored as a delta against one of ``ids`` (``ids`` among them too)."""
    children: list[int] = []
    for part in chunks(ids):
        children += [
            r[0]
            for r in txn.execute(
                f"SELECT state_group FROM state_groups WHERE prev_state_group IN ({_marks(part)})", part
            ).fetchall()
        ]
    return children


def rewrite_as_snapshot_txn(txn: Transaction, state_group: int, state: Mapping[int, int]) -> None:
    """Store ``state_group`` as a snapshot of ``state`` (its full state)."""
    txn.execute("DELETE FROM state_group_deltas WHERE state_group = ?", (state_group,))
    txn.insert_many(
        "state_group_deltas",
        DELTA_COLUMNS,
        [(state_group, key, event) for key, event in sorted(state.items())],
    )
    txn.execute(
        "UPDATE state_groups SET prev_state_group = NULL, chain_length = 0,"
        " sole_type_key_nid = ?, sole_event_nid = ? WHERE state_group = ?",
        (*sole_delta(state), state_group),
    )


def delete_groups_txn(txn: Transaction, ids: Sequence[int], counts: dict[str, int] | None = None) -> int:
    """Delete the groups ``ids`` and their rows; how many groups existed
    (``counts`` gains the rows deleted per table)."""
    deleted = rows = 0
    for part in chunks(ids):
        marks = _marks(part)
        # The group rows first: that takes their row locks before anything else.
        txn.execute(f"DELETE FROM state_groups WHERE state_group IN ({marks})", part)
        deleted += txn.rowcount
        txn.execute(delete_deltas_of(marks), part)
        rows += max(txn.rowcount, 0)
    if counts is not None:
        counts["state_groups"] = counts.get("state_groups", 0) + deleted
        counts["state_group_deltas"] = counts.get("state_group_deltas", 0) + rows
    return deleted


def room_group_links_txn(txn: Transaction, room_nid: int) -> dict[int, int | None]:
    """group -> its predecessor (None: a snapshot), for every group of the room."""
    return dict(
        txn.execute("SELECT state_group, prev_state_group FROM state_groups WHERE room_nid = ?", (room_nid,)).fetchall()
    )


def delete_deltas_of(groups_sql: str) -> str:
    """Deleting the delta rows of the groups ``groups_sql`` lists (a subquery or ``?`` marks)."""
    return f"DELETE FROM state_group_deltas WHERE state_group IN ({groups_sql})"
