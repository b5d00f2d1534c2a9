"""PostgreSQL restarted and its backends terminated under continuous writes
(issue 24 item 1), with real processes on a PostgreSQL of the test's own.

``serve --redis`` writes as ``w1`` (an idle writer moved up by ``w2``'s
positions, which it persists, holding its writer lock), one long ``import
--redis`` writes as ``w2``, two ``follow`` workers apply what they hear, and
read commands run in a loop. Meanwhile the server is restarted (``pg_ctl
restart -m immediate``) and every backend terminated (``pg_terminate_backend``),
``FAULTS`` times in all, taking turns. At the end:

- every event of the file is stored exactly once (lost 0, duplicated 0);
- every follower applied every event row of ``w2`` exactly once;
- ``w2``'s persisted position reaches its newest row, ``w1``'s too (moved up);
- the writers never exited (the import exits 0 with everything imported,
  ``serve`` is still running) and took their writer locks again;
- each read command printed its answer, or failed with one line on stderr.

Prints: restarts survived, events written, lost, duplicated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse

from twisted.trial import unittest

from roomstore.replication.store_streams import STORE_STREAMS
from tests.db import pg_query
from tests.replication.redis_utils import RedisServer
from tests.replication.store_utils import reap
from tests.replication.test_redis_processes import write_chunks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = int(os.environ.get("ROOMSTORE_DB_FAULTS", "10"))
CHUNKS = int(os.environ.get("ROOMSTORE_DB_FAULT_CHUNKS", "300"))
WRITERS = ("w1", "w2")
CHANNEL = "dbfaults.example"
W_ARGS = [arg for name in STORE_STREAMS for arg in ("--stream-writers", f"{name}={','.join(WRITERS)}")]


def _pg_bindir() -> str:
    for version in sorted(os.listdir("/usr/lib/postgresql"), reverse=True):
        path = f"/usr/lib/postgresql/{version}/bin"
        if os.path.exists(f"{path}/pg_ctl"):
            return path
    raise RuntimeError("no pg_ctl")


class OwnPostgres:
    """A PostgreSQL of this test's own (``bin/pg-test-server``), which it may restart."""

    def __init__(self, test) -> None:
        out = subprocess.run(
            [os.path.join(REPO, "bin", "pg-test-server"), "start"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            check=True,
            timeout=120,
        )
        self.admin_url, self.dir = out.stdout.decode().split()
        test.addCleanup(
            subprocess.run,
            [os.path.join(REPO, "bin", "pg-test-server"), "stop", self.dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
        # bin/pg-test-server runs with fsync and synchronous_commit off: a
        # crash there loses commits it acknowledged. Durable, as a deployment is.
        port = urllib.parse.urlsplit(self.admin_url).port
        self._pg_ctl("-m fast -w stop")
        self._pg_ctl(
            f"-w -t 60 -o \"-k '{self.dir}' -p {port} -c listen_addresses=127.0.0.1 -c max_connections=200\" start"
        )

    def _pg_ctl(self, args: str) -> None:
        command = f"'{_pg_bindir()}/pg_ctl' -D '{self.dir}/data' -l '{self.dir}/server.log' {args}"
        argv = ["su", "-s", "/bin/sh", "postgres", "-c", command] if os.getuid() == 0 else ["sh", "-c", command]
        subprocess.run(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            check=True,
            timeout=120,
        )

    def database_url(self, name: str) -> str:
        self.admin(f'CREATE DATABASE "{name}"')
        parsed = urllib.parse.urlsplit(self.admin_url)
        return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, "/" + name, "", ""))

    def admin(self, sql: str, args: tuple = ()) -> list:
        return pg_query(self.admin_url, sql, args)

    def query(self, url: str, sql: str) -> list:
        return pg_query(url, sql)

    def restart(self) -> None:
        """``pg_ctl restart -m immediate``: every process of the server killed, crash recovery at start."""
        self._pg_ctl("-m immediate -w -t 60 restart")

    def terminate_all(self) -> int:
        """``pg_terminate_backend`` of every client backend but this one; how many."""
        rows = self.admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        return len(rows)


class DatabaseRestartsTest(unittest.TestCase):
    timeout = 900

    def test_restarts_and_terminations_under_writes(self):
        pg = OwnPostgres(self)
        url = pg.database_url("faults")
        redis = RedisServer(self)
        redis.start()
        directory = tempfile.mkdtemp(prefix="roomstore-dbfaults-")
        base, chunk_files = write_chunks(directory, chunks=CHUNKS)
        big = os.path.join(directory, "w2-all.jsonl")
        with open(big, "w") as out:
            for path in chunk_files["w2"]:
                out.write(open(path).read())
        expected_ids = set()
        for path in (base, big):
            for line in open(path):
                from roomstore.events.write.batch import EventToPersist, prepare_events

                record = json.loads(line)
                raw = json.dumps(record["event"]).encode()
                expected_ids.add(prepare_events([EventToPersist(raw, record["room_version"])], {})[0].event_id)

        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        processes: list[subprocess.Popen] = []
        self.addCleanup(reap, processes)

        def spawn(argv: list[str], name: str) -> tuple[subprocess.Popen, str]:
            out = os.path.join(directory, name)
            with open(out, "wb") as stdout, open(out + ".err", "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "roomstore.cli", *argv], stdout=stdout, stderr=stderr, env=env
                )
            processes.append(proc)
            return proc, out

        common = ["--db", url, "--redis", redis.url, "--server-name", CHANNEL, *W_ARGS]

        def wait(proc: subprocess.Popen, seconds: float, what: str) -> None:
            try:
                proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                self.fail(f"{what} still running after {seconds} s")

        def wait_for(predicate, seconds: float, what: str) -> None:
            deadline = time.monotonic() + seconds
            while not predicate():
                if time.monotonic() > deadline:
                    self.fail(f"timed out waiting for {what}")
                time.sleep(0.2)

        # The rooms, written by w2 before anyone follows.
        proc, out = spawn(["import", base, "--instance", "w2", *common], "base.out")
        wait(proc, 120, "the base import")
        self.assertEqual(proc.returncode, 0, open(out + ".err").read())
        base_top = pg.query(url, "SELECT MAX(stream_ordering) FROM events")[0][0]

        serve, serve_out = spawn(["serve", "--instance", "w1", "--replication-port", "0", "-v", *common], "serve.out")
        wait_for(lambda: os.path.getsize(serve_out) > 0 or serve.poll() is not None, 60, "serve to start")
        self.assertIsNone(serve.poll(), open(serve_out + ".err").read())
        followers = {}
        for name in ("f1", "f2"):
            followers[name] = spawn(["follow", "--name", name, *common], f"{name}.out")
        for name, (proc, out) in followers.items():
            wait_for(lambda: os.path.getsize(out) > 0 or proc.poll() is not None, 60, f"{name} to start")
            self.assertIsNone(proc.poll(), open(out + ".err").read())

        importer, import_out = spawn(["import", big, "--instance", "w2", "--batch-size", "5", *common], "w2.out")
        # The faults start once the import is writing.
        wait_for(
            lambda: (
                pg.query(url, "SELECT MAX(stream_ordering) FROM events")[0][0] > base_top or importer.poll() is not None
            ),
            120,
            "the import to write",
        )

        reads = {"ok": 0, "one_line_errors": 0}
        read_failures: list[str] = []
        reader: tuple[subprocess.Popen, str] | None = None
        read_commands = [
            ["stats"],
            ["sync", "--user", "@alice:example.org", "--limit", "3"],
            ["messages", "!e2e0:example.org", "--user", "@alice:example.org", "--limit", "5"],
        ]

        def poll_reader(block: bool = False) -> None:
            nonlocal reader
            if reader is None:
                return
            proc, out = reader
            if block:
                wait(proc, 120, "a read command")
            if proc.poll() is None:
                return
            err = open(out + ".err").read().strip().splitlines()
            if proc.returncode == 0 and open(out).read().strip():
                reads["ok"] += 1
            elif proc.returncode != 0 and len(err) == 1:
                reads["one_line_errors"] += 1
            else:
                read_failures.append(f"exit {proc.returncode}, stderr {err[-5:]}")
            reader = None

        faults = {"restarts": 0, "terminations": 0}
        during_import = 0
        for n in range(FAULTS):
            poll_reader()
            if reader is None:
                command = read_commands[n % len(read_commands)]
                reader = spawn([*command, "--db", url], f"read-{n}.out")
            time.sleep(0.7)
            if importer.poll() is None:
                during_import += 1
            if n % 2 == 0:
                pg.restart()
                faults["restarts"] += 1
            else:
                pg.terminate_all()
                faults["terminations"] += 1
        poll_reader(block=True)
        wait(importer, 300, "the import")
        import_err = open(import_out + ".err").read()
        self.assertEqual(importer.returncode, 0, import_err[-3000:])
        summary = json.loads(open(import_out).read().strip().splitlines()[-1])

        # Every event once.
        rows = pg.query(
            url,
            "SELECT i.event_id, COUNT(*) FROM events AS e JOIN event_ids AS i"
            " ON i.event_nid = e.event_nid GROUP BY i.event_id",
        )
        stored = {event_id: count for event_id, count in rows}
        lost = len(expected_ids - set(stored))
        duplicated = sum(count - 1 for count in stored.values()) + len(set(stored) - expected_ids)
        orderings = pg.query(url, "SELECT COUNT(*), COUNT(DISTINCT stream_ordering) FROM events")[0]
        print(
            f"\ndatabase faults: restarts survived {faults['restarts']}, backends terminated"
            f" {faults['terminations']} times; events written {len(stored)} (expected {len(expected_ids)});"
            f" lost {lost}; duplicated {duplicated}; import summary {summary};"
            f" reads ok {reads['ok']}, one-line errors {reads['one_line_errors']}"
        )
        self.assertEqual(
            during_import, FAULTS, "the import ended before the faults did: raise ROOMSTORE_DB_FAULT_CHUNKS"
        )
        self.assertEqual(lost, 0)
        self.assertEqual(duplicated, 0)
        self.assertEqual(orderings[0], orderings[1], "a stream ordering used twice")
        self.assertEqual(read_failures, [])

        # Positions reach the newest row: w2 (the importer) and w1 (moved up).
        newest_w2 = pg.query(url, "SELECT MAX(stream_ordering) FROM events WHERE instance_name = 'w2'")[0][0]

        def positions() -> dict:
            return dict(
                pg.query(url, "SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = 'events'")
            )

        wait_for(
            lambda: all(positions().get(w, 0) >= newest_w2 for w in WRITERS),
            60,
            f"both writers' persisted events positions to reach {newest_w2}: {positions()}",
        )

        # Every follower applied every event row of w2 after the base exactly once.
        wanted = {
            token
            for (token,) in pg.query(
                url, f"SELECT stream_ordering FROM events WHERE instance_name = 'w2' AND stream_ordering > {base_top}"
            )
        }

        def applied(out: str) -> dict[int, int]:
            counts: dict[int, int] = {}
            for line in open(out).read().splitlines():
                record = json.loads(line)
                if record.get("stream") == "events" and record["row"][0] == "ev" and record["instance"] == "w2":
                    counts[record["token"]] = counts.get(record["token"], 0) + 1
            return counts

        for name, (proc, out) in followers.items():
            wait_for(lambda: set(applied(out)) >= wanted or proc.poll() is not None, 120, f"{name} to apply every row")
            counts = applied(out)
            self.assertIsNone(proc.poll(), f"{name} exited: {open(out + '.err').read()[-2000:]}")
            self.assertEqual(sorted(wanted - set(counts)), [], f"{name} missed rows")
            self.assertEqual({t: c for t, c in counts.items() if c != 1}, {}, f"{name} applied rows twice")

        # The writers never exited, and took their locks again.
        self.assertIsNone(serve.poll(), open(serve_out + ".err").read()[-3000:])
        serve_err = open(serve_out + ".err").read()
        self.assertIn("taken again", serve_err)
        self.assertNotIn("Traceback", serve_err)
        outage_lines = serve_err.count("lost the database connection")
        # One line per outage, whatever the connections and transactions it hit.
        for what, err in (("serve", serve_err), ("import", import_err)):
            self.assertIn(err.count("lost the database connection"), range(1, FAULTS + 1), what)
            self.assertNotIn("Traceback", err, what)
        for name, (_proc, out) in followers.items():
            self.assertNotIn("Traceback", open(out + ".err").read(), name)
        print(
            f"serve: {outage_lines} outage lines, {serve_err.count('taken again')} writer lock re-takes;"
            f" import: {import_err.count('lost the database connection')} outage lines,"
            f" {import_err.count('taken again')} re-takes"
        )
