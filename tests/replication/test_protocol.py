"""The line protocol: start-up, keep-alive, bad input, congestion, closing."""

from __future__ import annotations

from prometheus_client import REGISTRY
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport, StringTransportWithDisconnection
from twisted.logger import capturedLogs
from twisted.trial import unittest

from roomstore.replication import (
    ReplicationClientFactory,
    ReplicationConfig,
)
from roomstore.replication.commands import PingCommand, PositionCommand

from .utils import (
    SEED_TIME,
    RecordingHandler,
    connect,
    feed,
    make_server,
    metric,
    seed_registry,
    take,
    written,
)


def _make_client(clock: Clock, expected: str | None = "localhost:8823", **config):
    handler = RecordingHandler(seed_registry())
    factory = ReplicationClientFactory(
        handler, "synapse.app.appservice", expected, clock=clock, config=ReplicationConfig(**config)
    )
    protocol = factory.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    return factory, handler, protocol, transport


class SeedExampleTests(unittest.TestCase):
    """The example exchanges of the protocol document, line for line."""

    def test_example_interaction(self) -> None:
        """`Example` section: both directions, in order, through real protocols."""
        clock = Clock()
        clock.advance(SEED_TIME)
        registry = seed_registry(position=1)
        server_factory = make_server(registry, clock)
        server = server_factory.buildProtocol(None)
        server_transport = StringTransport()
        transcript: list[str] = []

        def pump() -> None:
            """Move lines both ways until quiet, recording them."""
            while True:
                from_server, from_client = take(server_transport), take(client_transport)
                if not from_server and not from_client:
                    return
                transcript.extend("> " + line for line in from_server)
                transcript.extend("< " + line for line in from_client)
                feed(client, *from_server)
                feed(server, *from_client)

        # * connection established *
        server.makeConnection(server_transport)
        client_factory, handler, client, client_transport = _make_client(clock)
        pump()

        clock.advance(4.9)
        registry.get("caches").append(
            "master", 2, ["get_user_by_id", ["@01register-user:localhost:8823"], 1490197670513]
        )
        server_factory.notify_new_rows("caches")
        registry.get("events").append(
            "master",
            14,
            [
                "$149019767112vOHxz:localhost:8823",
                "!AFDCvgApUmpdfVjIXm:localhost:8823",
                "m.room.guest_access",
                "",
                None,
            ],
        )
        server_factory.notify_new_rows("events")
        pump()
        # The server sent RDATA at +4.9 s; the client has been quiet since
        # connecting, so its keep-alive PING goes out at +5 s. (The document
        # shows the client's PING at +10 s; we keep the stated 5 s rule.)
        clock.advance(0.1)
        pump()
        server_factory.close_all("server stopping")
        pump()

        self.assertEqual(
            transcript,
            [
                "> SERVER localhost:8823",
                "> PING 1490197665618",
                "< NAME synapse.app.appservice",
                "< PING 1490197665618",
                "< REPLICATE",
                "> POSITION events master 1 1",
                "> POSITION backfill master 1 1",
                "> POSITION caches master 1 1",
                '> RDATA caches master 2 ["get_user_by_id",["@01register-user:localhost:8823"],1490197670513]',
                '> RDATA events master 14 ["$149019767112vOHxz:localhost:8823",'
                '"!AFDCvgApUmpdfVjIXm:localhost:8823","m.room.guest_access","",null]',
                "< PING 1490197670618",
                "> ERROR server stopping",
            ],
        )
        # * connection closed by server *
        self.assertTrue(server_transport.disconnecting)
        # And the client saw it all.
        self.assertEqual(
            handler.positions,
            [(name, "master", 1, 1) for name in ("events", "backfill", "caches")],
        )
        self.assertEqual([(s, t) for s, _, t, _ in handler.rdata], [("caches", 2), ("events", 14)])
        self.assertEqual(client_factory.positions.get("events", "master"), 14)
        self.assertEqual(handler.connected, 1)

    def test_overview_flow(self) -> None:
        """`Overview` section: REPLICATE, POSITION 53 53, then RDATA 54 and 55."""
        registry = seed_registry(position=53)
        factory = make_server(registry, server_name="example.com")
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertEqual(written(transport)[0], "SERVER example.com")
        transport.clear()
        feed(protocol, "REPLICATE")
        events = registry.get("events")
        events.append("master", 54, ["$foo1:bar.com"])
        factory.notify_new_rows("events")
        events.append("master", 55, ["$foo4:bar.com"])
        factory.notify_new_rows("events")
        self.assertEqual(
            written(transport)[:5],
            [
                "POSITION events master 53 53",
                "POSITION backfill master 53 53",
                "POSITION caches master 53 53",
                'RDATA events master 54 ["$foo1:bar.com"]',
                'RDATA events master 55 ["$foo4:bar.com"]',
            ],
        )

    def test_batched_rdata(self) -> None:
        """Four cache rows at one token: three `batch` lines, then the token."""
        registry = seed_registry(position=53)
        factory = make_server(registry)
        protocol, transport = connect(factory)
        feed(protocol, "REPLICATE")
        transport.clear()
        registry.get("caches").append(
            "master",
            54,
            *[["get_user_by_id", [f"@{u}:localhost:8823"], 1490197670513] for u in ("test", "test2", "test3", "test4")],
        )
        factory.notify_new_rows("caches")
        self.assertEqual(
            written(transport),
            [
                'RDATA caches master batch ["get_user_by_id",["@test:localhost:8823"],1490197670513]',
                'RDATA caches master batch ["get_user_by_id",["@test2:localhost:8823"],1490197670513]',
                'RDATA caches master batch ["get_user_by_id",["@test3:localhost:8823"],1490197670513]',
                'RDATA caches master 54 ["get_user_by_id",["@test4:localhost:8823"],1490197670513]',
            ],
        )


