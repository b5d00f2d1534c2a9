"""OutboundQueue on its own: a streaming producer on a StringTransport."""

from __future__ import annotations

from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from roomstore.replication.commands import Command, PingCommand, serialize_command
from roomstore.replication.outbound import OutboundQueue

from .utils import take


class _Owner:
    """Writes each command as a line; a transport that pauses after
    ``pause_after`` more writes, as a socket whose buffer fills."""

    def __init__(self, transport: StringTransport) -> None:
        self.transport = transport
        self.is_open = True
        self.congestions = 0
        self.pause_after: int | None = None

    def write_command(self, cmd: Command) -> None:
        self.transport.write(serialize_command(cmd).encode() + b"\n")
        if self.pause_after is not None:
            self.pause_after -= 1
            if self.pause_after == 0:
                self.pause_after = None
                self.transport.producer.pauseProducing()

    def congested(self) -> None:
        self.congestions += 1


class OutboundQueueTests(unittest.TestCase):
    def setUp(self) -> None:
        self.transport = StringTransport()
        self.owner = _Owner(self.transport)
        self.queue = OutboundQueue(self.owner, limit=3, conn_id="test-1")
        self.transport.registerProducer(self.queue, True)

    def send(self, *names: str) -> None:
        for name in names:
            self.queue.send(PingCommand(name))

    def test_is_a_push_producer(self) -> None:
        self.assertTrue(verifyObject(IPushProducer, self.queue))
        self.assertIs(self.transport.producer, self.queue)
        self.assertTrue(self.transport.streaming)

    def test_writes_through_until_paused_then_queues_in_order(self) -> None:
        self.send("a")
        self.assertEqual(take(self.transport), ["PING a"])
        self.transport.producer.pauseProducing()
        self.assertTrue(self.queue.paused)
        self.send("b", "c")
        self.assertEqual(take(self.transport), [])
        self.assertEqual(len(self.queue), 2)
        self.transport.producer.resumeProducing()
        self.assertEqual(take(self.transport), ["PING b", "PING c"])
        self.assertEqual(len(self.queue), 0)
        self.assertFalse(self.queue.paused)

    def test_a_write_during_resume_can_pause_again(self) -> None:
        self.queue.pauseProducing()
        self.send("a", "b", "c")
        self.owner.pause_after = 2
        self.queue.resumeProducing()
        self.assertEqual(take(self.transport), ["PING a", "PING b"])
        self.assertTrue(self.queue.paused)
        self.assertEqual(len(self.queue), 1)
        self.queue.resumeProducing()
        self.assertEqual(take(self.transport), ["PING c"])

    def test_past_the_limit_the_owner_hears_of_congestion(self) -> None:
        self.queue.pauseProducing()
        self.send("a", "b", "c")
        self.assertEqual(self.owner.congestions, 0)
        self.send("d")
        self.assertEqual(self.owner.congestions, 1)
        self.assertEqual(len(self.queue), 3)  # the owner closes; the queue does not guess

    def test_when_writable_waits_for_resume(self) -> None:
        self.assertTrue(self.queue.when_writable().called)
        self.queue.pauseProducing()
        waiting = self.queue.when_writable()
        self.assertFalse(waiting.called)
        self.queue.resumeProducing()
        self.assertTrue(waiting.called)

    def test_when_writable_does_not_wait_for_a_closed_connection(self) -> None:
        self.queue.pauseProducing()
        self.owner.is_open = False
        self.assertTrue(self.queue.when_writable().called)

    def test_stop_producing_drops_the_queue_and_releases_waiters(self) -> None:
        self.queue.pauseProducing()
        self.send("a", "b")
        waiting = self.queue.when_writable()
        self.transport.producer.stopProducing()
        self.assertEqual(len(self.queue), 0)
        self.assertTrue(waiting.called)
        self.assertEqual(take(self.transport), [])

    def test_nothing_is_flushed_to_a_closed_connection(self) -> None:
        self.queue.pauseProducing()
        self.send("a")
        self.owner.is_open = False
        self.queue.resumeProducing()
        self.assertEqual(take(self.transport), [])
