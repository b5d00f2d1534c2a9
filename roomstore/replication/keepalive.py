"""Keep-alive for a replication connection: PING when we have been quiet,
and a timeout once the peer has shown it pings too.

All timing comes from the ``IReactorTime`` given (a ``task.Clock`` in tests).
"""

from __future__ import annotations

from typing import Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime

__all__ = ["KeepAlive", "KeepAliveOwner"]

# Float timers from a reactor can land a hair before the deadline.
_EPSILON = 1e-3


class KeepAliveOwner(Protocol):
    """The connection a :class:`KeepAlive` serves."""

    @property
    def is_open(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def send_ping(self) -> None:
        """Send a PING now."""

    def peer_timed_out(self, silent_for: float) -> None:
        """The peer has been silent past the timeout: close."""


class KeepAlive:
    """The two timers of one connection.

    The owner reports traffic through :meth:`sent` and :meth:`received`;
    a PING goes out whenever nothing was sent for ``interval`` seconds
    (not while paused: a queued PING would only add to the backlog). The
    silence timeout stays off until :meth:`peer_pinged`, so a person at
    netcat is not cut off.
    """

    def __init__(self, owner: KeepAliveOwner, clock: IReactorTime, interval: float, timeout: float) -> None:
        self._owner = owner
        self._clock = clock
        self.interval = interval
        self.timeout = timeout
        self.last_sent = 0.0
        self.last_received = 0.0
        self._peer_pings = False
        self._ping_call: IDelayedCall | None = None
        self._timeout_call: IDelayedCall | None = None

    def reset(self) -> None:
        """Count from now: the connection was just made."""
        self.last_sent = self.last_received = self._clock.seconds()

    def start(self) -> None:
        """Start pinging (after the start-up commands went out)."""
        self._schedule_ping()

    def stop(self) -> None:
        """Cancel both timers: the connection is closing."""
        for call in (self._ping_call, self._timeout_call):
            if call is not None and call.active():
                call.cancel()
        self._ping_call = self._timeout_call = None

    def sent(self) -> None:
        self.last_sent = self._clock.seconds()

    def received(self) -> None:
        self.last_received = self._clock.seconds()

    def peer_pinged(self) -> None:
        """The peer sent a PING: it speaks the protocol, so time it out."""
        if not self._peer_pings:
            self._peer_pings = True
            self._schedule_timeout_check()

    def _schedule_ping(self) -> None:
        delay = max(0.0, self.last_sent + self.interval - self._clock.seconds())
        self._ping_call = self._clock.callLater(delay, self._ping_due)

    def _ping_due(self) -> None:
        self._ping_call = None
        owner = self._owner
        if not owner.is_open:
            return
        if owner.paused:
            # Nothing can be written now. Look again in a full interval.
            self._ping_call = self._clock.callLater(self.interval, self._ping_due)
            return
        if self._clock.seconds() - self.last_sent >= self.interval - _EPSILON:
            owner.send_ping()
        if owner.is_open:
            self._schedule_ping()

    def _schedule_timeout_check(self) -> None:
        delay = max(0.0, self.last_received + self.timeout - self._clock.seconds())
        self._timeout_call = self._clock.callLater(delay, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timeout_call = None
        if not self._owner.is_open:
            return
        silent_for = self._clock.seconds() - self.last_received
        if silent_for >= self.timeout - _EPSILON:
            self._owner.peer_timed_out(silent_for)
            return
        self._schedule_timeout_check()
