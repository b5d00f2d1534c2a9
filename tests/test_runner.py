"""bin/test (tests/runner.py): options alone run the whole suite, a run of no
tests fails, a killed run is a failure (issue 11 item 2)."""

from __future__ import annotations

import os
import subprocess

from twisted.internet import threads
from twisted.trial import unittest

from tests.runner import summarise, with_default_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RunnerTests(unittest.TestCase):
    def test_options_alone_select_the_whole_suite(self):
        self.assertEqual(with_default_tests([]), ["tests"])
        self.assertEqual(with_default_tests(["--reporter=timing"]), ["--reporter=timing", "tests"])
        self.assertEqual(
            with_default_tests(["--reporter", "timing", "-j", "2"]), ["--reporter", "timing", "-j", "2", "tests"]
        )
        self.assertEqual(with_default_tests(["-z", "7", "tests.streams"]), ["-z", "7", "tests.streams"])
        self.assertEqual(with_default_tests(["--testmodule=roomstore/cli.py"]), ["--testmodule=roomstore/cli.py"])

    def test_summaries(self):
        self.assertEqual(summarise("...\nPASSED (successes=3, skips=1)\n"), (3, 0, 1))
        self.assertEqual(summarise("FAILED (failures=1, errors=2, successes=4)\n"), (4, 3, 0))
        # No tests ran, or trial never printed its result (killed): failures.
        self.assertEqual(summarise("Running 0 tests.\n\nPASSED\n"), (0, 1, 0))
        self.assertEqual(summarise("Running 12 tests.\ntest_a ... [OK]\n"), (0, 1, 0))

    async def test_a_selection_of_no_tests_fails(self):
        # tests.db holds helpers and no tests: trial -j would hang on it.
        proc = await threads.deferToThread(
            subprocess.run,
            [os.path.join(ROOT, "bin", "test"), "tests.db"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertNotEqual(proc.returncode, 0, proc.stdout)
        self.assertTrue(proc.stdout.strip(), proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip().splitlines()[-1], "0 passed, 1 failed")

    async def test_options_alone_run_tests(self):
        # --dry-run keeps this quick: the whole suite is selected, none run.
        proc = await threads.deferToThread(
            subprocess.run,
            [os.path.join(ROOT, "bin", "test"), "--reporter=timing", "--dry-run"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertTrue(proc.stdout.strip(), proc.stderr[-3000:])
        last = proc.stdout.strip().splitlines()[-1]
        passed = int(last.split()[0])
        self.assertGreater(passed, 500, proc.stdout[-2000:])


class StaticCheckTests(unittest.TestCase):
    """bin/check (which bin/test runs first) fails on a finding of each tool, with one line per check."""

    async def test_a_finding_fails_with_a_line_naming_the_check(self):
        tree = self.mktemp()
        for folder in ("bin", "roomstore", "tests", "bench", "twisted"):
            os.makedirs(os.path.join(tree, folder))
        for name in ("bin/check", "pyproject.toml"):
            with open(os.path.join(ROOT, name), "rb") as source, open(os.path.join(tree, name), "wb") as copy:
                copy.write(source.read())
        os.chmod(os.path.join(tree, "bin", "check"), 0o755)
        os.symlink(os.path.join(ROOT, ".venv"), os.path.join(tree, ".venv"))
        with open(os.path.join(tree, "roomstore", "__init__.py"), "w") as module:
            # An unused import (ruff), single quotes (ruff format), a str returned as an int (mypy).
            module.write("import os\n\n\ndef f() -> int:\n    return 'x'\n")
        proc = await threads.deferToThread(
            subprocess.run, [os.path.join(tree, "bin", "check")], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("check: ")]
        self.assertEqual(
            [line.split(" found ")[0] for line in lines], ["check: ruff check", "check: ruff format", "check: mypy"]
        )
        self.assertIn("F401", proc.stdout)
        self.assertIn("[return-value]", proc.stdout)
