"""The optional shared secret: ``AUTH <secret>`` before anything else."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.test.iosim import connectedServerAndClient
from twisted.trial import unittest

from roomstore.replication import (
    InMemoryStream,
    ReplicationClientFactory,
    ReplicationConfig,
    ReplicationServerFactory,
    StreamRegistry,
)
from roomstore.replication.commands import AuthCommand, parse_command_from_line, serialize_command

from .utils import RecordingHandler, feed, metric, seed_registry, take

SECRET = "correct horse battery staple"


def make_server(registry=None, clock=None, server_name="localhost:8823", secret=None) -> ReplicationServerFactory:
    return ReplicationServerFactory(
        server_name, registry or seed_registry(), clock or Clock(), ReplicationConfig(), secret=secret
    )


def failures(reason: str) -> float:
    return metric("roomstore_replication_auth_failures_total", reason=reason)


class AuthCommandTests(unittest.TestCase):
    def test_round_trip_and_repr_hides_the_secret(self) -> None:
        cmd = AuthCommand(SECRET)
        self.assertEqual(serialize_command(cmd), f"AUTH {SECRET}")
        self.assertEqual(parse_command_from_line(f"AUTH {SECRET}"), cmd)
        self.assertNotIn("horse", repr(cmd))
        with self.assertRaises(ValueError):
            AuthCommand("")
        with self.assertRaises(ValueError):
            AuthCommand("two\nlines")


class ServerAuthTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.factory = make_server(clock=self.clock, secret=SECRET)

    def connect(self):
        protocol = self.factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def test_greeting_then_right_secret_opens_the_protocol(self) -> None:
        protocol, transport = self.connect()
        greeting = take(transport)
        self.assertEqual(greeting[0], "SERVER localhost:8823")
        self.assertTrue(greeting[1].startswith("PING "))
        self.assertFalse(protocol.authenticated)
        feed(protocol, "", "  ", f"AUTH {SECRET}\r", "NAME worker1", "REPLICATE")
        self.assertTrue(protocol.authenticated)
        self.assertEqual(
            take(transport),
            ["POSITION events master 1 1", "POSITION backfill master 1 1", "POSITION caches master 1 1"],
        )
        # Another AUTH later is harmless.
        feed(protocol, f"AUTH {SECRET}", "AUTH whatever")
        self.assertEqual(take(transport), [])
        self.assertTrue(protocol.is_open)
        # And the auth timer is gone.
        self.clock.advance(60)
        self.assertTrue(protocol.is_open)

    def assert_refused(self, lines: list[str | bytes], reason: str) -> None:
        protocol, transport = self.connect()
        take(transport)
        before = failures(reason)
        with capturedLogs() as logs:
            feed(protocol, *lines)
        self.assertEqual(take(transport), ["ERROR authentication failed"])
        self.assertFalse(protocol.is_open)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(failures(reason), before + 1)
        # What the peer sent (maybe a near-miss of the secret) is never logged.
        text = " ".join(str(e.get("log_format", "")) + repr(e) for e in logs)
        self.assertNotIn("hunter2", text)
        self.assertIn("authentication failed", text)

    def test_wrong_secret_closes(self) -> None:
        self.assert_refused(["AUTH hunter2", "REPLICATE"], "wrong_secret")

    def test_secret_prefix_or_extension_is_wrong(self) -> None:
        self.assert_refused([f"AUTH {SECRET[:-1]}"], "wrong_secret")
        self.assert_refused([f"AUTH {SECRET}x"], "wrong_secret")
        self.assert_refused(["AUTH"], "wrong_secret")

    def test_any_other_first_command_closes(self) -> None:
        self.assert_refused(["NAME hunter2", f"AUTH {SECRET}"], "no_auth")
        self.assert_refused(["REPLICATE"], "no_auth")
        self.assert_refused(["PING 1"], "no_auth")
        self.assert_refused([b"\xff\xfe hunter2"], "no_auth")
        self.assert_refused(["GARBAGE hunter2"], "no_auth")

    def test_silence_times_out(self) -> None:
        protocol, transport = self.connect()
        take(transport)
        before = failures("timeout")
        self.clock.advance(protocol.config.ping_timeout - 0.5)
        self.assertTrue(protocol.is_open)
        self.clock.advance(1)
        self.assertFalse(protocol.is_open)
        self.assertEqual(take(transport)[-1], "ERROR authentication failed")  # after keep-alive PINGs
        self.assertEqual(failures("timeout"), before + 1)

    def test_no_broadcasts_before_auth(self) -> None:
        stranger, stranger_transport = self.connect()
        member, member_transport = self.connect()
        feed(member, f"AUTH {SECRET}")
        take(stranger_transport), take(member_transport)
        self.factory.send_remote_server_up("matrix.org")
        self.assertEqual(take(member_transport), ["REMOTE_SERVER_UP matrix.org"])
        self.assertEqual(take(stranger_transport), [])

    def test_server_without_secret_accepts_and_ignores_auth(self) -> None:
        factory = make_server(clock=self.clock)
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        take(transport)
        self.assertTrue(protocol.authenticated)
        feed(protocol, "AUTH anything", "REPLICATE events NOW")
        self.assertEqual(take(transport), ["POSITION events master 1 1"])


class ClientAuthTests(unittest.TestCase):
    """A real client factory and server over an in-memory loopback."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.events = InMemoryStream("events")
        self.registry = StreamRegistry([self.events])

    def run_pair(self, server_secret: str | None, client_secret: str | None):
        server_factory = make_server(self.registry, self.clock, server_name="hs.example", secret=server_secret)
        handler = RecordingHandler(self.registry)
        client_factory = ReplicationClientFactory(
            handler, "worker1", "hs.example", clock=self.clock, config=ReplicationConfig(), secret=client_secret
        )
        client, server, pump = connectedServerAndClient(
            lambda: server_factory.buildProtocol(None),
            lambda: client_factory.buildProtocol(None),
            clock=self.clock,
            greet=False,
        )
        self.client_sent = b"".join(client.transport.stream).decode().splitlines()
        pump.flush()
        self.events.append("master", 1, ["row-1"])
        server_factory.notify_new_rows("events")
        pump.flush()
        return handler, client, server, pump

    def test_client_sends_auth_first_and_receives_rows(self) -> None:
        handler, client, server, pump = self.run_pair(SECRET, SECRET)
        self.assertEqual(self.client_sent[:2], [f"AUTH {SECRET}", "NAME worker1"])
        self.assertTrue(server.authenticated)
        self.assertEqual(handler.rdata, [("events", "master", 1, [("row-1",)])])

    def test_client_with_wrong_secret_gets_nothing(self) -> None:
        handler, client, server, pump = self.run_pair(SECRET, "hunter2")
        self.assertFalse(server.is_open)
        self.assertEqual(handler.rdata, [])
        self.assertEqual(handler.positions, [])

    def test_client_without_secret_gets_nothing(self) -> None:
        handler, client, server, pump = self.run_pair(SECRET, None)
        self.assertFalse(server.is_open)
        self.assertEqual(handler.rdata, [])

    def test_client_secret_against_open_server(self) -> None:
        handler, client, server, pump = self.run_pair(None, SECRET)
        self.assertTrue(server.is_open)
        self.assertEqual(handler.rdata, [("events", "master", 1, [("row-1",)])])
