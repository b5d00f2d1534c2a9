"""Redis at TCP's pace (issue 27, item 4), on a real Redis, both engines.

- A writer publishes a page of its rows pipelined: the page's lines in one
  write to Redis (one round trip), the very lines ``serialize_command`` makes,
  in order, ``batch`` on all but a token's last row.
- It reads the next page while one goes out (as the TCP feed reads ahead).
- A worker catching up from the database (a writer gone, a gap) reads the
  next page while it applies one.
- The guarantees stay: every row once, in order, per writer.
"""

from __future__ import annotations

from itertools import pairwise

from twisted.trial import unittest

from roomstore.replication.commands import PositionCommand, RdataCommand, serialize_command
from roomstore.replication.redis import _rdata_lines
from roomstore.replication.store_streams import STORE_STREAMS, store_stream_registry
from roomstore.store import StoreConfig
from tests.db import on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder

from .redis_utils import fresh_channel, shared_redis_url
from .store_utils import ALICE, BOB, wait_until
from .test_redis import Applied, RedisMixin
from .test_redis_positions import listen

READERS = {name: ["master"] for name in STORE_STREAMS}


async def expected_lines(store, stream: str, start: int, upto: int) -> list[str]:
    """``serialize_command`` of the RDATA commands for the rows in ``(start, upto]``."""
    updates = (await store_stream_registry(store).get(stream).get_updates("master", start, upto, 10**9)).updates
    lines = []
    for index, (token, row) in enumerate(updates):
        last_of_token = index + 1 == len(updates) or updates[index + 1][0] != token
        lines.append(serialize_command(RdataCommand(stream, "master", token if last_of_token else None, row)))
    return lines


async def settled(listener, on_writer) -> None:
    """Until the writer's connect-time lines are out: it answered its own
    ``REPLICATE`` (heard back on its channel) with its positions, after
    which what it publishes is what it persists."""
    await on_writer.when_ready()
    await wait_until(
        lambda: listener.lines.count("POSITION events master 0 0") >= 2, 10, "the writer's connect-time positions"
    )


@on_both_engines
class PipelinedPublishTests(RedisMixin):
    async def start(self, page_size: int):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        listener, _ = await listen(self, redis, channel)
        on_writer = self.connect(writer, redis, channel, page_size=page_size)
        return writer, listener, on_writer

    def heard(self, listener) -> list[str]:
        return [line for line in listener.lines if line.startswith("RDATA events ")]

    async def test_a_page_goes_out_in_one_write_as_the_lines_of_serialize_command(self):
        writer, listener, on_writer = await self.start(page_size=1000)
        writes: list[bytes] = []
        real_connection_up = on_writer._connection_up

        def connection_up(role, conn):
            if role == "publish":
                write = conn.transport.write
                conn.transport.write = lambda data: (writes.append(data), write(data))[1]
            real_connection_up(role, conn)

        on_writer._connection_up = connection_up
        await settled(listener, on_writer)
        room = UncheckedRoomBuilder("!one-batch:example.org")
        events = [room.create(), room.join(ALICE), room.join(BOB)]
        events += [room.message(ALICE, f"m{i}") for i in range(40)]
        await writer.persist_events([room.to_persist(e) for e in events])  # one batch: one announcement
        want = await expected_lines(writer, "events", 0, writer.events_stream.get_current_token())
        self.assertGreater(len(want), 43)
        await wait_until(lambda: len(self.heard(listener)) >= len(want), 20, "the batch's rows")
        self.assertEqual(self.heard(listener), want)
        page_writes = [w for w in writes if b"RDATA events " in w]
        self.assertEqual(len(page_writes), 1, "the page's lines in one write")
        self.assertEqual(page_writes[0].count(b"RDATA events "), len(want))
        self.assertEqual(page_writes[0].count(b"PUBLISH"), len(want))
        await on_writer.flush()  # every line acknowledged: the announcer is idle

    async def test_the_next_page_is_read_while_one_is_published(self):
        writer, listener, on_writer = await self.start(page_size=5)
        stream = on_writer.streams.get("events")
        steps: list[tuple] = []
        real_get_updates = stream.get_updates

        async def get_updates(instance, from_token, upto, limit):
            steps.append(("read", from_token))
            return await real_get_updates(instance, from_token, upto, limit)

        stream.get_updates = get_updates
        real_publish_page = on_writer._publish_page

        def publish_page(name, updates, start, upto):
            if name == "events":
                steps.append(("publish", start))
            return real_publish_page(name, updates, start, upto)

        on_writer._publish_page = publish_page
        await settled(listener, on_writer)
        room = UncheckedRoomBuilder("!pages:example.org")
        events = [room.create(), room.join(ALICE)] + [room.message(ALICE, f"m{i}") for i in range(30)]
        await writer.persist_events([room.to_persist(e) for e in events])
        want = await expected_lines(writer, "events", 0, writer.events_stream.get_current_token())
        await wait_until(lambda: self.heard(listener) == want, 20, "the batch's rows, in order, once")
        publishes = [start for kind, start in steps if kind == "publish"]
        self.assertGreater(len(publishes), 5)
        for page, start in enumerate(publishes[:-1]):
            # The next page's read started before this page was published.
            self.assertLess(steps.index(("read", publishes[page + 1])), steps.index(("publish", start)), steps)

    async def test_a_page_ends_with_a_position_when_its_range_goes_past_its_last_row(self):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        listener, _ = await listen(self, redis, channel)
        on_writer = self.connect(writer, redis, channel)
        await on_writer.when_ready()
        # A page with no rows in its range's end: POSITION from the last row to upto.
        page = on_writer._publish_page("caches", [(3, ("c", None, 1)), (3, ("d", ["k"], 1))], 0, 5)
        self.assertIsNotNone(page)
        await page

        def heard() -> list[str]:
            # Not the POSITION it announced on connecting.
            return [
                line for line in listener.lines if " caches master " in line and line != "POSITION caches master 0 0"
            ]

        await wait_until(lambda: len(heard()) >= 3, 10, "the page")
        self.assertEqual(
            heard(),
            [
                serialize_command(RdataCommand("caches", "master", None, ("c", None, 1))),
                serialize_command(RdataCommand("caches", "master", 3, ("d", ["k"], 1))),
                serialize_command(PositionCommand("caches", "master", 3, 5)),
            ],
        )


