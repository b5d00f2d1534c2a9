"""The statements the compaction job runs on roomstore's tables.

The job's own tables (``state_compaction_runs``, ``_rooms``, ``_chunks`` and
the two staging tables) are written here, and so is the job's SQL on the
store's state tables, ``state_groups`` and ``state_group_deltas``: the
planning reads, the JDBC reads, the swap's lock, re-check and rewrites. The
store never runs those; they live with the job so that the tables' owner,
:mod:`roomstore.state.group_tables`, holds the store's statements only
(tests/test_architecture.py names this module as the tables' second home).
From the owner come the rules the store's reads depend on: the full state of
a group (:func:`~roomstore.state.group_tables.full_state_sql`), a group's copy
of a one-row delta (:func:`~roomstore.state.group_tables.sole_deltas_sql`)
and deleting a group's rows. The lock's statements are
:mod:`roomstore.storage.maintenance_locks`', the rooms'
:mod:`roomstore.storage.interning`'s. Statements use ``?`` placeholders (the
engine converts them).

Who runs them: :mod:`roomstore.compaction.write_back` (the lock, the run's
bookkeeping, the planning reads: :data:`STATEMENTS`, the record the Synapse
layout's :mod:`roomstore.compaction.synapse_sql` fills too), and
:mod:`roomstore.compaction.roomstore_tables` (staging, the swap, the reads
over Spark's JDBC).

``where`` arguments are conditions on the ``state_groups`` row (a room
selection built by the driver from integers; Spark's JDBC reads take no bound
parameters, so those statements inline integers too).
"""

from __future__ import annotations

from roomstore.compaction import plan_sql
from roomstore.compaction.chunks import CHECKSUM_SQL
from roomstore.compaction.tables import JobStatements
from roomstore.state.group_tables import MAX_STATE_GROUP, delete_deltas_of, sole_deltas_sql
from roomstore.storage.interning import room_ids_and_nids_sql, room_ids_of_sql
from roomstore.storage.maintenance_locks import (
    LOCK_HEARTBEAT,
    LOCK_INSERT,
    LOCK_RELEASE,
    LOCK_RELEASE_HINT,
    LOCK_SELECT,
    LOCK_TAKE,
)

#: A bound above every state group id (a room's groups, whatever was written).
ANY_GROUP = 2**63 - 1
#: The relation the job plans over: ``(state_group, room_nid, prev_state_group)``.
_GROUPS = "state_groups"


def _and(where: str) -> str:
    return f" AND {where}" if where else ""


# ---------------------------------------------------------------------------
# reading the state tables to plan a run (the statements: plan_sql's). ``where``:
# conditions on the group's row, built from integers; ``{col}`` in them stands
# for the room_nid column.


def group_bounds(where: str = "") -> str:
    return plan_sql.group_bounds(_GROUPS, where)


def count_rooms(where: str = "") -> str:
    return plan_sql.count_rooms(_GROUPS, where)


def chunk_starts(where: str, chunk_groups: int) -> str:
    return plan_sql.chunk_starts(_GROUPS, _GROUPS, where, chunk_groups)


def chunk_links(where: str, chunk_groups: int) -> str:
    return plan_sql.chunk_links(_GROUPS, _GROUPS, where, chunk_groups)


def room_nids(count: int) -> str:
    """``(room_id, room_nid)`` of ``count`` room ids given as parameters."""
    return room_ids_and_nids_sql(count)


def room_ids_where(where: str = "") -> str:
    return room_ids_of_sql(f"SELECT DISTINCT room_nid FROM state_groups WHERE state_group <= ?{_and(where)}")


LARGEST_ROOMS = plan_sql.largest_rooms(_GROUPS)


def rooms_not_done(run_id: int) -> str:
    """A condition on ``{col}`` (a room_nid column): the rooms run ``run_id`` has not finished."""
    return "{col} NOT IN (SELECT room_nid FROM state_compaction_rooms WHERE run_id = " + str(int(run_id)) + ")"


