"""Traps a new user hit when persisting (issue 11): stream IDs spent on
events already stored or on events the store refuses, an event given twice
counted twice, and a room started by an event that is not its create event."""

from __future__ import annotations

import os
import tempfile

from roomstore.cli.import_loop import import_file
from roomstore.events.write.persist import MissingStateError
from roomstore.pdu.parsing import InvalidEventError
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id, pure_resolution, skip_precheck

ALICE = "@alice:example.org"


@on_both_engines
class PersistTrapTests:
    async def test_stored_events_take_no_stream_ids(self):
        store = await self.open_store()
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE), room.message(ALICE, "one")]
        await store.persist_events([room.to_persist(e) for e in events])
        self.assertEqual(store.get_current_token(), "s3")
        again = await store.persist_events([room.to_persist(e) for e in events])
        self.assertTrue(all(r.already_persisted for r in again))
        self.assertEqual(store.get_current_token(), "s3")
        # A batch mixing stored and new events takes IDs for the new ones only.
        more = room.message(ALICE, "two")
        results = await store.persist_events([room.to_persist(events[2]), room.to_persist(more)])
        self.assertEqual([r.already_persisted for r in results], [True, False])
        self.assertEqual(results[1].stream_ordering, 4)
        self.assertEqual(store.get_current_token(), "s4")

    async def test_refused_events_take_no_stream_ids(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        # Two branches from the join both set the topic (a fork: stored, its
        # state resolved); an event whose prev event nobody has (refused),
        # and one after the fork's first branch.
        t1 = room.state("m.room.topic", "", {"topic": "a"}, prev=[join.event_id])
        t2 = room.state("m.room.topic", "", {"topic": "b"}, prev=[join.event_id])
        orphan = room.message(ALICE, "orphan", prev=[fake_event_id("nobody has it")], set_leaves=False)
        last = room.message(ALICE, "last", prev=[t1.event_id])
        events = [create, join, t1, t2, orphan, last]
        path = os.path.join(tempfile.mkdtemp(), "refused.jsonl")
        self.addCleanup(os.remove, path)
        with open(path, "wb") as handle:
            handle.write(b"".join(e.raw + b"\n" for e in events))
        summary = await import_file(store, path)
        self.assertEqual((summary["imported"], summary["failed"]), (5, 1))
        # Five events stored, five stream IDs spent: none on the orphan, not
        # in the failing batch nor in the importer's event-by-event retry.
        self.assertEqual(store.get_current_token(), "s5")
        again = await import_file(store, path)
        self.assertEqual((again["already_present"], again["failed"]), (5, 1))
        self.assertEqual(store.get_current_token(), "s5")
        # The error is the write's, raised before any reservation.
        with self.assertRaises(MissingStateError):
            await store.persist_events([room.to_persist(orphan)])
        self.assertEqual(store.get_current_token(), "s5")
        # A trial run leaves nothing behind: the refused event was never stored.
        count = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        self.assertEqual(count, 5)

    async def test_the_write_checks_again_after_the_precheck(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        await store.persist_events([room.to_persist(e) for e in (create, join)])
        orphan = room.message(ALICE, "orphan", prev=[fake_event_id("nobody has it")])
        # A precheck that misses the missing prev event, as when another
        # writer changes the room between the look and the write: the write
        # refuses it.
        skip_precheck(store)
        with self.assertRaises(MissingStateError):
            await store.persist_events([room.to_persist(orphan)])
        stored = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        self.assertEqual(stored, 2)
        # That race spends the event's ID (a gap, 3): dropped, not counted
        # complete, and the stream is not stuck.
        self.assertEqual(store.events_stream.get_unfinished(), [])
        self.assertEqual(store.get_current_token(), "s2")
        async with store.events_stream.get_next() as next_id:
            self.assertEqual(next_id, 4)
        self.assertEqual(store.get_current_token(), "s4")

    async def test_a_given_whole_state_needs_no_trial_run(self):
        """A merge whose branches conflict, given its state before as a whole
        map (as import-synapse gives Synapse's), is written once: the
        precheck takes the given state for the derived one. A fork of new
        ends needs no trial run either: its states are resolved."""
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        t1 = room.state("m.room.topic", "", {"topic": "a"}, prev=[join.event_id])
        t2 = room.state("m.room.topic", "", {"topic": "b"}, prev=[join.event_id])
        merge = room.message(ALICE, "merge", prev=[t1.event_id, t2.event_id])
        await store.persist_events([room.to_persist(e) for e in (create, join, t1)])
        state = await store.get_state_ids(t1.event_id)
        undone = []
        original = store.db.run_interaction

        def run_interaction(description, fn, *args, **kwargs):
            if description == "persist_events":
                txn_undone = []

                def counting(txn, *a, **kw):
                    real = txn.undone
                    txn.undone = lambda *u, **k: (txn_undone.append(u), real(*u, **k))[1]
                    return fn(txn, *a, **kw)

                undone.append(txn_undone)
                return original(description, counting, *args, **kwargs)
            return original(description, fn, *args, **kwargs)

        store.db.run_interaction = run_interaction
        resolved = {**state, ("m.room.topic", ""): t2.event_id}
        results = await store.persist_events(
            [room.to_persist(t2), room.to_persist(merge, state_before=resolved)], {room.room_id: resolved}
        )
        self.assertEqual([r.stream_ordering for r in results], [4, 5])
        self.assertEqual(undone, [[]])  # the precheck ran no trial write
        self.assertEqual(await store.get_state_ids(merge.event_id, before=True), resolved)
        self.assertEqual(await store.get_current_state_ids(room.room_id), resolved)
        # Two new conflicting ends, no resolved current state given: written
        # once too, the room's current state resolved.
        t3 = room.state("m.room.topic", "", {"topic": "c"}, prev=[merge.event_id])
        t4 = room.state("m.room.topic", "", {"topic": "d"}, prev=[merge.event_id], set_leaves=False)
        results = await store.persist_events([room.to_persist(t3), room.to_persist(t4, state_before=resolved)])
        self.assertEqual([r.stream_ordering for r in results], [6, 7])
        self.assertEqual(undone[-1], [])
        current = await store.get_current_state_ids(room.room_id)
        states = [await store.get_state_ids(t.event_id) for t in (t3, t4)]
        self.assertEqual(current, pure_resolution(room, states))

    async def test_an_event_twice_in_a_batch_is_stored_once(self):
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        results = await store.persist_events([room.to_persist(e) for e in (create, join, join)])
        self.assertEqual([r.already_persisted for r in results], [False, False, True])
        self.assertEqual(results[1].stream_ordering, results[2].stream_ordering)
        self.assertEqual(store.get_current_token(), "s2")
        count = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM events"))
        self.assertEqual(count, 2)

    async def test_no_prev_events_in_an_unknown_room_is_refused(self):
        store = await self.open_store()
        room = RoomBuilder("!nocreate:example.org")
        orphan = room.message(ALICE, "where is the create event?")
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events([room.to_persist(orphan)])
        self.assertIn("unknown", str(caught.exception))
        rooms = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM rooms"))
        self.assertEqual(rooms, 0)
        self.assertEqual(store.get_current_token(), "s0")
        # Flagged an outlier, it is accepted (it arrived by federation).
        [result] = await store.persist_events([room.to_persist(orphan, outlier=True)])
        self.assertFalse(result.already_persisted)

    async def test_create_event_later_in_the_batch_starts_the_room(self):
        store = await self.open_store()
        room = RoomBuilder()
        create = room.create()
        topic = room.state("m.room.topic", "", {"topic": "t"}, prev=[])
        results = await store.persist_events([room.to_persist(topic), room.to_persist(create)])
        self.assertEqual(len(results), 2)

    async def test_a_second_batch_in_one_transaction_is_refused_whole(self):
        """``persist_txn`` writes one batch per transaction (the IDs the
        transaction interned name no stored event only then): a second is an
        error, and the transaction leaves nothing."""
        store = await self.open_store()
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        await store.persist_events([room.to_persist(create), room.to_persist(join)])
        message = room.message(ALICE, "once")
        first_batch = []

        def precheck_that_writes(txn, persister, events, resolved):
            first_batch.extend(events)
            persister.persist_txn(txn, events, [10**9], [], resolved)
            return {}

        store.writes.precheck = precheck_that_writes
        with self.assertRaises(RuntimeError) as raised:
            await store.persist_events([room.to_persist(message)])
        self.assertIn("one batch per transaction", str(raised.exception))
        self.assertEqual([ev.event_id for ev in first_batch], [message.event_id])
        self.assertEqual(await store.get_event(message.event_id), None)
        self.assertEqual(store.get_current_token(), "s2")
