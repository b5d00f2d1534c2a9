"""Wakes long-polling ``/sync`` requests when events that concern them are stored.

Each stored batch (the store's invalidation hook hands over its
``BatchOutcome``) bumps :attr:`Notifier.position` and is remembered as the
rooms it wrote to and the users whose membership it changed. A sync that
found nothing waits, naming its user and the rooms it is joined to; only a
batch touching one of those rooms or that user wakes it, so a message wakes
the room's members rather than every client (each woken sync reads the
store again). A sync passes the position it read before looking: a batch
for it between its look and its wait still wakes it at once (the recent
batches are kept for that; one older than they reach wakes it anyway).
A batch whose outcome names nothing (``notify()`` alone) wakes everyone."""

from __future__ import annotations

import collections
from collections.abc import Collection

import attrs
from twisted.internet import defer

__all__ = ["Notifier"]

#: Batches remembered for syncs between their look and their wait.
RECENT_BATCHES = 256


def _wake(waiters: set[_Waiter]) -> None:
    for waiter in waiters:
        if not waiter.deferred.called:
            waiter.deferred.callback(None)


@attrs.frozen
class _Change:
    """What one batch touched; ``rooms`` and ``users`` None: anything."""

    position: int
    rooms: frozenset[str] | None
    users: frozenset[str] | None

    def concerns(self, user_id: str, rooms: Collection[str]) -> bool:
        if self.rooms is None or self.users is None:
            return True
        return user_id in self.users or not self.rooms.isdisjoint(rooms)


@attrs.define(eq=False)
class _Waiter:
    user_id: str
    rooms: frozenset[str]
    deferred: defer.Deferred


class Notifier:
    def __init__(self, clock):
        self._clock = clock
        self.position = 0
        self._recent: collections.deque[_Change] = collections.deque(maxlen=RECENT_BATCHES)
        #: room ID (or user ID) -> the waiters it wakes; ``_everyone``: every waiter.
        self._by_room: dict[str, set[_Waiter]] = {}
        self._by_user: dict[str, set[_Waiter]] = {}
        self._everyone: set[_Waiter] = set()

    def notify(self, outcome=None) -> None:
        """A batch was stored (the store's invalidation hook: ``outcome`` its
        ``BatchOutcome``; None, or one naming no room and no user: wake all)."""
        self.position += 1
        rooms = frozenset(getattr(outcome, "room_positions", None) or ())
        users = frozenset(getattr(outcome, "membership_users", None) or ())
        if not rooms and not users:
            self._recent.append(_Change(self.position, None, None))
            woken = set(self._everyone)
        else:
            self._recent.append(_Change(self.position, rooms, users))
            woken = set()
            for room_id in rooms:
                woken.update(self._by_room.get(room_id, ()))
            for user_id in users:
                woken.update(self._by_user.get(user_id, ()))
        if woken:
            # Next turn of the reactor: the store calls its hooks before the
            # batch's stream IDs complete, and a sync woken now would not see it.
            self._clock.callLater(0, _wake, woken)

    def changed_since(self, seen: int, user_id: str, rooms: Collection[str]) -> bool:
        """Whether a batch after position ``seen`` concerns the user or one of ``rooms``."""
        if seen >= self.position:
            return False
        if not self._recent or self._recent[0].position > seen + 1:
            return True  # older than what is remembered
        return any(change.position > seen and change.concerns(user_id, rooms) for change in self._recent)

    async def wait_for_change(
        self, seen: int, timeout_s: float, user_id: str = "", rooms: Collection[str] = ()
    ) -> None:
        """Return once a batch after position ``seen`` concerns ``user_id`` or
        one of ``rooms``, or after ``timeout_s``."""
        if timeout_s <= 0 or self.changed_since(seen, user_id, rooms):
            return
        waiter = _Waiter(user_id, frozenset(rooms), defer.Deferred())
        self._add(waiter)

        def expire() -> None:
            if not waiter.deferred.called:
                waiter.deferred.callback(None)

        call = self._clock.callLater(timeout_s, expire)
        try:
            await waiter.deferred
        finally:
            if call.active():
                call.cancel()
            self._remove(waiter)

    def _add(self, waiter: _Waiter) -> None:
        self._everyone.add(waiter)
        self._by_user.setdefault(waiter.user_id, set()).add(waiter)
        for room_id in waiter.rooms:
            self._by_room.setdefault(room_id, set()).add(waiter)

    def _remove(self, waiter: _Waiter) -> None:
        self._everyone.discard(waiter)
        for index, keys in ((self._by_user, [waiter.user_id]), (self._by_room, waiter.rooms)):
            for key in keys:
                waiters = index.get(key)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del index[key]
