"""A store's writer process: ``python -m roomstore.writer_process.child``.

``RoomStore.open`` starts it for ``StoreConfig(writer_process=True)``
(``roomstore.writer_process.parent`` is the parent's side and describes the
frames). It opens the store as the writer and runs the calls its parent
forwards, in the order they come, several at a time as the parent makes
them; each reply carries the batches committed since the last one and the
streams' positions. It leaves at the end of its stdin, after its calls in
flight, closing the store (its writer lock, its validation workers).

Only the parent is trusted to write to the pipe: it sends its own calls'
arguments (events as bytes), never code.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from typing import Any

import attrs
from twisted.internet import defer, process, protocol, stdio
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST
from twisted.logger import (
    FilteringLogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from zope.interface import implementer

from roomstore.events.write.validation_worker import FrameReader, claim_stdout, frame, shipped_error
from roomstore.processes import react_and_leave, tune_collector
from roomstore.store import RoomStore, StoreConfig
from roomstore.writer_process.parent import FORWARDED

log = Logger()


def set_priority(priority: str | int) -> None:
    """This process's CPU priority (its threads and children inherit it):
    ``"idle"`` is ``SCHED_IDLE`` where the platform allows it (else nice 19);
    a nice value never below the one this process started with (going
    lower needs privileges)."""
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:  # refused (a container's seccomp, say): the nearest there is
            priority = 19
    wanted = 19 if priority == "idle" else int(priority)
    os.nice(max(0, wanted - os.nice(0)))


@implementer(IHalfCloseableProtocol)
class _Calls(protocol.Protocol):
    """Reads the parent's frames from stdin; answers on stdout."""

    def __init__(self, reactor: Any):
        self.reactor = reactor
        self.store: RoomStore | None = None
        self._frames = FrameReader()
        self._outcomes: list = []
        self._in_flight: set[defer.Deferred] = set()
        self.finished: defer.Deferred = defer.Deferred()
        self._opening: defer.Deferred | None = None

    def dataReceived(self, data: bytes) -> None:
        for message in self._frames.feed(data):
            self._dispatch(message)

    def _dispatch(self, message: tuple) -> None:
        if message[0] == "open":
            self._opening = defer.ensureDeferred(self._open(*message[1:]))
            return
        ticket, method, args, kwargs = message
        call = defer.ensureDeferred(self._run(ticket, method, args, kwargs))
        self._in_flight.add(call)
        call.addBoth(lambda _: self._in_flight.discard(call))

    async def _open(self, url: str, fields: dict, create: bool) -> None:
        try:
            config = StoreConfig(**fields)
            _LOG_LEVELS.setLogLevelForNamespace("", LogLevel.levelWithName(config.writer_process_log_level))
            set_priority(config.writer_process_priority)
            self.store = await RoomStore.open(url, config, reactor=self.reactor, create=create)
            if config.writer_process_gc is not None:
                tune_collector(config.writer_process_gc)
        except Exception as error:  # noqa: BLE001 - the parent raises it
            self._send(("failed", shipped_error(error)))
            self.transport.loseConnection()
            return
        self.store.add_invalidation_hook(self._collect)
        self._send(("ready", self._positions()))

    def _collect(self, outcome) -> None:
        # What the parent's caches need (positions, invalidations): the
        # calls' own replies carry the results, so the outcome need not.
        self._outcomes.append(attrs.evolve(outcome, results={}, new_event_ids=[]))

    async def _run(self, ticket: int, method: str, args: tuple, kwargs: dict) -> None:
        await self._opening  # calls come only after "ready"; its store is there
        try:
            if method not in FORWARDED:
                raise ValueError(f"{method!r} is not a method the writer process runs")
            result = await getattr(self.store, method)(*args, **kwargs)
            reply = (ticket, True, result)
        except Exception as error:  # noqa: BLE001 - every error goes back to the caller
            reply = (ticket, False, shipped_error(error))
        outcomes, self._outcomes[:] = list(self._outcomes), []
        self._send(reply + (outcomes, self._positions()))

    def _positions(self) -> dict[str, dict[str, int]]:
        return {name: gen.get_positions() for name, gen in self.store.generators.items()}

    def _send(self, message: tuple) -> None:
        self.transport.write(frame(message))

    def readConnectionLost(self) -> None:
        # The parent is done (or gone): answer what is in flight, then leave.
        defer.ensureDeferred(self._finish())

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason=None) -> None:
        if not self.finished.called:
            self.finished.callback(None)

    async def _finish(self) -> None:
        try:
            if self._opening is not None:
                await self._opening
            await defer.DeferredList(list(self._in_flight))
            if self.store is not None:
                await self.store.close()
        except Exception:  # noqa: BLE001 - leaving anyway
            log.failure("closing the writer's store")
        finally:
            self.transport.loseConnection()


#: Bytes read from the calls' pipe at a time, and the pipe's size asked for.
_READ_SIZE = 1 << 20


class _LargeReads(process.ProcessReader):
    """The calls' pipe read up to ``_READ_SIZE`` bytes at a time, not
    Twisted's 8 KiB: an import's calls carry its events' bytes (60 MB for
    100,000 events), and each read is a turn of this process's reactor, whose
    Python takes the GIL from the database thread beside it."""

    def doRead(self):
        try:
            data = os.read(self.fd, _READ_SIZE)
        except OSError as exc:
            return None if exc.errno in (errno.EAGAIN, errno.EINTR) else CONNECTION_LOST
        if not data:
            return CONNECTION_DONE
        self.dataReceived(data)
        return None


class _LargeReadsStdIO(stdio.StandardIO):
    """``StandardIO`` with its input read by ``_LargeReads``, from a pipe
    made ``_READ_SIZE`` large, Linux's limit for an unprivileged process
    (``/proc/sys/fs/pipe-max-size``; a pipe of the default 64 KiB would hand
    over no more than that a read)."""

    def __init__(self, proto, stdin: int, stdout: int, reactor: Any):
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            try:
                fcntl.fcntl(stdin, fcntl.F_SETPIPE_SZ, _READ_SIZE)
            except OSError:  # not a pipe, or above the system's limit: the default size then
                pass
        self.protocol = proto
        self._writer = process.ProcessWriter(reactor, self, "write", stdout)
        self._reader = _LargeReads(reactor, self, "read", stdin)
        self._reader.startReading()
        self.protocol.makeConnection(self)


async def _serve(reactor: Any, replies_fd: int) -> None:
    calls = _Calls(reactor)
    _LargeReadsStdIO(calls, stdin=0, stdout=replies_fd, reactor=reactor)
    await calls.finished


#: The log's level filter: info until the store's config names its level.
_LOG_LEVELS = LogLevelFilterPredicate(LogLevel.info)


def main() -> None:
    replies_fd = claim_stdout()
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [_LOG_LEVELS])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    # Once the store is closed and the replies written, leave without
    # freeing the caches object by object, which the parent would wait for.
    react_and_leave(lambda reactor: defer.ensureDeferred(_serve(reactor, replies_fd)))


if __name__ == "__main__":
    main()
