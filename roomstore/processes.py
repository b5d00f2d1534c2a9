"""What roomstore's own processes share: the collector set for bulk work,
and a quick exit.

``tune_collector``: the writer process and the validation workers hold what
their start made for their whole life, and build large batches; Python's
collector thresholds (700 / 10 / 10) would walk both thousands of times an
import to find nothing.

``leave_now``: a bulk load leaves millions of objects in its caches; at a
normal exit Python frees them one by one, which took 0.1-0.2 s at the end of
every import, in the writer process and again in the command
(docs/benchmarks.md). Only the processes' own entry points call it, once
their stores are closed: nothing is left then that the operating system does
not release itself.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

#: The collector's thresholds for bulk work (Python's are 700 / 10 / 10): a
#: young collection every 50,000 net allocations, the older generations
#: after 20 and 100 of those. The bulk loads (``roomstore.cli.common.
#: bulk_load_gc``), their writer process and the validation workers use them.
BULK_GC_THRESHOLDS = (50_000, 20, 100)


def tune_collector(thresholds: tuple[int, int, int]) -> None:
    """What exists now (the modules imported, a store opened) out of every
    collection from here on, and the collector's ``thresholds``."""
    gc.freeze()
    gc.set_threshold(*thresholds)


def code_of(done: SystemExit) -> int:
    """The status a ``SystemExit`` asks for, as the interpreter reads it:
    None is 0; a message is written to stderr and is 1."""
    if done.code is None:
        return 0
    if isinstance(done.code, int):
        return done.code
    sys.stderr.write(f"{done.code}\n")
    return 1


def react_and_leave(main: Callable[..., Any], argv: Sequence[Any] = ()) -> NoReturn:
    """``twisted.internet.task.react(main, argv)``, then ``leave_now`` with
    the status it ends with: the entry point of a process whose store
    ``main`` closes before it returns."""
    from twisted.internet import task  # here: the validation workers import this module, and no Twisted

    code = 0
    try:
        task.react(main, argv)
    except SystemExit as done:
        code = code_of(done)
    leave_now(code)


def leave_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then exit with ``code`` at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more to say
            pass
    os._exit(code)
