"""Every statement the compaction job runs, in one place.

What SQL touches the compaction's tables, or reads the state tables for it?
This module. Statements use ``?`` placeholders (the engine converts them);
the full state of a group is the state owner's statement
(:func:`roomstore.state.groups.full_state_sql`), not repeated here.

Who runs them: :mod:`roomstore.compaction.writer` (the lock, the run's
bookkeeping, staging and the swap), :mod:`roomstore.compaction.job.reading`
and the driver (the reads, some over Spark's JDBC), and
``bench/dataset.py`` (reading a room back).

``where`` arguments are conditions on the ``state_groups`` row (a room
selection built by the driver from integers; Spark's JDBC reads take no bound
parameters, so those statements inline integers too).
"""

from __future__ import annotations

from roomstore.compaction.chunks import CHECKSUM_SQL
from roomstore.state.groups import sole_deltas_sql

#: A bound above every state group id (a room's groups, whatever was written).
ANY_GROUP = 2**63 - 1


def _and(where: str) -> str:
    return f" AND {where}" if where else ""


# ---------------------------------------------------------------------------
# reading the state tables to plan a run

SCHEMA_VERSION = "SELECT version FROM schema_version"
MAX_STATE_GROUP = "SELECT COALESCE(MAX(state_group), 0) FROM state_groups"


def group_bounds(where: str = "") -> str:
    """MIN, MAX, COUNT of the groups up to ``?`` (the run's snapshot_max)."""
    return f"SELECT MIN(state_group), MAX(state_group), COUNT(*) FROM state_groups WHERE state_group <= ?{_and(where)}"


def count_rooms(where: str = "") -> str:
    return f"SELECT COUNT(DISTINCT room_nid) FROM state_groups WHERE state_group <= ?{_and(where)}"


def _numbered(where: str) -> str:
    # Rooms with more than ? groups up to ? (snapshot_max), their groups
    # numbered in id order (a window over the (room_nid, state_group) index).
    # Parameters: snapshot_max, chunk size, snapshot_max.
    extra = _and(where)
    return (
        f"WITH big AS (SELECT room_nid FROM state_groups WHERE state_group <= ?{extra}"
        " GROUP BY room_nid HAVING COUNT(*) > ?),"
        " numbered AS (SELECT state_group, room_nid, prev_state_group,"
        "  (ROW_NUMBER() OVER (PARTITION BY room_nid ORDER BY state_group) - 1) AS pos"
        f"  FROM state_groups WHERE state_group <= ?{extra} AND room_nid IN (SELECT room_nid FROM big))"
    )


def chunk_starts(where: str, chunk_groups: int) -> str:
    """``(room_nid, state_group)``: the first group of each chunk after a room's first."""
    n = int(chunk_groups)
    return (
        _numbered(where) + f" SELECT room_nid, state_group FROM numbered WHERE pos > 0 AND pos % {n} = 0"
        " ORDER BY room_nid, state_group"
    )


def chunk_links(where: str, chunk_groups: int) -> str:
    """``(room_nid, chunk, prev_state_group)`` of every predecessor link that
    crosses from a chunk into an earlier one."""
    n = int(chunk_groups)
    return (
        _numbered(where) + f" SELECT g.room_nid, g.pos / {n}, g.prev_state_group FROM numbered g"
        " JOIN numbered p ON p.state_group = g.prev_state_group AND p.room_nid = g.room_nid"
        f" WHERE g.pos / {n} <> p.pos / {n}"
    )


def room_nids(count: int) -> str:
    """``(room_id, room_nid)`` of ``count`` room ids given as parameters."""
    return f"SELECT room_id, room_nid FROM rooms WHERE room_id IN ({', '.join('?' for _ in range(count))})"


def room_ids_where(where: str = "") -> str:
    return (
        "SELECT r.room_nid, r.room_id FROM rooms r WHERE r.room_nid IN"
        f" (SELECT DISTINCT room_nid FROM state_groups WHERE state_group <= ?{_and(where)})"
    )


LARGEST_ROOMS = (
    "SELECT room_nid, COUNT(*) AS n FROM state_groups WHERE state_group <= ?"
    " GROUP BY room_nid ORDER BY n DESC, room_nid LIMIT ?"
)


def rooms_not_done(run_id: int) -> str:
    """A condition on ``{col}`` (a room_nid column): the rooms run ``run_id`` has not finished."""
    return "{col} NOT IN (SELECT room_nid FROM state_compaction_rooms WHERE run_id = " + str(int(run_id)) + ")"


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


