"""The collector's settings for a bulk load (``roomstore.cli.common.bulk_load_gc``):
set while ``import`` and ``import-synapse`` load, as they were afterwards."""

from __future__ import annotations

import gc
import os
import tempfile

from twisted.internet import reactor
from twisted.trial import unittest

from roomstore import cli
from roomstore.cli import imports
from roomstore.cli.common import BULK_GC_THRESHOLDS, bulk_load_gc
from roomstore.demo.sample import sample_lines


class BulkLoadGcTests(unittest.TestCase):
    def test_thresholds_and_freeze_inside_and_restored_after(self):
        before = gc.get_threshold()
        frozen = gc.get_freeze_count()
        with bulk_load_gc():
            self.assertEqual(gc.get_threshold(), BULK_GC_THRESHOLDS)
            # What existed at the start is out of every collection now.
            self.assertGreater(gc.get_freeze_count(), frozen)
            self.assertTrue(gc.isenabled())
        self.assertEqual(gc.get_threshold(), before)
        self.assertEqual(gc.get_freeze_count(), 0)

    def test_restored_after_an_error(self):
        before = gc.get_threshold()
        with self.assertRaises(KeyError), bulk_load_gc():
            raise KeyError("x")
        self.assertEqual(gc.get_threshold(), before)
        self.assertEqual(gc.get_freeze_count(), 0)

    def test_cycles_made_during_the_load_are_still_collected(self):
        collected = []

        class Node:
            def __del__(self):
                collected.append(True)

        with bulk_load_gc():
            node = Node()
            node.me = node  # a cycle only the collector frees
            del node
            # Allocations alone trigger it: no gc.collect() here.
            keep = [[i] for i in range(BULK_GC_THRESHOLDS[0] * 2)]
        del keep
        self.assertEqual(collected, [True])


class ImportUnderBulkGcTests(unittest.TestCase):
    async def test_import_runs_its_load_under_the_bulk_settings(self):
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "events.jsonl")
        with open(path, "wb") as out:
            out.writelines((line + "\n").encode() for line in sample_lines(rooms=1, events_per_room=20, seed=3))
        seen = []
        real = imports.import_file

        async def recording(*args, **kwargs):
            seen.append(gc.get_threshold())
            return await real(*args, **kwargs)

        self.patch(imports, "import_file", recording)
        self.patch(imports, "emit", lambda obj: None)
        before = gc.get_threshold()
        args = cli.build_parser().parse_args(["import", path, "--db", "sqlite:///" + os.path.join(directory, "s.db")])
        await imports.cmd_import(reactor, args)
        self.assertEqual(seen, [BULK_GC_THRESHOLDS])
        self.assertEqual(gc.get_threshold(), before)
