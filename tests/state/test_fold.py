"""fold_state and fold_packed_state: the nearest row of each key wins whatever order the rows come in."""

from __future__ import annotations

import random

from twisted.trial import unittest

from roomstore.state.groups import fold_packed_state, fold_state

# (hops, type_key_nid, event_nid): hop 0 is the group itself, hop 3 its snapshot.
ROWS = [
    (0, 3, 403),
    (0, 4, None),
    (0, 6, 406),
    (1, 2, 302),
    (1, 3, None),
    (2, 2, 202),
    (2, 5, 205),
    (3, 1, 101),
    (3, 2, 102),
    (3, 3, 103),
    (3, 4, 104),
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


def packed(rows, sole=False):
    """ROWS-shaped rows as packed_full_state_sql returns them: (hops, None,
    None, [keys, events]) per group; with ``sole``, a group of one row as
    (hops, key, event, None), as the walk on PostgreSQL returns it."""
    groups: dict[int, list[list]] = {}
    for hops, key, event in rows:
        columns = groups.setdefault(hops, [[], []])
        columns[0].append(key)
        columns[1].append(event)
    return [
        (hops, columns[0][0], columns[1][0], None) if sole and len(columns[0]) == 1 else (hops, None, None, columns)
        for hops, columns in groups.items()
    ]


def identity(value):
    return value


class FoldPackedStateTests(unittest.TestCase):
    def test_any_order_of_groups_gives_the_row_fold(self):
        rng = random.Random(6)
        for _ in range(50):
            for sole in (False, True):
                rows = packed(ROWS, sole)
                rng.shuffle(rows)
                self.assertEqual(fold_packed_state(rows, identity), EXPECTED, rows)

    def test_groups_without_rows_and_no_groups(self):
        rows = packed(ROWS) + [(4, None, None, [[], []]), (5, None, None, [])]
        self.assertEqual(fold_packed_state(rows, identity), EXPECTED)
        self.assertEqual(fold_packed_state([], identity), {})

    def test_removal_nearest_wins_over_an_older_value(self):
        for sole in (False, True):
            self.assertEqual(fold_packed_state(packed([(2, 7, 1), (0, 7, None), (1, 7, 2)], sole), identity), {})
            self.assertEqual(fold_packed_state(packed([(2, 7, None), (0, 7, 3), (1, 7, 2)], sole), identity), {7: 3})

    def test_random_rows_agree_with_fold_state(self):
        rng = random.Random(8)
        for _ in range(200):
            rows = []
            for hops in range(rng.randrange(1, 8)):
                for key in rng.sample(range(20), rng.randrange(0, 10)):
                    rows.append((hops, key, rng.choice([None, rng.randrange(1, 1 << 62)])))
            for sole in (False, True):
                self.assertEqual(fold_packed_state(packed(rows, sole), identity), fold_state(list(rows)), rows)