@on_both_engines
class CatchUpReadsAheadTests(RedisMixin):
    async def test_a_worker_filling_from_the_database_reads_the_next_page_while_it_applies(self):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        worker = await self.open_store(url, StoreConfig(instance_name="worker1", stream_writers=READERS))
        start = worker.events_stream.get_current_token_for_writer("master")
        await self.persist_room(writer, "!away:example.org", 30, batch=4)
        targets = {n: writer.generators[n].get_current_token() for n in STORE_STREAMS}
        expected = await self.expected_rows(writer, "events", "master", start)
        await writer.generators["events"].flush()
        await writer.close()  # gone: the worker catches up from the database alone
        applied = Applied()
        steps: list[tuple] = []
        on_worker = self.connect(worker, redis, channel, on_applied=applied, page_size=4)
        stream = on_worker.streams.get("events")
        real_get_updates = stream.get_updates

        async def get_updates(instance, from_token, upto, limit):
            steps.append(("read", from_token))
            return await real_get_updates(instance, from_token, upto, limit)

        stream.get_updates = get_updates
        real_on_rdata = on_worker.handler.on_rdata

        def on_rdata(stream_name, instance, token, rows):
            if stream_name == "events":
                steps.append(("apply", token))
            return real_on_rdata(stream_name, instance, token, rows)

        on_worker.handler.on_rdata = on_rdata
        real_on_rdata_batch = on_worker.handler.on_rdata_batch

        def on_rdata_batch(stream_name, instance, updates):
            # A page applied in one call: each of its tokens.
            if stream_name == "events":
                steps.extend(("apply", token) for token, _ in updates)
            return real_on_rdata_batch(stream_name, instance, updates)

        on_worker.handler.on_rdata_batch = on_rdata_batch
        await on_worker.when_ready()
        await wait_until(
            lambda: all(on_worker.positions.get(n, "master") >= targets[n] for n in STORE_STREAMS),
            20,
            "the worker to catch up from the database",
        )
        self.assertEqual(applied.tokens.get(("events", "master"), []), expected)
        reads = [step[1] for step in steps if step[0] == "read"]
        self.assertGreater(len(reads), 3)
        # The page after (a, b] was being read before any row of (a, b] was applied.
        for a, b in pairwise(reads):
            first_apply = next(i for i, step in enumerate(steps) if step[0] == "apply" and step[1] > a)
            self.assertLess(steps.index(("read", b)), first_apply, steps)


class RdataLinesTests(unittest.TestCase):
    """A page's RDATA lines as Synapse's serializer writes them; an empty page has none."""

    def test_lines_of_a_page(self):
        updates = [(5, ("a",)), (5, ("b",)), (7, ("c",))]
        expected = [
            serialize_command(RdataCommand("caches", "w1", t if i != 0 else None, row))
            for i, (t, row) in enumerate(updates)
        ]
        self.assertEqual(_rdata_lines("caches", "w1", updates), expected)

    def test_an_empty_page_has_no_lines(self):
        self.assertEqual(_rdata_lines("caches", "w1", []), [])
