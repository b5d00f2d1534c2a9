"""The writer's pipeline (events/write/pipeline.py): batches validated off the
reactor (worker processes or a thread), several calls in flight, written in
call order; errors as a one-call-at-a-time writer gives them."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from twisted.internet import defer, reactor, threads
from twisted.internet.task import deferLater
from twisted.trial import unittest

from roomstore.events.write.batch import EventToPersist, prepare_events
from roomstore.events.write.persist import MissingStateError
from roomstore.events.write.pipeline import MIN_CHUNK, BatchValidator, WriteTurns
from roomstore.pdu.content_hash import ContentHashMismatch
from roomstore.pdu.parsing import InvalidEventError
from roomstore.storage.errors import StorageFullError
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def linear_room(messages: int) -> tuple[RoomBuilder, list]:
    room = RoomBuilder()
    built = [room.create(), room.join(ALICE)]
    for i in range(messages):
        if i % 10 == 5:
            built.append(room.state("m.room.topic", "", {"topic": f"topic {i}"}, ALICE))
        else:
            built.append(room.message(ALICE, f"message {i}"))
    return room, built


def unstorable_join(user: str):
    """(A join to a room whose create event is never persisted, it to persist):
    its prev event is missing, so no write can store it."""
    stranger = RoomBuilder("!elsewhere:example.org")
    stranger.create()
    joined = stranger.join(user)
    return joined, stranger.to_persist(joined)


def with_bad_hash(raw: bytes) -> bytes:
    """The same event with its content changed under its content hash."""
    changed = raw.replace(b'"msgtype": "m.text"', b'"msgtype": "m.notice"')
    assert changed != raw
    return changed


class VersionAssumedTests(unittest.TestCase):
    def test_the_copy_differs_only_in_the_flag(self):
        import attrs

        room, built = linear_room(3)
        for ev in prepare_events([room.to_persist(e) for e in built], {}):
            self.assertEqual(ev.with_version_assumed(), attrs.evolve(ev, version_assumed=True))
            self.assertFalse(ev.version_assumed)


class PauseTests(unittest.TestCase):
    """The validator's thread lets the GIL go every few events; the result is the same."""

    def test_pauses_every_n_events_and_gives_the_same_result(self):
        import roomstore.events.write.batch as batch_module

        room, built = linear_room(30)
        events = [room.to_persist(e) for e in built]
        pauses = []
        real_sleep = batch_module.time.sleep
        self.patch(batch_module.time, "sleep", lambda seconds: pauses.append(seconds) or real_sleep(seconds))
        paused = prepare_events(events, {}, pause_every=8)
        self.assertEqual(pauses, [0] * (len(events) // 8))
        pauses.clear()
        self.assertEqual(prepare_events(events, {}), paused)
        self.assertEqual(pauses, [])

    async def test_the_validators_thread_pauses(self):
        import roomstore.events.write.batch as batch_module
        from roomstore.events.write.pipeline import PAUSE_EVERY

        room, built = linear_room(40)
        events = [room.to_persist(e) for e in built]
        pauses = []
        real_sleep = batch_module.time.sleep
        self.patch(batch_module.time, "sleep", lambda seconds: pauses.append(seconds) or real_sleep(seconds))
        validator = BatchValidator(reactor)
        self.addCleanup(validator.close)
        got = await validator.prepare(events, {})
        self.assertEqual(got, prepare_events(events, {}))
        self.assertGreaterEqual(pauses.count(0), len(events) // PAUSE_EVERY)


class WriteTurnsTests(unittest.TestCase):
    def test_turns_follow_call_order_however_earlier_ones_end(self):
        turns = WriteTurns()
        first, second, third = turns.take(), turns.take(), turns.take()
        order = []
        d3 = defer.ensureDeferred(third.ready()).addCallback(lambda _: order.append(3))
        d2 = defer.ensureDeferred(second.ready()).addCallback(lambda _: order.append(2))
        self.assertEqual(order, [])
        self.assertTrue(second.earlier_in_flight())
        first.done()  # as a call that failed ends its turn in a finally
        self.assertEqual(order, [2])
        second.done()
        self.assertEqual(order, [2, 3])
        third.done()
        self.assertEqual(turns.in_flight, 0)
        self.assertFalse(turns.take().earlier_in_flight())
        return defer.gatherResults([d2, d3])

    def test_calls_queued_behind_one_out_of_space_are_refused_alike(self):
        turns = WriteTurns()
        first, second, third = turns.take(), turns.take(), turns.take()

        async def write(turn):
            await turn.ready()
            turn.check_refused()

        waiting = [defer.ensureDeferred(write(t)) for t in (second, third)]
        full = StorageFullError("sqlite:///x.db is out of space (database or disk is full)")
        turns.out_of_space(first, full)
        first.done()
        self.failureResultOf(waiting[0], StorageFullError)
        second.done()
        failure = self.failureResultOf(waiting[1], StorageFullError)
        self.assertEqual(str(failure.value), str(full))
        third.done()
        later = turns.take()  # a call made after: tried again
        self.successResultOf(defer.ensureDeferred(write(later)))

    def test_a_room_created_in_flight_is_known_without_waiting_for_the_calls_after_its_create(self):
        # The create event's call is validated, the call after it is not:
        # a third call naming the room learns its version at once; asked
        # about every room (or one no call creates), it waits for them all.
        turns = WriteTurns()
        first, second, third = turns.take(), turns.take(), turns.take()
        version = SimpleNamespace(identifier="10")
        create = SimpleNamespace(room_id="!a:x", room_version=version, is_create=True)
        first.validated([SimpleNamespace(pdu=create)])
        named = defer.ensureDeferred(third.created_earlier({"!a:x"}))
        self.assertEqual(self.successResultOf(named), {"!a:x": "10"})
        everything = defer.ensureDeferred(third.created_earlier())
        unknown = defer.ensureDeferred(third.created_earlier({"!b:x"}))
        self.assertNoResult(everything)
        self.assertNoResult(unknown)
        second.validated([])
        self.assertEqual(self.successResultOf(everything), {"!a:x": "10"})
        self.assertEqual(self.successResultOf(unknown), {"!a:x": "10"})
        for turn in (first, second, third):
            turn.done()


class ValidatorTests(unittest.TestCase):
    """Worker processes give exactly what prepare_events gives, errors included."""

    def setUp(self):
        self.room, built = linear_room(70)
        self.events = [self.room.to_persist(e) for e in built]
        self.validator = BatchValidator(reactor, processes=2)
        self.addCleanup(self.validator.close)

    async def test_processes_give_what_one_thread_gives(self):
        expected = prepare_events(self.events, {})
        got = await self.validator.prepare(self.events, {})
        self.assertEqual([p.event_id for p in got], [p.event_id for p in expected])
        self.assertEqual(got, expected)
        self.assertEqual([p.pdu.content for p in got], [p.pdu.content for p in expected])
        self.assertEqual(len(self.validator._workers), 2)
        self.assertEqual(self.validator.fallbacks, 0)

    async def test_first_invalid_event_error_intact(self):
        events = list(self.events)
        events[40] = EventToPersist(with_bad_hash(events[40].raw), self.room.version)
        events[60] = EventToPersist(b"{not json", self.room.version)
        with self.assertRaises(ContentHashMismatch) as expected:
            prepare_events(events, {}, refuse_hash_mismatch=True)
        with self.assertRaises(ContentHashMismatch) as got:
            await self.validator.prepare(events, {}, refuse_hash_mismatch=True)
        self.assertEqual(str(got.exception), str(expected.exception))
        self.assertEqual(got.exception.field, expected.exception.field)
        self.assertEqual(got.exception.event_id, expected.exception.event_id)
        # Without the flag the mismatch is stored redacted; the bad JSON is the first error.
        with self.assertRaises(InvalidEventError) as expected:
            prepare_events(events, {})
        with self.assertRaises(InvalidEventError) as got:
            await self.validator.prepare(events, {})
        self.assertIs(type(got.exception), type(expected.exception))
        self.assertEqual((str(got.exception), got.exception.field), (str(expected.exception), expected.exception.field))

    async def test_a_killed_worker_loses_nothing(self):
        await self.validator.prepare(self.events, {})
        victim = self.validator._workers[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        await threads.deferToThread(victim.process.wait)
        got = await self.validator.prepare(self.events, {})
        self.assertEqual(got, prepare_events(self.events, {}))
        self.assertEqual(len([w for w in self.validator._workers if w.alive()]), 2)
        self.assertNotIn(victim, self.validator._workers)
        # A worker that dies holding a chunk: the thread validates that chunk.
        dying = self.validator._workers[1]
        original = dying.send

        def send_then_die(request):
            # Stopped first, so it cannot answer before it dies, however the
            # machine schedules the two processes.
            os.kill(dying.process.pid, signal.SIGSTOP)
            sent = original(request)
            os.kill(dying.process.pid, signal.SIGKILL)
            return sent

        dying.send = send_then_die
        self.assertEqual(await self.validator.prepare(self.events, {}), prepare_events(self.events, {}))
        self.assertEqual(self.validator.fallbacks, 1)

    async def test_a_worker_gets_the_next_batch_before_the_last_reply_is_read(self):
        import threading

        validator = BatchValidator(reactor, processes=1)
        self.addCleanup(validator.close)
        await validator.start()
        (worker,) = validator._workers
        second_sent = threading.Event()
        order = []
        real_send, real_receive = worker.send, worker.receive

        def send(request):
            ticket = real_send(request)
            order.append(("sent", ticket))
            if ticket == 1:
                second_sent.set()
            return ticket

        def receive(ticket):
            if ticket == 0:
                second_sent.wait(30)  # the other thread sends meanwhile
            reply = real_receive(ticket)
            order.append(("read", ticket))
            return reply

        worker.send, worker.receive = send, receive
        first, second = self.events[:35], self.events[35:]
        got = await defer.gatherResults(
            [
                defer.ensureDeferred(validator.prepare(first, {})),
                defer.ensureDeferred(validator.prepare(second, {})),
            ]
        )
        self.assertEqual(order[:2], [("sent", 0), ("sent", 1)])
        self.assertEqual(sorted(order[2:]), [("read", 0), ("read", 1)])
        self.assertEqual(
            got,
            [
                prepare_events(first, {}),
                prepare_events(
                    second,
                    {},
                ),
            ],
        )
        self.assertEqual(validator.fallbacks, 0)

    async def test_small_batches_stay_on_the_thread(self):
        got = await self.validator.prepare(self.events[: MIN_CHUNK - 1], {})
        self.assertEqual(len(got), MIN_CHUNK - 1)
        self.assertEqual(self.validator._workers, [])

    async def test_close_ends_the_workers(self):
        await self.validator.prepare(self.events, {})
        workers = list(self.validator._workers)
        self.assertEqual(len(workers), 2)
        await self.validator.close()
        self.assertEqual([w.process.returncode for w in workers], [0, 0])
        with self.assertRaises(RuntimeError):
            await self.validator.prepare(self.events, {})


@on_both_engines
class PipelineTests:
    async def open_store(self, processes: int = 2) -> RoomStore:
        db = await self.make_database()
        store = await RoomStore.open(db, StoreConfig(validation_processes=processes))
        self.addCleanup(store.close)
        return store

    async def _in_flight(self, store, batches):
        return await defer.DeferredList(
            [defer.ensureDeferred(store.persist_events(b)) for b in batches], consumeErrors=True
        )

    async def test_calls_in_flight_write_in_call_order(self):
        for processes in (2, 0):
            store = await self.open_store(processes)
            room, built = linear_room(200)
            events = [room.to_persist(e) for e in built]
            batches = [events[i : i + 30] for i in range(0, len(events), 30)]
            outcomes = await self._in_flight(store, batches)
            self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
            orderings = [r.stream_ordering for _, results in outcomes for r in results]
            self.assertEqual(orderings, list(range(1, len(events) + 1)))
            self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])
            last_topic = next(e.event_id for e in reversed(built) if e.event["type"] == "m.room.topic")
            self.assertEqual((await store.get_current_state_ids(room.room_id))[("m.room.topic", "")], last_topic)

    async def test_a_failed_call_in_the_middle(self):
        store = await self.open_store()
        room, built = linear_room(90)
        events = [room.to_persist(e) for e in built]
        _, lost = unstorable_join(BOB)
        bad = events[40:70] + [lost]
        outcomes = await self._in_flight(store, [events[:40], bad, events[40:]])
        self.assertTrue(outcomes[0][0])
        self.assertFalse(outcomes[1][0])
        outcomes[1][1].trap(MissingStateError, InvalidEventError)
        self.assertTrue(outcomes[2][0], outcomes[2][1])
        # Nothing of the failed call stayed; the third call wrote every event after it.
        self.assertEqual([r.already_persisted for r in outcomes[2][1]], [False] * (len(events) - 40))
        self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])

    async def test_room_created_by_an_earlier_call_in_flight(self):
        store = await self.open_store()
        room, built = linear_room(60)
        # Without room versions: the second call needs the first's create event stored.
        bare = [EventToPersist(e.raw) for e in built]
        outcomes = await self._in_flight(store, [bare[:1], bare[1:]])
        self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
        self.assertEqual(outcomes[1][1][-1].stream_ordering, len(built))

    async def _validated_at_first_write(self, store, calls: list, expected: int) -> tuple[list, list[int]]:
        """(outcomes of ``calls`` in flight, how many calls were validated when
        the first write began): that write waits (up to 5 s) for ``expected``
        validated calls, so a call whose validation waits for it leaves fewer."""
        validated: list[int] = []
        at_first_write: list[int] = []
        real_prepare, real_write = store.validator.prepare, store.writes.write

        async def prepare(events, *args, **kwargs):
            prepared = await real_prepare(events, *args, **kwargs)
            validated.append(len(events))
            return prepared

        async def write(prepared, resolved):
            if not at_first_write:
                for _ in range(500):
                    if len(validated) == expected:
                        break
                    await deferLater(reactor, 0.01, lambda: None)
                at_first_write.append(len(validated))
            return await real_write(prepared, resolved)

        store.validator.prepare, store.writes.write = prepare, write
        outcomes = await self._in_flight(store, calls)
        self.assertTrue(all(ok for ok, _ in outcomes), [r for ok, r in outcomes if not ok])
        return outcomes, at_first_write

    async def test_a_room_being_created_is_validated_before_its_create_is_written(self):
        # The calls after the one holding the create event are validated by its
        # version while it writes, not after (an import's pipeline stays full).
        store = await self.open_store()
        room, built = linear_room(60)
        bare = [EventToPersist(e.raw) for e in built]
        outcomes, at_first_write = await self._validated_at_first_write(store, [bare[:30], bare[30:45], bare[45:]], 3)
        self.assertEqual(at_first_write, [3])
        self.assertEqual([r.stream_ordering for r in outcomes[2][1]], list(range(46, len(built) + 1)))

    async def test_bare_events_beside_their_rooms_create_with_its_version_wait_for_no_write(self):
        # An import's file gives most events with their room version and
        # some bare: a batch holding a room's create event (its version
        # given) and bare events of that room takes their version from it,
        # as from a bare create event, and is validated while the calls
        # before it write, not after them (a stall at every room's start).
        store = await self.open_store()
        first_room, first_built = linear_room(20)
        room = RoomBuilder("!second:example.org")
        built = [room.create(), room.join(ALICE), room.message(ALICE, "one"), room.message(ALICE, "two")]
        second = [room.to_persist(built[0]), room.to_persist(built[1])] + [EventToPersist(e.raw) for e in built[2:]]
        first = [first_room.to_persist(e) for e in first_built]
        outcomes, at_first_write = await self._validated_at_first_write(store, [first, second], 2)
        self.assertEqual(at_first_write, [2])
        self.assertEqual([r.event_id for r in outcomes[1][1]], [e.event_id for e in built])
        self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])

    async def _stored_room_and_impostor(self, version: str):
        """A store holding a v10 room whose version the cache has lost, the
        room, and a builder of another ``version`` for the same room ID."""
        store = await self.open_store()
        room, built = linear_room(3)
        await store.persist_events([room.to_persist(e) for e in built])
        store.batch_rooms.cache.clear()
        return store, room, RoomBuilder(room.room_id, version=version)

    async def test_a_second_create_in_flight_costs_the_stored_rooms_events_nothing(self):
        # A stored v10 room (its version not cached), then a hostile create
        # event for the same room ID at v9 in an earlier call: the room's own
        # events behind it are validated by the stored version and stored;
        # the create event and the events built on it are refused.
        store, room, impostor = await self._stored_room_and_impostor("9")
        forged = [impostor.create(), impostor.join(BOB)]
        genuine = room.message(ALICE, "after")
        calls = [[impostor.to_persist(forged[0])], [EventToPersist(genuine.raw)], [EventToPersist(forged[1].raw)]]
        outcomes = await self._in_flight(store, calls)
        self.assertFalse(outcomes[0][0])
        outcomes[0][1].trap(InvalidEventError)
        self.assertTrue(outcomes[1][0], outcomes[1][1])
        self.assertEqual([r.event_id for r in outcomes[1][1]], [genuine.event_id])
        self.assertFalse(outcomes[2][0])
        self.assertEqual(await store.get_forward_extremities(room.room_id), [genuine.event_id])

    async def test_events_a_second_create_in_flight_makes_invalid_are_validated_again(self):
        # The hostile create event in flight is of room version 1, whose
        # events carry their ID: the room's own bare events fail validation
        # by it, and are validated again by the stored version and stored.
        store, room, impostor = await self._stored_room_and_impostor("1")
        genuine = [room.message(ALICE, "after"), room.message(ALICE, "and after")]
        calls = [[impostor.to_persist(impostor.create())], [EventToPersist(e.raw) for e in genuine]]
        outcomes = await self._in_flight(store, calls)
        outcomes[0][1].trap(InvalidEventError)
        self.assertTrue(outcomes[1][0], outcomes[1][1])
        self.assertEqual([r.event_id for r in outcomes[1][1]], [e.event_id for e in genuine])
        self.assertEqual(await store.get_forward_extremities(room.room_id), [genuine[-1].event_id])

    async def test_a_batch_validated_by_a_create_in_flight_keeps_its_own_error(self):
        # The versions assumed were right: an event of the batch that is
        # invalid by them is refused with its own error, once.
        store = await self.open_store()
        room, built = linear_room(3)
        broken = EventToPersist(built[1].raw.replace(b'"depth": 2', b'"depth": "two"'))
        prepared = []
        prepare = store.writes.validator.prepare

        async def counting(events, *args, **kwargs):
            prepared.append(len(events))
            return await prepare(events, *args, **kwargs)

        self.patch(store.writes.validator, "prepare", counting)
        calls = [[room.to_persist(built[0])], [broken]]
        outcomes = await self._in_flight(store, calls)
        self.assertTrue(outcomes[0][0], outcomes[0][1])
        outcomes[1][1].trap(InvalidEventError)
        self.assertIn("depth", str(outcomes[1][1].value))
        self.assertEqual(prepared, [1, 1])

    async def test_a_room_whose_create_write_fails_is_unknown_to_the_calls_after(self):
        # Validated by the create event's version while it was in flight; its
        # batch refused, the next call is refused as if it had waited.
        store = await self.open_store()
        room, built = linear_room(30)
        _, lost = unstorable_join(BOB)
        bare = [EventToPersist(e.raw) for e in built]
        outcomes = await self._in_flight(store, [[bare[0], lost], bare[1:]])
        self.assertFalse(outcomes[0][0])
        outcomes[0][1].trap(MissingStateError, InvalidEventError)
        self.assertFalse(outcomes[1][0])
        outcomes[1][1].trap(InvalidEventError)
        self.assertIn("is unknown", str(outcomes[1][1].value))
        self.assertEqual(store.get_current_token(), "s0")

    async def test_a_write_out_of_space_refuses_the_calls_queued_behind_it(self):
        # The second call's write meets a full disk: the calls already queued
        # behind it are refused alike (none written after the refusal an
        # importer stops at); a call made afterwards is tried again.
        store = await self.open_store(0)
        room, built = linear_room(120)
        events = [room.to_persist(e) for e in built]
        write = store.writes.write
        calls = []

        async def second_write_full(prepared, resolved):
            calls.append(len(prepared))
            if len(calls) == 2:
                raise StorageFullError("the test's disk is out of space")
            return await write(prepared, resolved)

        self.patch(store.writes, "write", second_write_full)
        batches = [events[i : i + 30] for i in range(0, 90, 30)]
        outcomes = await self._in_flight(store, batches)
        self.assertTrue(outcomes[0][0], outcomes[0][1])
        for ok, failure in outcomes[1:]:
            self.assertFalse(ok)
            failure.trap(StorageFullError)
        self.assertEqual(store.get_current_token(), "s30")
        again = await store.persist_events(events[30:])
        self.assertEqual([r.stream_ordering for r in again], list(range(31, len(events) + 1)))

    async def test_unknown_room_still_refused(self):
        store = await self.open_store()
        room, built = linear_room(30)
        bare = [EventToPersist(e.raw) for e in built[1:]]
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events(bare)
        self.assertIn("is unknown", str(caught.exception))
        # Waits for nothing when nothing is in flight: no sleep needed to see it refused.
        await deferLater(reactor, 0, lambda: None)


