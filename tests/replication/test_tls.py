"""Across machines (issue 24, item 4): Redis with a password and over TLS,
TCP replication over TLS, and ``serve`` refusing an unprotected public bind.

Real servers only: a ``redis-server`` started with ``--requirepass`` and
``--tls-port`` (client certificates required), certificates made by
``openssl`` for the test (``tests/replication/certs.py``). In-process cases
run on both engines; the command-line cases run ``roomstore`` and ``twistd``
as child processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

from twisted.internet import reactor
from twisted.internet.interfaces import ISSLTransport
from twisted.trial import unittest

from roomstore.replication import ReplicationClientFactory
from roomstore.replication.process_services import ReplicationServerService, save_positions
from roomstore.replication.redis import RedisRefused, parse_redis_url
from roomstore.replication.store_streams import STORE_STREAMS
from roomstore.replication.tls import ClientTLS, TLSConfigError, check_bind_protected, is_loopback
from roomstore.store import StoreConfig
from tests.db import on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder

from . import test_process_services as test_service
from .certs import make_certs
from .redis_utils import RedisServer, fresh_channel
from .store_utils import ALICE, BOB, sleep, wait_until, with_timeout
from .test_process_services import ServiceTestMixin, free_port
from .test_redis import Applied, RedisMixin
from .utils import RecordingHandler, seed_registry

PASSWORD = "pw-of-issue-24"


@on_both_engines
class RedisAcrossMachinesTests(RedisMixin):
    async def test_rows_over_tls_with_a_password_and_a_client_certificate(self):
        certs = make_certs(self)
        redis = RedisServer(self, password=PASSWORD, tls=certs)
        redis.start()
        url, channel = self.new_database_url(), fresh_channel()
        tls = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        worker = await self.open_store(
            url, StoreConfig(instance_name="worker1", stream_writers={n: ["master"] for n in STORE_STREAMS})
        )
        applied = Applied()
        on_writer = self.connect(writer, redis.tls_url, channel, tls=tls)
        on_worker = self.connect(worker, redis.tls_url, channel, tls=tls, on_applied=applied)
        await with_timeout(on_writer.when_ready(), 20, "writer on Redis over TLS")
        await with_timeout(on_worker.when_ready(), 20, "worker on Redis over TLS")
        for replication in (on_writer, on_worker):
            for conn in (replication._pub_conn, replication._sub_conn):
                self.assertTrue(ISSLTransport.providedBy(conn.transport), "a plaintext connection")
        await self.persist_room(writer, "!tls:example.org", 10)
        await wait_until(
            lambda: worker.events_stream.get_current_token() == writer.events_stream.get_current_token(),
            20,
            "the worker to catch up over TLS",
        )
        self.assertEqual(applied.tokens[("events", "master")], await self.expected_rows(writer, "events", "master"))

    async def test_a_wrong_or_missing_password_is_refused_in_one_line(self):
        redis = RedisServer(self, password=PASSWORD)
        redis.start()
        store = await self.open_store(self.new_database_url(), StoreConfig())
        plain = f"redis://127.0.0.1:{redis.port}"
        for given in (f"redis://:not-{PASSWORD}@127.0.0.1:{redis.port}", plain):
            replication = self.connect(store, given, fresh_channel())
            with self.assertRaises(RedisRefused) as caught:
                await with_timeout(replication.when_ready(), 20, "the refusal")
            message = str(caught.exception)
            self.assertIn(f"Redis at {plain} refused the connection", message)
            self.assertIn("redis://:PASSWORD@host:port", message)
            self.assertNotIn("not-" + PASSWORD, message)
            self.assertEqual(len(message.splitlines()), 1)
            await replication.stop()

    async def test_a_server_certificate_from_another_ca_is_never_trusted(self):
        certs = make_certs(self)
        redis = RedisServer(self, tls=certs)
        redis.start()
        store = await self.open_store(self.new_database_url(), StoreConfig())
        for tls in (
            ClientTLS(certs.other_ca, certs.client_cert, certs.client_key),  # server not trusted
            ClientTLS(certs.ca),
        ):  # no client certificate: the server refuses us
            replication = self.connect(store, redis.tls_url, fresh_channel(), tls=tls)
            for _ in range(15):  # never subscribed: TLS 1.3 may let the client finish its side first
                await sleep(0.1)
                self.assertFalse(replication.ready)
                self.assertFalse(replication._subscribed)
            await replication.stop()


class TLSUnitTests(unittest.TestCase):
    def test_urls(self):
        address = parse_redis_url(f"rediss://:{PASSWORD}@redis.example:6380/1")
        self.assertEqual(
            (address.host, address.port, address.dbid, address.password, address.tls),
            ("redis.example", 6380, 1, PASSWORD, True),
        )
        self.assertEqual(address.describe(), "rediss://redis.example:6380/1")
        self.assertNotIn(PASSWORD, repr(address))
        self.assertEqual(parse_redis_url("redis://:p%40ss@h:1").password, "p@ss")
        with self.assertRaises(ValueError) as caught:
            parse_redis_url(f"http://:{PASSWORD}@h:1")
        self.assertNotIn(PASSWORD, str(caught.exception))

    def test_bind_protection(self):
        for address in ("127.0.0.1", "127.5.0.1", "::1", "localhost"):
            self.assertTrue(is_loopback(address), address)
            check_bind_protected(address, secret=False, tls=False)
        for address in ("0.0.0.0", "::", "10.0.0.1", "example.org"):
            self.assertFalse(is_loopback(address), address)
            with self.assertRaises(TLSConfigError) as caught:
                check_bind_protected(address, secret=False, tls=False)
            self.assertIn("add --secret-file FILE", str(caught.exception))
            check_bind_protected(address, secret=True, tls=False)
            check_bind_protected(address, secret=False, tls=True)
        with self.assertRaises(TLSConfigError):
            ReplicationServerService("sqlite:///nowhere.db", bind="0.0.0.0")

    def test_unusable_files_are_one_line_errors(self):
        certs = make_certs(self)
        with self.assertRaises(TLSConfigError) as caught:
            ReplicationServerService("sqlite:///nowhere.db", tls_cert=certs.server_cert, tls_key=certs.client_key)
        self.assertIn(
            f"certificate {certs.server_cert} with key {certs.client_key} cannot be used", str(caught.exception)
        )
        with self.assertRaises(TLSConfigError) as caught:
            ClientTLS("/no/such/ca.pem").options("localhost")
        self.assertEqual(
            str(caught.exception), "cannot read the CA certificate /no/such/ca.pem: No such file or directory"
        )
        with self.assertRaises(TLSConfigError):
            ClientTLS(certs.ca, certs.client_cert)  # a certificate without its key


@on_both_engines
class TCPOverTLSTests(ServiceTestMixin):
    async def test_follower_over_tls_and_an_untrusting_one(self):
        certs = make_certs(self)
        url = self.new_database_url()
        server = await self.start_server(url, tls_cert=certs.server_cert, tls_key=certs.server_key)
        follower = await self.start_follower(url, server, tls=ClientTLS(certs.ca))
        await wait_until(lambda: follower.factory.connection is not None, what="follower connected over TLS")
        self.assertTrue(ISSLTransport.providedBy(follower.factory.connection.transport))
        room = UncheckedRoomBuilder()
        target = await self.persist(server.store, room, room.create(), room.join(ALICE), room.join(BOB))
        await with_timeout(follower.store.events_stream.wait_for_position(target), 10, "events over TLS")
        self.assertEqual(
            await follower.store.get_current_state_ids(room.room_id),
            await server.store.get_current_state_ids(room.room_id),
        )

        # A client trusting another CA, and a plaintext client, get nothing.
        port = server.port.getHost().port
        for tls in (ClientTLS(certs.other_ca), None):
            handler = RecordingHandler(seed_registry())
            factory = ReplicationClientFactory(handler, "checker", "hs.example")
            factory.maxDelay = 0.2
            if tls is None:
                connector = reactor.connectTCP("127.0.0.1", port, factory)
            else:
                connector = reactor.connectSSL("127.0.0.1", port, factory, tls.options("127.0.0.1"))
            await sleep(1.0)
            self.assertEqual(handler.positions, [])
            factory.stop()
            connector.disconnect()
            await wait_until(lambda: connector.state == "disconnected", what="disconnect")


class AcrossMachinesCommandTests(unittest.TestCase):
    """The commands and the twistd plugin with the new options (SQLite files;
    the stores underneath are the ones the in-process tests run on both engines)."""

    spawn = test_service.ChildProcessTests.spawn
    wait_for_exit = test_service.ChildProcessTests.wait_for_exit

    def roomstore(self, *args: str):
        return self.spawn([sys.executable, "-m", "roomstore.cli", *args])

    async def last_error_line(self, proc, err: str) -> str:
        self.assertEqual(await self.wait_for_exit(proc), 2)
        with open(err) as handle:
            lines = handle.read().strip().splitlines()
        self.assertEqual(len(lines), 1, lines)  # one line, no traceback
        return lines[0]

    async def test_serve_refuses_a_public_bind_without_protection(self):
        db = f"sqlite:///{tempfile.mkdtemp()}/serve.db"
        proc, out, err = self.roomstore("serve", "--db", db, "--bind", "0.0.0.0", "--replication-port", "0")
        line = await self.last_error_line(proc, err)
        self.assertTrue(line.startswith("roomstore serve: refusing to serve replication on 0.0.0.0"), line)
        self.assertIn("add --secret-file FILE", line)
        self.assertIn("--tls-cert FILE --tls-key FILE", line)
        self.assertFalse(os.path.exists(db[len("sqlite:///") :]), "serve opened the database before refusing")

    async def test_serve_over_tls_and_follow_with_the_ca(self):
        certs = make_certs(self)
        directory = tempfile.mkdtemp()
        db = f"sqlite:///{directory}/serve.db"
        sample = os.path.join(directory, "sample.jsonl")
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "roomstore", "data", "sample-rooms.jsonl")) as h:
            lines = [next(h) for _ in range(40)]
        with open(sample, "w") as handle:
            handle.writelines(lines)
        proc, out, err = self.roomstore("import", sample, "--db", db)
        self.assertEqual(await self.wait_for_exit(proc, 60), 0, open(err).read())
        imported = json.loads(open(out).read().strip().splitlines()[-1])
        self.assertEqual(imported["imported"], 40)

        # A public bind is accepted with TLS.
        server, out, err = self.roomstore(
            "serve",
            "--db",
            db,
            "--bind",
            "0.0.0.0",
            "--replication-port",
            "0",
            "--server-name",
            "hs.example",
            "--tls-cert",
            certs.server_cert,
            "--tls-key",
            certs.server_key,
            "-v",
        )
        await wait_until(lambda: os.path.getsize(out) > 0 or server.poll() is not None, timeout=30, what="serving line")
        serving = json.loads(open(out).readline())["serving"]
        self.assertEqual((serving["host"], serving["tls"], serving["secret"]), ("0.0.0.0", True, False))
        self.assertIn("(no secret) over TLS", open(err).read())

        positions = os.path.join(directory, "positions.json")
        save_positions(positions, {(n, "master"): 0 for n in STORE_STREAMS})  # replay everything
        follow_db = f"sqlite:///{directory}/worker.db"
        follower, fout, ferr = self.roomstore(
            "follow",
            "--db",
            follow_db,
            "--server",
            f"127.0.0.1:{serving['port']}",
            "--server-name",
            "hs.example",
            "--tls-ca",
            certs.ca,
            "--positions-file",
            positions,
        )

        def printed_tokens() -> set:
            with open(fout) as handle:
                rows = [json.loads(line) for line in handle.read().splitlines()[1:] if line.endswith("}")]
            return {r["token"] for r in rows if r["stream"] == "events"}

        await wait_until(
            lambda: len(printed_tokens()) == 40 or follower.poll() is not None,
            timeout=60,
            what="the follower to print every event over TLS",
        )
        self.assertEqual(printed_tokens(), set(range(1, 41)))
        self.assertTrue(json.loads(open(fout).readline())["tls"])

        # A follower trusting another CA never gets a row, and says why in its retry lines.
        other, oout, oerr = self.roomstore(
            "follow",
            "--db",
            f"sqlite:///{directory}/other.db",
            "--server",
            f"127.0.0.1:{serving['port']}",
            "--tls-ca",
            certs.other_ca,
            "--positions-file",
            os.path.join(directory, "other.json"),
        )
        await wait_until(
            lambda: "TLS handshake failed (certificate verify failed)" in open(oerr).read(),
            timeout=30,
            what="the untrusting follower to say why it retries",
        )
        self.assertEqual(open(oout).read().strip().splitlines()[1:], [])
        self.assertIn("is --tls-ca the CA that signed the server's certificate", open(oerr).read())
        for proc in (other, follower, server):
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(await self.wait_for_exit(proc), 0)

    async def test_import_over_rediss_with_a_password(self):
        certs = make_certs(self)
        redis = RedisServer(self, password=PASSWORD, tls=certs)
        redis.start()
        directory = tempfile.mkdtemp()
        sample = os.path.join(directory, "sample.jsonl")
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "roomstore", "data", "sample-rooms.jsonl")) as h:
            lines = [next(h) for _ in range(10)]
        with open(sample, "w") as handle:
            handle.writelines(lines)
        db = f"sqlite:///{directory}/import.db"
        tls_args = ["--redis-ca", certs.ca, "--redis-cert", certs.client_cert, "--redis-key", certs.client_key]
        proc, out, err = self.roomstore("import", sample, "--db", db, "--redis", redis.tls_url, *tls_args)
        self.assertEqual(await self.wait_for_exit(proc, 60), 0, open(err).read())
        self.assertEqual(json.loads(open(out).read().strip().splitlines()[-1])["imported"], 10)

        wrong = redis.tls_url.replace(PASSWORD, "not-the-password")
        proc, out, err = self.roomstore("import", sample, "--db", db, "--redis", wrong, *tls_args)
        line = await self.last_error_line(proc, err)
        self.assertIn(f"Redis at rediss://127.0.0.1:{redis.tls_port} refused the connection", line)
        self.assertNotIn("not-the-password", line)

        proc, out, err = self.roomstore("import", sample, "--db", db, "--redis", redis.url, "--redis-ca", certs.ca)
        line = await self.last_error_line(proc, err)
        self.assertIn("give --redis rediss://HOST:PORT", line)

    async def test_twistd_plugin_takes_the_options(self):
        certs = make_certs(self)
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        directory = tempfile.mkdtemp()
        logfile = os.path.join(directory, "twistd.log")
        proc, out, err = self.spawn(
            [
                twistd,
                "-n",
                "--pidfile=",
                f"--logfile={logfile}",
                "roomstore",
                "--db",
                f"sqlite:///{directory}/refused.db",
                "--bind",
                "0.0.0.0",
            ]
        )
        self.assertNotEqual(await self.wait_for_exit(proc), 0)
        self.assertIn("refusing to serve replication on 0.0.0.0", open(err).read() + open(out).read())

        port = free_port()
        proc, out, err = self.spawn(
            [
                twistd,
                "-n",
                "--pidfile=",
                f"--logfile={logfile}",
                "roomstore",
                "--db",
                f"sqlite:///{directory}/t.db",
                "--bind",
                "0.0.0.0",
                "--replication-port",
                str(port),
                "--server-name",
                "hs.example",
                "--tls-cert",
                certs.server_cert,
                "--tls-key",
                certs.server_key,
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
        self.assertIn(f"listening on 0.0.0.0:{port} (no secret) over TLS", log_text())
        handler = RecordingHandler(seed_registry())
        factory = ReplicationClientFactory(handler, "checker", "hs.example")
        connector = reactor.connectSSL("127.0.0.1", port, factory, ClientTLS(certs.ca).options("127.0.0.1"))
        await wait_until(lambda: len(handler.positions) >= 3, timeout=20, what="positions over TLS")
        factory.stop()
        connector.disconnect()
        proc.send_signal(signal.SIGTERM)
        self.assertEqual(await self.wait_for_exit(proc), -signal.SIGTERM)
