"""Group commit (``WriteTurns.take_followers``, ``write_in_group``): calls
validated while an earlier call writes are written in one transaction by the
first of them whose turn comes, and every call gets what a one-call-at-a-time
writer would have given it: its results, or its own refusal."""

from __future__ import annotations

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater

from roomstore.events.write.batch import EventToPersist
from roomstore.events.write.persist import MissingStateError
from roomstore.pdu.parsing import InvalidEventError
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.test_pipeline import ALICE, linear_room, unstorable_join


class _HeldWriter:
    """The store's first write held until every call is validated; each
    transaction's batch sizes (one per call it writes) recorded."""

    def __init__(self, store: RoomStore, calls: int):
        self.store = store
        self.calls = calls
        self.validated = 0
        self.all_validated: defer.Deferred = defer.Deferred()
        self.writes: list[int] = []
        real_prepare, real_write = store.validator.prepare, store.writes.write

        async def prepare(*args, **kwargs):
            prepared = await real_prepare(*args, **kwargs)
            self.validated += 1
            if self.validated == self.calls:
                reactor.callLater(0, self.all_validated.callback, None)
            return prepared

        async def write(prepared, resolved):
            self.writes.append(len(prepared))
            if len(self.writes) == 1:
                await self.all_validated
                await deferLater(reactor, 0, lambda: None)  # each call has offered its batch
            return await real_write(prepared, resolved)

        store.validator.prepare = prepare
        store.writes.write = write

    async def run(self, batches):
        return await defer.DeferredList(
            [defer.ensureDeferred(self.store.persist_events(b)) for b in batches], consumeErrors=True
        )


