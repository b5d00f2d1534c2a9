"""What a client-server front needs of the store (issue 41 item 2): the
topological token of an event, and events in the client format."""

from __future__ import annotations

from roomstore.storage import NotFoundError
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def ids(events):
    return [e["event_id"] for e in events]


class RoomHelpers:
    async def open_room_store(self) -> RoomStore:
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        return store

    async def build_forked_room(self, store):
        """A room whose topological order is not its stream order (two
        branches persisted interleaved, a late event on an old branch), and
        an outlier. Returns (room, results by event ID of the graph events,
        the outlier's ID)."""
        room = RoomBuilder(room_id="!client:example.org")
        results = {}

        async def persist(*events, **flags):
            for result in await store.persist_events([room.to_persist(e, **flags) for e in events]):
                results[result.event_id] = result

        await persist(room.create(), room.join(ALICE), room.join_rules(), room.join(BOB))
        base = room.message(ALICE, "base")
        await persist(base)
        a1 = room.message(ALICE, "a1", prev=[base.event_id])
        b1 = room.message(BOB, "b1", prev=[base.event_id])
        a2 = room.message(ALICE, "a2", prev=[a1.event_id])
        await persist(a1, b1)
        await persist(a2)
        room.leaves = [a2.event_id, b1.event_id]
        await persist(room.message(ALICE, "merge"))
        leaves = list(room.leaves)
        late = room.message(BOB, "late", prev=[a1.event_id])
        room.leaves = leaves
        await persist(late)
        await persist(room.message(ALICE, "last"))
        outlier = room.message(ALICE, "outlier", prev=[fake_event_id("gone")], set_leaves=False)
        await persist(outlier, outlier=True)
        del results[outlier.event_id]
        return room, results, outlier.event_id


@on_both_engines
class TopologicalTokenTests(RoomHelpers):
    async def test_token_of_every_event_and_pages_from_it(self):
        store = await self.open_room_store()
        room, results, _ = await self.build_forked_room(store)
        keys = {e: (r.topological_ordering, r.stream_ordering) for e, r in results.items()}
        ascending = sorted(keys, key=keys.__getitem__)
        self.assertNotEqual(ascending, sorted(keys, key=lambda e: keys[e][1]))  # the forks matter
        for position, event_id in enumerate(ascending):
            token = await store.get_topological_token(event_id)
            self.assertEqual(token, results[event_id].topological_token)
            self.assertEqual(token, "t%d-%d" % keys[event_id])
            # The token is the position just after the event: backwards from
            # it comes the event, then each one before it in topological
            # order; forwards, the events after it.
            back = await store.paginate(room.room_id, ALICE, token, "b", len(keys))
            self.assertEqual(ids(back.events), ascending[position::-1])
            forward = await store.paginate(room.room_id, ALICE, token, "f", len(keys))
            self.assertEqual(ids(forward.events), ascending[position + 1:])
            # One page of one event ends just before it: the next page starts right before the event.
            first = await store.paginate(room.room_id, ALICE, token, "b", 1)
            self.assertEqual(ids(first.events), [event_id])
            before = await store.paginate(room.room_id, ALICE, first.next_token, "b", 1)
            self.assertEqual(ids(before.events), ascending[position - 1:position] if position else [])

    async def test_unknown_event_and_outlier_raise_not_found(self):
        store = await self.open_room_store()
        _, _, outlier = await self.build_forked_room(store)
        unknown = fake_event_id("nobody has it")
        with self.assertRaises(NotFoundError) as caught:
            await store.get_topological_token(unknown)
        self.assertEqual(str(caught.exception), f"event {unknown} is not stored")
        self.assertIsInstance(caught.exception, KeyError)
        with self.assertRaises(NotFoundError) as caught:
            await store.get_topological_token(outlier)
        self.assertIn("is an outlier", str(caught.exception))
