"""Writing a compaction back, safely while the homeserver runs.

Everything here runs in the Spark *driver* with plain DB-API connections
(``psycopg2`` or ``sqlite3``, opened by :mod:`roomstore.storage.engines`);
Spark never writes to the database. The flow, per run:

The table layout (roomstore's tables or a Synapse database's) is behind
:class:`~roomstore.compaction.tables.StateTables`, which the caller chooses:
its ``statements`` (a :class:`~roomstore.compaction.tables.JobStatements`)
give the SQL this module runs step by step, and its ``swap`` the lock,
re-check and replacement inside the swap transaction; nothing here is
layout-specific, nor imports a layout.

1. :meth:`CompactionWriter.acquire_lock` takes the lock row (roomstore: the
   ``maintenance_locks`` row ``state_compaction``; Synapse:
   ``roomstore_compressor_lock``) and keeps its ``heartbeat_ts`` fresh from a thread.
   ``RoomStore.delete_state_groups`` waits while the lock is held and ignores
   it (with a warning) once the heartbeat is older than its timeout.
2. :meth:`CompactionWriter.begin_run` records ``snapshot_max`` (MAX(state_group)
   at start) or resumes the unfinished run and its ``snapshot_max``; groups
   above it were persisted after the run began and are never touched.
3. :meth:`CompactionWriter.stage_chunk` copies a chunk's new representation
   into the staging tables (no effect on readers).
4. :meth:`CompactionWriter.swap_chunk` swaps one chunk in, in one short
   transaction: re-check the lock, row-lock the chunk's groups, re-check that
   every group still exists with the representation the job read (else skip:
   someone deleted or rewrote it meanwhile), replace the rewritten groups'
   delta rows, update ``prev_state_group``/``chain_length``, repair the
   ``chain_length`` of descendants outside the chunk, and record progress.

Why readers never see a mix: a group's full state is read by one SQL statement
(``roomstore.state.groups.FULL_STATE_SQL``), which sees one snapshot of the
database, and every swap is one transaction; the rows a statement sees for a
chunk are therefore all old or all new. Each new delta reproduces its group's
full state on top of its new predecessor's state, which itself is unchanged
(content never changes, only representation), so both versions give the same
states. A job killed at any moment (SIGKILL included) leaves every swap either
committed with its progress row or not at all; the next run resumes.

The contract with the Spark side (:mod:`roomstore.compaction.job`) is
:mod:`roomstore.compaction.chunks`: :class:`StagedChunk` and the per-row
checksum both sides compute.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from roomstore.compaction.chunks import StagedChunk
from roomstore.compaction.tables import StateTables, add_step_time
from roomstore.storage.database import RetryTransaction, run_transaction
from roomstore.storage.engines import engine_from_url

log = logging.getLogger("roomstore.compaction")

__all__ = ["CompactionWriter", "LockHeldError", "LockLostError"]
#: A lock whose heartbeat is older than this is treated as abandoned.
DEFAULT_STALE_LOCK_SECONDS = 600.0
#: How often the job refreshes its heartbeat.
DEFAULT_HEARTBEAT_SECONDS = 30.0
#: Swap transactions retried after serialisation failures / deadlocks.
SWAP_ATTEMPTS = 6
#: A staged chunk of at least this many rows (groups, references and delta
#: rows) has the staging tables analysed before its swap (PostgreSQL).
ANALYZE_STAGED_ROWS = 1000


def now_ms() -> int:
    return int(time.time() * 1000)


class LockHeldError(RuntimeError):
    """Another live job holds the compaction lock."""

    def __init__(self, holder: str, age_s: float, release: str = "") -> None:
        super().__init__(
            f"state compaction lock is held by {holder} (last heartbeat {age_s:.0f}s ago); "
            "another compaction is running. If it died, wait for the lock to go stale or "
            f"delete the row: {release}"
        )
        self.holder = holder
        self.age_s = age_s


class LockLostError(RuntimeError):
    """Our lock was taken over (we were presumed dead): stop writing at once."""


@attrs.frozen
class SwapResult:
    """Outcome of :meth:`CompactionWriter.swap_chunk`.

    ``status`` is ``"swapped"`` or ``"changed_underneath"`` (nothing written:
    a group was deleted or changed since the job read it; ``detail`` says
    which). ``rows_deleted``/``rows_inserted`` count delta rows.
    """

    status: str
    detail: str = ""
    rows_deleted: int = 0
    rows_inserted: int = 0


@attrs.frozen
class RoomOutcome:
    """What a run did with one room (one ``state_compaction_rooms`` row)."""

    room_nid: int
    status: str
    state_groups: int
    rows_before: int
    rows_after: int
    groups_rewritten: int
    detail: str = ""


@attrs.define
class RunState:
    """The run being executed.

    ``run_id`` is None for a dry run (nothing is recorded). ``done_rooms``
    (resumed runs) are the rooms finished by an earlier attempt, with their
    recorded outcome; ``done_chunks`` maps ``(room_nid, first_group)`` to the
    ``(last_group, rows_before, rows_after, groups_rewritten)`` of chunks
    already swapped in rooms not finished.
    """

    run_id: int | None
    snapshot_max: int
    resumed: bool = False
    done_rooms: dict = attrs.Factory(dict)
    done_chunks: dict = attrs.Factory(dict)
    warnings: list = attrs.Factory(list)


def default_holder() -> str:
    """``host:pid:random``: the pid lets a rerun on the same host see that the
    previous holder is dead without waiting for the stale timeout."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def holder_is_dead(holder: str) -> bool:
    """True if ``holder`` names a process on this host that no longer runs."""
    parts = holder.split(":")
    if len(parts) < 2 or parts[0] != socket.gethostname():
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _Connection:
    """One DB-API connection plus the engine's dialect; runs transactions."""

    def __init__(self, url: str) -> None:
        self.engine = engine_from_url(url)
        # As the pool's connections: on PostgreSQL the transaction's BEGIN
        # travels with its first statement (one round trip less each; a
        # 1,000-room run has about 2,000 transactions).
        self.conn = self.engine.connect(pooled=True)

    def sql(self, text: str) -> str:
        return self.engine.convert_sql(text)

    def run(self, fn: Callable[[Any], Any], attempts: int = SWAP_ATTEMPTS) -> Any:
        """``fn(cursor)`` in one transaction, retried on serialisation failures
        (and :class:`RetryTransaction`)."""
        return run_transaction(self.engine, lambda: self.conn, fn, attempts=attempts, backoff_s=0.01, max_backoff_s=1.0)

    def query(self, text: str, args: Sequence = ()) -> list:
        def fn(cur):
            cur.execute(self.sql(text), tuple(args))
            return cur.fetchall()

        return self.run(fn)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