# ---------------------------------------------------------------------------
# the groups' rows: over Spark's JDBC (a ``dbtable``, no bound parameters:
# integers inlined), and one room's in plain SQL (read_room_chunks)


def jdbc_groups(snapshot_max: int, where: str = "") -> str:
    """The groups Spark reads (a JDBC ``dbtable``), partitioned on state_group."""
    return (
        "(SELECT state_group, room_nid, prev_state_group, chain_length FROM state_groups"
        f" WHERE state_group <= {int(snapshot_max)}{_and(where.format(col='room_nid'))}) AS sg"
    )


def jdbc_deltas(snapshot_max: int, where: str = "") -> str:
    """The delta rows Spark reads (a JDBC ``dbtable``), partitioned on state_group."""
    if where:
        return (
            "(SELECT d.state_group, d.type_key_nid, d.event_nid FROM state_group_deltas d"
            " JOIN state_groups g ON g.state_group = d.state_group"
            f" WHERE d.state_group <= {int(snapshot_max)} AND {where.format(col='g.room_nid')}) AS sgd"
        )
    return (
        "(SELECT state_group, type_key_nid, event_nid FROM state_group_deltas"
        f" WHERE state_group <= {int(snapshot_max)}) AS sgd"
    )


#: One room's groups, then its delta rows, up to a bound (room_nid, bound).
ROOM_GROUPS = (
    "SELECT state_group, prev_state_group, chain_length FROM state_groups"
    " WHERE room_nid = ? AND state_group <= ? ORDER BY state_group"
)
ROOM_DELTAS = (
    "SELECT d.state_group, d.type_key_nid, d.event_nid FROM state_group_deltas d"
    " JOIN state_groups g ON g.state_group = d.state_group"
    " WHERE g.room_nid = ? AND d.state_group <= ? ORDER BY d.state_group, d.type_key_nid"
)


# ---------------------------------------------------------------------------
# the run's bookkeeping: state_compaction_runs, _rooms, _chunks, staging

RUN_UNFINISHED = (
    "SELECT run_id, snapshot_max, options FROM state_compaction_runs WHERE finished_ts IS NULL"
    " ORDER BY run_id DESC LIMIT 1"
)
RUN_INSERT = (
    "INSERT INTO state_compaction_runs (snapshot_max, holder, options, started_ts) VALUES (?, ?, ?, ?) RETURNING run_id"
)
RUN_TAKE_OVER = "UPDATE state_compaction_runs SET holder = ? WHERE run_id = ?"
RUN_FINISH = "UPDATE state_compaction_runs SET finished_ts = ? WHERE run_id = ?"

RUN_ROOMS = (
    "SELECT room_nid, status, state_groups, rows_before, rows_after, groups_rewritten, detail"
    " FROM state_compaction_rooms WHERE run_id = ?"
)
#: Rooms recorded as done whose groups up to snapshot_max are gone (run_id, snapshot_max).
RUN_ROOMS_GONE = (
    "SELECT r.room_nid FROM state_compaction_rooms r WHERE r.run_id = ? AND NOT"
    " EXISTS (SELECT 1 FROM state_groups g WHERE g.room_nid = r.room_nid AND g.state_group <= ?)"
)
#: Swapped chunks, with whether their first and last groups still exist.
RUN_CHUNKS = (
    "SELECT c.room_nid, c.first_group, c.last_group, c.rows_before, c.rows_after, c.groups_rewritten,"
    " (SELECT COUNT(*) FROM state_groups g WHERE g.state_group = c.first_group AND g.room_nid = c.room_nid),"
    " (SELECT COUNT(*) FROM state_groups g WHERE g.state_group = c.last_group AND g.room_nid = c.room_nid)"
    " FROM state_compaction_chunks c WHERE c.run_id = ?"
)
ROOM_INSERT = (
    "INSERT INTO state_compaction_rooms (run_id, room_nid, status, state_groups, rows_before, rows_after,"
    " groups_rewritten, detail, updated_ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (run_id, room_nid) DO NOTHING"
)
CHUNK_UPSERT = (
    "INSERT INTO state_compaction_chunks (run_id, room_nid, first_group, last_group, rows_before,"
    " rows_after, groups_rewritten, updated_ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    # A resumed run whose chunk layout moved (groups purged meanwhile) may
    # swap a chunk starting at the same group.
    " ON CONFLICT (run_id, room_nid, first_group) DO UPDATE SET last_group = excluded.last_group,"
    " rows_before = excluded.rows_before, rows_after = excluded.rows_after,"
    " groups_rewritten = excluded.groups_rewritten, updated_ts = excluded.updated_ts"
)

