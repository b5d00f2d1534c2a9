"""Wakes long-polling ``/sync`` requests when events are stored.

One process writes every event, so "something changed" is enough: each
change bumps :attr:`Notifier.position`, and a sync that found nothing waits
for the position to move past the one it read before looking (so a change
between its look and its wait still wakes it), or for its timeout."""

from __future__ import annotations

from twisted.internet import defer

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, clock):
        self._clock = clock
        self.position = 0
        self._waiters: list[defer.Deferred] = []

    def notify(self, *_ignored) -> None:
        """Something changed (also a store invalidation hook: it takes the batch's outcome)."""
        self.position += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    async def wait_for_change(self, seen: int, timeout_s: float) -> None:
        """Return once ``position`` is past ``seen``, or after ``timeout_s``."""
        if self.position != seen or timeout_s <= 0:
            return
        waiter: defer.Deferred = defer.Deferred()
        self._waiters.append(waiter)
        call = self._clock.callLater(timeout_s, lambda: waiter.called or waiter.callback(None))
        try:
            await waiter
        finally:
            if call.active():
                call.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
