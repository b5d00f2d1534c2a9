"""Two writer processes' stores sharing the events stream (PostgreSQL only)."""

from __future__ import annotations

from twisted.internet import defer
from twisted.trial import unittest

from roomstore.store import RoomStore, StoreConfig
from roomstore.streams import StreamConfigError
from tests.db import DatabaseTestMixin, on_both_engines
from tests.store.builder import RoomBuilder

WRITERS = {"events": ["w1", "w2"], "backfill": ["w1", "w2"], "caches": ["w1", "w2"]}


class MultiWriterStoreTests(DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"

    async def test_two_writers_interleave_without_collisions(self):
        url = self.new_database_url()
        first = await RoomStore.open(url, StoreConfig(instance_name="w1", stream_writers=WRITERS))
        self.addCleanup(first.close)
        second = await RoomStore.open(url, StoreConfig(instance_name="w2", stream_writers=WRITERS))
        self.addCleanup(second.close)
        rooms = [RoomBuilder(f"!r{i}:example.org") for i in range(2)]
        batches = []
        for room in rooms:
            events = [room.create(), room.join("@alice:example.org")]
            events += [room.message("@alice:example.org", f"m{i}") for i in range(30)]
            batches.append([room.to_persist(e) for e in events])

        # Both writers persist at the same time, in small batches.
        async def run(store, batch):
            out = []
            for start in range(0, len(batch), 4):
                out.extend(await store.persist_events(batch[start : start + 4]))
            return out

        results = await defer.gatherResults(
            [defer.ensureDeferred(run(first, batches[0])), defer.ensureDeferred(run(second, batches[1]))],
            consumeErrors=True,
        )
        orderings = [r.stream_ordering for rs in results for r in rs]
        self.assertEqual(len(orderings), len(set(orderings)))
        self.assertEqual(sorted(orderings), list(range(1, 65)))
        instances = await first.db.run_interaction(
            "instances",
            lambda t: dict(t.execute("SELECT instance_name, COUNT(*) FROM events GROUP BY instance_name").fetchall()),
        )
        self.assertEqual(instances, {"w1": 32, "w2": 32})
        # Each knows its own position; after hearing the other's, they agree.
        first.events_stream.advance("w2", second.events_stream.get_current_token_for_writer("w2"))
        second.events_stream.advance("w1", first.events_stream.get_current_token_for_writer("w1"))
        first.events_stream.advance("w2", second.events_stream.get_current_token_for_writer("w2"))
        self.assertEqual(first.events_stream.get_positions(), second.events_stream.get_positions())
        self.assertEqual(first.events_stream.get_current_token(), 64)
        # Each store reads what the other wrote.
        state = await first.get_current_state_ids(rooms[1].room_id)
        self.assertIn(("m.room.member", "@alice:example.org"), state)


@on_both_engines
class WriterConfigTests:
    async def test_non_writer_cannot_persist(self):
        url = self.new_database_url()
        writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
        self.addCleanup(writer.close)
        worker = await RoomStore.open(
            url,
            StoreConfig(
                instance_name="worker1",
                stream_writers={"events": ["master"], "backfill": ["master"], "caches": ["master"]},
            ),
        )
        self.addCleanup(worker.close)
        room = RoomBuilder()
        with self.assertRaises(StreamConfigError):
            await worker.persist_events([room.to_persist(room.create())])
        await writer.persist_events([room.to_persist(room.events[0])])
        event = await worker.get_event(room.events[0].event_id)
        self.assertEqual(event["type"], "m.room.create")

    async def test_multi_writer_store_on_sqlite_is_refused(self):
        url = self.new_database_url()
        if self.engine_name == "sqlite":
            with self.assertRaises(StreamConfigError):
                await RoomStore.open(url, StoreConfig(instance_name="w1", stream_writers=WRITERS))
        else:
            store = await RoomStore.open(url, StoreConfig(instance_name="w1", stream_writers=WRITERS))
            await store.close()
