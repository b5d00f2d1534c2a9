"""One replication connection, either side: its lifecycle and sending
(:class:`BaseReplicationProtocol`), built from the framing (:mod:`.framing`),
the command dispatch (:mod:`.dispatch`), the keep-alive (:mod:`.keepalive`)
and the outbound queue (:mod:`.outbound`). The server's and the worker's protocols are in
:mod:`.server_protocol` and :mod:`.client_protocol`.

A connection turns ``\\n``-terminated UTF-8 lines into
:mod:`~roomstore.replication.commands` values and back. What a command
*means* is not decided here: each side hands commands to a *session* object
built by its factory, so a protocol knows nothing of streams, databases or
caches.

Behaviour common to both sides (:class:`BaseReplicationProtocol`):

- Blank lines are ignored; one trailing ``\\r`` is tolerated (telnet).
- A line that is not UTF-8, does not parse, names an unknown command, or names
  a command this side never receives is answered with ``ERROR <reason>`` and
  otherwise ignored: **the connection stays open**. Framing is by newline, so
  one bad line cannot desynchronise the next, and a human poking at the port
  with netcat gets told what was wrong instead of being hung up on.
- A line longer than ``max_line_length`` bytes (default 16 KiB, Synapse's
  limit) *is* fatal (the rest of it would be parsed as garbage):
  ``ERROR line too long`` and close.
- Keep-alive: a ``PING`` is sent whenever nothing was sent for
  ``ping_interval`` seconds. Once the peer has sent its first ``PING``, a peer
  silent for ``ping_timeout`` seconds gets ``ERROR ping timeout`` and is
  closed. Timeouts stay off until then so that netcat users are not cut off.
- Closing always goes through :meth:`~BaseReplicationProtocol.close`: if the
  transport has not reported the connection lost ``close_timeout`` seconds
  after ``loseConnection()``, it is aborted.
- All timers come from the injected ``clock`` (an ``IReactorTime``).

Outgoing lines longer than ``max_line_length`` are not sent but logged as
errors: the peer would drop the connection and, after reconnecting, be sent
the same line again. Stream rows never get that far: the feed splits a long
row (a large cache invalidation) into several rows at one token, or, for a
row that cannot be split, tells the client to fetch that token itself
(:mod:`~roomstore.replication.feed`).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from roomstore.replication import metrics
from roomstore.replication.commands import (
    Command,
    ErrorCommand,
    PingCommand,
    RdataCommand,
    decode_row,
    describe,
    serialize_command,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.dispatch import CloseConnection, CommandDispatcher, LogLimiter
from roomstore.replication.framing import LineFramedProtocol
from roomstore.replication.keepalive import KeepAlive
from roomstore.replication.outbound import OutboundQueue

__all__ = ["BaseReplicationProtocol", "CloseConnection"]


class _State(enum.Enum):
    NEW = "new"  # constructed, no transport yet
    OPEN = "open"
    CLOSING = "closing"  # loseConnection called, waiting for connectionLost
    CLOSED = "closed"


_connection_ids = itertools.count(1)


class BaseReplicationProtocol(LineFramedProtocol):
    """Framing, dispatch, keep-alive, congestion and closing for one connection.

    Subclasses set ``SIDE`` (metrics label), ``INBOUND_COMMANDS`` (names this
    side accepts) and extend :meth:`command_handlers` with a handler for each
    of them other than PING and ERROR, plus :meth:`on_connected` for the
    start-up commands.

    Callers outside the protocol use :meth:`send_command`, :meth:`close`,
    :meth:`close_with_error`, :attr:`is_open`, :attr:`paused` and
    :meth:`when_writable`; everything else is internal.
    """

    SIDE: ClassVar[str] = "base"
    INBOUND_COMMANDS: ClassVar[frozenset[str]] = frozenset()
    #: Whether to register with the transport as a streaming producer.
    REGISTER_AS_PRODUCER: ClassVar[bool] = False

    log = Logger()

    def __init__(self, clock: IReactorTime, config: ReplicationConfig) -> None:
        self.clock = clock
        self.config = config
        self.MAX_LENGTH = config.max_line_length
        self.conn_id = f"{self.SIDE}-{next(_connection_ids)}"
        #: Name the peer gave (NAME on the server side, SERVER on the client).
        self.peer_name: str | None = None

        self._state = _State.NEW
        self.keepalive = KeepAlive(self, clock, config.ping_interval, config.ping_timeout)
        self._abort_call: IDelayedCall | None = None
        self._auth_call: IDelayedCall | None = None

        #: The queue for a paused transport; the transport's producer.
        self.outbound = OutboundQueue(self, config.max_pending_commands, self.conn_id)
        handlers = self.command_handlers()
        if handlers.keys() != self.INBOUND_COMMANDS:
            raise TypeError(f"{type(self).__name__} handles {sorted(handlers)}, not {sorted(self.INBOUND_COMMANDS)}")
        #: Parses each line and hands it to its command's handler.
        self.dispatcher = CommandDispatcher(self, self.SIDE, handlers, clock)
        self._peer_error_log = LogLimiter(clock)

    # -- state seen from outside ------------------------------------------

    @property
    def is_open(self) -> bool:
        """True from connectionMade until a close starts."""
        return self._state is _State.OPEN

    @property
    def paused(self) -> bool:
        """True while the transport asked us to stop writing."""
        return self.outbound.paused

    @property
    def pending_count(self) -> int:
        return len(self.outbound)

    def when_writable(self) -> defer.Deferred[None]:
        """A Deferred that fires once the connection is not paused, or is gone.

        Already fired if that is the case now. Callers must re-check
        :attr:`is_open` afterwards.
        """
        return self.outbound.when_writable()

    # -- connection lifecycle ---------------------------------------------

    def connectionMade(self) -> None:
        self._state = _State.OPEN
        self.keepalive.reset()
        metrics.CONNECTIONS.labels(self.SIDE).inc()
        peer = self.transport.getPeer()
        self.log.info("[{conn_id}] replication connection with {peer}", conn_id=self.conn_id, peer=peer)
        self._size_socket_io()
        if self.REGISTER_AS_PRODUCER:
            self.transport.registerProducer(self.outbound, True)
        self.on_connected()
        if self._state is _State.OPEN:
            self.keepalive.start()

    def _size_socket_io(self) -> None:
        """On a socket transport (Twisted's TCP), take ``read_size`` bytes
        per read where nothing else depends on its buffer size (a side that
        is no producer: there it is also the bound that pauses one) and give
        ``write_size`` per send, rather than 64 KiB and 128 KiB: a catching-up
        worker wakes once per few pages rather than twice per page."""
        transport = self.transport
        if not self.REGISTER_AS_PRODUCER and type(getattr(transport, "bufferSize", None)) is int:
            transport.bufferSize = self.config.read_size
        if type(getattr(transport, "SEND_LIMIT", None)) is int:
            transport.SEND_LIMIT = self.config.write_size

    def on_connected(self) -> None:
        """Send the start-up commands. Called once from connectionMade."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        previous = self._state
        if previous is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self.keepalive.stop()
        self._cancel_timers("_abort_call", "_auth_call")
        self.outbound.discard()
        self.outbound.release_waiters()
        if previous is _State.NEW:
            return
        metrics.CONNECTIONS.labels(self.SIDE).dec()
        self.log.info(
            "[{conn_id}] replication connection lost: {reason}",
            conn_id=self.conn_id,
            reason=reason.getErrorMessage() if isinstance(reason, Failure) else reason,
        )
        self._notify_session_lost()

    def _cancel_timers(self, *names: str) -> None:
        for name in names:
            call: IDelayedCall | None = getattr(self, name)
            if call is not None and call.active():
                call.cancel()
            setattr(self, name, None)

    def _notify_session_lost(self) -> None:
        """Tell the session the connection went; subclasses override."""

    def close(self) -> None:
        """Start closing the connection (idempotent).

        Commands still queued for a paused transport are dropped. If the
        transport does not report the connection lost within
        ``close_timeout`` seconds (the peer stopped reading, so the kernel
        buffer never drains), the transport is aborted.
        """
        if self._state is not _State.OPEN:
            return
        self._state = _State.CLOSING
        self.keepalive.stop()
        self._cancel_timers("_auth_call")
        self.outbound.discard()
        self.outbound.release_waiters()
        # Scheduled before loseConnection: some transports call connectionLost
        # synchronously, which cancels it.
        self._abort_call = self.clock.callLater(self.config.close_timeout, self._abort)
        self.transport.loseConnection()

    def close_with_error(self, message: str) -> None:
        """Send ``ERROR <message>`` and close. The ERROR skips the pending
        queue: it is written to the transport even while paused."""
        if self._state is not _State.OPEN:
            return
        self.outbound.discard()
        self._write(ErrorCommand(_one_line(message)))
        self.close()

    def _abort(self) -> None:
        self._abort_call = None
        if self._state is _State.CLOSING:
            self.log.warn(
                "[{conn_id}] connection did not close within {timeout}s; aborting",
                conn_id=self.conn_id,
                timeout=self.config.close_timeout,
            )
            self.transport.abortConnection()

    # -- sending -------------------------------------------------------------

    def send_command(self, cmd: Command) -> None:
        """Queue or write ``cmd``. Does nothing once the connection is closing.

        While paused, the command waits in the pending queue; if the queue is
        already full (``max_pending_commands``), the connection is dropped
        instead (see module docstring).
        """
        if self._state is not _State.OPEN:
            return
        self.outbound.send(cmd)

    def send_rows(self, stream_name: str, instance_name: str, items: Sequence[Any]) -> None:
        """Send a page of a stream: RDATA lines for ``(token or None, row,
        row_json)`` items (``row_json`` being ``encode_row(row)``, ``None``
        for ``batch``; ``row`` may be None, decoded from ``row_json`` where
        a command object needs it) and any commands among them, in order.

        While the connection is writable the page goes out in one transport
        write, built as lines without a command object per row; while it is
        paused, each item goes through :meth:`send_command` (and the pending
        queue) as an :class:`RdataCommand`.
        """
        if self._state is not _State.OPEN:
            return
        if self.outbound.paused:
            for item in items:
                if type(item) is tuple:
                    item = _rdata_command(stream_name, instance_name, item)
                self.send_command(item)
            return
        limit = self.config.max_line_length
        prefix = f"RDATA {stream_name} {instance_name} "
        if self._send_plain_rows(prefix, items, limit):
            return
        lines = []
        counts: dict[str, int] = {}
        rdata = 0
        for item in items:
            if type(item) is tuple:
                token, row, row_json = item
                line = f"{prefix}{'batch' if token is None else token} {row_json}"
                name = "RDATA"
            else:
                line = serialize_command(item)
                name = item.NAME
            # An ASCII str has as many bytes as characters (and says so in O(1)).
            length = len(line) if line.isascii() else len(line.encode("utf-8"))
            if length > limit:
                self._refuse_long_line(
                    _rdata_command(stream_name, instance_name, item) if type(item) is tuple else item,
                    length,
                )
                continue
            lines.append(line)
            if name == "RDATA":
                rdata += 1
            else:
                counts[name] = counts.get(name, 0) + 1
        if not lines:
            return
        lines.append("")
        data = "\n".join(lines).encode("utf-8")
        self.transport.write(data)
        self.keepalive.sent()
        if rdata:
            counts["RDATA"] = rdata
        for name, count in counts.items():
            metrics.child(metrics.COMMANDS_SENT, self.SIDE, name).inc(count)
        metrics.child(metrics.BYTES_SENT, self.SIDE).inc(len(data))

    def _send_plain_rows(self, prefix: str, items: Sequence[Any], limit: int) -> bool:
        """``send_rows`` for a page of rows only (no commands), every line
        ASCII and within ``limit``: the usual page, written without a step
        per row beyond a list comprehension. False, having sent nothing,
        for any other page."""
        if not items:
            return False
        try:
            lines = [f"{prefix}{'batch' if token is None else token} {row_json}" for token, _row, row_json in items]
        except TypeError:  # a command among the rows: it does not unpack
            return False
        lines.append("")
        text = "\n".join(lines)
        if not text.isascii() or max(map(len, lines)) > limit:
            return False
        self.transport.write(text.encode("ascii"))
        self.keepalive.sent()
        metrics.child(metrics.COMMANDS_SENT, self.SIDE, "RDATA").inc(len(items))
        metrics.child(metrics.BYTES_SENT, self.SIDE).inc(len(text))
        return True

    def send_rdata_text(self, text: str, count: int) -> bool:
        """Write a page of ``count`` RDATA lines made already (``text``: the
        lines, each ending in a newline, ASCII, none over the line limit:
        the caller checked) in one write. False, having written nothing,
        while the connection is paused or closing: the caller sends the
        page's items through :meth:`send_rows` instead."""
        if self._state is not _State.OPEN or self.outbound.paused:
            return False
        self.transport.write(text.encode("ascii"))
        self.keepalive.sent()
        metrics.child(metrics.COMMANDS_SENT, self.SIDE, "RDATA").inc(count)
        metrics.child(metrics.BYTES_SENT, self.SIDE).inc(len(text))
        return True

    def send_error(self, message: str) -> None:
        """Send ``ERROR <message>`` without closing."""
        self.send_command(ErrorCommand(_one_line(message)))

    def _write(self, cmd: Command) -> None:
        line = serialize_command(cmd).encode("utf-8")
        if len(line) > self.config.max_line_length:
            self._refuse_long_line(cmd, len(line))
            return
        self.transport.write(line + self.delimiter)
        self.keepalive.sent()
        metrics.child(metrics.COMMANDS_SENT, self.SIDE, cmd.NAME).inc()
        metrics.child(metrics.BYTES_SENT, self.SIDE).inc(len(line) + 1)

    def _refuse_long_line(self, cmd: Command, length: int) -> None:
        # The peer would drop the connection, we would reconnect and send
        # it again: refuse loudly instead of looping.
        self.log.error(
            "[{conn_id}] not sending {command}: line of {length} bytes exceeds {limit}",
            conn_id=self.conn_id,
            command=cmd.NAME,
            length=length,
            limit=self.config.max_line_length,
        )

    # -- OutboundOwner -----------------------------------------------------

    def write_command(self, cmd: Command) -> None:
        self._write(cmd)

    def congested(self) -> None:
        self.log.error(
            "[{conn_id}] peer {peer} is not reading: {count} commands pending; dropping connection",
            conn_id=self.conn_id,
            peer=self.peer_name,
            count=len(self.outbound),
        )
        metrics.CONGESTION_DISCONNECTS.inc()
        self.close_with_error("too many pending commands")

    # -- receiving -----------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._state is not _State.OPEN:
            return  # closing: whatever else the peer says is moot
        # Any bytes prove the peer is alive, even the middle of a long line.
        self.keepalive.received()
        metrics.child(metrics.BYTES_RECEIVED, self.SIDE).inc(len(data))
        try:
            super().dataReceived(data)
        finally:
            self.dispatcher.flush_counts()

    def lineLengthExceeded(self, line: bytes) -> None:
        self.discard_partial_line()
        metrics.INVALID_LINES.labels(self.SIDE, "too_long").inc()
        self.log.warn(
            "[{conn_id}] line of {length} bytes exceeds {limit}; closing",
            conn_id=self.conn_id,
            length=len(line),
            limit=self.MAX_LENGTH,
        )
        self.close_with_error("line too long")

    def lineReceived(self, line: bytes) -> None:
        """Parse and dispatch one line. Never raises."""
        if self._state is _State.OPEN:
            self.dispatcher.line(line)

    # -- commands both sides receive ---------------------------------------

    def command_handlers(self) -> dict[str, Callable[[Any], Any]]:
        """The handler of each name in ``INBOUND_COMMANDS``; a side adds its
        own to these."""
        return {"PING": self.on_PING, "ERROR": self.on_ERROR}

    def on_PING(self, cmd: PingCommand) -> None:
        self.keepalive.peer_pinged()

    def on_ERROR(self, cmd: ErrorCommand) -> None:
        suppressed = self._peer_error_log.allow()
        if suppressed is not None:
            self.log.error(
                "[{conn_id}] peer {peer} sent ERROR: {text}",
                conn_id=self.conn_id,
                peer=self.peer_name,
                text=describe(cmd.message, 200),
            )

    # -- keep-alive (KeepAliveOwner) ---------------------------------------

    def send_ping(self) -> None:
        self.send_command(self._ping_now())

    def peer_timed_out(self, silent_for: float) -> None:
        self.log.warn(
            "[{conn_id}] peer {peer} silent for {silent:.1f}s; closing",
            conn_id=self.conn_id,
            peer=self.peer_name,
            silent=silent_for,
        )
        self.close_with_error("ping timeout")

    def _ping_now(self) -> PingCommand:
        return PingCommand(str(int(self.clock.seconds() * 1000)))


def _rdata_command(stream_name: str, instance_name: str, item: tuple) -> RdataCommand:
    """The RDATA command of a ``send_rows`` item."""
    token, row, row_json = item
    return RdataCommand.from_encoded(
        stream_name, instance_name, token, decode_row(row_json) if row is None else row, row_json
    )


def _one_line(message: str) -> str:
    return message.replace("\r", " ").replace("\n", " ")
