"""A writer's POSITION is never below the position it has persisted (issue 24, item 2).

The anomaly seen in the end-to-end test: a restarted writer announced a
position (1294) below the one it had persisted (1299). Its ID generator was
not at fault: a restart recovers at least the persisted position (and, on
PostgreSQL, the sequence). What lagged was the Redis announcer: it answered
``REPLICATE`` with the last token whose rows it had published, and that lags
the generator while the announcer reads the new rows (``get_updates``, a
database round trip). In that window the generator has already moved (an
idle writer moved up by another writer's POSITION, or its own batch) and
persisted the new position, which a reader (re)connecting meanwhile catches
up to from the database; the answer to its ``REPLICATE`` then steps back.

The test runs the sequence on a real Redis: the writer persisted, stopped,
restarted; it is moved up (PostgreSQL: idle, by the other writer's position;
SQLite, one writer only: by its own batch) and persists that while its read
of the new rows is held; a ``REPLICATE`` arrives; its ``POSITION`` answer
must not be below the persisted position.
"""

from __future__ import annotations

import txredisapi
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint

from roomstore.replication.redis import parse_redis_url
from roomstore.replication.store_streams import STORE_STREAMS
from roomstore.store import StoreConfig
from tests.db import on_both_engines

from .redis_utils import fresh_channel, shared_redis_url
from .store_utils import wait_until
from .test_redis import RedisMixin


class _Lines(txredisapi.SubscriberProtocol):
    def messageReceived(self, pattern, channel, message):
        self.factory.lines.append(message.decode() if isinstance(message, bytes) else str(message))


async def listen(test, redis_url: str, channel: str):
    """A raw subscriber on ``channel`` (``factory.lines``) and a publishing connection."""
    address = parse_redis_url(redis_url)
    factory = txredisapi.SubscriberFactory()
    factory.protocol = _Lines
    factory.lines = []
    factory.reconnect = False
    factory.startConnecting(TCP4ClientEndpoint(reactor, address.host, address.port))
    test.addCleanup(factory.disconnect)
    await factory.deferred
    conn = await factory.getConnection()
    await conn.subscribe([channel])
    publisher = await txredisapi.Connection(address.host, address.port, reconnect=False)
    test.addCleanup(publisher.disconnect)
    return factory, publisher


def positions_of(lines: list[str], stream: str, writer: str) -> list[int]:
    """The new tokens of ``writer``'s POSITION lines of ``stream``, in order."""
    found = []
    for line in lines:
        words = line.split(" ")
        if words[:3] == ["POSITION", stream, writer]:
            found.append(int(words[4]))
    return found


def after_replicate(lines: list[str]) -> list[str]:
    """The lines heard after the last ``REPLICATE`` (ours, heard back)."""
    last = max((i for i, line in enumerate(lines) if line == "REPLICATE"), default=None)
    return [] if last is None else lines[last + 1 :]


@on_both_engines
class RestartedWriterPositionTests(RedisMixin):
    async def test_replicate_answer_not_below_persisted_position(self):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        multi = self.engine_name == "postgres"
        writers = {n: ["w1", "w2"] for n in STORE_STREAMS} if multi else {n: ["w1"] for n in STORE_STREAMS}
        config = StoreConfig(instance_name="w1", stream_writers=writers)

        # w1 writes and persists, then its process is gone.
        first = await self.open_store(url, config)
        await self.persist_room(first, "!first:example.org", 4)
        await first.close()

        # Restarted, on the bus, idle.
        listener, publisher = await listen(self, redis, channel)
        w1 = await self.open_store(url, config)
        on_w1 = self.connect(w1, redis, channel)
        await on_w1.when_ready()
        await on_w1.flush()
        before = w1.events_stream.get_current_token_for_writer("w1")

        # Its read of new rows for announcing is held (a slow database).
        gate: defer.Deferred = defer.Deferred()
        events = on_w1.streams.get("events")
        real_get_updates = events.get_updates

        async def held_get_updates(*args, **kwargs):
            await gate
            return await real_get_updates(*args, **kwargs)

        self.patch(events, "get_updates", held_get_updates)
        self.addCleanup(lambda: None if gate.called else gate.callback(None))

        if multi:
            # w2 writes; w1, idle, hears its position and moves up with it.
            w2 = await self.open_store(url, StoreConfig(instance_name="w2", stream_writers=writers))
            await self.persist_room(w2, "!second:example.org", 4)
            w1.events_stream.advance("w2", w2.events_stream.get_current_token_for_writer("w2"))
        else:
            # One writer: its own batch moves it (and persists in the batch's transaction).
            await self.persist_room(w1, "!second:example.org", 4)
        await w1.events_stream.flush()
        persisted = (await w1.events_stream.read_persisted_positions())["w1"]
        self.assertGreater(persisted, before)
        self.assertEqual(persisted, w1.events_stream.get_current_token_for_writer("w1"))

        # A reader (re)connecting now catches up to `persisted` from the
        # database and asks for positions.
        del listener.lines[:]
        await publisher.publish(channel, "REPLICATE")
        await wait_until(
            lambda: positions_of(after_replicate(listener.lines), "events", "w1"), 10, "w1's answer to REPLICATE"
        )
        answer = positions_of(after_replicate(listener.lines), "events", "w1")[0]
        self.assertGreaterEqual(answer, persisted, f"w1 answered POSITION {answer} below its persisted {persisted}")

        # Released, w1 announces nothing below it either, and ends at its position.
        gate.callback(None)
        await on_w1.flush()
        announced = positions_of(listener.lines, "events", "w1")
        self.assertTrue(all(token >= persisted for token in announced), announced)
        del listener.lines[:]
        await publisher.publish(channel, "REPLICATE")
        await wait_until(lambda: positions_of(after_replicate(listener.lines), "events", "w1"), 10, "the second answer")
        self.assertEqual(
            positions_of(after_replicate(listener.lines), "events", "w1"),
            [w1.events_stream.get_current_token_for_writer("w1")],
        )
