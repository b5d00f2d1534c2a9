"""``import_file(..., in_flight=N)``: several batches handed to the store at
once, on a file with a refused batch, a batch that needs its events, a
damaged line and a conflicting fork, import and report what one batch at a
time does."""

from __future__ import annotations

import os
import tempfile

from roomstore.cli import import_loop
from roomstore.cli.import_loop import import_file
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def write_lines(lines: list[bytes]) -> str:
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "events.jsonl")
    with open(path, "wb") as handle:
        handle.write(b"".join(line + b"\n" for line in lines))
    return path


def awkward_file() -> tuple[str, RoomBuilder, list]:
    """Batches of 3 (``batch_size=3``): the second holds an event whose prev
    event nobody has (the batch is refused, then retried event by event);
    the third needs the second's events; a damaged line; a fork that
    conflicts (resolved); then a long tail of messages."""
    room = RoomBuilder()
    create, join_a, m1 = room.create(), room.join(ALICE), room.message(ALICE, "one")
    m2 = room.message(ALICE, "two")
    orphan = room.message(ALICE, "orphan", prev=[fake_event_id("nobody has it")], set_leaves=False)
    m3 = room.message(ALICE, "three", prev=[m2.event_id])
    m4, rules, join_b = room.message(ALICE, "four"), room.join_rules(), room.join(BOB)
    m5 = room.message(BOB, "five")
    base = list(room.leaves)
    t1 = room.state("m.room.topic", "", {"topic": "left"}, prev=base)
    t2 = room.state("m.room.topic", "", {"topic": "right"}, prev=base)
    room.leaves = [t1.event_id]  # the tail follows t1 (t2 stays an end beside it)
    tail = [room.message(ALICE if i % 2 else BOB, f"tail {i}") for i in range(40)]
    events = [create, join_a, m1, m2, orphan, m3, m4, rules, join_b, m5, t1, t2, *tail]
    lines = [e.raw for e in events]
    lines.insert(9, b'{"type": "m.room.message", "broken')
    return write_lines(lines), room, events


@on_both_engines
class ImportInFlightTests:
    async def imported(self, path: str, in_flight: int) -> tuple[dict, list, RoomStore]:
        store = await self.open_store()
        reports: list = []
        self.patch(import_loop, "emit", reports.append)
        summary = await import_file(store, path, batch_size=3, in_flight=in_flight)
        return summary, reports, store

    async def stored(self, store: RoomStore, room: RoomBuilder, events: list) -> dict:
        """What a reader sees: which events are stored, the room's state and ends."""
        present = {}
        for event in events:
            present[event.event_id] = await store.get_event(event.event_id) is not None
        return {
            "present": present,
            "state": await store.get_current_state_ids(room.room_id),
            "extremities": sorted(await store.get_forward_extremities(room.room_id)),
        }

    async def test_same_outcome_as_one_batch_at_a_time(self):
        path, room, events = awkward_file()
        self.addCleanup(os.remove, path)
        one_summary, one_reports, one_store = await self.imported(path, 1)
        many_summary, many_reports, many_store = await self.imported(path, 6)
        self.assertEqual(many_summary, one_summary)
        self.assertEqual(many_reports, one_reports)
        # The orphan and the damaged line failed; the rest went in, the fork resolved.
        self.assertEqual((one_summary["imported"], one_summary["failed"]), (len(events) - 1, 2))
        self.assertEqual(
            sorted(r["line"] for r in many_reports),
            [5, 10],
            "the orphan and the damaged line, each reported once by its line",
        )
        self.assertEqual(await self.stored(many_store, room, events), await self.stored(one_store, room, events))
        self.assertEqual(many_store.get_current_token(), one_store.get_current_token())

    async def test_run_again_finds_everything_present(self):
        path, _room, events = awkward_file()
        self.addCleanup(os.remove, path)
        summary, _reports, store = await self.imported(path, 8)
        again = await import_file(store, path, batch_size=3, in_flight=8)
        self.assertEqual((again["imported"], again["already_present"]), (0, summary["imported"]))

    async def test_in_flight_below_one_is_refused(self):
        store = await self.open_store()
        path = write_lines([])
        self.addCleanup(os.remove, path)
        with self.assertRaises(ValueError):
            await import_file(store, path, in_flight=0)

    async def test_a_refused_batch_is_retried_in_halves_not_event_by_event(self):
        # One orphan among 203 events in one batch: the rest go in with a few
        # dozen calls, not one a line; the outcome is one batch a line's.
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE)] + [room.message(ALICE, f"before {i}") for i in range(100)]
        orphan = room.message(ALICE, "orphan", prev=[fake_event_id("nobody has it")], set_leaves=False)
        events += [orphan] + [room.message(ALICE, f"after {i}") for i in range(100)]
        path = write_lines([e.raw for e in events])
        self.addCleanup(os.remove, path)
        outcomes = []
        for batch_size in (len(events), 1):
            store = await self.open_store()
            calls: list[int] = []
            persist = store.persist_events

            async def counting(batch, _persist=persist, _calls=calls, **kwargs):
                _calls.append(len(batch))
                return await _persist(batch, **kwargs)

            self.patch(store, "persist_events", counting)
            reports: list = []
            self.patch(import_loop, "emit", reports.append)
            summary = await import_file(store, path, batch_size=batch_size, in_flight=1)
            outcomes.append((summary, reports, await self.stored(store, room, events), calls))
        (halves, halves_reports, halves_stored, calls), (single, single_reports, single_stored, _) = outcomes
        self.assertEqual((halves["imported"], halves["failed"]), (len(events) - 1, 1))
        self.assertEqual(halves, single)
        self.assertEqual(halves_reports, single_reports)
        self.assertEqual([r["line"] for r in halves_reports], [103])
        self.assertEqual(halves_stored, single_stored)
        self.assertLess(len(calls), 40, calls)
        self.assertEqual(calls[0], len(events))

    async def test_lines_are_read_as_the_batches_are_made_and_reported_in_line_order(self):
        # The first batch is handed over once its lines are read, not the
        # whole file's; a bad line is reported in its place among the
        # events' reports (here after the orphan's refusal above it).
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE)] + [room.message(ALICE, f"m{i}") for i in range(30)]
        orphan = room.message(ALICE, "orphan", prev=[fake_event_id("nobody has it")], set_leaves=False)
        lines = [e.raw for e in events]
        lines.insert(3, orphan.raw)
        lines.append(b'{"type": "m.room.message", "broken')
        path = write_lines(lines)
        self.addCleanup(os.remove, path)
        store = await self.open_store()
        read: list[int] = []
        real_read = import_loop.read_import_lines

        def counting(file_path):
            for item in real_read(file_path):
                read.append(item[0])
                yield item

        self.patch(import_loop, "read_import_lines", counting)
        at_first_call: list[int] = []
        persist = store.persist_events

        async def first(batch, **kwargs):
            if not at_first_call:
                at_first_call.append(len(read))
            return await persist(batch, **kwargs)

        self.patch(store, "persist_events", first)
        reports: list = []
        self.patch(import_loop, "emit", reports.append)
        summary = await import_file(store, path, batch_size=4, in_flight=2)
        self.assertEqual(at_first_call, [4])
        self.assertEqual(
            [(r["line"], r["error"]) for r in reports], [(4, "MissingStateError"), (len(lines), "BadLine")]
        )
        self.assertEqual((summary["imported"], summary["failed"]), (len(events), 2))
