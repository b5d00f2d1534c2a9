"""Command dispatch for a replication connection: a line in, parsed, and
handed to the handler of its command, or answered with ``ERROR``.

Bad lines (not UTF-8, unparsable, unknown or unexpected commands) are
answered and otherwise ignored; a handler that raises
:class:`CloseConnection` closes the connection, any other error is answered
and logged. Neither takes the connection down by accident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from roomstore.replication import metrics
from roomstore.replication.commands import (
    CommandParseError,
    UnknownCommandError,
    describe,
    parse_command_from_line,
    parse_rdata_fields,
)

__all__ = ["CloseConnection", "CommandDispatcher", "DispatchOwner", "LogLimiter"]


class CloseConnection(Exception):
    """Raised by a session to make its protocol send ``ERROR <message>``
    and close the connection (the peer broke the protocol)."""


class DispatchOwner(Protocol):
    """The connection a :class:`CommandDispatcher` reads for."""

    conn_id: str
    peer_name: str | None
    log: Logger

    def send_error(self, message: str) -> None:
        """Send ``ERROR <message>``; the connection stays open."""

    def close_with_error(self, message: str) -> None:
        """Send ``ERROR <message>`` and close."""


class LogLimiter:
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


class CommandDispatcher:
    """Parses lines and calls ``handlers[name](cmd)`` for each command.

    ``on_rdata_fields``, if set, takes every well-formed RDATA line as
    ``(stream_name, instance_name, token, row)`` instead of the RDATA
    handler taking a command (a worker's: no command object per row).
    Received commands are counted per line and added to the metrics per
    read (:meth:`flush_counts`): a Prometheus counter takes a lock.
    """

    def __init__(
        self, owner: DispatchOwner, side: str, handlers: dict[str, Callable[[Any], Any]], clock: IReactorTime
    ) -> None:
        self._owner = owner
        self._side = side
        self.handlers = handlers
        self.on_rdata_fields: Callable[[tuple], Any] | None = None
        #: Shared by everything that logs a peer's mistakes.
        self.bad_line_log = LogLimiter(clock)
        self._counts: dict[str, int] = {}

    def line(self, line: bytes) -> None:
        """Parse and dispatch one line. Never raises."""
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            self.reject("bad_utf8", "line is not valid UTF-8", line)
            return
        if not text or text.isspace():
            return
        on_rdata_fields = self.on_rdata_fields
        if on_rdata_fields is not None:
            fields = parse_rdata_fields(text)
            if fields is not None:
                self.dispatch("RDATA", fields, on_rdata_fields)
                return
        try:
            cmd = parse_command_from_line(text)
        except UnknownCommandError as e:
            self.reject("unknown_command", e.reason, line)
            return
        except CommandParseError as e:
            # Not an UnknownCommandError, so the first word is a known name.
            name = text.partition(" ")[0]
            self.reject("malformed", f"failed to parse {name}: {e.reason}", line)
            return
        except Exception:  # a parser bug must not take the connection down
            owner = self._owner
            owner.log.failure("[{conn_id}] parser crashed on {line}", conn_id=owner.conn_id, line=describe(text))
            self.reject("malformed", "failed to parse line", line)
            return
        name = cmd.NAME
        handler = self.handlers.get(name)
        if handler is None:
            self.reject("unexpected_command", f"unexpected command {name}", line)
            return
        self.dispatch(name, cmd, handler)

    def dispatch(self, name: str, cmd: Any, handler: Callable[[Any], Any], lines: int = 1) -> None:
        """``handler(cmd)`` for ``lines`` lines of command ``name`` (``cmd``:
        a command, or RDATA lines' fields), its errors answered as the
        protocol says."""
        counts = self._counts
        counts[name] = counts.get(name, 0) + lines
        owner = self._owner
        try:
            result = handler(cmd)
        except CloseConnection as e:
            owner.log.warn("[{conn_id}] closing: {text}", conn_id=owner.conn_id, text=str(e))
            owner.close_with_error(str(e))
            return
        except Exception:
            owner.log.failure("[{conn_id}] error handling {command}", conn_id=owner.conn_id, command=name)
            owner.send_error(f"internal error handling {name}")
            return
        if result is not None and isinstance(result, defer.Deferred):
            result.addErrback(_log_failure(owner.log, f"{owner.conn_id} {name}"))

    def reject(self, kind: str, reason: str, line: bytes) -> None:
        """Count and (rate-limited) log a bad line, and answer it."""
        metrics.INVALID_LINES.labels(self._side, kind).inc()
        suppressed = self.bad_line_log.allow()
        owner = self._owner
        if suppressed is not None:
            owner.log.warn(
                "[{conn_id}] bad line from {peer}: {reason} (line {line}; {suppressed} more suppressed)",
                conn_id=owner.conn_id,
                peer=owner.peer_name,
                reason=reason,
                line=describe(line.decode("utf-8", "replace")),
                suppressed=suppressed,
            )
        owner.send_error(reason)

    def flush_counts(self) -> None:
        """Add the commands counted since the last flush to the metrics."""
        counts = self._counts
        if counts:
            for name, count in counts.items():
                metrics.child(metrics.COMMANDS_RECEIVED, self._side, name).inc(count)
            counts.clear()


def _log_failure(log: Logger, what: str) -> Callable[[Failure], None]:
    def errback(failure: Failure) -> None:
        log.failure("Unhandled error in {what}", failure=failure, what=what)

    return errback
