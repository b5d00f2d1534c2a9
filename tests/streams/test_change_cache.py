"""StreamChangeCache: answers from memory, "don't know" below its horizon, bounded size."""

from twisted.trial import unittest

from roomstore.streams import StreamChangeCache


class ChangeCacheTests(unittest.TestCase):
    def test_has_entity_changed(self):
        cache = StreamChangeCache("rooms", earliest_known_position=10)
        cache.entity_has_changed("!a", 12)
        cache.entity_has_changed("!b", 15)
        self.assertTrue(cache.has_entity_changed("!a", 11))
        self.assertFalse(cache.has_entity_changed("!a", 12))
        self.assertFalse(cache.has_entity_changed("!c", 10))  # known: never changed since 10
        self.assertTrue(cache.has_entity_changed("!c", 9))  # below the horizon: don't know

    def test_get_entities_changed(self):
        cache = StreamChangeCache("rooms", 0)
        for pos, room in enumerate(["!a", "!b", "!c", "!a"], start=1):
            cache.entity_has_changed(room, pos)
        self.assertEqual(cache.get_entities_changed({"!a", "!b", "!z"}, 1), {"!a", "!b"})
        self.assertEqual(cache.get_entities_changed(["!b", "!c"], 2), {"!c"})
        self.assertEqual(cache.get_entities_changed(["!a"], 4), set())
        # Both walking strategies agree: many entities asked, few changed.
        many = {f"!r{i}" for i in range(100)} | {"!c"}
        self.assertEqual(cache.get_entities_changed(many, 2), {"!c"})
        self.assertIsNone(StreamChangeCache("x", 5).get_entities_changed(["!a"], 4))

    def test_positions_move_forward_only(self):
        cache = StreamChangeCache("rooms", 0)
        cache.entity_has_changed("!a", 10)
        cache.entity_has_changed("!a", 5)  # older news: ignored
        self.assertEqual(cache.get_max_pos_of_last_change("!a"), 10)
        self.assertEqual(cache.get_all_entities_changed(0), ["!a"])

    def test_bounded_size_moves_horizon(self):
        cache = StreamChangeCache("users", 0, max_size=3)
        for pos, user in enumerate(["@a", "@b", "@c", "@d", "@e"], start=1):
            cache.entity_has_changed(user, pos)
        self.assertEqual(len(cache), 3)
        self.assertEqual(cache.earliest_known_position, 2)
        self.assertIsNone(cache.get_entities_changed(["@a"], 1))  # forgotten: don't know
        self.assertEqual(cache.get_entities_changed(["@a", "@c", "@e"], 2), {"@c", "@e"})
        self.assertEqual(cache.get_all_entities_changed(2), ["@c", "@d", "@e"])

    def test_out_of_order_positions(self):
        cache = StreamChangeCache("rooms", 0)
        cache.entity_has_changed("!b", 7)
        cache.entity_has_changed("!a", 3)  # arrives late (another writer)
        self.assertEqual(cache.get_all_entities_changed(0), ["!a", "!b"])
        self.assertEqual(cache.get_entities_changed(["!a", "!b"], 5), {"!b"})

    def test_has_any_entity_changed(self):
        cache = StreamChangeCache("rooms", 4)
        self.assertFalse(cache.has_any_entity_changed(4))
        self.assertTrue(cache.has_any_entity_changed(3))  # unknown
        cache.entity_has_changed("!a", 6)
        self.assertTrue(cache.has_any_entity_changed(5))
        self.assertFalse(cache.has_any_entity_changed(6))

    def test_changes_at_or_below_horizon_are_not_stored(self):
        cache = StreamChangeCache("rooms", 10, prefilled=[("!old", 9), ("!new", 11)])
        self.assertEqual(len(cache), 1)
        self.assertEqual(cache.get_all_entities_changed(10), ["!new"])
