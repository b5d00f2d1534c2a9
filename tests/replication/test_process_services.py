"""The services, the ``serve``/``follow`` commands and the twistd plugin.

In-process tests run the real services on the real reactor over loopback TCP;
the command and plugin tests run them as child processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

from twisted.internet import reactor
from twisted.logger import globalLogPublisher
from twisted.trial import unittest

from roomstore.replication import ReplicationClientFactory, ReplicationConfig
from roomstore.replication.process_services import (
    FollowerService,
    ReplicationServerService,
    fit_read_ahead,
    load_positions,
    parse_host_port,
    read_secret_file,
    save_positions,
)
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import RoomBuilder, UncheckedRoomBuilder, fake_event_id, skip_precheck

from .store_utils import ALICE, BOB, sleep, wait_until, with_timeout
from .utils import RecordingHandler, seed_registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class ServiceTestMixin:
    async def start_server(self, url, **kw) -> ReplicationServerService:
        kw.setdefault("port", 0)
        kw.setdefault("server_name", "hs.example")
        service = ReplicationServerService(url, **kw)
        service.startService()
        self.addCleanup(lambda: service.stopService() if service.running else None)
        await with_timeout(service.when_ready(), 30, "server service")
        return service

    async def start_follower(self, url, server: ReplicationServerService | None, port: int | None = None, **kw):
        applied = []
        kw.setdefault("on_applied", lambda *a: applied.append(a))
        service = FollowerService(
            url,
            "127.0.0.1",
            port if port is not None else server.port.getHost().port,
            expected_server_name="hs.example",
            **kw,
        )
        service.applied = applied
        service.startService()
        self.addCleanup(lambda: service.stopService() if service.running else None)
        await with_timeout(service.when_ready(), 30, "follower service")
        return service

    async def persist(self, store, room: RoomBuilder, *events) -> int:
        await store.persist_events([room.to_persist(e) for e in events])
        return store.events_stream.get_current_token()


@on_both_engines
class ServiceTests(ServiceTestMixin):
    async def test_server_and_follower_replicate_log_and_stop_cleanly(self):
        url = self.new_database_url()
        logged = []

        def observer(event):
            ours = event.get("log_namespace") == "roomstore.replication.process_services"
            if ours and "applied" in event.get("log_format", ""):
                logged.append((event["stream"], event["instance"], event["token"], event["count"]))

        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        positions_file = os.path.join(tempfile.mkdtemp(), "positions.json")
        server = await self.start_server(url, metrics_port=0)
        follower = await self.start_follower(url, server, positions_file=positions_file)
        await wait_until(lambda: follower.factory.connection is not None, what="follower connected")
        self.assertEqual(await follower.store.get_rooms_for_user(ALICE), frozenset())

        room = UncheckedRoomBuilder()
        await self.persist(server.store, room, room.create(), room.join(ALICE))
        await self.persist(server.store, room, room.message(ALICE, "one"))
        target = await self.persist(server.store, room, room.join(BOB), room.message(BOB, "two"))
        caches = server.store.caches_stream.get_current_token()
        await with_timeout(follower.store.events_stream.wait_for_position(target), 10, "events")
        await with_timeout(follower.store.caches_stream.wait_for_position(caches), 10, "caches")
        self.assertEqual(await follower.store.get_rooms_for_user(BOB), frozenset([room.room_id]))
        self.assertEqual(
            await follower.store.get_current_state_ids(room.room_id),
            await server.store.get_current_state_ids(room.room_id),
        )

        # One log line per applied token, saying stream, instance, token and rows.
        rows = (await server.factory.streams.get("events").get_updates("master", 0, target, 1000)).updates
        per_token = [("events", "master", t, sum(1 for u, _ in rows if u == t)) for t in range(1, target + 1)]
        self.assertEqual([entry for entry in logged if entry[0] == "events"], per_token)
        self.assertEqual([(s, i, t, len(rows)) for s, i, t, rows in follower.applied], logged)
        await wait_until(
            lambda: (load_positions(positions_file) or {}).get(("caches", "master")) == caches, what="positions file"
        )
        self.assertEqual(
            load_positions(positions_file),
            {("events", "master"): target, ("backfill", "master"): 0, ("caches", "master"): caches},
        )

        # Prometheus text format on /metrics, with the replication metrics.
        from twisted.web.client import Agent, readBody

        mport = server.metrics_port_listener.getHost().port
        response = await Agent(reactor).request(b"GET", f"http://127.0.0.1:{mport}/metrics".encode())
        body = (await readBody(response)).decode()
        self.assertEqual(response.code, 200)
        for name in [
            'roomstore_replication_commands_sent_total{command="RDATA",side="server"}',
            'roomstore_replication_commands_received_total{command="REPLICATE",side="server"}',
            'roomstore_replication_sent_bytes_total{side="server"}',
            'roomstore_replication_received_bytes_total{side="server"}',
            'roomstore_replication_connections{side="server"}',
            "# TYPE roomstore_replication_pending_commands gauge",
            "# TYPE roomstore_replication_congestion_disconnects_total counter",
            "# TYPE roomstore_replication_auth_failures_total counter",
            'roomstore_stream_position{stream="events",writer="master"}',
        ]:
            self.assertIn(name, body)

        store, factory, port = server.store, server.factory, server.port.getHost().port
        follower_store = follower.store
        await follower.stopService()
        await server.stopService()
        self.assertTrue(store.db.closed)
        self.assertTrue(follower_store.db.closed)
        self.assertEqual(factory.connections, [])
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

    async def test_follower_saves_positions_off_the_reactor_coalesced_and_flushes_on_stop(self):
        from .test_positions_file import HeldThreads

        url = self.new_database_url()
        positions_file = os.path.join(tempfile.mkdtemp(), "positions.json")
        threads = HeldThreads()  # no write finishes until the test says so
        server = await self.start_server(url)
        follower = await self.start_follower(url, server, positions_file=positions_file, run_in_thread=threads)
        await wait_until(lambda: follower.factory.connection is not None, what="follower connected")
        room = UncheckedRoomBuilder()
        await self.persist(server.store, room, room.create(), room.join(ALICE))
        for i in range(5):
            await self.persist(server.store, room, room.message(ALICE, f"m{i}"))
        target = await self.persist(server.store, room, room.join(BOB))
        caches = server.store.caches_stream.get_current_token()
        await wait_until(
            lambda: (
                ("events", "master", target) in [a[:3] for a in follower.applied]
                and ("caches", "master", caches) in [a[:3] for a in follower.applied]
            ),
            what="applied",
        )
        # Nine tokens applied, positions moved each time: one write started
        # (held), the rest waits as the newest positions, nothing on the reactor.
        self.assertGreaterEqual(len(follower.applied), 8)
        self.assertEqual((threads.calls, threads.most_in_flight), (1, 1))
        self.assertIsNone(load_positions(positions_file))

        stopped = follower.stopService()
        while not stopped.called:
            if threads.held:
                threads.finish()
            await sleep(0.01)
        self.assertEqual(threads.calls, 2, "the held write, then one of the newest positions")
        self.assertEqual(
            load_positions(positions_file),
            {("events", "master"): target, ("backfill", "master"): 0, ("caches", "master"): caches},
        )

    async def test_server_reads_ahead_no_more_than_its_pool_allows(self):
        """Pages read ahead at once fit the database pool with a connection
        to spare for the writer: one on SQLite (one connection), the
        configured two on PostgreSQL (five)."""
        server = await self.start_server(self.new_database_url())
        connections = server.store.db.engine.max_connections
        self.assertEqual(server.factory.config.read_ahead, 1 if connections <= 2 else 2)
        self.assertEqual(ReplicationConfig().read_ahead, 2)
        self.assertEqual(fit_read_ahead(ReplicationConfig(read_ahead=8), 5).read_ahead, 4)
        self.assertEqual(fit_read_ahead(ReplicationConfig(read_ahead=3), 1).read_ahead, 1)
        kept = ReplicationConfig(read_ahead=2, page_size=7)
        self.assertIs(fit_read_ahead(kept, 5), kept)

    async def test_follower_resumes_from_its_positions_file(self):
        url = self.new_database_url()
        positions_file = os.path.join(tempfile.mkdtemp(), "positions.json")
        server = await self.start_server(url)
        room = UncheckedRoomBuilder()
        first = await self.start_follower(url, server, positions_file=positions_file)
        await wait_until(lambda: first.factory.connection is not None, what="connected")
        seen = await self.persist(server.store, room, room.create(), room.join(ALICE))
        await with_timeout(first.store.events_stream.wait_for_position(seen), 10, "events")
        await first.stopService()
        self.assertEqual([t for s, _, t, _ in first.applied if s == "events"], [1, 2])

        # Written while no worker runs.
        missed = [await self.persist(server.store, room, room.message(ALICE, f"m{i}")) for i in range(3)]
        second = await self.start_follower(url, server, positions_file=positions_file)
        self.assertEqual(second.resumed_from[("events", "master")], seen)
        await with_timeout(second.store.events_stream.wait_for_position(missed[-1]), 10, "events")
        await wait_until(lambda: [t for s, _, t, _ in second.applied if s == "events"] == missed, what="replay")
        await second.stopService()

        # Without a file: from the store's positions, nothing old is replayed.
        third = await self.start_follower(url, server)
        self.assertEqual(third.resumed_from[("events", "master")], missed[-1])
        last = await self.persist(server.store, room, room.message(ALICE, "new"))
        await with_timeout(third.store.events_stream.wait_for_position(last), 10, "events")
        await wait_until(lambda: any(s == "events" for s, *_ in third.applied), what="applied")
        self.assertEqual([t for s, _, t, _ in third.applied if s == "events"], [last])

    async def test_writes_between_worker_start_and_connection_are_applied(self):
        # The worker caches a read, then the writer persists before the worker
        # reaches the server: it must resume from where its store stood, not
        # from the server's position, or its cache stays stale forever.
        url = self.new_database_url()
        port = free_port()
        writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
        room = UncheckedRoomBuilder()
        await self.persist(writer, room, room.create(), room.join(ALICE))
        await writer.close()
        follower = await self.start_follower(url, None, port=port)
        follower.factory.maxDelay = 0.2  # retry quickly once the server is up
        self.assertEqual(await follower.store.get_rooms_for_user(BOB), frozenset())  # cached
        writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
        target = await self.persist(writer, room, room.join(BOB))
        await writer.close()
        server = await self.start_server(url, port=port)
        self.assertEqual(server.store.events_stream.get_current_token(), target)
        await with_timeout(follower.store.events_stream.wait_for_position(target), 20, "events")
        self.assertEqual(await follower.store.get_rooms_for_user(BOB), frozenset([room.room_id]))

    async def test_position_of_a_failed_batch_reaches_workers(self):
        from roomstore.events.write.persist import MissingStateError

        url = self.new_database_url()
        server = await self.start_server(url)
        follower = await self.start_follower(url, server)
        await wait_until(lambda: follower.factory.connection is not None, what="connected")
        room = UncheckedRoomBuilder()
        await self.persist(server.store, room, room.create())
        orphan = UncheckedRoomBuilder(room.room_id)
        orphan.leaves = [fake_event_id("never stored")]
        # Failing in its write (past the precheck, as in a race with another writer).
        skip_precheck(server.store)
        with self.assertRaises(MissingStateError):
            await self.persist(server.store, orphan, orphan.message(ALICE, "no state"))
        # The failed transaction's stream ID (2) is dropped with it: the position
        # stays, and the next batch's position, past the gap, reaches the worker.
        self.assertEqual(server.store.events_stream.get_current_token(), 1)
        await self.persist(server.store, room, room.join(ALICE))
        target = server.store.events_stream.get_current_token()
        self.assertEqual(target, 3)
        await with_timeout(follower.store.events_stream.wait_for_position(target), 10, "events")
        await wait_until(lambda: 3 in [t for s, _, t, _ in follower.applied if s == "events"], what="applied")
        self.assertEqual([t for s, _, t, _ in follower.applied if s == "events"], [1, 3])


class HelperTests(unittest.TestCase):
    def test_read_secret_file(self):
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "secret")
        with open(path, "w") as handle:
            handle.write("  s3cret value \nsecond line\n")
        os.chmod(path, 0o600)
        self.assertEqual(read_secret_file(path), "s3cret value")
        with open(path, "w") as handle:
            handle.write("\n")
        with self.assertRaises(ValueError):
            read_secret_file(path)

    def test_parse_host_port(self):
        self.assertEqual(parse_host_port("127.0.0.1:9093"), ("127.0.0.1", 9093))
        self.assertEqual(parse_host_port("example.org"), ("example.org", 9092))
        self.assertEqual(parse_host_port("[::1]:9000"), ("::1", 9000))
        for bad in (":9000", "host:port", "[::1]:x"):
            with self.assertRaises(ValueError):
                parse_host_port(bad)

    def test_positions_file_round_trip(self):
        path = os.path.join(tempfile.mkdtemp(), "p.json")
        self.assertIsNone(load_positions(path))
        save_positions(path, {("events", "master"): 5, ("caches", "master"): 2})
        self.assertEqual(load_positions(path), {("events", "master"): 5, ("caches", "master"): 2})
        with open(path, "w") as handle:
            handle.write('{"events": ')  # torn by a power cut
        self.assertIsNone(load_positions(path))


class ChildProcessTests(unittest.TestCase):
    """``roomstore serve`` and ``twistd roomstore``, as an operator runs them."""

    def spawn(self, argv: list[str]) -> tuple[subprocess.Popen, str, str]:
        directory = tempfile.mkdtemp()
        out, err = os.path.join(directory, "out"), os.path.join(directory, "err")
        with open(out, "wb") as out_handle, open(err, "wb") as err_handle:
            proc = subprocess.Popen(argv, stdout=out_handle, stderr=err_handle, env=child_env(), cwd=directory)

        def reap():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        self.addCleanup(reap)
        return proc, out, err

    def secret_file(self, secret: str) -> str:
        path = os.path.join(tempfile.mkdtemp(), "secret")
        with open(path, "w") as handle:
            handle.write(secret + "\n")
        os.chmod(path, 0o600)
        return path

    async def check_server(self, port: int, secret: str) -> None:
        """A client with the right secret gets positions; one with a wrong
        secret is turned away."""
        for given, expect_positions in ((secret, True), ("wrong", False)):
            handler = RecordingHandler(seed_registry())
            factory = ReplicationClientFactory(handler, "checker", "hs.example", secret=given)
            factory.maxDelay = 0.2
            connector = reactor.connectTCP("127.0.0.1", port, factory)
            if expect_positions:
                await wait_until(lambda: len(handler.positions) >= 3, timeout=20, what="positions")
                self.assertEqual({p[0] for p in handler.positions}, {"events", "backfill", "caches"})
            else:
                await sleep(0.5)
                self.assertEqual(handler.positions, [])
            factory.stop()
            connector.disconnect()
            await wait_until(lambda: connector.state == "disconnected", what="disconnect")

    async def wait_for_exit(self, proc: subprocess.Popen, timeout: float = 20) -> int:
        await wait_until(lambda: proc.poll() is not None, timeout=timeout, what="child exit")
        return proc.returncode

    async def test_serve_command(self):
        db = f"sqlite:///{tempfile.mkdtemp()}/serve.db"
        secret = self.secret_file("s3cret")
        proc, out, err = self.spawn(
            [
                sys.executable,
                "-m",
                "roomstore.cli",
                "serve",
                "--db",
                db,
                "--replication-port",
                "0",
                "--server-name",
                "hs.example",
                "--secret-file",
                secret,
                "--metrics-port",
                "0",
                "-v",
            ]
        )
        await wait_until(lambda: os.path.getsize(out) > 0 or proc.poll() is not None, timeout=30, what="serving line")
        with open(out) as handle:
            serving = json.loads(handle.readline())["serving"]
        self.assertEqual(
            (serving["host"], serving["server_name"], serving["secret"]), ("127.0.0.1", "hs.example", True)
        )
        self.assertIn("metrics_port", serving)
        await self.check_server(serving["port"], "s3cret")
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(await self.wait_for_exit(proc), 0)
        with open(err) as handle:
            log = handle.read()
        self.assertIn("authentication failed (wrong_secret)", log)
        self.assertIn("replication server stopped", log)
        self.assertNotIn("wrong\n", log.replace("wrong_secret", ""))

    async def test_serve_max_line_length(self):
        """``--max-line-length`` sets the longest line the server accepts:
        a longer one is answered with ERROR and a close; a value below 1 is
        refused with a one-line error."""
        db = f"sqlite:///{tempfile.mkdtemp()}/serve.db"
        proc, out, err = self.spawn(
            [
                sys.executable,
                "-m",
                "roomstore.cli",
                "serve",
                "--db",
                db,
                "--replication-port",
                "0",
                "--max-line-length",
                "200",
            ]
        )
        await wait_until(lambda: os.path.getsize(out) > 0 or proc.poll() is not None, timeout=30, what="serving line")
        with open(out) as handle:
            port = json.loads(handle.readline())["serving"]["port"]

        def talk(line: bytes, until: bytes) -> bytes:
            """Send ``line``; what the server says until ``until`` or a close."""
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(line)
                received = b""
                while until not in received:
                    try:
                        data = sock.recv(4096)
                    except OSError:
                        break
                    if not data:
                        break
                    received += data
                return received

        from twisted.internet import threads

        short = await threads.deferToThread(
            talk, b"NAME " + b"w" * 150 + b"\nPING 1\nREPLICATE nosuch 0\n", b"unknown stream"
        )
        self.assertNotIn(b"line too long", short)
        self.assertIn(b"ERROR unknown stream 'nosuch'", short)
        long = await threads.deferToThread(talk, b"NAME " + b"w" * 250 + b"\n", b"never said")
        self.assertIn(b"ERROR line too long\n", long)
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(await self.wait_for_exit(proc), 0)
        proc, out, err = self.spawn(
            [
                sys.executable,
                "-m",
                "roomstore.cli",
                "serve",
                "--db",
                db,
                "--max-line-length",
                "0",
            ]
        )
        self.assertEqual(await self.wait_for_exit(proc), 2)
        with open(err) as handle:
            self.assertEqual(
                handle.read().strip().splitlines()[-1],
                "roomstore serve: --max-line-length must be a positive number of bytes",
            )

    async def test_serve_refuses_a_bad_secret_file_and_a_taken_port(self):
        db = f"sqlite:///{tempfile.mkdtemp()}/serve.db"
        empty = self.secret_file("")
        proc, out, err = self.spawn(
            [sys.executable, "-m", "roomstore.cli", "serve", "--db", db, "--secret-file", empty]
        )
        self.assertEqual(await self.wait_for_exit(proc), 2)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            proc, out, err = self.spawn(
                [
                    sys.executable,
                    "-m",
                    "roomstore.cli",
                    "serve",
                    "--db",
                    db,
                    "--replication-port",
                    str(port),
                ]
            )
            self.assertEqual(await self.wait_for_exit(proc), 2)
        with open(err) as handle:
            self.assertIn("roomstore serve:", handle.read())

    async def test_twistd_plugin(self):
        from twisted.application.service import IServiceMaker
        from twisted.plugin import getPlugins

        makers = {p.tapname: p for p in getPlugins(IServiceMaker)}
        self.assertIn("roomstore", makers)
        db = f"sqlite:///{tempfile.mkdtemp()}/twistd.db"
        port = free_port()
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        # A log file, not stdout: twistd ends by re-raising the signal, which
        # would lose a buffered stdout.
        logfile = os.path.join(tempfile.mkdtemp(), "twistd.log")
        proc, out, err = self.spawn(
            [
                twistd,
                "-n",
                "--pidfile=",
                f"--logfile={logfile}",
                "roomstore",
                "--db",
                db,
                "--replication-port",
                str(port),
                "--server-name",
                "hs.example",
                "--secret-file",
                self.secret_file("plugin-secret"),
            ]
        )

        def log_text() -> str:
            try:
                with open(logfile) as handle:
                    return handle.read()
            except FileNotFoundError:
                return ""

        await wait_until(
            lambda: "listening on" in log_text() or proc.poll() is not None, timeout=30, what="twistd listening"
        )
        await self.check_server(port, "plugin-secret")
        proc.send_signal(signal.SIGTERM)
        # twistd stops its services, then exits by re-raising the signal.
        self.assertEqual(await self.wait_for_exit(proc), -signal.SIGTERM)
        log = log_text()
        self.assertIn(f"listening on 127.0.0.1:{port} (shared secret required)", log)
        self.assertIn("replication server stopped", log)