class ProcessCountTests(unittest.TestCase):
    def test_none_by_default_and_negative_refused(self):
        self.assertEqual(StoreConfig().validation_processes, 0)
        with self.assertRaises(ValueError) as caught:
            BatchValidator(reactor, processes=-1)
        self.assertIn("0 or more", str(caught.exception))


class StartTests(unittest.TestCase):
    """A store with validation processes has them running once it is open,
    so the first batch waits for no interpreter to start."""

    async def test_workers_run_once_the_store_is_open(self):
        path = self.mktemp() + ".db"
        store = await RoomStore.open(f"sqlite:///{path}", StoreConfig(validation_processes=2))
        self.addCleanup(store.close)
        self.assertEqual(len(store.validator._workers), 2)
        self.assertTrue(all(w.alive() for w in store.validator._workers))
        room, built = linear_room(60)
        results = await store.persist_events([room.to_persist(e) for e in built])
        self.assertEqual(len(results), len(built))
        self.assertEqual(store.validator.fallbacks, 0)

    def test_a_worker_says_ready_before_its_first_reply(self):
        import io

        from roomstore.events.write.validation_worker import READY, frame, serve

        room, built = linear_room(3)
        replies = io.BytesIO()
        serve(io.BytesIO(frame(([room.to_persist(e) for e in built], {}))), replies)
        ready = frame(READY)
        self.assertEqual(replies.getvalue()[: len(ready)], ready)
        self.assertGreater(len(replies.getvalue()), len(ready))  # then the reply

    async def test_no_workers_by_default(self):
        validator = BatchValidator(reactor)
        self.addCleanup(validator.close)
        await validator.start()
        self.assertEqual(validator._workers, [])
