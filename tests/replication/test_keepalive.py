"""KeepAlive on its own: a Clock and a recording owner, no protocol."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial import unittest

from roomstore.replication.keepalive import KeepAlive


class _Owner:
    def __init__(self) -> None:
        self.is_open = True
        self.paused = False
        self.pings: list[float] = []
        self.timeouts: list[float] = []
        self.keepalive: KeepAlive | None = None
        self.clock: Clock | None = None

    def send_ping(self) -> None:
        assert self.keepalive is not None and self.clock is not None
        self.pings.append(self.clock.seconds())
        self.keepalive.sent()

    def peer_timed_out(self, silent_for: float) -> None:
        self.timeouts.append(silent_for)
        self.is_open = False


class KeepAliveUnitTests(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.owner = _Owner()
        self.keepalive = KeepAlive(self.owner, self.clock, interval=5.0, timeout=15.0)
        self.owner.keepalive, self.owner.clock = self.keepalive, self.clock
        self.keepalive.reset()
        self.keepalive.start()

    def test_pings_when_quiet_and_not_after_traffic(self) -> None:
        self.clock.advance(5)
        self.assertEqual(self.owner.pings, [5.0])
        self.clock.advance(3)
        self.keepalive.sent()  # other traffic at 8 postpones the next PING to 13
        self.clock.pump([2, 2])
        self.assertEqual(self.owner.pings, [5.0])
        self.clock.advance(1)
        self.assertEqual(self.owner.pings, [5.0, 13.0])

    def test_no_ping_while_paused(self) -> None:
        self.owner.paused = True
        self.clock.pump([5, 5, 5])
        self.assertEqual(self.owner.pings, [])
        self.owner.paused = False
        self.clock.advance(5)
        self.assertEqual(self.owner.pings, [20.0])

    def test_timeout_only_once_the_peer_pinged(self) -> None:
        self.clock.pump([10] * 5)
        self.assertEqual(self.owner.timeouts, [])
        self.keepalive.received()
        self.keepalive.peer_pinged()
        self.clock.advance(10)
        self.keepalive.received()  # any bytes count, not only PINGs
        self.clock.advance(14)
        self.assertEqual(self.owner.timeouts, [])
        self.clock.advance(1)
        self.assertEqual(self.owner.timeouts, [15.0])

    def test_stop_cancels_both_timers(self) -> None:
        self.keepalive.peer_pinged()
        self.keepalive.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])
