"""The one interface through which the compaction job reads and writes state groups.

The algorithm (:mod:`roomstore.compaction`), the executors
(:mod:`roomstore.compaction.job.executor`), the driver and the writer
(:mod:`roomstore.compaction.write_back`: the lock, runs, staging, the swap
transaction and its retries) know nothing of a table layout; everything that
does is behind :class:`StateTables`, a :class:`typing.Protocol` (mypy checks
each layout against it). Two implementations:

* :class:`roomstore.compaction.roomstore_tables.RoomstoreTables`: roomstore's
  ``state_groups`` / ``state_group_deltas`` (interned integer keys and
  events, ``chain_length``, ``sole_*``), statements in
  :mod:`roomstore.compaction.roomstore_sql`;
* :class:`roomstore.compaction.synapse_tables.SynapseTables`: a Synapse
  PostgreSQL database's ``state_groups`` / ``state_group_edges`` /
  ``state_groups_state`` (strings), statements in
  :mod:`roomstore.compaction.synapse_sql`, progress in tables of our own
  (``roomstore_compressor_*``).

Neither implementation's SQL appears anywhere else. The steps both layouts
take the same way (the lock row, the run's bookkeeping, the planning reads)
are one :class:`JobStatements` record per layout, which the writer runs; the
methods of :class:`StateTables` are the parts whose shape differs.

Rooms are identified by an integer ``room_nid`` throughout the job (roomstore's
interned room id; for Synapse a hash of the room ID computed in SQL).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from roomstore.compaction.chunks import StagedChunk
from roomstore.compaction.job.reading import JdbcSource
from roomstore.storage.engines import Engine

#: ``q(text)``: a statement in the connection's placeholder style.
Convert = Callable[[str], str]
#: A staged chunk's key: ``(run_id, room_nid, first_group)``.
ChunkKey = tuple[int, int, int]
#: ``(room_nid, sort_id, boundary group)``: a chunk (the room's rows from ``sort_id`` on) needs the group's state.
BoundaryNeed = tuple[int, int, int]
#: ``(room_nid, first group, groups)`` of a room.
RoomSize = tuple[int, int, int]
#: What a swap found changed since the read: ``(group, is_ref, reason)`` each.
Changed = list[tuple[int, int, str]]


class JobDatabase(Protocol):
    """The write-back's connection as a layout uses it
    (:class:`roomstore.compaction.write_back.CompactionWriter`'s ``db``)."""

    engine: Engine

    def query(self, text: str, args: Sequence[Any] = ()) -> list:
        """The rows of one statement (``?`` placeholders), in a transaction of its own."""
        ...

    def run(self, fn: Callable[[Any], Any], attempts: int = ...) -> Any:
        """``fn(cursor)`` in one transaction, retried on serialisation failures."""
        ...


@attrs.frozen
class JobStatements:
    """The statements the writer runs on either layout: the same steps, each layout's SQL.

    One record per layout (``sql.STATEMENTS``, ``synapse_sql.STATEMENTS``),
    so a statement one layout lacks is an error where the record is built,
    not a failed attribute lookup in the middle of a run. ``?`` placeholders;
    ``where`` arguments are conditions on ``{col}`` = ``room_nid`` built from
    integers.
    """

    #: MAX(state_group): the run's snapshot_max.
    max_state_group: str
    #: ``group_bounds(where)``: MIN, MAX, COUNT of the groups up to ``?``.
    group_bounds: Callable[[str], str]
    #: ``count_rooms(where)``: rooms with groups up to ``?``.
    count_rooms: Callable[[str], str]
    #: ``chunk_starts(where, chunk_groups)``: ``(room_nid, first group)`` of every chunk after a room's first.
    chunk_starts: Callable[[str, int], str]
    #: ``chunk_links(where, chunk_groups)``: ``(room_nid, chunk, predecessor)`` links into an earlier chunk.
    chunk_links: Callable[[str, int], str]
    #: ``room_nids(count)``: ``(room_id, room_nid)`` of ``count`` room IDs given as parameters.
    room_nids: Callable[[int], str]
    #: ``room_ids_where(where)``: ``(room_nid, room_id)`` of the rooms with groups up to ``?``.
    room_ids_where: Callable[[str], str]
    #: ``rooms_not_done(run_id)``: a condition on ``{col}``, the rooms the run has not finished.
    rooms_not_done: Callable[[int], str]
    #: ``(room_nid, groups)`` of the ``?`` rooms with most groups up to ``?``.
    largest_rooms: str

    #: The lock row: read (``lock_name``), insert, take over, heartbeat, release; and the
    #: statement an operator runs to free it by hand (printed when the lock is held).
    lock_select: str
    lock_insert: str
    lock_take: str
    lock_heartbeat: str
    lock_release: str
    lock_release_hint: str

    #: The run's bookkeeping: its row, its rooms' and chunks' progress.
    run_unfinished: str
    run_insert: str
    run_take_over: str
    run_finish: str
    run_rooms: str
    run_rooms_gone: str
    run_chunks: str
    room_insert: str
    chunk_upsert: str

    #: ``delete_staging(*columns)``: deleting both staging tables' rows matching the columns.
    delete_staging: Callable[..., tuple[str, ...]]
    #: Fresh planner statistics for the staging tables (PostgreSQL; before a large chunk's swap).
    analyze_staging: tuple[str, ...]


class StateTables(Protocol):
    """How one layout's state-group tables are read, staged and swapped.

    The layouts subclass it explicitly, so mypy checks each method's
    signature against the one here.
    """

    #: ``"roomstore"`` or ``"synapse"`` (printed, in the summary).
    layout: str
    #: The job's lock row.
    lock_name: str
    #: The statements the writer runs by step (see :class:`JobStatements`).
    statements: JobStatements
    #: Seconds spent in the layout's own steps of the swaps (the run summary's ``timings_s``).
    step_times: dict[str, float]

    # -- the database --------------------------------------------------------

    def check_schema(self, db: JobDatabase) -> int | None:
        """Raise with a one-line message if the database cannot be compacted;
        the schema version where the layout has one."""
        ...

    def prepare(self, db: JobDatabase, dry_run: bool) -> None:
        """Make the job's own tables ready (nothing in a dry run)."""
        ...

    def incremental_condition(self, db: JobDatabase) -> str:
        """A condition on ``{col}`` (a room_nid column) leaving out rooms that
        earlier finished runs compacted and that have no group since, or ""."""
        ...

    def skipped_at_start(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        """Groups the run leaves alone from the start, counted for the summary."""
        ...

    def skipped_at_end(self, db: JobDatabase, snapshot_max: int, where: str) -> dict[str, int]:
        """Groups left alone that the end of the run can count (created after the start)."""
        ...

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
        """The Spark frame of rows fed to :meth:`room_function`: one row per
        delta row of a group up to ``snapshot_max`` (a group without rows:
        one row with null key), plus boundary states (:func:`boundary_rows`),
        with the columns the room function expects."""
        ...

    def room_sizes(self, db: JobDatabase, snapshot_max: int, where: str) -> list[RoomSize] | None:
        """``(room_nid, first group, groups)`` of every selected room with
        groups up to ``snapshot_max``, for :meth:`ordered_input`; None: this
        layout has no ordered read."""
        ...

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
        """The same rows as :meth:`input_rows`, as one-partition frames
        (each made when its function is called), each holding whole rooms,
        each room's rows together and in :meth:`sort_columns` order (the
        database sorts them): the job then runs the room function over each
        partition as it is read, with no shuffle. Only for layouts whose
        :meth:`room_sizes` is not None (the others' rows are shuffled by room)."""
        ...

    def sort_columns(self) -> Sequence[str]:
        """How a room's rows are sorted before the room function."""
        ...

    def room_function(self, config: Mapping[str, Any]) -> Callable[..., Any]:
        """The ``applyInArrow`` function (executor side) for this layout."""
        ...

    # -- staging and the swap ------------------------------------------------

    def staged_chunk(self, row: Any, room_nid: int) -> StagedChunk:
        """The executor's output row decoded into a :class:`~roomstore.compaction.chunks.StagedChunk`."""
        ...

    def stage(self, db: JobDatabase, cur: Any, key: ChunkKey, chunk: StagedChunk) -> None:
        """Insert ``chunk``'s staging rows (the caller deleted older ones)."""
        ...

    def swap(
        self, cur: Any, q: Convert, key: ChunkKey, for_update: str, chain_changed: bool
    ) -> tuple[Changed | None, int, int]:
        """Lock, re-check and replace one staged chunk inside the caller's transaction.

        Returns ``(changed, deleted, inserted)``: ``changed`` lists
        ``(group, is_ref, reason)`` when something changed since the read
        (nothing was written then), else None with the delta rows deleted and
        inserted.
        """
        ...


#: Boundary groups per statement of :func:`boundary_rows` (their ids are inlined in its SQL).
BOUNDARY_GROUPS_PER_READ = 2000


def boundary_rows(
    spark: Any,
    source: JdbcSource,
    needs: Sequence[BoundaryNeed],
    boundary_ids: Sequence[int],
    states_sql: Callable[[Sequence[int]], str],
    states_schema: str,
    columns: Sequence[str],
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
        ids = boundary_ids[start : start + BOUNDARY_GROUPS_PER_READ]
        part = source.read(spark, f"({states_sql(ids)}) AS boundary", states_schema)
        states = part if states is None else states.unionByName(part)
    if states is None:
        raise ValueError("no boundary groups")
    state_columns = set(states.columns) - {"boundary_group"}
    placed_columns = {
        "room_nid": F.col("room_nid"),
        "sort_id": F.col("sort_id"),
        "kind": F.lit(0).cast("long"),
        "state_group": F.col("boundary_group"),
    }
    return placed.join(states, "boundary_group").select(
        *[
            (
                placed_columns[c]
                if c in placed_columns
                else F.col(c)
                if c in state_columns
                else F.lit(None).cast("long")
            ).alias(c)
            for c in columns
        ]
    )


def add_step_time(times: dict[str, float], name: str, since: float) -> float:
    """Account the seconds since ``since`` (``time.monotonic()``) to
    ``times[name]`` (a run summary's ``timings_s``); returns now."""
    now = time.monotonic()
    times[name] = times.get(name, 0.0) + now - since
    return now
