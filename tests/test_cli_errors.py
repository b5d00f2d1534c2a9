"""Every error a person can cause is one line on stderr and a non-zero exit,
with no traceback (that needs -v): the real commands, as subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.cli.demo import SAMPLE_PATH

ROOT = Path(__file__).resolve().parents[1]
COMPACT = str(ROOT / "bin" / "roomstore-compact")

#: Every command that opens a store, with the arguments it needs besides --db.
COMMANDS = {
    "init": [],
    "import": [SAMPLE_PATH],
    "state": ["$" + "A" * 43],
    "messages": ["!room0:example.org", "--user", "@user0:example.org"],
    "sync": ["--user", "@user0:example.org"],
    "recent": ["--user", "@user0:example.org"],
    "stats": [],
    "demo": [],
    "serve": ["--replication-port", "0"],
    "follow": ["--server", "127.0.0.1:1"],
}


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=tempfile.mkdtemp(prefix="roomstore-errors-")
    )


def roomstore(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "roomstore.cli", *args])


def closed_port() -> int:
    """A loopback port where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneLineErrorTests(unittest.TestCase):
    def assert_one_line(self, proc: subprocess.CompletedProcess, *wanted: str) -> None:
        lines = proc.stderr.strip().splitlines()
        self.assertNotEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        for text in wanted:
            self.assertIn(text, lines[0])

    async def test_postgresql_where_nothing_listens(self):
        url = f"postgresql://roomstore@127.0.0.1:{closed_port()}/roomstore"
        for command, extra in COMMANDS.items():
            proc = await threads.deferToThread(roomstore, command, *extra, "--db", url)
            self.assert_one_line(proc, f"roomstore {command}: cannot connect to PostgreSQL", "is the server running")

    async def test_sqlite_file_that_is_not_a_database(self):
        directory = tempfile.mkdtemp(prefix="roomstore-notdb-")
        path = os.path.join(directory, "notes.db")
        with open(path, "wb") as handle:
            handle.write(b"these are my notes, not a database\n" * 100)
        before = Path(path).read_bytes()
        for command, extra in COMMANDS.items():
            proc = await threads.deferToThread(roomstore, command, *extra, "--db", f"sqlite:///{path}")
            self.assert_one_line(proc, f"roomstore {command}:", "is not a SQLite database")
        self.assertEqual(Path(path).read_bytes(), before)  # left as it was
        # No -wal/-shm beside it (the writing commands' lock file may be there).
        self.assertLessEqual(set(os.listdir(directory)), {"notes.db", "notes.db.writer-lock"})

    async def test_compact_unreachable_master(self):
        directory = tempfile.mkdtemp(prefix="roomstore-compact-")
        db = os.path.join(directory, "store.db")
        proc = await threads.deferToThread(roomstore, "init", "--db", f"sqlite:///{db}")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        proc = await threads.deferToThread(run, [COMPACT, "--db", f"sqlite:///{db}", "--master", "spark://127.0.0.1:1"])
        self.assert_one_line(proc, "roomstore-compact: cannot reach the Spark master spark://127.0.0.1:1")

    async def test_compact_database_problems(self):
        directory = tempfile.mkdtemp(prefix="roomstore-compact-")
        notdb = os.path.join(directory, "notes.db")
        with open(notdb, "w") as handle:
            handle.write("not a database\n")
        for url, wanted in (
            (f"postgresql://roomstore@127.0.0.1:{closed_port()}/roomstore", "cannot connect to PostgreSQL"),
            (f"sqlite:///{notdb}", "is not a SQLite database"),
            (f"sqlite:///{directory}/missing.db", "does not exist"),
        ):
            proc = await threads.deferToThread(run, [COMPACT, "--db", url])
            self.assert_one_line(proc, "roomstore-compact:", wanted)


class ClosedPipeTests(unittest.TestCase):
    async def test_a_reader_that_leaves_early_ends_the_command_quietly(self):
        """``roomstore stats | head -1``: no BrokenPipeError line, the exit code of a tool killed by SIGPIPE."""
        directory = tempfile.mkdtemp(prefix="roomstore-pipe-")
        url = f"sqlite:///{os.path.join(directory, 'store.db')}"
        self.assertEqual((await threads.deferToThread(roomstore, "import", SAMPLE_PATH, "--db", url)).returncode, 0)

        def stats_into_a_closed_pipe() -> tuple[int, str]:
            read_end, write_end = os.pipe()
            os.close(read_end)  # the reader is gone before anything is written
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            proc = subprocess.run(
                [sys.executable, "-m", "roomstore.cli", "stats", "--db", url],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                timeout=120,
            )
            os.close(write_end)
            return proc.returncode, proc.stderr

        code, err = await threads.deferToThread(stats_into_a_closed_pipe)
        self.assertEqual(err, "")
        self.assertEqual(code, 141)
