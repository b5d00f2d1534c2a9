"""RoomStore.sync as ``/sync`` serves it (issue 41 item 2): timelines with a
limit, ``limited``, ``prev_batch`` and the state block, initial and
incremental, a room joined in the window, a leave in the window, and
``full_state``."""

from __future__ import annotations

from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def ids(events):
    return [e["event_id"] for e in events]


@on_both_engines
class SyncLimitTests:
    async def open_store(self) -> RoomStore:
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        return store

    async def persist(self, store, room, *events):
        return await store.persist_events([room.to_persist(e) for e in events])

    async def new_room(self, store, name: str, visibility: str = "shared") -> RoomBuilder:
        room = RoomBuilder(room_id=f"!{name}:example.org")
        await self.persist(
            store, room, room.create(), room.join(ALICE), room.join_rules(), room.history_visibility(visibility)
        )
        return room

    async def messages(self, store, room, count: int, sender: str = ALICE, label: str = "m") -> list:
        built = [room.message(sender, f"{label}{i}") for i in range(count)]
        await self.persist(store, room, *built)
        return built

    async def back_from(self, store, room_id: str, user: str, token: str | None) -> list[str]:
        """Every event back-pagination serves from ``token``, newest first, in pages of 7."""
        served: list[str] = []
        while True:
            page = await store.paginate(room_id, user, token, "b", 7)
            if page.next_token is None:
                return served
            served += ids(page.events)
            token = page.next_token

    async def assert_covers_history(self, store, room_id: str, user: str, timeline) -> None:
        """prev_batch back-paginates over every visible event before the
        timeline, newest first, none missed and none repeated."""
        everything = await self.back_from(store, room_id, user, None)
        before = await self.back_from(store, room_id, user, timeline.prev_batch)
        self.assertEqual(list(reversed(ids(timeline.events))) + before, everything)
        self.assertEqual(len(set(before)), len(before))

    async def assert_state_at_start(self, store, timeline) -> None:
        """The state block is the state before the timeline's first event, less the timeline."""
        expected = set((await store.get_state_ids(timeline.events[0]["event_id"], before=True)).values())
        self.assertEqual(set(ids(timeline.state)), expected - set(ids(timeline.events)))
        keys = [(e["type"], e["state_key"]) for e in timeline.state]
        self.assertEqual(keys, sorted(keys))

    async def test_initial_sync_limited_with_prev_batch_and_full_state(self):
        store = await self.open_store()
        room = await self.new_room(store, "initial")
        await self.persist(store, room, room.join(BOB))
        early = await self.messages(store, room, 12, label="early")
        topic = room.state("m.room.topic", "", {"topic": "sync"})
        await self.persist(store, room, topic)
        late = await self.messages(store, room, 12, sender=BOB, label="late")

        result = await store.sync(BOB, None, initial_limit=10)
        timeline = result.timelines[room.room_id]
        self.assertEqual(ids(timeline.events), [e.event_id for e in late[-10:]])
        self.assertEqual(result.rooms, {room.room_id: timeline.events})
        self.assertTrue(timeline.limited)
        self.assertTrue(timeline.prev_batch.startswith("t"))
        await self.assert_covers_history(store, room.room_id, BOB, timeline)
        await self.assert_state_at_start(store, timeline)
        self.assertIn(topic.event_id, ids(timeline.state))
        self.assertEqual(len(timeline.state), 6)  # create, two members, join rules, visibility, topic

        # The whole room in the timeline: not limited, nothing before it, no state before the create event.
        whole = (await store.sync(BOB, None, initial_limit=100)).timelines[room.room_id]
        self.assertFalse(whole.limited)
        self.assertEqual(len(whole.events), 5 + len(early) + 1 + len(late))
        self.assertEqual(whole.state, [])
        self.assertEqual(await self.back_from(store, room.room_id, BOB, whole.prev_batch), [])
        # A room with exactly the limit is not limited.
        exact = (await store.sync(BOB, None, initial_limit=len(whole.events))).timelines[room.room_id]
        self.assertFalse(exact.limited)

    async def test_incremental_sync_limited_and_unlimited(self):
        store = await self.open_store()
        room = await self.new_room(store, "incremental")
        await self.persist(store, room, room.join(BOB))
        await self.messages(store, room, 3, label="old")
        token = (await store.sync(BOB, None)).next_token

        first = await self.messages(store, room, 4, label="first")
        topic = room.state("m.room.topic", "", {"topic": "changed in the window"})
        await self.persist(store, room, topic)
        rest = await self.messages(store, room, 8, sender=BOB, label="rest")

        unlimited = await store.sync(BOB, token)
        timeline = unlimited.timelines[room.room_id]
        self.assertEqual(ids(timeline.events), [e.event_id for e in [*first, topic, *rest]])
        self.assertFalse(timeline.limited)
        self.assertEqual(timeline.state, [])
        await self.assert_covers_history(store, room.room_id, BOB, timeline)

        limited = await store.sync(BOB, token, limit=5)
        timeline = limited.timelines[room.room_id]
        self.assertEqual(ids(timeline.events), [e.event_id for e in rest[-5:]])
        self.assertEqual(limited.rooms, {room.room_id: timeline.events})
        self.assertTrue(timeline.limited)
        # The state that changed between the token and the timeline's start.
        self.assertEqual(ids(timeline.state), [topic.event_id])
        await self.assert_covers_history(store, room.room_id, BOB, timeline)
        self.assertEqual(limited.next_token, unlimited.next_token)

        exact = (await store.sync(BOB, token, limit=len(first) + 1 + len(rest))).timelines[room.room_id]
        self.assertFalse(exact.limited)
        self.assertEqual(exact.state, [])
        # A limit that leaves out only messages: limited, the topic in the timeline, no state block.
        late = (await store.sync(BOB, token, limit=len(rest) + 1)).timelines[room.room_id]
        self.assertTrue(late.limited)
        self.assertEqual(ids(late.events)[0], topic.event_id)
        self.assertEqual(late.state, [])

        # Nothing new: no room, no timeline.
        quiet = await store.sync(BOB, limited.next_token, limit=5)
        self.assertEqual((quiet.rooms, quiet.timelines), ({}, {}))
        with self.assertRaises(ValueError):
            await store.sync(BOB, token, limit=-1)

    async def test_room_joined_in_the_window_has_its_full_state(self):
        store = await self.open_store()
        room = await self.new_room(store, "joined", "joined")
        await self.messages(store, room, 5, label="before")
        topic = room.state("m.room.topic", "", {"topic": "before bob"})
        await self.persist(store, room, topic)
        token = (await store.sync(BOB, None)).next_token
        self.assertEqual((await store.sync(BOB, None)).rooms, {})

        join = room.join(BOB)
        await self.persist(store, room, join)
        after = await self.messages(store, room, 6, label="after")

        result = await store.sync(BOB, token, limit=3)
        timeline = result.timelines[room.room_id]
        self.assertEqual(ids(timeline.events), [e.event_id for e in after[-3:]])
        self.assertTrue(timeline.limited)
        await self.assert_state_at_start(store, timeline)
        self.assertIn(topic.event_id, ids(timeline.state))
        self.assertIn(join.event_id, ids(timeline.state))
        # History visibility "joined": back-pagination skips what was said
        # before Bob's join (what came before the visibility event is "shared").
        before = await self.back_from(store, room.room_id, BOB, timeline.prev_batch)
        self.assertEqual(before[:4], [e.event_id for e in reversed([join, *after[:-3]])])
        self.assertNotIn(topic.event_id, before)
        await self.assert_covers_history(store, room.room_id, BOB, timeline)

        # Unlimited, the join is in the timeline: the state block is the state before it.
        whole = (await store.sync(BOB, token)).timelines[room.room_id]
        self.assertEqual(ids(whole.events), [e.event_id for e in [join, *after]])
        await self.assert_state_at_start(store, whole)
        self.assertEqual(len(whole.state), 5)  # create, Alice, join rules, visibility, topic

    async def test_leave_in_the_window(self):
        store = await self.open_store()
        room = await self.new_room(store, "leave", "world_readable")
        await self.persist(store, room, room.join(BOB))
        token = (await store.sync(BOB, None)).next_token

        name = room.state("m.room.name", "", {"name": "soon left"})
        await self.persist(store, room, name)
        before = await self.messages(store, room, 4, label="before")
        leave = room.member(BOB, "leave", sender=BOB)
        await self.persist(store, room, leave)
        await self.messages(store, room, 3, label="after")

        result = await store.sync(BOB, token, limit=2)
        timeline = result.timelines[room.room_id]
        # Up to and including the leave, never after it.
        self.assertEqual(ids(timeline.events), [before[-1].event_id, leave.event_id])
        self.assertTrue(timeline.limited)
        self.assertEqual(ids(timeline.state), [name.event_id])
        self.assertEqual(list(result.left), [room.room_id])
        self.assertEqual(ids(result.membership_events), [leave.event_id])
        expected_before = [e.event_id for e in reversed(before[:-1])] + [name.event_id]
        served = await self.back_from(store, room.room_id, BOB, timeline.prev_batch)
        self.assertEqual(served[: len(expected_before)], expected_before)
        self.assertNotIn(leave.event_id, served)

    async def test_full_state_gives_every_joined_room(self):
        store = await self.open_store()
        busy, quiet = await self.new_room(store, "busy"), await self.new_room(store, "quiet")
        for room in (busy, quiet):
            await self.persist(store, room, room.join(BOB))
        token = (await store.sync(BOB, None)).next_token
        message = busy.message(ALICE, "new")
        await self.persist(store, busy, message)

        result = await store.sync(BOB, token, limit=10, full_state=True)
        self.assertEqual(set(result.timelines), {busy.room_id, quiet.room_id})
        self.assertEqual(result.rooms, {busy.room_id: result.timelines[busy.room_id].events, quiet.room_id: []})
        busy_timeline, quiet_timeline = result.timelines[busy.room_id], result.timelines[quiet.room_id]
        self.assertEqual(ids(busy_timeline.events), [message.event_id])
        await self.assert_state_at_start(store, busy_timeline)
        # No new event: the current state, and prev_batch is the sync's token.
        current = await store.get_current_state_ids(quiet.room_id)
        self.assertEqual(set(ids(quiet_timeline.state)), set(current.values()))
        self.assertEqual((quiet_timeline.events, quiet_timeline.limited), ([], False))
        self.assertEqual(quiet_timeline.prev_batch, result.next_token)
        served = await self.back_from(store, quiet.room_id, BOB, quiet_timeline.prev_batch)
        self.assertEqual(served, await self.back_from(store, quiet.room_id, BOB, None))

    async def test_the_limit_is_per_room(self):
        store = await self.open_store()
        rooms = [await self.new_room(store, f"room{i}") for i in range(3)]
        for room in rooms:
            await self.persist(store, room, room.join(BOB))
        token = (await store.sync(BOB, None)).next_token
        sent = {room.room_id: await self.messages(store, room, 2 + 2 * i) for i, room in enumerate(rooms)}
        result = await store.sync(BOB, token, limit=4)
        for room_id, events in sent.items():
            timeline = result.timelines[room_id]
            self.assertEqual(ids(timeline.events), [e.event_id for e in events[-4:]])
            self.assertEqual(timeline.limited, len(events) > 4)
            await self.assert_covers_history(store, room_id, BOB, timeline)
