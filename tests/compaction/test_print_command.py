"""``bin/roomstore-compact --print-command``: the line runs as printed from a
shell with no virtualenv active (one local Spark run), and an unreachable
standalone master fails fast in one line (the wrapper, and a direct
spark-submit of the printed line)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

from twisted.trial import unittest

from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = str(ROOT / "bin" / "roomstore-compact")
CLEAN = ["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c"]
#: "Fails fast": well before Spark's own retries of an unreachable standalone
#: master (about a minute), with room for a JVM starting on a loaded machine.
FAIL_FAST_S = 40


def printed_line(*args: str) -> str:
    proc = subprocess.run([WRAPPER, *args, "--print-command"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


class PrintCommandTests(unittest.TestCase):
    def small_store(self) -> str:
        directory = tempfile.mkdtemp(prefix="roomstore-print-command-")
        sample = os.path.join(directory, "sample.jsonl")
        code, _, err = run_cli("generate-sample", sample, "--rooms", "2", "--events-per-room", "150")
        self.assertEqual(code, 0, err)
        db = os.path.join(directory, "store.db")
        code, _, err = run_cli("import", sample, "--db", f"sqlite:///{db}")
        self.assertEqual(code, 0, err)
        return db

    def test_the_line_carries_what_it_needs(self):
        db = self.small_store()
        line = printed_line("--db", f"sqlite:///{db}", "--dry-run")
        words = shlex.split(line)
        self.assertEqual(words[0], "env")
        self.assertIn("SPARK_LOCAL_IP=" + os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"), words)
        self.assertTrue(any(w.startswith("SPARK_HOME=") for w in words))
        confs = [words[i + 1] for i, w in enumerate(words) if w == "--conf"]
        self.assertIn("spark.pyspark.driver.python=" + str(ROOT / ".venv" / "bin" / "python"), confs)
        self.assertIn("spark.pyspark.python=" + str(ROOT / ".venv" / "bin" / "python"), confs)
        self.assertTrue(words[words.index("--jars") + 1].endswith("sqlite-jdbc.jar"))
        self.assertTrue(os.path.isfile(words[words.index("--py-files") + 1]))
        # An executor Python of the operator's choice is kept, not doubled.
        line = printed_line(
            "--db", f"sqlite:///{db}", "--master", "spark://h:7077", "--conf", "spark.pyspark.python=/usr/bin/python3"
        )
        words = shlex.split(line)
        confs = [words[i + 1] for i, w in enumerate(words) if w == "--conf"]
        self.assertEqual(
            [c for c in confs if c.startswith("spark.pyspark.python=")], ["spark.pyspark.python=/usr/bin/python3"]
        )
        self.assertFalse(any(w.startswith("SPARK_LOCAL_IP=") for w in words))  # a cluster needs a real address

    def test_printed_line_runs_from_a_clean_shell(self):
        db = self.small_store()
        summary = db + ".summary.json"
        line = printed_line(
            "--db",
            f"sqlite:///{db}",
            "--summary-json",
            summary,
            "--conf",
            "spark.ui.enabled=false",
            "--driver-java-options=-XX:TieredStopAtLevel=1",
        )
        proc = subprocess.run(
            [*CLEAN, line], capture_output=True, text=True, timeout=600, cwd=tempfile.mkdtemp(prefix="roomstore-cwd-")
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertNotIn("SPARK_LOCAL_IP", proc.stderr)  # no loopback warning: the line sets it
        with open(summary) as handle:
            report = json.load(handle)
        self.assertGreater(report["totals"]["state_groups"], 0, report["totals"])
        self.assertEqual(report["totals"]["mismatched_groups"], 0)

    def test_unreachable_master_wrapper_is_one_line(self):
        db = self.small_store()
        started = time.monotonic()
        proc = subprocess.run(
            [WRAPPER, "--db", f"sqlite:///{db}", "--master", "spark://127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertLess(time.monotonic() - started, FAIL_FAST_S)
        self.assertNotEqual(proc.returncode, 0)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
        self.assertIn("cannot reach the Spark master spark://127.0.0.1:1", proc.stderr)

    def test_unreachable_master_direct_spark_submit_fails_fast(self):
        db = self.small_store()
        line = printed_line("--db", f"sqlite:///{db}", "--master", "spark://127.0.0.1:1")
        started = time.monotonic()
        proc = subprocess.run([*CLEAN, line], capture_output=True, text=True, timeout=120)
        self.assertLess(time.monotonic() - started, FAIL_FAST_S, proc.stderr)
        self.assertNotEqual(proc.returncode, 0)
        # Beside the JVM's own start-up notes, the job's reason is one line, with no trace
        # (spark-submit sends the Python driver's stderr to its stdout).
        output = proc.stdout + proc.stderr
        self.assertNotIn("Traceback", output)
        self.assertNotIn("\tat ", output)
        reasons = [line for line in output.splitlines() if "cannot reach the Spark master" in line]
        self.assertEqual(
            reasons,
            [
                "roomstore-compact: cannot reach the Spark master spark://127.0.0.1:1"
                " (127.0.0.1:1: Connection refused): start it, or check --master"
                " (local[*] runs Spark in this process)"
            ],
            output,
        )
