"""A token ahead of the events stream (issue 11): refused, after a bounded
wait on a worker that may just be behind its writer. Sync and pagination."""

from __future__ import annotations

from twisted.internet.task import Clock

from roomstore.events.tokens import InvalidToken
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
FOLLOWS_MASTER = {"events": ["master"], "backfill": ["master"], "caches": ["master"]}


@on_both_engines
class TokenAheadTests:
    async def writer_with_room(self, url: str) -> tuple[RoomStore, RoomBuilder]:
        writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
        self.addCleanup(writer.close)
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE), room.message(ALICE, "hi")]
        await writer.persist_events([room.to_persist(e) for e in events])
        return writer, room

    async def open_worker(self, url: str, clock: Clock) -> RoomStore:
        worker = await RoomStore.open(
            url, StoreConfig(instance_name="worker1", stream_writers=FOLLOWS_MASTER, token_wait_ms=2_000), clock=clock
        )
        self.addCleanup(worker.close)
        return worker

    async def test_writer_refuses_a_token_it_never_issued(self):
        writer, room = await self.writer_with_room(self.new_database_url())
        self.assertEqual(writer.get_current_token(), "s3")
        for token in ("s99999", "s4"):
            with self.assertRaises(InvalidToken) as caught:
                await writer.sync(ALICE, token)
            self.assertIn("ahead of the events stream", str(caught.exception))
            with self.assertRaises(InvalidToken):
                await writer.paginate(room.room_id, ALICE, token, "f", 10)
        with self.assertRaises(InvalidToken):
            await writer.paginate(room.room_id, ALICE, "t3-99999", "b", 10)
        # Tokens it issued still work.
        result = await writer.sync(ALICE, "s3")
        self.assertEqual(result.next_token, "s3")
        page = await writer.paginate(room.room_id, ALICE, "t3-3", "b", 10)
        self.assertEqual(len(page.events), 3)

    async def test_worker_waits_then_refuses(self):
        url = self.new_database_url()
        await self.writer_with_room(url)
        clock = Clock()
        worker = await self.open_worker(url, clock)
        self.assertEqual(worker.get_current_token(), "s3")
        pending = worker.sync(ALICE, "s99999")
        from twisted.internet import defer

        d = defer.ensureDeferred(pending)
        self.assertFalse(d.called)  # waiting for the writer
        clock.advance(1.9)
        self.assertFalse(d.called)
        clock.advance(0.2)
        failure = self.failureResultOf(d, InvalidToken)
        self.assertIn("ahead of the events stream", str(failure.value))

    async def test_worker_serves_once_the_writer_position_arrives(self):
        url = self.new_database_url()
        writer, room = await self.writer_with_room(url)
        clock = Clock()
        worker = await self.open_worker(url, clock)
        newer = room.message(ALICE, "after the worker started")
        [result] = await writer.persist_events([room.to_persist(newer)])
        self.assertEqual(result.stream_token, "s4")
        from twisted.internet import defer

        synced = defer.ensureDeferred(worker.sync(ALICE, "s4"))
        paged = defer.ensureDeferred(worker.paginate(room.room_id, ALICE, result.topological_token, "b", 10))
        self.assertFalse(synced.called or paged.called)
        # Replication tells the worker the writer reached 4.
        worker.events_stream.advance("master", 4)
        sync = await synced
        self.assertEqual(sync.next_token, "s4")
        page = await paged
        self.assertEqual([e["event_id"] for e in page.events][0], newer.event_id)
