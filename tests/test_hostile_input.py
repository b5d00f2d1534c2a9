"""Hostile input (issue 40): each case an attacker tried against the real
commands, its file written here, one altered line among valid events.

What each must show: the bad line is refused in one line naming why, every
valid event beside it is stored, the command exits 0, the stream's position
is the count of stored events (a refusal takes none), and every read of the
room still works. Database URLs and files that cannot be opened: one line,
exit 2, no password anywhere in the output (``-v`` included).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.demo.sample import RoomGraphBuilder
from roomstore.pdu.parsing import MAX_JSON_NESTING

from .test_cli_errors import closed_port, roomstore
from .test_disk_full import TmpfsMixin

ALICE = "@alice:example.org"


def nested(levels: int) -> dict:
    """Content that, as an event's ``content``, nests the event ``levels + 2`` deep."""
    content: dict = {"x": 1}
    for _ in range(levels):
        content = {"a": content}
    return content


def deep_message(room: RoomGraphBuilder, levels: int, **kw):
    """A message nesting ``levels`` deep, hashed and named as a sender
    would: the builder's canonical JSON recurses, so with room to."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * levels + 1000))
    try:
        return room.build("m.room.message", ALICE, nested(levels), **kw)
    finally:
        sys.setrecursionlimit(limit)


def new_room(version: str) -> RoomGraphBuilder:
    """A room of ``version`` with its create event, alice's join and a message."""
    room = RoomGraphBuilder(room_id=f"!hostile{version}:example.org", version=version, creator=ALICE)
    room.create()
    room.join(ALICE)
    room.message(ALICE, "before")
    return room


def lines_of(room: RoomGraphBuilder) -> list[str]:
    # From each event's bytes: a deep one cannot be encoded again here.
    return [f'{{"room_version": "{room.version}", "event": {built.raw.decode()}}}' for built in room.events]


