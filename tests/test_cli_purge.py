"""``roomstore purge-history`` and ``purge-room``, run as real processes, on both engines."""

from __future__ import annotations

import os
import tempfile

from twisted.internet import threads

from roomstore.demo.sample import write_sample
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.test_cli import run_cli


@on_both_engines
class PurgeCliTests:
    async def cli(self, *args):
        return await threads.deferToThread(run_cli, *args)

    async def test_purge_history_then_room(self):
        url = self.new_database_url()
        sample = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        self.addCleanup(os.remove, sample)
        write_sample(sample, rooms=2, events_per_room=80, seed=5)
        code, _, err = await self.cli("import", sample, "--db", url)
        self.assertEqual(code, 0, err)
        store = await RoomStore.open(url, StoreConfig(read_only=True))
        try:
            room_id, other = await store.get_room_ids()
            members = await store.get_users_in_room(room_id)
            page = await store.paginate(room_id, members[0], None, "b", 30)
        finally:
            await store.close()

        code, out, err = await self.cli("purge-history", "--db", url, room_id, "--before", page.next_token)
        self.assertEqual(code, 0, err)
        [result] = out
        self.assertEqual(result["room_id"], room_id)
        self.assertGreater(result["rows_deleted"]["events"], 0)
        self.assertGreater(result["state_groups_deleted"], 0)
        code, out, err = await self.cli("purge-history", "--db", url, room_id, "--before", page.next_token)
        self.assertEqual((code, out[0]["rows_deleted"], out[0]["state_groups_deleted"]), (0, {}, 0))
        code, out, err = await self.cli("messages", "--db", url, room_id, "--user", members[0], "--limit", "100")
        self.assertEqual(code, 0, err)
        # Exactly the page after the purge point is left of the timeline.
        self.assertEqual([e["event_id"] for e in out[:-1]], [e["event_id"] for e in page.events])

        code, out, err = await self.cli("purge-room", "--db", url, room_id)
        self.assertEqual(code, 0, err)
        self.assertEqual(out[0]["rows_deleted"]["rooms"], 1)
        code, out, err = await self.cli("stats", "--db", url)
        rows = {row["table"]: row["rows"] for row in out}
        self.assertEqual(rows["rooms"], 1)  # the other room

        code, out, err = await self.cli("purge-history", "--db", url, other, "--before", "x1")
        self.assertEqual((code, out), (2, []))
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("--before", err)
