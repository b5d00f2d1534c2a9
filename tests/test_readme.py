"""The README documents every command, every document and the token forms (issue 11 item 13), and its
"First ten minutes" runs as written, in a fresh shell (issue 26)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

from twisted.trial import unittest

from roomstore.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReadmeTests(unittest.TestCase):
    def setUp(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
            self.readme = handle.read()

    def test_every_command(self):
        for command in COMMANDS:
            self.assertIn(f"| `{command}", self.readme, command)
        self.assertIn("`bin/roomstore-compact --db", self.readme)

    def test_every_document(self):
        for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
            self.assertIn(f"`docs/{name}`", self.readme, name)
        for path in ("bench/README.md", "roomstore/schema/README.md"):
            self.assertIn(f"`{path}`", self.readme)

    def test_tokens_and_initial_sync(self):
        for form in ("`s<N>`", "`m<N>~<id>.<pos>~...`", "`t<depth>-<N>`"):
            self.assertIn(form, self.readme)
        self.assertIn("without `--since` an initial sync", self.readme)

    def test_the_sample_imports_whole_as_described(self):
        import tempfile

        from tests.test_cli import run_cli

        base = tempfile.mkdtemp(prefix="roomstore-readme-")
        code, out, err = run_cli("demo", "--db", f"sqlite:///{base}/demo.db")
        self.assertEqual(code, 0, err)
        self.assertEqual([(o["line"], o["error"]) for o in out if "error" in o], [])
        [summary] = [o for o in out if "import" in o and "imported" in o]
        self.assertEqual((summary["imported"], summary["failed"]), (4004, 0))
        for claim in ("imports all 4,004", "state resolution"):
            self.assertIn(claim, self.readme)
        for gone in ("`ConflictedStateError`", "the other 4,002"):
            self.assertNotIn(gone, self.readme)


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
        proc = subprocess.run(
            ["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        summary = next(o for o in lines if "imported" in o)
        self.assertEqual((summary["imported"], summary["failed"]), (4004, 0))
        tables = {o["table"]: o["rows"] for o in lines if "table" in o}
        self.assertEqual(tables["events"], 4004)
        state = next(o for o in lines if "state" in o and "before" in o)
        self.assertEqual([s["type"] for s in state["state"]], ["m.room.create"])
        self.assertEqual(
            len(
                [o for o in lines if o.get("room_id") == "!u6Uu_jrNs3kpjRg4NAqo3yLO4rCli2DeRapcDvlG24o" and "type" in o]
            ),
            3,
        )
        self.assertTrue(any("next_token" in o for o in lines))
        self.assertEqual(proc.stderr, "")
