"""A worker's positions file: read at start, saved off the reactor, coalesced.

``load_positions`` and ``save_positions`` read and write the file (a JSON
object ``{stream: {writer: token}}``, replaced atomically).
``PositionsFileWriter`` is what a running worker saves through: ``update``
records the newest positions and returns at once; one write at a time runs on
a thread, and positions that arrive while it runs are written by the next one,
newest only (a burst of N tokens costs at most two writes, not N). ``flush``
waits until the newest positions are on disk: the worker calls it when it
stops, so nothing applied is left unsaved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

__all__ = ["PositionsFileWriter", "load_positions", "save_positions"]

log = Logger()

Positions = Mapping[tuple[str, str], int]


def load_positions(path: str) -> dict[tuple[str, str], int] | None:
    """Positions saved by :func:`save_positions`, or None if there is no
    usable file (missing, or unreadable after e.g. a power cut)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return {(stream, instance): int(token) for stream, tokens in data.items() for instance, token in tokens.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warn("ignoring unreadable positions file {path}: {exc}", path=path, exc=exc)
        return None


def save_positions(path: str, positions: Positions) -> None:
    """Write ``positions`` to ``path`` atomically (a reader sees the old or the
    new file, never half of one). Not fsynced: it survives the process being
    killed, which is what it is for; after a power cut it may be old (rows
    are replayed) or unreadable (the worker starts from its store's
    positions, as a fresh worker does)."""
    data: dict[str, dict[str, int]] = {}
    for (stream, instance), token in sorted(positions.items()):
        data.setdefault(stream, {})[instance] = token
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, sort_keys=True)
    os.replace(tmp, path)


def reactor_threads(reactor: Any) -> Callable[..., defer.Deferred]:
    """``run(f, *args)``: ``f(*args)`` on ``reactor``'s thread pool, as a Deferred."""
    from twisted.internet.threads import deferToThreadPool

    return lambda f, *args: deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


class PositionsFileWriter:
    """Saves a worker's positions to ``path`` off the reactor, coalesced.

    ``run_in_thread(f, *args)`` runs ``f(*args)`` off the reactor and returns
    a Deferred of its result (``reactor_threads(reactor)``; tests pass one they
    fire by hand). At most one write is in flight. A write that fails (disk
    full, directory gone) is logged in one line and leaves the previous file
    as it was; the next ``update`` or ``flush`` writes the newest positions.
    """

    def __init__(
        self,
        path: str,
        run_in_thread: Callable[..., defer.Deferred],
        save: Callable[[str, Positions], None] = save_positions,
    ) -> None:
        self.path = path
        self._run = run_in_thread
        self._save = save
        #: The newest positions given, and the last ones written to the file.
        self._newest: dict[tuple[str, str], int] | None = None
        self._saved: dict[tuple[str, str], int] | None = None
        self._in_flight: defer.Deferred | None = None
        self._idle_waiters: list[defer.Deferred] = []

    @property
    def writing(self) -> bool:
        """Whether a write is in flight."""
        return self._in_flight is not None

    def update(self, positions: Positions) -> None:
        """Record the newest positions; written now if no write is in flight,
        else by the write after it."""
        self._newest = dict(positions)
        if self._in_flight is None:
            self._write_newest()

    async def flush(self) -> None:
        """Wait until the newest positions given are written (or a write of
        them failed, logged): the worker's last step before it stops."""
        await self._until_idle()
        if self._newest is not None and self._newest != self._saved:
            self._write_newest()
            await self._until_idle()

    async def _until_idle(self) -> None:
        while self._in_flight is not None:
            waiter: defer.Deferred = defer.Deferred()
            self._idle_waiters.append(waiter)
            await waiter

    def _write_newest(self) -> None:
        snapshot = self._newest
        self._in_flight = self._run(self._save, self.path, snapshot)
        self._in_flight.addBoth(self._written, snapshot)

    def _written(self, result: Any, snapshot: dict) -> None:
        self._in_flight = None
        if isinstance(result, Failure):
            log.warn(
                "could not save positions to {path}: {error}; the previous file stays, the next update tries again",
                path=self.path,
                error=result.getErrorMessage(),
            )
        else:
            self._saved = snapshot
            if self._newest is not snapshot and self._newest != snapshot:
                # Positions arrived while it ran: write the newest, once.
                self._write_newest()
                return
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter.callback(None)
