"""InternCache, the interners' cache: bounded, hits promoted, bulk reads in order."""

from __future__ import annotations

from twisted.trial import unittest

from roomstore.storage.interning import InternCache, LruCache


class InternCacheTests(unittest.TestCase):
    def test_size_stays_within_the_bound(self):
        cache = InternCache(10)
        for i in range(1000):
            cache.set(i, f"v{i}")
            self.assertLessEqual(len(cache), 10)
            self.assertLessEqual(len(cache._young) + len(cache._old), 10)
        # The newest entries are still there; the oldest are gone.
        self.assertEqual(cache.get(999), "v999")
        self.assertIsNone(cache.get(0))
        self.assertEqual(cache.get(0, "default"), "default")

    def test_a_hit_in_the_old_generation_is_promoted(self):
        cache = InternCache(4)  # two generations of 2
        cache.set("a", 1)
        cache.set("b", 2)  # the young generation is full: it becomes the old one
        self.assertEqual(cache.get("a"), 1)  # promoted into the new young one
        cache.set("c", 3)  # full again: {a, c} old, {a, b} dropped but a lives on
        self.assertEqual(cache.get("a"), 1)
        self.assertIsNone(cache.get("b"))
        self.assertEqual(cache.get("c"), 3)

    def test_unused_entries_leave_after_two_turnovers(self):
        cache = InternCache(4)
        cache.set("a", 1)
        for key in "bcde":
            cache.set(key, key)
        self.assertNotIn("a", cache)
        self.assertIn("e", cache)

    def test_values_of_in_order_with_missing_indexes(self):
        cache = InternCache(100)
        for i in range(10):
            cache.set(i, i * 10)
        # All in the young generation: the bulk path.
        self.assertEqual(cache.values_of([3, 1, 3, 9]), ([30, 10, 30, 90], []))
        # Some unknown: None at their places and their indexes.
        self.assertEqual(cache.values_of([2, 42, 5, 43]), ([20, None, 50, None], [1, 3]))
        self.assertEqual(cache.values_of([7]), ([70], []))
        self.assertEqual(cache.values_of([77]), ([None], [0]))
        self.assertEqual(cache.values_of([]), ([], []))

    def test_values_of_promotes_old_hits(self):
        cache = InternCache(4)
        cache.set("a", 1)
        cache.set("b", 2)  # turnover: {a, b} old
        self.assertEqual(cache.values_of(["b", "x"]), ([2, None], [1]))
        self.assertIn("b", cache._young)
        self.assertNotIn("a", cache._young)

    def test_pop_and_clear(self):
        cache = InternCache(4)
        cache.set("a", 1)
        cache.set("b", 2)
        cache.get("a")  # now in both generations
        self.assertEqual(cache.pop("a"), 1)
        self.assertNotIn("a", cache)
        self.assertEqual(cache.pop("a", "none"), "none")
        cache.clear()
        self.assertEqual(len(cache), 0)

    def test_split_on_both_cache_kinds(self):
        for cache in (InternCache(100), LruCache(100)):
            cache.set("a", 1)
            cache.set("c", 3)
            known, missing = cache.split(["c", "b", "a", "b", "d"])
            self.assertEqual(known, {"c": 3, "a": 1}, type(cache))
            self.assertEqual(missing, ["b", "d"], type(cache))
            self.assertEqual(list(known), ["c", "a"])
