"""What every public read gives for an ID the store does not hold (docs/api.md,
"Unknown IDs"), on both engines: a read about one event raises ``NotFoundError``
(an outlier's state too: ``StateGroupNotFound`` is one), a fetch returns None,
many-ID reads leave the unknown out, and an unknown room reads as an empty
room."""

from __future__ import annotations

from roomstore.state import StateGroupNotFound
from roomstore.storage import NotFoundError
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
UNKNOWN_EVENT = "$unknown:example.org"
UNKNOWN_ROOM = "!unknown:example.org"


@on_both_engines
class UnknownIdTests:
    async def store_with_a_room(self):
        store = await self.open_store()
        room = RoomBuilder(room_id="!known:example.org")
        create, join = room.create(), room.join(ALICE)
        await store.persist_events([room.to_persist(e) for e in (create, join)])
        return store, room, join

    async def test_a_read_about_one_event_raises_not_found(self):
        store, _, join = await self.store_with_a_room()
        for read in (
            lambda: store.get_state_ids(UNKNOWN_EVENT),
            lambda: store.get_state_ids(UNKNOWN_EVENT, before=True),
            lambda: store.get_state_ids_filtered(UNKNOWN_EVENT, [("m.room.create", "")]),
            lambda: store.get_topological_token(UNKNOWN_EVENT),
        ):
            with self.assertRaises(NotFoundError) as caught:
                await read()
            self.assertIsInstance(caught.exception, KeyError)  # callers catching KeyError keep working
            message = str(caught.exception)
            self.assertIn(UNKNOWN_EVENT, message)
            self.assertNotIn("\n", message)
        self.assertIn(("m.room.member", ALICE), await store.get_state_ids(join.event_id))

    async def test_an_outliers_state_is_not_found(self):
        store, room, join = await self.store_with_a_room()
        outlier = room.state("m.room.topic", "", {"topic": "far"}, prev=[join.event_id], set_leaves=False)
        await store.persist_events([room.to_persist(outlier, outlier=True)])
        for read in (
            lambda: store.get_state_ids(outlier.event_id),
            lambda: store.get_state_ids_filtered(outlier.event_id, [("m.room.topic", "")]),
        ):
            with self.assertRaises(StateGroupNotFound) as caught:
                await read()
            self.assertIsInstance(caught.exception, NotFoundError)
            self.assertIn("outlier", str(caught.exception))
        with self.assertRaises(NotFoundError):
            await store.get_topological_token(outlier.event_id)
        self.assertIsNotNone(await store.get_event(outlier.event_id))  # stored: fetched as any event

    async def test_fetches_and_many_id_reads(self):
        store, room, join = await self.store_with_a_room()
        self.assertIsNone(await store.get_event(UNKNOWN_EVENT))
        self.assertIsNone(await store.get_event_json_bytes(UNKNOWN_EVENT))
        self.assertEqual(list(await store.get_events([UNKNOWN_EVENT, join.event_id])), [join.event_id])
        self.assertEqual(list(await store.get_event_flags([UNKNOWN_EVENT, join.event_id])), [join.event_id])
        self.assertEqual(list(await store.get_state_ids_for_events([UNKNOWN_EVENT, join.event_id])), [join.event_id])
        self.assertEqual(await store.get_auth_chain_ids([UNKNOWN_EVENT]), set())
        self.assertEqual(await store.get_auth_chain_difference([{UNKNOWN_EVENT}, set()]), {UNKNOWN_EVENT})
        self.assertFalse(await store.is_visible(ALICE, UNKNOWN_EVENT))
        self.assertEqual(await store.backfill(room.room_id, [UNKNOWN_EVENT], 5), [])
        self.assertEqual(await store.get_missing_events(room.room_id, [UNKNOWN_EVENT], [UNKNOWN_EVENT], 5), [])

    async def test_an_unknown_room_reads_as_an_empty_room(self):
        store, _, _ = await self.store_with_a_room()
        self.assertIsNone(await store.get_room_version(UNKNOWN_ROOM))  # how to tell an unknown room
        self.assertEqual(await store.get_current_state_ids(UNKNOWN_ROOM), {})
        self.assertEqual(await store.get_forward_extremities(UNKNOWN_ROOM), [])
        self.assertEqual(await store.get_backward_extremities(UNKNOWN_ROOM), [])
        self.assertEqual(await store.get_users_in_room(UNKNOWN_ROOM), [])
        page = await store.paginate(UNKNOWN_ROOM, ALICE, None, "b", 5)
        self.assertEqual((page.events, page.next_token), ([], None))
        self.assertEqual(await store.backfill(UNKNOWN_ROOM, [UNKNOWN_EVENT], 5), [])
        purged = await store.purge_room(UNKNOWN_ROOM)
        self.assertEqual((purged.rows_deleted, purged.changed), ({}, False))
