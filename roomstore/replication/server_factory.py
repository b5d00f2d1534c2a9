"""The main process's side: a factory that serves streams to workers.

:class:`ReplicationServerFactory` is what homeserver code holds. It is given
the server name, a :class:`~roomstore.replication.stream_interface.StreamRegistry` and
a reactor, listens via ``reactor.listenTCP(port, factory)``, and is told about
new rows with :meth:`~ReplicationServerFactory.notify_new_rows`. Each
connection it builds gets a :class:`~roomstore.replication.feed.ConnectionFeed`
that decides what that connection is sent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.logger import Logger

from roomstore.replication.commands import (
    CLIENT_NOTIFICATIONS,
    Command,
    LockReleasedCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.feed import ConnectionFeed
from roomstore.replication.server_protocol import ServerReplicationProtocol
from roomstore.replication.stream_interface import StreamRegistry

__all__ = ["ClientCommandCallback", "ReplicationServerFactory"]

#: ``callback(connection, command)``; may return a Deferred or coroutine.
ClientCommandCallback = Callable[[ServerReplicationProtocol, Command], Any]


class _ServerSession:
    """Glue between one ServerReplicationProtocol and its factory."""

    def __init__(self, factory: ReplicationServerFactory, conn: ServerReplicationProtocol) -> None:
        self._factory = factory
        self._conn = conn
        self.feed = ConnectionFeed(
            conn,
            factory.streams,
            factory.config.page_size,
            factory.config.max_line_length,
            factory.config.read_ahead,
        )

    def on_connection_made(self) -> None:
        self._factory._connections.append(self._conn)

    def on_replicate(self, cmd: ReplicateCommand) -> None:
        self.feed.replicate(cmd)

    def on_client_command(self, cmd: Command) -> None:
        self._factory._dispatch_client_command(self._conn, cmd)

    def on_connection_lost(self) -> None:
        self.feed.stop()
        try:
            self._factory._connections.remove(self._conn)
        except ValueError:
            pass


class ReplicationServerFactory(ServerFactory):
    """Builds :class:`ServerReplicationProtocol` connections over one set of streams.

    Homeserver code calls :meth:`notify_new_rows` after a stream advanced
    (rows committed, or a position moved), registers callbacks for the
    notifications workers send with :meth:`add_command_handler`, and calls
    :meth:`close_all` on shutdown. All calls from the reactor thread.

    ``secret``: if given, every connection must open with ``AUTH <secret>``
    (see :mod:`.server_protocol`); until it has, it is sent no broadcasts.
    """

    log = Logger()

    def __init__(
        self,
        server_name: str,
        streams: StreamRegistry,
        reactor: IReactorTime,
        config: ReplicationConfig = ReplicationConfig(),
        secret: str | None = None,
    ) -> None:
        self.server_name = server_name
        self.streams = streams
        self.reactor = reactor
        self.config = config
        self._secret = secret
        self._connections: list[ServerReplicationProtocol] = []
        self._handlers: dict[str, list[ClientCommandCallback]] = {}

    def buildProtocol(self, addr: IAddress | None) -> ServerReplicationProtocol:
        protocol = ServerReplicationProtocol(
            self.server_name,
            self.reactor,
            lambda conn: _ServerSession(self, conn),
            self.config,
            secret=self._secret,
        )
        protocol.factory = self
        return protocol

    @property
    def connections(self) -> list[ServerReplicationProtocol]:
        """The open connections, oldest first (a copy)."""
        return list(self._connections)

    def notify_new_rows(self, stream_name: str) -> None:
        """``stream_name`` advanced: send each connection its new rows.

        Each connection is caught up from the last token it was sent, in
        pages of ``config.page_size`` rows. Raises UnknownStreamError if no
        such stream is registered (a bug in the caller).
        """
        self.streams.get(stream_name)
        for conn in list(self._connections):
            cast(_ServerSession, conn.session).feed.on_stream_advanced(stream_name)  # the sessions it builds

    on_stream_advanced = notify_new_rows

    def add_command_handler(self, command_name: str, callback: ClientCommandCallback) -> None:
        """Call ``callback(connection, cmd)`` for every ``command_name``
        (USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK, REMOTE_SERVER_UP, USER_IP,
        LOCK_RELEASED, NEW_ACTIVE_TASK or CANCEL_TASK) received on any
        connection. Errors in the callback are logged."""
        if command_name not in CLIENT_NOTIFICATIONS:
            raise ValueError(f"no handlers can be registered for {command_name!r}")
        self._handlers.setdefault(command_name, []).append(callback)

    def _dispatch_client_command(self, conn: ServerReplicationProtocol, cmd: Command) -> None:
        for callback in self._handlers.get(cmd.NAME, ()):
            try:
                result = callback(conn, cmd)
                if inspect.iscoroutine(result):
                    result = defer.ensureDeferred(result)
                if isinstance(result, defer.Deferred):
                    result.addErrback(self._log_handler_failure, cmd.NAME)
            except Exception:
                self.log.failure("handler for {command} failed", command=cmd.NAME)

    def _log_handler_failure(self, failure: Any, command: str) -> None:
        self.log.failure("handler for {command} failed", failure=failure, command=command)

    def broadcast(self, cmd: Command, exclude: Iterable[ServerReplicationProtocol] = ()) -> None:
        """Send ``cmd`` to every open, authenticated connection except ``exclude``."""
        skip = set(map(id, exclude))
        for conn in list(self._connections):
            if id(conn) not in skip and conn.authenticated:
                conn.send_command(cmd)

    def send_remote_server_up(self, server: str) -> None:
        """Tell every worker that ``server`` may be reachable again."""
        self.broadcast(RemoteServerUpCommand(server))

    def send_lock_released(self, instance_name: str, lock_name: str, lock_key: str) -> None:
        """Tell every worker that ``instance_name`` released a lock."""
        self.broadcast(LockReleasedCommand(instance_name, lock_name, lock_key))

    def close_all(self, message: str = "server stopping") -> None:
        """Send ``ERROR <message>`` to every connection and close it."""
        for conn in list(self._connections):
            conn.close_with_error(message)