class StartupTests(unittest.TestCase):
    def test_server_greets_with_server_then_ping(self) -> None:
        clock = Clock()
        clock.advance(12.345)
        protocol = make_server(clock=clock, server_name="hs.example").buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertEqual(written(transport), ["SERVER hs.example", "PING 12345"])
        self.assertIs(transport.producer, protocol.outbound)
        self.assertTrue(transport.streaming)

    def test_client_sends_name_ping_replicate(self) -> None:
        clock = Clock()
        _, _, _, transport = _make_client(clock)
        self.assertEqual(written(transport), ["NAME synapse.app.appservice", "PING 0", "REPLICATE"])

    def test_client_rejects_wrong_server(self) -> None:
        factory, handler, protocol, transport = _make_client(Clock(), expected="hs.example")
        transport.clear()
        feed(protocol, "SERVER evil.example", "POSITION events master 1 1")
        self.assertEqual(written(transport), ["ERROR wrong server name: expected 'hs.example', got 'evil.example'"])
        self.assertTrue(transport.disconnecting)
        # Nothing after the bad SERVER line was acted upon.
        self.assertEqual(handler.positions, [])
        self.assertEqual(handler.connected, 0)
        self.assertIsNone(factory.connection)

    def test_client_accepts_any_server_when_none_expected(self) -> None:
        factory, handler, protocol, transport = _make_client(Clock(), expected=None)
        feed(protocol, "SERVER whoever")
        self.assertFalse(transport.disconnecting)
        self.assertIs(factory.connection, protocol)
        self.assertEqual(protocol.peer_name, "whoever")


class KeepAliveTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.factory = make_server(clock=self.clock)
        self.protocol, self.transport = connect(self.factory)

    def test_ping_every_five_seconds_when_idle(self) -> None:
        sent_at = []
        for _ in range(6):
            self.clock.advance(1)
            for line in take(self.transport):
                self.assertTrue(line.startswith("PING "), line)
                sent_at.append(self.clock.seconds())
        self.assertEqual(sent_at, [5.0])
        for _ in range(20):
            self.clock.advance(1)
            sent_at.extend(self.clock.seconds() for line in take(self.transport) if line.startswith("PING"))
        self.assertEqual(sent_at, [5.0, 10.0, 15.0, 20.0, 25.0])

    def test_other_traffic_postpones_the_ping(self) -> None:
        self.clock.advance(3)
        self.protocol.send_command(PositionCommand("events", "master", 1, 1))
        take(self.transport)
        self.clock.advance(4.9)  # 7.9: only 4.9 s since the POSITION
        self.assertEqual(take(self.transport), [])
        self.clock.advance(0.1)  # 8.0: 5 s since the POSITION
        self.assertEqual(take(self.transport), ["PING 8000"])

    def test_no_timeout_before_first_ping(self) -> None:
        """A netcat user who never PINGs is never timed out."""
        feed(self.protocol, "REPLICATE")
        self.clock.advance(100)
        self.assertFalse(self.transport.disconnecting)
        self.assertTrue(self.protocol.is_open)

    def test_timeout_after_ping_then_abort(self) -> None:
        feed(self.protocol, "PING 1")
        self.clock.advance(10)
        feed(self.protocol, "REPLICATE")  # any traffic resets the timer
        self.clock.advance(14.9)
        self.assertFalse(self.transport.disconnecting)
        take(self.transport)
        self.clock.advance(0.1)  # 15 s of silence
        self.assertEqual(take(self.transport), ["ERROR ping timeout"])
        self.assertTrue(self.transport.disconnecting)
        self.assertFalse(self.transport.disconnected)
        self.assertFalse(self.protocol.is_open)
        # StringTransport never completes the close: the protocol aborts.
        self.clock.advance(4.9)
        self.assertFalse(self.transport.disconnected)
        self.clock.advance(0.1)
        self.assertTrue(self.transport.disconnected)
        # Nothing more is sent on a closing connection, not even PINGs.
        self.clock.advance(60)
        self.assertEqual(take(self.transport), [])

    def test_timeout_close_that_completes_is_not_aborted(self) -> None:
        protocol, transport = connect(self.factory, StringTransportWithDisconnection())
        feed(protocol, "PING 1")
        self.clock.advance(15)
        self.assertEqual(written(transport)[-1], "ERROR ping timeout")
        self.assertFalse(transport.connected)  # connectionLost ran
        self.assertFalse(transport.disconnected)  # never aborted
        self.assertNotIn(protocol, self.factory.connections)
        # No timers of this connection left behind.
        self.protocol.connectionLost(None)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_configurable_ping_timeout(self) -> None:
        factory = make_server(clock=self.clock, ping_timeout=30.0)
        protocol, transport = connect(factory)
        feed(protocol, "PING 1")
        self.clock.advance(29)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(1)
        self.assertEqual(written(transport)[-1], "ERROR ping timeout")


