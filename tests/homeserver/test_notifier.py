"""The notifier wakes only the long-polls a stored batch concerns (pure: a
``Clock``, batch outcomes as the store's hook hands them)."""

from __future__ import annotations

import attrs
from twisted.internet import defer, task
from twisted.trial import unittest

from roomstore.homeserver.notifier import RECENT_BATCHES, Notifier


@attrs.frozen
class Outcome:
    """The two fields of ``BatchOutcome`` the notifier reads."""

    room_positions: dict = attrs.Factory(dict)
    membership_users: dict = attrs.Factory(dict)


class NotifierTests(unittest.TestCase):
    def setUp(self):
        self.clock = task.Clock()
        self.notifier = Notifier(self.clock)

    def wait(self, user: str, rooms, timeout: float = 30) -> defer.Deferred:
        seen = self.notifier.position
        return defer.ensureDeferred(self.notifier.wait_for_change(seen, timeout, user, rooms))

    def test_only_the_rooms_members_and_the_membership_users_wake(self):
        in_a, in_b, invited = self.wait("@a:x", {"!a"}), self.wait("@b:x", {"!b"}), self.wait("@c:x", set())
        self.notifier.notify(Outcome({"!a": 5}))
        self.clock.advance(0)  # the wake comes on the next turn: the batch's IDs complete first
        self.assertTrue(in_a.called)
        self.assertFalse(in_b.called or invited.called)
        self.notifier.notify(Outcome({"!d": 6}, {"@c:x": 6}))
        self.clock.advance(0)
        self.assertTrue(invited.called)
        self.assertFalse(in_b.called)
        self.clock.advance(30)  # its timeout
        self.assertTrue(in_b.called)

    def test_a_batch_between_look_and_wait_wakes_at_once(self):
        seen = self.notifier.position
        self.notifier.notify(Outcome({"!b": 1}))
        self.notifier.notify(Outcome({"!a": 2}))
        woken = defer.ensureDeferred(self.notifier.wait_for_change(seen, 30, "@a:x", {"!a"}))
        self.assertTrue(woken.called)
        seen = self.notifier.position
        self.notifier.notify(Outcome({"!b": 3}))
        other = defer.ensureDeferred(self.notifier.wait_for_change(seen, 30, "@a:x", {"!a"}))
        self.assertFalse(other.called)  # not its room
        self.clock.advance(30)

    def test_anything_unnamed_or_forgotten_wakes_everyone(self):
        waiting = self.wait("@a:x", {"!a"})
        self.notifier.notify()  # no outcome: anything may have changed
        self.clock.advance(0)
        self.assertTrue(waiting.called)
        seen = self.notifier.position
        for i in range(RECENT_BATCHES + 1):
            self.notifier.notify(Outcome({"!b": i}))
        # Older than the batches kept: it cannot tell, so it looks again.
        self.assertTrue(defer.ensureDeferred(self.notifier.wait_for_change(seen, 30, "@a:x", {"!a"})).called)
