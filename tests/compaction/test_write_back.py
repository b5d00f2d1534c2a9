"""The compaction writer (staging, swap, progress, lock) and the store's
deletion that honours the lock, on both engines, without Spark.

The rooms are real: persisted through ``RoomStore.persist_events`` (the
package's sample history, a small ``max_state_chain_length`` so there are
many snapshots) plus generated rooms written straight into the tables
(``bench.dataset``). Plans come from the same per-room code the
Spark executors run (:class:`RoomCompactor`) over the same chunk layout
(:func:`read_room_chunks`), so these tests exercise everything but Spark.

Helpers here are shared with ``test_spark_job``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import TestCase

from bench.dataset import load_dataset, read_roomstore_room
from roomstore.compaction import chain_depths, verify
from roomstore.compaction.chunks import CHECKSUM_SQL, row_checksum
from roomstore.compaction.job.executor import RoomCompactor
from roomstore.compaction.roomstore_tables import LOCK_NAME, RoomstoreTables, read_room_chunks
from roomstore.compaction.write_back import (
    CompactionWriter,
    LockHeldError,
    LockLostError,
    RoomOutcome,
)
from roomstore.state.group_tables import FULL_STATE_SQL, full_state_sql, packed_full_state_sql
from roomstore.state.groups import fold_packed_state, fold_state
from roomstore.storage.database import RetryTransaction
from roomstore.storage.engines import engine_from_url
from roomstore.storage.schema import SCHEMA_VERSION, SchemaTooNewError
from roomstore.store import RoomStore, StoreConfig
from tests.db import SOLE_DELTA_MISMATCHES_SQL, on_both_engines

#: Small enough that the persisted rooms have many snapshots to compact.
CHAIN = 6
CHUNK = 40


# ---------------------------------------------------------------- helpers (shared)


async def persist_sample_rooms(url: str, rooms: int = 2, events_per_room: int = 500, seed: int = 11) -> None:
    """Persist the package's sample history through RoomStore (events the
    store refuses, like the sample's deliberate unresolvable merge, are
    skipped)."""
    from roomstore.cli.import_loop import read_import_lines
    from roomstore.demo.sample import write_sample
    from roomstore.events.write.persist import EventToPersist

    directory = tempfile.mkdtemp(prefix="roomstore-compaction-sample-")
    path = os.path.join(directory, "sample.jsonl")
    write_sample(path, rooms=rooms, events_per_room=events_per_room, seed=seed)
    store = await RoomStore.open(url, StoreConfig(max_state_chain_length=CHAIN))
    try:
        lines = list(read_import_lines(path))
        for start in range(0, len(lines), 100):
            batch = [EventToPersist(raw, version) for _, raw, version in lines[start : start + 100]]
            try:
                await store.persist_events(batch)
            except Exception:
                for item in batch:
                    try:
                        await store.persist_events([item])
                    except Exception:
                        pass
    finally:
        await store.close()


async def build_database(url: str, *, sample_rooms: int = 2, size: str = "tiny", chain: int = 8) -> None:
    """Real persisted rooms, then generated ones (the same for a given URL kind)."""
    await persist_sample_rooms(url, rooms=sample_rooms)
    load_dataset(size, roomstore_url=url, max_chain_length=chain)


_templates: dict[str, str] = {}


async def compaction_database(test, kind: str = "standard") -> str:
    """A fresh database holding the standard test rooms (built once per engine
    and kind, then copied: a file copy on SQLite, ``CREATE DATABASE ...
    TEMPLATE`` on PostgreSQL)."""
    import shutil
    import urllib.parse

    key = f"{test.engine_name}/{kind}"
    if key not in _templates:
        if test.engine_name == "postgres":
            import atexit

            from tests.db import create_postgres_database, drop_postgres_database

            test.new_database_url()  # fails or skips the test when PostgreSQL is not configured
            url = create_postgres_database()  # outlives this test: dropped at exit
            atexit.register(drop_postgres_database, url)
        else:
            url = _sqlite_url()
        if kind == "standard":
            await build_database(url)
        else:
            await persist_sample_rooms(url, rooms=1, events_per_room=300)
        if test.engine_name == "sqlite":
            _checkpoint(url)
        _templates[key] = url
    template = _templates[key]
    if test.engine_name == "sqlite":
        copy = _sqlite_url()
        shutil.copy(engine_from_url(template).path, engine_from_url(copy).path)
        test.addCleanup(shutil.rmtree, os.path.dirname(engine_from_url(copy).path), True)
        return copy
    from tests.db import create_postgres_database, drop_postgres_database

    url = create_postgres_database(template=urllib.parse.urlsplit(template).path.lstrip("/"))
    test.addCleanup(drop_postgres_database, url)
    return url


def _sqlite_url() -> str:
    directory = tempfile.mkdtemp(prefix="roomstore-compaction-test-")
    return f"sqlite:///{directory}/test.db"


def _checkpoint(url: str) -> None:
    import sqlite3

    conn = sqlite3.connect(engine_from_url(url).path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def connect(url: str):
    engine = engine_from_url(url)
    conn = engine.connect()
    return engine, conn


def query(url: str, sql: str, args=()) -> list:
    engine, conn = connect(url)
    try:
        cur = conn.cursor()
        cur.execute(engine.convert_sql(sql), tuple(args))
        rows = cur.fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()


def execute(url: str, *statements: str) -> None:
    engine, conn = connect(url)
    try:
        cur = conn.cursor()
        engine.begin(cur)
        for sql in statements:
            cur.execute(engine.convert_sql(sql))
        conn.commit()
    finally:
        conn.close()


def all_states(url: str) -> dict[int, dict[int, int]]:
    """Every group's full state from its rows (FULL_STATE_SQL), checked equal
    to the store's own read (``packed_full_state_sql``: on PostgreSQL it takes
    one-row deltas from ``state_groups.sole_*``, which must follow every
    rewrite)."""
    engine, conn = connect(url)
    try:
        cur = conn.cursor()
        cur.execute("SELECT state_group FROM state_groups ORDER BY state_group")
        groups = [r[0] for r in cur.fetchall()]
        if engine.name == "postgres":
            # Freshly loaded tables have no statistics yet, and the recursive
            # walk would seq-scan them for every group.
            conn.commit()
            conn.autocommit = True
            cur.execute("ANALYZE state_groups")
            cur.execute("ANALYZE state_group_deltas")
        sql = engine.convert_sql(FULL_STATE_SQL)
        store_sql = engine.convert_sql(packed_full_state_sql(engine))
        states = {}
        for group in groups:
            cur.execute(sql, (group,))
            states[group] = fold_state(cur.fetchall())
            cur.execute(store_sql, (group,))
            read = fold_packed_state(cur.fetchall(), engine.unpack_ints)
            if read != states[group]:
                raise AssertionError(f"group {group}: the store's read differs from the group's rows")
        conn.commit()
        return states
    finally:
        conn.close()


def delta_rows(url: str) -> int:
    return query(url, "SELECT COUNT(*) FROM state_group_deltas")[0][0]


def representation(url: str) -> tuple[list, list]:
    """Groups (id, prev, chain_length) and delta rows, sorted: the exact stored form."""
    groups = query(url, "SELECT state_group, prev_state_group, chain_length FROM state_groups ORDER BY state_group")
    deltas = query(
        url, "SELECT state_group, type_key_nid, event_nid FROM state_group_deltas ORDER BY state_group, type_key_nid"
    )
    return [tuple(r) for r in groups], [tuple(r) for r in deltas]


def room_nids(url: str) -> list[int]:
    return [r[0] for r in query(url, "SELECT DISTINCT room_nid FROM state_groups ORDER BY room_nid")]


def chain_lengths_are_depths(test: TestCase, url: str) -> None:
    """Every group's chain_length is its real number of hops to a snapshot."""
    for room in room_nids(url):
        groups = read_roomstore_room(url, room)
        stored = dict(query(url, "SELECT state_group, chain_length FROM state_groups WHERE room_nid = ?", (room,)))
        ids = {g.group_id for g in groups}
        if any(g.prev_group is not None and g.prev_group not in ids for g in groups):
            continue  # a dangling chain (purged predecessor): depth unknown
        depths = chain_depths(groups)
        wrong = {g: (stored[g], d) for g, d in depths.items() if stored[g] != d}
        test.assertEqual(wrong, {}, f"room {room}: chain_length != depth")


