"""The outbound side of a replication connection: :class:`OutboundQueue`, a
streaming producer that queues commands while the transport is paused.

Congestion (server side): the protocol registers itself with its transport
as a streaming producer. While the transport has paused it, outgoing commands
wait in a queue of at most ``max_pending_commands``; the command that would
exceed it makes the protocol log loudly, count it, send
``ERROR too many pending commands`` and drop that connection. Other
connections are unaffected. Stream rows are written a page at a time
(``send_rows``: one transport write per page, so at most one page per
stream and writer sits in the transport's buffer), and the server's catch-up
loops (:mod:`~roomstore.replication.feed`) write no page while the
connection is paused and read at most ``read_ahead`` pages ahead, so a slow
but live client falls behind in the stream (the database) rather than in our
memory, and catches up when it drains. What
fills the queue past the limit is a client that stays paused while a page,
or other traffic (POSITIONs, ERRORs for its bad lines, broadcasts), arrives.
A client that stops reading altogether also stops sending PINGs and is
closed by the ping timeout.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from roomstore.replication import metrics
from roomstore.replication.commands import Command

__all__ = ["OutboundOwner", "OutboundQueue"]


class OutboundOwner(Protocol):
    """The connection an :class:`OutboundQueue` writes for."""

    @property
    def is_open(self) -> bool: ...

    def write_command(self, cmd: Command) -> None:
        """Write ``cmd`` to the transport now."""

    def congested(self) -> None:
        """The queue is full and another command came: the peer is not reading."""


@implementer(IPushProducer)
class OutboundQueue:
    """Commands waiting for a paused transport, and who waits to write.

    Registered with the transport as a streaming producer (on the server
    side), or paused and resumed by hand.
    """

    def __init__(self, owner: OutboundOwner, limit: int, conn_id: str) -> None:
        self._owner = owner
        self._limit = limit
        self._conn_id = conn_id
        self._paused = False
        self._pending: deque[Command] = deque()
        self._waiters: list[defer.Deferred[None]] = []

    @property
    def paused(self) -> bool:
        """True while the transport asked us to stop writing."""
        return self._paused

    def __len__(self) -> int:
        return len(self._pending)

    def send(self, cmd: Command) -> None:
        """Write ``cmd``, or queue it while paused; past the limit, tell the
        owner instead (it closes the connection, which empties the queue)."""
        if not self._paused:
            self._owner.write_command(cmd)
            return
        if len(self._pending) >= self._limit:
            self._owner.congested()
            return
        self._pending.append(cmd)
        metrics.PENDING_COMMANDS.labels(self._conn_id).set(len(self._pending))

    def when_writable(self) -> defer.Deferred[None]:
        """A Deferred that fires once not paused, or once the connection is
        gone (already fired if so now). Callers re-check the connection."""
        if not self._paused or not self._owner.is_open:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._waiters.append(d)
        return d

    def discard(self) -> None:
        """Drop what is queued (the connection is closing)."""
        self._pending.clear()
        try:
            metrics.PENDING_COMMANDS.remove(self._conn_id)
        except KeyError:
            pass

    def release_waiters(self) -> None:
        """Fire every :meth:`when_writable` Deferred."""
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(None)

    # -- IPushProducer (called by the transport) -------------------------

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        owner = self._owner
        # A write may make the transport pause us again: re-check every time.
        while self._pending and not self._paused and owner.is_open:
            owner.write_command(self._pending.popleft())
        if owner.is_open:
            metrics.PENDING_COMMANDS.labels(self._conn_id).set(len(self._pending))
        if not self._paused:
            self.release_waiters()

    def stopProducing(self) -> None:
        # The transport is going away; connectionLost follows.
        self._paused = True
        self.discard()
        self.release_waiters()
