"""What a client-server front needs of the store (issue 41 item 2): client
transaction IDs recorded with their events, and a user's rooms by
membership, out-of-band invites included."""

from __future__ import annotations

import pickle

from twisted.trial import unittest

from roomstore.events.read.user_rooms import RoomMembership
from roomstore.events.tables.client_txns import delete_room_txns_txn
from roomstore.events.write.persist import ClientTxn, EventToPersist, PersistedEvent
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
REMOTE = "@rita:remote.example"


class Helpers:
    async def open_store(self) -> RoomStore:
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        return store

    async def new_room(self, store, name: str, join_rule: str = "public") -> RoomBuilder:
        room = RoomBuilder(room_id=f"!{name}:example.org")
        await store.persist_events(
            [
                room.to_persist(e)
                for e in (
                    room.create(),
                    room.join(ALICE),
                    room.join_rules(join_rule),
                    room.history_visibility("shared"),
                )
            ]
        )
        return room


@on_both_engines
class ClientTxnTests(Helpers):
    async def test_recorded_with_its_event_and_found_per_user_and_device(self):
        store = await self.open_store()
        room = await self.new_room(store, "txn")
        hello = room.message(ALICE, "hello")
        [result] = await store.persist_events([room.to_persist(hello, client_txn=ClientTxn(ALICE, "DEVICE1", "m1"))])
        self.assertIsNone(result.existing_txn_event_id)
        self.assertEqual(await store.get_event_id_for_txn(ALICE, "DEVICE1", "m1"), hello.event_id)
        # The key is the user, the device and the txn ID together.
        self.assertIsNone(await store.get_event_id_for_txn(ALICE, "DEVICE2", "m1"))
        self.assertIsNone(await store.get_event_id_for_txn(ALICE, "DEVICE1", "m2"))
        self.assertIsNone(await store.get_event_id_for_txn(BOB, "DEVICE1", "m1"))
        self.assertIsNone(await store.get_event_id_for_txn("@nobody:example.org", "D", "m1"))

    async def test_a_second_event_of_a_recorded_txn_is_stored_and_told_the_first(self):
        store = await self.open_store()
        room = await self.new_room(store, "retry")
        txn = ClientTxn(ALICE, "DEVICE1", "m1")
        first, retry = room.message(ALICE, "hello"), room.message(ALICE, "hello again")
        await store.persist_events([room.to_persist(first, client_txn=txn)])
        [result] = await store.persist_events([room.to_persist(retry, client_txn=txn)])
        self.assertEqual(result.existing_txn_event_id, first.event_id)
        self.assertFalse(result.already_persisted)
        self.assertIsNotNone(await store.get_event(retry.event_id))  # stored all the same
        self.assertEqual(await store.get_event_id_for_txn(ALICE, "DEVICE1", "m1"), first.event_id)
        # Two events of one txn in one batch: the first is recorded.
        one, two = room.message(ALICE, "one"), room.message(ALICE, "two")
        other = ClientTxn(ALICE, "DEVICE1", "m2")
        results = await store.persist_events([room.to_persist(e, client_txn=other) for e in (one, two)])
        self.assertEqual([r.existing_txn_event_id for r in results], [None, one.event_id])
        self.assertEqual(await store.get_event_id_for_txn(ALICE, "DEVICE1", "m2"), one.event_id)
        # An event stored before is a no-op: nothing recorded for it.
        [again] = await store.persist_events([room.to_persist(one, client_txn=ClientTxn(ALICE, "D", "m3"))])
        self.assertTrue(again.already_persisted)
        self.assertIsNone(await store.get_event_id_for_txn(ALICE, "D", "m3"))

    async def test_a_rejected_event_records_nothing(self):
        store = await self.open_store()
        room = await self.new_room(store, "rejected")
        intruder = room.message(BOB, "not a member", set_leaves=False)
        [result] = await store.persist_events([room.to_persist(intruder, client_txn=ClientTxn(BOB, "D", "t"))])
        self.assertIsNotNone(result.rejected_reason)
        self.assertIsNone(await store.get_event_id_for_txn(BOB, "D", "t"))

    async def test_the_sending_device_gets_its_transaction_id_in_the_client_format(self):
        store = await self.open_store()
        room = await self.new_room(store, "echo")
        mine, other_device, untracked = room.message(ALICE, "a"), room.message(ALICE, "b"), room.message(ALICE, "c")
        await store.persist_events(
            [
                room.to_persist(mine, client_txn=ClientTxn(ALICE, "PHONE", "t1")),
                room.to_persist(other_device, client_txn=ClientTxn(ALICE, "LAPTOP", "t2")),
                room.to_persist(untracked),
            ]
        )
        served = await store.get_events([e.event_id for e in (mine, other_device, untracked)])
        events = [served[e.event_id] for e in (mine, other_device, untracked)]
        txn_ids = lambda formatted: [e["unsigned"].get("transaction_id") for e in formatted]  # noqa: E731
        self.assertEqual(
            txn_ids(await store.format_client_events(events, 0, sent_by=(ALICE, "PHONE"))), ["t1", None, None]
        )
        self.assertEqual(
            txn_ids(await store.format_client_events(events, 0, sent_by=(ALICE, "LAPTOP"))), [None, "t2", None]
        )
        # Another user, or no device named: nobody's transaction IDs.
        self.assertEqual(txn_ids(await store.format_client_events(events, 0, sent_by=(BOB, "PHONE"))), [None] * 3)
        self.assertEqual(txn_ids(await store.format_client_events(events, 0)), [None] * 3)
        self.assertNotIn("transaction_id", served[mine.event_id].get("unsigned", {}))  # the served event untouched

    async def test_rows_are_deletable_by_room(self):
        store = await self.open_store()
        kept, purged = await self.new_room(store, "kept"), await self.new_room(store, "purged")
        for room in (kept, purged):
            await store.persist_events(
                [room.to_persist(room.message(ALICE, "x"), client_txn=ClientTxn(ALICE, "D", room.room_id))]
            )
        nids = await store.db.run_interaction("nids", lambda txn: store.interners.rooms.lookup(txn, [purged.room_id]))
        deleted = await store.db.run_interaction("purge", delete_room_txns_txn, list(nids.values()))
        self.assertEqual(deleted, 1)
        self.assertIsNone(await store.get_event_id_for_txn(ALICE, "D", purged.room_id))
        self.assertIsNotNone(await store.get_event_id_for_txn(ALICE, "D", kept.room_id))


