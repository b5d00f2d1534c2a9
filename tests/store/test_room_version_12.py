"""A room version 12 room in the store, on both engines: persisted and read
back (state, messages, sync, backfill, the implied create auth edge), its
redacted events served as Synapse's ``prune_event`` makes them, and the
refusals a v12 room ID brings (a create event carrying ``room_id``, a room
ID that names no create event), through the API and ``roomstore import``."""

from __future__ import annotations

import copy
import json
import os
import tempfile

from twisted.internet import threads

from roomstore.events.write.batch import EventToPersist
from roomstore.pdu.hashing import compute_content_hash
from roomstore.pdu.parsing import InvalidEventError
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.events.test_room_version_12 import synapse
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
CAROL = "@carol:example.org"


def v12_room() -> RoomBuilder:
    return RoomBuilder(version="12", creator=ALICE, additional_creators=[CAROL])


def retarget(room: RoomBuilder, room_id: str, body: str) -> bytes:
    """A message on the room's leaves that names ``room_id`` instead."""
    event = {
        "auth_events": [],
        "content": {"msgtype": "m.text", "body": body},
        "depth": 99,
        "origin": "example.org",
        "origin_server_ts": 1_700_000_999_000,
        "prev_events": list(room.leaves),
        "room_id": room_id,
        "sender": ALICE,
        "type": "m.room.message",
    }
    event["hashes"] = {"sha256": compute_content_hash(event)}
    event["signatures"] = {"example.org": {"ed25519:a": "c2lnbmF0dXJl"}}
    return json.dumps(event).encode()


