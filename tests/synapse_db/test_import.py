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
import tempfile
import threading

from roomstore.cli import import_loop
from roomstore.cli.import_loop import import_file
from roomstore.store import RoomStore
from roomstore.synapse_db import SynapseReader, import_synapse, verify_synapse
from tests.db import on_both_engines
from tests.synapse_db.history import build, users_of
from tests.synapse_server import SharedHistory, SynapseError, SynapseServer, exclusive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def departure(facts: dict, shown_by_roomstore: bool) -> str | None:
    """Which of Synapse's departures from the spec's history visibility rules
    (Client-Server API, "History visibility"; the Server-Server API's
    algorithm) explains an event one side shows and the other does not, or
    None. roomstore follows the spec; each rule named decides for it.

    * "clamped at leave": Synapse ends a departed member's /messages at their
      leave event; rule 1 (world_readable: "all events while this is the
      value may be shared ... with anyone") shows the events sent while the
      room was world_readable after it.
    * "invited to joined": the change from "invited" to "joined" seen by a
      user invited at that point: a history_visibility event is judged by
      the setting before or after it, and rule 4 (invited at the event,
      "invited") allows it; Synapse hides it.
    * "banned peeker": Synapse treats a banned user of a room that is
      world_readable now as a peeker and hides the "shared" events from
      before they joined; rule 3 ("shared, and the user joined the room at
      any point after the event was sent") allows them.
    * "shared while departed": Synapse shows "shared" events to a user who
      has been in the room whatever their membership at the event; rule 3
      needs a join at or after the event, so the spec (rule 5) denies them.
    """
    shared = "shared" in (facts["hv_before"], facts["hv_after"])
    if shown_by_roomstore:
        if facts["world_readable"] and facts["after_last_own_membership"] and facts["last_membership"] == "leave":
            return "clamped at leave"
        if (facts["hv_before"], facts["hv_after"]) == ("invited", "joined") and facts["membership_before"] == "invite":
            return "invited to joined"
        if shared and facts["joined_after"] and facts["last_membership"] == "ban":
            return "banned peeker"
        return None
    if shared and not facts["joined_after"] and "join" not in (facts["membership_before"], facts["membership_after"]):
        return "shared while departed"
    return None


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
            f" WHERE e.room_id IN ({marks}) ORDER BY e.stream_ordering",
            self.rooms,
        )

    async def test_import_matches_synapse(self):
        store, reader, summary, skipped = await self.imported_store()
        events = self.synapse_events()
        self.assertEqual(skipped, [])
        self.assertEqual((summary.rooms, summary.events, summary.already_present), (3, len(events), 0))
        self.assertGreater(len(events), 300)
        # The forked room took Synapse's answers: states before its merge
        # events, and its current state where its extremities conflicted.
        self.assertGreater(summary.states_from_synapse, 0)
        self.assertGreater(summary.current_states_from_synapse, 0)
        # Each event's bytes are Synapse's stored JSON, exactly.
        for event_id, _, raw in events:
            self.assertEqual(await store.get_event_json_bytes(event_id), raw.encode("utf-8"), event_id)
        # Room versions as Synapse created them: its default 12, and 10.
        main, second = self.history["rooms"]["main"], self.history["rooms"]["second"]
        self.assertEqual(await store.get_room_version(main), "12")
        self.assertEqual(await store.get_room_version(self.history["rooms"]["forked"]), "12")
        self.assertEqual(await store.get_room_version(second), "10")
        checked = await verify_synapse(store, reader, self.rooms)
        self.assertEqual(checked.differences, 0, checked)
        self.assertEqual(checked.events_checked, len(events))
        self.assertEqual(checked.states_compared, len(events))
        flags = await store.get_event_flags([e for e, _, _ in events])
        self.assertEqual(sum(f.redacted for f in flags.values()), 4)  # the four redacted messages
        # Current state is Synapse's.
        for room_id in self.rooms:
            theirs = {
                (t, k): e
                for t, k, e in self.synapse_rows(
                    "SELECT type, state_key, event_id FROM current_state_events WHERE room_id = ?", (room_id,)
                )
            }
            self.assertEqual(await store.get_current_state_ids(room_id), theirs)

    async def test_verify_finds_a_difference(self):
        store, reader, _, _ = await self.imported_store()
        main = self.history["rooms"]["main"]
        # Drop a redaction flag behind the store's back: verify must see it.
        target = self.synapse_rows(
            "SELECT redacts FROM redactions AS r JOIN events AS e ON e.event_id = r.event_id WHERE e.room_id = ?"
            " ORDER BY e.stream_ordering LIMIT 1",
            (main,),
        )[0][0]

        def unflag(txn):
            nid = store.interners.events.lookup(txn, [target])[target]
            txn.execute("UPDATE events SET redacted = ? WHERE event_nid = ?", (False, nid))

        await store.db.run_interaction("unflag", unflag)
        found: list[dict] = []
        checked = await verify_synapse(store, reader, self.rooms, report=found.append)
        self.assertEqual((checked.redaction_differences, checked.state_differences), (1, 0))
        self.assertEqual(
            found,
            [{"event_id": target, "difference": "redaction", "synapse_redacted": True, "roomstore_redacted": False}],
        )

    async def test_rerun_imports_nothing(self):
        store, reader, first, _ = await self.imported_store()
        token = store.get_current_token()
        again = await import_synapse(store, reader, self.rooms)
        self.assertEqual((again.events, again.already_present, again.skipped), (0, first.events, {}))
        self.assertEqual(store.get_current_token(), token)

    async def test_stored_events_are_looked_for_until_a_page_holds_none(self):
        # A first run looks once (its first page holds no stored event), not
        # page by page; a run again looks at every page and imports nothing.
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        reader = await self.open_reader()
        looks: list[int] = []
        real_flags = store.get_event_flags

        async def flags(event_ids):
            found = await real_flags(event_ids)
            looks.append(len(found))
            return found

        self.patch(store, "get_event_flags", flags)
        first = await import_synapse(store, reader, self.rooms, batch_size=16)
        self.assertGreater(first.events, 32)
        self.assertEqual(looks, [0])
        looks.clear()
        again = await import_synapse(store, reader, self.rooms, batch_size=16)
        self.assertEqual((again.events, again.already_present), (0, first.events))
        self.assertEqual(len(looks), -(-first.events // 16))
        # Stored events after a page without any are left to the store, which
        # reports them present: counted the same, nothing written twice.
        token = store.get_current_token()
        looks.clear()

        async def first_page_unseen(event_ids):
            looks.append(len(event_ids))
            return {} if len(looks) == 1 else await real_flags(event_ids)

        self.patch(store, "get_event_flags", first_page_unseen)
        third = await import_synapse(store, reader, self.rooms, batch_size=16)
        self.assertEqual((third.events, third.already_present, third.skipped), (0, first.events, {}))
        self.assertEqual(len(looks), 1)
        self.assertEqual(store.get_current_token(), token)

    async def test_import_beside_a_live_synapse(self):
        """Synapse keeps sending while imports run against its live database:
        each run takes what is there, the next what came since; at the end
        everything is there once and verifies."""
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        writing = exclusive(self.synapse)  # no compaction test beside these writes
        self.addCleanup(writing.close)
        alice = users_of(self.synapse, self.history)["alice"]
        live = alice.create_room(name="live")
        sender = threading.Thread(target=lambda: [alice.send(live, f"live {i}") for i in range(150)])
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        reader = await self.open_reader()
        imported, runs = 0, 0
        sender.start()
        while sender.is_alive() or runs < 2:
            summary = await import_synapse(store, reader, [live], batch_size=16)
            self.assertEqual(summary.skipped, {})
            imported += summary.events
            runs += 1
            await deferLater(reactor, 0.05, lambda: None)
        sender.join()
        imported += (await import_synapse(store, reader, [live])).events
        count = self.synapse_rows("SELECT COUNT(*) FROM events WHERE room_id = ?", (live,))[0][0]
        self.assertEqual(imported, count)
        self.assertGreater(runs, 2)
        checked = await verify_synapse(store, reader, [live])
        self.assertEqual((checked.differences, checked.not_imported, checked.events_checked), (0, 0, count))

    async def test_messages_match_synapse(self):
        """Every user's ``/messages`` of every room, paged back to the start,
        against roomstore's pages. Where they differ, each event must be one
        of Synapse's known departures from the spec's history visibility
        rules (``DEPARTURES``), and which departure meets whom is named."""
        store, _, _, _ = await self.imported_store()
        users = users_of(self.synapse, self.history)
        rooms = {room_id: n for n, room_id in self.history["rooms"].items()}
        found: set[tuple[str, str, str]] = set()
        same = 0
        dummies = {e for e, _, raw in self.synapse_events() if json.loads(raw)["type"] == "org.matrix.dummy_event"}
        for room_id, room_name in sorted(rooms.items()):
            timeline = [e for e, r, _ in self.synapse_events() if r == room_id]
            for name, user in sorted(users.items()):
                theirs = user.messages_back(room_id)
                ours = await self.page_back(store, room_id, user.user_id)
                if isinstance(theirs, SynapseError):
                    # Synapse refuses /messages outright to a user who never
                    # was in the room, or is banned from it, while it is not
                    # world_readable now (its membership check comes before
                    # the per-event rules); roomstore applies the per-event
                    # rules, which show such a user the events sent while
                    # the room was world_readable (rule 1), and only those.
                    self.assertEqual((theirs.status, theirs.errcode), (403, "M_FORBIDDEN"), (room_name, name))
                    facts = [await self.visibility_facts(store, timeline, e, user.user_id) for e in ours]
                    self.assertTrue(all(f["world_readable"] for f in facts), (room_name, name))
                    found.add((room_name, name, "refused"))
                    continue
                # Synapse never sends a client the dummy events it makes to
                # merge a room's forward extremities (a filter of its own, not
                # a visibility rule); roomstore serves every stored event.
                self.assertFalse(dummies & set(theirs))
                ours = [e for e in ours if e not in dummies]
                if ours == theirs:
                    same += 1
                    continue
                # The order of what both show is the same: topological.
                both = set(ours) & set(theirs)
                self.assertEqual([e for e in ours if e in both], [e for e in theirs if e in both], (room_name, name))
                for event_id in set(ours) ^ set(theirs):
                    facts = await self.visibility_facts(store, timeline, event_id, user.user_id)
                    rule = departure(facts, shown_by_roomstore=event_id in ours)
                    self.assertIsNotNone(rule, (room_name, name, event_id, facts))
                    found.add((room_name, name, rule))
        self.assertEqual(
            found,
            {
                ("main", "carol", "clamped at leave"),
                ("main", "carol", "invited to joined"),
                ("main", "dave", "shared while departed"),
                ("main", "frank", "refused"),
                ("second", "bob", "banned peeker"),
                ("second", "eve", "clamped at leave"),
                ("forked", "dave", "refused"),
                ("forked", "eve", "refused"),
                ("forked", "frank", "refused"),
            },
        )
        self.assertEqual(same, 10)  # the other 10 of the 18 (user, room) pairs agree event for event

    async def page_back(self, store, room_id: str, user_id: str) -> list[str]:
        """Every event ID roomstore's pages give the user, back from the end."""
        ids: list[str] = []
        token = None
        while True:
            page = await store.paginate(room_id, user_id, token, "b", 50)
            if not page.events:
                return ids
            ids.extend(ev["event_id"] for ev in page.events)
            token = page.next_token

    async def visibility_facts(self, store, timeline: list[str], event_id: str, user_id: str) -> dict:
        """What the spec's rules and Synapse's departures are judged on, from
        roomstore's state before and after the event and the room's timeline."""

        async def content_of(state, key) -> dict:
            found = state.get(key)
            return (await store.get_event(found, redact=False))["content"] if found else {}

        member = ("m.room.member", user_id)
        hv = ("m.room.history_visibility", "")
        before = await store.get_state_ids(event_id, before=True)
        after = await store.get_state_ids(event_id)
        own = []  # (index, membership) of the user's membership events
        for index, other in enumerate(timeline):
            ev = await store.get_event(other, redact=False)
            if ev["type"] == "m.room.member" and ev.get("state_key") == user_id:
                own.append((index, ev["content"].get("membership")))
        at = timeline.index(event_id)
        hv_before = (await content_of(before, hv)).get("history_visibility", "shared")
        hv_after = (await content_of(after, hv)).get("history_visibility", "shared")
        return {
            "hv_before": hv_before,
            "hv_after": hv_after,
            "world_readable": "world_readable" in (hv_before, hv_after),
            "membership_before": (await content_of(before, member)).get("membership"),
            "membership_after": (await content_of(after, member)).get("membership"),
            "joined_after": any(i > at and m == "join" for i, m in own),
            "after_last_own_membership": bool(own) and at > own[-1][0],
            "last_membership": own[-1][1] if own else None,
        }

    async def test_json_lines_of_the_same_events_import_too(self):
        """The same events as JSON lines import with ``roomstore import``,
        the forked room too: the lines carry no resolved state, and the
        store's own state resolution gives Synapse's state after every event
        (import-synapse takes Synapse's answer instead)."""
        store, reader, summary, _ = await self.imported_store()
        folder = tempfile.mkdtemp(prefix="roomstore-export-")
        forked = self.history["rooms"]["forked"]
        paths = {"linear": os.path.join(folder, "linear.jsonl"), "forked": os.path.join(folder, "forked.jsonl")}
        counts = {"linear": 0, "forked": 0}
        with open(paths["linear"], "w") as linear, open(paths["forked"], "w") as fork:
            for _event_id, room_id, raw in self.synapse_events():
                which = "forked" if room_id == forked else "linear"
                version = await store.get_room_version(room_id)
                (fork if which == "forked" else linear).write(f'{{"room_version": "{version}", "event": {raw}}}\n')
                counts[which] += 1
        other = await RoomStore.open(await self.make_database())
        self.addCleanup(other.close)
        result = await import_file(other, paths["linear"], batch_size=64)
        self.assertEqual((result["imported"], result["already_present"], result["failed"]), (counts["linear"], 0, 0))
        self.assertEqual(result["redacted_content_hash_mismatch"], 0)  # Synapse's JSON holds its hashes
        checked = await verify_synapse(other, reader, sorted(set(self.rooms) - {forked}))
        self.assertEqual((checked.differences, checked.not_imported), (0, 0))
        errors = []
        self.patch(import_loop, "emit", errors.append)
        result = await import_file(other, paths["forked"], batch_size=64)
        self.assertEqual((result["imported"], result["failed"], errors), (counts["forked"], 0, []))
        differences: list = []
        checked = await verify_synapse(other, reader, [forked], report=differences.append)
        self.assertEqual((checked.differences, checked.not_imported), (0, 0), differences)
        self.assertEqual(checked.events_checked, counts["forked"])


@on_both_engines
class SynapseSqliteImportTests(SynapseImportMixin):
    synapse_variable = "ROOMSTORE_TEST_SYNAPSE"


@on_both_engines
class SynapsePostgresImportTests(SynapseImportMixin):
    synapse_variable = "ROOMSTORE_TEST_SYNAPSE_PG"
