"""``StoreConfig(writer_process=True)``: the store's writes run in a child
process (``roomstore.writer_process.parent``, ``roomstore.writer_process.child``);
this process reads, and learns each commit from the child's replies before
the call that made it returns. Real child processes, real databases."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile

from twisted.internet import defer
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.trial import unittest

from roomstore.events.write.batch import EventToPersist
from roomstore.events.write.persist import MissingStateError
from roomstore.events.write.validation_worker import FrameReader, frame
from roomstore.pdu.parsing import InvalidEventError
from roomstore.storage.errors import DatabaseConfigError
from roomstore.storage.writer_lock import WriterLockHeld
from roomstore.store import RoomStore, StoreConfig
from roomstore.writer_process.parent import WriterProcessLost, how_it_ended
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder
from tests.store.test_pipeline import ALICE, BOB, linear_room, unstorable_join


@on_both_engines
class WriterProcessTests:
    async def open_store(self, url: str | None = None, **config) -> RoomStore:
        store = await RoomStore.open(url or self.new_database_url(), StoreConfig(writer_process=True, **config))
        self.addCleanup(store.close)
        return store

    async def test_writes_in_a_child_and_reads_here(self):
        store = await self.open_store(validation_processes=1)
        child = store.writes.process._transport.pid
        self.assertNotEqual(child, os.getpid())
        if hasattr(os, "SCHED_IDLE"):
            self.assertEqual(os.sched_getscheduler(child), os.SCHED_IDLE)
        room, built = linear_room(300)
        events = [room.to_persist(e) for e in built]
        batches = [events[i : i + 40] for i in range(0, len(events), 40)]
        # Several calls in flight, as a homeserver makes them: their order kept.
        outcomes = await defer.gatherResults([defer.ensureDeferred(store.persist_events(b)) for b in batches])
        orderings = [r.stream_ordering for results in outcomes for r in results]
        self.assertEqual(orderings, list(range(1, len(events) + 1)))
        self.assertEqual([r.event_id for results in outcomes for r in results], [e.event_id for e in built])
        # Positions and reads here, as soon as the calls returned.
        self.assertEqual(store.events_stream.get_current_token(), len(events))
        self.assertEqual((await store.get_event(built[-1].event_id))["event_id"], built[-1].event_id)
        self.assertEqual(await store.get_forward_extremities(room.room_id), [built[-1].event_id])
        synced = await store.sync(ALICE, None, initial_limit=5)
        self.assertEqual([e["event_id"] for e in synced.rooms[room.room_id]], [e.event_id for e in built[-5:]])
        # The same event again: stored once, reported as before.
        again = await store.persist_events([events[7]])
        self.assertTrue(again[0].already_persisted)
        self.assertEqual(again[0].stream_ordering, 8)

    async def test_the_child_leaves_with_status_0_and_its_writes_stored(self):
        # It leaves by os._exit once its store is closed (roomstore.processes.leave_now).
        url = self.new_database_url()
        store = await RoomStore.open(url, StoreConfig(writer_process=True))
        room, built = linear_room(60)
        await store.persist_events([room.to_persist(e) for e in built])
        process = store.writes.process
        await store.close()
        self.assertEqual(os.waitstatus_to_exitcode(process._transport.status), 0)
        again = await RoomStore.open(url, StoreConfig())
        self.addCleanup(again.close)
        self.assertEqual(await again.get_forward_extremities(room.room_id), [built[-1].event_id])
        self.assertEqual(again.events_stream.get_current_token(), len(built))

    async def test_calls_larger_than_a_read_and_the_pipe_arrive_whole(self):
        """The child reads its calls' pipe a MiB at a time from a pipe it
        made a MiB large: a call of several MiB arrives whole, in order."""
        store = await self.open_store()
        pipe = store.writes.process._transport.pipes[0].fileno()
        if hasattr(fcntl, "F_GETPIPE_SZ"):
            self.assertEqual(fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ), 1 << 20)
        room = RoomBuilder()
        built = [room.create(), room.join(ALICE)]
        built += [room.message(ALICE, f"{i} " + "x" * 20_000) for i in range(150)]
        events = [room.to_persist(e) for e in built]
        for call in (events[:80], events[80:]):  # each more than a read and than the pipe holds
            self.assertGreater(sum(len(e.raw) for e in call), 1 << 20)
        first, second = await defer.gatherResults(
            [
                defer.ensureDeferred(store.persist_events(events[:80])),
                defer.ensureDeferred(store.persist_events(events[80:])),
            ]
        )
        self.assertEqual([r.stream_ordering for r in first + second], list(range(1, len(events) + 1)))
        self.assertEqual((await store.get_event(built[-1].event_id))["content"], built[-1].event["content"])

    async def test_each_commit_reaches_this_process_caches_before_the_call_returns(self):
        store = await self.open_store()
        room = RoomBuilder()
        await store.persist_events([room.to_persist(e) for e in (room.create(), room.join(ALICE), room.join_rules())])
        token = store.get_current_token()
        self.assertEqual(await store.get_rooms_for_user(BOB), frozenset())  # cached here
        await store.persist_events([room.to_persist(room.join(BOB))])
        self.assertEqual(await store.get_rooms_for_user(BOB), frozenset({room.room_id}))
        message = room.message(BOB, "hello")
        await store.persist_events([room.to_persist(message)])
        since = await store.sync(BOB, token)
        self.assertEqual([e["event_id"] for e in since.rooms[room.room_id]][-1], message.event_id)
        self.assertEqual(store.events_stream.get_current_token(), 5)

    async def test_a_refusal_comes_back_as_its_own_error_and_writes_nothing(self):
        store = await self.open_store()
        room, built = linear_room(5)
        await store.persist_events([room.to_persist(e) for e in built])
        token = store.events_stream.get_current_token()
        _joined, lost = unstorable_join(ALICE)
        with self.assertRaises((MissingStateError, InvalidEventError)):
            await store.persist_events([lost])
        with self.assertRaises(InvalidEventError) as caught:
            await store.persist_events([EventToPersist(b"{not json", room.version)])
        self.assertIn("JSON", str(caught.exception))
        self.assertEqual(store.events_stream.get_current_token(), token)
        # The child goes on writing.
        more = room.message(ALICE, "after")
        self.assertEqual((await store.persist_events([room.to_persist(more)]))[0].stream_ordering, token + 1)

    async def test_other_writes_are_forwarded(self):
        store = await self.open_store()
        before = store.caches_stream.get_current_token()
        stream_id = await store.invalidate_cache("get_event", ["$x"])
        self.assertGreater(stream_id, before)
        self.assertEqual(store.caches_stream.get_current_token(), stream_id)
        room, built = linear_room(3)
        results = await store.persist_events([room.to_persist(e) for e in built])
        group = results[-1].state_group
        self.assertEqual(await store.delete_state_groups([group + 1000]), 0)
        self.assertEqual(await store.censor_expired_redactions(), 0)

    async def test_a_cancelled_call_leaves_the_others_answered(self):
        store = await self.open_store()
        room, built = linear_room(30)
        events = [room.to_persist(e) for e in built]
        first = defer.ensureDeferred(store.persist_events(events[:10]))
        second = defer.ensureDeferred(store.persist_events(events[10:20]))
        third = defer.ensureDeferred(store.persist_events(events[20:]))
        second.cancel()
        self.assertEqual(len(await first), 10)
        self.assertEqual([r.stream_ordering for r in await third], list(range(21, 33)))
        with self.assertRaises(defer.CancelledError):
            await second
        # (A cancelled Deferred ignores its late result.) The child wrote the cancelled call's batch
        # all the same, and this process learnt it.
        self.assertEqual((await store.get_event(built[15].event_id))["event_id"], built[15].event_id)

    async def test_the_child_holds_the_writer_lock(self):
        url = self.new_database_url()
        await self.open_store(url)
        with self.assertRaises(WriterLockHeld):
            await RoomStore.open(url)
        # And the other way round: the child's refusal is raised here.
        other = self.new_database_url()
        writer = await RoomStore.open(other)
        self.addCleanup(writer.close)
        with self.assertRaises(WriterLockHeld):
            await RoomStore.open(other, StoreConfig(writer_process=True))

    async def test_a_lost_child_fails_the_calls_and_nothing_hangs(self):
        store = await self.open_store()
        room, built = linear_room(3)
        await store.persist_events([room.to_persist(e) for e in built])
        ended = store.writes.process._ended_d
        store.writes.process._transport.signalProcess("KILL")
        await ended
        with self.assertRaises(WriterProcessLost) as caught:
            await store.persist_events([room.to_persist(room.message(ALICE, "late"))])
        self.assertIn("open the store again", str(caught.exception))
        self.assertIn("killed by signal 9 (SIGKILL)", str(caught.exception))
        # Reads go on.
        self.assertEqual((await store.get_event(built[0].event_id))["type"], "m.room.create")

    async def test_killed_mid_import_every_batch_is_whole_or_absent(self):
        url = self.new_database_url()
        store = await RoomStore.open(url, StoreConfig(writer_process=True))
        room, built = linear_room(1500)
        events = [room.to_persist(e) for e in built]
        batches = [events[i : i + 100] for i in range(0, len(events), 100)]
        calls = [defer.ensureDeferred(store.persist_events(b)) for b in batches]
        await calls[0]
        store.writes.process._transport.signalProcess("KILL")
        outcomes = await defer.DeferredList(calls[1:], consumeErrors=True)
        for ok, failure in outcomes:
            if not ok:
                failure.trap(WriterProcessLost)
        self.assertFalse(all(ok for ok, _ in outcomes), "the kill came after the last batch")
        await store.close()

        reopened = await RoomStore.open(url)
        self.addCleanup(reopened.close)
        present = await reopened.get_events([e.event_id for e in built], redact=False)
        whole = []
        for index, batch in enumerate(range(0, len(built), 100)):
            stored = sum(1 for e in built[batch : batch + 100] if e.event_id in present)
            self.assertIn(stored, (0, len(built[batch : batch + 100])), f"batch {index} half written")
            whole.append(stored > 0)
        # In call order: the batches written are the first ones, every call answered ok among them.
        self.assertEqual(whole, sorted(whole, reverse=True))
        self.assertTrue(all(whole[: 1 + sum(1 for ok, _ in outcomes if ok)]))
        # The reopened store goes on where the child stopped.
        rest = [b for b, done in zip(batches, whole, strict=True) if not done]
        top = reopened.events_stream.get_current_token()
        results = await reopened.persist_events([e for b in rest for e in b])
        self.assertEqual([r.stream_ordering for r in results], list(range(top + 1, top + 1 + len(results))))
        self.assertEqual(await reopened.get_forward_extremities(room.room_id), [built[-1].event_id])


class HowItEndedTests(unittest.TestCase):
    """``WriterProcessLost``'s words for each way the child can end."""

    def test_killed_by_a_signal(self):
        self.assertEqual(
            how_it_ended(ProcessTerminated(signal=9)), "the writer process was killed by signal 9 (SIGKILL)"
        )

    def test_an_unknown_signal_number_is_given_as_is(self):
        self.assertEqual(how_it_ended(ProcessTerminated(signal=200)), "the writer process was killed by signal 200")

    def test_exited_with_a_status(self):
        self.assertEqual(
            how_it_ended(ProcessTerminated(exitCode=3)),
            "the writer process exited with status 3: its log, on this process's stderr, says why",
        )

    def test_left(self):
        self.assertEqual(how_it_ended(ProcessDone(0)), "the writer process left")


