"""``roomstore.processes``: the command and the writer process leave
without the interpreter's teardown, their output whole and their status
kept; the writer process and validation workers run with the bulk collector."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from twisted.trial import unittest

from roomstore.processes import code_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(source: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, env=env, timeout=60
    )


class LeaveNowTests(unittest.TestCase):
    def test_buffered_output_is_flushed_and_the_code_kept(self):
        done = run_python(
            """
            import atexit, sys
            from roomstore.processes import leave_now
            atexit.register(lambda: print("teardown ran"))
            sys.stdout.write("a line not yet flushed\\n")
            sys.stderr.write("and one on stderr\\n")
            leave_now(3)
            print("not reached")
            """
        )
        self.assertEqual(done.returncode, 3)
        self.assertEqual(done.stdout, "a line not yet flushed\n")
        self.assertEqual(done.stderr, "and one on stderr\n")

    def test_a_closed_stdout_does_not_stop_it(self):
        done = run_python(
            """
            import sys
            from roomstore.processes import leave_now
            sys.stdout.write("lost")
            sys.stdout.close()
            leave_now(0)
            """
        )
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_code_of_reads_a_system_exit_as_the_interpreter_does(self):
        self.assertEqual(code_of(SystemExit()), 0)
        self.assertEqual(code_of(SystemExit(None)), 0)
        self.assertEqual(code_of(SystemExit(2)), 2)
        self.assertEqual(code_of(SystemExit(141)), 141)

    def test_code_of_writes_a_message_and_gives_1(self):
        done = run_python(
            """
            import sys
            from roomstore.processes import code_of
            sys.exit(code_of(SystemExit("roomstore: a message")))
            """
        )
        self.assertEqual((done.returncode, done.stderr), (1, "roomstore: a message\n"))


class CommandExitTests(unittest.TestCase):
    """``roomstore.cli.main`` leaves through ``leave_now``, with the command's status."""

    def run_cli(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=ROOT)
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "import atexit; atexit.register(print, 'teardown ran'); from roomstore.cli import main; main()",
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    def test_a_command_that_succeeds(self):
        path = os.path.join(self.mktemp() + ".db")
        done = self.run_cli("init", "--db", f"sqlite:///{os.path.abspath(path)}")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn('"schema_version"', done.stdout)
        self.assertNotIn("teardown ran", done.stdout)

    def test_a_command_that_fails_keeps_its_status_and_line(self):
        done = self.run_cli("import", os.path.abspath(self.mktemp()), "--db", "sqlite:///:memory:")
        self.assertEqual(done.returncode, 2)
        self.assertEqual(done.stderr.count("\n"), 1, done.stderr)
        self.assertIn("no such file", done.stderr)
        self.assertNotIn("teardown ran", done.stdout)


class CollectorTests(unittest.TestCase):
    def test_tune_collector_freezes_what_exists_and_sets_thresholds(self):
        done = run_python(
            """
            import gc
            from roomstore.processes import tune_collector
            tune_collector((1234, 5, 6))
            print(gc.get_threshold(), gc.get_freeze_count() > 0)
            """
        )
        self.assertEqual(done.stdout.strip(), "(1234, 5, 6) True", done.stderr)

    def test_a_validation_worker_runs_with_its_thresholds(self):
        # The worker's main, with serve() reporting the collector it runs under.
        done = run_python(
            """
            import gc, sys
            from roomstore.events.write import validation_worker as worker
            def serve(requests, replies):
                print(gc.get_threshold(), gc.get_freeze_count() > 0, file=sys.stderr)
            worker.serve = serve
            worker.main()
            """
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stderr.strip(), "(50000, 20, 100) True")

    def test_a_validation_worker_whose_asker_is_gone_leaves_quietly(self):
        # Its store's process killed mid-batch: the reply's write finds no
        # reader. It used to print a BrokenPipeError traceback.
        import pickle
        import struct

        env = dict(os.environ, PYTHONPATH=ROOT)
        worker = subprocess.Popen(
            [sys.executable, "-m", "roomstore.events.write.validation_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        header = struct.Struct("!Q")
        (length,) = header.unpack(worker.stdout.read(header.size))
        self.assertEqual(pickle.loads(worker.stdout.read(length)), ("ready",))
        worker.stdout.close()  # the asker is gone
        request = pickle.dumps(([], {}))
        worker.stdin.write(header.pack(len(request)) + request)
        worker.stdin.close()
        self.assertEqual(worker.wait(timeout=60), 0)
        self.assertEqual(worker.stderr.read(), b"")
        worker.stderr.close()