class CompactionWriter:
    """The driver's database side of a compaction run; see the module docstring.

    Not thread-safe except for the heartbeat thread, which has its own
    connection. ``before_commit`` is a test hook called inside each swap
    transaction just before commit (raising there rolls the swap back, like a
    crash).
    """

    def __init__(
        self,
        db_url: str,
        *,
        tables: StateTables,
        holder: str | None = None,
        stale_after_s: float = DEFAULT_STALE_LOCK_SECONDS,
        heartbeat_s: float = DEFAULT_HEARTBEAT_SECONDS,
        before_commit: Callable[[Any, int, int], None] | None = None,
    ) -> None:
        self.db_url = db_url
        #: The layout's tables and statements.
        self.tables = tables
        self.statements = tables.statements
        self.lock_name = self.tables.lock_name
        self.holder = holder or default_holder()
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.before_commit = before_commit
        self.db = _Connection(db_url)
        #: Seconds spent in steps of the swaps (the run summary's ``timings_s``).
        self.step_times: dict[str, float] = {}
        self.has_lock = False
        self._lock_lost = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # ------------------------------------------------------------- queries

    def check_schema(self) -> int | None:
        """Raises with a one-line message if the database cannot be compacted
        (:meth:`StateTables.check_schema`)."""
        return self.tables.check_schema(self.db)

    def max_state_group(self) -> int:
        return self.db.query(self.statements.max_state_group)[0][0]

    def group_bounds(self, snapshot_max: int, where: str = "") -> tuple[int | None, int | None, int]:
        """MIN, MAX and COUNT of state groups up to ``snapshot_max`` (plus ``where``)."""
        row = self.db.query(self.statements.group_bounds(where), (snapshot_max,))[0]
        return row[0], row[1], row[2]

    def count_rooms(self, snapshot_max: int, where: str = "") -> int:
        return self.db.query(self.statements.count_rooms(where), (snapshot_max,))[0][0]

    def chunk_layout(
        self, snapshot_max: int, chunk_groups: int, where: str = ""
    ) -> tuple[dict[int, list[int]], list[tuple[int, int, int]]]:
        """How rooms bigger than ``chunk_groups`` groups are cut into chunks.

        Returns ``starts`` (room -> first group of each chunk after the first)
        and ``links``: ``(room, chunk, predecessor)`` for every predecessor
        link that crosses from a chunk into an earlier one: the job reads those
        predecessors' full states. Both are small (about one entry per chunk);
        the database does the numbering (a window over the
        ``(room_nid, state_group)`` index) in one read-only statement each.
        """
        if chunk_groups <= 0:
            return {}, []
        args = (snapshot_max, int(chunk_groups), snapshot_max)
        starts: dict[int, list[int]] = {}
        for room, group in self.db.query(self.statements.chunk_starts(where, chunk_groups), args):
            starts.setdefault(room, []).append(group)
        links = [tuple(link) for link in self.db.query(self.statements.chunk_links(where, chunk_groups), args)]
        return starts, sorted(set(links))

    def room_nids(self, room_ids: Iterable[str]) -> dict[str, int]:
        """``room_id -> room_nid`` for the rooms that exist."""
        ids = list(room_ids)
        out: dict[str, int] = {}
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            for room_id, nid in self.db.query(self.statements.room_nids(len(part)), part):
                out[room_id] = nid
        return out

    def room_ids_where(self, snapshot_max: int, where: str = "") -> dict[int, str]:
        """``room_nid -> room_id`` of every room with state groups selected by ``where``."""
        return dict(self.db.query(self.statements.room_ids_where(where), (snapshot_max,)))

    def rooms_not_done_condition(self, run_id: int) -> str:
        """A condition on ``{col}`` (a room_nid column): the rooms run ``run_id``
        has not finished. The id is inlined: Spark's JDBC reads take no parameters."""
        return self.statements.rooms_not_done(run_id)

    def largest_rooms(self, count: int, snapshot_max: int) -> list[int]:
        """The ``count`` rooms with the most state groups (up to ``snapshot_max``)."""
        return [r[0] for r in self.db.query(self.statements.largest_rooms, (snapshot_max, count))]

    # ------------------------------------------------------------- lock

    def acquire_lock(self) -> None:
        """Take the compaction lock, or raise :class:`LockHeldError`.

        A lock whose heartbeat is older than ``stale_after_s``, or whose
        holder is a dead process on this host, is taken over with a warning.
        Starts the heartbeat thread.
        """

        def txn(cur):
            cur.execute(self.db.sql(self.statements.lock_select + self.db.engine.for_update), (self.lock_name,))
            row = cur.fetchone()
            now = now_ms()
            if row is None:
                cur.execute(self.db.sql(self.statements.lock_insert), (self.lock_name, self.holder, now, now))
                if cur.rowcount != 1:
                    raise RetryTransaction()  # another job inserted it first
                return None
            holder, acquired, beat = row
            age_s = (now - (beat if beat is not None else acquired)) / 1000.0
            if holder != self.holder:
                if holder_is_dead(holder):
                    note = f"compaction lock holder {holder} is no longer running on this host: taking the lock over"
                elif age_s > self.stale_after_s:
                    note = (
                        f"compaction lock held by {holder} is stale (last heartbeat {age_s:.0f}s ago,"
                        f" timeout {self.stale_after_s:.0f}s): taking it over"
                    )
                else:
                    raise LockHeldError(holder, age_s, self.statements.lock_release_hint)
            else:
                note = None
            cur.execute(self.db.sql(self.statements.lock_take), (self.holder, now, now, self.lock_name, holder))
            if cur.rowcount != 1:
                raise RetryTransaction()  # the lock changed hands meanwhile
            return note

        try:
            note = self.db.run(txn)
        except RetryTransaction:
            raise RuntimeError("could not take the compaction lock (it kept changing hands)") from None
        if note:
            log.warning(note)
        self.has_lock = True
        self._lock_lost.clear()
        self._start_heartbeat()

    def heartbeat(self, db: _Connection | None = None) -> bool:
        """Refresh our heartbeat; False (and the lock marked lost) if not ours any more."""
        db = db or self.db

        def txn(cur):
            cur.execute(db.sql(self.statements.lock_heartbeat), (now_ms(), self.lock_name, self.holder))
            return cur.rowcount == 1

        ok = db.run(txn)
        if not ok:
            self._lock_lost.set()
        return ok

    def _start_heartbeat(self) -> None:
        if self._heartbeat_thread is not None or self.heartbeat_s <= 0:
            return
        self._stop_heartbeat.clear()

        def loop() -> None:
            conn = None
            try:
                conn = _Connection(self.db_url)
                while not self._stop_heartbeat.wait(self.heartbeat_s):
                    try:
                        if not self.heartbeat(conn):
                            log.error("compaction lock lost (taken over by another job); stopping writes")
                            return
                    except Exception as exc:  # a blip must not kill the job; the swap re-checks
                        log.warning("heartbeat failed: %s", exc)
            finally:
                if conn is not None:
                    conn.close()

        self._heartbeat_thread = threading.Thread(target=loop, name="compaction-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def release_lock(self) -> None:
        """Release the lock if we hold it; stops the heartbeat. Idempotent."""
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=10)
            self._heartbeat_thread = None
        if not self.has_lock:
            return

        def txn(cur):
            cur.execute(self.db.sql(self.statements.lock_release), (self.lock_name, self.holder))

        self.db.run(txn)
        self.has_lock = False

    # ------------------------------------------------------------- runs

    def begin_run(self, options: Mapping[str, Any], dry_run: bool = False) -> RunState:
        """Start a run, or resume the unfinished one (keeping its snapshot_max).

        A resumed run skips the rooms it finished and the chunks it swapped;
        progress rows naming rooms or groups that no longer exist (purged
        since) are skipped with a warning. Dry runs record nothing.
        """
        if dry_run:
            return RunState(run_id=None, snapshot_max=self.max_state_group())
        opts = json.dumps(dict(options), sort_keys=True)
        rows = self.db.query(self.statements.run_unfinished)
        if not rows:
            snapshot = self.max_state_group()

            def create(cur):
                cur.execute(self.db.sql(self.statements.run_insert), (snapshot, self.holder, opts, now_ms()))
                return cur.fetchone()[0]

            return RunState(run_id=self.db.run(create), snapshot_max=snapshot)

        run_id, snapshot, old_opts = rows[0]
        state = RunState(run_id=run_id, snapshot_max=snapshot, resumed=True)
        if old_opts != opts:
            state.warnings.append(f"resuming run {run_id} started with options {old_opts}; continuing with {opts}")
        for nid, status, groups, before, after, rewritten, detail in self.db.query(
            self.statements.run_rooms, (run_id,)
        ):
            state.done_rooms[nid] = RoomOutcome(nid, status, groups, before, after, rewritten, detail or "")
        gone_rooms = [r[0] for r in self.db.query(self.statements.run_rooms_gone, (run_id, snapshot))]
        for nid in gone_rooms:
            state.warnings.append(
                f"progress of run {run_id} lists room {nid} as done, but its state groups no longer exist"
                " (purged since): skipped"
            )
            state.done_rooms.pop(nid, None)
        for nid, first, last, before, after, rewritten, first_ok, last_ok in self.db.query(
            self.statements.run_chunks, (run_id,)
        ):
            if nid in state.done_rooms:
                continue
            if not first_ok or not last_ok:
                state.warnings.append(
                    f"progress of run {run_id} lists groups {first}..{last} of room {nid} as swapped, but"
                    " they no longer exist (purged since): skipped"
                )
                continue
            state.done_chunks[(nid, first)] = (last, before, after, rewritten)

        def take_over(cur):
            cur.execute(self.db.sql(self.statements.run_take_over), (self.holder, run_id))
            # Staging rows of the interrupted attempt are recomputed.
            for statement in self.statements.delete_staging("run_id"):
                cur.execute(self.db.sql(statement), (run_id,))

        self.db.run(take_over)
        return state

    def finish_run(self, run: RunState) -> None:
        """Mark the run finished and drop its leftover staging rows."""
        if run.run_id is None:
            return

        def txn(cur):
            for statement in self.statements.delete_staging("run_id"):
                cur.execute(self.db.sql(statement), (run.run_id,))
            cur.execute(self.db.sql(self.statements.run_finish), (now_ms(), run.run_id))

        self.db.run(txn)

    # ------------------------------------------------------------- staging

    def stage_chunk(self, run: RunState, chunk: StagedChunk) -> None:
        """Copy ``chunk`` into the staging tables (replacing an earlier copy)."""
        key = (run.run_id, chunk.room_nid, chunk.first_group)

        analyze = self.db.engine.name == "postgres" and (
            len(chunk.groups) + len(chunk.refs) + len(chunk.deltas) >= ANALYZE_STAGED_ROWS
        )

        def txn(cur):
            self._delete_staged(cur, *key)
            self.tables.stage(self.db, cur, key, chunk)
            if analyze:
                # Fresh statistics for the swap's plans: with the ones of a
                # small chunk staged before, PostgreSQL joins a large chunk's
                # re-check in a nested loop (seconds instead of milliseconds).
                for statement in self.statements.analyze_staging:
                    cur.execute(statement)

        self.db.run(txn)

    def _delete_staged(self, cur, run_id: int, room_nid: int, first_group: int) -> None:
        self._execute_all(cur, self._delete_staged_statements(run_id, room_nid, first_group))

    def _delete_staged_statements(self, run_id: int, room_nid: int, first_group: int) -> list:
        return [
            (statement, (run_id, room_nid, first_group))
            for statement in self.statements.delete_staging("run_id", "room_nid", "first_group")
        ]

    def _execute_all(self, cur, statements: Sequence[tuple[str, Sequence]]) -> None:
        """Run ``(sql, args)`` statements whose results are not needed, in
        order: on PostgreSQL in one round trip (one ``execute`` of them all),
        elsewhere one by one."""
        if self.db.engine.name == "postgres" and len(statements) > 1:
            cur.execute(
                "; ".join(self.db.sql(text) for text, _ in statements),
                tuple(arg for _, args in statements for arg in args),
            )
            return
        for text, args in statements:
            cur.execute(self.db.sql(text), tuple(args))

    # ------------------------------------------------------------- swap

    def swap_chunk(
        self,
        run: RunState,
        room_nid: int,
        first_group: int,
        chunk_stats: tuple[int, int, int, int],
        room_outcome: RoomOutcome | None = None,
        chain_changed: bool = True,
    ) -> SwapResult:
        """Swap one staged chunk in, in one transaction (see the module docstring).

        ``chunk_stats`` is ``(last_group, rows_before, rows_after,
        groups_rewritten)`` for the progress row; ``room_outcome``, given for
        a room's last chunk, is recorded in the same transaction.
        ``chain_changed=False`` (no group of the chunk changes its
        ``chain_length``) skips repairing descendants. Raises
        :class:`LockLostError` if the lock is no longer ours (nothing written).
        """
        if run.run_id is None:
            raise ValueError("dry runs do not swap")
        if self._lock_lost.is_set():
            raise LockLostError("the compaction lock was taken over by another job")
        key = (run.run_id, room_nid, first_group)
        q, for_update = self.db.sql, self.db.engine.for_update

        def txn(cur):
            # 1. Still ours? The heartbeat update also row-locks the lock row,
            # so a takeover waits for this swap to finish.
            cur.execute(q(self.statements.lock_heartbeat), (now_ms(), self.lock_name, self.holder))
            if cur.rowcount != 1:
                raise LockLostError("the compaction lock is no longer held by this job")
            # 2.-5. Row-lock, re-check, replace (the layout's part).
            changed, deleted, inserted = self.tables.swap(cur, q, key, for_update, chain_changed)
            if changed:
                parts = [
                    f"state group {g} {reason}" + (" (a predecessor outside the chunk)" if is_ref else "")
                    for g, is_ref, reason in changed
                ]
                return SwapResult("changed_underneath", "; ".join(parts))
            # 6. Progress, in the same transaction as the swap it records.
            last, before, after, groups_rewritten = chunk_stats
            now = now_ms()
            progress = [(self.statements.chunk_upsert, key + (last, before, after, groups_rewritten, now))]
            if room_outcome is not None:
                progress.append(self._room_row(run.run_id, room_outcome, now))
            # The progress rows and the staging rows' removal travel together.
            t = time.monotonic()
            self._execute_all(cur, progress + self._delete_staged_statements(*key))
            add_step_time(self.step_times, "swap_progress", t)
            if self.before_commit is not None:
                self.before_commit(cur, room_nid, first_group)
            return SwapResult("swapped", "", deleted, inserted)

        started = time.monotonic()
        result = self.db.run(txn)
        add_step_time(self.step_times, "swap_total", started)
        return result

    def record_room(self, run: RunState, outcome: RoomOutcome) -> None:
        """Record a room's outcome (rooms whose last step was not a swap)."""
        if run.run_id is None:
            return

        def txn(cur):
            self._execute_all(
                cur,
                [self._room_row(run.run_id, outcome, now_ms())]
                + [
                    (statement, (run.run_id, outcome.room_nid))
                    for statement in self.statements.delete_staging("run_id", "room_nid")
                ],
            )

        self.db.run(txn)

    def _room_row(self, run_id: int, o: RoomOutcome, now: int) -> tuple:
        """The statement recording a room's outcome, with its arguments."""
        return self.statements.room_insert, (
            run_id,
            o.room_nid,
            o.status,
            o.state_groups,
            o.rows_before,
            o.rows_after,
            o.groups_rewritten,
            o.detail or None,
            now,
        )

    def _insert_room(self, cur, run_id: int, o: RoomOutcome, now: int) -> None:
        self._execute_all(cur, [self._room_row(run_id, o, now)])

    def close(self) -> None:
        """Release the lock (if held) and close the connection."""
        try:
            self.release_lock()
        finally:
            self.db.close()
