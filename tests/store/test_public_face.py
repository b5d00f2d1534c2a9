"""The face replication and the command line use (docs/api.md "Streams and
the database"), on both engines."""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial import unittest

from roomstore.storage import SCHEMA_VERSION
from roomstore.storage.stats import STATS_TABLES
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, UncheckedRoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


@on_both_engines
class PublicFaceTests:
    async def open(self, url: str, **config) -> RoomStore:
        store = await RoomStore.open(url, StoreConfig(**config))
        self.addCleanup(store.close)
        return store

    async def test_database_facts(self):
        url = self.new_database_url()
        store = await self.open(url)
        self.assertEqual(store.schema_version, SCHEMA_VERSION)
        self.assertEqual(store.describe_database(), store.db.engine.describe())
        self.assertEqual(store.max_connections, store.db.engine.max_connections)
        first, second = RoomBuilder("!first:example.org"), RoomBuilder("!second:example.org")
        await store.persist_events([second.to_persist(e) for e in (second.create(), second.join(ALICE))])
        await store.persist_events([first.to_persist(e) for e in (first.create(), first.join(ALICE))])
        self.assertEqual(await store.get_room_ids(), [second.room_id, first.room_id])
        stats = await store.table_stats()
        self.assertEqual([row["table"] for row in stats], list(STATS_TABLES))
        by_table = {row["table"]: row["rows"] for row in stats}
        self.assertEqual((by_table["rooms"], by_table["events"], by_table["state_compaction_runs"]), (2, 4, 0))
        # A read-only store reads the same facts.
        reader = await self.open(url, instance_name="reader", read_only=True)
        self.assertEqual(reader.schema_version, SCHEMA_VERSION)
        self.assertEqual(await reader.get_room_ids(), [second.room_id, first.room_id])

    async def test_stream_views_read_and_follow_positions_but_reserve_nothing(self):
        store = await self.open(self.new_database_url())
        self.assertEqual(store.stream_names, ("events", "backfill", "caches"))
        room = RoomBuilder()
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        events = store.stream("events")
        self.assertIs(events, store.stream("events"))
        self.assertEqual((events.name, events.writers, events.is_writer), ("events", ("master",), True))
        self.assertEqual(events.get_current_token(), 2)
        self.assertEqual(events.get_positions(), {"master": 2})
        self.assertEqual(events.get_current_token_for_writer("master"), 2)
        self.assertEqual(self.successResultOf(events.wait_for_position(2)), 2)
        self.assertFalse(hasattr(events, "get_next"))
        with self.assertRaises(KeyError):
            store.stream("receipts")

    async def test_stream_reads_and_replicated_changes(self):
        url = self.new_database_url()
        writer = await self.open(url)
        room = UncheckedRoomBuilder()  # about streams: Bob joins a room without join rules
        await writer.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE))])
        await writer.persist_events([room.to_persist(room.join(BOB))])
        await writer.invalidate_cache("get_thing", ["a", "b"])

        events, state, more = await writer.read_events_stream("master", 0, 3, 2)
        self.assertTrue(more)
        self.assertEqual([(e[0], e[3], e[4]) for e in events], [(1, "m.room.create", ""), (2, "m.room.member", ALICE)])
        # A batch's state rows sit at its room's newest event.
        self.assertEqual({(s[0], s[2], s[3]) for s in state}, {(2, "m.room.create", ""), (2, "m.room.member", ALICE)})
        events, state, more = await writer.read_events_stream("master", 2, 3, 2)
        self.assertEqual(([e[0] for e in events], [s[0] for s in state], more), ([3], [3], False))
        self.assertEqual(await writer.read_backfill_stream("master", 0, 0, 5), ([], False))
        rows, more = await writer.read_caches_stream("master", 0, writer.stream("caches").get_current_token(), 10)
        self.assertFalse(more)
        self.assertIn(("get_thing", ["a", "b"]), [(r[1], r[2]) for r in rows])

        # A worker that caches Bob's rooms before a replicated join drops it.
        worker = await self.open(
            url, instance_name="worker", stream_writers={n: ["master"] for n in writer.stream_names}
        )
        self.assertEqual(await worker.get_rooms_for_user("@carol:example.org"), frozenset())
        carol = room.join("@carol:example.org")
        await writer.persist_events([room.to_persist(carol)])
        self.assertEqual(await worker.get_rooms_for_user("@carol:example.org"), frozenset(), "cached")
        token = writer.stream("events").get_current_token()
        worker.replicated_event(token, room.room_id, "m.room.member", "@carol:example.org", None)
        worker.stream("events").advance("master", token)
        self.assertEqual(worker.stream("events").get_current_token(), token)
        self.assertEqual(await worker.get_rooms_for_user("@carol:example.org"), frozenset([room.room_id]))


class PackageFaceTests(unittest.TestCase):
    """``roomstore`` itself exports what an embedder uses (docs/api.md, "The
    public face"), each name the very object its home module defines, and
    importing the package loads none of it."""

    def test_every_name_resolves_to_its_home(self):
        import importlib

        import roomstore

        for name, home in roomstore._HOME.items():
            self.assertIs(getattr(roomstore, name), getattr(importlib.import_module(home), name), name)
        self.assertIn("EventToPersist", dir(roomstore))
        with self.assertRaises(AttributeError):
            roomstore.NoSuchName  # noqa: B018

    def test_the_errors_are_exceptions(self):
        import roomstore

        for name in roomstore.__all__:
            if name.endswith(("Error", "Mismatch", "Signature", "Version", "Cycle", "Token", "Lost", "Held", "Found")):
                self.assertTrue(issubclass(getattr(roomstore, name), Exception), name)
        self.assertTrue(issubclass(roomstore.NotFoundError, KeyError))
        self.assertTrue(issubclass(roomstore.StateGroupNotFound, roomstore.NotFoundError))

    def test_import_roomstore_is_cheap(self):
        code = "import sys, roomstore; print(sorted(m for m in ('twisted', 'roomstore.store') if m in sys.modules))"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
        self.assertEqual(out.stdout.strip(), "[]")
