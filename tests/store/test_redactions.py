"""Redactions: flagging in either arrival order, pruned reads, and censoring
the stored bytes once the retention period has passed (on demand and by the
periodic job, driven by a ``Clock``).

Also the contract censoring relies on: until then, the stored bytes are
exactly the bytes received (``EventBytesTests``).
"""

from __future__ import annotations

import json
import time

from canonicaljson import encode_canonical_json
from signedjson.key import generate_signing_key, get_verify_key
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from twisted.internet.task import Clock

from roomstore.pdu.hashing import compute_content_hash, compute_event_id
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import get_room_version
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.builder import BuiltEvent, RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
RETENTION_MS = 60_000


def _signed_message(room: RoomBuilder, key, body: str) -> BuiltEvent:
    """A message signed the way servers sign PDUs: over the pruned event."""
    version = room.room_version
    event = {
        "auth_events": room.auth_events_for("m.room.message", ALICE),
        "content": {"msgtype": "m.text", "body": body},
        "depth": max(room.depth_of.values()) + 1,
        "origin": "example.org",
        "origin_server_ts": room.clock + 1000,
        "prev_events": list(room.leaves),
        "room_id": room.room_id,
        "sender": ALICE,
        "type": "m.room.message",
    }
    event["hashes"] = {"sha256": compute_content_hash(event)}
    signed_pruned = sign_json(prune_event_dict(version, event), "example.org", key)
    event["signatures"] = signed_pruned["signatures"]
    event_id = compute_event_id(version, event)
    room.clock += 1000
    return room.add_built(BuiltEvent(event_id, json.dumps(event).encode("utf-8"), event))


