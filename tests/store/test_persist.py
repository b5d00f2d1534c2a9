"""Persisting batches: positions, idempotence, atomicity, state, extremities."""

from __future__ import annotations

from roomstore.events import resolution_source
from roomstore.events.write.persist import EventToPersist, MissingStateError, StateDelta
from roomstore.pdu.parsing import InvalidEventError
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id, pure_resolution

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


@on_both_engines
class PersistTests:
    async def test_batch_positions_and_state(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        join = room.join(ALICE)
        msg = room.message(ALICE, "hello")
        results = await store.persist_events([room.to_persist(e) for e in (create, join, msg)])
        self.assertEqual([r.stream_ordering for r in results], [1, 2, 3])
        self.assertEqual([r.topological_ordering for r in results], [1, 2, 3])
        self.assertEqual(store.get_current_token(), "s3")
        state = await store.get_state_ids(msg.event_id)
        self.assertEqual(state, {("m.room.create", ""): create.event_id, ("m.room.member", ALICE): join.event_id})
        self.assertEqual(
            await store.get_state_ids(join.event_id, before=True), {("m.room.create", ""): create.event_id}
        )
        self.assertEqual(await store.get_current_state_ids(room.room_id), state)
        self.assertEqual(await store.get_forward_extremities(room.room_id), [msg.event_id])
        self.assertEqual(await store.get_users_in_room(room.room_id), [ALICE])
        self.assertEqual(await store.get_rooms_for_user(ALICE), frozenset([room.room_id]))

    async def test_bytes_round_trip_exactly(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        await store.persist_events([room.to_persist(create)])
        self.assertEqual(await store.get_event_json_bytes(create.event_id), create.raw)
        event = await store.get_event(create.event_id)
        self.assertEqual(event["event_id"], create.event_id)
        self.assertEqual(event["content"]["creator"], ALICE)

    async def test_room_ids_in_the_order_first_seen(self):
        store = await self.open_store()
        self.assertEqual(await store.get_room_ids(), [])
        first, second = RoomBuilder("!first:example.org"), RoomBuilder("!second:example.org")
        await store.persist_events([second.to_persist(second.create())])
        await store.persist_events([first.to_persist(first.create())])
        self.assertEqual(await store.get_room_ids(), [second.room_id, first.room_id])

    async def test_repersist_is_a_no_op(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        first = await store.persist_events([room.to_persist(create), room.to_persist(join)])
        again = await store.persist_events([room.to_persist(join), room.to_persist(create)])
        self.assertEqual([r.stream_ordering for r in again], [first[1].stream_ordering, first[0].stream_ordering])
        self.assertTrue(all(r.already_persisted for r in again))
        count = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        self.assertEqual(count, 2)

    async def test_failed_batch_leaves_nothing(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        await store.persist_events([room.to_persist(create)])
        join = room.join(ALICE)
        orphan = room.message(ALICE, "x", prev=[fake_event_id("unknown")])
        before = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        with self.assertRaises(MissingStateError):
            await store.persist_events([room.to_persist(join), room.to_persist(orphan)])
        after = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM event_json"))
        self.assertEqual(before, after)
        # Refused before stream IDs were reserved: none taken, none left unfinished
        # (test_persist_traps has the race where a reservation fails and completes).
        self.assertEqual(store.events_stream.get_unfinished(), [])
        results = await store.persist_events([room.to_persist(join)])
        self.assertEqual(results[0].stream_ordering, 2)
        self.assertEqual(store.events_stream.get_current_token(), 2)

    async def test_invalid_bytes_rejected(self):
        store = await self.open_store()
        for raw in (b"\xff\xfe", b"[1, 2]", b"{" + b" " * 70000 + b"}"):
            with self.assertRaises(InvalidEventError):
                await store.persist_events([EventToPersist(raw, "10")])

    async def test_the_auth_edges_of_stored_events_are_not_read_back(self):
        # A conflict between branches of earlier calls is resolved over the
        # auth chains of stored events (the create event's, which has none,
        # included): the edges their writes stored are known, not read.
        store = await self.open_store()
        room = RoomBuilder(version="12", creator=ALICE)
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        fork = list(room.leaves)
        t1 = room.state("m.room.topic", "", {"topic": "a"}, prev=fork)
        t2 = room.state("m.room.topic", "", {"topic": "b"}, prev=fork)
        await store.persist_events([room.to_persist(t1)])
        await store.persist_events([room.to_persist(t2)])
        reads = []
        real = resolution_source.auth_edges_txn
        self.patch(resolution_source, "auth_edges_txn", lambda *args: reads.append(args[1]) or real(*args))
        after = room.message(ALICE, "after", prev=[t1.event_id, t2.event_id])
        await store.persist_events([room.to_persist(after)])
        states = [await store.get_state_ids(t.event_id) for t in (t1, t2)]
        self.assertEqual(await store.get_state_ids(after.event_id, before=True), pure_resolution(room, states))
        self.assertEqual(reads, [])

    async def test_fork_merge_and_conflict(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        await store.persist_events([room.to_persist(create), room.to_persist(join)])
        # Two branches from join: one sets a topic, the other a name: no conflict.
        topic = room.state("m.room.topic", "", {"topic": "t"}, prev=[join.event_id])
        name = room.state("m.room.name", "", {"name": "n"}, prev=[join.event_id])
        await store.persist_events([room.to_persist(topic), room.to_persist(name)])
        self.assertEqual(
            sorted(await store.get_forward_extremities(room.room_id)), sorted([topic.event_id, name.event_id])
        )
        current = await store.get_current_state_ids(room.room_id)
        self.assertEqual(current[("m.room.topic", "")], topic.event_id)
        self.assertEqual(current[("m.room.name", "")], name.event_id)
        merge = room.message(ALICE, "merge", prev=[topic.event_id, name.event_id])
        await store.persist_events([room.to_persist(merge)])
        state = await store.get_state_ids(merge.event_id)
        self.assertEqual(state[("m.room.topic", "")], topic.event_id)
        self.assertEqual(state[("m.room.name", "")], name.event_id)
        # Two branches that both set the topic: stored, the room's current
        # state resolved by its version's algorithm (here v2: the later
        # topic by the mainline order, as the pure resolution says).
        t1 = room.state("m.room.topic", "", {"topic": "a"}, prev=[merge.event_id])
        t2 = room.state("m.room.topic", "", {"topic": "b"}, prev=[merge.event_id])
        await store.persist_events([room.to_persist(t1), room.to_persist(t2)])
        current = await store.get_current_state_ids(room.room_id)
        states = [await store.get_state_ids(t.event_id) for t in (t1, t2)]
        self.assertEqual(current, pure_resolution(room, states))
        self.assertEqual(current[("m.room.topic", "")], t2.event_id)
        # An event after both: the state before it resolved the same way.
        after = room.message(ALICE, "after", prev=[t1.event_id, t2.event_id])
        await store.persist_events([room.to_persist(after)])
        self.assertEqual(await store.get_state_ids(after.event_id, before=True), current)
        # A caller's resolved current state still overrides (an importer carrying its source's).
        t3 = room.state("m.room.topic", "", {"topic": "c"}, prev=[after.event_id])
        t4 = room.state("m.room.topic", "", {"topic": "d"}, prev=[after.event_id])
        resolved = dict(current)
        resolved[("m.room.topic", "")] = t3.event_id
        await store.persist_events([room.to_persist(t3), room.to_persist(t4)], {room.room_id: resolved})
        self.assertEqual((await store.get_current_state_ids(room.room_id))[("m.room.topic", "")], t3.event_id)
        # And state given explicitly for an event stands in for resolution.
        last = room.message(ALICE, "last", prev=[t3.event_id, t4.event_id])
        given = await store.persist_events([room.to_persist(last, state_before=resolved)])
        self.assertEqual(await store.get_state_ids(last.event_id, before=True), resolved)
        self.assertIsNotNone(given[0].state_group_before)

    async def test_state_delta_against_known_group(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        res = await store.persist_events([room.to_persist(create), room.to_persist(join)])
        topic = room.state("m.room.topic", "", {"topic": "t"})
        await store.persist_events([room.to_persist(topic)])
        # An event whose prev events we lack, with state given as a delta.
        late = room.message(ALICE, "late", prev=[fake_event_id("missing")])
        await store.persist_events(
            [room.to_persist(late, state_before=StateDelta(res[1].state_group, {("m.room.topic", ""): topic.event_id}))]
        )
        state = await store.get_state_ids(late.event_id)
        self.assertEqual(state[("m.room.topic", "")], topic.event_id)
        self.assertEqual(state[("m.room.member", ALICE)], join.event_id)
        self.assertIn(fake_event_id("missing"), await store.get_backward_extremities(room.room_id))

    async def test_bounded_chain_length(self):
        store = await self.open_store(
            config=__import__("roomstore.store", fromlist=["StoreConfig"]).StoreConfig(max_state_chain_length=5)
        )
        room = RoomBuilder()
        batch = [room.create(), room.join(ALICE)]
        for i in range(20):
            batch.append(room.state("m.room.topic", "", {"topic": str(i)}))
        results = await store.persist_events([room.to_persist(e) for e in batch])
        lengths = await store.db.run_interaction(
            "lengths",
            lambda t: [
                r[0] for r in t.execute("SELECT chain_length FROM state_groups ORDER BY state_group").fetchall()
            ],
        )
        self.assertLessEqual(max(lengths), 5)
        self.assertIn(0, lengths[5:])  # snapshots were taken along the way
        final = await store.get_state_ids(batch[-1].event_id)
        self.assertEqual(final[("m.room.topic", "")], batch[-1].event_id)
        self.assertEqual(len(final), 3)
        self.assertEqual(results[-1].state_group, max(r.state_group for r in results))


@on_both_engines
class CacheInvalidationTests:
    async def test_batch_invalidations_share_one_stream_id(self):
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        msg = room.message(ALICE, "oops")
        await store.persist_events([room.to_persist(e) for e in (create, join, msg)])
        redaction = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(redaction)])
        rows = await store.db.run_interaction(
            "rows",
            lambda t: t.execute(
                "SELECT stream_id, cache_name, keys FROM cache_invalidations ORDER BY stream_id, cache_name, keys"
            ).fetchall(),
        )
        first = [(name, keys) for sid, name, keys in rows if sid == rows[0][0]]
        self.assertEqual(
            sorted(first),
            sorted(
                [
                    ("cs_cache_fake", f'["{room.room_id}"]'),
                    ("get_rooms_for_user", f'["{ALICE}"]'),
                ]
            ),
        )
        second = [(name, keys) for sid, name, keys in rows if sid != rows[0][0]]
        self.assertEqual(second, [("get_event", f'["{msg.event_id}"]')])
        self.assertEqual(store.caches_stream.get_current_token(), 2)
        stream_id = await store.invalidate_cache("my_homeserver_cache", None)
        self.assertEqual(stream_id, 3)
        last = await store.db.run_interaction(
            "last",
            lambda t: t.execute("SELECT cache_name, keys FROM cache_invalidations WHERE stream_id = 3").fetchall(),
        )
        self.assertEqual([tuple(r) for r in last], [("my_homeserver_cache", None)])
        with self.assertRaises(ValueError):
            await store.invalidate_cache("two words", ["x"])
