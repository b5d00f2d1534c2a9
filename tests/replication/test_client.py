"""Client side: batches, positions and catch-up, unknown streams, reconnects."""

from __future__ import annotations

from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial import unittest

from roomstore.replication import (
    InMemoryStream,
    ReplicationClientFactory,
    ReplicationConfig,
    StreamRegistry,
)

from .utils import GatedStream, RecordingHandler, feed, take, written


class FakeConnector:
    """Just enough of IConnector for ReconnectingClientFactory."""

    def __init__(self) -> None:
        self.connects = 0

    def connect(self) -> None:
        self.connects += 1

    def stopConnecting(self) -> None:
        pass

    def getDestination(self):
        return None


class ClientTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.events = InMemoryStream("events")
        self.caches = InMemoryStream("caches", writers=["master", "worker1"])
        self.handler = RecordingHandler(StreamRegistry([self.events, self.caches]))
        self.factory = ReplicationClientFactory(
            self.handler,
            "worker1",
            "hs.example",
            clock=self.clock,
            config=ReplicationConfig(page_size=3, max_batch_rows=5),
        )
        self.protocol, self.transport = self.connect()

    def connect(self):
        protocol = self.factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        feed(protocol, "SERVER hs.example", "PING 0")
        return protocol, transport


class BatchTests(ClientTestCase):
    def test_rows_applied_only_on_the_token_line(self) -> None:
        feed(
            self.protocol,
            'RDATA caches master batch ["get_user_by_id",["@test:localhost:8823"],1]',
            'RDATA caches master batch ["get_user_by_id",["@test2:localhost:8823"],1]',
            'RDATA caches master batch ["get_user_by_id",["@test3:localhost:8823"],1]',
        )
        self.assertEqual(self.handler.rdata, [])
        self.assertIsNone(self.factory.positions.get("caches", "master"))
        feed(self.protocol, 'RDATA caches master 54 ["get_user_by_id",["@test4:localhost:8823"],1]')
        self.assertEqual(
            self.handler.rdata,
            [
                (
                    "caches",
                    "master",
                    54,
                    [("get_user_by_id", [f"@{u}:localhost:8823"], 1) for u in ("test", "test2", "test3", "test4")],
                )
            ],
        )
        self.assertEqual(self.factory.positions.get("caches", "master"), 54)

    def test_batches_of_different_writers_do_not_mix(self) -> None:
        feed(
            self.protocol,
            'RDATA caches master batch ["m1"]',
            'RDATA caches worker1 batch ["w1"]',
            'RDATA caches worker1 7 ["w2"]',
            'RDATA caches master 9 ["m2"]',
        )
        self.assertEqual(
            self.handler.rdata,
            [("caches", "worker1", 7, [("w1",), ("w2",)]), ("caches", "master", 9, [("m1",), ("m2",)])],
        )

    def test_oversized_batch_closes_the_connection(self) -> None:
        take(self.transport)
        feed(self.protocol, *['RDATA caches master batch ["x"]'] * 6)
        self.assertEqual(take(self.transport), ["ERROR batch for caches longer than 5 rows"])
        self.assertTrue(self.transport.disconnecting)

    def test_replayed_rows_are_dropped(self) -> None:
        feed(
            self.protocol,
            'RDATA events master 5 ["a"]',
            'RDATA events master batch ["b"]',
            'RDATA events master 5 ["c"]',
        )
        feed(self.protocol, 'RDATA events master 4 ["old"]', 'RDATA events master 6 ["d"]')
        self.assertEqual([t for _, _, t, _ in self.handler.rdata], [5, 6])


