"""Rejected events (issue 39, item 3's first part): kept with their reason,
never a room's forward extremity, never a reason for their prev events to
stop being one; the room's next event builds on the accepted leaves."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"


@on_both_engines
class RejectedEventTests:
    async def persist(self, store, room, *events, **flags):
        return await store.persist_events([room.to_persist(e, **flags) for e in events])

    async def test_a_rejected_event_is_no_forward_extremity(self):
        store = await self.open_store()
        room = RoomBuilder()
        await self.persist(store, room, room.create(), room.join(ALICE))
        leaf = room.message(ALICE, "accepted")
        await self.persist(store, room, leaf)
        bad = room.state("m.room.topic", "", {"topic": "forbidden"}, sender=ALICE, prev=[leaf.event_id])
        await self.persist(store, room, bad, rejected_reason="auth_error")
        self.assertEqual(await store.get_forward_extremities(room.room_id), [leaf.event_id])
        flags = await store.get_event_flags([bad.event_id])
        self.assertEqual(flags[bad.event_id].rejected_reason, "auth_error")
        self.assertNotIn(("m.room.topic", ""), await store.get_current_state_ids(room.room_id))
        # In one batch with an accepted sibling: only the sibling is a leaf.
        sibling = room.message(ALICE, "sibling", prev=[leaf.event_id])
        bad2 = room.message(ALICE, "rejected too", prev=[leaf.event_id])
        await store.persist_events([room.to_persist(sibling), room.to_persist(bad2, rejected_reason="auth_error")])
        self.assertEqual(await store.get_forward_extremities(room.room_id), [sibling.event_id])

    async def test_a_rejected_event_citing_a_leaf_leaves_it_a_leaf(self):
        store = await self.open_store()
        room = RoomBuilder()
        await self.persist(store, room, room.create(), room.join(ALICE))
        first = room.message(ALICE, "one", set_leaves=False)
        second = room.message(ALICE, "two", prev=[room.leaves[0]], set_leaves=False)
        await self.persist(store, room, first, second)
        bad = room.message(ALICE, "merge, rejected", prev=[first.event_id, second.event_id])
        await self.persist(store, room, bad, rejected_reason="auth_error")
        self.assertEqual(
            sorted(await store.get_forward_extremities(room.room_id)), sorted([first.event_id, second.event_id])
        )
