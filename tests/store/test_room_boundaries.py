"""An event's prev and auth events are of its own room (issue 39, item 3):
one citing another room's event is refused in one line, before any stream
position, whether that event is stored or in the same batch."""

from __future__ import annotations

from roomstore.pdu.parsing import InvalidEventError
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
MALLORY = "@mallory:evil.org"


@on_both_engines
class CitedRoomTests:
    async def two_rooms(self, store):
        rooms = []
        for name, creator in (("!a:example.org", ALICE), ("!b:evil.org", MALLORY)):
            room = RoomBuilder(room_id=name, creator=creator)
            room.create()
            room.join(creator)
            room.message(creator, "hello")
            await store.persist_events([room.to_persist(e) for e in room.events])
            rooms.append(room)
        return rooms

    async def test_prev_events_in_another_room_are_refused(self):
        store = await self.open_store()
        room_a, room_b = await self.two_rooms(store)
        token = store.get_current_token()
        # Mallory's event in room B built on room A's leaf: it would inherit
        # room A's state, where Mallory is no member.
        sneaky = room_b.message(MALLORY, "in A?", prev=[room_a.leaves[0]])
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events([room_b.to_persist(sneaky)])
        self.assertIn(f"cites {room_a.leaves[0]} in 'prev_events', an event of another room", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))
        self.assertIsNone(await store.get_event(sneaky.event_id))
        self.assertEqual(store.get_current_token(), token)
        self.assertEqual(await store.get_users_in_room(room_a.room_id), [ALICE])

    async def test_auth_events_in_another_room_are_refused(self):
        store = await self.open_store()
        room_a, room_b = await self.two_rooms(store)
        sneaky = room_b.message(MALLORY, "auth from A", extra={"auth_events": [room_a.events[0].event_id]})
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events([room_b.to_persist(sneaky)])
        self.assertIn("in 'auth_events', an event of another room", str(caught.exception))

    async def test_a_prev_event_of_another_room_in_the_same_batch(self):
        store = await self.open_store()
        room_a, room_b = await self.two_rooms(store)
        in_a = room_a.message(ALICE, "new in A")
        sneaky = room_b.message(MALLORY, "on it", prev=[in_a.event_id])
        token = store.get_current_token()
        with self.assertRaises(InvalidEventError):
            await store.persist_events([room_a.to_persist(in_a), room_b.to_persist(sneaky)])
        self.assertEqual(store.get_current_token(), token)
        # Alone, the good one is stored.
        await store.persist_events([room_a.to_persist(in_a)])
        self.assertIsNotNone(await store.get_event(in_a.event_id))
