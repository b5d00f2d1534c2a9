"""A real server and client protocol talking through an in-memory loopback."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.test.iosim import connectedServerAndClient
from twisted.trial import unittest

from roomstore.replication import (
    InMemoryStream,
    ReplicationClientFactory,
    ReplicationConfig,
    StreamRegistry,
)

from .utils import RecordingHandler, make_server, metric


class LoopbackTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.events = InMemoryStream("events")
        self.caches = InMemoryStream("caches", writers=["master", "worker2"])
        # Both sides read the same streams, as workers read the same database.
        self.registry = StreamRegistry([self.events, self.caches])
        self.server_factory = make_server(self.registry, self.clock, server_name="hs.example", page_size=4)
        self.handler = RecordingHandler(self.registry)
        self.client_factory = ReplicationClientFactory(
            self.handler, "worker1", "hs.example", clock=self.clock, config=ReplicationConfig(page_size=4)
        )
        self.next_token = {"events": 0, "caches": 0}

    def connect(self, greet: bool = True):
        return connectedServerAndClient(
            lambda: self.server_factory.buildProtocol(None),
            lambda: self.client_factory.buildProtocol(None),
            clock=self.clock,
            greet=greet,
        )

    def write(self, stream: InMemoryStream, writer: str = "master", rows: int = 1) -> None:
        """Commit a fact of ``rows`` rows and tell the server."""
        self.next_token[stream.name] += 1
        token = self.next_token[stream.name]
        stream.append(writer, token, *[[f"{stream.name}-{token}-{i}"] for i in range(rows)])
        self.server_factory.notify_new_rows(stream.name)

    def applied(self) -> dict[tuple[str, str], list[tuple]]:
        """Rows the handler has seen, per (stream, writer), in order."""
        seen: dict[tuple[str, str], list[tuple]] = {}
        for stream, writer, token, rows in self.handler.rdata:
            seen.setdefault((stream, writer), []).extend((token, row) for row in rows)
        return seen

    def expected(self) -> dict[tuple[str, str], list[tuple]]:
        out = {}
        for stream in (self.events, self.caches):
            for writer in stream.writers():
                rows = list(stream.rows(writer))
                if rows:
                    out[(stream.name, writer)] = rows
        return out

    def test_rows_flow_and_resume_after_reconnect(self) -> None:
        # Rows that exist before the worker ever connects are not replayed:
        # the first REPLICATE only establishes positions.
        self.write(self.events)
        client, server, pump = self.connect()
        self.assertEqual(self.handler.connected, 1)
        self.assertEqual(self.client_factory.positions.get("events", "master"), 1)
        before = len(self.handler.rdata)
        self.assertEqual(before, 0)

        for i in range(10):
            self.write(self.events, rows=1 + i % 3)
            self.write(self.caches, writer="master" if i % 2 else "worker2")
            pump.flush()
        # The connection drops with rows in flight.
        self.write(self.events, rows=2)
        server.transport.loseConnection()
        pump.flush()
        self.assertIsNone(self.client_factory.connection)
        self.assertEqual(self.server_factory.connections, [])

        # Writes continue while the worker is away.
        for i in range(9):
            self.write(self.events, rows=1 + i % 2)
            self.write(self.caches, writer="worker2")

        caches_master_before = self.client_factory.positions.get("caches", "master")
        caches_worker2_before = self.client_factory.positions.get("caches", "worker2")
        self.assertNotEqual(caches_master_before, caches_worker2_before)
        rdata_before = metric("roomstore_replication_commands_received_total", side="client", command="RDATA")
        rows_before = len(self.handler.rdata)

        client, server, pump = self.connect(greet=False)
        # The worker resumes each stream from its last token (the lowest of
        # the writers for caches), then asks for positions.
        self.assertEqual(
            b"".join(client.transport.stream).decode().splitlines()[2:],
            [
                f"REPLICATE events {self.client_factory.positions.get('events', 'master')}",
                f"REPLICATE caches {min(caches_master_before, caches_worker2_before)}",
                "REPLICATE",
            ],
        )
        # Live writes while the replay is being pumped through.
        for _ in range(5):
            pump.pump()
            self.write(self.events)
            self.write(self.caches, writer="master", rows=3)
        pump.flush()

        # Everything after the first position, exactly once, in order.
        expected = self.expected()
        expected[("events", "master")] = expected[("events", "master")][1:]
        self.assertEqual(self.applied(), expected)
        for (stream, writer), rows in expected.items():
            self.assertEqual(self.client_factory.positions.get(stream, writer), rows[-1][0])
        # Rows of the writer that was ahead were replayed by the server and
        # dropped by the client as already applied.
        received = metric("roomstore_replication_commands_received_total", side="client", command="RDATA")
        applied_rows = sum(len(rows) for *_, rows in self.handler.rdata[rows_before:])
        self.assertGreater(received - rdata_before, applied_rows)

    def test_keepalive_keeps_an_idle_connection_up(self) -> None:
        client, server, pump = self.connect()
        for _ in range(60):
            self.clock.advance(1)
            pump.flush()
        self.assertTrue(client.is_open)
        self.assertTrue(server.is_open)

    def test_server_times_out_a_silent_client(self) -> None:
        client, server, pump = self.connect()
        # The client stops being pumped (its process hangs): no more data
        # reaches the server.
        self.clock.advance(15)
        self.assertFalse(server.is_open)
        self.assertTrue(server.transport.disconnecting)