class PositionTests(ClientTestCase):
    def test_first_position_is_adopted(self) -> None:
        feed(self.protocol, "POSITION events master 10 10")
        self.assertEqual(self.handler.positions, [("events", "master", 10, 10)])
        self.assertEqual(self.handler.rdata, [])
        self.assertEqual(self.factory.positions.get("events", "master"), 10)

    def test_no_gap_no_fetch(self) -> None:
        feed(self.protocol, 'RDATA events master 10 ["a"]', "POSITION events master 10 15")
        self.assertEqual(len(self.handler.rdata), 1)
        self.assertEqual(self.factory.positions.get("events", "master"), 15)

    def test_gap_is_fetched_in_pages_then_position_advances(self) -> None:
        for token in range(1, 21):
            self.events.append("master", token, [f"e{token}"], *([[f"e{token}b"]] if token == 14 else []))
        feed(self.protocol, 'RDATA events master 10 ["e10"]')
        # We were at 10; the server says its last position was 18, now 20.
        feed(self.protocol, "POSITION events master 18 20")
        tokens = [t for _, _, t, _ in self.handler.rdata]
        self.assertEqual(tokens, list(range(10, 21)))
        # The two rows at 14 come in one call.
        self.assertIn(("events", "master", 14, [("e14",), ("e14b",)]), self.handler.rdata)
        self.assertEqual(self.handler.positions, [("events", "master", 18, 20)])
        self.assertEqual(self.factory.positions.get("events", "master"), 20)

    def test_rows_behind_a_slow_fetch_wait_their_turn(self) -> None:
        """Updates to a stream are applied in arrival order even when a fetch
        is slow; other streams are not held up."""
        gated = GatedStream(self.events)
        self.handler.streams = StreamRegistry([gated, self.caches])
        for token in range(1, 7):
            self.events.append("master", token, [f"e{token}"])
        feed(self.protocol, 'RDATA events master 1 ["e1"]', "POSITION events master 5 5")
        feed(self.protocol, 'RDATA events master 7 ["e7"]', 'RDATA caches master 3 ["c3"]')
        self.assertEqual([(s, t) for s, _, t, _ in self.handler.rdata], [("events", 1), ("caches", 3)])
        while gated.waiting:
            gated.release()
        self.assertEqual(
            [(s, t) for s, _, t, _ in self.handler.rdata],
            [("events", 1), ("caches", 3), ("events", 2), ("events", 3), ("events", 4), ("events", 5), ("events", 7)],
        )
        self.assertEqual(self.factory.positions.get("events", "master"), 7)

    def test_server_behind_us_wins(self) -> None:
        feed(self.protocol, 'RDATA events master 10 ["a"]')
        with capturedLogs() as logs:
            feed(self.protocol, "POSITION events master 3 4")
        self.assertEqual(self.factory.positions.get("events", "master"), 4)
        self.assertTrue(any("moved" in e.get("log_format", "") for e in logs))


class UnknownStreamTests(ClientTestCase):
    def test_unknown_stream_ignored_with_a_warning(self) -> None:
        take(self.transport)
        with capturedLogs() as logs:
            feed(
                self.protocol,
                'RDATA typing master batch ["x"]',
                'RDATA typing master 5 ["y"]',
                "POSITION typing master 1 9",
                'RDATA typing master 6 ["z"]',
            )
        warnings = [e for e in logs if "unknown stream" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)  # once per stream, not per line
        self.assertEqual(self.handler.rdata, [])
        self.assertEqual(self.handler.positions, [])
        self.assertEqual(take(self.transport), [])  # no ERROR
        self.assertTrue(self.protocol.is_open)
        self.assertEqual(list(self.factory.positions.items()), [])
        # Known streams carry on.
        feed(self.protocol, 'RDATA events master 1 ["e"]')
        self.assertEqual(self.handler.rdata, [("events", "master", 1, [("e",)])])