class ImportCaseMixin:
    def case_file(self, lines: list[str]) -> str:
        directory = tempfile.mkdtemp(prefix="roomstore-hostile-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "case.jsonl")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        self.db = f"sqlite:///{os.path.join(directory, 'case.db')}"
        return path

    async def cli(self, *args: str) -> subprocess.CompletedProcess:
        return await threads.deferToThread(roomstore, *args)

    async def import_case(self, lines: list[str]) -> tuple[list[dict], dict]:
        """(the lines reporting refused events, the summary); exit 0 and no stderr asserted."""
        proc = await self.cli("import", self.case_file(lines), "--db", self.db)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        out = [json.loads(line) for line in proc.stdout.splitlines()]
        return out[:-1], out[-1]

    async def assert_reads_work(self, room: RoomGraphBuilder, bodies: list[str]) -> None:
        """``messages`` and ``sync`` of the room succeed for its member and
        serve exactly the messages ``bodies``, newest first."""
        proc = await self.cli("messages", room.room_id, "--user", ALICE, "--limit", "50", "--db", self.db)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        *events, end = map(json.loads, proc.stdout.splitlines())
        self.assertIn("next_token", end)
        served = [ev["content"].get("body") for ev in events if ev["type"] == "m.room.message"]
        self.assertEqual(served, bodies)
        proc = await self.cli("sync", "--user", ALICE, "--limit", "50", "--db", self.db)
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def assert_refused(self, reports: list[dict], line: int, *fragments: str) -> None:
        mine = [r for r in reports if r["line"] == line]
        self.assertEqual(len(mine), 1, reports)
        self.assertNotIn("\n", mine[0]["message"])
        for fragment in fragments:
            self.assertIn(fragment, mine[0]["message"])


class ImportedEventsTests(ImportCaseMixin, unittest.TestCase):
    async def test_nesting_that_read_paths_could_not_decode_is_refused(self):
        # About 975 levels imported before, and then broke messages and sync.
        room = new_room("10")
        deep_message(room, 975, set_leaves=False)
        room.message(ALICE, "after")
        reports, summary = await self.import_case(lines_of(room))
        self.assert_refused(reports, 4, f"the limit is {MAX_JSON_NESTING}")
        self.assertEqual((summary["imported"], summary["failed"], summary["current_token"]), (4, 1, "s4"))
        await self.assert_reads_work(room, ["after", "before"])

    async def test_nesting_deeper_than_the_line_reader_is_one_bad_line(self):
        # About 980 levels or more stopped the whole import, nothing stored.
        room = new_room("10")
        deep_message(room, 2000, set_leaves=False)
        room.message(ALICE, "after")
        reports, summary = await self.import_case(lines_of(room))
        self.assert_refused(reports, 4, "nested too deeply", f"the limit is {MAX_JSON_NESTING}")
        self.assertEqual((summary["imported"], summary["failed"], summary["current_token"]), (4, 1, "s4"))
        await self.assert_reads_work(room, ["after", "before"])

    async def test_the_deepest_nesting_allowed_is_stored_and_reads_back(self):
        room = new_room("10")
        room.build("m.room.message", ALICE, {"body": "deep", "n": nested(MAX_JSON_NESTING - 3)})
        room.build("m.room.message", ALICE, {"body": "too deep", "n": nested(MAX_JSON_NESTING - 2)}, set_leaves=False)
        reports, summary = await self.import_case(lines_of(room))
        self.assert_refused(reports, 5, f"nested {MAX_JSON_NESTING + 1} levels deep")
        self.assertEqual(summary["imported"], 4)
        await self.assert_reads_work(room, ["deep", "before"])

    async def test_origin_server_ts_beyond_int64_in_a_version_5_room(self):
        # OverflowError from SQLite stopped the import before.
        room = new_room("5")
        room.build("m.room.message", ALICE, {"body": "late"}, extra={"origin_server_ts": 2**64}, set_leaves=False)
        room.message(ALICE, "after")
        reports, summary = await self.import_case(lines_of(room))
        self.assert_refused(reports, 4, "'origin_server_ts' must be a 64-bit integer")
        self.assertEqual((summary["imported"], summary["current_token"]), (4, "s4"))
        await self.assert_reads_work(room, ["after", "before"])

    async def test_a_version_1_event_citing_itself(self):
        # KeyError in the precheck stopped the import, and refused events took stream positions.
        room = new_room("1")
        stored = room.leaves[0]
        room.build(
            "m.room.message",
            ALICE,
            {"body": "self"},
            prev=["$self:example.org", stored],
            extra={"event_id": "$self:example.org"},
            set_leaves=False,
        )
        room.message(ALICE, "after", prev=[stored])
        reports, summary = await self.import_case(lines_of(room))
        self.assert_refused(reports, 4, "cites itself in 'prev_events'")
        self.assertEqual((summary["imported"], summary["failed"], summary["current_token"]), (4, 1, "s4"))
        await self.assert_reads_work(room, ["after", "before"])

    async def test_a_version_1_cycle_of_two_events_beside_a_stored_prev(self):
        room = new_room("1")
        stored = room.leaves[0]
        for name, other in (("A", "B"), ("B", "A")):
            room.build(
                "m.room.message",
                ALICE,
                {"body": name},
                prev=[f"${other}:example.org", stored],
                extra={"event_id": f"${name}:example.org"},
                set_leaves=False,
            )
        room.message(ALICE, "after", prev=[stored])
        reports, summary = await self.import_case(lines_of(room))
        for line in (4, 5):
            self.assert_refused(reports, line, "$A:example.org, $B:example.org", "cite each other round")
        self.assertEqual((summary["imported"], summary["failed"], summary["current_token"]), (4, 2, "s4"))
        await self.assert_reads_work(room, ["after", "before"])

    async def test_a_bare_pdu_with_an_event_key_is_not_unwrapped(self):
        # The outer event was dropped, counted imported, and the inner one stored and served.
        room = new_room("10")
        inner = room.build("m.room.message", ALICE, {"body": "inner"}, set_leaves=False).event
        outer = room.build("m.room.message", ALICE, {"body": "outer"}, extra={"event": inner})
        reports, summary = await self.import_case(lines_of(room)[:3] + [json.dumps(outer.event)])
        self.assertEqual((reports, summary["imported"]), ([], 4))
        proc = await self.cli("state", outer.event_id, "--db", self.db)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        await self.assert_reads_work(room, ["outer", "before"])

    async def test_wrapped_lines_of_another_shape_are_bad_lines(self):
        room = new_room("10")
        event = room.message(ALICE, "fine").event
        lines = lines_of(room)[:3] + [
            json.dumps({"room_version": "10", "event": event, "extra": 1}),
            json.dumps({"room_version": "10"}),
            json.dumps({"room_version": 10, "event": event}),
            json.dumps({"room_version": "10", "event": event}),
        ]
        reports, summary = await self.import_case(lines)
        self.assertEqual([(r["line"], r["error"]) for r in reports], [(4, "BadLine"), (5, "BadLine"), (6, "BadLine")])
        self.assertIn("only room_version and event, not 'extra'", reports[0]["message"])
        self.assertEqual((summary["imported"], summary["current_token"]), (4, "s4"))


class DatabaseUrlTests(ImportCaseMixin, TmpfsMixin, unittest.TestCase):
    def assert_one_line(self, proc: subprocess.CompletedProcess, *wanted: str, code: int = 2) -> None:
        self.assertEqual(proc.returncode, code, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        for text in wanted:
            self.assertIn(text, lines[0])

    async def test_a_password_is_never_shown(self):
        port = closed_port()
        for password, wanted in (
            ("se%zzcret", "has a '%' that is not followed by two hex digits"),
            ("se@cret", f'connection to server at "127.0.0.1", port {port} failed'),
        ):
            url = f"postgresql://bob:{password}@127.0.0.1:{port}/roomstore"
            for verbose in ((), ("-v",)):
                proc = await self.cli("stats", *verbose, "--db", url)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertNotIn(password, proc.stderr + proc.stdout)
                self.assertNotIn("cret", proc.stderr + proc.stdout)
                self.assertIn(wanted, proc.stderr)
        proc = await self.cli("stats", "--db", f"postgresql://bob:se@cret@127.0.0.1:{port}/")
        self.assert_one_line(proc, "'postgresql://bob:***@127.0.0.1", "must name a database")

    async def test_a_sqlite_path_that_is_a_directory(self):
        directory = tempfile.mkdtemp(prefix="roomstore-dir-")
        self.addCleanup(shutil.rmtree, directory, True)
        for command in ("init", "stats", "import"):
            extra = [os.devnull] if command == "import" else []
            proc = await self.cli(command, *extra, "--db", f"sqlite:///{directory}")
            self.assert_one_line(proc, "is a directory: give the path of a database file")

    async def test_a_read_only_mount(self):
        directory = self.small_tmpfs("20m")
        room = new_room("10")
        self.case_file(lines_of(room))
        path = os.path.join(directory, "store.db")
        proc = await self.cli("import", self.case_file(lines_of(room)), "--db", f"sqlite:///{path}")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
        for command in ("init", "import"):
            extra = [os.devnull] if command == "import" else []
            for target in (path, os.path.join(directory, "new.db"), os.path.join(directory, "sub", "new.db")):
                proc = await self.cli(command, *extra, "--db", f"sqlite:///{target}")
                self.assert_one_line(proc, "its file system is read-only")
        # A WAL database on a read-only mount reads (its log was folded in when the import closed it).
        proc = await self.cli("stats", "--db", f"sqlite:///{path}")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        rows = {row["table"]: row["rows"] for row in map(json.loads, proc.stdout.splitlines())}
        self.assertEqual(rows["events"], 3)
        self.db = f"sqlite:///{path}"
        await self.assert_reads_work(room, ["before"])
