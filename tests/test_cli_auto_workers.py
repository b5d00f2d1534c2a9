"""``roomstore import --validation-processes auto`` (the default): a worker
process for a large file on a machine with cores to spare, none otherwise."""

from __future__ import annotations

import os
import tempfile

from twisted.trial import unittest

from roomstore import cli
from roomstore.cli import imports


class AutoValidationProcessesTests(unittest.TestCase):
    def file_of(self, lines: int) -> str:
        handle, path = tempfile.mkstemp(suffix=".jsonl")
        with os.fdopen(handle, "wb") as out:
            out.write(b"{}\n" * lines)
        self.addCleanup(os.remove, path)
        return path

    def cores(self, count: int) -> None:
        self.patch(imports.os, "sched_getaffinity", lambda pid: set(range(count)))

    def test_a_worker_from_the_threshold_on(self):
        self.cores(2)
        self.assertEqual(imports.auto_validation_processes(self.file_of(imports.AUTO_WORKER_LINES - 1)), 0)
        self.assertEqual(imports.auto_validation_processes(self.file_of(imports.AUTO_WORKER_LINES)), 1)

    def test_none_on_one_core(self):
        self.cores(1)
        self.assertEqual(imports.auto_validation_processes(self.file_of(imports.AUTO_WORKER_LINES * 3)), 0)

    def test_the_option_takes_auto_or_a_number(self):
        parser = cli.build_parser()
        parse = lambda *extra: parser.parse_args(["import", "events.jsonl", *extra]).validation_processes  # noqa: E731
        self.assertEqual(parse(), "auto")
        self.assertEqual(parse("--validation-processes", "2"), 2)
        self.assertEqual(parse("--validation-processes", "auto"), "auto")