def roomstore_writer(url: str, **options) -> CompactionWriter:
    """A writer on roomstore's own tables (the writer has no default layout)."""
    return CompactionWriter(url, tables=RoomstoreTables(), **options)


def plan_room(writer: CompactionWriter, room: int, snapshot_max: int, chunk_groups: int, fault: bool = False):
    """The room's chunk results, as the Spark executors would compute them."""
    compactor = RoomCompactor(room, fault=fault)
    return [compactor.process_chunk(c) for c in read_room_chunks(writer, room, snapshot_max, chunk_groups)]


def reference_compaction(url: str, chunk_groups: int = CHUNK, min_saving: int = 1) -> dict[int, str]:
    """A whole run through the executor code and the writer, without Spark:
    the job's decisions per room (mismatch, unchanged, too small, written)."""
    writer = roomstore_writer(url, heartbeat_s=0)
    outcomes = {}
    try:
        writer.acquire_lock()
        run = writer.begin_run({"reference": True})
        for room in room_nids(url):
            results = plan_room(writer, room, run.snapshot_max, chunk_groups)
            before = sum(r.rows_before for r in results)
            after = sum(r.rows_after for r in results)
            changed = [r for r in results if r.has_changes]
            if any(r.mismatched for r in results):
                status = "mismatch"
            elif not changed:
                status = "unchanged"
            elif before - after < min_saving:
                status = "below_min_saving"
            else:
                status = "written"
            outcome = RoomOutcome(
                room, status, sum(r.state_groups for r in results), before, after, sum(r.rewritten for r in results)
            )
            if status == "written":
                for index, result in enumerate(changed):
                    writer.stage_chunk(run, result.to_staged(room))
                    swap = writer.swap_chunk(
                        run,
                        room,
                        result.first_group,
                        (result.last_group, result.rows_before, result.rows_after, result.rewritten),
                        outcome if index == len(changed) - 1 else None,
                    )
                    assert swap.status == "swapped", swap
            else:
                writer.record_room(run, outcome)
            outcomes[room] = status
        writer.finish_run(run)
    finally:
        writer.close()
    return outcomes


