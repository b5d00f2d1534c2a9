"""roomstore's own state tables behind :class:`~roomstore.compaction.tables.StateTables`.

``state_groups`` (``room_nid``, ``prev_state_group``, ``chain_length``,
``sole_*``) and ``state_group_deltas`` (interned ``type_key_nid``,
``event_nid``, NULL event: a removal). Every statement in
:mod:`roomstore.compaction.roomstore_sql`; the full state of a group is the state
tables' owner's (:func:`roomstore.state.group_tables.full_state_sql`), as
for the store's reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from roomstore.compaction import roomstore_sql as sql
from roomstore.compaction.chunks import ChunkResult, StagedChunk
from roomstore.compaction.job.reading import JdbcSource
from roomstore.compaction.tables import (
    BoundaryNeed,
    Changed,
    ChunkKey,
    Convert,
    JobDatabase,
    RoomSize,
    StateTables,
    boundary_rows,
)
from roomstore.state.group_tables import full_state_sql
from roomstore.storage.maintenance_locks import COMPACTION_LOCK_NAME
from roomstore.storage.schema import READ_SCHEMA_VERSION, SCHEMA_VERSION, SchemaTooNewError

#: The ``maintenance_locks`` row of the compaction job; RoomStore honours it
#: (both take the name from the table's owner, roomstore.storage.maintenance_locks).
LOCK_NAME = COMPACTION_LOCK_NAME

#: The columns of the rows fed to the executors, in order.
_COLUMNS = [
    "room_nid",
    "sort_id",
    "kind",
    "state_group",
    "prev_state_group",
    "chain_length",
    "type_key_nid",
    "event_nid",
]


class SchemaTooOldError(RuntimeError):
    """The database has no compaction tables (schema version < 2)."""


class RoomstoreTables(StateTables):
    """roomstore's own tables; the job's tables are part of the store's schema (version 2)."""

    layout = "roomstore"
    statements = sql.STATEMENTS
    lock_name = LOCK_NAME

    def __init__(self) -> None:
        #: No step of the swap is timed apart: the writer's timings say it all.
        self.step_times: dict[str, float] = {}

    def check_schema(self, db: JobDatabase) -> int:
        """The schema version; raises :class:`SchemaTooOldError` below 2,
        :class:`SchemaTooNewError` above the version this code knows (a newer
        schema may keep more about the rows this job rewrites)."""
        rows = db.query(READ_SCHEMA_VERSION)
        version = rows[0][0] if rows else 0
        if version < 2:
            raise SchemaTooOldError(
                f"database schema is version {version}; state compaction needs version 2. "
                "Start the homeserver (roomstore >= this version) once to upgrade it."
            )
        if version > SCHEMA_VERSION:
            raise SchemaTooNewError(
                f"database schema is version {version}, newer than this roomstore's ({SCHEMA_VERSION}); "
                "install the homeserver's roomstore version for the compaction job."
            )
        return version

    def prepare(self, db: JobDatabase, dry_run: bool) -> None:
        """Nothing: the job's tables are in the store's schema."""

    def incremental_condition(self, db: JobDatabase) -> str:
        """No condition: every run reads every selected room."""
        return ""

    def skipped_at_start(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        """Nothing counted: the summary's "left alone" figures are the Synapse layout's."""
        return {}

    def skipped_at_end(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        return {}

    # -- Spark ---------------------------------------------------------------

    def input_rows(
        self,
        spark: Any,
        source: JdbcSource,
        snapshot_max: int,
        where: str,
        partition: tuple[int, int, int],
        needs: Sequence[BoundaryNeed],
        boundary_ids: Sequence[int],
    ) -> Any:
        from pyspark.sql import functions as F

        groups = source.read(
            spark,
            sql.jdbc_groups(snapshot_max, where),
            "state_group LONG, room_nid LONG, prev_state_group LONG, chain_length LONG",
            partition,
        )
        deltas = source.read(
            spark,
            sql.jdbc_deltas(snapshot_max, where),
            "state_group LONG, type_key_nid LONG, event_nid LONG",
            partition,
        )
        rows = groups.join(deltas, "state_group", "left").select(
            "room_nid",
            F.col("state_group").alias("sort_id"),
            F.lit(1).cast("long").alias("kind"),
            "state_group",
            "prev_state_group",
            "chain_length",
            "type_key_nid",
            "event_nid",
        )
        if boundary_ids:
            boundary = boundary_rows(
                spark,
                source,
                needs,
                boundary_ids,
                full_state_sql,
                "boundary_group LONG, type_key_nid LONG, event_nid LONG",
                _COLUMNS,
            )
            rows = rows.select(*_COLUMNS).unionByName(boundary)
        return rows

    def room_sizes(self, db: JobDatabase, snapshot_max: int, where: str) -> list[RoomSize] | None:
        """None: the rows are shuffled by room (:meth:`input_rows`), no ordered read."""
        return None

    def ordered_input(
        self,
        spark: Any,
        source: JdbcSource,
        snapshot_max: int,
        where: str,
        partitions: int,
        needs: Sequence[BoundaryNeed],
        sizes: Sequence[RoomSize],
    ) -> list[Callable[[], Any]]:
        raise NotImplementedError("roomstore's tables have no ordered read (room_sizes is None)")

    def sort_columns(self) -> Sequence[str]:
        return ("room_nid", "sort_id", "kind", "state_group", "type_key_nid")

    def room_function(self, config: Mapping[str, Any]) -> Callable[..., Any]:
        from roomstore.compaction.job.executor import make_room_function

        return make_room_function(config)

    # -- staging and the swap ------------------------------------------------

    def staged_chunk(self, row: Any, room_nid: int) -> StagedChunk:
        chunk = ChunkResult(
            first_group=row["first_group"],
            last_group=row["last_group"],
            state_groups=row["state_groups"],
            rows_before=row["rows_before"],
            rows_after=row["rows_after"],
            rewritten=row["rewritten"],
            chain_updates=row["chain_updates"],
            max_depth=row["max_depth"],
            boundary=row["boundary"],
            missing={},
            mismatched=[],
            groups=np.frombuffer(row["groups_blob"], dtype="<i8").reshape(-1, 7),
            refs=np.frombuffer(row["refs_blob"], dtype="<i8"),
            deltas=np.frombuffer(row["deltas_blob"], dtype="<i8").reshape(-1, 3),
        )
        return chunk.to_staged(room_nid)

    def stage(self, db: JobDatabase, cur: Any, key: ChunkKey, chunk: StagedChunk) -> None:
        group_rows = [key + (g[0], 0) + tuple(g[1:]) for g in chunk.groups]
        group_rows += [key + (ref, 1, None, 0, 0, None, 0, 0) for ref in chunk.refs]
        delta_rows = [key + tuple(d) for d in chunk.deltas]
        # Integers all (numpy ones from the job too: int() gives their text).
        db.engine.bulk_insert(cur, sql.STAGED_GROUPS, sql.STAGED_GROUP_COLUMNS, group_rows, lambda v: str(int(v)))
        db.engine.bulk_insert(cur, sql.STAGED_DELTAS, sql.STAGED_DELTA_COLUMNS, delta_rows, lambda v: str(int(v)))

    def swap(
        self, cur: Any, q: Convert, key: ChunkKey, for_update: str, chain_changed: bool
    ) -> tuple[Changed | None, int, int]:
        # 2. Row-lock the chunk's groups and the groups it builds on, so a
        # concurrent deletion either finishes first (and the re-check below
        # sees it) or waits for this swap. SQLite: BEGIN IMMEDIATE already
        # excludes every other writer (no FOR UPDATE there).
        if for_update:
            cur.execute(q(sql.SWAP_LOCK_GROUPS + for_update), key)
            cur.fetchall()
        # 3. Re-check: every group exists with the representation read;
        # every referenced group outside the chunk still exists.
        cur.execute(q(sql.SWAP_RECHECK), key + key)
        changed = cur.fetchall()
        if changed:
            return (
                [
                    (g, is_ref, "no longer exists" if gone else "changed since it was read")
                    for g, is_ref, gone in changed
                ],
                0,
                0,
            )
        # 4. Replace the rewritten groups' rows.
        cur.execute(q(sql.SWAP_DELETE_DELTAS), key)
        deleted = cur.rowcount
        cur.execute(q(sql.SWAP_INSERT_DELTAS), key)
        inserted = cur.rowcount
        cur.execute(q(sql.SWAP_UPDATE_GROUPS), key + key)
        cur.execute(q(sql.SWAP_UPDATE_CHAIN_LENGTHS), key)
        # 5. chain_length of descendants outside the chunk follows their
        # predecessor's new length. chain_length only decides when the
        # persister stores a snapshot; reads never use it.
        if chain_changed:
            cur.execute(q(sql.SWAP_FIX_CHAIN_LENGTHS), key + key)
        return None, deleted, inserted


def read_room_chunks(
    writer: Any, room_nid: int, snapshot_max: int, chunk_groups: int
) -> Iterator[dict[str, np.ndarray]]:
    """The chunks of one room exactly as the Spark job feeds them, read with
    plain SQL through ``writer`` (a reference for tests and debugging).
    """
    import pyarrow as pa

    from roomstore.compaction.job.executor import INPUT_COLUMNS, iter_chunks

    db = writer.db
    where = f"room_nid = {int(room_nid)}"
    starts_by_room, links = writer.chunk_layout(snapshot_max, chunk_groups, where)
    starts = starts_by_room.get(room_nid, [])
    need: dict[int, list[int]] = {}
    for _, chunk, prev in links:
        need.setdefault(chunk, []).append(prev)
    states: dict[int, list[tuple[int, int]]] = {}
    all_prevs = sorted({p for prevs in need.values() for p in prevs})
    if all_prevs:
        for g, k, e in db.query(full_state_sql(all_prevs)):
            states.setdefault(g, []).append((-1 if k is None else k, -1 if e is None else e))
    groups = db.query(sql.ROOM_GROUPS, (room_nid, snapshot_max))
    deltas: dict[int, list[tuple[int, int | None]]] = {}
    for g, k, e in db.query(sql.ROOM_DELTAS, (room_nid, snapshot_max)):
        deltas.setdefault(g, []).append((k, e))
    rows: list[tuple[int, ...]] = []
    for chunk, prevs in need.items():
        sort_id = 0 if chunk == 0 else starts[chunk - 1]
        for g in sorted(set(prevs)):
            for k, e in sorted(states.get(g, [])):
                rows.append((sort_id, 0, g, -1, -1, k, e))
    for g, p, chain in groups:
        for k, e in deltas.get(g) or [(-1, -1)]:
            rows.append((g, 1, g, -1 if p is None else p, chain, k, -1 if e is None else e))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[5]))
    if not rows:
        return
    cols = np.array(rows, dtype=np.int64).T
    arrays = {name: cols[i] for i, name in enumerate(INPUT_COLUMNS)}
    yield from iter_chunks([pa.RecordBatch.from_pydict(arrays)], starts)
