"""Hypothesis examples that each await the store, run from a test method.

Hypothesis calls its test function synchronously; the store's calls need the
reactor. ``run_examples`` runs Hypothesis in a worker thread and blocks on
the reactor for each example (``blockingCallFromThread``) while trial's
reactor keeps running, stops drawing new examples once the time budget is
spent (what ran is the test), and fails the test with the first failure's
traceback, before any shrinking that the budget cut short.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor, threads
from twisted.internet.threads import blockingCallFromThread


async def run_examples(
    test: Any, example: Callable[..., Awaitable[None]], strategies: list, max_examples: int, budget_seconds: float
) -> int:
    """Run ``example(*drawn)`` for the values Hypothesis draws from
    ``strategies``; return how many examples ran."""
    tried: list[int] = [0]
    first_failure: list[str] = []
    started = time.monotonic()

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.tuples(*strategies))
    def check(drawn):
        if time.monotonic() - started > budget_seconds:
            return  # out of time
        tried[0] += 1
        try:
            blockingCallFromThread(reactor, lambda: defer.ensureDeferred(example(*drawn)))
        except Exception:
            if not first_failure:
                first_failure.append(f"{drawn!r:.300}\n{traceback.format_exc()}")
            raise

    try:
        await threads.deferToThread(check)
    except Exception:
        if not first_failure:
            raise  # Hypothesis itself refused to run (a strategy's mistake)
        test.fail(f"after {tried[0]} examples, first failure:\n{first_failure[0]}")
    return tried[0]