@on_both_engines
class GroupCommitTests:
    async def open_store(self, **config) -> RoomStore:
        store = await RoomStore.open(await self.make_database(), StoreConfig(**config))
        self.addCleanup(store.close)
        return store

    async def test_calls_waiting_go_in_one_transaction(self):
        store = await self.open_store()
        room, built = linear_room(248)
        events = [room.to_persist(e) for e in built]
        batches = [events[i : i + 50] for i in range(0, len(events), 50)]
        held = _HeldWriter(store, len(batches))
        outcomes = await held.run(batches)
        self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
        # The first call alone (held), then the four waiting behind it together.
        self.assertEqual(held.writes, [50, 200])
        self.assertEqual([len(r) for _, r in outcomes], [len(b) for b in batches])
        orderings = [r.stream_ordering for _, results in outcomes for r in results]
        self.assertEqual(orderings, list(range(1, len(events) + 1)))
        self.assertEqual([r.event_id for _, results in outcomes for r in results], [e.event_id for e in built])
        self.assertFalse(any(r.already_persisted for _, results in outcomes for r in results))
        self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])
        last_topic = next(e.event_id for e in reversed(built) if e.event["type"] == "m.room.topic")
        self.assertEqual((await store.get_current_state_ids(room.room_id))[("m.room.topic", "")], last_topic)
        # Each event's state as a call-by-call writer stores it.
        for e in built[-30:]:
            state = await store.get_state_ids(e.event_id)
            self.assertEqual(state[("m.room.member", ALICE)], built[1].event_id)

    async def _linear_in_batches(self, messages: int, size: int, limit: int):
        """A linear room's events in calls of ``size``, the first held;
        (its events, the writes' sizes, the calls' outcomes), every call written."""
        store = await self.open_store(max_events_per_transaction=limit)
        room, built = linear_room(messages)
        batches = [[room.to_persist(e) for e in built[i : i + size]] for i in range(0, len(built), size)]
        held = _HeldWriter(store, len(batches))
        outcomes = await held.run(batches)
        self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
        return built, held.writes, outcomes

    async def _three_calls(self):
        """A store, a linear room's 92 events, three calls of them (30, 30, 32), the first to be held."""
        store = await self.open_store()
        room, built = linear_room(90)
        events = [room.to_persist(e) for e in built]
        batches = [events[:30], events[30:60], events[60:]]
        return store, built, events, batches, _HeldWriter(store, len(batches))

    async def test_calls_behind_a_room_being_created_go_with_it(self):
        # Bare events whose room's create event is in the first call: the calls
        # behind it are validated by that event's version while it writes
        # (held), then go together, as calls of a stored room do.
        store = await self.open_store()
        room, built = linear_room(60)
        bare = [EventToPersist(e.raw) for e in built]
        held = _HeldWriter(store, 3)
        outcomes = await held.run([bare[:20], bare[20:40], bare[40:]])
        self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
        self.assertEqual(held.writes, [20, 42])
        self.assertEqual(outcomes[2][1][-1].stream_ordering, len(bare))

    async def test_up_to_the_configured_events(self):
        built, writes, outcomes = await self._linear_in_batches(298, 50, limit=120)
        self.assertEqual(writes, [50, 100, 100, 50])
        self.assertEqual(
            [r.stream_ordering for _, results in outcomes for r in results], list(range(1, len(built) + 1))
        )

    async def test_one_refused_call_leaves_the_others_written(self):
        store = await self.open_store()
        room, built = linear_room(120)
        events = [room.to_persist(e) for e in built]
        joined, lost = unstorable_join(ALICE)
        batches = [events[:40], events[40:80], [lost], events[80:]]
        held = _HeldWriter(store, len(batches))
        outcomes = await held.run(batches)
        self.assertEqual([ok for ok, _ in outcomes], [True, True, False, True])
        outcomes[2][1].trap(MissingStateError, InvalidEventError)
        # The group was written again call by call: the others' results as if alone.
        self.assertEqual(held.writes, [40, 40 + 1 + len(events) - 80, 40, 1, len(events) - 80])
        self.assertEqual(
            [r.stream_ordering for ok, results in outcomes if ok for r in results], list(range(1, len(events) + 1))
        )
        self.assertIsNone(await store.get_event(joined.event_id))
        self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])

    async def test_a_later_batch_an_earlier_one_needs_is_not_taken(self):
        store = await self.open_store()
        room, built = linear_room(60)
        events = [room.to_persist(e) for e in built]
        # The third call holds the prev event of the second's first event:
        # alone, the second cannot be written; together they could, but
        # only by putting the third's event first. It is refused as alone.
        batches = [events[:20], events[41:], events[20:41]]
        held = _HeldWriter(store, len(batches))
        outcomes = await held.run(batches)
        self.assertEqual([ok for ok, _ in outcomes], [True, False, True])
        outcomes[1][1].trap(MissingStateError)
        self.assertEqual(held.writes, [20, 21, 21])
        self.assertEqual([r.stream_ordering for r in outcomes[2][1]], list(range(21, 42)))

    async def test_an_event_in_two_calls_is_stored_once(self):
        store = await self.open_store()
        room, built = linear_room(60)
        events = [room.to_persist(e) for e in built]
        batches = [events[:20], events[20:40], events[30:]]
        held = _HeldWriter(store, len(batches))
        outcomes = await held.run(batches)
        self.assertTrue(all(ok for ok, _ in outcomes))
        self.assertEqual(held.writes, [20, 20 + len(events) - 30])
        again = outcomes[2][1][:10]
        self.assertTrue(all(r.already_persisted for r in again))
        self.assertEqual([r.stream_ordering for r in again], [r.stream_ordering for r in outcomes[1][1][10:]])
        self.assertFalse(any(r.already_persisted for r in outcomes[2][1][10:]))
        self.assertEqual(outcomes[2][1][-1].stream_ordering, len(events))

    async def test_a_database_error_fails_every_call_of_the_group(self):
        store, built, events, batches, held = await self._three_calls()
        real_txn = store.writes.check_and_write_txn

        def failing_txn(txn, take, unique, *args):
            if len(unique) > 30:  # the group's transaction
                raise RuntimeError("the database went away")
            return real_txn(txn, take, unique, *args)

        store.writes.check_and_write_txn = failing_txn
        outcomes = await held.run(batches)
        self.assertEqual([ok for ok, _ in outcomes], [True, False, False])
        for _, failure in outcomes[1:]:
            failure.trap(RuntimeError)
        self.assertEqual(held.writes, [30, 62])  # not written again call by call
        self.assertIsNone(await store.get_event(built[30].event_id))
        # Nothing of the group was written: the calls may be made again.
        store.writes.check_and_write_txn = real_txn
        again = await store.persist_events(events[30:])
        self.assertEqual([r.stream_ordering for r in again][:1], [31])
        self.assertFalse(any(r.already_persisted for r in again))

    async def test_one_event_per_transaction_turns_it_off(self):
        _, writes, _ = await self._linear_in_batches(40, 10, limit=1)
        self.assertEqual(writes, [10, 10, 10, 10, 2])

    async def test_a_group_write_that_ends_abruptly_leaves_no_call_waiting(self):
        store, built, events, batches, held = await self._three_calls()
        real_write = store.writes.write

        async def cancelled_group(prepared, resolved):
            if len(prepared) > 30:  # the group's write: cancelled, not a refusal nor an Exception
                held.writes.append(len(prepared))
                raise defer.CancelledError()
            return await real_write(prepared, resolved)

        store.writes.write = cancelled_group
        outcomes = await held.run(batches)
        self.assertEqual([ok for ok, _ in outcomes], [True, False, False])
        for _, failure in outcomes[1:]:
            failure.trap(defer.CancelledError)
        self.assertEqual(held.writes, [30, 62])