class BadInputTests(unittest.TestCase):
    """Bad lines are answered with ERROR; only over-long lines close."""

    def setUp(self) -> None:
        self.factory = make_server(max_line_length=200)
        self.protocol, self.transport = connect(self.factory)
        self.other, self.other_transport = connect(self.factory)

    def assertOtherConnectionServes(self) -> None:
        feed(self.other, "REPLICATE")
        self.assertEqual(
            written(self.other_transport),
            [f"POSITION {name} master 1 1" for name in ("events", "backfill", "caches")],
        )
        self.assertTrue(self.other.is_open)

    def test_malformed_unknown_and_unexpected_lines(self) -> None:
        before = metric("roomstore_replication_invalid_lines_total", side="server", reason="malformed")
        feed(
            self.protocol,
            "RDATA",
            "POSITION events master x 1",
            "FROBNICATE all the things",
            b"PING \xff\xfe",
            "SERVER I am a server",  # valid command, wrong direction
            "REPLICATE nosuchstream 5",
        )
        self.assertEqual(
            take(self.transport),
            [
                "ERROR failed to parse RDATA: expected <stream_name> <instance_name> <token> <row_json>, got ''",
                "ERROR failed to parse POSITION: prev_token must be a non-negative integer, got 'x'",
                "ERROR unknown command 'FROBNICATE'",
                "ERROR line is not valid UTF-8",
                "ERROR unexpected command SERVER",
                "ERROR unknown stream 'nosuchstream'",
            ],
        )
        self.assertEqual(
            metric("roomstore_replication_invalid_lines_total", side="server", reason="malformed") - before, 2
        )
        # The connection is still open and still works.
        self.assertTrue(self.protocol.is_open)
        self.assertFalse(self.transport.disconnecting)
        feed(self.protocol, "REPLICATE caches 1")
        self.assertEqual(take(self.transport), ["POSITION caches master 1 1"])
        self.assertOtherConnectionServes()

    def test_blank_lines_and_crlf(self) -> None:
        feed(self.protocol, "", "   ", "\r", "REPLICATE events NOW\r")
        self.assertEqual(take(self.transport), ["POSITION events master 1 1"])

    def test_over_long_line_closes_only_that_connection(self) -> None:
        feed(self.protocol, "NAME " + "x" * 196)  # 201 bytes
        self.assertEqual(take(self.transport), ["ERROR line too long"])
        self.assertTrue(self.transport.disconnecting)
        feed(self.protocol, "REPLICATE")  # ignored: the connection is closing
        self.assertEqual(take(self.transport), [])
        self.assertOtherConnectionServes()

    def test_line_at_the_limit_is_accepted(self) -> None:
        feed(self.protocol, "NAME " + "x" * 195)  # exactly 200 bytes
        self.assertEqual(take(self.transport), [])
        self.assertEqual(self.protocol.peer_name, "x" * 195)

    def test_unterminated_over_long_data_closes(self) -> None:
        """No newline in sight: the buffer is not allowed to grow past the limit."""
        for _ in range(5):
            self.protocol.dataReceived(b"y" * 50)
        self.assertEqual(take(self.transport), ["ERROR line too long"])
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.protocol.partial_line, b"")

    def test_default_limit_is_synapses_16_kib(self) -> None:
        protocol, transport = connect(make_server())
        protocol.dataReceived(b"PING " + b"n" * (16384 - 5) + b"\n")
        self.assertEqual(take(transport), [])
        protocol.dataReceived(b"PING " + b"n" * (16384 - 4) + b"\n")
        self.assertEqual(take(transport), ["ERROR line too long"])

    def test_peer_error_is_logged_not_answered(self) -> None:
        with capturedLogs() as events:
            feed(self.protocol, "ERROR something broke")
        self.assertEqual(take(self.transport), [])
        self.assertTrue(self.protocol.is_open)
        self.assertTrue(any("something broke" in str(e.get("text")) for e in events))

    def test_flood_of_bad_lines_is_rate_limited_in_logs(self) -> None:
        with capturedLogs() as events:
            feed(self.protocol, *[f"BAD {i}" for i in range(50)])
        self.assertEqual(len(take(self.transport)), 50)  # every line answered
        warnings = [e for e in events if e.get("log_format", "").startswith("[{conn_id}] bad line")]
        self.assertEqual(len(warnings), 1)  # but logged once


