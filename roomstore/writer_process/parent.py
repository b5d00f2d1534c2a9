"""The store's writes in a child process (``StoreConfig.writer_process``).

Why: a fast import keeps a writer's Python busy (building rows, interning,
the database driver, unpickling validated batches) for most of the GIL and a
core. Embedded in a homeserver, that Python shares the process with the
homeserver's reactor, which then waits for the GIL or a core for several
milliseconds at a time (``bench/event_store.py`` section f). In a child
process of its own, at a lower CPU priority, the writer takes neither: the
homeserver's process only sends it the calls and applies its replies.

``WriterProcess`` is the parent's side. It starts ``python -m
roomstore.writer_process.child`` (``reactor.spawnProcess``) and speaks to it over
its stdin and stdout in ``validation_worker``'s frames (a length, a pickle):

* first ``("open", url, config fields)``; the child opens the store as the
  writer (its lock, its validation workers) and answers ``("ready",
  positions)`` or ``("failed", error)``;
* then ``(ticket, method, args, kwargs)`` for each forwarded call, answered
  ``(ticket, ok, result or error, outcomes, positions)``: the batches the
  child committed since its last reply (``BatchOutcome``), and its streams'
  positions after them. The parent applies both before the call's result
  reaches its caller, so a reader finds its caches and positions already
  past what the call wrote.

Calls are sent in the order they are made and the child starts them in that
order, so batches keep their order as with a writer in process. The child
leaves at the end of its stdin: the parent's ``close``, exit or death.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet import defer, protocol
from twisted.logger import Logger

from roomstore.events.write.validation_worker import FrameReader, frame, rebuilt_error
from roomstore.storage.engines import engine_from_url
from roomstore.storage.errors import DatabaseConfigError

log = Logger()

__all__ = ["FORWARDED", "WriterProcess", "WriterProcessLost", "opens_apart"]

#: The store methods a writer process runs for its parent.
FORWARDED = (
    "persist_events",
    "invalidate_cache",
    "censor_expired_redactions",
    "delete_state_groups",
    "purge_history",
    "purge_room",
)


def opens_apart(url: str) -> bool:
    """Whether another process can open the database ``url`` names: a file
    or a server, not SQLite's ``:memory:`` (a bad URL raises
    ``DatabaseConfigError``, as opening it would)."""
    return isinstance(url, str) and getattr(engine_from_url(url), "path", None) != ":memory:"


class WriterProcessLost(RuntimeError):
    """The writer process ended: the store writes nothing more. A call that
    was in flight may or may not have committed (persisting an event again
    is a no-op); open the store again to write."""


def how_it_ended(reason: BaseException) -> str:
    """What a writer process's end (Twisted's ``ProcessDone`` or
    ``ProcessTerminated``) says to a person: the signal that killed it (no
    log of its own then), or its exit status and where its log is."""
    signal_number = getattr(reason, "signal", None)
    if signal_number is not None:
        try:
            name = f" ({signal.Signals(signal_number).name})"
        except ValueError:
            name = ""
        return f"the writer process was killed by signal {signal_number}{name}"
    code = getattr(reason, "exitCode", None)
    if code == 0:
        return "the writer process left"
    return f"the writer process exited with status {code}: its log, on this process's stderr, says why"


class _Frames(protocol.ProcessProtocol):
    """Splits the child's stdout into frames; tells its owner of each and of the end."""

    def __init__(self, owner: WriterProcess):
        self.owner = owner
        self._frames = FrameReader()

    def childDataReceived(self, fd: int, data: bytes) -> None:
        for message in self._frames.feed(data):
            self.owner._message(message)

    def processEnded(self, reason) -> None:
        self.owner._ended(reason.value)


