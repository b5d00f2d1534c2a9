from __future__ import annotations

import operator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from roomstore.events.tokens import (
    MAX_POSITION,
    InvalidToken,
    StreamToken,
    TopologicalToken,
    parse_token,
)

# CI runs trial in parallel; don't fail on timing, only on behaviour.
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

positions = st.integers(min_value=0, max_value=MAX_POSITION)
small = st.integers(min_value=0, max_value=50)
stream_tokens = st.builds(StreamToken.create, small, st.dictionaries(st.integers(0, 8), small, max_size=5))


class StreamTokenTests(unittest.TestCase):
    def test_simple_form(self) -> None:
        token = StreamToken.parse("s42")
        self.assertEqual(token, StreamToken(42))
        self.assertEqual(token.to_string(), "s42")
        self.assertEqual(StreamToken(0).to_string(), "s0")

    def test_multi_writer_form(self) -> None:
        token = StreamToken.parse("m10~1.15~3.12")
        self.assertEqual(token.stream, 10)
        self.assertEqual(token.instance_positions, ((1, 15), (3, 12)))
        self.assertEqual(token.to_string(), "m10~1.15~3.12")

    def test_create_normalises(self) -> None:
        token = StreamToken.create(10, {3: 12, 1: 15, 2: 10, 4: 3})
        self.assertEqual(token.instance_positions, ((1, 15), (3, 12)))
        self.assertEqual(token.to_string(), "m10~1.15~3.12")
        self.assertEqual(StreamToken.create(7, {1: 7}).to_string(), "s7")
        self.assertEqual(StreamToken.create(7, [(1, 9)]).to_string(), "m7~1.9")
        with self.assertRaises(InvalidToken):
            StreamToken.create(7, [(1, 9), (1, 10)])

    def test_constructor_enforces_invariant(self) -> None:
        for stream, entries in (
            (10, ((3, 12), (1, 15))),  # unsorted
            (10, ((1, 12), (1, 15))),  # repeated
            (10, ((1, 10),)),  # not ahead
            (10, ((1, 9),)),  # behind
            (-1, ()),
            (MAX_POSITION + 1, ()),
            (10, ((-1, 12),)),
            (10, [(1, 12)]),  # not a tuple
            (10, ((1,),)),
        ):
            with self.assertRaises(InvalidToken, msg=repr((stream, entries))):
                StreamToken(stream, entries)  # type: ignore[arg-type]
        with self.assertRaises(InvalidToken):
            StreamToken(True)  # bools are not positions
        with self.assertRaises(InvalidToken):
            StreamToken("5")  # type: ignore[arg-type]

    def test_invalid_strings(self) -> None:
        bad = [
            "",
            "s",
            "s-1",
            "s01",
            "s+1",
            "s 1",
            "s1 ",
            " s1",
            "s1_000",
            "s\u0661",  # ARABIC-INDIC DIGIT ONE: int() would accept it
            "S1",
            "x1",
            "s1.5",
            "s9223372036854775808",
            "s12345678901234567890",
            "m1",
            "m1~",
            "m~1.2",
            "m1~2",
            "m1~2.",
            "m1~.2",
            "m1~2.1",  # writer not ahead of the minimum
            "m1~2.5~1.6",  # unsorted
            "m1~2.5~2.6",  # repeated
            "m1~2.5~",
            "m01~2.5",
            "m1~2.05",
            "m1~-2.5",
            "t1-2",
        ]
        for token in bad:
            with self.assertRaises(InvalidToken, msg=token):
                StreamToken.parse(token)
        with self.assertRaises(InvalidToken):
            StreamToken.parse(5)  # type: ignore[arg-type]

    def test_error_message_names_token(self) -> None:
        with self.assertRaises(InvalidToken) as cm:
            StreamToken.parse("m1~2.1")
        self.assertIn("'m1~2.1'", str(cm.exception))
        self.assertIn("not ahead of the minimum", str(cm.exception))

    def test_max_position(self) -> None:
        text = f"s{MAX_POSITION}"
        self.assertEqual(StreamToken.parse(text).to_string(), text)

    def test_positions(self) -> None:
        token = StreamToken.parse("m10~1.15~3.12")
        self.assertEqual(token.get_stream_pos_for_instance(1), 15)
        self.assertEqual(token.get_stream_pos_for_instance(3), 12)
        self.assertEqual(token.get_stream_pos_for_instance(2), 10)
        self.assertEqual(token.get_max_stream_pos(), 15)
        self.assertEqual(StreamToken(4).get_max_stream_pos(), 4)

    def test_is_before_or_eq_table(self) -> None:
        cases = [
            ("s5", "s5", True),
            ("s5", "s6", True),
            ("s6", "s5", False),
            ("s5", "m5~1.7", True),
            ("m5~1.7", "s5", False),
            ("m5~1.7", "s7", True),
            ("m5~1.7", "m6~1.7", True),
            ("m5~1.8", "m6~1.7", False),
            ("m5~1.7", "m5~2.7", False),  # incomparable both ways
            ("m5~2.7", "m5~1.7", False),
            ("m5~1.6~2.6", "m5~1.6~2.7", True),
        ]
        for a, b, expected in cases:
            self.assertEqual(StreamToken.parse(a).is_before_or_eq(StreamToken.parse(b)), expected, (a, b))

    def test_is_before_or_eq_rejects_other_types(self) -> None:
        with self.assertRaises(TypeError):
            StreamToken(1).is_before_or_eq(TopologicalToken(1, 1))  # type: ignore[arg-type]

    def test_no_total_ordering_operators(self) -> None:
        self.assertRaises(TypeError, operator.lt, StreamToken(1), StreamToken(2))

    def test_copy_and_advance(self) -> None:
        a = StreamToken.parse("m5~1.9~2.6")
        b = StreamToken.parse("m7~3.8")
        self.assertEqual(a.copy_and_advance(b).to_string(), "m7~1.9~3.8")
        self.assertEqual(StreamToken(3).copy_and_advance(StreamToken(2)), StreamToken(3))

    @relaxed
    @given(stream_tokens)
    def test_round_trip(self, token: StreamToken) -> None:
        text = token.to_string()
        self.assertEqual(StreamToken.parse(text), token)
        self.assertEqual(parse_token(text), token)
        self.assertEqual(StreamToken.parse(text).to_string(), text)

    @relaxed
    @given(positions, st.dictionaries(positions, positions, max_size=4))
    def test_round_trip_large_values(self, stream: int, entries: dict[int, int]) -> None:
        token = StreamToken.create(stream, entries)
        self.assertEqual(StreamToken.parse(token.to_string()), token)

    @relaxed
    @given(stream_tokens, stream_tokens)
    def test_is_before_or_eq_is_pointwise(self, a: StreamToken, b: StreamToken) -> None:
        instances = range(0, 10)
        pointwise = (
            all(a.get_stream_pos_for_instance(i) <= b.get_stream_pos_for_instance(i) for i in instances)
            and a.stream <= b.stream
        )
        self.assertEqual(a.is_before_or_eq(b), pointwise)
        self.assertTrue(a.is_before_or_eq(a))

    @relaxed
    @given(stream_tokens, stream_tokens)
    def test_copy_and_advance_is_least_upper_bound(self, a: StreamToken, b: StreamToken) -> None:
        joined = a.copy_and_advance(b)
        self.assertTrue(a.is_before_or_eq(joined))
        self.assertTrue(b.is_before_or_eq(joined))
        for i in range(0, 10):
            self.assertEqual(
                joined.get_stream_pos_for_instance(i),
                max(a.get_stream_pos_for_instance(i), b.get_stream_pos_for_instance(i)),
            )