class PausingTransport(StringTransport):
    """Pauses its producer after a set number of further writes."""

    _writes_left: int | None = None

    def pause_after(self, writes: int) -> None:
        self._writes_left = writes

    def write(self, data: bytes) -> None:
        super().write(data)
        if self._writes_left is not None:
            self._writes_left -= 1
            if self._writes_left == 0:
                self._writes_left = None
                self.producer.pauseProducing()


class CongestionTests(unittest.TestCase):
    def setUp(self) -> None:
        self.registry = seed_registry()
        self.factory = make_server(self.registry, max_pending_commands=5)
        self.slow, self.slow_transport = connect(self.factory)
        self.fast, self.fast_transport = connect(self.factory)
        for protocol in (self.slow, self.fast):
            feed(protocol, "REPLICATE")
        take(self.slow_transport), take(self.fast_transport)

    def test_disconnect_exactly_past_the_limit(self) -> None:
        before = metric("roomstore_replication_congestion_disconnects_total")
        self.slow.outbound.pauseProducing()
        for i in range(5):
            self.slow.send_command(PingCommand(str(i)))
        # Exactly at the limit: buffered, nothing written, still connected.
        self.assertEqual(self.slow.pending_count, 5)
        self.assertEqual(metric("roomstore_replication_pending_commands", connection=self.slow.conn_id), 5)
        self.assertEqual(take(self.slow_transport), [])
        self.assertTrue(self.slow.is_open)
        # One more is one too many.
        self.slow.send_command(PingCommand("5"))
        self.assertEqual(take(self.slow_transport), ["ERROR too many pending commands"])
        self.assertTrue(self.slow_transport.disconnecting)
        self.assertEqual(self.slow.pending_count, 0)
        self.assertEqual(metric("roomstore_replication_congestion_disconnects_total") - before, 1)
        # The other connection carries on.
        self.registry.get("events").append("master", 2, ["$e"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(self.fast_transport), ['RDATA events master 2 ["$e"]'])
        self.assertEqual(take(self.slow_transport), [])

    def _stalling_connection(self, writes_before_pause: int):
        """A connection whose transport pauses it after some more writes,
        as a real transport does when the socket buffer fills."""
        transport = PausingTransport()
        protocol, transport = connect(self.factory, transport)
        feed(protocol, "REPLICATE")
        take(transport)
        transport.pause_after(writes_before_pause)
        return protocol, transport

    def test_a_page_is_written_whole_then_the_connection_waits(self) -> None:
        """A page of rows goes out in one write; the transport pauses; no
        further page is read (nothing queues) until it resumes."""
        protocol, transport = self._stalling_connection(1)
        events = self.registry.get("events")
        for token in range(2, 8):  # six rows, one page
            events.append("master", token, [f"$e{token}"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(transport), [f'RDATA events master {t} ["$e{t}"]' for t in range(2, 8)])
        self.assertTrue(protocol.paused)
        for token in range(8, 20):
            events.append("master", token, [f"$e{token}"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(transport), [])
        self.assertEqual(protocol.pending_count, 0)
        self.assertTrue(protocol.is_open)
        protocol.outbound.resumeProducing()
        self.assertEqual(take(transport), [f'RDATA events master {t} ["$e{t}"]' for t in range(8, 20)])

    def test_traffic_while_paused_past_the_limit_drops(self) -> None:
        """Commands sent while paused queue up to the limit; one more drops
        that connection, and the other gets every row."""
        protocol, transport = self._stalling_connection(1)
        events = self.registry.get("events")
        for token in range(2, 9):  # seven rows, one page
            events.append("master", token, [f"$e{token}"])
        self.factory.notify_new_rows("events")
        self.assertEqual(len(take(transport)), 7)
        with capturedLogs() as logs:
            for i in range(6):
                self.factory.send_remote_server_up(f"s{i}.example")
        self.assertEqual(take(transport), ["ERROR too many pending commands"])
        self.assertTrue(transport.disconnecting)
        self.assertFalse(protocol.is_open)
        self.assertTrue(any("not reading" in e.get("log_format", "") for e in logs))
        self.assertEqual(
            take(self.fast_transport),
            [f'RDATA events master {t} ["$e{t}"]' for t in range(2, 9)]
            + [f"REMOTE_SERVER_UP s{i}.example" for i in range(6)],
        )

    def test_paused_connection_is_not_read_for(self) -> None:
        """While paused, a connection's rows stay in the stream rather than in
        memory: nothing is fetched or queued until it resumes."""
        self.slow.outbound.pauseProducing()
        events = self.registry.get("events")
        for token in range(2, 6):
            events.append("master", token, [f"$e{token}"])
        self.factory.notify_new_rows("events")
        self.assertEqual(take(self.slow_transport), [])
        self.assertEqual(self.slow.pending_count, 0)
        self.assertFalse(self.slow.session.feed.is_idle())  # waiting to be writable
        self.assertEqual(self.slow.session.feed.position("events", "master"), 1)
        self.slow.outbound.resumeProducing()
        self.assertEqual(take(self.slow_transport), [f'RDATA events master {t} ["$e{t}"]' for t in range(2, 6)])
        self.assertEqual(self.slow.pending_count, 0)
        self.assertTrue(self.slow.session.feed.is_idle())
        self.assertTrue(self.slow.is_open)

    def test_no_pings_pile_up_while_paused(self) -> None:
        clock = self.factory.reactor
        self.slow.outbound.pauseProducing()
        clock.advance(60)
        self.assertEqual(self.slow.pending_count, 0)
        self.slow.outbound.resumeProducing()
        clock.advance(5)
        self.assertEqual([line.split()[0] for line in take(self.slow_transport)], ["PING"])


class MetricsTests(unittest.TestCase):
    def test_commands_bytes_and_connections(self) -> None:
        factory = make_server()
        sent = metric("roomstore_replication_commands_sent_total", side="server", command="POSITION")
        received = metric("roomstore_replication_commands_received_total", side="server", command="REPLICATE")
        bytes_in = metric("roomstore_replication_received_bytes_total", side="server")
        connections = metric("roomstore_replication_connections", side="server")

        protocol, transport = connect(factory)
        self.assertEqual(metric("roomstore_replication_connections", side="server") - connections, 1)
        bytes_out = metric("roomstore_replication_sent_bytes_total", side="server")
        feed(protocol, "REPLICATE")
        self.assertEqual(
            metric("roomstore_replication_commands_received_total", side="server", command="REPLICATE") - received, 1
        )
        self.assertEqual(
            metric("roomstore_replication_commands_sent_total", side="server", command="POSITION") - sent, 3
        )
        self.assertEqual(metric("roomstore_replication_received_bytes_total", side="server") - bytes_in, 10)
        self.assertEqual(
            metric("roomstore_replication_sent_bytes_total", side="server") - bytes_out, len(transport.value())
        )
        protocol.connectionLost(None)
        self.assertEqual(metric("roomstore_replication_connections", side="server") - connections, 0)

    def test_unknown_command_names_do_not_become_labels(self) -> None:
        protocol, _ = connect(make_server())
        unknown = metric("roomstore_replication_invalid_lines_total", side="server", reason="unknown_command")
        feed(protocol, "NOT_A_COMMAND 1")
        self.assertEqual(
            metric("roomstore_replication_invalid_lines_total", side="server", reason="unknown_command") - unknown, 1
        )
        self.assertIsNone(
            REGISTRY.get_sample_value(
                "roomstore_replication_commands_received_total",
                {"side": "server", "command": "NOT_A_COMMAND"},
            )
        )

    def test_many_protocols_share_metrics(self) -> None:
        factory = make_server()
        for _ in range(200):
            protocol, _ = connect(factory)
            protocol.connectionLost(None)
        self.assertEqual(factory.connections, [])