class _LogCapture:
    def __init__(self, test: TestCase) -> None:
        self.events: list[str] = []
        globalLogPublisher.addObserver(self)
        test.addCleanup(globalLogPublisher.removeObserver, self)

    def __call__(self, event) -> None:
        from twisted.logger import formatEvent

        self.events.append(formatEvent(event))

    def text(self) -> str:
        return "\n".join(self.events)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- tests


class ChecksumTests(TestCase):
    def test_lock_name_matches_the_store(self) -> None:
        self.assertEqual(LOCK_NAME, RoomStore.COMPACTION_LOCK_NAME)

    def test_row_checksum(self) -> None:
        self.assertEqual(row_checksum(5, None), row_checksum(5, 0))
        self.assertNotEqual(row_checksum(5, 7), row_checksum(7, 5))
        # A million rows of the largest value still fit a signed 64-bit sum.
        self.assertLess(row_checksum(2**40 - 1, 2**62) * 1_000_000, 2**63)


@on_both_engines
class WriterTests:
    timeout = 300

    async def setUp(self):
        self.url = await compaction_database(self)

    def test_checksum_sql_matches_python(self) -> None:
        rows = query(self.url, "SELECT type_key_nid, event_nid FROM state_group_deltas")
        expected = sum(row_checksum(k, e) for k, e in rows)
        got = query(self.url, f"SELECT SUM({CHECKSUM_SQL}) FROM state_group_deltas d")[0][0]
        self.assertEqual(int(got), expected)

    def test_many_group_full_state_sql_agrees_with_the_store_read(self) -> None:
        # The job's boundary states and the store's reads are one statement
        # (state.groups.full_state_sql): folded in SQL for many groups at once,
        # they equal the store's per-group read; unknown chains give no rows.
        states = all_states(self.url)
        groups = sorted(states)[::7]
        top = max(states)
        wanted = groups + [top + 1000]

        def read_many() -> dict:
            got: dict = {}
            for g, k, e in query(self.url, full_state_sql(wanted)):
                got.setdefault(g, {})
                if k is not None:
                    got[g][k] = e
            return got

        self.assertEqual(read_many(), {g: states[g] for g in groups})
        # A group whose chain reaches a purged group: unknown, not a wrong state.
        victim = next(
            g
            for g in groups
            if query(self.url, "SELECT prev_state_group FROM state_groups WHERE state_group = ?", (g,))[0][0]
            is not None
        )
        execute(self.url, f"UPDATE state_groups SET prev_state_group = {top + 2000} WHERE state_group = {victim}")
        got = read_many()
        self.assertNotIn(victim, got)
        self.assertEqual({g: got[g] for g in got}, {g: states[g] for g in got})
        # The key filter: only the given keys, same values.
        group = max(groups, key=lambda g: len(states[g]))
        keys = sorted(states[group])[:3]
        rows = query(self.url, full_state_sql(keys=len(keys)), (group, *keys))
        self.assertEqual(fold_state(rows), {k: states[group][k] for k in keys})

    def test_writer_transactions_retry_through_the_shared_helper(self) -> None:
        # The writer has no retry loop of its own: storage.database.run_transaction
        # rolls an attempt back and runs it again (RetryTransaction here, as for
        # serialisation failures), and a failing body leaves nothing behind.
        writer = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(writer.close)
        attempts = []

        def body(cur):
            attempts.append(1)
            cur.execute(
                writer.db.sql("INSERT INTO maintenance_locks (lock_name, holder, acquired_ts) VALUES (?, ?, ?)"),
                ("retry_test", "me", len(attempts)),
            )
            if len(attempts) < 3:
                raise RetryTransaction()
            return "done"

        self.assertEqual(writer.db.run(body), "done")
        self.assertEqual(len(attempts), 3)
        self.assertEqual(
            query(self.url, "SELECT acquired_ts FROM maintenance_locks WHERE lock_name = 'retry_test'"), [(3,)]
        )

        def failing(cur):
            cur.execute(writer.db.sql("DELETE FROM maintenance_locks WHERE lock_name = ?"), ("retry_test",))
            raise ValueError("boom")

        with self.assertRaises(ValueError):
            writer.db.run(failing)
        self.assertEqual(len(query(self.url, "SELECT 1 FROM maintenance_locks WHERE lock_name = 'retry_test'")), 1)

    def test_a_large_staged_chunk_gets_fresh_statistics_on_postgres(self) -> None:
        # Staging a chunk of ANALYZE_STAGED_ROWS rows or more analyses the
        # staging tables on PostgreSQL (the swap's re-check was a nested loop
        # with a small chunk's statistics); on SQLite nothing changes. Either
        # way a real compaction afterwards swaps and verifies.
        from roomstore.compaction import roomstore_sql as rs_sql
        from roomstore.compaction.chunks import StagedChunk
        from roomstore.compaction.write_back import ANALYZE_STAGED_ROWS

        writer = roomstore_writer(self.url, heartbeat_s=0)
        try:
            writer.acquire_lock()
            run = writer.begin_run({"analyze": True})
            n = ANALYZE_STAGED_ROWS
            groups = [(10**12 + i, None, 1, 0, None, 0, 0) for i in range(n)]
            deltas = [(10**12 + i, 1, 1) for i in range(n)]
            writer.stage_chunk(run, StagedChunk(1, 10**12, 10**12 + n - 1, groups, [], deltas, 0, 0, 0))
            if self.engine_name == "postgres":
                for table in (rs_sql.STAGED_GROUPS, rs_sql.STAGED_DELTAS):
                    reltuples = query(self.url, "SELECT reltuples FROM pg_class WHERE relname = ?", (table,))[0][0]
                    self.assertGreaterEqual(reltuples, n, table)
            writer.finish_run(run)
        finally:
            writer.close()
        before = all_states(self.url)
        self.assertIn("written", reference_compaction(self.url).values())
        self.assertEqual(all_states(self.url), before)

    def test_chunked_plan_equals_whole_room_plan(self) -> None:
        # Boundary states make every predecessor resolvable, so chunking
        # changes memory, not the result.
        writer = roomstore_writer(self.url)
        self.addCleanup(writer.close)
        snapshot = writer.max_state_group()
        for room in room_nids(self.url):
            chunked = plan_room(writer, room, snapshot, 25)
            whole = plan_room(writer, room, snapshot, 0)
            self.assertEqual(len(whole), 1)
            self.assertEqual(sum(r.rows_after for r in chunked), whole[0].rows_after, f"room {room}")
            self.assertEqual([r.mismatched for r in chunked if r.mismatched], [])

    def test_swap_preserves_every_state_and_shrinks(self) -> None:
        before = all_states(self.url)
        rows_before = delta_rows(self.url)
        self.assertEqual(query(self.url, SOLE_DELTA_MISMATCHES_SQL), [])
        outcomes = reference_compaction(self.url)
        self.assertIn("written", outcomes.values())
        self.assertEqual(all_states(self.url), before)
        # Every rewritten group's copy of a one-row delta follows its new rows.
        self.assertEqual(query(self.url, SOLE_DELTA_MISMATCHES_SQL), [])
        self.assertLess(delta_rows(self.url), rows_before * 0.6)
        chain_lengths_are_depths(self, self.url)
        # Progress recorded, staging emptied, lock released, run finished.
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_compaction_rooms")[0][0], len(outcomes))
        self.assertGreater(query(self.url, "SELECT COUNT(*) FROM state_compaction_chunks")[0][0], len(outcomes))
        for table in ("state_compaction_staged_groups", "state_compaction_staged_deltas", "maintenance_locks"):
            self.assertEqual(query(self.url, f"SELECT COUNT(*) FROM {table}")[0][0], 0, table)
        self.assertEqual(
            query(self.url, "SELECT COUNT(*) FROM state_compaction_runs WHERE finished_ts IS NULL"), [(0,)]
        )
        # A second run finds nothing more to save.
        again = reference_compaction(self.url)
        self.assertNotIn("written", again.values())

    def _stage_first_changed_chunk(self):
        writer = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(writer.close)
        writer.acquire_lock()
        run = writer.begin_run({})
        for room in room_nids(self.url):
            for result in plan_room(writer, room, run.snapshot_max, CHUNK):
                if result.rewritten and len(result.groups) > 3:
                    writer.stage_chunk(run, result.to_staged(room))
                    return writer, run, room, result
        self.fail("no chunk to rewrite")

    def _swap(self, writer, run, room, result):
        return writer.swap_chunk(
            run, room, result.first_group, (result.last_group, result.rows_before, result.rows_after, result.rewritten)
        )

    def test_swap_skips_a_group_deleted_underneath(self) -> None:
        writer, run, room, result = self._stage_first_changed_chunk()
        victim = int(result.groups[len(result.groups) // 2][0])
        # A deletion that ignored the lock, between staging and swap.
        execute(
            self.url,
            f"DELETE FROM state_groups WHERE state_group = {victim}",
            f"DELETE FROM state_group_deltas WHERE state_group = {victim}",
        )
        stored = representation(self.url)
        swap = self._swap(writer, run, room, result)
        self.assertEqual(swap.status, "changed_underneath")
        self.assertIn(f"state group {victim} no longer exists", swap.detail)
        self.assertEqual(representation(self.url), stored)
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_compaction_chunks")[0][0], 0)

    def test_swap_skips_a_group_rewritten_underneath(self) -> None:
        writer, run, room, result = self._stage_first_changed_chunk()
        victim = next(int(g[0]) for g in result.groups if g[2] > 0)
        execute(self.url, f"UPDATE state_group_deltas SET event_nid = event_nid + 1 WHERE state_group = {victim}")
        stored = representation(self.url)
        swap = self._swap(writer, run, room, result)
        self.assertEqual(swap.status, "changed_underneath")
        self.assertIn(f"state group {victim} changed since it was read", swap.detail)
        self.assertEqual(representation(self.url), stored)

    def test_a_crash_inside_the_swap_changes_nothing(self) -> None:
        writer, run, room, result = self._stage_first_changed_chunk()
        groups_before = read_roomstore_room(self.url, room)
        stored = representation(self.url)

        def crash(cur, room_nid, first_group):
            raise KeyboardInterrupt("killed")

        writer.before_commit = crash
        with self.assertRaises(KeyboardInterrupt):
            self._swap(writer, run, room, result)
        self.assertEqual(representation(self.url), stored)
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_compaction_chunks")[0][0], 0)
        # The staged copy survived the rollback; a swap now goes through.
        writer.before_commit = None
        self.assertEqual(self._swap(writer, run, room, result).status, "swapped")
        self.assertNotEqual(representation(self.url), stored)
        self.assertEqual(verify(groups_before, read_roomstore_room(self.url, room)), [])

    def test_lock_is_exclusive_and_stale_locks_are_taken_over(self) -> None:
        first = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(first.close)
        first.acquire_lock()
        second = roomstore_writer(self.url, heartbeat_s=0, stale_after_s=60)
        self.addCleanup(second.close)
        with self.assertRaises(LockHeldError):
            second.acquire_lock()
        # The first job stops beating (it hangs or died on another host).
        old = int(time.time() * 1000) - 120_000
        execute(self.url, f"UPDATE maintenance_locks SET heartbeat_ts = {old}")
        with self.assertLogs("roomstore.compaction", "WARNING") as logs:
            second.acquire_lock()
        self.assertIn("is stale", logs.output[0])
        self.assertEqual(query(self.url, "SELECT holder FROM maintenance_locks"), [(second.holder,)])
        # The first job finds out at its next heartbeat or swap and stops.
        self.assertFalse(first.heartbeat())
        run = first.begin_run({})
        with self.assertRaises(LockLostError):
            first.swap_chunk(run, 1, 1, (1, 0, 0, 0))

    def test_lock_of_a_dead_process_on_this_host_is_taken_over(self) -> None:
        import socket

        holder = f"{socket.gethostname()}:{dead_pid()}:cafe"
        now = int(time.time() * 1000)
        execute(
            self.url,
            "INSERT INTO maintenance_locks (lock_name, holder, acquired_ts, heartbeat_ts)"
            f" VALUES ('{LOCK_NAME}', '{holder}', {now}, {now})",
        )
        writer = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(writer.close)
        with self.assertLogs("roomstore.compaction", "WARNING") as logs:
            writer.acquire_lock()
        self.assertIn("no longer running on this host", logs.output[0])

    def test_heartbeat_thread_keeps_the_lock_fresh(self) -> None:
        writer = roomstore_writer(self.url, heartbeat_s=0.05)
        self.addCleanup(writer.close)
        writer.acquire_lock()
        first = query(self.url, "SELECT heartbeat_ts FROM maintenance_locks")[0][0]
        deadline = time.monotonic() + 5
        while query(self.url, "SELECT heartbeat_ts FROM maintenance_locks")[0][0] == first:
            self.assertLess(time.monotonic(), deadline, "no heartbeat")
            time.sleep(0.05)
        writer.release_lock()
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM maintenance_locks")[0][0], 0)

    def test_resume_skips_done_work_and_stale_progress(self) -> None:
        writer = roomstore_writer(self.url, heartbeat_s=0)
        writer.acquire_lock()
        run = writer.begin_run({"levels": [100, 50, 25]})
        rooms = room_nids(self.url)
        # Room A: finished. Room B: two chunks swapped, then the job dies.
        big = [r for r in rooms if len([c for c in plan_room(writer, r, run.snapshot_max, CHUNK) if c.rewritten]) >= 3]
        room_a = rooms[0]
        room_b = [r for r in big if r != room_a][0]
        writer.record_room(run, RoomOutcome(room_a, "unchanged", 1, 1, 1, 0))
        chunks_b = [c for c in plan_room(writer, room_b, run.snapshot_max, CHUNK) if c.has_changes]
        for result in chunks_b[:2]:
            writer.stage_chunk(run, result.to_staged(room_b))
            self._swap(writer, run, room_b, result)
        writer.stage_chunk(run, chunks_b[2].to_staged(room_b))  # staged, never swapped
        writer.db.close()  # killed: no finish, no release
        # Meanwhile room A is purged, and so is the second swapped chunk of B.
        execute(self.url, f"DELETE FROM state_groups WHERE room_nid = {room_a}")
        gone = chunks_b[1]
        execute(self.url, f"DELETE FROM state_groups WHERE state_group = {gone.first_group}")
        # The next job: the lock's holder is this (live) process, so it waits
        # for the heartbeat to go stale.
        execute(self.url, "UPDATE maintenance_locks SET heartbeat_ts = 0")
        again = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(again.close)
        with self.assertLogs("roomstore.compaction", "WARNING"):
            again.acquire_lock()
        resumed = again.begin_run({"levels": [100, 50, 25]})
        self.assertTrue(resumed.resumed)
        self.assertEqual((resumed.run_id, resumed.snapshot_max), (run.run_id, run.snapshot_max))
        self.assertEqual(resumed.done_rooms, {})
        self.assertEqual(list(resumed.done_chunks), [(room_b, chunks_b[0].first_group)])
        text = "\n".join(resumed.warnings)
        self.assertIn(f"lists room {room_a} as done", text)
        self.assertIn(f"groups {gone.first_group}..{gone.last_group} of room {room_b}", text)
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_compaction_staged_groups")[0][0], 0)


@on_both_engines
class SoleDeltaCopyTests:
    """``state_groups.sole_*`` (schema version 6) as the persister writes it,
    and the job refusing a schema newer than it knows."""

    timeout = 300

    async def test_persisted_groups_copy_exactly_their_one_row_deltas(self):
        url = await compaction_database(self, "one_room")
        self.assertEqual(query(url, SOLE_DELTA_MISMATCHES_SQL), [])
        copied, groups = query(url, "SELECT COUNT(sole_type_key_nid), COUNT(*) FROM state_groups")[0]
        self.assertGreater(copied, groups // 2)
        all_states(url)  # the store's read equals the rows' for every group

    async def test_the_job_refuses_a_newer_schema(self):
        url = await compaction_database(self, "one_room")
        writer = roomstore_writer(url)
        self.addCleanup(writer.close)
        self.assertEqual(writer.check_schema(), SCHEMA_VERSION)
        execute(url, f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}")
        with self.assertRaises(SchemaTooNewError) as caught:
            writer.check_schema()
        self.assertIn(f"version {SCHEMA_VERSION + 1}, newer than", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))


@on_both_engines
class DeleteStateGroupsTests:
    timeout = 300

    async def setUp(self):
        self.url = await compaction_database(self, "one_room")
        self.store = await RoomStore.open(self.url, StoreConfig(max_state_chain_length=CHAIN))
        self.addCleanup(self.store.close)

    def _middle_group(self) -> tuple[int, list[int]]:
        rows = query(
            self.url,
            "SELECT p.state_group FROM state_groups p JOIN state_groups c ON c.prev_state_group = p.state_group"
            " ORDER BY p.state_group",
        )
        group = rows[len(rows) // 2][0]
        children = [
            r[0] for r in query(self.url, "SELECT state_group FROM state_groups WHERE prev_state_group = ?", (group,))
        ]
        return group, children

    async def test_waits_while_the_compaction_lock_is_held(self):
        group, children = self._middle_group()
        states = all_states(self.url)
        writer = roomstore_writer(self.url, heartbeat_s=0)
        self.addCleanup(writer.close)
        writer.acquire_lock()
        captured = _LogCapture(self)
        deleting = defer.ensureDeferred(self.store.delete_state_groups([group], poll_interval_s=0.05))
        await deferLater(reactor, 0.5, lambda: None)
        self.assertFalse(deleting.called, "deleted while the compaction lock was held")
        self.assertIn("waiting for state compaction", captured.text())
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_groups WHERE state_group = ?", (group,)), [(1,)])
        writer.release_lock()
        self.assertEqual(await deleting, 1)
        self.assertEqual(query(self.url, "SELECT COUNT(*) FROM state_groups WHERE state_group = ?", (group,)), [(0,)])
        # The children were re-based as snapshots: every other state is intact.
        after = all_states(self.url)
        self.assertEqual(query(self.url, SOLE_DELTA_MISMATCHES_SQL), [])
        del states[group]
        self.assertEqual(after, states)
        for child in children:
            self.assertEqual(
                query(
                    self.url, "SELECT prev_state_group, chain_length FROM state_groups WHERE state_group = ?", (child,)
                ),
                [(None, 0)],
            )

    async def test_a_stale_lock_is_ignored_with_a_warning(self):
        group, _ = self._middle_group()
        old = int(time.time() * 1000) - 3_600_000
        execute(
            self.url,
            "INSERT INTO maintenance_locks (lock_name, holder, acquired_ts, heartbeat_ts)"
            f" VALUES ('{LOCK_NAME}', 'elsewhere:1:x', {old}, {old})",
        )
        captured = _LogCapture(self)
        self.assertEqual(await self.store.delete_state_groups([group], lock_timeout_s=60), 1)
        self.assertIn("ignoring stale state compaction lock held by elsewhere:1:x", captured.text())

    async def test_nothing_to_delete(self):
        self.assertEqual(await self.store.delete_state_groups([]), 0)
        self.assertEqual(await self.store.delete_state_groups([10**9]), 0)


class RoomCompactorTests(TestCase):
    def test_a_corrupted_plan_fails_verification(self) -> None:
        directory = tempfile.mkdtemp(prefix="roomstore-compactor-")
        url = f"sqlite:///{directory}/t.db"
        from bench.dataset import prepare_roomstore_schema

        prepare_roomstore_schema(url)
        load_dataset("tiny", roomstore_url=url, max_chain_length=8)
        writer = roomstore_writer(url)
        self.addCleanup(writer.close)
        room = room_nids(url)[-1]
        good = plan_room(writer, room, 10**9, 100)
        bad = plan_room(writer, room, 10**9, 100, fault=True)
        self.assertEqual([m for r in good for m in r.mismatched], [])
        mismatched = [m for r in bad for m in r.mismatched]
        self.assertTrue(mismatched)
        # The other chunks (planned after the fault) still verify.
        self.assertEqual(sum(1 for r in bad if r.mismatched), 1)
        # And verify() agrees with the room as stored.
        self.assertEqual(verify(read_roomstore_room(url, room), read_roomstore_room(url, room)), [])


@on_both_engines
class RoomSelectionTests:
    timeout = 300

    async def test_rooms_option(self):
        from roomstore.compaction.job.driver import Driver
        from roomstore.compaction.job.options import job_parser

        url = await compaction_database(self)
        writer = roomstore_writer(url)
        self.addCleanup(writer.close)
        run = writer.begin_run({}, dry_run=True)
        counts = dict(query(url, "SELECT room_nid, COUNT(*) FROM state_groups GROUP BY room_nid"))
        biggest = sorted(counts, key=lambda r: (-counts[r], r))[:2]

        def selected(spec):
            args = ["--db", url] + (["--rooms", spec] if spec else [])
            driver = Driver(job_parser().parse_args(args))
            driver.writer, driver.run = writer, run
            where = driver.room_filter()
            if where is None:
                return None
            lo, hi, n = writer.group_bounds(run.snapshot_max, where.format(col="room_nid"))
            return n, driver.warnings

        self.assertEqual(selected(None), (sum(counts.values()), []))
        self.assertEqual(selected("largest:2"), (sum(counts[r] for r in biggest), []))
        busy = query(url, "SELECT room_nid FROM rooms WHERE room_id = '!busy0:example.org'")[0][0]
        with self.assertLogs("roomstore.compaction", "WARNING"):
            n, warnings = selected("!busy0:example.org, !nowhere:example.org")
        self.assertEqual(n, counts[busy])
        self.assertEqual(warnings, ["room !nowhere:example.org is not in the database: skipped"])
        with self.assertLogs("roomstore.compaction", "WARNING"):
            self.assertIsNone(selected("!nowhere:example.org"))
