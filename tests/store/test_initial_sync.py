"""An initial sync (no ``since``) gives the newest events of each joined room
and the token to sync on from (issue 11 item 13)."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.store.test_sync import ALICE, BOB, SyncHelpers


@on_both_engines
class InitialSyncTests(SyncHelpers):
    async def test_newest_events_of_each_joined_room(self):
        store = await self.open_store()
        busy = await self.new_room(store, "busy")
        quiet = await self.new_room(store, "quiet", "joined")
        elsewhere = await self.new_room(store, "elsewhere")
        await self.persist(store, busy, busy.join(BOB))
        sent = [busy.message(ALICE, f"m{i}") for i in range(5)]
        await self.persist(store, busy, *sent)
        await self.persist(store, quiet, quiet.message(ALICE, "before bob: joined-only history"))
        bob_joins_quiet = quiet.join(BOB)
        await self.persist(store, quiet, bob_joins_quiet)
        await self.persist(store, elsewhere, elsewhere.message(ALICE, "bob is not here"))

        initial = await store.sync(BOB, None, initial_limit=3)
        self.assertEqual(set(initial.rooms), {busy.room_id, quiet.room_id})
        self.assertEqual([e["event_id"] for e in initial.rooms[busy.room_id]], [e.event_id for e in sent[-3:]])
        # Only what Bob may see (the store's visibility predicate decides).
        visible = [e.event_id for e in quiet.events if await store.is_visible(BOB, e.event_id)]
        self.assertEqual([e["event_id"] for e in initial.rooms[quiet.room_id]], visible[-3:])
        self.assertIn(bob_joins_quiet.event_id, visible)
        self.assertLess(len(visible), len(quiet.events))  # the message before the join is hidden
        self.assertEqual(initial.next_token, store.get_current_token())

        # Syncing on from its token: only what came after.
        later = busy.message(ALICE, "after the initial sync")
        await self.persist(store, busy, later)
        incremental = await store.sync(BOB, initial.next_token)
        self.assertEqual([e["event_id"] for e in incremental.rooms[busy.room_id]], [later.event_id])

    async def test_user_in_no_room(self):
        store = await self.open_store()
        await self.new_room(store, "alone")
        initial = await store.sync(BOB, None)
        self.assertEqual((initial.rooms, initial.next_token), ({}, store.get_current_token()))
