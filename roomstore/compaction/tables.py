"""The one interface through which the compaction job reads and writes state groups.

The algorithm (:mod:`roomstore.compaction`), the executors
(:mod:`roomstore.compaction.job.executor`), the driver and the writer
(:mod:`roomstore.compaction.writer`: the lock, runs, staging, the swap
transaction and its retries) know nothing of a table layout; everything that
does is behind :class:`StateTables`. Two implementations:

* :class:`roomstore.compaction.roomstore_tables.RoomstoreTables`: roomstore's
  ``state_groups`` / ``state_group_deltas`` (interned integer keys and
  events, ``chain_length``, ``sole_*``), statements in
  :mod:`roomstore.compaction.sql`;
* :class:`roomstore.compaction.synapse_tables.SynapseTables`: a Synapse
  PostgreSQL database's ``state_groups`` / ``state_group_edges`` /
  ``state_groups_state`` (strings), statements in
  :mod:`roomstore.compaction.synapse_sql`, progress in tables of our own
  (``roomstore_compressor_*``).

Neither implementation's SQL appears anywhere else. ``statements`` is the
module of statements the writer and driver run by name (the same names in
both: the lock row, the run's bookkeeping, the planning reads); the methods
below are the parts whose shape differs between layouts.

Rooms are identified by an integer ``room_nid`` throughout the job (roomstore's
interned room id; for Synapse a hash of the room ID computed in SQL).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

#: ``q(text)``: a statement in the connection's placeholder style.
Convert = Callable[[str], str]
#: A staged chunk's key: ``(run_id, room_nid, first_group)``.
ChunkKey = Tuple[int, int, int]


class StateTables:
    """How one layout's state-group tables are read, staged and swapped.

    Attributes:
        layout: ``"roomstore"`` or ``"synapse"`` (printed, in the summary).
        statements: the module of named statements (see the module docstring).
        lock_name: the job's lock row.
    """

    layout: str = ""
    statements: Any = None
    lock_name: str = ""

    # -- the database --------------------------------------------------------

    def check_schema(self, db: Any) -> None:
        """Raise with a one-line message if the database cannot be compacted."""
        raise NotImplementedError

    def prepare(self, db: Any, dry_run: bool) -> None:
        """Make the job's own tables ready (nothing in a dry run)."""

    def incremental_condition(self, db: Any) -> str:
        """A condition on ``{col}`` (a room_nid column) leaving out rooms that
        earlier finished runs compacted and that have no group since, or ""."""
        return ""

    def skipped_at_start(self, db: Any, snapshot_max: int, where: str) -> Dict[str, int]:
        """Groups the run leaves alone from the start, counted for the summary."""
        return {}

    def skipped_at_end(self, db: Any, snapshot_max: int, where: str) -> Dict[str, int]:
        """Groups left alone that the end of the run can count (created after the start)."""
        return {}

    # -- Spark ---------------------------------------------------------------

    def input_rows(
        self, spark: Any, source: Any, snapshot_max: int, where: str, partition: Tuple[int, int, int],
        needs: Sequence[Tuple[int, int, int]], boundary_ids: Sequence[int],
    ) -> Any:
        """The Spark frame of rows fed to :meth:`room_function`: one row per
        delta row of a group up to ``snapshot_max`` (a group without rows:
        one row with null key), plus boundary states (``needs``: room, sort
        id, boundary group), with the columns the room function expects."""
        raise NotImplementedError

    def room_sizes(self, db: Any, snapshot_max: int, where: str) -> Optional[List[Tuple[int, int, int]]]:
        """``(room_nid, first group, groups)`` of every selected room with
        groups up to ``snapshot_max``, for :meth:`ordered_input`; None: this
        layout has no ordered read."""
        return None

    def ordered_input(
        self, spark: Any, source: Any, snapshot_max: int, where: str, partitions: int,
        needs: Sequence[Tuple[int, int, int]], sizes: Sequence[Tuple[int, int, int]],
    ) -> List[Callable[[], Any]]:
        """The same rows as :meth:`input_rows`, as one-partition frames
        (each made when its function is called), each holding whole rooms,
        each room's rows together and in :meth:`sort_columns` order (the
        database sorts them): the job then runs the room function over each
        partition as it is read, with no shuffle. Only for layouts whose
        :meth:`room_sizes` is not None (the others' rows are shuffled by room)."""
        raise NotImplementedError

    def sort_columns(self) -> Sequence[str]:
        """How a room's rows are sorted before the room function."""
        raise NotImplementedError

    def room_function(self, config: Mapping[str, Any]) -> Callable:
        """The ``applyInArrow`` function (executor side) for this layout."""
        raise NotImplementedError

    # -- staging and the swap ------------------------------------------------

    def staged_chunk(self, row: Any, room_nid: int) -> Any:
        """The executor's output row decoded into a :class:`~roomstore.compaction.chunks.StagedChunk`."""
        raise NotImplementedError

    def stage(self, db: Any, cur: Any, key: ChunkKey, chunk: Any) -> None:
        """Insert ``chunk``'s staging rows (the caller deleted older ones)."""
        raise NotImplementedError

    def swap(self, cur: Any, q: Convert, key: ChunkKey, for_update: str, chain_changed: bool) -> Tuple[Optional[list], int, int]:
        """Lock, re-check and replace one staged chunk inside the caller's transaction.

        Returns ``(changed, deleted, inserted)``: ``changed`` lists
        ``(group, is_ref, reason)`` when something changed since the read
        (nothing was written then), else None with the delta rows deleted and
        inserted.
        """
        raise NotImplementedError


