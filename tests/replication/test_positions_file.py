"""The worker's positions file: saved off the reactor, one write at a time,
the newest positions next, flushed on stop; a crash leaves a whole file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from twisted.internet import defer
from twisted.trial import unittest

from roomstore.replication import positions_file
from roomstore.replication.positions_file import PositionsFileWriter, load_positions, save_positions


class HeldThreads:
    """A thread runner the test drives: ``run(f, *args)`` is held until
    ``finish()`` runs it, as a thread would some time later."""

    def __init__(self) -> None:
        self.held: list[tuple] = []
        self.most_in_flight = 0
        self.calls = 0

    def __call__(self, f, *args) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        self.held.append((f, args, d))
        self.calls += 1
        self.most_in_flight = max(self.most_in_flight, len(self.held))
        return d

    def finish(self) -> None:
        f, args, d = self.held.pop(0)
        try:
            result = f(*args)
        except Exception:
            d.errback()
        else:
            d.callback(result)


def positions(token: int) -> dict[tuple[str, str], int]:
    return {("events", "master"): token, ("caches", "master"): token // 2}


class PositionsFileWriterTests(unittest.TestCase):
    def setUp(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(), "positions.json")
        self.threads = HeldThreads()
        self.writer = PositionsFileWriter(self.path, self.threads)

    def test_updates_during_a_write_coalesce_into_one_write_of_the_newest(self):
        self.writer.update(positions(1))
        self.assertEqual(self.threads.calls, 1)
        self.assertIsNone(load_positions(self.path), "written on the reactor thread")
        for token in range(2, 12):
            self.writer.update(positions(token))
        self.assertEqual(self.threads.calls, 1, "a second write while one is in flight")
        self.threads.finish()
        self.assertEqual(load_positions(self.path), positions(1))
        self.assertEqual(self.threads.calls, 2)
        self.assertEqual(self.threads.held[0][1][1], positions(11), "the next write is of the newest positions")
        self.threads.finish()
        self.assertEqual(load_positions(self.path), positions(11))
        self.assertEqual((self.threads.calls, self.threads.held, self.threads.most_in_flight), (2, [], 1))
        # Idle again: the next update writes at once.
        self.writer.update(positions(12))
        self.assertEqual(self.threads.calls, 3)
        self.threads.finish()
        self.assertEqual(load_positions(self.path), positions(12))

    def test_the_positions_it_writes_are_a_copy(self):
        given = positions(1)
        self.writer.update(given)
        given[("events", "master")] = 99  # the caller's dict moves on meanwhile
        self.threads.finish()
        self.assertEqual(load_positions(self.path), positions(1))

    def test_flush_waits_for_the_write_in_flight_then_writes_the_newest(self):
        self.writer.update(positions(1))
        self.writer.update(positions(2))
        flushed = defer.ensureDeferred(self.writer.flush())
        self.assertFalse(flushed.called)
        self.threads.finish()  # positions(1); positions(2) starts
        self.assertFalse(flushed.called)
        self.threads.finish()
        self.assertTrue(flushed.called)
        self.assertEqual(load_positions(self.path), positions(2))
        self.assertEqual(self.threads.calls, 2)

    def test_flush_with_nothing_new_writes_nothing(self):
        self.successResultOf(defer.ensureDeferred(self.writer.flush()))
        self.assertEqual(self.threads.calls, 0)
        self.writer.update(positions(3))
        self.threads.finish()
        self.successResultOf(defer.ensureDeferred(self.writer.flush()))
        self.assertEqual(self.threads.calls, 1)

    def test_a_crash_before_the_rename_leaves_the_previous_file(self):
        save_positions(self.path, positions(1))

        def crash(src, dst):
            raise OSError(28, "No space left on device")

        self.patch(positions_file.os, "replace", crash)
        with self.assertRaises(OSError):
            save_positions(self.path, positions(2))
        self.assertEqual(load_positions(self.path), positions(1))

    def test_a_failed_write_is_logged_and_the_next_update_writes_the_newest(self):
        save_positions(self.path, positions(1))
        real_replace = os.replace

        def crash(src, dst):
            raise OSError(28, "No space left on device")

        self.patch(positions_file.os, "replace", crash)
        self.writer.update(positions(2))
        self.writer.update(positions(3))  # arrives while the failing write runs
        self.threads.finish()
        self.assertEqual(len(self.flushLoggedErrors()), 0)  # a warning line, not a traceback
        self.assertEqual(load_positions(self.path), positions(1))
        self.assertEqual(self.threads.held, [], "no retry loop on a failing disk")
        self.patch(positions_file.os, "replace", real_replace)
        self.writer.update(positions(4))
        self.threads.finish()
        self.assertEqual(load_positions(self.path), positions(4))

    def test_flush_after_a_failed_write_tries_the_newest_once(self):
        def crash(src, dst):
            raise OSError(30, "Read-only file system")

        self.patch(positions_file.os, "replace", crash)
        self.writer.update(positions(1))
        self.threads.finish()
        flushed = defer.ensureDeferred(self.writer.flush())
        self.assertEqual(self.threads.calls, 2)
        self.threads.finish()  # fails again: flush gives up (logged) rather than spin
        self.successResultOf(flushed)
        self.assertEqual(self.threads.held, [])


_SAVER = """
import sys
from roomstore.replication.positions_file import save_positions
path = sys.argv[1]
print("ready", flush=True)
token = 0
while True:
    token += 1
    save_positions(path, {("events", "master"): token, ("caches", "master"): token // 2,
                          ("backfill", "master"): 7})
"""


class KilledMidWriteTests(unittest.TestCase):
    def test_a_process_killed_while_saving_leaves_a_whole_file(self):
        """SIGKILL at moments of a loop of saves: the file is always one whole
        set of positions, never torn or missing."""
        path = os.path.join(tempfile.mkdtemp(), "positions.json")
        save_positions(path, {("events", "master"): 0, ("caches", "master"): 0, ("backfill", "master"): 7})
        last = 0
        for delay in (0.05, 0.13, 0.21):
            proc = subprocess.Popen([sys.executable, "-c", _SAVER, path], stdout=subprocess.PIPE)
            self.assertEqual(proc.stdout.readline().strip(), b"ready")
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            saved = load_positions(path)
            self.assertIsNotNone(saved, open(path).read()[:200])
            self.assertEqual(set(saved), {("events", "master"), ("caches", "master"), ("backfill", "master")})
            self.assertEqual(saved[("caches", "master")], saved[("events", "master")] // 2)
            last = max(last, saved[("events", "master")])
            with open(path) as handle:
                json.load(handle)
        self.assertGreater(last, 0)
