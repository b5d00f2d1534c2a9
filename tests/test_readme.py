"""The README documents every command, every document and the token forms (issue 11 item 13)."""

from __future__ import annotations

import os

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

    def test_sample_failures_as_described(self):
        import tempfile

        from tests.test_cli import run_cli

        base = tempfile.mkdtemp(prefix="roomstore-readme-")
        code, out, err = run_cli("demo", "--db", f"sqlite:///{base}/demo.db")
        self.assertEqual(code, 0, err)
        failures = [(o["line"], o["error"]) for o in out if "error" in o]
        self.assertEqual(failures, [(4002, "ConflictedStateError"), (4003, "MissingStateError")])
        [summary] = [o for o in out if "import" in o and "imported" in o]
        self.assertEqual((summary["imported"], summary["failed"]), (4002, 2))
        for claim in ("(line 4002)", "(line 4003)", "`ConflictedStateError`", "`MissingStateError`", "the other 4,002"):
            self.assertIn(claim, self.readme)
