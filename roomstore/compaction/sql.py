"""The statements the compaction job runs on roomstore's tables.

The job's own tables (``state_compaction_runs``, ``_rooms``, ``_chunks`` and
the two staging tables) are written here; the state tables' statements are
composed from their owner, :mod:`roomstore.state.group_tables` (this module
hands it the staging tables as SQL text), the lock's from
:mod:`roomstore.storage.maintenance_locks` and the rooms' from
:mod:`roomstore.storage.interning`; the full state of a group is the state
owner's :func:`~roomstore.state.group_tables.full_state_sql`. Statements use
``?`` placeholders (the engine converts them).

Who runs them: :mod:`roomstore.compaction.writer` (the lock, the run's
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
from roomstore.compaction.tables import JobStatements
from roomstore.compaction.chunks import CHECKSUM_SQL
from roomstore.state import group_tables as groups
from roomstore.state.group_tables import MAX_STATE_GROUP, ROOM_DELTAS, ROOM_GROUPS, jdbc_deltas, jdbc_groups  # noqa: F401
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
#: The groups' relation (the state owner's).
_GROUPS = groups.PLANNING_GROUPS


# ---------------------------------------------------------------------------
# reading the state tables to plan a run (the statements: plan_sql's)

SCHEMA_VERSION = "SELECT version FROM schema_version"


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
    return room_ids_of_sql(groups.rooms_with_groups_sql(where))


LARGEST_ROOMS = plan_sql.largest_rooms(_GROUPS)


def rooms_not_done(run_id: int) -> str:
    """A condition on ``{col}`` (a room_nid column): the rooms run ``run_id`` has not finished."""
    return "{col} NOT IN (SELECT room_nid FROM state_compaction_rooms WHERE run_id = " + str(int(run_id)) + ")"


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
    "SELECT r.room_nid FROM state_compaction_rooms r WHERE r.run_id = ? AND NOT "
    + groups.room_has_groups_sql("r.room_nid")
)
#: Swapped chunks, with whether their first and last groups still exist.
RUN_CHUNKS = (
    "SELECT c.room_nid, c.first_group, c.last_group, c.rows_before, c.rows_after, c.groups_rewritten,"
    f" {groups.group_in_room_sql('c.first_group', 'c.room_nid')},"
    f" {groups.group_in_room_sql('c.last_group', 'c.room_nid')}"
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
SWAP_LOCK_GROUPS = groups.swap_lock_groups(_STAGED)
#: Groups that no longer exist or changed since the job read them (key, key).
SWAP_RECHECK = groups.swap_recheck(f"{STAGED_GROUPS} s", _STAGED, _STAGED_KEY, CHECKSUM_SQL)
SWAP_DELETE_DELTAS = groups.delete_deltas_of(f"{_STAGED} AND rewrite = 1 AND is_ref = 0")
SWAP_INSERT_DELTAS = groups.insert_deltas_from(_NEW_ROWS)
#: The rewritten groups: new predecessor and chain length, and their copy of a
#: one-row delta from the chunk's staged rows (key, key).
SWAP_UPDATE_GROUPS = groups.rewrite_groups_from(_STAGED_AS, _NEW_ROWS, _STAGED_KEY + " AND s.is_ref = 0 AND s.rewrite = 1")
#: The chunk's groups kept as they were whose chain length changed (key).
SWAP_UPDATE_CHAIN_LENGTHS = groups.set_chain_lengths_from(_STAGED_AS, _STAGED_KEY + " AND s.is_ref = 0 AND s.rewrite = 0")
#: chain_length of descendants outside the chunk (later chunks, groups
#: persisted after snapshot_max) follows their predecessor's new length (key, key).
SWAP_FIX_CHAIN_LENGTHS = groups.fix_chain_lengths(f"{_STAGED} AND is_ref = 0", _STAGED)


# ---------------------------------------------------------------------------
# the writer's record of the statements above

#: What :class:`~roomstore.compaction.writer.CompactionWriter` runs on this layout (by step, typed).
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
