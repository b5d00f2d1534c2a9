"""The main process's end of a replication connection:
:class:`ServerReplicationProtocol` and the :class:`ServerSession` it hands
commands to (:mod:`.server_factory` builds both).

The behaviour both ends share is described in :mod:`.connection`.

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
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime

from roomstore.replication import metrics
from roomstore.replication.commands import (
    CLIENT_NOTIFICATIONS,
    CLIENT_SENT_COMMANDS,
    AuthCommand,
    Command,
    NameCommand,
    ReplicateCommand,
    ServerCommand,
    describe,
)
from roomstore.replication.config import ReplicationConfig
from roomstore.replication.connection import BaseReplicationProtocol, _State
from roomstore.replication.stream_interface import UnknownStreamError

__all__ = ["ServerReplicationProtocol", "ServerSession"]


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
            suppressed = self.dispatcher.bad_line_log.allow()
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
            **dict.fromkeys(CLIENT_NOTIFICATIONS, self._to_session),
        }
