"""Reads a room server owes a homeserver (issue 39, item 5): auth chains and
their difference from ``event_auth_edges``, state for many events in one
call, and rejected events hidden from ``get_event`` unless asked."""

from __future__ import annotations

from roomstore.events import resolution_source
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def auth(*built) -> dict:
    return {"auth_events": [b.event_id for b in built]}


@on_both_engines
class RoomServerReadTests:
    async def room_with_auth(self, store):
        """create <- join(alice) <- power levels <- join(bob); two topics
        on forks, each authed by the create, levels and its sender's join."""
        room = RoomBuilder()
        create = room.create()
        join_a = room.build("m.room.member", ALICE, {"membership": "join"}, ALICE, extra=auth(create))
        levels = room.state(
            "m.room.power_levels", "", {"users": {ALICE: 100}}, sender=ALICE, extra=auth(create, join_a)
        )
        join_b = room.build("m.room.member", BOB, {"membership": "join"}, BOB, extra=auth(create, levels))
        base = list(room.leaves)
        topic_a = room.state(
            "m.room.topic",
            "",
            {"topic": "a"},
            sender=ALICE,
            prev=base,
            extra=auth(create, levels, join_a),
            set_leaves=False,
        )
        topic_b = room.state(
            "m.room.topic",
            "",
            {"topic": "b"},
            sender=BOB,
            prev=base,
            extra=auth(create, levels, join_b),
            set_leaves=False,
        )
        await store.persist_events([room.to_persist(e) for e in (create, join_a, levels, join_b, topic_a)])
        await store.persist_events(
            [room.to_persist(topic_b)], resolved_current_state={room.room_id: {("m.room.topic", ""): topic_a.event_id}}
        )
        return room, (create, join_a, levels, join_b, topic_a, topic_b)

    async def test_auth_chains(self):
        store = await self.open_store()
        room, (create, join_a, levels, join_b, topic_a, topic_b) = await self.room_with_auth(store)
        ids = lambda *built: {b.event_id for b in built}  # noqa: E731
        self.assertEqual(await store.get_auth_chain_ids([topic_a.event_id]), ids(create, levels, join_a))
        self.assertEqual(await store.get_auth_chain_ids([join_b.event_id]), ids(create, levels, join_a))
        self.assertEqual(await store.get_auth_chain_ids([create.event_id]), set())
        self.assertEqual(await store.get_auth_chain_ids(["$unknown"]), set())
        # Closures: {topic_a} -> topic_a, create, levels, join_a; {topic_b} -> topic_b, create, levels, join_a, join_b.
        self.assertEqual(
            await store.get_auth_chain_difference([{topic_a.event_id}, {topic_b.event_id}]),
            ids(topic_a, topic_b, join_b),
        )
        self.assertEqual(await store.get_auth_chain_difference([{levels.event_id}, {levels.event_id}]), set())
        self.assertEqual(
            await store.get_auth_chain_difference([{levels.event_id}, {"$unknown"}]),
            ids(levels, create, join_a) | {"$unknown"},
        )
        # Three sets, in one masked walk, and a set at a time (past MAX_MASKED_SETS): the same.
        three = [{topic_a.event_id}, {topic_b.event_id}, {join_b.event_id}]
        self.assertEqual(await store.get_auth_chain_difference(three), ids(topic_a, topic_b, join_b))
        self.patch(resolution_source, "MAX_MASKED_SETS", 2)
        self.assertEqual(await store.get_auth_chain_difference(three), ids(topic_a, topic_b, join_b))

    async def test_the_cached_walk_answers_as_the_recursive_query(self):
        """Resolution's walk of stored chains over the auth edge cache gives
        what one recursive query gives, cold and warm, and a cleared cache
        (a purge) is read again."""
        store = await self.open_store()
        room, (create, join_a, levels, join_b, topic_a, topic_b) = await self.room_with_auth(store)
        cache = store.persister.parsed_events
        cache.clear()

        def walks(txn):
            nids = store.interners.events.lookup(txn, [topic_a.event_id, topic_b.event_id, join_b.event_id])
            start = {nids[topic_a.event_id]: 1, nids[topic_b.event_id]: 2, nids[join_b.event_id]: 4}
            cached = resolution_source.TransactionEventSource(txn, store.interners, {}, cache)
            plain = resolution_source.TransactionEventSource(txn, store.interners, {})
            return plain._stored_masks(start), cached._stored_masks(start), cached._stored_masks(start)

        expected, cold, warm = await store.db.run_interaction("walks", walks)
        self.assertEqual(cold, expected)
        self.assertEqual(warm, expected)
        self.assertTrue(cache.auth_edges._edges)
        cache.clear()
        self.assertFalse(cache.auth_edges._edges)

    async def test_state_for_many_events(self):
        store = await self.open_store()
        room, built = await self.room_with_auth(store)
        wanted = [b.event_id for b in built] + ["$not-stored"]
        many = await store.get_state_ids_for_events(wanted)
        self.assertEqual(set(many), set(wanted) - {"$not-stored"})
        for event_id in many:
            self.assertEqual(many[event_id], await store.get_state_ids(event_id))
        before = await store.get_state_ids_for_events(wanted, before=True)
        for event_id in before:
            self.assertEqual(before[event_id], await store.get_state_ids(event_id, before=True))

    async def test_rejected_events_hidden_unless_asked(self):
        store = await self.open_store()
        room = RoomBuilder()
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        bad = room.message(ALICE, "rejected", set_leaves=False)
        await store.persist_events([room.to_persist(bad, rejected_reason="auth_error")])
        for _ in range(2):  # the second read after the first could have cached it
            self.assertIsNone(await store.get_event(bad.event_id))
            self.assertEqual(await store.get_events([bad.event_id]), {})
            served = await store.get_event(bad.event_id, allow_rejected=True)
            self.assertEqual(served["content"]["body"], "rejected")
        self.assertEqual((await store.get_event_flags([bad.event_id]))[bad.event_id].rejected_reason, "auth_error")
