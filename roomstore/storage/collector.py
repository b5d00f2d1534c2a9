"""Pausing Python's cyclic garbage collector around bulk work on short-lived rows.

A replication page makes thousands of tuples and lists that live until the
page is sent or applied, and are then freed by reference counting: none
of them is ever cyclic garbage. Yet allocating them runs the cyclic
collector every 700 container allocations, which moves the page's live
objects into the older generations, and those promotions bring on full
collections, which walk every object of the process (a worker caught up
20,000 events in ~150 ms on this machine, and one full collection in the
middle of it took 60-140 ms of that). ``collector_paused()`` holds the
collector off for the length of such a step: when it ends, the step's
objects are gone and the collector's allocation count is back where it
was, so no collection runs for them at all. Cyclic garbage made meanwhile
(by anything, in any thread) waits for the next collection after the
pause.

Pauses nest and may overlap in several threads: the collector is disabled
by the first and enabled again by the last to end, and only if it was
enabled when the first began (an application that turned it off keeps it
off). Keep a pause to a bounded step (one page, one read): never across an
``await``.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused", "freeze_startup_objects"]

_lock = threading.Lock()
_depth = 0
_enable_after = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector off until the block ends."""
    global _depth, _enable_after
    with _lock:
        if _depth == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _enable_after:
                gc.enable()


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive into the collector's
    permanent generation (``gc.freeze``), as Synapse's processes do once
    started: what a process makes at start-up (modules, the store, its
    first cache entries) lives as long as it does, and full collections no
    longer walk it. For a process's entry point (``roomstore serve`` and
    ``follow`` call it once their service is ready), never for a library
    or a test process: frozen objects are never collected."""
    gc.collect()
    gc.freeze()
