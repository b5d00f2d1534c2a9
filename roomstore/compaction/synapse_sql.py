"""Every statement the compaction job runs on a Synapse database (PostgreSQL), in one place.

Synapse's layout: ``state_groups(id, room_id, event_id)``,
``state_group_edges(state_group, prev_state_group)`` (no edge: the group's
rows are a full snapshot; an edge: they are a delta on the predecessor's full
state, with no way to remove a key) and ``state_groups_state(state_group,
room_id, type, state_key, event_id)``; ``state_groups_pending_deletion`` and
``state_groups_persisting`` (Synapse's deletion machinery,
``synapse/storage/databases/state/deletion.py``) are read, never written.
The job's own tables are ``roomstore_compressor_*``; nothing of Synapse's
schema is changed.

The writer runs the statements of :data:`STATEMENTS` (the record
:mod:`roomstore.compaction.roomstore_sql` fills for roomstore's tables, see
:class:`roomstore.compaction.tables.JobStatements`). Rooms are numbered by
:data:`ROOM_NID`, 60 bits of the MD5 of the room ID, computed in SQL: no
mapping table, the same number in every run. Statements use ``?``
placeholders; the ``where`` arguments are conditions on ``{col}`` =
``room_nid`` built from integers (Spark's JDBC reads take no parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

from roomstore.compaction import plan_sql
from roomstore.compaction.tables import JobStatements

#: A bound above every state group id.
ANY_GROUP = 2**63 - 1
PREFIX = "roomstore_compressor_"


def room_nid(column: str) -> str:
    """The room number of a ``room_id`` column (60 bits of its MD5)."""
    return f"('x' || substr(md5({column}), 1, 15))::bit(60)::bigint"


#: SQL of a row's checksum over ``state_groups_state AS d``: 28 bits of
#: PostgreSQL's own 64-bit hash of the row's strings (``\x01``-separated); a
#: group's checksum is the sum over its rows (28 bits keep the sums far from
#: overflowing a BIGINT). Only PostgreSQL computes it (the read and the swap's
#: check, on the same server, within one run: staged rows of an interrupted
#: attempt are recomputed). Meant to catch accidental change, not tampering.
#: A quarter of the time of the MD5 it replaces (0.19 against 0.73 us a row).
CHECKSUM_SQL = "(hashtextextended(d.type || chr(1) || d.state_key || chr(1) || d.event_id, 0) & 268435455)"

#: Synapse's tables the job needs (a database without them is not Synapse's, or too old).
REQUIRED_TABLES = (
    "state_groups",
    "state_group_edges",
    "state_groups_state",
    "state_groups_pending_deletion",
    "state_groups_persisting",
)
TABLES_PRESENT = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ({})"


def _and(where: str) -> str:
    return f" AND {where}" if where else ""


#: Groups the job may rewrite: neither pending deletion nor being persisted
#: (those are left alone for the run), with their room number.
_GROUPS = (
    "(SELECT sg.id AS state_group, " + room_nid("sg.room_id") + " AS room_nid, sg.room_id FROM state_groups sg"
    " WHERE NOT EXISTS (SELECT 1 FROM state_groups_pending_deletion p WHERE p.state_group = sg.id)"
    " AND NOT EXISTS (SELECT 1 FROM state_groups_persisting p WHERE p.state_group = sg.id))"
)
#: The same with each group's predecessor (NULL: a snapshot).
_GROUPS_EDGES = (
    "(SELECT g.state_group, g.room_nid, g.room_id, e.prev_state_group FROM " + _GROUPS + " g"
    " LEFT JOIN state_group_edges e ON e.state_group = g.state_group)"
)

# ---------------------------------------------------------------------------
# planning reads

MAX_STATE_GROUP = "SELECT COALESCE(MAX(id), 0) FROM state_groups"


def group_bounds(where: str = "") -> str:
    return plan_sql.group_bounds(f"{_GROUPS} g", where)


def count_rooms(where: str = "") -> str:
    return plan_sql.count_rooms(f"{_GROUPS} g", where)


def chunk_starts(where: str, chunk_groups: int) -> str:
    return plan_sql.chunk_starts(f"{_GROUPS} g", f"{_GROUPS_EDGES} g", where, chunk_groups)


def chunk_links(where: str, chunk_groups: int) -> str:
    return plan_sql.chunk_links(f"{_GROUPS} g", f"{_GROUPS_EDGES} g", where, chunk_groups)


def room_nids(count: int) -> str:
    """``(room_id, room_nid)`` of ``count`` room IDs given as parameters (rooms with state groups)."""
    marks = ", ".join("?" for _ in range(count))
    return f"SELECT DISTINCT room_id, {room_nid('room_id')} FROM state_groups WHERE room_id IN ({marks})"


def room_ids_where(where: str = "") -> str:
    return f"SELECT DISTINCT room_nid, room_id FROM {_GROUPS} g WHERE state_group <= ?{_and(where)}"


LARGEST_ROOMS = plan_sql.largest_rooms(f"{_GROUPS} g")
#: Distinct room IDs and distinct room numbers (a collision of the 60-bit hash would make them differ).
ROOM_NID_COLLISIONS = f"SELECT COUNT(DISTINCT room_id), COUNT(DISTINCT {room_nid('room_id')}) FROM state_groups"


#: A condition on ``{col}``: rooms that no finished run compacted (written,
#: unchanged or below the minimum saving) or that have groups above the
#: snapshot_max of the last finished run that did. Reruns skip the others.
ROOMS_CHANGED_SINCE_DONE = (
    "{col} NOT IN (SELECT d.room_nid FROM (SELECT r.room_nid, MAX(u.snapshot_max) AS snap FROM "
    + PREFIX
    + "rooms r JOIN "
    + PREFIX
    + "runs u ON u.run_id = r.run_id WHERE u.finished_ts IS NOT NULL"
    " AND r.status IN ('written', 'unchanged', 'below_min_saving') GROUP BY r.room_nid) d"
    " WHERE NOT EXISTS (SELECT 1 FROM state_groups sg WHERE sg.id > d.snap AND "
    + room_nid("sg.room_id")
    + " = d.room_nid))"
)


def rooms_not_done(run_id: int) -> str:
    return "{col} NOT IN (SELECT room_nid FROM " + PREFIX + "rooms WHERE run_id = " + str(int(run_id)) + ")"


def jdbc_group_rows(snapshot_max: int, where: str = "") -> str:
    """The groups Spark reads joined with their state rows (one row of NULLs
    for a group without rows): ``state_group, room_nid, prev_state_group,
    type, state_key, event_id, row_checksum`` (:data:`CHECKSUM_SQL` of the row,
    what the swap's re-check sums per group). PostgreSQL joins them, so Spark
    shuffles the rows once (by room) instead of once more for a join of its own."""
    return (
        f"(SELECT g.state_group, g.room_nid, g.prev_state_group, d.type, d.state_key, d.event_id, {CHECKSUM_SQL}"
        f" AS row_checksum FROM {_GROUPS_EDGES} g LEFT JOIN state_groups_state d ON d.state_group = g.state_group"
        f" WHERE g.state_group <= {int(snapshot_max)}{_and(where.format(col='g.room_nid'))}) AS sgr"
    )


def room_sizes(where: str = "") -> str:
    """``(room_nid, first group, groups)`` of each room with groups up to ``?``
    (the job's ordered read puts whole rooms into partitions of about the same size)."""
    return (
        f"SELECT room_nid, MIN(state_group), COUNT(*) FROM {_GROUPS} g WHERE state_group <= ?{_and(where)}"
        " GROUP BY room_nid"
    )


def jdbc_ordered_rows(
    snapshot_max: int,
    where: str,
    first_groups: Sequence[int],
    needs: Sequence[tuple[int, int, int]],
    boundary_ids: Sequence[int],
) -> str:
    """The rows of the rooms whose groups ``first_groups`` are (one group per
    room, integers only): what :func:`jdbc_group_rows` reads (``kind`` 1,
    ``sort_id`` the group), plus the boundary states those rooms ``needs``
    (``(room_nid, sort_id, boundary_group)``, ``kind`` 0; ``boundary_ids``
    their groups), ordered by room, then ``sort_id``, then ``kind``: a
    room's rows together, each chunk's boundary states just before its
    groups. The rooms are selected by ``room_id`` through the
    ``state_groups(room_id)`` index."""
    ids = ", ".join(str(int(g)) for g in first_groups)
    # The rooms' groups through the state_groups(room_id) index, a room at a
    # time (LATERAL ... OFFSET 0 keeps PostgreSQL from joining the whole
    # table by hash instead).
    groups = (
        f"(SELECT sg.id AS state_group, {room_nid('sg.room_id')} AS room_nid, sg.room_id, e.prev_state_group"
        f" FROM (SELECT DISTINCT room_id FROM state_groups WHERE id IN ({ids})) r CROSS JOIN LATERAL"
        f" (SELECT id, room_id FROM state_groups WHERE room_id = r.room_id AND id <= {int(snapshot_max)} OFFSET 0) sg"
        " LEFT JOIN state_group_edges e ON e.state_group = sg.id"
        " WHERE NOT EXISTS (SELECT 1 FROM state_groups_pending_deletion p WHERE p.state_group = sg.id)"
        " AND NOT EXISTS (SELECT 1 FROM state_groups_persisting p WHERE p.state_group = sg.id))"
    )
    rows = (
        "SELECT g.room_id, g.room_nid, g.state_group AS sort_id, 1::bigint AS kind, g.state_group,"
        f" g.prev_state_group, d.type, d.state_key, d.event_id, {CHECKSUM_SQL} AS row_checksum"
        f" FROM {groups} g LEFT JOIN state_groups_state d ON d.state_group = g.state_group"
        f" WHERE TRUE{_and(where.format(col='g.room_nid'))}"
    )
    if needs:
        values = ", ".join(f"({int(r)}, {int(s)}, {int(b)})" for r, s, b in needs)
        rows += (
            " UNION ALL SELECT sgb.room_id, n.room_nid, n.sort_id, 0::bigint, n.boundary_group, NULL::bigint,"
            " b.type, b.state_key, b.event_id, NULL::bigint"
            f" FROM (VALUES {values}) AS n(room_nid, sort_id, boundary_group)"
            f" JOIN ({full_states(boundary_ids)}) AS b ON b.boundary_group = n.boundary_group"
            " JOIN state_groups sgb ON sgb.id = n.boundary_group"
        )
    return (
        "SELECT x.room_nid, x.sort_id, x.kind, x.state_group, x.prev_state_group, x.type, x.state_key, x.event_id,"
        f" x.row_checksum FROM ({rows}) AS x ORDER BY x.room_id, x.sort_id, x.kind"
    )


def full_states(groups: Sequence[int]) -> str:
    """``boundary_group, type, state_key, event_id``: the full state of each
    group (nearest row per key up its edges), plus one row of NULLs per group
    marking its state complete (an empty state is a state)."""
    ids = ", ".join(str(int(g)) for g in groups)
    return (
        "WITH RECURSIVE chain(start_group, state_group, hop) AS ("
        f" SELECT id, id, 0 FROM state_groups WHERE id IN ({ids})"
        " UNION ALL SELECT c.start_group, e.prev_state_group, c.hop + 1 FROM chain c"
        " JOIN state_group_edges e ON e.state_group = c.state_group)"
        " SELECT start_group AS boundary_group, type, state_key, event_id FROM ("
        " SELECT DISTINCT ON (c.start_group, s.type, s.state_key) c.start_group, s.type, s.state_key, s.event_id"
        " FROM chain c JOIN state_groups_state s ON s.state_group = c.state_group"
        " ORDER BY c.start_group, s.type, s.state_key, c.hop) AS x"
        f" UNION ALL SELECT id, NULL, NULL, NULL FROM state_groups WHERE id IN ({ids})"
    )


#: Groups left alone from the start (counted for the summary), and created after it.
PENDING_DELETION = (
    f"SELECT COUNT(*) FROM (SELECT sg.id, {room_nid('sg.room_id')} AS room_nid FROM state_groups sg"
    " WHERE sg.id <= ? AND EXISTS (SELECT 1 FROM state_groups_pending_deletion p WHERE p.state_group = sg.id)) g"
)
PERSISTING = (
    f"SELECT COUNT(*) FROM (SELECT sg.id, {room_nid('sg.room_id')} AS room_nid FROM state_groups sg"
    " WHERE sg.id <= ? AND EXISTS (SELECT 1 FROM state_groups_persisting p WHERE p.state_group = sg.id)) g"
)
CREATED_AFTER = (
    f"SELECT COUNT(*) FROM (SELECT sg.id, {room_nid('sg.room_id')} AS room_nid FROM state_groups sg WHERE sg.id > ?) g"
)

# ---------------------------------------------------------------------------
# the job's own tables (created on the first run that writes)

CREATE_TABLES = (
    f"CREATE TABLE IF NOT EXISTS {PREFIX}lock (lock_name TEXT PRIMARY KEY, holder TEXT NOT NULL,"
    " acquired_ts BIGINT NOT NULL, heartbeat_ts BIGINT)",
    f"CREATE TABLE IF NOT EXISTS {PREFIX}runs (run_id BIGSERIAL PRIMARY KEY, snapshot_max BIGINT NOT NULL,"
    " holder TEXT NOT NULL, options TEXT NOT NULL, started_ts BIGINT NOT NULL, finished_ts BIGINT)",
    f"CREATE TABLE IF NOT EXISTS {PREFIX}rooms (run_id BIGINT NOT NULL, room_nid BIGINT NOT NULL,"
    " status TEXT NOT NULL, state_groups BIGINT NOT NULL, rows_before BIGINT NOT NULL, rows_after BIGINT NOT NULL,"
    " groups_rewritten BIGINT NOT NULL, detail TEXT, updated_ts BIGINT NOT NULL, PRIMARY KEY (run_id, room_nid))",
    f"CREATE TABLE IF NOT EXISTS {PREFIX}chunks (run_id BIGINT NOT NULL, room_nid BIGINT NOT NULL,"
    " first_group BIGINT NOT NULL, last_group BIGINT NOT NULL, rows_before BIGINT NOT NULL,"
    " rows_after BIGINT NOT NULL, groups_rewritten BIGINT NOT NULL, updated_ts BIGINT NOT NULL,"
    " PRIMARY KEY (run_id, room_nid, first_group))",
    f"CREATE UNLOGGED TABLE IF NOT EXISTS {PREFIX}staged_groups (run_id BIGINT NOT NULL, room_nid BIGINT NOT NULL,"
    " first_group BIGINT NOT NULL, state_group BIGINT NOT NULL, is_ref SMALLINT NOT NULL, old_prev BIGINT,"
    " old_rows BIGINT NOT NULL, old_checksum BIGINT NOT NULL, new_prev BIGINT, rewrite SMALLINT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {PREFIX}staged_groups_key ON {PREFIX}staged_groups (run_id, room_nid, first_group)",
    f"CREATE UNLOGGED TABLE IF NOT EXISTS {PREFIX}staged_deltas (run_id BIGINT NOT NULL, room_nid BIGINT NOT NULL,"
    " first_group BIGINT NOT NULL, state_group BIGINT NOT NULL, type TEXT NOT NULL, state_key TEXT NOT NULL,"
    " event_id TEXT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {PREFIX}staged_deltas_key ON {PREFIX}staged_deltas (run_id, room_nid, first_group)",
)
OWN_TABLES = "SELECT COUNT(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = '" + PREFIX + "runs'"

# ---------------------------------------------------------------------------
# the lock row

LOCK_SELECT = f"SELECT holder, acquired_ts, heartbeat_ts FROM {PREFIX}lock WHERE lock_name = ?"
LOCK_INSERT = (
    f"INSERT INTO {PREFIX}lock (lock_name, holder, acquired_ts, heartbeat_ts) VALUES (?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
LOCK_TAKE = f"UPDATE {PREFIX}lock SET holder = ?, acquired_ts = ?, heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
LOCK_HEARTBEAT = f"UPDATE {PREFIX}lock SET heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
LOCK_RELEASE = f"DELETE FROM {PREFIX}lock WHERE lock_name = ? AND holder = ?"
LOCK_RELEASE_HINT = f"DELETE FROM {PREFIX}lock WHERE lock_name = 'state_compaction'"

# ---------------------------------------------------------------------------
# the run's bookkeeping

RUN_UNFINISHED = (
    f"SELECT run_id, snapshot_max, options FROM {PREFIX}runs WHERE finished_ts IS NULL ORDER BY run_id DESC LIMIT 1"
)
RUN_INSERT = (
    f"INSERT INTO {PREFIX}runs (snapshot_max, holder, options, started_ts) VALUES (?, ?, ?, ?) RETURNING run_id"
)
RUN_TAKE_OVER = f"UPDATE {PREFIX}runs SET holder = ? WHERE run_id = ?"
RUN_FINISH = f"UPDATE {PREFIX}runs SET finished_ts = ? WHERE run_id = ?"
RUN_ROOMS = (
    "SELECT room_nid, status, state_groups, rows_before, rows_after, groups_rewritten, detail"
    f" FROM {PREFIX}rooms WHERE run_id = ?"
)
RUN_ROOMS_GONE = (
    f"SELECT r.room_nid FROM {PREFIX}rooms r WHERE r.run_id = ? AND r.room_nid NOT IN"
    f" (SELECT {room_nid('room_id')} FROM state_groups WHERE id <= ?)"
)
RUN_CHUNKS = (
    "SELECT c.room_nid, c.first_group, c.last_group, c.rows_before, c.rows_after, c.groups_rewritten,"
    f" (SELECT COUNT(*) FROM state_groups g WHERE g.id = c.first_group AND {room_nid('g.room_id')} = c.room_nid),"
    f" (SELECT COUNT(*) FROM state_groups g WHERE g.id = c.last_group AND {room_nid('g.room_id')} = c.room_nid)"
    f" FROM {PREFIX}chunks c WHERE c.run_id = ?"
)
ROOM_INSERT = (
    f"INSERT INTO {PREFIX}rooms (run_id, room_nid, status, state_groups, rows_before, rows_after,"
    " groups_rewritten, detail, updated_ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (run_id, room_nid) DO NOTHING"
)
CHUNK_UPSERT = (
    f"INSERT INTO {PREFIX}chunks (run_id, room_nid, first_group, last_group, rows_before,"
    " rows_after, groups_rewritten, updated_ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (run_id, room_nid, first_group) DO UPDATE SET last_group = excluded.last_group,"
    " rows_before = excluded.rows_before, rows_after = excluded.rows_after,"
    " groups_rewritten = excluded.groups_rewritten, updated_ts = excluded.updated_ts"
)

STAGED_GROUPS = PREFIX + "staged_groups"
STAGED_DELTAS = PREFIX + "staged_deltas"
#: Fresh planner statistics for the staging tables (PostgreSQL; before a large chunk's swap).
ANALYZE_STAGING = tuple(f"ANALYZE {table}" for table in (STAGED_GROUPS, STAGED_DELTAS))
STAGED_GROUP_COLUMNS = (
    "run_id",
    "room_nid",
    "first_group",
    "state_group",
    "is_ref",
    "old_prev",
    "old_rows",
    "old_checksum",
    "new_prev",
    "rewrite",
)
STAGED_DELTA_COLUMNS = ("run_id", "room_nid", "first_group", "state_group", "type", "state_key", "event_id")


def delete_staging(*columns: str) -> tuple[str, ...]:
    cond = " AND ".join(f"{column} = ?" for column in columns)
    return tuple(f"DELETE FROM {table} WHERE {cond}" for table in (STAGED_GROUPS, STAGED_DELTAS))


# ---------------------------------------------------------------------------
# the swap: one staged chunk, one transaction (see SynapseTables.swap).
# Parameters: the chunk's key (run_id, room_nid, first_group) per occurrence.

#: The connections of the job's reads (the JDBC ``options`` property) look
#: rows up by index, with memory to sort a partition's rows and no parallel
#: workers (Spark runs a read per core): a partition's read had scanned and
#: hashed the three tables whole, once per partition (4 of the 1,000-room
#: bench's 13 partitions: 2.4 s against 5.9 s).
READ_OPTIONS = "-c enable_seqscan=off -c enable_mergejoin=off -c work_mem=64MB -c max_parallel_workers_per_gather=0"

_KEY = "run_id = ? AND room_nid = ? AND first_group = ?"
_REWRITTEN = f"SELECT state_group FROM {STAGED_GROUPS} WHERE {_KEY} AND rewrite = 1 AND is_ref = 0"

#: ``rewrite`` of a staged group: 1 rewritten; 2 kept, but an old or new
#: predecessor of a rewritten group (its rows are re-counted); 0 kept.
REWRITE, KEPT_BASE = 1, 2

# The swap's statements reach Synapse's tables through their indexes only,
# whatever PostgreSQL's estimates: groups as ``= ANY (ARRAY(...))`` (not a
# join PostgreSQL could turn into a scan of the whole table) and LATERAL
# lookups per staged group. Joins had been planned from the staging tables'
# statistics of another chunk (or Synapse's n_distinct of -0.02 on
# state_groups_state.state_group): a small room's deletion as a hash join
# over a scan of all of state_groups_state, 0.5 s for 84 groups of a 2.2M-row
# table, and the re-check as a merge over all of state_group_edges.

#: The groups of a chunk whose edges the swap touches: the rewritten groups,
#: their old and new predecessors, and the groups outside the chunk it builds
#: on (refs). Only these are locked (and their rows re-counted, below): every
#: other group keeps its rows and its edge, and what Synapse may do to it
#: meanwhile (turn it into a snapshot when its predecessor is deleted) keeps
#: its full state (key x3).
_TOUCHED = (
    f"SELECT state_group FROM {STAGED_GROUPS} WHERE {_KEY} AND (rewrite = 1 OR is_ref = 1)"
    f" UNION SELECT new_prev FROM {STAGED_GROUPS} WHERE {_KEY} AND rewrite = 1 AND is_ref = 0 AND new_prev IS NOT NULL"
    f" UNION SELECT old_prev FROM {STAGED_GROUPS} WHERE {_KEY} AND rewrite = 1 AND is_ref = 0 AND old_prev IS NOT NULL"
)
#: Row-locks (FOR NO KEY UPDATE, in id order) the groups the swap touches
#: (:data:`_TOUCHED`): Synapse's deletion locks the groups it deletes FOR
#: UPDATE first, so one waits for the other (key x3). Locking every group of
#: the chunk instead cost 25 ms per 1,000 groups, for chunks that rewrite a
#: few percent of them.
SWAP_LOCK_GROUPS = f"SELECT id FROM state_groups WHERE id = ANY (ARRAY({_TOUCHED})) ORDER BY id FOR NO KEY UPDATE"
#: A new row version of every group that becomes a new predecessor: a deletion
#: transaction of Synapse's (REPEATABLE READ) that waited for this swap then
#: fails to lock it and is retried with a snapshot that sees the new edges,
#: instead of computing the groups to de-delta from the old ones (key).
SWAP_TOUCH_BASES = (
    "UPDATE state_groups SET event_id = event_id WHERE id = ANY (ARRAY("
    f"SELECT new_prev FROM {STAGED_GROUPS} WHERE {_KEY} AND rewrite = 1 AND is_ref = 0 AND new_prev IS NOT NULL))"
)
#: Groups of the chunk (and refs) gone, pending deletion, being persisted (the
#: chunk's own), or changed since the read: ``(group, is_ref, reason)`` (key).
#: Existence, the deletion tables and the edge are checked for every group
#: (index lookups); the rows are counted and summed here only for the kept
#: old and new predecessors of rewritten groups (``rewrite`` 2), each by a
#: lookup of its own in the ``(state_group, ...)`` index. The rewritten
#: groups' rows are counted and summed as they are deleted
#: (:data:`SWAP_DELETE_ROWS`): reading them here as well had cost a second
#: pass over most of the table's rows, 10 of a 1,000-room run's 26 s of swaps.
_FOUND = (
    " LEFT JOIN LATERAL (SELECT 1 AS found FROM {table} x WHERE x.{column} = s.state_group{extra} LIMIT 1) {alias}"
    " ON TRUE"
)
SWAP_RECHECK = (
    "SELECT s.state_group, s.is_ref, CASE WHEN g.found IS NULL THEN 'no longer exists'"
    " WHEN pd.found IS NOT NULL THEN 'is pending deletion' WHEN ps.found IS NOT NULL THEN 'is being persisted'"
    " ELSE 'changed since it was read' END"
    f" FROM {STAGED_GROUPS} s"
    + _FOUND.format(table="state_groups", column="id", extra="", alias="g")
    + _FOUND.format(table="state_groups_pending_deletion", column="state_group", extra="", alias="pd")
    + _FOUND.format(table="state_groups_persisting", column="state_group", extra=" AND s.is_ref = 0", alias="ps")
    + " LEFT JOIN LATERAL (SELECT e.prev_state_group FROM state_group_edges e WHERE e.state_group = s.state_group"
    "   OFFSET 0) e ON TRUE"
    f" LEFT JOIN LATERAL (SELECT COUNT(*) AS n, SUM({CHECKSUM_SQL}) AS h FROM state_groups_state d"
    f"   WHERE d.state_group = s.state_group AND s.is_ref = 0 AND s.rewrite = {KEPT_BASE}) a ON TRUE"
    f" WHERE s.{_KEY.replace(' AND ', ' AND s.')}"
    "   AND (g.found IS NULL OR pd.found IS NOT NULL OR ps.found IS NOT NULL OR (s.is_ref = 0 AND ("
    "     COALESCE(e.prev_state_group, -1) <> COALESCE(s.old_prev, -1)"
    f"     OR (s.rewrite = {KEPT_BASE} AND (COALESCE(a.n, 0) <> s.old_rows"
    "       OR COALESCE(a.h, 0) <> s.old_checksum)))))"
    " ORDER BY s.state_group LIMIT 5"
)
#: Deletes the rewritten groups' rows, counting and summing them per group as
#: they go: one row, the rows deleted and the rewritten groups (at most 5)
#: whose rows are not the ones the job read (then the swap rolls the deletion
#: back, :meth:`SynapseTables.swap`) (key x2).
SWAP_DELETE_ROWS = (
    f"WITH gone AS (DELETE FROM state_groups_state d WHERE d.state_group = ANY (ARRAY({_REWRITTEN}))"
    f" RETURNING d.state_group, {CHECKSUM_SQL} AS h),"
    " per_group AS (SELECT state_group, COUNT(*) AS n, SUM(h) AS h FROM gone GROUP BY state_group)"
    " SELECT (SELECT COUNT(*) FROM gone), ARRAY(SELECT s.state_group"
    f" FROM {STAGED_GROUPS} s LEFT JOIN per_group a ON a.state_group = s.state_group"
    f" WHERE s.{_KEY.replace(' AND ', ' AND s.')} AND s.rewrite = 1 AND s.is_ref = 0"
    " AND (COALESCE(a.n, 0) <> s.old_rows OR COALESCE(a.h, 0) <> s.old_checksum) ORDER BY s.state_group LIMIT 5)"
)
SWAP_DELETE_EDGES = f"DELETE FROM state_group_edges WHERE state_group = ANY (ARRAY({_REWRITTEN}))"
SWAP_INSERT_EDGES = (
    "INSERT INTO state_group_edges (state_group, prev_state_group)"
    f" SELECT state_group, new_prev FROM {STAGED_GROUPS} WHERE {_KEY} AND rewrite = 1 AND is_ref = 0"
    " AND new_prev IS NOT NULL"
)
SWAP_INSERT_ROWS = (
    "INSERT INTO state_groups_state (state_group, room_id, type, state_key, event_id)"
    f" SELECT d.state_group, g.room_id, d.type, d.state_key, d.event_id FROM {STAGED_DELTAS} d"
    " JOIN LATERAL (SELECT room_id FROM state_groups g WHERE g.id = d.state_group OFFSET 0) g ON TRUE"
    f" WHERE d.{_KEY.replace(' AND ', ' AND d.')}"
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