@on_both_engines
class RedactionTests:
    async def open_store(self, config: StoreConfig | None = None, **kw) -> RoomStore:
        db = await self.make_database()
        store = await RoomStore.open(db, config or StoreConfig(redaction_retention_ms=RETENTION_MS), **kw)
        self.addCleanup(store.close)
        return store

    async def flags(self, store: RoomStore, *events: BuiltEvent) -> list[bool]:
        def txn_fn(txn):
            out = []
            for ev in events:
                row = txn.execute(
                    "SELECT e.redacted FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
                    " WHERE i.event_id = ?",
                    (ev.event_id,),
                ).fetchone()
                out.append(None if row is None else bool(row[0]))
            return out

        return await store.db.run_interaction("flags", txn_fn)

    async def censor_state(self, store: RoomStore, target: BuiltEvent) -> tuple[bool, list[bool]]:
        """(event_json.censored of target, have_censored of each redaction of it)."""

        def txn_fn(txn):
            nid = txn.select_one_value("SELECT event_nid FROM event_ids WHERE event_id = ?", (target.event_id,))
            censored = txn.select_one_value("SELECT censored FROM event_json WHERE event_nid = ?", (nid,))
            marks = [
                bool(r[0])
                for r in txn.execute(
                    "SELECT have_censored FROM redactions WHERE redacts_event_nid = ? ORDER BY redaction_event_nid",
                    (nid,),
                ).fetchall()
            ]
            return bool(censored), marks

        return await store.db.run_interaction("censor_state", txn_fn)

    async def received_ts(self, store: RoomStore, redaction: BuiltEvent) -> int:
        return await store.db.run_interaction(
            "received",
            lambda t: t.select_one_value(
                "SELECT r.received_ts FROM redactions AS r JOIN event_ids AS i ON i.event_nid = r.redaction_event_nid"
                " WHERE i.event_id = ?",
                (redaction.event_id,),
            ),
        )

    async def start_room(
        self, store: RoomStore, version: str = "10", room_id: str = "!room:example.org"
    ) -> RoomBuilder:
        room = RoomBuilder(room_id=room_id, version=version)
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE), room.join_rules())])
        return room

    # ------------------------------------------------------------------ flagging

    async def test_same_batch(self):
        store = await self.open_store()
        room = await self.start_room(store)
        msg = room.message(ALICE, "oops")
        red = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(red), room.to_persist(msg)])
        self.assertEqual(await self.flags(store, msg, red), [True, False])

    async def test_redaction_first_target_later(self):
        store = await self.open_store()
        room = await self.start_room(store)
        join_id = room.leaves[0]
        msg = room.message(ALICE, "late", prev=[join_id])
        red = room.redact(ALICE, msg.event_id, prev=[join_id])
        await store.persist_events([room.to_persist(red)])
        self.assertEqual(await self.flags(store, msg, red), [None, False])
        # The redaction alone is served as it is; nothing else is touched.
        self.assertNotIn("redacted_because", (await store.get_event(red.event_id)).get("unsigned", {}))
        await store.persist_events([room.to_persist(msg)])
        self.assertEqual(await self.flags(store, msg, red), [True, False])
        served = await store.get_event(msg.event_id)
        self.assertEqual(served["content"], {})
        self.assertEqual(served["unsigned"]["redacted_because"]["event_id"], red.event_id)

    async def test_target_first_redaction_later_invalidates_cache(self):
        store = await self.open_store()
        room = await self.start_room(store)
        msg = room.message(ALICE, "cached")
        await store.persist_events([room.to_persist(msg)])
        self.assertEqual((await store.get_event(msg.event_id))["content"]["body"], "cached")  # now cached
        red = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(red)])
        self.assertEqual(await self.flags(store, msg), [True])
        self.assertEqual((await store.get_event(msg.event_id))["content"], {})

    async def test_redaction_from_another_room_does_not_redact(self):
        store = await self.open_store()
        room = await self.start_room(store)
        other = await self.start_room(store, room_id="!other:example.org")
        msg = room.message(ALICE, "mine")
        await store.persist_events([room.to_persist(msg)])
        foreign = other.redact(ALICE, msg.event_id)
        await store.persist_events([other.to_persist(foreign)])
        self.assertEqual(await self.flags(store, msg), [False])
        self.assertEqual((await store.get_event(msg.event_id))["content"]["body"], "mine")
        # Nor when the foreign redaction arrives first.
        msg2 = room.message(ALICE, "mine too", prev=[room.leaves[0]])
        foreign2 = other.redact(ALICE, msg2.event_id)
        await store.persist_events([other.to_persist(foreign2)])
        await store.persist_events([room.to_persist(msg2)])
        self.assertEqual(await self.flags(store, msg2), [False])
        self.assertEqual((await store.get_event(msg2.event_id))["content"]["body"], "mine too")
        # And censoring never touches it.
        far_future = int(time.time() * 1000) + 10 * RETENTION_MS
        self.assertEqual(await store.censor_expired_redactions(far_future), 0)
        self.assertEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)

    # ------------------------------------------------------------------ reads

    async def _check_pruned_read(self, version: str):
        store = await self.open_store()
        room = await self.start_room(store, version=version)
        msg = room.message(ALICE, "secret")
        topic = room.state("m.room.topic", "", {"topic": "hidden"})
        member = room.build("m.room.member", BOB, {"membership": "join", "displayname": "Bob"}, BOB)
        red_msg = room.redact(ALICE, msg.event_id)
        red_topic = room.redact(ALICE, topic.event_id)
        red_member = room.redact(ALICE, member.event_id)
        batch = [msg, topic, member, red_msg, red_topic, red_member]
        await store.persist_events([room.to_persist(e) for e in batch])
        served = await store.get_events([msg.event_id, topic.event_id, member.event_id])
        for target, redaction in ((msg, red_msg), (topic, red_topic), (member, red_member)):
            event = served[target.event_id]
            self.assertEqual(event["event_id"], target.event_id)
            because = event["unsigned"]["redacted_because"]
            self.assertEqual(because["event_id"], redaction.event_id)
            self.assertEqual(because["type"], "m.room.redaction")
            if version == "11":
                self.assertEqual(because["content"]["redacts"], target.event_id)
                self.assertNotIn("redacts", because)
            else:
                self.assertEqual(because["redacts"], target.event_id)
        self.assertEqual(served[msg.event_id]["content"], {})
        self.assertEqual(served[topic.event_id]["content"], {})
        self.assertEqual(served[member.event_id]["content"], {"membership": "join"})
        # Everything the spec keeps is kept.
        for key in ("sender", "room_id", "type", "depth", "prev_events", "hashes", "signatures"):
            self.assertEqual(served[msg.event_id][key], msg.event[key])
        # The redactions themselves are not redacted.
        self.assertEqual((await store.get_event(red_msg.event_id))["content"]["reason"], "spam")

    async def test_pruned_read_v10(self):
        await self._check_pruned_read("10")

    async def test_pruned_read_v11(self):
        await self._check_pruned_read("11")

    # ------------------------------------------------------------------ censoring

    async def _check_original_until_retention(self, version: str):
        store = await self.open_store()
        room = await self.start_room(store, version=version)
        key = generate_signing_key("a1")
        msg = _signed_message(room, key, "keep me for a while")
        red = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(msg), room.to_persist(red)])
        received = await self.received_ts(store, red)
        pruned = await store.get_event(msg.event_id)
        # Before (and exactly at) the retention: the original is still there.
        for now in (received, received + RETENTION_MS - 1, received + RETENTION_MS):
            self.assertEqual(await store.censor_expired_redactions(now), 0)
            self.assertEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)
            original = (await store.get_events([msg.event_id], redact=False))[msg.event_id]
            self.assertEqual(original["content"]["body"], "keep me for a while")
            self.assertNotIn("unsigned", original)
            self.assertEqual(await self.censor_state(store, msg), (False, [False]))
        # Once it has passed: the bytes are the canonical pruned event.
        self.assertEqual(await store.censor_expired_redactions(received + RETENTION_MS + 1), 1)
        stored = await store.get_event_json_bytes(msg.event_id)
        self.assertEqual(stored, encode_canonical_json(prune_event_dict(get_room_version(version), msg.event)))
        self.assertNotIn(b"keep me", stored)
        self.assertEqual(await self.censor_state(store, msg), (True, [True]))
        # Still the same event: its ID and (pruned-form) signature hold.
        censored = json.loads(stored)
        self.assertEqual(compute_event_id(get_room_version(version), censored), msg.event_id)
        verify_signed_json(censored, "example.org", get_verify_key(key))
        self.assertEqual((await store.get_events([msg.event_id], redact=False))[msg.event_id]["content"], {})
        # The served (redacted) form is unchanged by censoring.
        self.assertEqual(await store.get_event(msg.event_id), pruned)
        # Idempotent.
        self.assertEqual(await store.censor_expired_redactions(received + 10 * RETENTION_MS), 0)

    async def test_original_until_retention_v10(self):
        await self._check_original_until_retention("10")

    async def test_original_until_retention_v11(self):
        await self._check_original_until_retention("11")

    async def test_signature_of_original_does_not_cover_censored_bytes(self):
        # Sanity of the helper above: signing the whole event (not the pruned
        # form) would not survive censoring, so the check there means something.
        key = generate_signing_key("a1")
        event = {"type": "m.room.message", "content": {"body": "x"}, "room_id": "!r:example.org"}
        signed = sign_json(dict(event), "example.org", key)
        pruned = prune_event_dict(get_room_version("10"), signed)
        with self.assertRaises(SignatureVerifyException):
            verify_signed_json(pruned, "example.org", get_verify_key(key))

    async def test_censor_counts_each_event_once_and_batches(self):
        from roomstore.events import censor

        store = await self.open_store()
        room = await self.start_room(store)
        msgs = [room.message(ALICE, f"m{i}") for i in range(7)]
        twice = msgs[0]
        reds = [room.redact(ALICE, m.event_id) for m in msgs] + [room.redact(ALICE, twice.event_id)]
        await store.persist_events([room.to_persist(e) for e in msgs + reds])
        received = max([await self.received_ts(store, r) for r in reds])
        self.patch(censor, "BATCH_SIZE", 3)  # several transactions
        self.assertEqual(await store.censor_expired_redactions(received + RETENTION_MS + 1), 7)
        self.assertEqual(await self.censor_state(store, twice), (True, [True, True]))
        for m in msgs:
            self.assertNotIn(m.event["content"]["body"].encode(), await store.get_event_json_bytes(m.event_id))

    async def test_target_arriving_after_an_old_redaction(self):
        store = await self.open_store()
        room = await self.start_room(store)
        join_id = room.leaves[0]
        msg = room.message(ALICE, "late", prev=[join_id])
        red = room.redact(ALICE, msg.event_id, prev=[join_id])
        await store.persist_events([room.to_persist(red)])
        received = await self.received_ts(store, red)
        later = received + RETENTION_MS + 1
        self.assertEqual(await store.censor_expired_redactions(later), 0)  # nothing to censor yet
        await store.persist_events([room.to_persist(msg)])
        self.assertEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)
        # The retention counts from the redaction, as in Synapse.
        self.assertEqual(await store.censor_expired_redactions(later), 1)
        self.assertNotEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)

    async def test_periodic_job_on_a_clock(self):
        clock = Clock()
        clock.advance(time.time())
        interval_ms = 1_000
        store = await self.open_store(
            StoreConfig(redaction_retention_ms=RETENTION_MS, censor_interval_ms=interval_ms), clock=clock
        )
        job = store._censor_job
        # The events arrive a moment after the store opened (the store takes
        # received_ts from the same clock).
        clock.advance(0.1)
        room = await self.start_room(store)
        msg = room.message(ALICE, "wait for it")
        red = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(msg), room.to_persist(red)])
        cached = await store.get_events([msg.event_id])
        received = await self.received_ts(store, red)

        async def advance_to(ms: int) -> None:
            clock.advance(ms / 1000 - clock.seconds())
            await job.wait_idle()

        # Runs before the retention passed censor nothing.
        await advance_to(received + interval_ms)
        await advance_to(received + RETENTION_MS - 5)  # float clock: stay clear of the boundary
        self.assertGreaterEqual(job.runs, 2)
        self.assertEqual(job.censored, 0)
        self.assertEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)
        # The first run after it censors.
        await advance_to(received + RETENTION_MS + interval_ms)
        self.assertEqual(job.censored, 1)
        self.assertNotEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)
        self.assertEqual(await self.censor_state(store, msg), (True, [True]))
        # The event cache was invalidated (a fresh dict is read back) and
        # still serves the same redacted event.
        again = await store.get_events([msg.event_id])
        self.assertIsNot(again[msg.event_id], cached[msg.event_id])
        self.assertEqual(again, cached)
        # Closing stops the loop.
        await store.close()
        self.assertFalse(job._loop.running)

    async def test_timestamps_and_now_come_from_the_store_clock(self):
        # A clock far from the wall clock: received_ts is the clock's, and
        # censoring without an explicit now measures against the clock.
        clock = Clock()
        clock.advance(1_000_000)
        store = await self.open_store(clock=clock)
        room = await self.start_room(store)
        msg = room.message(ALICE, "clocked")
        red = room.redact(ALICE, msg.event_id)
        await store.persist_events([room.to_persist(msg), room.to_persist(red)])
        self.assertEqual(await self.received_ts(store, red), 1_000_000_000)
        clock.advance(RETENTION_MS / 1000)
        self.assertEqual(await store.censor_expired_redactions(), 0)  # exactly the retention: not yet
        clock.advance(0.002)
        self.assertEqual(await store.censor_expired_redactions(), 1)
        self.assertNotEqual(await store.get_event_json_bytes(msg.event_id), msg.raw)

    async def test_no_job_by_default(self):
        store = await self.open_store()
        self.assertIsNone(store._censor_job)


