"""Traps a new user hit when persisting (issue 11): stream IDs spent on
events already stored, an event given twice counted twice, and a room
started by an event that is not its create event."""

from __future__ import annotations

from roomstore.events.validation import InvalidEventError
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"


@on_both_engines
class PersistTrapTests:
    async def open_store(self) -> RoomStore:
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        return store

    async def test_stored_events_take_no_stream_ids(self):
        store = await self.open_store()
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE), room.message(ALICE, "one")]
        await store.persist_events([room.to_persist(e) for e in events])
        self.assertEqual(store.get_current_token(), "s3")
        again = await store.persist_events([room.to_persist(e) for e in events])
        self.assertTrue(all(r.already_persisted for r in again))
        self.assertEqual(store.get_current_token(), "s3")
        # A batch mixing stored and new events takes IDs for the new ones only.
        more = room.message(ALICE, "two")
        results = await store.persist_events([room.to_persist(events[2]), room.to_persist(more)])
        self.assertEqual([r.already_persisted for r in results], [True, False])
        self.assertEqual(results[1].stream_ordering, 4)
        self.assertEqual(store.get_current_token(), "s4")

    async def test_an_event_twice_in_a_batch_is_stored_once(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        results = await store.persist_events([room.to_persist(e) for e in (create, join, join)])
        self.assertEqual([r.already_persisted for r in results], [False, False, True])
        self.assertEqual(results[1].stream_ordering, results[2].stream_ordering)
        self.assertEqual(store.get_current_token(), "s2")
        count = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        self.assertEqual(count, 2)

    async def test_no_prev_events_in_an_unknown_room_is_refused(self):
        store = await self.open_store()
        room = RoomBuilder("!nocreate:example.org")
        orphan = room.message(ALICE, "where is the create event?")
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events([room.to_persist(orphan)])
        self.assertIn("unknown", str(caught.exception))
        rooms = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM rooms"))
        self.assertEqual(rooms, 0)
        self.assertEqual(store.get_current_token(), "s0")
        # Flagged an outlier, it is accepted (it arrived by federation).
        [result] = await store.persist_events([room.to_persist(orphan, outlier=True)])
        self.assertFalse(result.already_persisted)

    async def test_create_event_later_in_the_batch_starts_the_room(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        topic = room.state("m.room.topic", "", {"topic": "t"}, prev=[])
        results = await store.persist_events([room.to_persist(topic), room.to_persist(create)])
        self.assertEqual(len(results), 2)