STAGED_GROUPS = "state_compaction_staged_groups"
STAGED_DELTAS = "state_compaction_staged_deltas"
#: Fresh planner statistics for the staging tables (PostgreSQL; before a large chunk's swap).
ANALYZE_STAGING = tuple(f"ANALYZE {table}" for table in (STAGED_GROUPS, STAGED_DELTAS))
STAGED_GROUP_COLUMNS = (
    "run_id, room_nid, first_group, state_group, is_ref, old_prev, old_rows, old_checksum,"
    " new_prev, new_chain_length, rewrite"
)
STAGED_DELTA_COLUMNS = "run_id, room_nid, first_group, state_group, type_key_nid, event_nid"


def delete_staging(*columns: str) -> tuple[str, ...]:
    """Deleting both staging tables' rows matching ``columns`` (parameters in that order)."""
    cond = " AND ".join(f"{column} = ?" for column in columns)
    return tuple(f"DELETE FROM {table} WHERE {cond}" for table in (STAGED_GROUPS, STAGED_DELTAS))


# ---------------------------------------------------------------------------
# the swap: one staged chunk in, one transaction (see CompactionWriter.swap_chunk)
# Parameters: the chunk's key (run_id, room_nid, first_group), once per
# occurrence of _STAGED and once more where the statement says so.

_STAGED = f"SELECT state_group FROM {STAGED_GROUPS} WHERE run_id = ? AND room_nid = ? AND first_group = ?"
#: The staged groups (alias ``s``), the chunk's key on them, and its new delta rows (key).
_STAGED_AS = f"{STAGED_GROUPS} AS s"
_STAGED_KEY = "s.run_id = ? AND s.room_nid = ? AND s.first_group = ?"
_NEW_ROWS = (
    f"SELECT state_group, type_key_nid, event_nid FROM {STAGED_DELTAS}"
    " WHERE run_id = ? AND room_nid = ? AND first_group = ?"
)

