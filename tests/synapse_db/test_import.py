"""``import-synapse`` and ``verify-synapse`` against a real Synapse.

``bin/test`` starts two Synapse homeservers (``tests/synapse_server.py``):
one on SQLite, one on PostgreSQL. The tests make a history on each through
the client-server API (``history.py``), import Synapse's database into a
fresh roomstore of each engine, and hold roomstore's answers to Synapse's own:
the state after every event against Synapse's state groups, the redaction
flags, the stored bytes, and every user's ``/messages`` of every room, paged
back to the start. Without a running Synapse they fail, never skip.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile

from roomstore.cli import import_file
from roomstore.store import RoomStore
from roomstore.synapse_db import SynapseReader, import_synapse, verify_synapse
from tests.db import on_both_engines
from tests.synapse_db.history import build, users_of
from tests.synapse_server import SharedHistory, SynapseError, SynapseServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SynapseImportMixin:
    #: The environment variable naming the Synapse this class reads.
    synapse_variable = "ROOMSTORE_TEST_SYNAPSE"

    def setUp(self):
        self.synapse = SynapseServer.from_env(self.synapse_variable)
        self.history = SharedHistory(self.synapse, "import").get(build)
        self.rooms = sorted(self.history["rooms"].values())

    async def open_reader(self) -> SynapseReader:
        from twisted.internet import reactor

        reader = await SynapseReader.open(self.synapse.database_url, reactor)
        self.addCleanup(reader.close)
        return reader

    async def imported_store(self):
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        reader = await self.open_reader()
        skipped: list[dict] = []
        summary = await import_synapse(store, reader, self.rooms, batch_size=64, report=skipped.append)
        return store, reader, summary, skipped

    def synapse_rows(self, sql: str, args=()) -> list[tuple]:
        """Rows of Synapse's own database, through a connection of the test's."""
        if self.synapse.engine == "sqlite":
            conn = sqlite3.connect(f"file:{self.synapse.database}?mode=ro", uri=True)
        else:
            import psycopg2

            conn = psycopg2.connect(self.synapse.database)
            sql = sql.replace("?", "%s")
        try:
            cur = conn.cursor()
            cur.execute(sql, args)
            return cur.fetchall()
        finally:
            conn.close()

    def synapse_events(self) -> list[tuple[str, str, str]]:
        """(event_id, room_id, json) of the test's rooms, in stream order."""
        marks = ", ".join("?" for _ in self.rooms)
        return self.synapse_rows(
            "SELECT e.event_id, e.room_id, j.json FROM events AS e JOIN event_json AS j USING (event_id)"
            f" WHERE e.room_id IN ({marks}) ORDER BY e.stream_ordering", self.rooms,
        )

    async def test_import_matches_synapse(self):
        store, reader, summary, skipped = await self.imported_store()
        events = self.synapse_events()
        self.assertEqual(skipped, [])
        self.assertEqual((summary.rooms, summary.events, summary.already_present), (2, len(events), 0))
        self.assertGreater(len(events), 250)
        # Each event's bytes are Synapse's stored JSON, exactly.
        for event_id, _, raw in events:
            self.assertEqual(await store.get_event_json_bytes(event_id), raw.encode("utf-8"), event_id)
        # Room versions as Synapse created them: its default 12, and 10.
        main, second = self.history["rooms"]["main"], self.history["rooms"]["second"]
        self.assertEqual(await store.get_room_version(main), "12")
        self.assertEqual(await store.get_room_version(second), "10")
        checked = await verify_synapse(store, reader, self.rooms)
        self.assertEqual(checked.differences, 0, checked)
        self.assertEqual(checked.events_checked, len(events))
        self.assertEqual(checked.states_compared, len(events))
        flags = await store.get_event_flags([e for e, _, _ in events])
        self.assertEqual(sum(f.redacted for f in flags.values()), 4)  # the four redacted messages
        # Current state is Synapse's.
        for room_id in self.rooms:
            theirs = {(t, k): e for t, k, e in self.synapse_rows(
                "SELECT type, state_key, event_id FROM current_state_events WHERE room_id = ?", (room_id,))}
            self.assertEqual(await store.get_current_state_ids(room_id), theirs)

    async def test_verify_finds_a_difference(self):
        store, reader, _, _ = await self.imported_store()
        main = self.history["rooms"]["main"]
        # Drop a redaction flag behind the store's back: verify must see it.
        target = self.synapse_rows(
            "SELECT redacts FROM redactions AS r JOIN events AS e ON e.event_id = r.event_id WHERE e.room_id = ?"
            " ORDER BY e.stream_ordering LIMIT 1", (main,))[0][0]

        def unflag(txn):
            nid = store.interners.events.lookup(txn, [target])[target]
            txn.execute("UPDATE events SET redacted = ? WHERE event_nid = ?", (False, nid))

        await store.db.run_interaction("unflag", unflag)
        found: list[dict] = []
        checked = await verify_synapse(store, reader, self.rooms, report=found.append)
        self.assertEqual((checked.redaction_differences, checked.state_differences), (1, 0))
        self.assertEqual(found, [{"event_id": target, "difference": "redaction",
                                  "synapse_redacted": True, "roomstore_redacted": False}])

    async def test_rerun_imports_nothing(self):
        store, reader, first, _ = await self.imported_store()
        token = store.get_current_token()
        again = await import_synapse(store, reader, self.rooms)
        self.assertEqual((again.events, again.already_present, again.skipped), (0, first.events, {}))
        self.assertEqual(store.get_current_token(), token)

    async def test_messages_match_synapse(self):
        """Every user's ``/messages`` of every room, paged back to the start,
        against roomstore's pages, with Synapse's departures named."""
        store, _, _, _ = await self.imported_store()
        main = self.history["rooms"]["main"]
        users = users_of(self.synapse, self.history)
        compared = refused = 0
        for room_name, room_id in sorted(self.history["rooms"].items()):
            for name, user in sorted(users.items()):
                theirs = user.messages_back(room_id)
                ours = await self.page_back(store, room_id, user.user_id)
                if isinstance(theirs, SynapseError):
                    # Synapse refuses /messages outright to a user who never
                    # was in the room while it is not world_readable now (its
                    # membership check comes before the per-event rules);
                    # roomstore applies the per-event rules, which show such a
                    # user only what was sent while the room was world_readable.
                    self.assertEqual((theirs.status, theirs.errcode), (403, "M_FORBIDDEN"), (room_name, name))
                    readable = await self.world_readable_events(store, room_id)
                    self.assertEqual(ours, [e for e in ours if e in readable], (room_name, name))
                    refused += 1
                    continue
                if room_id == main and name == "carol":
                    # The spec's rule (Client-Server API, "History visibility":
                    # an event is visible to an invited user if the
                    # history_visibility in force is "invited", judged by the
                    # state before the event, or after it for a
                    # history_visibility event itself): the change from
                    # "invited" to "joined" is visible to carol, invited at
                    # that point. Synapse hides it. That event is the only
                    # difference.
                    mark = self.history["marks"]["invited_to_joined"]
                    self.assertIn(mark, ours)
                    self.assertNotIn(mark, theirs)
                    ours = [e for e in ours if e != mark]
                self.assertEqual(ours, theirs, (room_name, name))
                compared += 1
        self.assertEqual((compared, refused), (9, 3))  # frank never joins; dave never was in main

    async def page_back(self, store, room_id: str, user_id: str) -> list[str]:
        ids: list[str] = []
        token = None
        while True:
            page = await store.paginate(room_id, user_id, token, "b", 50)
            ids.extend(ev["event_id"] for ev in page.events)
            if not page.events:
                return ids
            token = page.next_token

    async def world_readable_events(self, store, room_id: str) -> set[str]:
        """Events sent while the room's history_visibility was world_readable
        (judged as the spec says: the state before the event)."""
        readable = set()
        for event_id, _, _ in self.synapse_events():
            state = await store.get_state_ids(event_id, before=True)
            hv = state.get(("m.room.history_visibility", ""))
            if hv is None:
                continue
            setting = (await store.get_event(hv))["content"].get("history_visibility")
            if setting == "world_readable":
                readable.add(event_id)
        return readable

    async def test_json_lines_of_the_same_events_import_too(self):
        store, reader, summary, _ = await self.imported_store()
        path = os.path.join(tempfile.mkdtemp(prefix="roomstore-export-"), "events.jsonl")
        with open(path, "w") as out:
            for event_id, room_id, raw in self.synapse_events():
                version = await store.get_room_version(room_id)
                out.write('{"room_version": "%s", "event": %s}\n' % (version, raw))
        other = await RoomStore.open(await self.make_database())
        self.addCleanup(other.close)
        result = await import_file(other, path, batch_size=64)
        self.assertEqual(result, {"imported": summary.events, "already_present": 0, "failed": 0})
        checked = await verify_synapse(other, reader, self.rooms)
        self.assertEqual((checked.differences, checked.not_imported), (0, 0))


@on_both_engines
class SynapseSqliteImportTests(SynapseImportMixin):
    synapse_variable = "ROOMSTORE_TEST_SYNAPSE"


@on_both_engines
class SynapsePostgresImportTests(SynapseImportMixin):
    synapse_variable = "ROOMSTORE_TEST_SYNAPSE_PG"
