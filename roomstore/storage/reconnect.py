"""Riding out a database server that goes away: backoff and outages.

A PostgreSQL server restarts, or a backend is terminated
(``pg_terminate_backend``), and every connection of the pool dies with it.
``Database.run_interaction`` then drops the dead connection and tries the
transaction again on a new one, after a pause that doubles from
``Backoff.initial_s`` up to ``Backoff.maximum_s``; the pauses are taken on the
reactor (``clock``), so no pool thread sleeps and tests drive them with
``twisted.internet.task.Clock``.

:class:`Outages` is the pool's memory of outages, shared by its
interactions: the first lost connection opens an outage (one warning line,
whatever number of interactions and connections meet it), the first
transaction that commits again closes it (one info line with how long it
lasted). Connections opened before the outage began are dropped before they
are used again (``generation``), since the server that held them is gone.
An outage lasting longer than ``give_up_after_s`` fails the interactions
waiting on it with :class:`DatabaseUnavailableError`, one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from prometheus_client import Counter
from twisted.logger import Logger

from roomstore.storage.errors import DatabaseUnavailableError

__all__ = ["Backoff", "ConnectionLost", "Outages", "one_line"]

log = Logger()

outages_counter = Counter("roomstore_db_outages", "Times the database connection was lost (outages begun)")
reconnect_attempts = Counter(
    "roomstore_db_reconnect_attempts", "Transactions tried again after their connection was lost"
)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (PostgreSQL's have several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class ConnectionLost(Exception):
    """A transaction's connection died (or none could be opened): raised from
    the pool's thread to ``run_interaction``, which waits and tries again.

    ``in_doubt``: the connection died while ``COMMIT`` was on its way, for a
    transaction that wrote; ``(xid, outcome)``, the server's transaction id
    and what the body returned, so the next attempt asks the server whether
    it committed (and returns ``outcome`` if so) before running it again.
    ``generation``: the pool's outage generation of the dead connection.
    """

    def __init__(self, cause: BaseException, generation: int, in_doubt: tuple[str, Any] | None = None):
        super().__init__(one_line(cause))
        self.cause = cause
        self.generation = generation
        self.in_doubt = in_doubt


@attrs.frozen
class Backoff:
    """Pauses between attempts: ``initial_s``, doubling, at most ``maximum_s``."""

    initial_s: float = 0.05
    factor: float = 2.0
    maximum_s: float = 2.0

    def delay(self, attempt: int) -> float:
        """The pause before attempt ``attempt + 1`` (``attempt`` >= 1 failed)."""
        return min(self.initial_s * self.factor ** max(attempt - 1, 0), self.maximum_s)


class Outages:
    """The outages one pool meets; see the module docstring. Reactor thread only."""

    def __init__(
        self,
        clock: Any,
        where: str,
        backoff: Backoff = Backoff(),
        give_up_after_s: float = 60.0,
    ):
        self.clock = clock
        self.where = where
        self.backoff = backoff
        self.give_up_after_s = give_up_after_s
        #: Bumped as an outage begins: connections of an older generation are
        #: dropped before use (pool threads read it).
        self.generation = 0
        self.started: float | None = None
        self.cause = ""
        #: Outages survived (ended by a commit), and attempts retried in all.
        self.survived = 0
        self.retries = 0
        #: Called (no arguments) as each outage ends; the writer lock checks itself.
        self.on_end: list[Callable[[], object]] = []

    @property
    def in_outage(self) -> bool:
        return self.started is not None

    def lost(self, exc: ConnectionLost, attempt: int) -> float:
        """A transaction's ``attempt``-th try lost its connection: the pause
        before the next, or ``DatabaseUnavailableError`` once the outage has
        lasted ``give_up_after_s``."""
        now = self.clock.seconds()
        self.retries += 1
        reconnect_attempts.inc()
        if self.started is None:
            if exc.generation < self.generation:
                # A connection from before the last outage, which has ended:
                # dead with that server; a new one will do, at once. A commit
                # still in doubt waits for its old session to end: the backoff.
                return 0.0 if exc.in_doubt is None else self.backoff.delay(attempt)
            self.generation += 1
            self.started = now
            self.cause = one_line(exc.cause)
            outages_counter.inc()
            log.warn(
                "{where}: lost the database connection ({cause}); reconnecting with backoff"
                " (transactions wait up to {limit:.0f} s)",
                where=self.where,
                cause=self.cause,
                limit=self.give_up_after_s,
            )
        if now - self.started >= self.give_up_after_s:
            raise DatabaseUnavailableError(
                f"{self.where} has been unreachable for {now - self.started:.0f} s ({one_line(exc.cause)}):"
                " is the server running? The transaction was not committed"
            )
        return self.backoff.delay(attempt)

    def committed(self) -> None:
        """A transaction committed: an outage in progress is over."""
        if self.started is None:
            return
        lasted = self.clock.seconds() - self.started
        self.started = None
        self.survived += 1
        log.info("{where}: database connection back after {lasted:.1f} s", where=self.where, lasted=lasted)
        for hook in list(self.on_end):
            hook()