class HandlerHookTests(ClientTestCase):
    def test_remote_server_up_and_connected(self) -> None:
        feed(self.protocol, "REMOTE_SERVER_UP matrix.org")
        self.assertEqual(self.handler.remote_servers, ["matrix.org"])
        self.assertEqual(self.handler.connected, 1)

    def test_send_notifications(self) -> None:
        take(self.transport)
        self.assertTrue(self.factory.send_user_sync("@a:b", True, 100))
        self.assertTrue(self.factory.send_user_sync("@a:b", False, 200, device_id="DEV"))
        self.assertTrue(self.factory.send_federation_ack(42))
        self.assertTrue(self.factory.send_remote_server_up("matrix.org"))
        self.assertTrue(self.factory.send_clear_user_sync())
        self.assertTrue(self.factory.send_user_ip("@a:b", "tok", "10.0.0.1", "curl/8", None, 300))
        self.assertTrue(self.factory.send_lock_released("purge", "!r:b"))
        self.assertEqual(
            take(self.transport),
            [
                "USER_SYNC worker1 @a:b None start 100",
                "USER_SYNC worker1 @a:b DEV end 200",
                "FEDERATION_ACK worker1 42",
                "REMOTE_SERVER_UP matrix.org",
                "CLEAR_USER_SYNC worker1",
                'USER_IP @a:b ["tok","10.0.0.1","curl/8",null,300]',
                'LOCK_RELEASED ["worker1","purge","!r:b"]',
            ],
        )
        self.protocol.connectionLost(Failure(ConnectionLost()))
        self.assertFalse(self.factory.send_federation_ack(43))

    def test_client_rejects_server_only_commands_it_should_not_get(self) -> None:
        take(self.transport)
        feed(self.protocol, "REPLICATE", "USER_SYNC a b start 1")
        self.assertEqual(
            take(self.transport), ["ERROR unexpected command REPLICATE", "ERROR unexpected command USER_SYNC"]
        )
        self.assertTrue(self.protocol.is_open)

    def test_bad_rdata_lines_are_answered_and_skipped(self) -> None:
        """A worker reads RDATA through the fast path (fields, no command);
        a line that path refuses still gets the parser's ERROR, and the
        lines around it are applied."""
        take(self.transport)
        feed(
            self.protocol,
            'RDATA caches master 5 ["a"]',
            'RDATA caches master -6 ["b"]',
            'RDATA caches master 7 ["c"',
            'RDATA caches master 8 ["d"]\r\r',
            "RDATA caches master 9",
            'RDATA caches master 10 ["e"]',
        )
        errors = take(self.transport)
        self.assertEqual(len(errors), 4, errors)
        self.assertTrue(all(e.startswith("ERROR failed to parse RDATA") for e in errors), errors)
        self.assertEqual(self.handler.rdata, [("caches", "master", 5, [("a",)]), ("caches", "master", 10, [("e",)])])
        self.assertTrue(self.protocol.is_open)


class ReconnectTests(ClientTestCase):
    def test_reconnect_resumes_with_legacy_replicate(self) -> None:
        self.assertEqual(written(self.transport), ["NAME worker1", "PING 0", "REPLICATE"])
        feed(
            self.protocol,
            "POSITION events master 5 5",
            "POSITION caches master 3 3",
            "POSITION caches worker1 8 8",
            'RDATA events master 7 ["e7"]',
            'RDATA caches master batch ["half a batch"]',  # lost with the connection
        )
        connector = FakeConnector()
        self.protocol.connectionLost(Failure(ConnectionLost()))
        self.factory.clientConnectionLost(connector, Failure(ConnectionLost()))
        self.assertIsNone(self.factory.connection)
        self.assertEqual(connector.connects, 0)
        # Backoff: the reconnect is scheduled on the injected clock.
        self.clock.advance(self.factory.delay + 1)
        self.assertEqual(connector.connects, 1)

        protocol = self.factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertEqual(
            written(transport),
            [
                "NAME worker1",
                f"PING {int(self.clock.seconds() * 1000)}",
                "REPLICATE events 7",
                "REPLICATE caches 3",  # the lowest of its writers
                "REPLICATE",
            ],
        )
        # The half batch from the old connection is gone.
        feed(protocol, "SERVER hs.example", 'RDATA caches master 4 ["c4"]')
        self.assertEqual(self.handler.rdata[-1], ("caches", "master", 4, [("c4",)]))
        # A good connection resets the backoff.
        self.assertEqual(self.factory.delay, self.factory.initialDelay)

    def test_backoff_grows_while_the_server_is_down(self) -> None:
        connector = FakeConnector()
        delays = []
        for _ in range(5):
            self.factory.clientConnectionFailed(connector, Failure(ConnectionLost()))
            delays.append(self.factory.delay)
            self.clock.advance(self.factory.maxDelay + 10)
        self.assertEqual(connector.connects, 5)
        self.assertEqual(delays, sorted(delays))
        self.assertGreater(delays[-1], delays[0])

    def test_stop(self) -> None:
        self.factory.stop()
        self.assertTrue(self.transport.disconnecting)
        connector = FakeConnector()
        self.factory.clientConnectionLost(connector, Failure(ConnectionLost()))
        self.clock.advance(1000)
        self.assertEqual(connector.connects, 0)
