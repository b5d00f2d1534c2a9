"""The driver of the state-group compaction job (runs under spark-submit).

Started by ``spark-submit ... roomstore/compaction/spark_job.py --db URL ...``,
usually through ``bin/roomstore-compact``
(:func:`roomstore.compaction.job.submit.submit_main`); docs/compaction.md is
the operator's guide. What happens:

1. The driver takes the compaction lock and starts or resumes a run
   (:mod:`roomstore.compaction.write_back`): ``snapshot_max`` = MAX(state_group)
   at start; nothing above it is read or written.
2. Rooms with more than ``--chunk-groups`` groups are cut into chunks of
   that many groups in id order; one driver-side statement returns the first
   group of each chunk and every predecessor link that crosses into an
   earlier chunk (about one per chunk). Spark reads those predecessors' full
   states (one recursive statement, :func:`roomstore.state.groups.full_state_sql`) and reads
   ``state_groups`` and ``state_group_deltas`` over JDBC (PostgreSQL, or
   SQLite through the xerial driver), partitioned on ``state_group`` between
   MIN and MAX. Rows are sorted by ``sort_id`` (the group id; for boundary
   states the first group of the chunk that needs them), so a chunk's
   boundary states arrive just before its groups.
3. ``groupBy(room).applyInArrow`` with the *iterator* form runs one
   :class:`RoomCompactor` per room over Arrow batches sorted by (chunk, id):
   the room is fed to :class:`~roomstore.compaction.StreamingCompactor` chunk by
   chunk, so a Python worker holds one chunk plus the compactor's bounded
   carry-over, never the room. For every chunk the job rebuilds the groups
   from the rows it is about to write and checks with
   :func:`~roomstore.compaction.verify` that every group's full state is the
   same under the old and the new representation. A room with any mismatch
   is reported and not written.
4. The driver streams the per-chunk results, stages each room's new rows and
   swaps its chunks in, one short transaction each (re-checking that nothing
   changed underneath), recording progress in the same transaction.

Everything the executors run is in :mod:`roomstore.compaction.job.executor`
(pure Python plus numpy/pyarrow, no database); the SQL the reads run is in
:mod:`roomstore.compaction.job.reading`. Importing this module does not start
Spark.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from pyspark.sql import SparkSession

from roomstore.compaction import levels_hop_bound
from roomstore.compaction.job.executor import OUTPUT_SCHEMA, whole_rooms
from roomstore.compaction.job.options import APP_NAME, EXIT_LOCKED, EXIT_ROOMS_FAILED, job_parser, unreachable_master
from roomstore.compaction.job.reading import JdbcSource
from roomstore.compaction.job.report import (
    FAILED_STATUSES,
    STATUS_WOULD_WRITE,
    STATUS_WRITTEN,
    ChunkRecord,
    RoomReport,
    report_lines,
    run_totals,
    write_atomic,
    write_metrics,
)
from roomstore.compaction.roomstore_tables import RoomstoreTables, SchemaTooOldError
from roomstore.compaction.synapse_tables import NotSynapseError, SynapseTables
from roomstore.compaction.tables import StateTables
from roomstore.compaction.write_back import CompactionWriter, LockHeldError
from roomstore.progress import progress_bar
from roomstore.storage.errors import DatabaseConfigError, DatabaseUnavailableError, StorageFullError
from roomstore.storage.schema import SchemaTooNewError

log = logging.getLogger("roomstore.compaction")


class Driver:
    """Runs one compaction (driver side): see the module docstring."""

    def __init__(self, args: argparse.Namespace, out=None, tables: StateTables | None = None) -> None:
        self.args = args
        if tables is None:
            tables = SynapseTables() if getattr(args, "synapse", None) else RoomstoreTables()
        self.tables: StateTables = tables
        if getattr(args, "synapse", None):
            args.db = args.synapse  # the database the writer and Spark's reads open
        self.skipped: dict[str, int] = {}
        self.out = out or sys.stdout
        self.levels = tuple(args.levels)
        self.max_hops = args.max_hops if args.max_hops is not None else levels_hop_bound(self.levels)
        self.rooms: dict[int, RoomReport] = {}
        self.order: list[int] = []
        self.warnings: list[str] = []
        self.timings: dict[str, float] = {}
        self.total_rooms = 0
        self.total_chunks = 0
        self.done = 0
        self.writer: Any = None
        self.run: Any = None
        self.resumed_rooms: list[RoomReport] = []
        self.chunked_rooms = 0
        self.rows_so_far = [0, 0]
        self.room_names: dict[int, str] = {}
        self.sizes: list | None = None

    # -- output -------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning(text)

    # -- main ---------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        a = self.args
        return {
            "levels": list(self.levels),
            "max_hops": self.max_hops,
            "min_saving": a.min_saving,
            "chunk_groups": a.chunk_groups,
            "strategy": a.strategy,
            "window": a.window,
            "rooms": a.rooms,
        }

    def execute(self) -> int:
        a = self.args
        if self.max_hops < 0 or a.chunk_groups < 0 or a.window < 1:
            raise SystemExit("max-hops and chunk-groups must not be negative; window must be at least 1")
        if a.strategy == "levels" and self.max_hops < levels_hop_bound(self.levels):
            raise SystemExit(
                f"--max-hops {self.max_hops} is below the levels' own bound {levels_hop_bound(self.levels)}"
            )
        started = time.time()
        t0 = time.monotonic()
        self.writer = writer = CompactionWriter(
            a.db, stale_after_s=a.lock_timeout, heartbeat_s=a.heartbeat, tables=self.tables
        )
        if a.swap_hold:
            writer.before_commit = self._hold_swap
        spark = None
        starting: _SparkStart | None = None
        status = 0
        try:
            writer.check_schema()
            self.tables.prepare(writer.db, a.dry_run)
            if not a.dry_run:
                try:
                    writer.acquire_lock()
                except LockHeldError as exc:
                    log.error("%s", exc)
                    return EXIT_LOCKED
            # Spark (the session, then the executors the master launches)
            # starts while the run's bookkeeping and the planning reads run.
            starting = self._start_spark_in_background()
            self.run = run = writer.begin_run(self.options(), dry_run=a.dry_run)
            for note in run.warnings:
                self.warn(note)
            mode = "dry run" if a.dry_run else (f"resuming run {run.run_id}" if run.resumed else f"run {run.run_id}")
            self.say(
                f"state compaction ({mode}) on {self.tables.layout} {writer.db.engine.describe()}:"
                f" snapshot_max={run.snapshot_max},"
                f" levels={','.join(map(str, self.levels))}, max_hops={self.max_hops}, chunk_groups={a.chunk_groups}"
            )
            self._report_earlier_attempt(run.done_rooms)
            where = self.room_filter()
            if where is not None:
                cond = where.format(col="room_nid") if where else ""
                self.skipped = self.tables.skipped_at_start(writer.db, run.snapshot_max, cond)
                if any(self.skipped.values()):
                    self.say(
                        "  left alone for this run: "
                        + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in self.skipped.items())
                    )
            if where is None:
                self.say("  no rooms selected")
            else:
                lo, hi, count = writer.group_bounds(run.snapshot_max, where.format(col="room_nid"))
                if not count or lo is None or hi is None:  # (MIN and MAX are NULL only when COUNT is 0)
                    self.say("  nothing to do: no state groups selected")
                else:
                    spark = self.compute_and_write(starting, lo, hi, count, where)
            if where is not None:
                cond = where.format(col="room_nid") if where else ""
                self.skipped.update(self.tables.skipped_at_end(writer.db, run.snapshot_max, cond))
            if not a.dry_run:
                writer.finish_run(run)
        finally:
            if starting is not None:
                spark = starting.session(raise_error=False)
            if spark is not None:
                spark.stop()
            writer.close()
            self.timings["total"] = time.monotonic() - t0
            self.timings.update(writer.step_times)
            self.timings.update(self.tables.step_times)
        self.report(started)
        failed = [r for r in self.all_rooms() if r.status in FAILED_STATUSES]
        if failed:
            status = EXIT_ROOMS_FAILED
        return status

    def _report_earlier_attempt(self, done_rooms: dict) -> None:
        """The rooms an interrupted attempt of this run finished: reported as they ended, skipped now."""
        for nid, outcome in done_rooms.items():
            report = RoomReport(
                nid,
                status=outcome.status,
                state_groups=outcome.state_groups,
                rows_before=outcome.rows_before,
                rows_after=outcome.rows_after,
                rewritten=outcome.groups_rewritten,
                earlier_attempt=True,
            )
            if outcome.detail:
                report.detail.append(outcome.detail)
            self.resumed_rooms.append(report)
        if done_rooms:
            self.say(f"  {len(done_rooms)} room(s) already finished by the interrupted attempt: skipped")

    def all_rooms(self) -> list[RoomReport]:
        return self.resumed_rooms + [self.rooms[n] for n in self.order]

    def room_filter(self) -> str | None:
        """A condition on ``{col}`` (a room_nid column) selecting the rooms to
        process: "" for every room, None when the selection is empty. Room
        ids are inlined as integers: Spark's JDBC reads take no parameters."""
        a, run = self.args, self.run
        clauses: list[str] = []
        if a.rooms:
            spec = a.rooms.strip()
            if spec.startswith("largest:"):
                try:
                    n = int(spec.split(":", 1)[1])
                except ValueError:
                    raise SystemExit(f"--rooms {spec!r}: expected largest:N") from None
                nids = self.writer.largest_rooms(n, run.snapshot_max)
            else:
                ids = [r.strip() for r in spec.split(",") if r.strip()]
                found = self.writer.room_nids(ids)
                for room_id in ids:
                    if room_id not in found:
                        self.warn(f"room {room_id} is not in the database: skipped")
                nids = sorted(set(found.values()))
            if not nids:
                return None
            clauses.append("{col} IN (" + ", ".join(str(int(n)) for n in nids) + ")")
        if run.run_id is not None and run.resumed:
            clauses.append(self.writer.rooms_not_done_condition(run.run_id))
        incremental = self.tables.incremental_condition(self.writer.db)
        if incremental:
            clauses.append(incremental)
        return " AND ".join(clauses)

    def start_spark(self) -> Any:
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\..*)?")
        t = time.monotonic()
        spark = SparkSession.builder.appName(APP_NAME).config("spark.ui.showConsoleProgress", "false").getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        self.timings["spark_start"] = time.monotonic() - t
        return spark

    def _start_spark_in_background(self) -> _SparkStart:
        return _SparkStart(self.start_spark)

    # -- Spark --------------------------------------------------------------

    def chunk_layout(self, where: str) -> tuple:
        """The rooms' chunks (driver-side statements, run while Spark starts):
        ``(starts, needs, boundary_ids)``, see :meth:`build_frame`."""
        a = self.args
        cond: str | None = where.format(col="room_nid") if where else ""
        t = time.monotonic()
        self.sizes = self.tables.room_sizes(self.writer.db, int(self.run.snapshot_max), where)
        if self.sizes is not None:
            self.timings["room_sizes"] = time.monotonic() - t
            t = time.monotonic()
            big = [nid for nid, _, n in self.sizes if n > a.chunk_groups]
            # Only rooms larger than a chunk are cut: none, no statement.
            cond = f"room_nid IN ({', '.join(str(int(n)) for n in big)})" if big else None
        starts, links = (
            self.writer.chunk_layout(int(self.run.snapshot_max), a.chunk_groups, cond) if cond is not None else ({}, [])
        )
        self.timings["chunk_layout"] = time.monotonic() - t
        self.chunked_rooms = len(starts)
        self.total_chunks = self.total_rooms + sum(len(s) for s in starts.values())
        boundary_ids = sorted({prev for _, _, prev in links})
        self.timings["boundary_groups"] = len(boundary_ids)
        # (room, sort_id, boundary group): sort_id is the first group of the
        # chunk that needs the state (0 for a room's first chunk).
        needs = [(room, 0 if chunk == 0 else starts[room][chunk - 1], prev) for room, chunk, prev in links]
        return starts, needs, boundary_ids

    def build_frame(self, spark: Any, lo: int, hi: int, count: int, where: str, layout: tuple) -> Any:
        """The per-chunk result frame (not yet computed); ``layout`` from :meth:`chunk_layout`."""
        a, run = self.args, self.run
        starts, needs, boundary_ids = layout
        source = JdbcSource.from_db_url(a.db)
        parallelism = spark.sparkContext.defaultParallelism
        read_parts = a.read_partitions or max(parallelism, min(256, -(-count // 100_000)))
        if not a.read_partitions:
            # Whole waves: 3 reads on 2 cores take as long as 4 smaller ones.
            read_parts = -(-read_parts // parallelism) * parallelism
        read_parts = max(1, min(read_parts, hi - lo + 1))
        # Rooms are spread over several partitions per core: the driver writes
        # one partition's rooms while the next ones are planned (see
        # compute_and_write), so the first results should come early.
        shuffle_parts = a.shuffle_partitions or max(4 * parallelism, min(512, -(-count // 20_000)))
        # Joins and exchanges of this job follow the data's size, not the
        # 200-partition default (each task costs scheduling time); adaptive
        # execution must not merge the rooms' partitions back into one or two.
        spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_parts))
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")
        snap = int(run.snapshot_max)
        fault_room = None
        if a.inject_fault_room:
            fault_room = self.writer.room_nids([a.inject_fault_room]).get(a.inject_fault_room)
        fn = self.tables.room_function(
            {
                "strategy": a.strategy,
                "levels": self.levels,
                "max_hops": self.max_hops,
                "window": a.window,
                "emit": not a.dry_run,
                "fault_room": fault_room,
                "starts": starts,
            }
        )
        if self.sizes is not None:
            # Each partition whole rooms in order, read as they are planned;
            # one frame per partition, made when its job starts (see
            # compute_and_write).
            frames = self.tables.ordered_input(spark, source, snap, where, shuffle_parts, needs, self.sizes)
            return [lambda f=f: f().mapInArrow(whole_rooms(fn), OUTPUT_SCHEMA) for f in frames]
        rows = self.tables.input_rows(spark, source, snap, where, (lo, hi, read_parts), needs, boundary_ids)
        # Rows of a room in (sort_id, kind, id, key) order: the grouped map
        # keeps the order of its sorted input, and the iterator form hands the
        # room over in batches, so a worker never holds more than a chunk.
        return (
            rows.repartition(shuffle_parts, "room_nid")
            .sortWithinPartitions(*self.tables.sort_columns())
            .groupBy("room_nid")
            .applyInArrow(fn, OUTPUT_SCHEMA)
        )

    def compute_and_write(self, starting: _SparkStart, lo: int, hi: int, count: int, where: str) -> Any:
        """Plan on the executors and write here, overlapped: the results are
        consumed a partition at a time (the layout's ordered read: one Spark
        job per partition, a core's worth and one more running ahead, in the
        order they finish, :func:`_partition_rows`; otherwise
        ``toLocalIterator`` with the next partition computed while this one
        is handled), so the driver stages and swaps one partition's rooms
        while Spark plans the next ones.
        Every chunk is still verified on the executor before the driver sees
        it, and each swap is its own transaction, as before. The driver's
        planning statements run while Spark is still starting; returns the
        Spark session."""
        t = time.monotonic()
        cond = where.format(col="room_nid") if where else ""
        self.room_names = self.writer.room_ids_where(self.run.snapshot_max, cond)
        self.total_rooms = len(self.room_names)  # the selected rooms with groups: one statement less
        layout = self.chunk_layout(where)
        w = time.monotonic()
        spark = starting.session()
        self.timings["wait_spark_start"] = time.monotonic() - w
        result = self.build_frame(spark, lo, hi, count, where, layout)
        self.say(
            f"  planning and writing {self.total_rooms} room(s), {count:,} state groups in {self.total_chunks} chunk(s)"
            f" ({self.chunked_rooms} room(s) chunked, {self.timings['boundary_groups']} boundary state(s))"
        )
        bar = progress_bar(self.total_chunks, "compaction", "chunk", force=self.args.progress)
        # (With adaptive execution the call itself runs the reads and the
        # shuffle's map stage: counted as waiting on Spark.)
        w = time.monotonic()
        self.timings["prepare_frame"] = w - t
        if isinstance(result, list):
            rows = _partition_rows(result, spark.sparkContext.defaultParallelism + 1)
        else:
            rows = iter(result.toLocalIterator(prefetchPartitions=True))
        waited = time.monotonic() - w
        while True:
            w = time.monotonic()
            row = next(rows, None)
            waited += time.monotonic() - w
            if "first_result" not in self.timings:
                self.timings["first_result"] = time.monotonic() - t
            if row is None:
                break
            self.handle(row)
            bar.update(1)
        bar.close()
        self.timings["plan_and_write"] = time.monotonic() - t
        self.timings["read_and_plan"] = waited
        self.timings["write"] = self.timings["plan_and_write"] - waited - self.timings["prepare_frame"]
        return spark

    # -- per chunk / per room -------------------------------------------------

    def handle(self, row: Any) -> None:
        """One chunk row from the executors: account, stage, and at the
        room's last chunk decide and write."""
        nid = row["room_nid"]
        room = self.rooms.get(nid)
        if room is None:
            room = self.rooms[nid] = RoomReport(nid)
            self.order.append(nid)
        if row["status"] == "error":
            room.error = row["detail"]
        elif not room.error:
            first, last = row["first_group"], row["last_group"]
            done = self.run.done_chunks.get((nid, first))
            already = done is not None and done[0] == last
            before, after, rewritten = (
                (done[1], done[2], done[3]) if already else (row["rows_before"], row["rows_after"], row["rewritten"])
            )
            room.chunks += 1
            room.state_groups += row["state_groups"]
            room.rows_before += before
            room.rows_after += after
            room.rewritten += rewritten
            room.chain_updates += row["chain_updates"]
            room.missing += row["missing"]
            room.mismatched += row["mismatched"]
            room.max_depth = max(room.max_depth, row["max_depth"])
            if row["detail"]:
                room.detail.append(row["detail"])
            has_changes = bool(row["rewritten"] or row["chain_updates"])
            room.chunk_list.append(
                ChunkRecord(first, last, before, after, rewritten, row["chain_updates"], has_changes, already)
            )
            if has_changes and not already and not self.args.dry_run and not room.mismatched:
                t = time.monotonic()
                self.writer.stage_chunk(self.run, self.tables.staged_chunk(row, nid))
                self._add_time("stage", t)
        if row["is_last"]:
            self.finish_room(room)

    def finish_room(self, room: RoomReport) -> None:
        a, writer, run = self.args, self.writer, self.run
        room.room_id = self.room_names.get(room.room_nid) or f"<room_nid {room.room_nid}>"
        if room.error:
            room.status = "error"
            log.error("room %s: %s; left untouched", room.room_id, room.error)
        elif room.mismatched:
            room.status = "mismatch"
            log.error(
                "room %s: %d state group(s) would change state under the new representation; left untouched (%s)",
                room.room_id,
                room.mismatched,
                "; ".join(room.detail),
            )
        elif not room.rewritten and not room.chain_updates:
            room.status = "unchanged"
        elif room.saving < a.min_saving:
            room.status = "below_min_saving"
        else:
            room.status = STATUS_WOULD_WRITE if a.dry_run else STATUS_WRITTEN
        if room.missing:
            self.warn(
                f"room {room.room_id}: {room.missing} state group(s) whose predecessor chain reaches a missing"
                f" (purged) group were skipped"
            )
        if not a.dry_run:
            t = time.monotonic()
            if room.status == STATUS_WRITTEN:
                self.swap_room(room)
                self._add_time("swap", t)
            else:
                writer.record_room(run, room.outcome())
                self._add_time("record", t)
        self.done += 1
        self.rows_so_far[0] += room.rows_before
        self.rows_so_far[1] += room.rows_after
        # Every room that changed or failed gets a line; quiet rooms only now
        # and then, so a server with 100,000 small rooms gets a readable log.
        noteworthy = room.status not in ("unchanged", "below_min_saving")
        if noteworthy or self.done % 500 == 0 or self.done == self.total_rooms:
            self.say(
                f"  [{self.done}/{self.total_rooms}] {room.room_id}: {room.status}, {room.rows_before:,} -> "
                f"{room.rows_after:,} rows ({room.state_groups:,} groups, {room.chunks} chunk(s))"
                f" | so far {self.rows_so_far[0]:,} -> {self.rows_so_far[1]:,}"
            )

    def _add_time(self, what: str, since: float) -> None:
        """Account the seconds since ``since`` to ``what`` (the summary's ``timings_s``)."""
        self.timings[what] = self.timings.get(what, 0.0) + time.monotonic() - since

    def swap_room(self, room: RoomReport) -> None:
        writer, run = self.writer, self.run
        todo = [c for c in room.chunk_list if c.to_swap]
        if not todo:
            writer.record_room(run, room.outcome())
            return
        for index, c in enumerate(todo):
            last_one = index == len(todo) - 1
            result = writer.swap_chunk(
                run,
                room.room_nid,
                c.first_group,
                (c.last_group, c.rows_before, c.rows_after, c.rewritten),
                room.outcome() if last_one else None,
                chain_changed=c.chain_updates > 0,
            )
            if result.status != "swapped":
                room.status = "changed_underneath"
                room.detail.append(result.detail)
                self.warn(
                    f"room {room.room_id}: {result.detail}; skipping the rest of the room"
                    f" ({index} of {len(todo)} chunk(s) were already swapped in and stay valid)"
                )
                writer.record_room(run, room.outcome())
                break
        if self.args.swap_delay:
            time.sleep(self.args.swap_delay)

    def _hold_swap(self, cur, room_nid: int, first_group: int) -> None:
        """Test hook (``--swap-hold``): inside a swap's transaction, every
        statement run, before COMMIT: say so, then wait ``--swap-hold``
        seconds or until the file ``--swap-hold-release`` exists."""
        a = self.args
        self.say(f"swap transaction open: room_nid {room_nid} chunk {first_group}")
        deadline = time.monotonic() + a.swap_hold
        while time.monotonic() < deadline and not (a.swap_hold_release and os.path.exists(a.swap_hold_release)):
            time.sleep(0.05)

    # -- reporting ------------------------------------------------------------

    def report(self, started: float) -> None:
        a = self.args
        rooms = self.all_rooms()
        totals = run_totals(rooms)
        for line in report_lines(rooms, totals, a.dry_run, self.timings.get("total", 0), len(self.warnings)):
            self.say(line)
        if any(self.skipped.values()):
            self.say("groups left alone: " + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in self.skipped.items()))
        summary = {
            "run_id": self.run.run_id if self.run else None,
            "resumed": bool(self.run and self.run.resumed),
            "dry_run": a.dry_run,
            "snapshot_max": self.run.snapshot_max if self.run else None,
            "database": self.writer.db.engine.describe() if self.writer else None,
            "layout": self.tables.layout,
            "skipped_groups": self.skipped,
            "options": self.options(),
            "started_at": started,
            "duration_s": round(self.timings.get("total", 0.0), 3),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items() if k != "boundary_groups"},
            "chunked_rooms": self.chunked_rooms,
            "boundary_groups": self.timings.get("boundary_groups", 0),
            "totals": totals,
            "rooms": [r.as_json() for r in rooms],
            "warnings": self.warnings,
        }
        if a.summary_json:
            write_atomic(a.summary_json, json.dumps(summary, indent=2, sort_keys=True) + "\n")
        if a.metrics_file:
            write_metrics(a.metrics_file, summary)


def check_master() -> None:
    """Under a direct spark-submit to a standalone master that is not there,
    stop with one line before Spark retries it for a minute."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # the JVM spark-submit started: its conf holds the master
    reason = unreachable_master(SparkConf().get("spark.master", "local[*]"))
    if reason is not None:
        raise SystemExit(f"roomstore-compact: {reason}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under spark-submit: parse the job options and run."""
    args = job_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="roomstore-compact %(levelname)s: %(message)s", force=True
    )
    # py4j logs every callback at INFO.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        check_master()
        return Driver(args).execute()
    except SystemExit:
        raise
    except (DatabaseConfigError, DatabaseUnavailableError) as exc:  # what the operator fixes: one line
        sys.stderr.write(f"roomstore-compact: {exc}\n")
        return 1
    except (NotSynapseError, SchemaTooOldError, SchemaTooNewError) as exc:
        # The database is not one the job can compact: one line says what to do.
        log.error("%s", exc)
        return 1
    except StorageFullError as exc:
        # Staging (or a swap) ran out of space: that transaction rolled back
        # whole, swaps committed before it are complete rooms or chunks.
        log.error(
            "compaction stopped: %s. No state group's state changed: what was swapped in before stays valid and"
            " every other group keeps its representation. Free space (the staging tables' disk or tablespace) and"
            " run it again: it resumes",
            exc,
        )
        return 1
    except Exception as exc:
        log.error("compaction failed: %s", exc)
        traceback.print_exc()
        return 1


def _collect(frame: Callable[[], Any]) -> list:
    """The rows of the frame ``frame()`` makes (a function, so a pool's thread makes and runs it)."""
    return frame().collect()


def _partition_rows(frames: Sequence[Any], ahead: int) -> Iterator[Any]:
    """The rows of ``frames`` (functions making a one-partition frame each,
    whole rooms), a frame's rows together, frames in the order they finish:
    each frame is made and collected
    by a Spark job of its own, at most ``ahead`` of them running or finished
    and not yet handed over, so Spark plans while the caller writes and the
    driver holds a bounded number of partitions' results."""
    todo = iter(frames)
    pending: set = set()
    with ThreadPoolExecutor(max_workers=max(1, ahead), thread_name_prefix="partition") as pool:

        def refill() -> None:
            while len(pending) < ahead:
                frame = next(todo, None)
                if frame is None:
                    return
                pending.add(pool.submit(_collect, frame))

        try:
            refill()
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                future = next(iter(done))
                pending.discard(future)
                rows = future.result()
                refill()  # first: Spark goes on while the caller writes these
                yield from rows
        finally:
            for future in pending:
                future.cancel()


class _SparkStart:
    """The Spark session, started in a thread while the driver's first
    statements run; :meth:`session` waits for it (and raises what starting
    raised, unless ``raise_error`` is false: then None)."""

    def __init__(self, start: Any) -> None:
        self._session: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(start,), name="spark-start", daemon=True)
        self._thread.start()

    def _run(self, start: Any) -> None:
        try:
            self._session = start()
        except BaseException as exc:  # handed to the main thread by session()
            self._error = exc

    def session(self, raise_error: bool = True) -> Any:
        self._thread.join()
        if self._error is not None and raise_error:
            error, self._error = self._error, None
            raise error
        return self._session
