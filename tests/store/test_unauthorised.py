"""The store checks every event against its room's authorization rules
(issue 39, item 3): each unauthorised event of the issue, handed over
through the public API (``RoomStore.persist_events``) as a homeserver would,
in a version 12 room that is invite-only with ``redact: 50``, is stored
rejected and changes nothing a member is served: not membership, not
current state, not a timeline (``sync``, ``paginate``, ``recent``), not a
forward extremity. Beside each, the same event made allowable is accepted,
so the checks are what refuses it."""

from __future__ import annotations

from roomstore.events.write import auth_checks
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"  # the creator: infinite power in v12
BOB = "@bob:example.org"  # invited and joined, power 0
MALLORY = "@mallory:example.org"  # never invited
EVE = "@eve:elsewhere.org"  # invited and joined from another server, power 0


@on_both_engines
class UnauthorisedEventTests:
    async def room(self, store) -> RoomBuilder:
        """The issue's room: v12, invite-only, ``redact: 50``; Bob and Eve invited and joined."""
        room = RoomBuilder(version="12", creator=ALICE)
        events = [room.create(), room.join(ALICE)]
        events.append(room.state("m.room.power_levels", "", {"users": {}, "redact": 50, "users_default": 0}))
        events.append(room.join_rules("invite"))
        events.append(room.history_visibility("shared"))
        for user in (BOB, EVE):
            events += [room.member(user, "invite", sender=ALICE), room.join(user)]
        results = await store.persist_events([room.to_persist(e) for e in events])
        self.assertEqual([r.rejected_reason for r in results], [None] * len(events))
        return room

    async def served(self, store, room) -> dict:
        """Everything a member (Bob) is served of the room."""
        sync = await store.sync(BOB, None, initial_limit=100)
        back = await store.paginate(room.room_id, BOB, None, "b", 100)
        recent = await store.recent(BOB, 5, 100)
        return {
            "members": await store.get_users_in_room(room.room_id),
            "state": await store.get_current_state_ids(room.room_id),
            "extremities": sorted(await store.get_forward_extremities(room.room_id)),
            "sync": [e["event_id"] for e in sync.rooms.get(room.room_id, [])],
            "paginate": [e["event_id"] for e in back.events],
            "recent": [[e["event_id"] for e in events] for room_id, events in recent.rooms if room_id == room.room_id],
        }

    async def assert_rejected(self, store, room, bad, rule: str) -> None:
        """``bad`` persisted: stored rejected for ``rule``, served nowhere,
        and what Bob is served is as it was."""
        before = await self.served(store, room)
        [result] = await store.persist_events([room.to_persist(bad)])
        self.assertIsNotNone(result.rejected_reason)
        self.assertIn(rule, result.rejected_reason)
        self.assertNotIn("\n", result.rejected_reason)
        flags = await store.get_event_flags([bad.event_id])
        self.assertEqual(flags[bad.event_id].rejected_reason, result.rejected_reason)
        self.assertIsNone(await store.get_event(bad.event_id))
        self.assertIsNotNone(await store.get_event(bad.event_id, allow_rejected=True))
        self.assertEqual(await self.served(store, room), before)
        # The builder took it as the room's leaf: the room goes on from the accepted one.
        room.leaves = before["extremities"]

    async def assert_accepted(self, store, room, good) -> None:
        [result] = await store.persist_events([room.to_persist(good)])
        self.assertIsNone(result.rejected_reason)
        self.assertIsNotNone(await store.get_event(good.event_id))

    async def test_a_user_never_invited_cannot_join(self):
        store = await self.open_store()
        room = await self.room(store)
        await self.assert_rejected(store, room, room.join(MALLORY), "is not invited")
        self.assertNotIn(MALLORY, await store.get_users_in_room(room.room_id))
        self.assertEqual(await store.get_rooms_for_user(MALLORY), frozenset())
        await self.assert_accepted(store, room, room.member(MALLORY, "invite", sender=ALICE))
        await self.assert_accepted(store, room, room.join(MALLORY))
        self.assertIn(MALLORY, await store.get_users_in_room(room.room_id))

    async def test_a_user_without_power_cannot_change_the_topic(self):
        store = await self.open_store()
        room = await self.room(store)
        await self.assert_rejected(
            store, room, room.state("m.room.topic", "", {"topic": "mine"}, sender=BOB), "needs power 50"
        )
        self.assertNotIn(("m.room.topic", ""), await store.get_current_state_ids(room.room_id))
        await self.assert_accepted(store, room, room.state("m.room.topic", "", {"topic": "hers"}, sender=ALICE))

    async def test_a_user_who_never_joined_cannot_send(self):
        store = await self.open_store()
        room = await self.room(store)
        await self.assert_rejected(
            store, room, room.message(MALLORY, "let me in"), "rule 6: @mallory:example.org is not joined"
        )
        await self.assert_accepted(store, room, room.message(BOB, "a member's"))

    async def test_auth_events_that_do_not_exist(self):
        store = await self.open_store()
        room = await self.room(store)
        missing = fake_event_id("no such event")
        forged = room.build(
            "m.room.message", BOB, {"msgtype": "m.text", "body": "forged"}, extra={"auth_events": [missing]}
        )
        await self.assert_rejected(store, room, forged, "missing")

    async def test_auth_events_the_rules_do_not_select(self):
        store = await self.open_store()
        room = await self.room(store)
        # Bob cites Eve's membership for his message: not an auth event of his.
        state = await store.get_current_state_ids(room.room_id)
        cited = [state[("m.room.power_levels", "")], state[("m.room.member", BOB)], state[("m.room.member", EVE)]]
        forged = room.build("m.room.message", BOB, {"msgtype": "m.text", "body": "odd"}, extra={"auth_events": cited})
        await self.assert_rejected(store, room, forged, "not one the rules select")

    async def test_stale_auth_events_are_checked_against_the_state_before(self):
        """An event whose auth events allow it but the state before it does
        not (Bob banned since): rejected by the second check."""
        store = await self.open_store()
        room = await self.room(store)
        stale = room.auth_events_for("m.room.message", BOB)
        await self.assert_accepted(store, room, room.member(BOB, "ban", sender=ALICE))
        late = room.build(
            "m.room.message", BOB, {"msgtype": "m.text", "body": "after the ban"}, extra={"auth_events": stale}
        )
        before = await self.served(store, room)
        [result] = await store.persist_events([room.to_persist(late)])
        self.assertIn("auth:", result.rejected_reason)
        self.assertEqual(await self.served(store, room), before)

    async def test_a_redaction_without_power_is_not_applied(self):
        store = await self.open_store()
        room = await self.room(store)
        message = room.message(ALICE, "the creator's")
        await self.assert_accepted(store, room, message)
        # Eve (power 0, another server) may send a redaction event, but it redacts nothing.
        redaction = room.redact(EVE, message.event_id)
        await self.assert_accepted(store, room, redaction)
        self.assertFalse((await store.get_event_flags([message.event_id]))[message.event_id].redacted)
        self.assertEqual((await store.get_event(message.event_id))["content"]["body"], "the creator's")

    async def test_an_event_citing_a_rejected_auth_event(self):
        store = await self.open_store()
        room = await self.room(store)
        join = room.join(MALLORY)
        await self.assert_rejected(store, room, join, "is not invited")
        # Mallory's message cites her rejected join (the builder's state holds it).
        follow = room.build("m.room.message", MALLORY, {"msgtype": "m.text", "body": "I am in"}, prev=[join.event_id])
        await self.assert_rejected(store, room, follow, "was rejected")

    async def test_the_checks_of_a_batch_see_its_earlier_events(self):
        """Invite and join in one batch: the join's auth events are the
        batch's invite; a rejected event early in a batch makes the events
        citing it rejected too."""
        store = await self.open_store()
        room = await self.room(store)
        invite = room.member(MALLORY, "invite", sender=ALICE)
        join = room.join(MALLORY)
        topic = room.state("m.room.topic", "", {"topic": "by a newcomer"}, sender=MALLORY)
        said = room.message(MALLORY, "hello")
        results = await store.persist_events([room.to_persist(e) for e in (invite, join, topic, said)])
        self.assertEqual([r.rejected_reason is None for r in results], [True, True, False, True])
        self.assertIn(MALLORY, await store.get_users_in_room(room.room_id))
        self.assertNotIn(("m.room.topic", ""), await store.get_current_state_ids(room.room_id))

    async def test_trusted_events_are_stored_as_given(self):
        """``auth_checked``: the source checked them (an import from a
        server's database); the store takes its word."""
        store = await self.open_store()
        room = await self.room(store)
        join = room.join(MALLORY)
        [result] = await store.persist_events([room.to_persist(join, auth_checked=True)])
        self.assertIsNone(result.rejected_reason)
        self.assertIn(MALLORY, await store.get_users_in_room(room.room_id))