class ClientTxnValueTests(unittest.TestCase):
    def test_pickled_with_the_event_and_the_result(self):
        txn = ClientTxn(ALICE, "DEVICE", "t1")
        event = EventToPersist(b"{}", "10", client_txn=txn)
        self.assertEqual(pickle.loads(pickle.dumps(event)), event)
        result = PersistedEvent("$e", "!r:x", 3, 2, 1, 2, existing_txn_event_id="$first")
        self.assertEqual(pickle.loads(pickle.dumps(result)), result)

    def test_fields_are_strings(self):
        self.assertRaises(TypeError, ClientTxn, ALICE, None, "t1")
        self.assertRaises(TypeError, EventToPersist, b"{}", "10", client_txn=("a", "b", "c"))


@on_both_engines
class RoomsByMembershipTests(Helpers):
    async def test_current_membership_per_room_with_out_of_band_invites(self):
        store = await self.open_store()
        joined, invited = await self.new_room(store, "joined"), await self.new_room(store, "invited")
        left, banned = await self.new_room(store, "left"), await self.new_room(store, "banned")
        knocked = await self.new_room(store, "knocked", "knock")
        events = {}
        for room in (joined, left, banned):
            await store.persist_events([room.to_persist(room.join(BOB))])
        for room, event in (
            (joined, joined.message(BOB, "hi")),
            (invited, invited.member(BOB, "invite", sender=ALICE)),
            (left, left.member(BOB, "leave", sender=BOB)),
            (banned, banned.member(BOB, "ban", sender=ALICE)),
            (knocked, knocked.member(BOB, "knock", sender=BOB)),
        ):
            [result] = await store.persist_events([room.to_persist(event)])
            self.assertIsNone(result.rejected_reason)
            events[room.room_id] = (event.event_id, result.stream_ordering)
        join_id = (await store.get_current_state_ids(joined.room_id, [("m.room.member", BOB)]))[("m.room.member", BOB)]

        # An invite over federation to a room this server is not in: an outlier.
        remote = RoomBuilder(room_id="!remote:remote.example", creator=REMOTE)
        remote.create(), remote.join(REMOTE), remote.join_rules("invite")
        oob_invite = remote.member(BOB, "invite", sender=REMOTE)
        [oob] = await store.persist_events([remote.to_persist(oob_invite, outlier=True)])

        def rows(found):
            return [(m.room_id, m.membership, m.event_id) for m in found]

        invites = await store.get_rooms_for_user_by_membership(BOB, ["invite"])
        self.assertEqual(
            rows(invites),
            [
                (invited.room_id, "invite", events[invited.room_id][0]),
                (remote.room_id, "invite", oob_invite.event_id),
            ],
        )
        self.assertEqual(invites[1], RoomMembership(remote.room_id, "invite", oob_invite.event_id, oob.stream_ordering))
        self.assertEqual(
            rows(await store.get_rooms_for_user_by_membership(BOB, {"join"})), [(joined.room_id, "join", join_id)]
        )
        self.assertEqual(
            set(rows(await store.get_rooms_for_user_by_membership(BOB, ("leave", "ban", "knock")))),
            {
                (left.room_id, "leave", events[left.room_id][0]),
                (banned.room_id, "ban", events[banned.room_id][0]),
                (knocked.room_id, "knock", events[knocked.room_id][0]),
            },
        )
        everything = await store.get_rooms_for_user_by_membership(BOB, ["invite", "join", "leave", "ban", "knock"])
        self.assertEqual(len(everything), 6)
        self.assertEqual([m.stream_ordering for m in everything], sorted(m.stream_ordering for m in everything))
        self.assertEqual(await store.get_rooms_for_user_by_membership(BOB, []), [])
        self.assertEqual(await store.get_rooms_for_user_by_membership("@nobody:example.org", ["join"]), [])

        # Rejecting the out-of-band invite (another outlier) makes it a leave.
        reject = remote.member(BOB, "leave", sender=BOB)
        await store.persist_events([remote.to_persist(reject, outlier=True)])
        self.assertEqual(
            rows(await store.get_rooms_for_user_by_membership(BOB, ["invite"])),
            [(invited.room_id, "invite", events[invited.room_id][0])],
        )
        self.assertIn(
            (remote.room_id, "leave", reject.event_id),
            rows(await store.get_rooms_for_user_by_membership(BOB, ["leave"])),
        )

    async def test_unknown_memberships_are_refused(self):
        store = await self.open_store()
        with self.assertRaises(ValueError) as caught:
            await store.get_rooms_for_user_by_membership(BOB, ["joined"])
        self.assertIn("unknown membership 'joined'", str(caught.exception))
        with self.assertRaises(ValueError):
            await store.get_rooms_for_user_by_membership(BOB, "invite")
