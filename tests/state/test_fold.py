"""fold_state: the nearest row of each key wins whatever order the rows come in."""

from __future__ import annotations

import random

from twisted.trial import unittest

from roomstore.state.groups import fold_state

# (hops, type_key_nid, event_nid): hop 0 is the group itself, hop 3 its snapshot.
ROWS = [
    (0, 3, 403), (0, 4, None), (0, 6, 406),
    (1, 2, 302), (1, 3, None),
    (2, 2, 202), (2, 5, 205),
    (3, 1, 101), (3, 2, 102), (3, 3, 103), (3, 4, 104),
]
EXPECTED = {1: 101, 2: 302, 3: 403, 5: 205, 6: 406}


class FoldStateTests(unittest.TestCase):
    def test_nearest_first_farthest_first_and_shuffled(self):
        orders = [list(ROWS), list(reversed(ROWS))]
        rng = random.Random(5)
        for _ in range(50):
            shuffled = list(ROWS)
            rng.shuffle(shuffled)
            orders.append(shuffled)
        for rows in orders:
            self.assertEqual(fold_state(rows), EXPECTED, rows)

    def test_any_iterable_and_empty(self):
        self.assertEqual(fold_state(iter(ROWS)), EXPECTED)
        self.assertEqual(fold_state(tuple(ROWS)), EXPECTED)
        self.assertEqual(fold_state([]), {})

    def test_removal_nearest_wins_over_an_older_value(self):
        self.assertEqual(fold_state([(2, 7, 1), (0, 7, None), (1, 7, 2)]), {})
        self.assertEqual(fold_state([(2, 7, None), (0, 7, 3), (1, 7, 2)]), {7: 3})