@on_both_engines
class SoftFailTests:
    """Check 6 of the server-server spec ("soft failure"): an event that its
    auth events and the state before it allow, but the room's current state
    as it arrives does not, is stored soft-failed: part of the state after
    it, never served in a timeline, never a forward extremity."""

    async def test_alike_events_against_one_state_are_compared_once_a_batch(self):
        # Twenty messages of Bob's citing the same auth events against the
        # same state: the quick path compares them with the state for the
        # second only (the first takes the full checks), and the rest are
        # accepted as it was. After a ban in the same batch a message citing
        # those auth events again is against another state: compared, fully
        # checked, and rejected.
        store = await self.open_store()
        room = RoomBuilder(version="12", creator=ALICE)
        setup = [room.create(), room.join(ALICE), room.join_rules(), room.join(BOB)]
        await store.persist_events([room.to_persist(e) for e in setup])
        compared = []
        real = auth_checks._cites_exactly
        self.patch(auth_checks, "_cites_exactly", lambda *args: compared.append(1) or real(*args))
        chat = [room.message(BOB, f"message {i}") for i in range(20)]
        ban = room.member(BOB, "ban", sender=ALICE)
        stale = room.message(BOB, "after the ban", extra={"auth_events": chat[-1].event["auth_events"]})
        results = await store.persist_events([room.to_persist(e) for e in [*chat, ban, stale]])
        self.assertEqual([r.rejected_reason is None for r in results], [True] * 21 + [False])
        self.assertEqual(len(compared), 2)

    async def test_a_message_on_an_old_branch_after_a_ban(self):
        store = await self.open_store()
        room = RoomBuilder(version="12", creator=ALICE)
        events = [room.create(), room.join(ALICE), room.join_rules(), room.join(BOB)]
        await store.persist_events([room.to_persist(e) for e in events])
        before_ban = list(room.leaves)
        ban = room.member(BOB, "ban", sender=ALICE)
        await store.persist_events([room.to_persist(ban)])
        # Bob answers from before the ban (his server had not heard of it).
        late = room.message(BOB, "I did not see the ban", prev=before_ban)
        [result] = await store.persist_events([room.to_persist(late)])
        self.assertIsNone(result.rejected_reason)
        self.assertTrue(result.soft_failed)
        flags = (await store.get_event_flags([late.event_id]))[late.event_id]
        self.assertEqual((flags.rejected_reason, flags.soft_failed), (None, True))
        self.assertEqual(await store.get_forward_extremities(room.room_id), [ban.event_id])
        sync = await store.sync(ALICE, None, initial_limit=50)
        self.assertNotIn(late.event_id, [e["event_id"] for e in sync.rooms[room.room_id]])
        page = await store.paginate(room.room_id, ALICE, None, "b", 50)
        self.assertNotIn(late.event_id, [e["event_id"] for e in page.events])
        # Federation still has it: it is part of the room's graph.
        self.assertIsNotNone(await store.get_event(late.event_id))
        # The same message from a current member on the same old branch is accepted.
        fine = room.message(ALICE, "mine is fine", prev=before_ban)
        [result] = await store.persist_events([room.to_persist(fine)])
        self.assertFalse(result.soft_failed)
        self.assertEqual(
            sorted(await store.get_forward_extremities(room.room_id)), sorted([ban.event_id, fine.event_id])
        )

    async def test_a_soft_failed_state_event_is_in_the_state_after_it(self):
        store = await self.open_store()
        room = RoomBuilder(version="10", creator=ALICE)
        events = [
            room.create(),
            room.join(ALICE),
            room.join_rules(),
            room.power_levels({ALICE: 100, BOB: 50}),
            room.join(BOB),
        ]
        await store.persist_events([room.to_persist(e) for e in events])
        before = list(room.leaves)
        demote = room.power_levels({ALICE: 100, BOB: 0})
        await store.persist_events([room.to_persist(demote)])
        topic = room.state("m.room.topic", "", {"topic": "Bob's, from before"}, sender=BOB, prev=before)
        [result] = await store.persist_events([room.to_persist(topic)])
        self.assertTrue(result.soft_failed)
        self.assertEqual((await store.get_state_ids(topic.event_id))[("m.room.topic", "")], topic.event_id)
        self.assertNotIn(("m.room.topic", ""), await store.get_current_state_ids(room.room_id))

    async def test_in_one_batch_the_ends_move_with_the_batch(self):
        store = await self.open_store()
        room = RoomBuilder(version="11", creator=ALICE)
        base = [room.create(), room.join(ALICE), room.join_rules(), room.join(BOB)]
        before_ban = base[-1].event_id
        ban = room.member(BOB, "ban", sender=ALICE)
        late = room.message(BOB, "late", prev=[before_ban])
        results = await store.persist_events([room.to_persist(e) for e in [*base, ban, late]])
        self.assertEqual([r.soft_failed for r in results], [False] * 5 + [True])
