"""One live process per writer instance (``roomstore.storage.writer_lock``), both engines.

In process: a second claim of a held instance is refused with one line naming
the instance and the holder, and succeeds once the first lets go. Across real
processes: with a writer store open in one process, ``roomstore import`` into
the same database in another ends in that one-line error having written
nothing, the read commands keep working, and the first process carries on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.demo.sample import write_sample
from roomstore.storage.writer_lock import WriterLock, WriterLockHeld
from roomstore.store import RoomStore, StoreConfig
from tests.db import DatabaseTestMixin, on_both_engines
from tests.test_cli import ROOT, run_cli


def read_until(stream, prefix: str) -> str:
    """The first line starting with ``prefix`` (import reports precede it), or "" at EOF."""
    for line in stream:
        if line.startswith(prefix):
            return line
    return ""


@on_both_engines
class WriterLockTests:
    async def test_second_claim_refused_until_released(self):
        url = self.new_database_url()
        first = await self.make_database(url)
        second = await self.make_database(url, prepare=False)
        lock = await WriterLock.acquire(first, "master")
        with self.assertRaises(WriterLockHeld) as caught:
            await WriterLock.acquire(second, "master")
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        self.assertIn("writer instance 'master' is already running", message)
        self.assertIn(f"pid {os.getpid()}", message)
        await lock.release()
        again = await WriterLock.acquire(second, "master")
        await again.release()

    async def test_store_takes_the_lock_and_read_only_does_not(self):
        url = self.new_database_url()
        writer = await RoomStore.open(url)
        self.addCleanup(writer.close)
        with self.assertRaises(WriterLockHeld):
            await RoomStore.open(url)
        reader = await RoomStore.open(url, StoreConfig(read_only=True))
        self.assertFalse(reader.events_stream.is_writer)
        await reader.close()
        # A worker (not a writer of any stream) takes no lock either.
        worker = await RoomStore.open(
            url, StoreConfig(instance_name="worker1", stream_writers={s: ["master"] for s in writer.generators})
        )
        await worker.close()
        await writer.close()
        reopened = await RoomStore.open(url)
        await reopened.close()

    async def test_import_beside_a_live_writer_process_is_refused(self):
        url = self.new_database_url()
        directory = tempfile.mkdtemp(prefix="roomstore-lock-")
        sample = os.path.join(directory, "sample.jsonl")
        total = write_sample(sample, rooms=2, events_per_room=60, seed=3)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        errors = open(os.path.join(directory, "holder.err"), "w+")
        self.addCleanup(errors.close)
        holder = subprocess.Popen(
            [sys.executable, "-m", "tests.store.holding_writer", url, sample],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
        self.addCleanup(lambda: holder.poll() is None and holder.kill())
        ready = await threads.deferToThread(read_until, holder.stdout, "READY ")
        self.assertTrue(ready.startswith("READY "), open(errors.name).read())
        first_half = json.loads(ready[6:])

        code, out, err = await threads.deferToThread(run_cli, "import", sample, "--db", url)
        self.assertEqual(code, 2, err)
        self.assertEqual(out, [])
        lines = err.strip().splitlines()
        self.assertEqual(len(lines), 1, err)
        self.assertIn("writer instance 'master' is already running", lines[0])
        self.assertIn(f"pid {holder.pid}", lines[0])

        # Read-only commands work beside the writer; nothing was written.
        code, out, err = await threads.deferToThread(run_cli, "stats", "--db", url)
        self.assertEqual(code, 0, err)
        events_before = next(row["rows"] for row in out if row["table"] == "events")
        self.assertEqual(events_before, first_half["imported"])

        # The first process carries on and imports the rest without error.
        holder.stdin.write("go\n")
        holder.stdin.flush()
        done = await threads.deferToThread(read_until, holder.stdout, "DONE ")
        self.assertTrue(done.startswith("DONE "), done + open(errors.name).read())
        summary = json.loads(done[5:])
        self.assertEqual(await threads.deferToThread(holder.wait), 0)
        code, out, err = await threads.deferToThread(run_cli, "stats", "--db", url)
        self.assertEqual(
            next(row["rows"] for row in out if row["table"] == "events"), first_half["imported"] + summary["imported"]
        )
        self.assertEqual(first_half["imported"] + summary["imported"] + first_half["failed"] + summary["failed"], total)

        # With the writer gone, import works again (everything already there).
        code, out, err = await threads.deferToThread(run_cli, "import", sample, "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual(out[-1]["imported"], 0)


@on_both_engines
class MultiWriterRefusalTests:
    """Multi-writer configurations without Redis, or on SQLite, stop with one line."""

    async def test_refused_clearly(self):
        url = self.new_database_url()
        sample = os.path.join(tempfile.mkdtemp(prefix="roomstore-mw-"), "s.jsonl")
        write_sample(sample, rooms=1, events_per_room=5, seed=1)
        writers = ["--instance", "w1", "--stream-writers", "events=w1,w2"]
        code, out, err = await threads.deferToThread(run_cli, "import", sample, "--db", url, *writers)
        self.assertEqual(code, 2, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("needs PostgreSQL and --redis", err)
        if self.engine_name == "sqlite":
            code, out, err = await threads.deferToThread(
                run_cli, "import", sample, "--db", url, "--redis", "redis://127.0.0.1:1", *writers
            )
            self.assertEqual(code, 2, err)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertIn("multi-writer stream needs PostgreSQL", err)
        code, out, err = await threads.deferToThread(run_cli, "init", "--db", url)  # read commands create nothing
        self.assertEqual(code, 0, err)
        code, out, err = await threads.deferToThread(run_cli, "stats", "--db", url, *writers)
        # Reading a multi-writer PostgreSQL database is fine; SQLite has none.
        self.assertEqual(code, 0 if self.engine_name == "postgres" else 2, err)
        code, out, err = await threads.deferToThread(run_cli, "follow", "--db", url, "--name", "x")
        self.assertEqual(code, 2, err)
        self.assertIn("--server HOST:PORT (TCP) or --redis URL", err)


class WriterLockPerDatabaseTests(DatabaseTestMixin, unittest.TestCase):
    """Advisory locks are per database: the refusal names this database's
    holder, never a process holding the same instance name elsewhere (the
    lookup once did, whenever the server listed the other lock first)."""

    engine_name = "postgres"

    async def test_holder_named_is_this_databases(self):
        elsewhere = self.new_database_url()
        directory = tempfile.mkdtemp(prefix="roomstore-lockdb-")
        sample = os.path.join(directory, "sample.jsonl")
        write_sample(sample, rooms=1, events_per_room=5, seed=2)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        holders = []
        for _ in range(3):  # several other holders of "master", in other databases
            url = self.new_database_url()
            holder = subprocess.Popen(
                [sys.executable, "-m", "tests.store.holding_writer", url, sample],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            self.addCleanup(lambda h=holder: h.poll() is None and (h.kill(), h.wait()))
            holders.append(holder)
        for holder in holders:
            self.assertTrue((await threads.deferToThread(read_until, holder.stdout, "READY ")).startswith("READY"))
        first = await self.make_database(elsewhere)
        second = await self.make_database(elsewhere, prepare=False)
        lock = await WriterLock.acquire(first, "master")
        self.addCleanup(lock.release)
        for _ in range(5):
            with self.assertRaises(WriterLockHeld) as caught:
                await WriterLock.acquire(second, "master")
            self.assertIn(f"(pid {os.getpid()} on", str(caught.exception))

    async def test_waits_for_the_session_of_a_holder_killed_a_moment_ago(self):
        """A writer restarted right after a SIGKILL can find the server still
        ending its predecessor's session; the claim waits for it (the holder's
        pid on this host is dead) instead of refusing. A live holder is still
        refused at once (``test_second_claim_refused_until_released``)."""
        import socket
        import threading
        import time

        import psycopg2

        from roomstore.storage import writer_lock

        url = self.new_database_url()
        db = await self.make_database(url)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()

        def session_of_the_dead_process():
            """A session holding 'master' whose application_name names ``gone``."""
            conn = psycopg2.connect(url, application_name=f"roomstore-writer {gone.pid}@{socket.gethostname()}")
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_lock(%s, %s)", writer_lock.writer_lock_key("master"))
            return conn

        dead_holder = session_of_the_dead_process()

        def end_session_later():
            time.sleep(0.5)
            dead_holder.close()  # what the server does once it notices the client is gone

        ender = threading.Thread(target=end_session_later)
        started = time.monotonic()
        ender.start()
        try:
            lock = await WriterLock.acquire(db, "master")
        finally:
            ender.join()
        self.assertGreaterEqual(time.monotonic() - started, 0.4)
        await lock.release()

        # Not for ever: a session of a dead holder that never ends is refused
        # after the wait, naming it.
        stuck = session_of_the_dead_process()
        self.addCleanup(stuck.close)
        self.patch(writer_lock, "DEAD_HOLDER_WAIT_S", 0.3)
        with self.assertRaises(WriterLockHeld) as caught:
            await WriterLock.acquire(db, "master")
        self.assertIn(f"pid {gone.pid} on", str(caught.exception))