#: Row-locks the chunk's groups; followed by the engine's ``for_update``.
SWAP_LOCK_GROUPS = f"SELECT state_group FROM state_groups WHERE state_group IN ({_STAGED}) ORDER BY state_group"
#: Groups that no longer exist or changed since the job read them:
#: ``(state_group, is_ref, gone)``, at most 5 (key, key).
SWAP_RECHECK = (
    f"SELECT s.state_group, s.is_ref, g.state_group IS NULL FROM {STAGED_GROUPS} s"
    " LEFT JOIN state_groups g ON g.state_group = s.state_group"
    f" LEFT JOIN (SELECT d.state_group, COUNT(*) AS n, SUM({CHECKSUM_SQL}) AS h"
    f"   FROM state_group_deltas d WHERE d.state_group IN ({_STAGED}) GROUP BY d.state_group) a"
    "   ON a.state_group = s.state_group"
    f" WHERE {_STAGED_KEY} AND ("
    "   g.state_group IS NULL OR g.room_nid <> s.room_nid OR (s.is_ref = 0 AND ("
    "     COALESCE(g.prev_state_group, -1) <> COALESCE(s.old_prev, -1)"
    "     OR COALESCE(a.n, 0) <> s.old_rows OR COALESCE(a.h, 0) <> s.old_checksum)))"
    " ORDER BY s.state_group LIMIT 5"
)
SWAP_DELETE_DELTAS = delete_deltas_of(f"{_STAGED} AND rewrite = 1 AND is_ref = 0")
SWAP_INSERT_DELTAS = f"INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid) {_NEW_ROWS}"
#: The rewritten groups: new predecessor and chain length, and their copy of a
#: one-row delta (``sole_*``, which the store's full-state read trusts) from
#: the chunk's staged rows, which are exactly their new rows: one aggregate
#: over the chunk, one UPDATE, one new row version each (key, key).
SWAP_UPDATE_GROUPS = (
    "UPDATE state_groups SET prev_state_group = s.new_prev, chain_length = s.new_chain_length,"
    " sole_type_key_nid = a.sole_type_key_nid, sole_event_nid = a.sole_event_nid"
    f" FROM {_STAGED_AS} LEFT JOIN (" + sole_deltas_sql(_NEW_ROWS) + ") AS a ON a.state_group = s.state_group"
    f" WHERE {_STAGED_KEY} AND s.is_ref = 0 AND s.rewrite = 1"
    " AND s.state_group = state_groups.state_group"
)
#: The chunk's groups kept as they were whose chain length changed (key).
SWAP_UPDATE_CHAIN_LENGTHS = (
    "UPDATE state_groups SET chain_length = s.new_chain_length"
    f" FROM {_STAGED_AS}"
    f" WHERE {_STAGED_KEY} AND s.is_ref = 0 AND s.rewrite = 0"
    " AND s.state_group = state_groups.state_group AND state_groups.chain_length <> s.new_chain_length"
)
#: chain_length of descendants outside the chunk (later chunks, groups
#: persisted after snapshot_max) follows their predecessor's new length; only
#: where it differs, so the walk stops early (key, key).
SWAP_FIX_CHAIN_LENGTHS = (
    "WITH RECURSIVE fix(state_group, len) AS ("
    "  SELECT c.state_group, p.chain_length + 1"
    "  FROM state_groups p JOIN state_groups c ON c.prev_state_group = p.state_group"
    f"  WHERE p.state_group IN ({_STAGED} AND is_ref = 0)"
    f"  AND c.state_group NOT IN ({_STAGED})"
    "  AND c.chain_length <> p.chain_length + 1"
    "  UNION ALL"
    "  SELECT c.state_group, fix.len + 1 FROM fix"
    "  JOIN state_groups c ON c.prev_state_group = fix.state_group"
    "  WHERE c.chain_length <> fix.len + 1 AND fix.len < 1000000"
    ")"
    " UPDATE state_groups SET chain_length = fix.len FROM fix"
    " WHERE fix.state_group = state_groups.state_group"
)


# ---------------------------------------------------------------------------
# the writer's record of the statements above

#: What :class:`~roomstore.compaction.write_back.CompactionWriter` runs on this layout (by step, typed).
STATEMENTS = JobStatements(
    max_state_group=MAX_STATE_GROUP,
    group_bounds=group_bounds,
    count_rooms=count_rooms,
    chunk_starts=chunk_starts,
    chunk_links=chunk_links,
    room_nids=room_nids,
    room_ids_where=room_ids_where,
    rooms_not_done=rooms_not_done,
    largest_rooms=LARGEST_ROOMS,
    lock_select=LOCK_SELECT,
    lock_insert=LOCK_INSERT,
    lock_take=LOCK_TAKE,
    lock_heartbeat=LOCK_HEARTBEAT,
    lock_release=LOCK_RELEASE,
    lock_release_hint=LOCK_RELEASE_HINT,
    run_unfinished=RUN_UNFINISHED,
    run_insert=RUN_INSERT,
    run_take_over=RUN_TAKE_OVER,
    run_finish=RUN_FINISH,
    run_rooms=RUN_ROOMS,
    run_rooms_gone=RUN_ROOMS_GONE,
    run_chunks=RUN_CHUNKS,
    room_insert=ROOM_INSERT,
    chunk_upsert=CHUNK_UPSERT,
    delete_staging=delete_staging,
    analyze_staging=ANALYZE_STAGING,
)
