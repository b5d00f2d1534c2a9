"""The line protocol of TCP replication: framing, keep-alive, congestion.

A connection is a :class:`ServerReplicationProtocol` on the main process and a
:class:`ClientReplicationProtocol` on a worker. Both are
``LineOnlyReceiver`` subclasses that turn ``\\n``-terminated UTF-8 lines into
:mod:`~roomstore.replication.commands` values and back. What a command
*means* is not decided here: each protocol hands commands to a *session*
object built by its factory (:mod:`.server_factory` and :mod:`.client` provide them),
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
loops (:mod:`~roomstore.replication.feed`) write no page while the
connection is paused and read at most ``read_ahead`` pages ahead, so a slow
but live client falls behind in the stream (the database) rather than in our
memory, and catches up when it drains. What
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

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from twisted.internet.interfaces import IReactorTime
from zope.interface import Interface

from roomstore.replication import metrics
from roomstore.replication.base_protocol import (
    BaseReplicationProtocol,
    CloseConnection,
    ReplicationConfig,
    _State,
)
from roomstore.replication.commands import (
    CLIENT_SENT_COMMANDS,
    SERVER_SENT_COMMANDS,
    AuthCommand,
    Command,
    LockReleasedCommand,
    NameCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    describe,
)
from roomstore.replication.stream_interface import UnknownStreamError
from roomstore.replication.wire import parse_rdata_lines, parse_rdata_run
from roomstore.storage.collector import collector_paused

__all__ = [
    "BaseReplicationProtocol",
    "ClientReplicationProtocol",
    "ClientSession",
    "CloseConnection",
    "IRdataRunSession",
    "ReplicationConfig",
    "ServerReplicationProtocol",
    "ServerSession",
]


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

    # Optional: declare IRdataRunSession (below) to be handed RDATA lines
    # without a command built per row.

    def on_position(self, cmd: PositionCommand) -> None:
        """A stream position arrived. May raise CloseConnection."""

    def on_remote_server_up(self, cmd: RemoteServerUpCommand) -> None:
        """The server reports a remote homeserver may be back."""

    def on_lock_released(self, cmd: LockReleasedCommand) -> None:
        """The server reports an instance released a lock."""

    def on_connection_lost(self) -> None:
        """The connection is gone."""


#: What a client tells the server for the server's session to act on.
_NOTIFICATIONS = (
    "USER_SYNC",
    "CLEAR_USER_SYNC",
    "FEDERATION_ACK",
    "REMOTE_SERVER_UP",
    "USER_IP",
    "LOCK_RELEASED",
    "NEW_ACTIVE_TASK",
    "CANCEL_TASK",
)


class IRdataRunSession(Interface):
    """A client session that takes RDATA lines parsed in bulk (a worker's).

    Declare it with ``@implementer(IRdataRunSession)``; the protocol then
    hands it every well-formed RDATA line through these, and ``on_rdata``
    gets only the rest.
    """

    def on_rdata_fields(fields: tuple) -> None:
        """One row, as ``(stream_name, instance_name, token or None, row)``
        (``parse_rdata_fields``). May raise CloseConnection."""

    def on_rdata_run(run: tuple) -> None:
        """A read's run of plain RDATA lines, as ``parse_rdata_lines``
        gives them. May raise CloseConnection."""

    def on_rdata_rows(run: tuple) -> None:
        """A read's plain RDATA lines of one stream and writer, as
        ``parse_rdata_run`` gives them. May raise CloseConnection."""


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
        session_factory: Callable[[ServerReplicationProtocol], ServerSession],
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
            self.log.info(
                "[{conn_id}] client calls itself {name}", conn_id=self.conn_id, name=describe(cmd.client_name)
            )
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

    def command_handlers(self) -> dict[str, Callable[[Any], Any]]:
        # The notifications a client sends all go to the session unchanged.
        return {
            **super().command_handlers(),
            "AUTH": self.on_AUTH,
            "NAME": self.on_NAME,
            "REPLICATE": self.on_REPLICATE,
            **dict.fromkeys(_NOTIFICATIONS, self._to_session),
        }


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
        session_factory: Callable[[ClientReplicationProtocol], ClientSession],
        config: ReplicationConfig = ReplicationConfig(),
        secret: str | None = None,
    ) -> None:
        super().__init__(clock, config)
        self.client_name = client_name
        self.expected_server_name = expected_server_name
        self._secret = secret
        self.session = session_factory(self)
        self._on_rdata_run: Callable[[tuple], Any] | None = None
        self._on_rdata_rows: Callable[[tuple], Any] | None = None
        if IRdataRunSession.providedBy(self.session):
            bulk = cast(IRdataRunSession, self.session)
            self._on_rdata_fields = bulk.on_rdata_fields
            self._on_rdata_run = bulk.on_rdata_run
            self._on_rdata_rows = bulk.on_rdata_rows

    def linesReceived(self, block: bytes, lines: list[bytes]) -> None:
        """A run of RDATA lines (what a worker mostly reads: a server writes
        a page per write) goes to the session's ``on_rdata_run`` at once,
        parsed by ``parse_rdata_lines``; any other line, and every line of a
        run that is not plain, goes through ``lineReceived`` as before."""
        on_run = self._on_rdata_run
        if on_run is None:
            super().linesReceived(block, lines)
        elif block.startswith(b"RDATA ") and block.count(b"\nRDATA ") == len(lines) - 1:
            self._rdata_block(block, lines, on_run)
        else:
            self._mixed_lines(lines, [line[:6] == b"RDATA " for line in lines], on_run)

    def _mixed_lines(self, lines: list[bytes], starts: list[bool], on_run: Callable) -> None:
        """Runs of RDATA lines to ``_rdata_run``, other lines one by one."""
        index = 0
        while index < len(lines):
            if self.transport.disconnecting or self._state is not _State.OPEN:
                return
            if not starts[index]:
                self.lineReceived(lines[index])
                index += 1
                continue
            end = index + 1
            while end < len(lines) and starts[end]:
                end += 1
            self._rdata_block(b"\n".join(lines[index:end]), lines[index:end], on_run)
            index = end

    def _rdata_block(self, block: bytes, lines: list[bytes], on_run: Callable) -> None:
        """A read's whole lines, all RDATA (``block``: them joined): one
        stream's and writer's plain lines to the session's ``on_rdata_rows``
        at once (``parse_rdata_run``), any others as a run."""
        on_rows = self._on_rdata_rows
        if on_rows is not None:
            with collector_paused():
                try:
                    parsed = parse_rdata_run(block.decode("utf-8"), len(lines))
                except UnicodeDecodeError:
                    parsed = None
                if parsed is not None:
                    self._dispatch_rdata(len(lines), parsed, on_rows)
                    del parsed  # freed before the collector is back
                    return
        self._rdata_run(lines, on_run)

    def _dispatch_rdata(self, lines: int, parsed: Any, handler: Callable) -> None:
        """``lines`` RDATA lines, parsed together, counted and handed to ``handler``."""
        counts = self._received_counts
        counts["RDATA"] = counts.get("RDATA", 0) + lines
        self._dispatch("RDATA", parsed, handler)

    def _rdata_run(self, run: list[bytes], on_run: Callable) -> None:
        # The run's rows are freed by reference counting once applied: the
        # cyclic collector is held off meanwhile (``storage.collector``).
        with collector_paused():
            try:
                fields = parse_rdata_lines(b"\n".join(run).decode("utf-8").split("\n"))
            except UnicodeDecodeError:
                fields = None
            if fields is not None:
                self._dispatch_rdata(len(run), fields, on_run)
                del fields  # freed before the collector is back: nothing left for it to walk
                return
        for line in run:
            if self.transport.disconnecting:
                return
            self.lineReceived(line)

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
            self.close_with_error(f"wrong server name: expected {describe(expected)}, got {describe(cmd.server_name)}")
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

    def command_handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {
            **super().command_handlers(),
            "SERVER": self.on_SERVER,
            "RDATA": self.on_RDATA,
            "POSITION": self.on_POSITION,
            "REMOTE_SERVER_UP": self.on_REMOTE_SERVER_UP,
            "LOCK_RELEASED": self.on_LOCK_RELEASED,
        }
