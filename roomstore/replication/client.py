"""A worker's side: a reconnecting factory and the handler interface.

Worker code subclasses :class:`ReplicationClientHandler` (what to do with
rows and positions; which streams it can read), builds a
:class:`ReplicationClientFactory` around it and connects it with
``reactor.connectTCP(host, port, factory)``. The factory reconnects with
exponential backoff; after a reconnect it asks the server to replay each
stream from the last token applied (legacy ``REPLICATE <stream> <token>``),
so nothing is missed across the gap.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.internet.protocol import ReconnectingClientFactory, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from roomstore.replication.client_protocol import ClientReplicationProtocol, IRdataRunSession
from roomstore.replication.commands import (
    ClearUserSyncCommand,
    Command,
    FederationAckCommand,
    LockReleasedCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    UserIpCommand,
    UserSyncCommand,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.follower import StreamFollower, StreamPositions
from roomstore.replication.handler_interface import ReplicationClientHandler

__all__ = ["ReplicationClientFactory", "ReplicationClientHandler"]


@implementer(IRdataRunSession)
class _ClientSession:
    """Glue between one ClientReplicationProtocol and its factory."""

    def __init__(self, factory: ReplicationClientFactory, conn: ClientReplicationProtocol) -> None:
        self._factory = factory
        self._conn = conn
        config = factory.config
        self.follower = StreamFollower(
            factory.handler,
            factory.positions,
            page_size=config.page_size,
            max_batch_rows=config.max_batch_rows,
            max_queued=config.max_pending_commands,
        )
        #: The protocol hands well-formed RDATA lines here as fields, runs
        #: of plain ones as ``parse_rdata_lines`` gives them, and a read's
        #: plain lines of one stream and writer as ``parse_rdata_run`` does.
        self.on_rdata_fields = self.follower.on_rdata_fields
        self.on_rdata_run = self.follower.on_rdata_run
        self.on_rdata_rows = self.follower.on_rdata_rows

    def replicate_commands(self) -> list[ReplicateCommand]:
        resume = self._factory.positions.resume_tokens()
        # Replays first, so the bare REPLICATE's POSITIONs for those streams
        # come after the replayed rows rather than racing them.
        commands = [ReplicateCommand(name, token) for name, token in resume.items()]
        commands.append(ReplicateCommand())
        return commands

    def on_server_verified(self) -> None:
        self._factory._connection_verified(self._conn)

    def on_rdata(self, cmd: RdataCommand) -> None:
        self.follower.on_rdata(cmd)

    def on_position(self, cmd: PositionCommand) -> None:
        self.follower.on_position(cmd)

    def on_remote_server_up(self, cmd: RemoteServerUpCommand) -> None:
        self._factory.handler.on_remote_server_up(cmd.server)

    def on_lock_released(self, cmd: LockReleasedCommand) -> None:
        self._factory.handler.on_lock_released(cmd.instance_name, cmd.lock_name, cmd.lock_key)

    def on_connection_lost(self) -> None:
        self.follower.stop()
        self._factory._connection_lost(self._conn)


class _ClientProtocol(ClientReplicationProtocol):
    def connectionLost(self, reason: Failure = connectionDone) -> None:
        # The transport's reason, which under TLS says why a handshake failed
        # (the connector's only says the socket closed cleanly).
        self.factory._lost_reason = reason
        super().connectionLost(reason)


def _describe(reason: Failure) -> str:
    """Why a connection ended, in words; a failed TLS handshake says what to check."""
    error = reason.value
    if type(error).__module__.startswith("OpenSSL") or type(error).__name__ == "VerificationError":
        # pyOpenSSL's errors carry [(library, function, reason), ...].
        parts = error.args[0] if error.args and isinstance(error.args[0], list) else []
        details = "; ".join(str(p[-1]) if isinstance(p, tuple) else str(p) for p in parts) or str(error)
        return (
            f"TLS handshake failed ({details}): is --tls-ca the CA that signed the server's certificate,"
            " and is the --server host a name on it?"
        )
    return reason.getErrorMessage()


class ReplicationClientFactory(ReconnectingClientFactory):
    """Keeps one worker connected to the main process.

    ``clock`` (any ``IReactorTime``; the global reactor if None) drives both
    the protocol's timers and the reconnection backoff, so tests can use a
    ``Clock``. Stream positions live here, in :attr:`positions`, across
    connections. The ``send_*`` methods return False when not connected
    (those notifications are not queued: the worker resends state in
    ``handler.on_connected``). ``secret``: sent as ``AUTH <secret>`` first
    on every connection, for a server that requires it.
    """

    log = Logger()
    initialDelay = 0.5
    maxDelay = 30

    def __init__(
        self,
        handler: ReplicationClientHandler,
        client_name: str,
        expected_server_name: str | None,
        *,
        clock: IReactorTime | None = None,
        config: ReplicationConfig = ReplicationConfig(),
        secret: str | None = None,
    ) -> None:
        self.handler = handler
        self.secret = secret
        self.client_name = client_name
        self.expected_server_name = expected_server_name
        self.clock = clock  # read by ReconnectingClientFactory.retry
        self.config = config
        self.positions = StreamPositions()
        self._lost_reason: Failure | None = None
        self._connection: ClientReplicationProtocol | None = None
        self.resetDelay()  # the first retry after initialDelay (the base class starts at its own 1.0)

    def _clock(self) -> IReactorTime:
        if self.clock is not None:
            return self.clock
        from twisted.internet import reactor

        return reactor

    def buildProtocol(self, addr: IAddress | None) -> ClientReplicationProtocol:
        self._lost_reason = None
        protocol = _ClientProtocol(
            self.client_name,
            self.expected_server_name,
            self._clock(),
            lambda conn: _ClientSession(self, conn),
            self.config,
            secret=self.secret,
        )
        protocol.factory = self
        return protocol

    @property
    def connection(self) -> ClientReplicationProtocol | None:
        """The current verified connection, if any."""
        return self._connection

    def _connection_verified(self, conn: ClientReplicationProtocol) -> None:
        self._connection = conn
        self.resetDelay()  # a good connection: next failure retries quickly
        self.log.info("replication connected to {server}", server=conn.peer_name)
        self.handler.on_connected()

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        super().clientConnectionFailed(connector, reason)
        self._log_retry(connector, "failed", reason)

    def clientConnectionLost(self, connector: Any, reason: Failure) -> None:
        super().clientConnectionLost(connector, reason)
        self._log_retry(connector, "lost", reason)

    def _log_retry(self, connector: Any, what: str, reason: Failure) -> None:
        """One warning per failed attempt: where, why, and when the next one is."""
        destination = connector.getDestination()
        where = f"{getattr(destination, 'host', destination)}:{getattr(destination, 'port', '')}"
        if self.continueTrying:
            self.log.warn(
                "replication connection to {where} {what}: {reason}; retrying in {delay:.1f}s (retry {n})",
                where=where,
                what=what,
                reason=_describe(self._lost_reason if what == "lost" and self._lost_reason is not None else reason),
                delay=self.delay,
                n=self.retries,
            )

    def _connection_lost(self, conn: ClientReplicationProtocol) -> None:
        if self._connection is conn:
            self._connection = None

    def send_command(self, cmd: Command) -> bool:
        """Send ``cmd`` on the current connection; False if there is none."""
        conn = self._connection
        if conn is None or not conn.is_open:
            return False
        conn.send_command(cmd)
        return True

    def send_user_sync(self, user_id: str, is_syncing: bool, last_sync_ms: int, device_id: str | None = None) -> bool:
        return self.send_command(UserSyncCommand(self.client_name, user_id, device_id, is_syncing, last_sync_ms))

    def send_user_ip(
        self, user_id: str, access_token: str, ip: str, user_agent: str, device_id: str | None, last_seen: int
    ) -> bool:
        return self.send_command(UserIpCommand(user_id, access_token, ip, user_agent, device_id, last_seen))

    def send_lock_released(self, lock_name: str, lock_key: str) -> bool:
        return self.send_command(LockReleasedCommand(self.client_name, lock_name, lock_key))

    def send_clear_user_sync(self) -> bool:
        return self.send_command(ClearUserSyncCommand(self.client_name))

    def send_federation_ack(self, token: int) -> bool:
        return self.send_command(FederationAckCommand(self.client_name, token))

    def send_remote_server_up(self, server: str) -> bool:
        return self.send_command(RemoteServerUpCommand(server))

    def stop(self) -> None:
        """Stop reconnecting and close the current connection."""
        self.stopTrying()
        if self._connection is not None:
            self._connection.close()