def _odd_bytes(room: RoomBuilder) -> tuple[bytes, dict]:
    """A valid v10 PDU serialised unusually: keys in reverse order, odd
    whitespace, ``\\/`` and ``\\u00e9`` escapes and a ``\\u0000`` in content."""
    event = {
        "auth_events": room.auth_events_for("m.room.message", ALICE),
        "content": {"msgtype": "m.text", "body": "caf\u00e9 a/b \u0000 end", "nested": {"z": 1, "a": [1, 2]}},
        "depth": max(room.depth_of.values()) + 1,
        "origin": "example.org",
        "origin_server_ts": room.clock + 1000,
        "prev_events": list(room.leaves),
        "room_id": room.room_id,
        "sender": ALICE,
        "type": "m.room.message",
    }
    event["hashes"] = {"sha256": compute_content_hash(event)}
    event["signatures"] = {"example.org": {"ed25519:a": "c2lnbmF0dXJl"}}
    reordered = dict(reversed(list(event.items())))
    text = json.dumps(reordered, ensure_ascii=True, indent="\t", separators=(" ,", " :  "))
    text = text.replace("a/b", "a\\/b")
    raw = ("\r\n  " + text + " \n").encode("utf-8")
    return raw, event


@on_both_engines
class EventBytesTests:
    async def test_odd_serialisation_round_trips_exactly(self):
        store = await self.open_store()
        room = RoomBuilder()
        await store.persist_events([room.to_persist(room.create()), room.to_persist(room.join(ALICE))])
        raw, event = _odd_bytes(room)
        for needle in (b"\\u00e9", b"\\u0000", b"a\\/b", b"\t", b"\r\n", b'"type" :  "m.room.message" ,'):
            self.assertIn(needle, raw)
        self.assertLess(raw.index(b'"type"'), raw.index(b'"auth_events"'))
        event_id = compute_event_id(room.room_version, event)
        [result] = await store.persist_events([room.to_persist(BuiltEvent(event_id, raw, event))])
        self.assertEqual(result.event_id, event_id)
        self.assertEqual(await store.get_event_json_bytes(event_id), raw)
        served = await store.get_event(event_id)
        self.assertEqual(served["content"]["body"], "caf\u00e9 a/b \u0000 end")
        self.assertEqual({k: v for k, v in served.items() if k != "event_id"}, event)

    async def test_signed_event_verifies_after_round_trip(self):
        store = await self.open_store()
        room = RoomBuilder()
        await store.persist_events([room.to_persist(room.create()), room.to_persist(room.join(ALICE))])
        key = generate_signing_key("a1")
        event = {
            "auth_events": room.auth_events_for("m.room.message", ALICE),
            "content": {"msgtype": "m.text", "body": "signed \u00e9\u0000"},
            "depth": max(room.depth_of.values()) + 1,
            "origin": "example.org",
            "origin_server_ts": room.clock + 1000,
            "prev_events": list(room.leaves),
            "room_id": room.room_id,
            "sender": ALICE,
            "type": "m.room.message",
        }
        event["hashes"] = {"sha256": compute_content_hash(event)}
        # Build, sign, then compute the ID (v10 IDs hash the pruned event,
        # signatures included in neither).
        signed = sign_json(event, "example.org", key)
        event_id = compute_event_id(room.room_version, signed)
        raw = json.dumps(signed, indent=1).encode("utf-8")
        [result] = await store.persist_events([room.to_persist(BuiltEvent(event_id, raw, signed))])
        self.assertEqual(result.event_id, event_id)
        stored = await store.get_event_json_bytes(event_id)
        self.assertEqual(stored, raw)
        verify_signed_json(json.loads(stored), "example.org", get_verify_key(key))
        # The served dict carries event_id, which the signature does not cover.
        served = await store.get_event(event_id)
        self.assertEqual(served.pop("event_id"), event_id)
        verify_signed_json(served, "example.org", get_verify_key(key))
        # A flipped byte of content would not verify: the check is real.
        tampered = json.loads(stored)
        tampered["content"]["body"] = "signed e"
        with self.assertRaises(SignatureVerifyException):
            verify_signed_json(tampered, "example.org", get_verify_key(key))
