"""The Stream contract, as implemented by InMemoryStream, and the registry."""

from __future__ import annotations

import random

from twisted.trial import unittest

from roomstore.replication import InMemoryStream, StreamRegistry, UnknownStreamError


def updates(stream: InMemoryStream, instance: str, from_token: int, upto: int, limit: int):
    """Run get_updates (it never waits for an in-memory stream)."""
    coro = stream.get_updates(instance, from_token, upto, limit)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("InMemoryStream.get_updates should not wait")


class InMemoryStreamTests(unittest.TestCase):
    def setUp(self) -> None:
        self.stream = InMemoryStream("caches", writers=["master", "worker1"])
        self.stream.append("master", 2, ("a",))
        self.stream.append("master", 3, ("b1",), ("b2",), ("b3",))
        self.stream.advance("master", 5)  # 4 and 5 carry no rows
        self.stream.append("master", 6, ("c",))

    def test_writers_and_tokens(self) -> None:
        self.assertEqual(self.stream.writers(), ["master", "worker1"])
        self.assertEqual(self.stream.current_token("master"), 6)
        self.assertEqual(self.stream.current_token("worker1"), 0)
        self.assertEqual(self.stream.current_token("nobody"), 0)

    def test_range_is_exclusive_inclusive(self) -> None:
        rows, upto, limited = updates(self.stream, "master", 2, 6, 100)
        self.assertEqual(rows, [(3, ("b1",)), (3, ("b2",)), (3, ("b3",)), (6, ("c",))])
        self.assertEqual((upto, limited), (6, False))
        self.assertEqual(updates(self.stream, "master", 3, 5, 100), ([], 5, False))
        self.assertEqual(updates(self.stream, "master", 6, 6, 100), ([], 6, False))
        self.assertEqual(updates(self.stream, "worker1", 0, 6, 100), ([], 6, False))

    def test_pages_never_split_a_token(self) -> None:
        # limit 2 would cut token 3 in half: the page stops before it.
        rows, upto, limited = updates(self.stream, "master", 0, 6, 2)
        self.assertEqual((rows, upto, limited), ([(2, ("a",))], 2, True))
        # From 2, token 3 alone has more rows than the limit: it comes whole.
        rows, upto, limited = updates(self.stream, "master", 2, 6, 2)
        self.assertEqual([t for t, _ in rows], [3, 3, 3])
        self.assertEqual((upto, limited), (3, True))
        rows, upto, limited = updates(self.stream, "master", 3, 6, 2)
        self.assertEqual((rows, upto, limited), ([(6, ("c",))], 6, False))

    def test_oversized_last_token_is_not_limited(self) -> None:
        """If the whole rest of the range is one big token, nothing is left out."""
        rows, upto, limited = updates(self.stream, "master", 2, 3, 1)
        self.assertEqual((len(rows), upto, limited), (3, 3, False))

    def test_random_paging_matches_one_big_read(self) -> None:
        """Paging with any limit yields exactly the rows of one unlimited read."""
        rng = random.Random(1234)
        stream = InMemoryStream("events")
        token = 0
        for _ in range(300):
            token += rng.choice([0, 1, 1, 2, 5]) if token else 1
            stream.append("master", token, *[(token, i) for i in range(rng.choice([1, 1, 1, 2, 4]))])
        everything, _, _ = updates(stream, "master", 0, token, 10_000)
        for limit in (1, 2, 3, 7, 50):
            got, start = [], 0
            while True:
                page, upto, limited = updates(stream, "master", start, token, limit)
                self.assertGreater(upto, start)
                self.assertTrue(all(start < t <= upto for t, _ in page))
                if limited:
                    self.assertEqual(page[-1][0], upto)
                    # A page exceeds the limit only when one token needs it.
                    if len(page) > limit:
                        self.assertEqual({t for t, _ in page}, {upto})
                got.extend(page)
                start = upto
                if not limited:
                    break
            self.assertEqual(start, token)
            self.assertEqual(got, everything)

    def test_tokens_never_go_backwards(self) -> None:
        with self.assertRaises(ValueError):
            self.stream.append("master", 5, ("late",))
        with self.assertRaises(ValueError):
            self.stream.advance("master", 1)
        self.stream.append("master", 6, ("c2",))  # same token: joins the batch
        self.assertEqual([t for t, _ in self.stream.rows("master")][-2:], [6, 6])

    def test_prune(self) -> None:
        self.stream.prune("master", 3)
        self.assertEqual(list(self.stream.rows("master")), [(6, ("c",))])
        self.assertEqual(self.stream.current_token("master"), 6)

    def test_rows_are_stored_as_tuples(self) -> None:
        self.stream.append("worker1", 1, ["x", 1])
        self.assertEqual(list(self.stream.rows("worker1")), [(1, ("x", 1))])

    def test_bad_names_and_limits(self) -> None:
        with self.assertRaises(ValueError):
            InMemoryStream("two words")
        with self.assertRaises(ValueError):
            self.stream.append("bad instance", 7, ("x",))
        with self.assertRaises(ValueError):
            updates(self.stream, "master", 0, 6, 0)


class StreamRegistryTests(unittest.TestCase):
    def test_register_get_names(self) -> None:
        events, caches = InMemoryStream("events"), InMemoryStream("caches")
        registry = StreamRegistry([events])
        registry.register(caches)
        self.assertEqual(registry.names(), ["events", "caches"])
        self.assertIs(registry.get("caches"), caches)
        self.assertIn("events", registry)
        self.assertNotIn("typing", registry)
        self.assertEqual(len(registry), 2)
        self.assertEqual(list(registry), [events, caches])

    def test_unknown_and_duplicate(self) -> None:
        registry = StreamRegistry([InMemoryStream("events")])
        with self.assertRaises(UnknownStreamError) as cm:
            registry.get("typing")
        self.assertEqual(cm.exception.stream_name, "typing")
        with self.assertRaises(ValueError):
            registry.register(InMemoryStream("events"))
