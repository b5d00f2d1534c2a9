"""Redactions applied only with authority (issue 39 item 4; the rule and its
spec sections: ``roomstore/events/write/redaction_authority.py``): the redaction's
sender has the room's ``redact`` power level in the state before it, or it
redacts its sender's own event, or (room versions 1 and 2) its event ID's
server is the target ID's server. An unauthorised redaction is stored and
served as an event, never applied, whichever of the two arrives first."""

from __future__ import annotations

from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"  # the creator
BOB = "@bob:elsewhere.org"  # power 0
MOD = "@mod:elsewhere.org"  # power 50


@on_both_engines
class RedactionAuthorityTests:
    async def room(self, store, version: str = "12", levels: bool = True):
        room = RoomBuilder(room_id="!auth:example.org", version=version, creator=ALICE)
        events = [room.create(), room.join(ALICE), room.join_rules()]
        if levels:
            events.append(room.power_levels({ALICE: 100, MOD: 50}))
        events += [room.join(BOB), room.join(MOD)]
        await store.persist_events([room.to_persist(e) for e in events])
        return room

    async def outcome(self, store, room, redactor: str, author: str, redaction_first: bool = False) -> bool:
        """Whether ``redactor``'s redaction of ``author``'s new message is applied (both stored)."""
        # Siblings, so either can be stored first.
        msg = room.message(author, f"by {author}", set_leaves=False)
        red = room.redact(redactor, msg.event_id, set_leaves=False)
        room.leaves = [msg.event_id, red.event_id]
        order = [red, msg] if redaction_first else [msg, red]
        for built in order:  # one batch each: the second finds the first stored
            await store.persist_events([room.to_persist(built)])
        served = await store.get_event(msg.event_id)
        flags = (await store.get_event_flags([msg.event_id]))[msg.event_id]
        self.assertEqual(flags.redacted, "redacted_because" in served.get("unsigned", {}))
        self.assertIsNotNone(await store.get_event(red.event_id))  # the redaction itself is stored either way
        return flags.redacted

    async def test_power_or_own_event_in_version_12(self):
        store = await self.open_store()
        room = await self.room(store)
        for first in (False, True):
            self.assertFalse(await self.outcome(store, room, BOB, ALICE, first))  # power 0, another's event
            self.assertTrue(await self.outcome(store, room, BOB, BOB, first))  # own event
            self.assertTrue(await self.outcome(store, room, MOD, BOB, first))  # redact power (50)
            self.assertTrue(await self.outcome(store, room, ALICE, MOD, first))  # a creator: infinite power

    async def test_an_unapplied_redaction_changes_no_read(self):
        store = await self.open_store()
        room = await self.room(store)
        msg = room.message(ALICE, "keep me")
        red = room.redact(BOB, msg.event_id)
        await store.persist_events([room.to_persist(msg), room.to_persist(red)])
        page = await store.paginate(room.room_id, ALICE, None, "b", 10)
        served = {e["event_id"]: e for e in page.events}
        self.assertEqual(served[msg.event_id]["content"]["body"], "keep me")
        self.assertEqual(await store.censor_expired_redactions(2**62), 0)
        self.assertIn(b"keep me", await store.get_event_json_bytes(msg.event_id))

    async def test_the_redact_level_of_the_power_levels(self):
        store = await self.open_store()
        room = RoomBuilder(room_id="!auth:example.org", version="10", creator=ALICE)
        events = [room.create(), room.join(ALICE)]
        events.append(room.state("m.room.power_levels", "", {"users": {ALICE: 100, MOD: 50}, "redact": 75}))
        events += [room.join_rules(), room.join(MOD), room.join(BOB)]
        results = await store.persist_events([room.to_persist(e) for e in events])
        self.assertEqual([r.rejected_reason for r in results], [None] * len(events))
        self.assertFalse(await self.outcome(store, room, MOD, BOB))  # 50 < 75
        self.assertTrue(await self.outcome(store, room, ALICE, BOB))

    async def test_without_power_levels_the_creator_alone(self):
        store = await self.open_store()
        room = await self.room(store, version="10", levels=False)
        self.assertTrue(await self.outcome(store, room, ALICE, BOB))  # the creator: 100
        self.assertFalse(await self.outcome(store, room, MOD, BOB))

    async def test_versions_1_and_2_by_the_servers_of_the_ids(self):
        store = await self.open_store()
        room = await self.room(store, version="1")
        # Event IDs are $...:example.org (the room's server) whoever sends them:
        # BOB's redaction of ALICE's event names the same server, as rule 11 allows.
        self.assertTrue(await self.outcome(store, room, BOB, ALICE))
        msg = room.message(ALICE, "from afar")
        red = room.build("m.room.redaction", BOB, {}, extra={"redacts": msg.event_id, "event_id": "$far:elsewhere.org"})
        await store.persist_events([room.to_persist(msg), room.to_persist(red)])
        self.assertFalse((await store.get_event_flags([msg.event_id]))[msg.event_id].redacted)
