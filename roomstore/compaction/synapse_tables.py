"""A Synapse database's state tables behind :class:`~roomstore.compaction.tables.StateTables`.

PostgreSQL only (Synapse's production database). Statements in
:mod:`roomstore.compaction.synapse_sql`; the executors' side in
:mod:`roomstore.compaction.job.synapse_rows`. What the swap locks and why a
reader of Synapse's never sees a mix: :meth:`SynapseTables.swap` and
docs/compaction.md ("Compacting a Synapse database").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from roomstore.compaction import synapse_sql as sql
from roomstore.compaction.chunks import StagedChunk
from roomstore.compaction.job.reading import JdbcSource
from roomstore.compaction.tables import (
    BoundaryNeed,
    Changed,
    ChunkKey,
    Convert,
    JobDatabase,
    RoomSize,
    StateTables,
    add_step_time,
    boundary_rows,
)

LOCK_NAME = "state_compaction"
_COLUMNS = [
    "room_nid",
    "sort_id",
    "kind",
    "state_group",
    "prev_state_group",
    "type",
    "state_key",
    "event_id",
    "row_checksum",
]


_ORDERED_SCHEMA = (
    "room_nid LONG, sort_id LONG, kind LONG, state_group LONG, prev_state_group LONG, type STRING, state_key STRING,"
    " event_id STRING, row_checksum LONG"
)


def room_partitions(
    sizes: Sequence[tuple[int, int, int]], partitions: int, first_share: float = 1.0
) -> list[list[tuple[int, int]]]:
    """``(room_nid, first group, groups)`` of every room cut into at most
    about ``partitions`` lists of ``(room_nid, first group)`` with about the
    same number of groups each, in the order given; a room with more groups
    than a share gets a list of its own. The first list gets ``first_share``
    of a share (the job's first results come sooner, so its writes start)."""
    total = sum(n for _, _, n in sizes)
    share = max(1, -(-total // max(1, partitions)))
    out: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    filled = 0
    for nid, first, n in sizes:
        if current and filled + n > (share if out else max(1, int(share * first_share))):
            out.append(current)
            current, filled = [], 0
        current.append((nid, first))
        filled += n
    if current:
        out.append(current)
    return out


class NotSynapseError(RuntimeError):
    """The database lacks Synapse's state tables."""


class SynapseTables(StateTables):
    """A Synapse database's tables, with the job's own ``roomstore_compressor_*`` beside them."""

    layout = "synapse"
    statements = sql.STATEMENTS
    lock_name = LOCK_NAME

    def __init__(self) -> None:
        #: Seconds spent in the swap's steps (the run summary's ``timings_s``).
        self.step_times: dict[str, float] = {}

    def check_schema(self, db: JobDatabase) -> None:
        if db.engine.name != "postgres":
            raise NotSynapseError("--synapse takes a PostgreSQL URL (postgresql://user@host:port/synapse)")
        tables = sql.REQUIRED_TABLES
        present = {r[0] for r in db.query(sql.TABLES_PRESENT.format(", ".join("?" for _ in tables)), tables)}
        missing = [t for t in tables if t not in present]
        if missing:
            raise NotSynapseError(
                f"{db.engine.describe()} has no {', '.join(missing)}: not a Synapse database, or one older than"
                " Synapse 1.126 (start a current Synapse on it once)"
            )
        rooms, numbers = db.query(sql.ROOM_NID_COLLISIONS)[0]
        if rooms != numbers:
            raise NotSynapseError("two room IDs share a 60-bit room number; compact with --rooms, one room at a time")

    def prepare(self, db: JobDatabase, dry_run: bool) -> None:
        if dry_run:
            return
        if db.query(sql.OWN_TABLES)[0][0]:
            return

        def txn(cur):
            for statement in sql.CREATE_TABLES:
                cur.execute(statement)

        db.run(txn)

    def incremental_condition(self, db: JobDatabase) -> str:
        if not db.query(sql.OWN_TABLES)[0][0]:
            return ""
        return sql.ROOMS_CHANGED_SINCE_DONE

    def skipped_at_start(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        extra = f" WHERE {where}" if where else ""
        return {
            "pending_deletion": db.query(sql.PENDING_DELETION + extra, (snapshot_max,))[0][0],
            "being_persisted": db.query(sql.PERSISTING + extra, (snapshot_max,))[0][0],
        }

    def skipped_at_end(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        extra = f" WHERE {where}" if where else ""
        return {"created_after_start": db.query(sql.CREATED_AFTER + extra, (snapshot_max,))[0][0]}

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

        rows = source.read(
            spark,
            sql.jdbc_group_rows(snapshot_max, where),
            "state_group LONG, room_nid LONG, prev_state_group LONG, type STRING, state_key STRING, event_id STRING,"
            " row_checksum LONG",
            partition,
        )
        out = rows.select(
            "room_nid",
            F.col("state_group").alias("sort_id"),
            F.lit(1).cast("long").alias("kind"),
            "state_group",
            "prev_state_group",
            "type",
            "state_key",
            "event_id",
            "row_checksum",
        )
        if boundary_ids:
            boundary = boundary_rows(
                spark,
                source,
                needs,
                boundary_ids,
                sql.full_states,
                "boundary_group LONG, type STRING, state_key STRING, event_id STRING",
                _COLUMNS,
            )
            out = out.select(*_COLUMNS).unionByName(boundary)
        return out

    def room_sizes(self, db: JobDatabase, snapshot_max: int, where: str) -> list[RoomSize] | None:
        cond = where.format(col="room_nid") if where else ""
        return [(int(nid), int(first), int(n)) for nid, first, n in db.query(sql.room_sizes(cond), (snapshot_max,))]

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
        """One JDBC read per partition of whole rooms (about the same number
        of groups each, a room larger than that alone), PostgreSQL sorting
        each room's rows (:func:`synapse_sql.jdbc_ordered_rows`): no shuffle,
        so the first partition's rooms are planned (and written by the
        driver) while the next ones are read."""

        source = self.read_source(source)

        def frame(rooms: list[tuple[int, int]]):
            nids = {nid for nid, _ in rooms}
            part_needs = [n for n in needs if n[0] in nids]
            table = sql.jdbc_ordered_rows(
                snapshot_max, where, [first for _, first in rooms], part_needs, sorted({b for _, _, b in part_needs})
            )
            return lambda: source.read(spark, f"({table}) AS sgr", _ORDERED_SCHEMA)

        # The driver writes nothing until a partition is planned: the first is
        # a quarter of the others (and its rooms, as the others', in the
        # statement's order).
        return [frame(rooms) for rooms in room_partitions(sizes, partitions, first_share=0.25)]

    @staticmethod
    def read_source(source: JdbcSource) -> JdbcSource:
        """``source`` whose connections look rows up by index (:data:`synapse_sql.READ_OPTIONS`, after the
        URL's own options)."""
        options = " ".join(filter(None, [source.properties.get("options"), sql.READ_OPTIONS]))
        return attrs.evolve(source, properties={**source.properties, "options": options})

    def sort_columns(self) -> Sequence[str]:
        return ("room_nid", "sort_id", "kind", "state_group", "type", "state_key")

    def room_function(self, config: Mapping[str, Any]) -> Callable[..., Any]:
        from roomstore.compaction.job.synapse_rows import make_synapse_room_function

        return make_synapse_room_function(config)

    # -- staging and the swap ------------------------------------------------

    def staged_chunk(self, row: Any, room_nid: int) -> StagedChunk:
        import numpy as np

        from roomstore.compaction.job.synapse_rows import decode_deltas

        groups = np.frombuffer(row["groups_blob"], dtype="<i8").reshape(-1, 7).tolist()
        return StagedChunk(
            room_nid=room_nid,
            first_group=row["first_group"],
            last_group=row["last_group"],
            groups=[
                (g, None if op < 0 else op, rows, ck, None if np_ < 0 else np_, chain, rw)
                for g, op, rows, ck, np_, chain, rw in groups
            ],
            refs=np.frombuffer(row["refs_blob"], dtype="<i8").tolist(),
            deltas=decode_deltas(row["deltas_blob"]),
            rows_before=row["rows_before"],
            rows_after=row["rows_after"],
            groups_rewritten=row["rewritten"],
        )

    def stage(self, db: JobDatabase, cur: Any, key: ChunkKey, chunk: StagedChunk) -> None:
        run_id, room_nid, first_group = key
        key = (int(run_id), int(room_nid), int(first_group))
        # Kept groups that are an old or new predecessor of a rewritten one
        # are staged with rewrite = 2: the swap re-counts their rows.
        bases = {p for _, op, _, _, np_, _, rw in chunk.groups if rw for p in (op, np_) if p is not None}
        group_rows = [
            key + (int(g), 0, op, int(rows), int(ck), np_, int(rw) if rw else sql.KEPT_BASE if g in bases else 0)
            for g, op, rows, ck, np_, _chain, rw in chunk.groups
        ]
        group_rows += [key + (int(ref), 1, None, 0, 0, None, 0) for ref in chunk.refs]
        delta_rows = [key + (int(g), t, k, e) for g, t, k, e in chunk.deltas]
        for table, columns, rows in (
            (sql.STAGED_GROUPS, sql.STAGED_GROUP_COLUMNS, group_rows),
            (sql.STAGED_DELTAS, sql.STAGED_DELTA_COLUMNS, delta_rows),
        ):
            if rows:
                # COPY: the staged rows are new (the chunk's earlier copy was deleted first).
                db.engine.copy_rows(cur, table, columns, rows)

    def swap(
        self, cur: Any, q: Convert, key: ChunkKey, for_update: str, chain_changed: bool
    ) -> tuple[Changed | None, int, int]:
        """Inside the writer's transaction (after its lock-row check):

        1. ``SELECT ... FOR NO KEY UPDATE`` the groups whose edges the swap
           touches: the rewritten groups, their old and new predecessors and
           the groups outside the chunk it builds on (``state_groups`` rows,
           id order):
           Synapse's deletion takes ``FOR UPDATE`` on the groups it deletes
           first, so a concurrent deletion either commits before (the
           re-check sees it) or waits for this swap;
        2. re-check: every group of the chunk exists, none is pending
           deletion, none of the chunk's is being persisted, each has the
           edge the job read, and the predecessors of step 1 that are not
           rewritten the row count and checksum it read; otherwise nothing
           is written;
        3. a no-op update of the new
           predecessors (see :data:`synapse_sql.SWAP_TOUCH_BASES`);
        4. delete the rewritten groups' rows, counting and summing them as
           they go: a group whose rows are not the ones the job read rolls
           steps 3-4 back (a savepoint) and nothing is written;
        5. replace the rewritten groups' edges and insert their new rows.
        """
        # Statements go in three round trips (PostgreSQL runs a multi-statement
        # execute in order and returns the last one's result): the lock with
        # the re-check, the savepoint and the touch with the rows' deletion,
        # the edges with the new rows.
        lock_and_check = q(sql.SWAP_LOCK_GROUPS) + "; " + q(sql.SWAP_RECHECK)
        t = time.monotonic()
        cur.execute(lock_and_check, key * (lock_and_check.count("%s") // 3))
        changed = cur.fetchall()
        t = add_step_time(self.step_times, "swap_lock_recheck", t)
        if changed:
            return [(g, is_ref, reason) for g, is_ref, reason in changed], 0, 0
        cur.execute("SAVEPOINT swap_rows; " + q(sql.SWAP_TOUCH_BASES) + "; " + q(sql.SWAP_DELETE_ROWS), key * 3)
        deleted, changed_rows = cur.fetchone()
        t = add_step_time(self.step_times, "swap_delete_rows", t)
        if changed_rows:
            # A rewritten group's rows are not the ones read: nothing of the
            # swap stays (the lock row's heartbeat does).
            cur.execute("ROLLBACK TO SAVEPOINT swap_rows")
            return [(g, 0, "changed since it was read") for g in changed_rows], 0, 0
        cur.execute(
            "; ".join(q(t) for t in (sql.SWAP_DELETE_EDGES, sql.SWAP_INSERT_EDGES, sql.SWAP_INSERT_ROWS)), key * 3
        )
        inserted = cur.rowcount
        add_step_time(self.step_times, "swap_insert", t)
        return None, deleted, inserted
