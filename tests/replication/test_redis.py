"""Replication over a real Redis server (``roomstore.replication.redis``).

Stores run in the test process on both engines (multi-writer on PostgreSQL),
each with its own ``RedisReplication`` on a channel of the test's own; the
checks compare what a reader applied with the rows the shared database holds
(``get_updates``): every token once, per writer in order, no gap.
"""

from __future__ import annotations

import json

from twisted.trial import unittest

from roomstore.replication import metrics
from roomstore.replication.redis import RedisReplication, parse_redis_url
from roomstore.replication.store_streams import STORE_STREAMS, store_stream_registry
from roomstore.store import RoomStore, StoreConfig
from tests.db import DatabaseTestMixin, on_both_engines

# Rooms built for replication's rows, not for the auth rules (joins without join rules):
# the store takes their events as checked (tests/store/builder.py).
from tests.store.builder import UncheckedRoomBuilder

from .redis_utils import RedisServer, fresh_channel, shared_redis_url
from .store_utils import ALICE, BOB, sleep, wait_until

MULTI = {name: ["w1", "w2"] for name in STORE_STREAMS}


class Applied:
    """What a reader applied: per (stream, writer), tokens in order with their rows."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[str, str], list[tuple[int, list]]] = {}

    def __call__(self, stream: str, instance: str, token: int, rows: list) -> None:
        self.tokens.setdefault((stream, instance), []).append((token, [json.loads(json.dumps(r)) for r in rows]))

    def last(self, stream: str, instance: str) -> int:
        got = self.tokens.get((stream, instance))
        return got[-1][0] if got else 0


class RedisMixin:
    async def open_store(self, url: str, config: StoreConfig) -> RoomStore:
        store = await RoomStore.open(url, config)
        self.addCleanup(store.close)
        return store

    def connect(self, store: RoomStore, redis_url: str, channel: str, **kw) -> RedisReplication:
        replication = RedisReplication(store, parse_redis_url(redis_url), channel, **kw)
        replication.start()
        self.addCleanup(replication.stop)
        return replication

    async def expected_rows(self, store: RoomStore, stream: str, writer: str, start: int = 0) -> list:
        registry = store_stream_registry(store)
        upto = store.generators[stream].get_current_token_for_writer(writer)
        updates = (await registry.get(stream).get_updates(writer, start, upto, 10**9)).updates
        grouped: list[tuple[int, list]] = []
        for token, row in updates:
            row = json.loads(json.dumps(row))
            if grouped and grouped[-1][0] == token:
                grouped[-1][1].append(row)
            else:
                grouped.append((token, [row]))
        return grouped

    async def persist_room(self, store: RoomStore, room_id: str, messages: int, batch: int = 3) -> None:
        room = UncheckedRoomBuilder(room_id)
        events = [room.create(), room.join(ALICE), room.join(BOB)]
        events += [room.message(ALICE if i % 2 else BOB, f"m{i}") for i in range(messages)]
        for start in range(0, len(events), batch):
            await store.persist_events([room.to_persist(e) for e in events[start : start + batch]])


@on_both_engines
class RedisSingleWriterTests(RedisMixin):
    async def test_rows_reach_a_worker_once_in_order(self):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        worker = await self.open_store(
            url, StoreConfig(instance_name="worker1", stream_writers={n: ["master"] for n in STORE_STREAMS})
        )
        applied, own = Applied(), Applied()
        on_writer = self.connect(writer, redis, channel, on_applied=own)
        on_worker = self.connect(worker, redis, channel, on_applied=applied)
        await on_writer.when_ready()
        await on_worker.when_ready()
        published = metrics.REDIS_PUBLISHED.labels("RDATA")._value.get()
        await self.persist_room(writer, "!a:example.org", 20)
        await writer.invalidate_cache("get_user", ["@x:example.org"])
        await wait_until(
            lambda: all(
                worker.generators[n].get_current_token() == writer.generators[n].get_current_token()
                for n in STORE_STREAMS
            ),
            20,
            "the worker to catch up",
        )
        self.assertGreater(metrics.REDIS_PUBLISHED.labels("RDATA")._value.get(), published)
        for stream in ("events", "caches"):
            self.assertEqual(
                applied.tokens.get((stream, "master"), []), await self.expected_rows(writer, stream, "master"), stream
            )
        # The writer ignores its own lines: it applied nothing.
        self.assertEqual(own.tokens, {})

    async def test_rows_of_a_writer_gone_before_the_reader_connects_are_filled(self):
        # A writer (an import) persists rows and exits while the worker is
        # down; the worker comes back with its old positions. No live process
        # of that writer is left to answer REPLICATE, so the worker must catch
        # up to the writer's persisted position from the database by itself.
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        readers = {n: ["master"] for n in STORE_STREAMS}
        writer = await RoomStore.open(url, StoreConfig(instance_name="master"))
        await self.persist_room(writer, "!before:example.org", 4)
        worker = await self.open_store(url, StoreConfig(instance_name="worker1", stream_writers=readers))
        start = {n: worker.generators[n].get_current_token_for_writer("master") for n in STORE_STREAMS}
        await self.persist_room(writer, "!while-away:example.org", 10)
        await writer.invalidate_cache("get_user", ["@x:example.org"])
        expected = {n: await self.expected_rows(writer, n, "master", start[n]) for n in ("events", "caches")}
        targets = {n: writer.generators[n].get_current_token() for n in STORE_STREAMS}
        await writer.close()  # gone: nobody will announce its rows
        applied = Applied()
        on_worker = self.connect(worker, redis, channel, on_applied=applied)
        await on_worker.when_ready()
        await wait_until(
            lambda: all(on_worker.positions.get(n, "master") >= targets[n] for n in STORE_STREAMS),
            20,
            "the worker to catch up from the database",
        )
        for stream in ("events", "caches"):
            self.assertTrue(expected[stream], stream)
            # Every row after where the worker stood, once, in order.
            self.assertEqual(applied.tokens.get((stream, "master"), []), expected[stream], stream)
        self.assertEqual(worker.events_stream.get_current_token(), targets["events"])

    async def test_gap_while_redis_was_down_is_filled_from_the_database(self):
        server = RedisServer(self)
        server.start()
        url, channel = self.new_database_url(), fresh_channel()
        writer = await self.open_store(url, StoreConfig(instance_name="master"))
        worker = await self.open_store(
            url, StoreConfig(instance_name="worker1", stream_writers={n: ["master"] for n in STORE_STREAMS})
        )
        applied = Applied()
        on_writer = self.connect(writer, server.url, channel)
        on_worker = self.connect(worker, server.url, channel, on_applied=applied, page_size=7)
        await on_writer.when_ready()
        await on_worker.when_ready()
        await self.persist_room(writer, "!before:example.org", 5)
        await wait_until(
            lambda: applied.last("events", "master") == writer.events_stream.get_current_token(),
            20,
            "rows before the restart",
        )
        server.stop()
        await wait_until(lambda: not on_worker.ready and not on_writer.ready, 10, "both to see Redis go")
        # Written while nobody can hear: more than a few pages.
        await self.persist_room(writer, "!during:example.org", 40)
        server.start()
        await wait_until(
            lambda: applied.last("events", "master") == writer.events_stream.get_current_token(),
            30,
            "the worker to fill the gap",
        )
        self.assertEqual(applied.tokens[("events", "master")], await self.expected_rows(writer, "events", "master"))
        # And live again afterwards.
        await self.persist_room(writer, "!after:example.org", 3)
        await wait_until(
            lambda: applied.last("events", "master") == writer.events_stream.get_current_token(),
            20,
            "rows after the restart",
        )
        self.assertEqual(applied.tokens[("events", "master")], await self.expected_rows(writer, "events", "master"))


class RedisMultiWriterTests(RedisMixin, DatabaseTestMixin, unittest.TestCase):
    engine_name = "postgres"

    async def test_two_writers_and_a_reader(self):
        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        w1 = await self.open_store(url, StoreConfig(instance_name="w1", stream_writers=MULTI))
        w2 = await self.open_store(url, StoreConfig(instance_name="w2", stream_writers=MULTI))
        reader = await self.open_store(url, StoreConfig(instance_name="reader", stream_writers=MULTI))
        applied = Applied()
        on_w1 = self.connect(w1, redis, channel)
        on_w2 = self.connect(w2, redis, channel)
        on_reader = self.connect(reader, redis, channel, on_applied=applied)
        for r in (on_w1, on_w2, on_reader):
            await r.when_ready()
        linear_seen: list[int] = []

        async def run(store, tag):
            await self.persist_room(store, f"!{tag}:example.org", 30, batch=2)

        from twisted.internet import defer

        watching = [True]

        async def watch():
            while watching[0]:
                linear_seen.append(reader.events_stream.get_current_token())
                await sleep(0.002)

        watcher = defer.ensureDeferred(watch())
        await defer.gatherResults(
            [defer.ensureDeferred(run(w1, "one")), defer.ensureDeferred(run(w2, "two"))], consumeErrors=True
        )
        final = {w: s.events_stream.get_current_token_for_writer(w) for w, s in (("w1", w1), ("w2", w2))}
        await wait_until(
            lambda: all(reader.events_stream.get_current_token_for_writer(w) >= final[w] for w in final),
            30,
            "the reader to hear both writers",
        )
        # The writer that finished first is idle: it moves up once it hears the
        # other and announces that with a POSITION, which the reader may not have
        # heard yet when the rows are all in.
        await wait_until(
            lambda: reader.events_stream.get_current_token() == max(final.values()),
            30,
            "the reader's linear position to reach the newest row",
        )
        watching[0] = False
        await watcher
        for writer, store in (("w1", w1), ("w2", w2)):
            self.assertEqual(applied.tokens[("events", writer)], await self.expected_rows(store, "events", writer))
        # The linear position never passed a token whose row the reader had
        # not applied (every row of both writers is in the database now).
        tokens = sorted(t for w in ("w1", "w2") for t, _ in applied.tokens[("events", w)])
        self.assertEqual(tokens, list(range(1, len(tokens) + 1)))
        self.assertEqual(reader.events_stream.get_current_token(), max(tokens))
        self.assertEqual(linear_seen, sorted(linear_seen))
        # Each writer heard the other (idle writers move up with the stream).
        self.assertEqual(w1.events_stream.get_current_token(), w2.events_stream.get_current_token())


class RedisUrlTests(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse_redis_url("redis://127.0.0.1:6380/2").port, 6380)
        self.assertEqual(parse_redis_url("redis://h").port, 6379)
        self.assertEqual(parse_redis_url("redis://:pw@h:1").password, "pw")
        with self.assertRaises(ValueError):
            parse_redis_url("http://h:1")


@on_both_engines
class RedisStopTests(RedisMixin):
    """A catch-up from the database that a stop overtakes ends quietly: the
    embedding process stops replication and then closes the store, and the
    catch-up begun on connect may still be reading positions."""

    async def test_catch_up_after_stop_and_close_ends_quietly(self):
        store = await RoomStore.open(self.new_database_url(), StoreConfig())
        replication = RedisReplication(store, parse_redis_url("redis://127.0.0.1:1"), fresh_channel())
        await replication.stop()
        await store.close()
        await replication._catch_up_from_database()  # no "database is closed"

    async def test_catch_up_of_a_running_connection_still_reports_a_closed_store(self):
        store = await RoomStore.open(self.new_database_url(), StoreConfig())
        replication = RedisReplication(store, parse_redis_url("redis://127.0.0.1:1"), fresh_channel())
        await store.close()
        with self.assertRaises(RuntimeError):
            await replication._catch_up_from_database()


class RedisCommandTests(DatabaseTestMixin, unittest.TestCase):
    """The commands as an operator runs them (PostgreSQL, two writers): the
    twistd plugin as writer ``w1``, ``roomstore import`` as ``w2`` reaching a
    live ``roomstore follow --redis`` (and its metrics), a second ``w1`` refused."""

    engine_name = "postgres"

    async def test_plugin_import_and_follow(self):
        import os
        import signal
        import subprocess
        import sys
        import tempfile
        import urllib.request

        from twisted.internet import threads

        from .redis_utils import _free_port
        from .store_utils import reap
        from .test_redis_processes import REPO, WRITER_ARGS, write_chunks

        url, redis, channel = self.new_database_url(), shared_redis_url(self), fresh_channel()
        directory = tempfile.mkdtemp(prefix="roomstore-redis-cli-")
        base, chunks = write_chunks(directory, 1)
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        processes: list = []
        self.addCleanup(reap, processes)
        common = ["--db", url, "--redis", redis, "--server-name", channel, *WRITER_ARGS]

        def spawn(argv, name):
            out = os.path.join(directory, name)
            with open(out, "wb") as stdout, open(out + ".err", "wb") as stderr:
                processes.append(subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env))
            return processes[-1], out

        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        plugin, plugin_out = spawn(
            [
                twistd,
                "-n",
                "--pidfile=",
                "roomstore",
                "--instance",
                "w1",
                "--replication-port",
                str(_free_port()),
                *common,
            ],
            "plugin",
        )
        follower, follower_out = spawn(
            [sys.executable, "-m", "roomstore.cli", "follow", "--name", "f1", "--metrics-port", "0", *common], "follow"
        )

        def text(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                return handle.read()

        await wait_until(lambda: "listening on" in text(plugin_out) or plugin.poll() is not None, 60, "twistd")
        await wait_until(lambda: '"following"' in text(follower_out) or follower.poll() is not None, 60, "follow")
        self.assertIsNone(plugin.poll(), text(plugin_out))
        start = json.loads(text(follower_out).splitlines()[0])

        def cli(*argv):
            return subprocess.run(
                [sys.executable, "-m", "roomstore.cli", *argv], capture_output=True, text=True, env=env, timeout=300
            )

        for path in (base, chunks["w2"][0]):
            done = await threads.deferToThread(cli, "import", path, "--instance", "w2", *common)
            self.assertEqual(done.returncode, 0, done.stderr)
        # The second process claiming w1 (the plugin's) is refused, in one line.
        refused = await threads.deferToThread(cli, "import", base, "--instance", "w1", *common)
        self.assertEqual(refused.returncode, 2)
        self.assertEqual(len(refused.stderr.strip().splitlines()), 1, refused.stderr)
        self.assertIn(f"writer instance 'w1' is already running (pid {plugin.pid}", refused.stderr)

        reader = await self.open_store_readonly(url)
        w2_rows = await RedisMixin.expected_rows(self, reader, "events", "w2")
        final = w2_rows[-1][0]

        def applied():
            rows = [json.loads(line) for line in text(follower_out).splitlines()[1:]]
            return [(r["token"], r["row"]) for r in rows if r["stream"] == "events" and r["instance"] == "w2"]

        await wait_until(lambda: applied() and applied()[-1][0] == final, 60, "w2's rows at the follower")
        self.assertEqual(applied(), [(token, row) for token, rows in w2_rows for row in rows])
        metrics_text = await threads.deferToThread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{start['metrics_port']}/metrics").read().decode()
        )
        self.assertIn(
            f'roomstore_replication_applied_position{{stream="events",writer="w2"}} {float(final)}', metrics_text
        )
        self.assertIn('roomstore_replication_redis_connected{role="subscribe"} 1.0', metrics_text)
        for proc in (follower, plugin):
            proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: proc.poll() is not None, 30, "exit")

    async def open_store_readonly(self, url):
        store = await RoomStore.open(url, StoreConfig(instance_name="checker", read_only=True, stream_writers=MULTI))
        self.addCleanup(store.close)
        return store