class TopologicalTokenTests(unittest.TestCase):
    def test_parse_and_render(self) -> None:
        token = TopologicalToken.parse("t12-345")
        self.assertEqual((token.topological, token.stream), (12, 345))
        self.assertEqual(token.to_string(), "t12-345")

    def test_negative_stream_for_backfill(self) -> None:
        token = TopologicalToken.parse("t5--3")
        self.assertEqual(token.as_tuple(), (5, -3))
        self.assertEqual(token.to_string(), "t5--3")

    def test_invalid(self) -> None:
        for bad in ("t", "t1", "t1-", "t-1-2", "t01-2", "t1-02", "t1--0", "t1-+2", "s1", "t1-2-3", "T1-2", "t1-2 "):
            with self.assertRaises(InvalidToken, msg=bad):
                TopologicalToken.parse(bad)
        with self.assertRaises(InvalidToken):
            TopologicalToken(-1, 0)
        with self.assertRaises(InvalidToken):
            TopologicalToken(0, -MAX_POSITION - 1)

    def test_ordering(self) -> None:
        cases = [
            ("t1-5", "t2-0", True),
            ("t2-0", "t1-5", False),
            ("t2-3", "t2-4", True),
            ("t2-4", "t2-3", False),
            ("t2-4", "t2-4", True),
            ("t2--5", "t2-1", True),
        ]
        for a, b, expected in cases:
            self.assertEqual(
                TopologicalToken.parse(a).is_before_or_eq(TopologicalToken.parse(b)),
                expected,
                (a, b),
            )
        with self.assertRaises(TypeError):
            TopologicalToken(1, 1).is_before_or_eq(StreamToken(1))  # type: ignore[arg-type]

    @relaxed
    @given(st.integers(0, MAX_POSITION), st.integers(-MAX_POSITION, MAX_POSITION))
    def test_round_trip(self, topological: int, stream: int) -> None:
        token = TopologicalToken(topological, stream)
        self.assertEqual(TopologicalToken.parse(token.to_string()), token)
        self.assertEqual(parse_token(token.to_string()), token)


class ParseTokenTests(unittest.TestCase):
    def test_dispatch(self) -> None:
        self.assertIsInstance(parse_token("s1"), StreamToken)
        self.assertIsInstance(parse_token("m1~2.3"), StreamToken)
        self.assertIsInstance(parse_token("t1-2"), TopologicalToken)

    def test_unknown_prefix(self) -> None:
        for bad in ("", "x1", "1", None):
            with self.assertRaises(InvalidToken) as cm:
                parse_token(bad)  # type: ignore[arg-type]
            self.assertIn("is not a room token", str(cm.exception))
