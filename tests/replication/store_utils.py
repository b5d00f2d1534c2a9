"""Helpers for replication tests over real stores: a writer and its workers,
RDATA lines for a page of rows, and waiting on the real reactor."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater

from roomstore.replication.commands import RdataCommand, serialize_command
from roomstore.store import RoomStore, StoreConfig

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
CAROL = "@carol:example.org"

#: A worker store: a reader of every stream "master" writes.
WORKER_WRITERS = {"events": ["master"], "backfill": ["master"], "caches": ["master"]}


def worker_config(name: str = "worker1") -> StoreConfig:
    return StoreConfig(instance_name=name, stream_writers=WORKER_WRITERS)


async def open_pair(
    test: Any, url: str | None = None, workers: Sequence[str] = ("worker1",)
) -> tuple[RoomStore, list[RoomStore]]:
    """A writer store ("master") and worker stores on one fresh database of
    the test's engine, closed after the test (workers first)."""
    url = url or test.new_database_url()
    writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
    test.addCleanup(writer.close)
    opened = []
    for name in workers:
        worker = await RoomStore.open(url, worker_config(name))
        test.addCleanup(worker.close)
        opened.append(worker)
    return writer, opened


def rdata_lines(stream_name: str, updates: Iterable[tuple[int, tuple]], writer: str = "master") -> list[str]:
    """The RDATA lines a server sends for ``updates``: ``batch`` on all but the
    last row of each token."""
    updates = list(updates)
    lines = []
    for index, (token, row) in enumerate(updates):
        last = index + 1 == len(updates) or updates[index + 1][0] != token
        lines.append(serialize_command(RdataCommand(stream_name, writer, token if last else None, row)))
    return lines


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the real reactor until true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await sleep(0.005)


async def with_timeout(d: defer.Deferred, timeout: float, what: str) -> Any:
    """Await ``d``, failing the test (and cancelling ``d``) after ``timeout`` seconds."""
    timed_out = []

    def expire() -> None:
        timed_out.append(True)
        d.cancel()

    call = reactor.callLater(timeout, expire)
    try:
        return await d
    except defer.CancelledError:
        if timed_out:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None
        raise
    finally:
        if call.active():
            call.cancel()


def reap(processes: list) -> None:
    """Kill and wait for every child process in ``processes`` still running (a cleanup)."""
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
