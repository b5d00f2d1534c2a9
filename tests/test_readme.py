"""README.md's "First ten minutes" runs as written, in a fresh shell."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

from twisted.trial import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_ten_minutes() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("\n## First ten minutes\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.S)
    return block


class FirstTenMinutesTests(unittest.TestCase):
    def test_runs_as_written_in_a_fresh_shell(self):
        block = first_ten_minutes()
        self.assertIn("--db sqlite:///var/first.db", block)
        for leftover in glob.glob(os.path.join(ROOT, "var", "first.db*")):
            os.remove(leftover)  # a fresh start, as for a new user
        # Nothing of this process's environment: no venv, no PYTHONPATH, a bare PATH.
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
        proc = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        summary = next(o for o in lines if "imported" in o)
        self.assertEqual((summary["imported"], summary["failed"]), (4002, 2))
        tables = {o["table"]: o["rows"] for o in lines if "table" in o}
        self.assertEqual(tables["events"], 4002)
        state = next(o for o in lines if "state" in o and "before" in o)
        self.assertEqual([s["type"] for s in state["state"]], ["m.room.create"])
        self.assertEqual(len([o for o in lines if o.get("room_id") == "!room0:example.org" and "type" in o]), 3)
        self.assertTrue(any("next_token" in o for o in lines))
        self.assertEqual(proc.stderr, "")