# ---------------------------------------------------------------------------
# the lock row (maintenance_locks; RoomStore.delete_state_groups honours it)

#: Followed by the engine's ``for_update``.
LOCK_SELECT = "SELECT holder, acquired_ts, heartbeat_ts FROM maintenance_locks WHERE lock_name = ?"
LOCK_INSERT = (
    "INSERT INTO maintenance_locks (lock_name, holder, acquired_ts, heartbeat_ts)"
    " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
LOCK_TAKE = (
    "UPDATE maintenance_locks SET holder = ?, acquired_ts = ?, heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
)
LOCK_HEARTBEAT = "UPDATE maintenance_locks SET heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
LOCK_RELEASE = "DELETE FROM maintenance_locks WHERE lock_name = ? AND holder = ?"
#: What an operator runs to drop a dead job's lock (printed, never executed).
LOCK_RELEASE_HINT = "DELETE FROM maintenance_locks WHERE lock_name = 'state_compaction'"


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
    "SELECT r.room_nid FROM state_compaction_rooms r WHERE r.run_id = ? AND NOT EXISTS"
    " (SELECT 1 FROM state_groups g WHERE g.room_nid = r.room_nid AND g.state_group <= ?)"
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

#: Row-locks the chunk's groups; followed by the engine's ``for_update``.
SWAP_LOCK_GROUPS = f"SELECT state_group FROM state_groups WHERE state_group IN ({_STAGED}) ORDER BY state_group"
#: Groups that no longer exist or changed since the job read them (key, key).
SWAP_RECHECK = (
    f"SELECT s.state_group, s.is_ref, g.state_group IS NULL FROM {STAGED_GROUPS} s"
    " LEFT JOIN state_groups g ON g.state_group = s.state_group"
    f" LEFT JOIN (SELECT d.state_group, COUNT(*) AS n, SUM({CHECKSUM_SQL}) AS h"
    f"   FROM state_group_deltas d WHERE d.state_group IN ({_STAGED}) GROUP BY d.state_group) a"
    "   ON a.state_group = s.state_group"
    " WHERE s.run_id = ? AND s.room_nid = ? AND s.first_group = ? AND ("
    "   g.state_group IS NULL OR g.room_nid <> s.room_nid OR (s.is_ref = 0 AND ("
    "     COALESCE(g.prev_state_group, -1) <> COALESCE(s.old_prev, -1)"
    "     OR COALESCE(a.n, 0) <> s.old_rows OR COALESCE(a.h, 0) <> s.old_checksum)))"
    " ORDER BY s.state_group LIMIT 5"
)
SWAP_DELETE_DELTAS = f"DELETE FROM state_group_deltas WHERE state_group IN ({_STAGED} AND rewrite = 1 AND is_ref = 0)"
SWAP_INSERT_DELTAS = (
    "INSERT INTO state_group_deltas (state_group, type_key_nid, event_nid)"
    f" SELECT state_group, type_key_nid, event_nid FROM {STAGED_DELTAS}"
    " WHERE run_id = ? AND room_nid = ? AND first_group = ?"
)
#: The rewritten groups: new predecessor and chain length, and their copy of a
#: one-row delta (``state_groups.sole_*``, which the store's full-state read
#: trusts) from the chunk's staged rows, which are exactly their new rows: one
#: aggregate over the chunk, one UPDATE, one new row version each (key, key).
SWAP_UPDATE_GROUPS = (
    "UPDATE state_groups SET prev_state_group = s.new_prev, chain_length = s.new_chain_length,"
    " sole_type_key_nid = a.sole_type_key_nid, sole_event_nid = a.sole_event_nid"
    f" FROM {STAGED_GROUPS} AS s LEFT JOIN ("
    + sole_deltas_sql(
        f"SELECT state_group, type_key_nid, event_nid FROM {STAGED_DELTAS}"
        " WHERE run_id = ? AND room_nid = ? AND first_group = ?"
    )
    + ") AS a ON a.state_group = s.state_group"
    " WHERE s.run_id = ? AND s.room_nid = ? AND s.first_group = ? AND s.is_ref = 0 AND s.rewrite = 1"
    " AND s.state_group = state_groups.state_group"
)
#: The chunk's groups kept as they were whose chain length changed (key).
SWAP_UPDATE_CHAIN_LENGTHS = (
    "UPDATE state_groups SET chain_length = s.new_chain_length"
    f" FROM {STAGED_GROUPS} AS s"
    " WHERE s.run_id = ? AND s.room_nid = ? AND s.first_group = ? AND s.is_ref = 0 AND s.rewrite = 0"
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
