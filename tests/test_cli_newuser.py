"""What a new user hit on the command line (issue 11), each run as a real
process: wrong answers, silent traps and tracebacks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder
from tests.test_cli import ROOT, run_cli

ALICE = "@alice:example.org"


def write_lines(lines: list[str]) -> str:
    directory = tempfile.mkdtemp(prefix="roomstore-import-")
    path = os.path.join(directory, "events.jsonl")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
    return path


def assert_one_line(case: unittest.TestCase, stderr: str) -> None:
    case.assertNotIn("Traceback", stderr)
    case.assertEqual(len(stderr.strip().splitlines()), 1, stderr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@on_both_engines
class NewUserCliTests:
    async def cli(self, *args):
        return await threads.deferToThread(run_cli, *args)

    async def stored_bytes(self, url: str, event_id: str) -> bytes | None:
        store = await RoomStore.open(url, create=False)
        try:
            return await store.get_event_json_bytes(event_id)
        finally:
            await store.close()

    async def test_wrapped_line_keeps_the_event_bytes(self):
        room = RoomBuilder()
        create, join = room.create(), room.join(ALICE)
        # Spaces after separators, keys out of canonical order: not what a
        # compact re-serialisation would give.
        spaced = [json.dumps(e.event, separators=(", ", ": ")) for e in (create, join)]
        lines = [
            f'{{"room_version" : "10",  "event" : {spaced[0]} }}',
            f'{{"event": {spaced[1]}, "room_version": "10"}}',
        ]
        url = self.new_database_url()
        code, out, err = await self.cli("import", write_lines(lines), "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual(out[-1]["imported"], 2)
        self.assertEqual(await self.stored_bytes(url, create.event_id), spaced[0].encode())
        self.assertEqual(await self.stored_bytes(url, join.event_id), spaced[1].encode())

    async def test_event_twice_in_a_file_counts_once(self):
        room = RoomBuilder()
        lines = [json.dumps({"room_version": "10", "event": e.event}) for e in (room.create(), room.join(ALICE))]
        url = self.new_database_url()
        code, out, err = await self.cli("import", write_lines(lines + lines[1:]), "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual((out[-1]["imported"], out[-1]["already_present"]), (2, 1))
        self.assertEqual(out[-1]["current_token"], "s2")

    async def test_reimport_leaves_the_stream_where_it_was(self):
        room = RoomBuilder()
        events = [room.create(), room.join(ALICE)] + [room.message(ALICE, f"m{i}") for i in range(5)]
        path = write_lines([json.dumps(e.event) for e in events])
        url = self.new_database_url()
        code, first, err = await self.cli("import", path, "--db", url)
        self.assertEqual(code, 0, err)
        code, again, err = await self.cli("import", path, "--db", url)
        self.assertEqual(code, 0, err)
        self.assertEqual(again[-1]["already_present"], len(events))
        self.assertEqual(again[-1]["current_token"], first[-1]["current_token"])

    async def test_messages_for_an_unknown_room(self):
        url = self.new_database_url()
        code, _, err = await self.cli("init", "--db", url)
        self.assertEqual(code, 0, err)
        code, out, err = await self.cli("messages", "!nowhere:example.org", "--user", ALICE, "--db", url)
        self.assertEqual(code, 2)
        self.assertEqual(out, [])
        self.assertIn("unknown room !nowhere:example.org", err)
        assert_one_line(self, err)

    async def test_sync_from_a_token_ahead_of_the_stream(self):
        room = RoomBuilder()
        url = self.new_database_url()
        code, _, err = await self.cli("import", write_lines([json.dumps(room.create().event)]), "--db", url)
        self.assertEqual(code, 0, err)
        code, out, err = await self.cli("sync", "--user", ALICE, "--since", "s99999", "--db", url)
        self.assertEqual((code, out), (2, []))
        self.assertIn("'s99999' is ahead of the events stream (now at 's1')", err)
        assert_one_line(self, err)

    async def test_directory_as_the_import_file(self):
        url = self.new_database_url()
        code, _, err = await self.cli("import", tempfile.mkdtemp(), "--db", url)
        self.assertEqual(code, 2)
        self.assertIn("is a directory", err)
        assert_one_line(self, err)


class MissingDatabaseTests(unittest.TestCase):
    """A mistyped SQLite path is an error, not a new empty database."""

    def test_read_commands_do_not_create_a_database(self):
        base = tempfile.mkdtemp(prefix="roomstore-missing-")
        path = os.path.join(base, "typo", "roomstore.db")
        url = f"sqlite:///{path}"
        for args in (
            ["stats"],
            ["state", "$" + "A" * 43],
            ["messages", "!r:example.org", "--user", ALICE],
            ["sync", "--user", ALICE],
            ["recent", "--user", ALICE],
        ):
            code, out, err = run_cli(*args, "--db", url)
            self.assertEqual(code, 2, (args, err))
            self.assertIn("does not exist", err)
            assert_one_line(self, err)
        self.assertEqual(os.listdir(base), [])

    def test_compaction_does_not_create_a_database(self):
        base = tempfile.mkdtemp(prefix="roomstore-missing-")
        url = f"sqlite:///{base}/typo/roomstore.db"
        proc = subprocess.run(
            [os.path.join(ROOT, "bin", "roomstore-compact"), "--db", url, "--dry-run"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("does not exist", proc.stderr)
        assert_one_line(self, proc.stderr)
        self.assertEqual(os.listdir(base), [])

    def test_init_creates_one(self):
        base = tempfile.mkdtemp(prefix="roomstore-new-")
        code, _, err = run_cli("init", "--db", f"sqlite:///{base}/new/roomstore.db")
        self.assertEqual(code, 0, err)
        self.assertTrue(os.path.isfile(os.path.join(base, "new", "roomstore.db")))


class ReadableErrorTests(unittest.TestCase):
    def test_postgres_unreachable(self):
        port = free_port()  # nothing listens there
        code, out, err = run_cli("stats", "--db", f"postgresql://postgres@127.0.0.1:{port}/roomstore")
        self.assertEqual(code, 2)
        self.assertIn(f"cannot connect to PostgreSQL postgresql://127.0.0.1:{port}/roomstore", err)
        assert_one_line(self, err)

    def test_serve_on_a_busy_port(self):
        base = tempfile.mkdtemp(prefix="roomstore-serve-")
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            code, out, err = run_cli("serve", "--db", f"sqlite:///{base}/r.db", "--replication-port", str(port))
        self.assertEqual(code, 2)
        self.assertIn("Address already in use", err)
        assert_one_line(self, err)

    def test_follow_logs_each_failed_attempt(self):
        base = tempfile.mkdtemp(prefix="roomstore-follow-")
        port = free_port()  # nothing listens there
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        marker = f"replication connection to 127.0.0.1:{port} failed"
        with tempfile.TemporaryFile(mode="w+") as stderr:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roomstore.cli",
                    "follow",
                    "--db",
                    f"sqlite:///{base}/w.db",
                    "--server",
                    f"127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                env=env,
            )
            try:
                # Retries come about 0.5 s, then 1.4 s, then 3.7 s apart.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    stderr.seek(0)
                    if stderr.read().count(marker) >= 3:
                        break
                    time.sleep(0.2)
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
            stderr.seek(0)
            err = stderr.read()
        attempts = [line for line in err.splitlines() if marker in line]
        self.assertGreaterEqual(len(attempts), 3, err)
        self.assertIn("Connection refused", attempts[0])
        self.assertIn("retrying in", attempts[0])
        self.assertIn("(retry 1)", attempts[0])
        self.assertIn("(retry 3)", attempts[2])
        self.assertNotIn("Traceback", err)


class HelpTextTests(unittest.TestCase):
    """Every option of every command says what it is for."""

    def undocumented(self, parser) -> list[str]:
        import argparse

        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += [f"{name} {m}" for m in self.undocumented(sub)]
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append("/".join(action.option_strings) or action.dest)
        return missing

    def test_roomstore_options(self):
        from roomstore.cli import build_parser

        self.assertEqual(self.undocumented(build_parser()), [])

    def test_roomstore_compact_options(self):
        from roomstore.compaction.job.options import submit_parser

        self.assertEqual(self.undocumented(submit_parser()), [])