class WriterProcess:
    """A running writer process. ``await WriterProcess.start(...)``, then
    ``call(method, *args, **kwargs)``; ``close()`` at the end."""

    #: How long ``close`` waits for the child to close its store and leave.
    STOP_GRACE_S = 30.0

    def __init__(self, reactor: Any):
        self._reactor = reactor
        self._apply: Callable[[list, dict], None] | None = None  # see ``follow``
        #: The child's stream positions when it became ready.
        self.ready_positions: dict = {}
        self._frames = _Frames(self)
        self._transport = None
        self._ready: defer.Deferred = defer.Deferred()
        self._pending: dict[int, defer.Deferred] = {}
        self._next_ticket = 0
        self._lost: WriterProcessLost | None = None
        self._ended_d: defer.Deferred = defer.Deferred()

    @classmethod
    async def start(cls, reactor: Any, url: str, config_fields: dict, create: bool = True) -> WriterProcess:
        """Start the child and wait until it holds the store open as the
        writer (``RoomStore.open(url, StoreConfig(**config_fields), create=create)``).
        Raises what opening the store raised in the child (the writer lock
        held elsewhere, a schema to upgrade)."""
        if not opens_apart(url):
            raise DatabaseConfigError("writer_process needs a database URL naming a file or a server, not :memory:")
        if reactor is None:
            from twisted.internet import reactor
        writer = cls(reactor)
        argv = [sys.executable, "-m", "roomstore.writer_process.child"]
        # stdin and stdout are the frames' pipes; stderr is ours (its log).
        writer._transport = reactor.spawnProcess(
            writer._frames, sys.executable, argv, env=os.environ, childFDs={0: "w", 1: "r", 2: 2}
        )
        # The URL (it may hold a password) goes through the pipe, not argv.
        writer._transport.write(frame(("open", url, config_fields, create)))
        try:
            writer.ready_positions = await writer._ready
        except BaseException:
            await writer.close()
            raise
        return writer

    def follow(self, after_commit: Callable[[Any], None], generators: dict) -> None:
        """With every reply, before its caller resumes: ``after_commit(outcome)``
        for each batch the child committed since its last, then each of
        ``generators`` (stream name -> ``StreamIdGenerator``) advanced to the
        child's positions (caches before positions: a reader woken by a
        position finds the caches past it). Now: the positions the child
        started at."""

        def apply(outcomes: list, positions: dict) -> None:
            for outcome in outcomes:
                after_commit(outcome)
            for name, by_writer in positions.items():
                for instance, position in by_writer.items():
                    generators[name].advance(instance, position)

        self._apply = apply
        apply([], self.ready_positions)

    def call(self, method: str, *args: Any, **kwargs: Any) -> defer.Deferred:
        """Run ``store.method(*args, **kwargs)`` in the child; its result."""
        if self._lost is not None:
            return defer.fail(self._lost)
        if method not in FORWARDED:
            raise ValueError(f"{method!r} is not a method the writer process runs")
        ticket = self._next_ticket
        self._next_ticket += 1
        waiting = self._pending[ticket] = defer.Deferred()
        self._transport.write(frame((ticket, method, args, kwargs)))
        return waiting

    def _message(self, message: tuple) -> None:
        if message[0] == "ready":
            self._ready.callback(message[1])
            return
        if message[0] == "failed":
            self._ready.errback(rebuilt_error(message[1]))
            return
        ticket, ok, payload, outcomes, positions = message
        self._apply(outcomes, positions)
        waiting = self._pending.pop(ticket)
        if ok:
            waiting.callback(payload)
        else:
            waiting.errback(rebuilt_error(payload))

    def _ended(self, reason: BaseException) -> None:
        self._lost = WriterProcessLost(f"{how_it_ended(reason)}; open the store again to write")
        if not self._ready.called:
            self._ready.errback(self._lost)
        pending, self._pending = self._pending, {}
        for waiting in pending.values():
            waiting.errback(self._lost)
        self._ended_d.callback(None)

    async def close(self) -> None:
        """Close the child's stdin (it finishes its calls, closes its store and
        leaves); kill it if it lingers past ``STOP_GRACE_S``."""
        if self._transport is None or self._ended_d.called:
            return
        self._transport.closeStdin()
        timer = self._reactor.callLater(self.STOP_GRACE_S, self._kill)
        try:
            await self._ended_d
        finally:
            if timer.active():
                timer.cancel()

    def _kill(self) -> None:
        log.warn("the writer process did not leave within {s} s: killing it", s=self.STOP_GRACE_S)
        try:
            self._transport.signalProcess("KILL")
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