#: Boundary groups per statement of :func:`boundary_rows` (their ids are inlined in its SQL).
BOUNDARY_GROUPS_PER_READ = 2000


def boundary_rows(
    spark: Any, source: Any, needs: Sequence[Tuple[int, int, int]], boundary_ids: Sequence[int],
    states_sql: Callable[[Sequence[int]], str], states_schema: str, columns: Sequence[str],
) -> Any:
    """The boundary-state rows (``kind`` 0) of a layout's input frame, in ``columns`` order: every
    chunk that needs a boundary group's state (``needs``: room, sort id, boundary group) gets the
    group's full state. ``states_sql(ids)`` is the layout's statement of the full states of ``ids``
    (``boundary_group`` and the state's own columns, as ``states_schema`` declares them), read over
    JDBC a slice of ids at a time; columns the state has not (the group's own, such as
    ``prev_state_group``) are NULL. Written once: the layouts differ only in the statement."""
    from pyspark.sql import functions as F

    placed = spark.createDataFrame(list(needs), "room_nid long, sort_id long, boundary_group long")
    states = None
    for start in range(0, len(boundary_ids), BOUNDARY_GROUPS_PER_READ):
        ids = boundary_ids[start:start + BOUNDARY_GROUPS_PER_READ]
        part = source.read(spark, f"({states_sql(ids)}) AS boundary", states_schema)
        states = part if states is None else states.unionByName(part)
    if states is None:
        raise ValueError("no boundary groups")
    state_columns = set(states.columns) - {"boundary_group"}
    placed_columns = {
        "room_nid": F.col("room_nid"), "sort_id": F.col("sort_id"), "kind": F.lit(0).cast("long"),
        "state_group": F.col("boundary_group"),
    }
    return placed.join(states, "boundary_group").select(*[
        (placed_columns[c] if c in placed_columns else F.col(c) if c in state_columns else F.lit(None).cast("long"))
        .alias(c)
        for c in columns
    ])


def add_step_time(times: Dict[str, float], name: str, since: float) -> float:
    """Account the seconds since ``since`` (``time.monotonic()``) to
    ``times[name]`` (a run summary's ``timings_s``); returns now."""
    now = time.monotonic()
    times[name] = times.get(name, 0.0) + now - since
    return now
