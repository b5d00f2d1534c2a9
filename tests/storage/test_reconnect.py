"""Lost database connections: the backoff and outage bookkeeping with a Clock,
and the pool, the commit check and the writer lock on a real PostgreSQL whose
backends are terminated (``pg_terminate_backend``). The whole server
restarting, under load, is ``tests/test_db_restarts.py``."""

from __future__ import annotations

import psycopg2
from twisted.internet import defer, task
from twisted.logger import globalLogPublisher
from twisted.trial import unittest

from roomstore.storage import Database, DatabaseUnavailableError
from roomstore.storage.reconnect import Backoff, ConnectionLost, Outages
from roomstore.storage.writer_lock import WriterLock, WriterLockLost, writer_lock_key
from tests.db import DatabaseTestMixin, pg_admin


class _Logged:
    """Log events of one namespace prefix, formatted."""

    def __init__(self, test, prefix: str) -> None:
        self.events: list[dict] = []
        self.prefix = prefix
        globalLogPublisher.addObserver(self)
        test.addCleanup(globalLogPublisher.removeObserver, self)

    def __call__(self, event: dict) -> None:
        if event.get("log_namespace", "").startswith(self.prefix):
            self.events.append(event)

    def levels(self) -> list[str]:
        return [e["log_level"].name for e in self.events]


def _lost(generation: int = 0) -> ConnectionLost:
    return ConnectionLost(psycopg2.OperationalError("server closed the connection\nunexpectedly"), generation)


class BackoffTest(unittest.TestCase):
    def test_doubles_up_to_the_maximum(self):
        backoff = Backoff(initial_s=0.05, factor=2.0, maximum_s=2.0)
        self.assertEqual([backoff.delay(n) for n in range(1, 9)], [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])


class OutagesTest(unittest.TestCase):
    def setUp(self):
        self.clock = task.Clock()
        self.logged = _Logged(self, "roomstore.storage.reconnect")
        self.outages = Outages(self.clock, "postgresql://db:5432/x", Backoff(0.1, 2.0, 1.0), give_up_after_s=10.0)

    def test_one_warning_per_outage_whatever_the_losses(self):
        # Three interactions lose their connections, and try again.
        delays = [self.outages.lost(_lost(), attempt) for attempt in (1, 1, 1, 2, 3)]
        self.assertEqual(delays, [0.1, 0.1, 0.1, 0.2, 0.4])
        self.assertEqual(self.logged.levels(), ["warn"])
        message = self.logged.events[0]
        self.assertIn(
            "lost the database connection (server closed the connection unexpectedly)",
            message["log_format"].format(**message),
        )
        self.assertEqual(self.outages.generation, 1)
        self.clock.advance(2.5)
        ended = []
        self.outages.on_end.append(lambda: ended.append(self.clock.seconds()))
        self.outages.committed()
        self.outages.committed()  # nothing more: the outage is over
        self.assertEqual(ended, [2.5])
        self.assertEqual(self.logged.levels(), ["warn", "info"])
        self.assertEqual(self.outages.survived, 1)

    def test_a_connection_from_before_an_ended_outage_retries_at_once_silently(self):
        self.outages.lost(_lost(0), 1)
        self.outages.committed()
        self.assertEqual(self.outages.lost(_lost(0), 1), 0.0)
        self.assertEqual(self.logged.levels(), ["warn", "info"])
        # A connection of the current generation dying is a new outage.
        self.outages.lost(_lost(1), 1)
        self.assertEqual(self.logged.levels(), ["warn", "info", "warn"])
        self.assertEqual(self.outages.generation, 2)

    def test_a_commit_in_doubt_after_its_outage_waits_silently(self):
        # A commit's outcome is checked after the outage ended, and its old
        # session is still ending: no new outage, the backoff's pause.
        self.outages.lost(_lost(0), 1)
        self.outages.committed()
        still_ending = ConnectionLost(RuntimeError("transaction 7 still in progress"), 0, ("7", None))
        self.assertEqual(self.outages.lost(still_ending, 2), 0.2)
        self.assertEqual(self.logged.levels(), ["warn", "info"])
        self.assertEqual((self.outages.generation, self.outages.in_outage), (1, False))

    def test_gives_up_after_the_limit_in_one_line(self):
        self.outages.lost(_lost(), 1)
        self.clock.advance(9.9)
        self.assertEqual(self.outages.lost(_lost(), 2), 0.2)
        self.clock.advance(0.1)
        with self.assertRaises(DatabaseUnavailableError) as raised:
            self.outages.lost(_lost(), 3)
        self.assertEqual(len(str(raised.exception).splitlines()), 1)
        self.assertIn("unreachable for 10 s", str(raised.exception))