class FrameReaderTests(unittest.TestCase):
    def test_frames_split_anywhere_come_out_whole_and_in_order(self):
        objects = [("open", "sqlite:///x", {"a": 1}, True), (0, "persist_events", (b"\x00" * 70_000,), {}), (1,)]
        stream = b"".join(frame(o) for o in objects)
        for step in (1, 7, 8, 9, 1000, len(stream)):
            reader = FrameReader()
            got = []
            for at in range(0, len(stream), step):
                got.extend(reader.feed(stream[at : at + step]))
            self.assertEqual(got, objects, f"fed {step} bytes at a time")
        # A partial frame waits for the rest.
        reader = FrameReader()
        self.assertEqual(reader.feed(stream[:-1]), objects[:2])
        self.assertEqual(reader.feed(stream[-1:]), objects[2:])


class WriterProcessConfigTests(unittest.TestCase):
    async def test_memory_database_refused(self):
        with self.assertRaises(DatabaseConfigError) as caught:
            await RoomStore.open("sqlite:///:memory:", StoreConfig(writer_process=True))
        self.assertIn(":memory:", str(caught.exception))

    def test_priority_set_in_a_process(self):
        code = (
            "import os, sys; from roomstore.writer_process.child import set_priority; set_priority(sys.argv[1]);"
            " print(os.sched_getscheduler(0) == getattr(os, 'SCHED_IDLE', None), os.nice(0))"
        )

        def run(priority):
            out = subprocess.run([sys.executable, "-c", code, priority], capture_output=True, text=True, check=True)
            return out.stdout.split()

        base = os.nice(0)
        self.assertEqual(run("7"), ["False", str(max(7, base))])
        if hasattr(os, "SCHED_IDLE"):
            self.assertEqual(run("idle")[0], "True")

    def test_priority_checked(self):
        with self.assertRaises(ValueError):
            StoreConfig(writer_process_priority=20)
        with self.assertRaises(ValueError):
            StoreConfig(writer_process_priority="low")
        self.assertEqual(StoreConfig(writer_process_priority=10).writer_process_priority, 10)

    def test_collector_thresholds_checked(self):
        for bad in ((1, 2), (1, 2, -3), [1, 2, 3], (1, 2, True), (1.0, 2, 3)):
            with self.assertRaises(ValueError, msg=bad):
                StoreConfig(writer_process_gc=bad)
        self.assertEqual(StoreConfig(writer_process_gc=(50_000, 20, 100)).writer_process_gc, (50_000, 20, 100))

    def test_log_level_checked(self):
        with self.assertRaises(ValueError):
            StoreConfig(writer_process_log_level="loud")

    def test_the_child_hears_its_input_close_apart(self):
        # Half-close: the parent closing the calls' pipe lets the calls in
        # flight finish and be answered before the child leaves.
        from twisted.internet.interfaces import IHalfCloseableProtocol

        from roomstore.writer_process.child import _Calls

        self.assertTrue(IHalfCloseableProtocol.implementedBy(_Calls))


class WriterProcessLogTests(unittest.TestCase):
    async def stderr_of_a_child_opening(self, level: str) -> str:
        """What a writer child wrote on stderr (which it shares with this
        process) while it created a store's schema, at log level ``level``."""
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        captured = os.path.join(directory, "stderr")
        saved = os.dup(2)
        with open(captured, "wb") as out:
            os.dup2(out.fileno(), 2)
        try:
            url = "sqlite:///" + os.path.join(directory, "s.db")
            store = await RoomStore.open(url, StoreConfig(writer_process=True, writer_process_log_level=level))
            await store.close()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        with open(captured) as f:
            return f.read()

    async def test_info_lines_only_at_info(self):
        said = await self.stderr_of_a_child_opening("info")
        self.assertIn("created schema version", said)
        # Its last line, written as it leaves: flushed before the quick exit.
        self.assertIn("Main loop terminated", said)
        self.assertEqual(await self.stderr_of_a_child_opening("warn"), "")
