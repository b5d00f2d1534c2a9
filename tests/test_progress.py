"""Progress bars (tqdm) for import, the demo and compaction (issue 11 item 10):
drawn on a terminal, not into a pipe unless ``--progress`` asks."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import tempfile
import termios

from twisted.internet import threads
from twisted.trial import unittest

from roomstore.demo.sample import write_sample
from tests.db import DatabaseTestMixin
from tests.test_cli import ROOT, run_cli


def small_sample(events_per_room: int = 60) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="roomstore-progress-"), "sample.jsonl")
    write_sample(path, rooms=2, events_per_room=events_per_room, seed=4)
    return path


def run_on_a_terminal(*args: str) -> tuple[int, str]:
    """Run the command with stderr on a pseudo-terminal; (status, what it drew)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "roomstore.cli", *args], stdout=subprocess.DEVNULL, stderr=follower, env=env
        )
    finally:
        os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    return proc.wait(timeout=120), drawn.decode("utf-8", "replace")


class ProgressTests(unittest.TestCase):
    def test_import_draws_a_bar_on_a_terminal_only(self):
        sample = small_sample()
        base = tempfile.mkdtemp(prefix="roomstore-progress-")
        code, drawn = run_on_a_terminal("import", sample, "--db", f"sqlite:///{base}/tty.db")
        self.assertEqual(code, 0, drawn)
        self.assertIn("import: 100%|", drawn)
        lines = len(open(sample).read().splitlines())
        self.assertIn(f"{lines}/{lines}", drawn)
        code, out, err = run_cli("import", sample, "--db", f"sqlite:///{base}/pipe.db")
        self.assertEqual(code, 0, err)
        self.assertNotIn("import:", err)
        self.assertEqual(out[-1]["imported"] + out[-1]["failed"], lines)

    def test_progress_option_forces_it(self):
        sample = small_sample()
        base = tempfile.mkdtemp(prefix="roomstore-progress-")
        code, out, err = run_cli("import", sample, "--progress", "--db", f"sqlite:///{base}/a.db")
        self.assertEqual(code, 0, err)
        self.assertIn("import: 100%|", err)
        code, out, err = run_cli("demo", "--sample", sample, "--progress", "--db", f"sqlite:///{base}/demo.db")
        self.assertEqual(code, 0, err)
        self.assertIn("import: 100%|", err)
        self.assertTrue(any(o.get("demo") == "stats" for o in out))


class CompactionProgressTests(DatabaseTestMixin, unittest.TestCase):
    engine_name = "sqlite"
    timeout = 900

    async def test_compaction_progress(self):
        from tests.compaction.test_spark_job import run_job
        from tests.compaction.test_write_back import compaction_database

        url = await compaction_database(self)
        status, output = await threads.deferToThread(run_job, url, "--dry-run", "--progress")
        self.assertEqual(status, 0, output)
        self.assertRegex(output, r"compaction: 100%\|[^\n\r]*\| (\d+)/\1 ")
