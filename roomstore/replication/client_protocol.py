"""A worker's end of a replication connection:
:class:`ClientReplicationProtocol` and the :class:`ClientSession` it hands
commands to (:mod:`.client` builds both), with :class:`IRdataRunSession` for
a session that takes RDATA lines parsed in bulk.

The behaviour both ends share is described in :mod:`.connection`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from twisted.internet.interfaces import IReactorTime
from zope.interface import Interface

from roomstore.replication.commands import (
    SERVER_SENT_COMMANDS,
    AuthCommand,
    LockReleasedCommand,
    NameCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    describe,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.connection import BaseReplicationProtocol, _State
from roomstore.replication.wire import parse_rdata_lines, parse_rdata_run
from roomstore.storage.collector import collector_paused

__all__ = ["ClientReplicationProtocol", "ClientSession", "IRdataRunSession"]


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
            self.dispatcher.on_rdata_fields = bulk.on_rdata_fields
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
        self.dispatcher.dispatch("RDATA", parsed, handler, lines)

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
