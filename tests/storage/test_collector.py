"""Pausing the cyclic garbage collector around bulk work (``storage.collector``)."""

from __future__ import annotations

import gc
import threading

from twisted.trial import unittest

from roomstore.storage.collector import collector_paused


class CollectorPausedTests(unittest.TestCase):
    def setUp(self) -> None:
        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)

    def test_pauses_nest_and_the_last_one_enables_it_again(self) -> None:
        gc.enable()
        with collector_paused():
            self.assertFalse(gc.isenabled())
            with collector_paused():
                self.assertFalse(gc.isenabled())
            self.assertFalse(gc.isenabled())
        self.assertTrue(gc.isenabled())

    def test_a_collector_turned_off_stays_off(self) -> None:
        gc.disable()
        with collector_paused():
            self.assertFalse(gc.isenabled())
        self.assertFalse(gc.isenabled())

    def test_enabled_again_after_an_error(self) -> None:
        gc.enable()
        with self.assertRaises(ValueError):
            with collector_paused():
                raise ValueError("boom")
        self.assertTrue(gc.isenabled())

    def test_pauses_overlapping_in_threads(self) -> None:
        """One thread's pause ending inside another's leaves the collector
        off until the second ends too."""
        gc.enable()
        inside, release = threading.Event(), threading.Event()
        seen = []

        def other() -> None:
            with collector_paused():
                inside.set()
                release.wait(10)
            seen.append(gc.isenabled())

        thread = threading.Thread(target=other)
        with collector_paused():
            thread.start()
            self.assertTrue(inside.wait(10))
        self.assertFalse(gc.isenabled())  # the other thread's pause still holds it
        release.set()
        thread.join(10)
        self.assertEqual(seen, [True])
        self.assertTrue(gc.isenabled())

    def test_no_collection_for_objects_freed_inside(self) -> None:
        """Objects made and freed inside a pause bring on no collection
        inside it, and after it at most one of the youngest generation
        (tuples and lists freed into CPython's free lists leave the
        collector's count raised), which finds them gone: without the pause,
        dozens, and the older generations too."""
        gc.enable()
        gc.collect()
        collections = []

        def callback(phase, info):
            if phase == "start":
                collections.append(info["generation"])

        gc.callbacks.append(callback)
        self.addCleanup(gc.callbacks.remove, callback)
        with collector_paused():
            rows = [(index, [index]) for index in range(50_000)]
            del rows
        spare = [[index] for index in range(10)]
        self.assertIn(collections, ([], [0]))
        del spare
