"""``SynapseReader``: a ``SynapseSource`` driven from the reactor.

The source's calls block (sqlite3, psycopg2), so they run on a thread pool of
one thread owned by the reader: the connection is only ever used from that
thread, and the reactor only schedules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

from roomstore.synapse_db.source import SynapseSource


class SynapseReader:
    """Open with ``await SynapseReader.open(url, reactor)``; ``await
    reader.run(source_method, *args)`` for each read; ``await reader.close()``."""

    def __init__(self, source: SynapseSource, reactor: Any):
        self.source = source
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="synapse-reader")

    @classmethod
    async def open(cls, url: str, reactor: Any) -> SynapseReader:
        reader = cls(SynapseSource(url), reactor)
        reader._pool.start()
        try:
            await reader.run(reader.source.connect)
        except BaseException:
            reader._pool.stop()
            raise
        return reader

    def run(self, fn: Callable[..., Any], *args: Any):
        """``fn(*args)`` on the reader's thread, as a Deferred."""
        return deferToThreadPool(self._reactor, self._pool, fn, *args)

    async def close(self) -> None:
        try:
            await self.run(self.source.close)
        finally:
            self._pool.stop()
