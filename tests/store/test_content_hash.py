"""Persisting an event whose content hash fails: stored redacted and flagged,
or refused; on both engines."""

from __future__ import annotations

import json

from canonicaljson import encode_canonical_json

from roomstore.events.write.persist import EventToPersist
from roomstore.pdu.content_hash import ContentHashMismatch
from roomstore.pdu.redaction_algorithm import prune_event_dict
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"


def tampered(built, **content) -> bytes:
    event = json.loads(built.raw)
    event["content"].update(content)
    return json.dumps(event).encode("utf-8")


@on_both_engines
class ContentHashStoreTests:
    async def flags(self, store, event_id):
        return await store.db.run_interaction(
            "flags",
            lambda t: t.execute(
                "SELECT j.censored, e.redacted FROM events AS e JOIN event_json AS j ON j.event_nid = e.event_nid"
                " JOIN event_ids AS i ON i.event_nid = e.event_nid WHERE i.event_id = ?",
                (event_id,),
            ).fetchone(),
        )

    async def test_tampered_message_is_stored_redacted_and_flagged(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join, msg = room.create(), room.join(ALICE), room.message(ALICE, "original")
        after = room.message(ALICE, "next")
        raw = tampered(msg, body="tampered")
        results = await store.persist_events(
            [room.to_persist(create), room.to_persist(join), EventToPersist(raw, "10"), room.to_persist(after)]
        )
        self.assertEqual([r.content_hash_mismatch for r in results], [False, False, True, False])
        self.assertEqual(results[2].event_id, msg.event_id)  # the reference hash covers the redacted form only
        stored = await store.get_event_json_bytes(msg.event_id)
        self.assertEqual(stored, encode_canonical_json(prune_event_dict(room.room_version, json.loads(raw))))
        self.assertNotIn(b"tampered", stored)
        self.assertEqual(await store.get_event_json_bytes(join.event_id), join.raw)  # good events: exact bytes
        event = await store.get_event(msg.event_id)
        self.assertEqual(event["content"], {})
        self.assertEqual(event["event_id"], msg.event_id)
        censored, redacted = await self.flags(store, msg.event_id)
        self.assertTrue(censored)
        self.assertFalse(redacted)
        self.assertEqual(tuple(map(bool, await self.flags(store, join.event_id))), (False, False))
        page = await store.paginate(room.room_id, ALICE, None, "b", 10)
        served = {e["event_id"]: e for e in page.events}
        self.assertEqual(served[msg.event_id]["content"], {})
        self.assertEqual(served[after.event_id]["content"]["body"], "next")

        # Sent again (good or tampered), it is already there.
        again = await store.persist_events([room.to_persist(msg)])
        self.assertTrue(again[0].already_persisted)
        self.assertEqual(await store.get_event_json_bytes(msg.event_id), stored)

    async def test_tampered_state_event_keeps_what_redaction_keeps(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        join = room.member(ALICE, "join", extra=None)
        raw = tampered(join, displayname="Mallory")
        results = await store.persist_events([room.to_persist(create), EventToPersist(raw, "10")])
        self.assertTrue(results[1].content_hash_mismatch)
        self.assertEqual(await store.get_users_in_room(room.room_id), [ALICE])
        self.assertEqual((await store.get_event(join.event_id))["content"], {"membership": "join"})

    async def test_refused_when_asked(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        await store.persist_events([room.to_persist(create)])
        with self.assertRaises(ContentHashMismatch):
            await store.persist_events(
                [EventToPersist(tampered(join, membership="leave"), "10")], refuse_hash_mismatch=True
            )
        self.assertIsNone(await store.get_event(join.event_id))
        self.assertEqual(store.get_current_token(), "s1")
