"""How the bulk loads run: the collector's settings (``roomstore.cli.common.bulk_load_gc``),
set while ``import`` and ``import-synapse`` load, as they were afterwards;
and ``import-synapse``'s writes in a writer process of their own
(``open_store(bulk_writer_process=True)``)."""

from __future__ import annotations

import gc
import os
import tempfile
import types

from twisted.internet import reactor
from twisted.trial import unittest

from roomstore import cli
from roomstore.cli import imports
from roomstore.cli import synapse as synapse_commands
from roomstore.cli.common import BULK_GC_THRESHOLDS, bulk_load_gc, open_store
from roomstore.demo.sample import sample_lines
from roomstore.store_writes import ForwardedWrites, LocalWrites


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


class BulkWriterProcessTests(unittest.TestCase):
    def args(self, url: str, *extra: str):
        return cli.build_parser().parse_args(["import-synapse", "--from", "x.db", "--db", url, *extra])

    async def test_the_writes_in_a_child_at_normal_priority_with_the_bulk_collector(self):
        directory = tempfile.mkdtemp()
        store = await open_store(
            reactor, self.args("sqlite:///" + os.path.join(directory, "s.db")), create=True, bulk_writer_process=True
        )
        self.addCleanup(store.close)
        self.assertIsInstance(store.writes, ForwardedWrites)
        child = store.writes.process._transport.pid
        self.assertNotEqual(child, os.getpid())
        self.assertEqual(os.getpriority(os.PRIO_PROCESS, child), os.getpriority(os.PRIO_PROCESS, 0))
        if hasattr(os, "SCHED_IDLE"):
            self.assertNotEqual(os.sched_getscheduler(child), os.SCHED_IDLE)
        self.assertEqual(store.config.writer_process_gc, BULK_GC_THRESHOLDS)
        self.assertEqual(store.config.writer_process_log_level, "warn")

    async def test_verbose_lets_the_child_log_info(self):
        directory = tempfile.mkdtemp()
        args = self.args("sqlite:///" + os.path.join(directory, "s.db"), "-v")
        store = await open_store(reactor, args, create=True, bulk_writer_process=True)
        self.addCleanup(store.close)
        self.assertEqual(store.config.writer_process_log_level, "info")

    async def test_an_in_memory_database_is_written_here(self):
        store = await open_store(reactor, self.args("sqlite:///:memory:"), create=True, bulk_writer_process=True)
        self.addCleanup(store.close)
        self.assertIsInstance(store.writes, LocalWrites)

    async def test_import_synapse_asks_for_it(self):
        seen = []

        async def recording(reactor, args, **kwargs):
            seen.append(kwargs.get("bulk_writer_process"))
            raise RuntimeError("stop here")

        async def reader(reactor, args):
            class Reader:
                source = types.SimpleNamespace(count_events=None)

                async def run(self, fn, *a):
                    return 10

                async def close(self):
                    pass

            return Reader()

        self.patch(synapse_commands, "open_store", recording)
        self.patch(synapse_commands, "open_synapse", reader)
        with self.assertRaises(RuntimeError):
            await synapse_commands.cmd_import_synapse(reactor, self.args("sqlite:///x.db"))
        self.assertEqual(seen, [True])