@on_both_engines
class RoomVersion12Tests:
    async def build_room(self, store: RoomStore) -> tuple[RoomBuilder, dict]:
        room = v12_room()
        create, join = room.create(), room.join(ALICE)
        # The create event and the first event in one batch: the room ID's create is in the batch.
        await store.persist_events([room.to_persist(create), room.to_persist(join)])
        power = room.power_levels({ALICE: 100, CAROL: 100, BOB: 50})
        rules = room.join_rules()
        visibility = room.history_visibility("shared")
        bob = room.join(BOB)
        message = room.message(BOB, "to be redacted")
        kept = room.message(ALICE, "kept")
        redaction = room.redact(ALICE, message.event_id)
        # Later batches: bare PDUs (no room version given), found from the stored room.
        await store.persist_events([EventToPersist(e.raw) for e in (power, rules, visibility, bob, message, kept)])
        await store.persist_events([room.to_persist(redaction)])
        names = dict(
            create=create,
            join=join,
            power=power,
            rules=rules,
            visibility=visibility,
            bob=bob,
            message=message,
            kept=kept,
            redaction=redaction,
        )
        return room, names

    async def test_persisted_and_read_back(self):
        store = await self.open_store()
        room, ev = await self.build_room(store)
        create = ev["create"]
        self.assertEqual(room.room_id, "!" + create.event_id[1:])
        self.assertEqual(await store.get_room_version(room.room_id), "12")
        # The bytes as received: no room_id in the create event.
        self.assertEqual(await store.get_event_json_bytes(create.event_id), create.raw)
        self.assertNotIn(b'"room_id"', create.raw)
        # Served, it has its room ID back, as Synapse serves it.
        served = await store.get_event(create.event_id)
        self.assertEqual((served["room_id"], served["event_id"]), (room.room_id, create.event_id))
        self.assertEqual(served["content"]["additional_creators"], [CAROL])

        state = await store.get_current_state_ids(room.room_id)
        self.assertEqual(
            state,
            {
                ("m.room.create", ""): create.event_id,
                ("m.room.member", ALICE): ev["join"].event_id,
                ("m.room.power_levels", ""): ev["power"].event_id,
                ("m.room.join_rules", ""): ev["rules"].event_id,
                ("m.room.history_visibility", ""): ev["visibility"].event_id,
                ("m.room.member", BOB): ev["bob"].event_id,
            },
        )
        self.assertEqual(
            await store.get_state_ids(ev["join"].event_id, before=True), {("m.room.create", ""): create.event_id}
        )
        self.assertEqual(await store.get_users_in_room(room.room_id), sorted([ALICE, BOB]))

        page = await store.paginate(room.room_id, BOB, None, "b", 50)
        ids = [e["event_id"] for e in page.events]
        self.assertEqual(ids, [e.event_id for e in reversed(list(ev.values()))])
        self.assertEqual(page.events[-1]["room_id"], room.room_id)  # the create event, served with it
        self.assertTrue(all(e["room_id"] == room.room_id for e in page.events))

        sync = await store.sync(BOB, None, 20)
        self.assertEqual([e["event_id"] for e in sync.rooms[room.room_id]], list(reversed(ids)))
        self.assertEqual(sync.rooms[room.room_id][0]["room_id"], room.room_id)

        backfilled = await store.backfill(room.room_id, [ev["redaction"].event_id], 10)
        self.assertEqual([e["event_id"] for e in backfilled], list(reversed(ids)))
        self.assertEqual(backfilled[0]["room_id"], room.room_id)

    async def test_auth_edges_include_the_implied_create_event(self):
        store = await self.open_store()
        room, ev = await self.build_room(store)

        def edges(txn, event_id):
            return sorted(
                r[0]
                for r in txn.execute(
                    "SELECT a.event_id FROM event_auth_edges AS x JOIN event_ids AS e ON e.event_nid = x.event_nid"
                    " JOIN event_ids AS a ON a.event_nid = x.auth_event_nid WHERE e.event_id = ?",
                    (event_id,),
                ).fetchall()
            )

        create_id = ev["create"].event_id
        # As Synapse's event_auth rows (its auth_event_ids() adds the create
        # event): the cited auth events and the implied create event.
        for name in ("join", "power", "message", "redaction"):
            cited = ev[name].event["auth_events"]
            self.assertNotIn(create_id, cited)
            self.assertEqual(
                await store.db.run_interaction("edges", edges, ev[name].event_id), sorted({*cited, create_id}), name
            )
        self.assertEqual(await store.db.run_interaction("edges", edges, create_id), [])

    async def test_redaction_served_as_synapse_prunes(self):
        known, make_event, prune_event, *_ = synapse()
        store = await self.open_store()
        room, ev = await self.build_room(store)
        served = await store.get_event(ev["message"].event_id)
        self.assertEqual(served["unsigned"]["redacted_because"]["event_id"], ev["redaction"].event_id)
        theirs = prune_event(make_event(copy.deepcopy(ev["message"].event), known["12"])).get_dict()
        theirs.pop("unsigned", None)
        ours = {k: v for k, v in served.items() if k not in ("unsigned", "event_id")}
        self.assertEqual(ours, theirs)
        self.assertEqual(ours["content"], {})
        # The same through messages and sync.
        page = await store.paginate(room.room_id, BOB, None, "b", 50)
        [paged] = [e for e in page.events if e["event_id"] == ev["message"].event_id]
        self.assertEqual(paged, served)
        # The redaction itself keeps content.redacts (v11 rules, unchanged in v12).
        redaction = await store.get_event(ev["redaction"].event_id)
        self.assertEqual(redaction["content"]["redacts"], ev["message"].event_id)

    async def test_room_id_not_matching_a_create_hash_is_refused(self):
        store = await self.open_store()
        room, ev = await self.build_room(store)
        position = store.get_current_token()
        # A room ID of the right form whose create event does not exist...
        nowhere = "!" + fake_event_id("no such create")[1:]
        with self.assertRaises(InvalidEventError) as cm:
            await store.persist_events([EventToPersist(retarget(room, nowhere, "astray"), "12")])
        self.assertIn(f"no create event ${nowhere[1:]} is stored", str(cm.exception))
        self.assertEqual(cm.exception.field, "room_id")
        # ... or names an event that is not a create event.
        not_create = "!" + ev["kept"].event_id[1:]
        with self.assertRaises(InvalidEventError) as cm:
            await store.persist_events([EventToPersist(retarget(room, not_create, "astray"), "12")])
        self.assertIn("is not that room's create event", str(cm.exception))
        # Nothing written, no stream position spent.
        self.assertEqual(store.get_current_token(), position)
        # The same event in the right room goes in.
        [result] = await store.persist_events([EventToPersist(retarget(room, room.room_id, "home"), "12")])
        self.assertFalse(result.already_persisted)

    async def test_create_event_carrying_a_room_id_is_refused(self):
        store = await self.open_store()
        room = v12_room()
        create = room.create()
        derived = room.room_id
        for room_id in (derived, "!room:example.org"):
            raw = json.dumps(dict(create.event, room_id=room_id)).encode()
            with self.assertRaises(InvalidEventError) as cm:
                await store.persist_events([EventToPersist(raw, "12")])
            self.assertIn("must not carry 'room_id'", str(cm.exception))
            # Without a room version given, the create event's content.room_version says 12.
            with self.assertRaises(InvalidEventError):
                await store.persist_events([EventToPersist(raw)])
        self.assertIsNone(await store.get_room_version(derived))
        self.assertEqual(store.get_current_token(), "s0")

    async def test_import_reports_v12_refusals_and_unknown_versions_one_line_each(self):
        from tests.test_cli import run_cli

        url = self.new_database_url()
        room = v12_room()
        create, join = room.create(), room.join(ALICE)
        message = room.message(ALICE, "hello")
        path = os.path.join(tempfile.mkdtemp(), "v12.jsonl")
        self.addCleanup(os.remove, path)
        lines = [
            {"room_version": "12", "event": create.event},
            join.event,  # a bare PDU: the version from the stored room
            {"room_version": "12", "event": dict(create.event, room_id=room.room_id)},
            {"room_version": "12", "event": json.loads(retarget(room, "!" + fake_event_id("x")[1:], "astray"))},
            {"room_version": "13", "event": message.event},
            {"room_version": "12", "event": message.event},
        ]
        with open(path, "w") as out:
            out.write("".join(json.dumps(line) + "\n" for line in lines))
        code, out, err = await threads.deferToThread(run_cli, "import", path, "--db", url)
        self.assertEqual(code, 0, err)
        errors = [(o["line"], o["error"], o["message"]) for o in out if "error" in o]
        self.assertEqual(
            [e[:2] for e in errors],
            [
                (3, "InvalidEventError"),
                (4, "InvalidEventError"),
                (5, "UnknownRoomVersion"),
            ],
        )
        self.assertIn("must not carry 'room_id'", errors[0][2])
        self.assertIn("no create event", errors[1][2])
        self.assertIn("Unknown room version '13'", errors[2][2])
        self.assertTrue(all("\n" not in e[2] for e in errors))
        self.assertEqual((out[-1]["imported"], out[-1]["failed"]), (3, 3))
        code, out, err = await threads.deferToThread(run_cli, "state", "--db", url, message.event_id)
        self.assertEqual(code, 0, err)
        self.assertEqual(
            {(s["type"], s["state_key"]) for s in out[0]["state"]}, {("m.room.create", ""), ("m.room.member", ALICE)}
        )