async def _until(predicate, seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("condition not reached")


class PoolReconnectTest(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"

    async def _pool(self) -> tuple[Database, task.Clock]:
        url = self.new_database_url()
        clock = task.Clock()
        from roomstore.storage.engines import engine_from_url

        db = Database(
            engine_from_url(url + "?cp_max=1"), clock=clock, backoff=Backoff(0.5, 2.0, 4.0), give_up_after_s=30.0
        )
        self.addCleanup(db.close)
        await db.prepare()
        return db, clock

    async def test_terminated_backend_waits_on_the_clock_then_commits_once(self):
        db, clock = await self._pool()
        await db.run_interaction("t", lambda txn: txn.execute("CREATE TABLE once (x INT)"))
        pid = await db.run_interaction("pid", lambda txn: txn.execute("SELECT pg_backend_pid()").fetchone()[0])
        self.assertEqual(pg_admin("SELECT pg_terminate_backend(%s)", (pid,)), [(True,)])
        runs = []

        def write(txn):
            runs.append(1)
            txn.execute("INSERT INTO once VALUES (1)")
            return "done"

        d = defer.ensureDeferred(db.run_interaction("write", write))
        # The dead connection is found, and the retry waits on the clock.
        await _until(lambda: clock.getDelayedCalls())
        self.assertFalse(d.called)
        self.assertEqual([c.getTime() for c in clock.getDelayedCalls()], [0.5])
        clock.advance(0.5)
        self.assertEqual(await d, "done")
        self.assertEqual(runs, [1, 1])  # the first attempt died before COMMIT: nothing written
        self.assertEqual(
            await db.run_interaction("n", lambda txn: txn.select_one_value("SELECT COUNT(*) FROM once")), 1
        )
        self.assertEqual(db.outages.survived, 1)

    async def test_commit_lost_is_settled_by_the_server_before_running_again(self):
        db, clock = await self._pool()
        await db.run_interaction("t", lambda txn: txn.execute("CREATE TABLE settled (x INT)"))
        runs = []

        def write(txn):
            runs.append(txn)
            txn.queue("INSERT INTO settled VALUES (1)")
            if len(runs) == 1:
                # The session dies after the write, as COMMIT would be sent:
                # the server rolled it back, so it runs again.
                txn.finish()
                pid = txn.select_one_value("SELECT pg_backend_pid()")
                pg_admin("SELECT pg_terminate_backend(%s)", (pid,))
            return len(runs)

        d = defer.ensureDeferred(db.run_interaction("write", write))
        await _until(lambda: clock.getDelayedCalls())
        clock.advance(0.5)
        self.assertEqual(await d, 2)
        self.assertIsNotNone(runs[0].xid)
        self.assertEqual(
            await db.run_interaction("n", lambda txn: txn.select_one_value("SELECT COUNT(*) FROM settled")), 1
        )

    async def test_commit_that_happened_is_never_run_again(self):
        # The server commits, and the answer is lost with the connection (cut
        # here by closing it right after COMMIT): the pool asks the server,
        # which says committed, and returns the first attempt's result.
        db, clock = await self._pool()
        await db.run_interaction("t", lambda txn: txn.execute("CREATE TABLE twice (x INT)"))
        real_get = db._get_connection
        cut = []

        class CutAfterCommit:
            def __init__(self, conn):
                self._conn = conn

            def __getattr__(self, name):
                return getattr(self._conn, name)

            def commit(self):
                self._conn.commit()
                if not cut:
                    cut.append(1)
                    self._conn.close()
                    raise psycopg2.OperationalError("server closed the connection unexpectedly")

        self.patch(db, "_get_connection", lambda: CutAfterCommit(real_get()))
        runs, after = [], []

        def write(txn):
            runs.append(1)
            txn.execute("INSERT INTO twice VALUES (1)")
            txn.call_after(after.append, "committed")
            return "first"

        d = defer.ensureDeferred(db.run_interaction("write", write))
        await _until(lambda: clock.getDelayedCalls())
        clock.advance(0.5)
        self.assertEqual(await d, "first")
        self.assertEqual((runs, after), ([1], ["committed"]))
        self.assertEqual(
            await db.run_interaction("n", lambda txn: txn.select_one_value("SELECT COUNT(*) FROM twice")), 1
        )

    async def test_commit_status_of_a_transaction(self):
        db, _ = await self._pool()
        await db.run_interaction("t", lambda txn: txn.execute("CREATE TABLE st (x INT)"))
        seen = {}

        def write(txn):
            txn.queue("INSERT INTO st VALUES (?)", (1,))
            txn.finish()
            seen["xid"] = txn.xid
            seen["read_xid"] = None

        await db.run_interaction("w", write)

        def read(txn):
            txn.execute("SELECT COUNT(*) FROM st")
            txn.finish()
            return txn.xid

        self.assertIsNone(await db.run_interaction("r", read))  # wrote nothing: nothing to settle
        engine = db.engine

        def status(txn, xid):
            return engine.transaction_status(txn._cursor, xid)

        self.assertEqual(await db.run_interaction("s", status, seen["xid"]), "committed")

        def aborted(txn):
            txn.execute("INSERT INTO st VALUES (2)")
            txn.finish()
            seen["aborted"] = txn.xid
            raise ValueError("roll back")

        with self.assertRaises(ValueError):
            await db.run_interaction("a", aborted)
        self.assertEqual(await db.run_interaction("s", status, seen["aborted"]), "aborted")
        future = str(int(seen["xid"]) + 10_000_000)
        self.assertEqual(await db.run_interaction("s", status, future), "aborted")


class WriterLockReconnectTest(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"

    async def _locked(self) -> tuple[Database, WriterLock, task.Clock]:
        db = await self.make_database()
        clock = task.Clock()
        lock = await WriterLock.acquire(db, "w9")
        self.addCleanup(lock.release)
        lock.watch(clock, interval_s=1.0)
        return db, lock, clock

    def _lock_pid(self, db) -> list:
        classid, objid = writer_lock_key("w9")
        return [
            pid
            for (pid,) in pg_admin(
                "SELECT l.pid FROM pg_locks AS l JOIN pg_database AS d ON d.oid = l.database"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid AND l.objid = %s::oid"
                " AND d.datname = %s",
                (classid & 0xFFFFFFFF, objid & 0xFFFFFFFF, db.engine.dsn.rsplit("/", 1)[1]),
            )
        ]

    async def test_taken_again_after_its_session_is_terminated(self):
        logged = _Logged(self, "roomstore.storage.writer_lock")
        db, lock, clock = await self._locked()
        (pid,) = self._lock_pid(db)
        pg_admin("SELECT pg_terminate_backend(%s)", (pid,))
        await _until(lambda: not self._lock_pid(db))
        clock.advance(1.0)  # the periodic check
        await _until(lambda: lock.retaken == 1)
        self.assertEqual(len(self._lock_pid(db)), 1)
        self.assertNotEqual(self._lock_pid(db), [pid])
        self.assertEqual(logged.levels(), ["warn"])
        self.assertFalse(lock.lost.called)

    async def test_stops_when_another_process_took_it_meanwhile(self):
        logged = _Logged(self, "roomstore.storage.writer_lock")
        db, lock, clock = await self._locked()
        (pid,) = self._lock_pid(db)
        pg_admin("SELECT pg_terminate_backend(%s)", (pid,))
        await _until(lambda: not self._lock_pid(db))
        other = psycopg2.connect(db.engine.dsn, application_name="roomstore-writer 4242@otherhost")
        self.addCleanup(other.close)
        other.autocommit = True
        with other.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s, %s)", writer_lock_key("w9"))
            self.assertTrue(cur.fetchone()[0])
        clock.advance(1.0)
        error = await lock.lost
        self.assertIsInstance(error, WriterLockLost)
        self.assertIn("pid 4242 on otherhost", str(error))
        self.assertEqual(len(str(error).splitlines()), 1)
        self.assertEqual(logged.levels(), ["error"])

    async def test_release_waits_for_a_check_in_progress(self):
        """A store closing while a periodic check runs (seen in a full run:
        the check and the release used the lock's session from two threads,
        the check "took it again" and then met a closed pool): the release
        waits for the check, then lets go; nothing is retaken or logged."""
        logged = _Logged(self, "roomstore.storage.writer_lock")
        db, lock, clock = await self._locked()
        for _ in range(20):
            clock.advance(1.0)  # a check starts, on a pool thread
            await lock.release()  # at once, as RoomStore.close does
            self.assertEqual((lock.retaken, self._lock_pid(db)), (0, []))
            lock = await WriterLock.acquire(db, "w9")
            self.addCleanup(lock.release)
            lock.watch(clock, interval_s=1.0)
        self.assertEqual(logged.levels(), [])
