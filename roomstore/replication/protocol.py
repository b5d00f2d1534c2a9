"""The line protocol of TCP replication: framing, keep-alive, congestion.

A connection is a :class:`ServerReplicationProtocol` on the main process and a
:class:`ClientReplicationProtocol` on a worker. Both are
``LineOnlyReceiver`` subclasses that turn ``\\n``-terminated UTF-8 lines into
:mod:`~roomstore.replication.commands` values and back. What a command
*means* is not decided here: each protocol hands commands to a *session*
object built by its factory (:mod:`.server` and :mod:`.client` provide them),
so the protocol knows nothing of streams, databases or caches.

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

Congestion (server side): the protocol registers itself with its transport
as a streaming producer. While the transport has paused it, outgoing commands
wait in a queue of at most ``max_pending_commands``; the command that would
exceed it makes the protocol log loudly, count it, send
``ERROR too many pending commands`` and drop that connection. Other
connections are unaffected. Stream rows are written a page at a time
(``send_rows``: one transport write per page, so at most one page per
stream and writer sits in the transport's buffer), and the server's catch-up
loops (:mod:`~roomstore.replication.feed`) do not read the next page while
the connection is paused, so a slow but live client falls behind in the
stream (the database) rather than in our memory, and catches up when it
drains. What
fills the queue past the limit is a client that stays paused while a page,
or other traffic (POSITIONs, ERRORs for its bad lines, broadcasts), arrives.
A client that stops reading altogether also stops sending PINGs and is
closed by the ping timeout.

Outgoing lines longer than ``max_line_length`` are not sent but logged as
errors: the peer would drop the connection and, after reconnecting, be sent
the same line again. Stream rows never get that far: the feed splits a long
row (a large cache invalidation) into several rows at one token, or, for a
row that cannot be split, tells the client to fetch that token itself
(:mod:`~roomstore.replication.feed`).

Shared secret (an extension of Synapse's protocol): a server given a
``secret`` requires ``AUTH <secret>`` as the first non-blank line of every
connection. Anything else (another command, a wrong secret, garbage, or
nothing for ``ping_timeout`` seconds) gets ``ERROR authentication failed``
and a close; the secret is compared as a SHA-256 digest with
``hmac.compare_digest``, so neither its value nor its length leaks through
timing. Until then the connection is sent only SERVER and PINGs. A server
without a secret accepts and ignores AUTH, so clients configured with one
still work against it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
from collections import deque
from typing import Any, Callable, ClassVar, Protocol, Sequence

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure
from zope.interface import implementer

from roomstore.replication import metrics
from roomstore.replication.commands import (
    CLIENT_SENT_COMMANDS,
    AuthCommand,
    MAX_LINE_LENGTH,
    SERVER_SENT_COMMANDS,
    Command,
    CommandParseError,
    ErrorCommand,
    LockReleasedCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    UnknownCommandError,
    describe,
    parse_command_from_line,
    serialize_command,
)
from roomstore.replication.streams import UnknownStreamError

__all__ = [
    "BaseReplicationProtocol",
    "ClientReplicationProtocol",
    "ClientSession",
    "CloseConnection",
    "ReplicationConfig",
    "ServerReplicationProtocol",
    "ServerSession",
]


def _positive(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen
class ReplicationConfig:
    """Tunables shared by both sides of a connection. Times are in seconds."""

    #: Send a PING when nothing else was sent for this long.
    ping_interval: float = attrs.field(default=5.0, validator=_positive)
    #: After the peer's first PING, close if it is silent for this long.
    ping_timeout: float = attrs.field(default=15.0, validator=_positive)
    #: Abort the transport if a close has not completed after this long.
    close_timeout: float = attrs.field(default=5.0, validator=_positive)
    #: Longest line accepted, in bytes without the delimiter.
    max_line_length: int = attrs.field(default=MAX_LINE_LENGTH, validator=_positive)
    #: Commands buffered for a paused connection before it is dropped; on the
    #: client, stream commands queued behind a slow fetch before it gives up.
    max_pending_commands: int = attrs.field(default=10_000, validator=_positive)
    #: Rows per ``get_updates`` call when catching a connection up.
    page_size: int = attrs.field(default=100, validator=_positive)
    #: Most ``batch`` rows a client buffers while waiting for the token line.
    max_batch_rows: int = attrs.field(default=10_000, validator=_positive)


class CloseConnection(Exception):
    """Raised by a session to make its protocol send ``ERROR <message>``
    and close the connection (the peer broke the protocol)."""


class ServerSession(Protocol):
    """What a server protocol hands its commands to (one per connection).

    Built by the factory with the protocol as argument; the protocol calls it
    from the reactor thread only.
    """

    def on_connection_made(self) -> None:
        """The connection is open and SERVER/PING have been sent."""

    def on_replicate(self, cmd: ReplicateCommand) -> None:
        """Answer a REPLICATE. Raises UnknownStreamError, before doing anything,
        if it names a stream that does not exist."""

    def on_client_command(self, cmd: Command) -> None:
        """USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK, REMOTE_SERVER_UP,
        USER_IP, LOCK_RELEASED, NEW_ACTIVE_TASK or CANCEL_TASK."""

    def on_connection_lost(self) -> None:
        """The connection is gone; stop sending to it."""


class ClientSession(Protocol):
    """What a client protocol hands its commands to (one per connection)."""

    def replicate_commands(self) -> Sequence[ReplicateCommand]:
        """The REPLICATE commands to send on connect, in order."""

    def on_server_verified(self) -> None:
        """The server named itself as expected."""

    def on_rdata(self, cmd: RdataCommand) -> None:
        """A row arrived. May raise CloseConnection."""

    def on_position(self, cmd: PositionCommand) -> None:
        """A stream position arrived. May raise CloseConnection."""

    def on_remote_server_up(self, cmd: RemoteServerUpCommand) -> None:
        """The server reports a remote homeserver may be back."""

    def on_lock_released(self, cmd: LockReleasedCommand) -> None:
        """The server reports an instance released a lock."""

    def on_connection_lost(self) -> None:
        """The connection is gone."""


class _State(enum.Enum):
    NEW = "new"  # constructed, no transport yet
    OPEN = "open"
    CLOSING = "closing"  # loseConnection called, waiting for connectionLost
    CLOSED = "closed"


class _LogLimiter:
    """Lets one log line through per ``interval`` seconds and counts the rest,
    so a peer flooding us with bad lines cannot flood the logs too."""

    def __init__(self, clock: IReactorTime, interval: float = 10.0) -> None:
        self._clock = clock
        self._interval = interval
        self._next_at = float("-inf")
        self._suppressed = 0

    def allow(self) -> int | None:
        """Return how many lines were suppressed since the last allowed one,
        or None if this one should be suppressed too."""
        now = self._clock.seconds()
        if now < self._next_at:
            self._suppressed += 1
            return None
        self._next_at = now + self._interval
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed


# Float timers from a reactor can land a hair before the deadline.
_EPSILON = 1e-3

_connection_ids = itertools.count(1)


def _log_failure(log: Logger, what: str) -> Callable[[Failure], None]:
    def errback(failure: Failure) -> None:
        log.failure("Unhandled error in {what}", failure=failure, what=what)

    return errback


@implementer(IPushProducer)
class BaseReplicationProtocol(LineOnlyReceiver):
    """Framing, dispatch, keep-alive, congestion and closing for one connection.

    Subclasses set ``SIDE`` (metrics label), ``INBOUND_COMMANDS`` (names this
    side accepts) and define ``on_<NAME>(cmd)`` for each of them other than
    PING and ERROR, plus :meth:`on_connected` for the start-up commands.

    Callers outside the protocol use :meth:`send_command`, :meth:`close`,
    :meth:`close_with_error`, :attr:`is_open`, :attr:`paused` and
    :meth:`when_writable`; everything else is internal.
    """

    delimiter = b"\n"
    SIDE: ClassVar[str] = "base"
    INBOUND_COMMANDS: ClassVar[frozenset[str]] = frozenset()
    #: Whether to register with the transport as a streaming producer.
    REGISTER_AS_PRODUCER: ClassVar[bool] = False

    log = Logger()

    def __init__(self, clock: IReactorTime, config: ReplicationConfig) -> None:
        self.clock = clock
        self.config = config
        # LineOnlyReceiver reads MAX_LENGTH from the instance.
        self.MAX_LENGTH = config.max_line_length
        self.conn_id = f"{self.SIDE}-{next(_connection_ids)}"
        #: Name the peer gave (NAME on the server side, SERVER on the client).
        self.peer_name: str | None = None

        self._state = _State.NEW
        self._last_sent = 0.0
        self._last_received = 0.0
        self._ping_seen = False
        self._keepalive_call: IDelayedCall | None = None
        self._timeout_call: IDelayedCall | None = None
        self._abort_call: IDelayedCall | None = None
        self._auth_call: IDelayedCall | None = None

        self._paused = False
        self._pending: deque[Command] = deque()
        self._writable_waiters: list[defer.Deferred[None]] = []
        self._bad_line_log = _LogLimiter(clock)
        self._received_counts: dict[str, int] = {}
        self._peer_error_log = _LogLimiter(clock)

    # -- state seen from outside ------------------------------------------

    @property
    def is_open(self) -> bool:
        """True from connectionMade until a close starts."""
        return self._state is _State.OPEN

    @property
    def paused(self) -> bool:
        """True while the transport asked us to stop writing."""
        return self._paused

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def when_writable(self) -> defer.Deferred[None]:
        """A Deferred that fires once the connection is not paused, or is gone.

        Already fired if that is the case now. Callers must re-check
        :attr:`is_open` afterwards.
        """
        if not self._paused or self._state is not _State.OPEN:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._writable_waiters.append(d)
        return d

    # -- connection lifecycle ---------------------------------------------

    def connectionMade(self) -> None:
        self._state = _State.OPEN
        now = self.clock.seconds()
        self._last_sent = self._last_received = now
        metrics.CONNECTIONS.labels(self.SIDE).inc()
        peer = self.transport.getPeer()
        self.log.info("[{conn_id}] replication connection with {peer}", conn_id=self.conn_id, peer=peer)
        if self.REGISTER_AS_PRODUCER:
            self.transport.registerProducer(self, True)
        self.on_connected()
        if self._state is _State.OPEN:
            self._schedule_keepalive()

    def on_connected(self) -> None:
        """Send the start-up commands. Called once from connectionMade."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        previous = self._state
        if previous is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._cancel_timers("_keepalive_call", "_timeout_call", "_abort_call", "_auth_call")
        self._drop_pending()
        self._release_writable_waiters()
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
        self._cancel_timers("_keepalive_call", "_timeout_call", "_auth_call")
        self._drop_pending()
        self._release_writable_waiters()
        # Scheduled before loseConnection: some transports call connectionLost
        # synchronously, which cancels it.
        self._abort_call = self.clock.callLater(self.config.close_timeout, self._abort)
        self.transport.loseConnection()

    def close_with_error(self, message: str) -> None:
        """Send ``ERROR <message>`` and close. The ERROR skips the pending
        queue: it is written to the transport even while paused."""
        if self._state is not _State.OPEN:
            return
        self._drop_pending()
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
        if self._paused:
            if len(self._pending) >= self.config.max_pending_commands:
                self._on_congested()
                return
            self._pending.append(cmd)
            metrics.PENDING_COMMANDS.labels(self.conn_id).set(len(self._pending))
            return
        self._write(cmd)

    def send_rows(self, stream_name: str, instance_name: str, items: Sequence[Any]) -> None:
        """Send a page of a stream: RDATA lines for ``(token or None, row,
        row_json)`` items (``row_json`` being ``encode_row(row)``, ``None``
        for ``batch``) and any commands among them, in order.

        While the connection is writable the page goes out in one transport
        write, built as lines without a command object per row; while it is
        paused, each item goes through :meth:`send_command` (and the pending
        queue) as an :class:`RdataCommand`.
        """
        if self._state is not _State.OPEN:
            return
        if self._paused:
            for item in items:
                if type(item) is tuple:
                    item = RdataCommand.from_encoded(stream_name, instance_name, *item)
                self.send_command(item)
            return
        limit = self.config.max_line_length
        prefix = f"RDATA {stream_name} {instance_name} "
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
                    RdataCommand.from_encoded(stream_name, instance_name, *item) if type(item) is tuple else item,
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
        self._last_sent = self.clock.seconds()
        if rdata:
            counts["RDATA"] = rdata
        for name, count in counts.items():
            metrics.child(metrics.COMMANDS_SENT, self.SIDE, name).inc(count)
        metrics.child(metrics.BYTES_SENT, self.SIDE).inc(len(data))

    def send_error(self, message: str) -> None:
        """Send ``ERROR <message>`` without closing."""
        self.send_command(ErrorCommand(_one_line(message)))

    def _write(self, cmd: Command) -> None:
        line = serialize_command(cmd).encode("utf-8")
        if len(line) > self.config.max_line_length:
            self._refuse_long_line(cmd, len(line))
            return
        self.transport.write(line + self.delimiter)
        self._last_sent = self.clock.seconds()
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

    def _on_congested(self) -> None:
        self.log.error(
            "[{conn_id}] peer {peer} is not reading: {count} commands pending; dropping connection",
            conn_id=self.conn_id,
            peer=self.peer_name,
            count=len(self._pending),
        )
        metrics.CONGESTION_DISCONNECTS.inc()
        self.close_with_error("too many pending commands")

    def _drop_pending(self) -> None:
        if self._pending:
            self._pending.clear()
        try:
            metrics.PENDING_COMMANDS.remove(self.conn_id)
        except KeyError:
            pass

    def _release_writable_waiters(self) -> None:
        waiters, self._writable_waiters = self._writable_waiters, []
        for d in waiters:
            d.callback(None)

    # -- IPushProducer (called by the transport) -------------------------

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        # A write may make the transport pause us again: re-check every time.
        while self._pending and not self._paused and self._state is _State.OPEN:
            self._write(self._pending.popleft())
        if self._state is _State.OPEN:
            metrics.PENDING_COMMANDS.labels(self.conn_id).set(len(self._pending))
        if not self._paused:
            self._release_writable_waiters()

    def stopProducing(self) -> None:
        # The transport is going away; connectionLost follows.
        self._paused = True
        self._drop_pending()
        self._release_writable_waiters()

    # -- receiving -----------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._state is not _State.OPEN:
            return  # closing: whatever else the peer says is moot
        # Any bytes prove the peer is alive, even the middle of a long line.
        self._last_received = self.clock.seconds()
        metrics.child(metrics.BYTES_RECEIVED, self.SIDE).inc(len(data))
        try:
            super().dataReceived(data)
        finally:
            self._count_received()

    def lineLengthExceeded(self, line: bytes) -> None:
        self._buffer = b""  # don't hold on to a huge partial line
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
        if self._state is not _State.OPEN:
            return
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            self._reject_line("bad_utf8", "line is not valid UTF-8", line)
            return
        if not text or text.isspace():
            return
        try:
            cmd = parse_command_from_line(text)
        except UnknownCommandError as e:
            self._reject_line("unknown_command", e.reason, line)
            return
        except CommandParseError as e:
            # Not an UnknownCommandError, so the first word is a known name.
            name = text.partition(" ")[0]
            self._reject_line("malformed", f"failed to parse {name}: {e.reason}", line)
            return
        except Exception:  # a parser bug must not take the connection down
            self.log.failure("[{conn_id}] parser crashed on {line}", conn_id=self.conn_id, line=describe(text))
            self._reject_line("malformed", "failed to parse line", line)
            return
        if cmd.NAME not in self.INBOUND_COMMANDS:
            self._reject_line("unexpected_command", f"unexpected command {cmd.NAME}", line)
            return
        name = cmd.NAME
        counts = self._received_counts
        counts[name] = counts.get(name, 0) + 1
        self._dispatch(cmd)

    def _count_received(self) -> None:
        # Counted per line, added to Prometheus per read: a counter's inc
        # takes a lock, which costs more than the rest of the bookkeeping.
        counts = self._received_counts
        if counts:
            for name, count in counts.items():
                metrics.child(metrics.COMMANDS_RECEIVED, self.SIDE, name).inc(count)
            counts.clear()

    def _dispatch(self, cmd: Command) -> None:
        handler: Callable[[Any], Any] = getattr(self, "on_" + cmd.NAME)
        try:
            result = handler(cmd)
        except CloseConnection as e:
            self.log.warn(
                "[{conn_id}] closing: {text}", conn_id=self.conn_id, text=str(e)
            )
            self.close_with_error(str(e))
            return
        except Exception:
            self.log.failure("[{conn_id}] error handling {command}", conn_id=self.conn_id, command=cmd.NAME)
            self.send_error(f"internal error handling {cmd.NAME}")
            return
        if result is not None and isinstance(result, defer.Deferred):
            result.addErrback(_log_failure(self.log, f"{self.conn_id} {cmd.NAME}"))

    def _reject_line(self, kind: str, reason: str, line: bytes) -> None:
        metrics.INVALID_LINES.labels(self.SIDE, kind).inc()
        suppressed = self._bad_line_log.allow()
        if suppressed is not None:
            self.log.warn(
                "[{conn_id}] bad line from {peer}: {reason} (line {line}; {suppressed} more suppressed)",
                conn_id=self.conn_id,
                peer=self.peer_name,
                reason=reason,
                line=describe(line.decode("utf-8", "replace")),
                suppressed=suppressed,
            )
        self.send_error(reason)

    # -- commands both sides receive ---------------------------------------

    def on_PING(self, cmd: PingCommand) -> None:
        if not self._ping_seen:
            self._ping_seen = True  # the peer speaks the protocol: time it out
            self._schedule_timeout_check()

    def on_ERROR(self, cmd: ErrorCommand) -> None:
        suppressed = self._peer_error_log.allow()
        if suppressed is not None:
            self.log.error(
                "[{conn_id}] peer {peer} sent ERROR: {text}",
                conn_id=self.conn_id,
                peer=self.peer_name,
                text=describe(cmd.message, 200),
            )

    # -- timers ----------------------------------------------------------------

    def _schedule_keepalive(self) -> None:
        delay = max(0.0, self._last_sent + self.config.ping_interval - self.clock.seconds())
        self._keepalive_call = self.clock.callLater(delay, self._keepalive)

    def _keepalive(self) -> None:
        self._keepalive_call = None
        if self._state is not _State.OPEN:
            return
        now = self.clock.seconds()
        if self._paused:
            # Nothing can be written now; a queued PING would only add to the
            # backlog. Look again in a full interval.
            self._keepalive_call = self.clock.callLater(self.config.ping_interval, self._keepalive)
            return
        if now - self._last_sent >= self.config.ping_interval - _EPSILON:
            self.send_command(self._ping_now())
        if self._state is _State.OPEN:
            self._schedule_keepalive()

    def _schedule_timeout_check(self) -> None:
        delay = max(0.0, self._last_received + self.config.ping_timeout - self.clock.seconds())
        self._timeout_call = self.clock.callLater(delay, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timeout_call = None
        if self._state is not _State.OPEN:
            return
        silent_for = self.clock.seconds() - self._last_received
        if silent_for >= self.config.ping_timeout - _EPSILON:
            self.log.warn(
                "[{conn_id}] peer {peer} silent for {silent:.1f}s; closing",
                conn_id=self.conn_id,
                peer=self.peer_name,
                silent=silent_for,
            )
            self.close_with_error("ping timeout")
            return
        self._schedule_timeout_check()

    def _ping_now(self) -> PingCommand:
        return PingCommand(str(int(self.clock.seconds() * 1000)))


def _one_line(message: str) -> str:
    return message.replace("\r", " ").replace("\n", " ")


class ServerReplicationProtocol(BaseReplicationProtocol):
    """The main process's end of one replication connection.

    On connect it sends ``SERVER <server_name>`` and ``PING``. It accepts the
    commands clients send (:data:`~.commands.CLIENT_SENT_COMMANDS`) and hands
    ``REPLICATE`` and the client notifications to its :class:`ServerSession`,
    which its factory builds through ``session_factory(protocol)``. An unknown
    stream in ``REPLICATE`` is answered with a warning and ``ERROR``; the
    connection stays open. With a ``secret``, every line before a correct
    ``AUTH`` is refused and closes the connection (see the module docstring).
    """

    SIDE = "server"
    INBOUND_COMMANDS = CLIENT_SENT_COMMANDS
    REGISTER_AS_PRODUCER = True

    def __init__(
        self,
        server_name: str,
        clock: IReactorTime,
        session_factory: Callable[["ServerReplicationProtocol"], ServerSession],
        config: ReplicationConfig = ReplicationConfig(),
        secret: str | None = None,
    ) -> None:
        super().__init__(clock, config)
        self.server_name = server_name
        # Only the digest is kept: comparing digests takes the same time
        # whatever the length of what the peer sent.
        self._secret_digest = None if secret is None else hashlib.sha256(secret.encode("utf-8")).digest()
        self._authenticated = secret is None
        self.session = session_factory(self)

    @property
    def authenticated(self) -> bool:
        """True once the peer sent the right AUTH (always, without a secret)."""
        return self._authenticated

    def on_connected(self) -> None:
        self.send_command(ServerCommand(self.server_name))
        self.send_command(self._ping_now())
        if not self._authenticated:
            self._auth_call = self.clock.callLater(self.config.ping_timeout, self._auth_timed_out)
        self.session.on_connection_made()

    def lineReceived(self, line: bytes) -> None:
        if self._authenticated:
            super().lineReceived(line)
            return
        if self._state is not _State.OPEN:
            return
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            return  # blank lines are ignored, as always
        name, _, given = line.partition(b" ")
        assert self._secret_digest is not None
        if name == b"AUTH" and hmac.compare_digest(hashlib.sha256(given).digest(), self._secret_digest):
            self._authenticated = True
            self._cancel_timers("_auth_call")
            metrics.COMMANDS_RECEIVED.labels(self.SIDE, AuthCommand.NAME).inc()
            self.log.info("[{conn_id}] peer authenticated", conn_id=self.conn_id)
            return
        self._refuse("wrong_secret" if name == b"AUTH" else "no_auth")

    def _auth_timed_out(self) -> None:
        self._auth_call = None
        if self._state is _State.OPEN and not self._authenticated:
            self._refuse("timeout")

    def _refuse(self, reason: str) -> None:
        # Never log what the peer sent: it may be a near-miss of the secret.
        metrics.AUTH_FAILURES.labels(reason).inc()
        self.log.warn(
            "[{conn_id}] replication authentication failed ({reason}) for {peer}; closing",
            conn_id=self.conn_id,
            reason=reason,
            peer=self.transport.getPeer(),
        )
        self.close_with_error("authentication failed")

    def on_AUTH(self, cmd: AuthCommand) -> None:
        """AUTH when no secret is configured, or again after authenticating: ignored."""

    def _notify_session_lost(self) -> None:
        self.session.on_connection_lost()

    def on_NAME(self, cmd: NameCommand) -> None:
        if self.peer_name != cmd.client_name:
            self.log.info("[{conn_id}] client calls itself {name}", conn_id=self.conn_id, name=describe(cmd.client_name))
        self.peer_name = cmd.client_name

    def on_REPLICATE(self, cmd: ReplicateCommand) -> None:
        try:
            self.session.on_replicate(cmd)
        except UnknownStreamError as e:
            suppressed = self._bad_line_log.allow()
            if suppressed is not None:
                self.log.warn(
                    "[{conn_id}] {peer} asked to replicate unknown stream {stream}",
                    conn_id=self.conn_id,
                    peer=self.peer_name,
                    stream=describe(e.stream_name),
                )
            metrics.INVALID_LINES.labels(self.SIDE, "unknown_stream").inc()
            self.send_error(f"unknown stream {describe(e.stream_name)}")

    def _to_session(self, cmd: Command) -> None:
        self.session.on_client_command(cmd)

    # The notifications a client sends all go to the session unchanged.
    on_USER_SYNC = on_CLEAR_USER_SYNC = on_FEDERATION_ACK = on_REMOTE_SERVER_UP = _to_session
    on_USER_IP = on_LOCK_RELEASED = on_NEW_ACTIVE_TASK = on_CANCEL_TASK = _to_session


class ClientReplicationProtocol(BaseReplicationProtocol):
    """A worker's end of one replication connection.

    On connect it sends ``NAME <client_name>``, ``PING`` and the REPLICATE
    commands its session asks for. When ``SERVER`` arrives it checks the name
    against ``expected_server_name`` (``None`` accepts any): a mismatch gets
    ``ERROR`` and a close. RDATA, POSITION and REMOTE_SERVER_UP go to the
    :class:`ClientSession` built by ``session_factory(protocol)``. With a
    ``secret`` it sends ``AUTH <secret>`` before anything else.
    """

    SIDE = "client"
    INBOUND_COMMANDS = SERVER_SENT_COMMANDS

    def __init__(
        self,
        client_name: str,
        expected_server_name: str | None,
        clock: IReactorTime,
        session_factory: Callable[["ClientReplicationProtocol"], ClientSession],
        config: ReplicationConfig = ReplicationConfig(),
        secret: str | None = None,
    ) -> None:
        super().__init__(clock, config)
        self.client_name = client_name
        self.expected_server_name = expected_server_name
        self._secret = secret
        self.session = session_factory(self)

    def on_connected(self) -> None:
        if self._secret is not None:
            self.send_command(AuthCommand(self._secret))
        self.send_command(NameCommand(self.client_name))
        self.send_command(self._ping_now())
        for cmd in self.session.replicate_commands():
            self.send_command(cmd)

    def _notify_session_lost(self) -> None:
        self.session.on_connection_lost()

    def on_SERVER(self, cmd: ServerCommand) -> None:
        expected = self.expected_server_name
        if expected is not None and cmd.server_name != expected:
            self.log.error(
                "[{conn_id}] connected to {got} but expected {expected}; closing",
                conn_id=self.conn_id,
                got=describe(cmd.server_name),
                expected=describe(expected),
            )
            self.close_with_error(
                f"wrong server name: expected {describe(expected)}, got {describe(cmd.server_name)}"
            )
            return
        self.peer_name = cmd.server_name
        self.session.on_server_verified()

    def on_RDATA(self, cmd: RdataCommand) -> None:
        self.session.on_rdata(cmd)

    def on_POSITION(self, cmd: PositionCommand) -> None:
        self.session.on_position(cmd)

    def on_REMOTE_SERVER_UP(self, cmd: RemoteServerUpCommand) -> None:
        self.session.on_remote_server_up(cmd)

    def on_LOCK_RELEASED(self, cmd: LockReleasedCommand) -> None:
        self.session.on_lock_released(cmd)
