from __future__ import annotations

import json
from typing import Any

from twisted.trial import unittest

from roomstore.pdu.hashing import compute_event_id
from roomstore.pdu.parsing import (
    MAX_PDU_SIZE,
    InvalidEventError,
    ParsedPdu,
    is_valid_event_id,
    parse_pdu,
)
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, RoomVersion, RoomVersions
from tests.events.pdus import V1_REF, V3_REF, V4_REF, encode, encode_loose, make_pdu

ALL_VERSIONS = list(KNOWN_ROOM_VERSIONS.values())
REQUIRED = [
    "room_id",
    "sender",
    "type",
    "content",
    "origin_server_ts",
    "depth",
    "prev_events",
    "auth_events",
    "hashes",
    "signatures",
]


class ValidPduTests(unittest.TestCase):
    def test_every_version_parses(self) -> None:
        for version in ALL_VERSIONS:
            pdu = make_pdu(version)
            parsed = parse_pdu(encode(pdu), version)
            self.assertIsInstance(parsed, ParsedPdu)
            self.assertEqual(parsed.room_id, pdu["room_id"])
            self.assertEqual(parsed.sender, "@alice:example.org")
            self.assertEqual(parsed.type, "m.room.message")
            self.assertIsNone(parsed.state_key)
            self.assertFalse(parsed.is_state)
            self.assertEqual(parsed.depth, 12)
            self.assertEqual(parsed.origin_server_ts, 1_700_000_000_000)
            self.assertEqual(parsed.content, {"msgtype": "m.text", "body": "hello"})
            self.assertEqual(parsed.event_dict, pdu)
            self.assertIs(parsed.room_version, version)
            self.assertIsNone(parsed.redacts)
            self.assertIsNone(parsed.membership)
            self.assertEqual(len(parsed.prev_event_ids), 1)
            self.assertEqual(len(parsed.auth_event_ids), 2)

    def test_v1_v2_use_the_pdu_event_id_and_pairs(self) -> None:
        for version in (RoomVersions.V1, RoomVersions.V2):
            parsed = parse_pdu(encode(make_pdu(version)), version)
            self.assertEqual(parsed.event_id, "$message1:example.org")
            self.assertEqual(parsed.prev_event_ids, ("$ref1:example.org",))
            self.assertEqual(parsed.auth_event_ids, ("$ref2:example.org", "$ref3:example.org"))

    def test_v3_plus_compute_the_event_id(self) -> None:
        for version in ALL_VERSIONS[2:]:
            pdu = make_pdu(version)
            parsed = parse_pdu(encode(pdu), version)
            self.assertEqual(parsed.event_id, compute_event_id(version, pdu))
            self.assertNotIn("event_id", parsed.event_dict)

    def test_raw_bytes_kept_verbatim(self) -> None:
        raw = encode_loose(make_pdu(RoomVersions.V10, content={"body": "caf\u00e9"}))
        self.assertIn(b"caf\\u00e9", raw)
        parsed = parse_pdu(raw, RoomVersions.V10)
        self.assertIs(parsed.raw, raw)
        self.assertEqual(parsed.content["body"], "caf\u00e9")
        # Non-canonical input still gets the canonical event ID.
        self.assertEqual(
            parsed.event_id,
            parse_pdu(encode(json.loads(raw)), RoomVersions.V10).event_id,
        )

    def test_nul_escape_in_content_is_accepted(self) -> None:
        raw = encode(make_pdu(RoomVersions.V11, content={"body": "a\u0000b"}))
        self.assertIn(b"a\\u0000b", raw)
        parsed = parse_pdu(raw, RoomVersions.V11)
        self.assertEqual(parsed.content["body"], "a\x00b")
        self.assertEqual(parsed.raw, raw)
        self.assertIn(b"\\u0000", parsed.raw)

    def test_surrogate_pair_escape_is_accepted(self) -> None:
        raw = encode(make_pdu(RoomVersions.V11)).replace(b'"hello"', b'"\\ud83d\\ude00"')
        parsed = parse_pdu(raw, RoomVersions.V11)
        self.assertEqual(parsed.content["body"], "\U0001f600")

    def test_state_and_member_event(self) -> None:
        pdu = make_pdu(
            RoomVersions.V9,
            type="m.room.member",
            state_key="@bob:example.org",
            content={"membership": "invite"},
        )
        parsed = parse_pdu(encode(pdu), RoomVersions.V9)
        self.assertEqual(parsed.state_key, "@bob:example.org")
        self.assertTrue(parsed.is_state)
        self.assertEqual(parsed.membership, "invite")

    def test_empty_state_key(self) -> None:
        pdu = make_pdu(RoomVersions.V9, type="m.room.name", state_key="", content={"name": "x"})
        self.assertEqual(parse_pdu(encode(pdu), RoomVersions.V9).state_key, "")

    def test_redacts_top_level_before_v11(self) -> None:
        for version in ALL_VERSIONS[:10]:
            target = V1_REF if version.event_id_in_pdu else "$target"
            pdu = make_pdu(version, type="m.room.redaction", redacts=target, content={})
            self.assertEqual(parse_pdu(encode(pdu), version).redacts, target)

    def test_redacts_in_content_from_v11(self) -> None:
        pdu = make_pdu(RoomVersions.V11, type="m.room.redaction", content={"redacts": "$t"})
        self.assertEqual(parse_pdu(encode(pdu), RoomVersions.V11).redacts, "$t")
        # A legacy top-level key is not where v11 looks.
        legacy = make_pdu(RoomVersions.V11, type="m.room.redaction", redacts="$t", content={})
        self.assertIsNone(parse_pdu(encode(legacy), RoomVersions.V11).redacts)

    def test_redaction_without_redacts(self) -> None:
        pdu = make_pdu(RoomVersions.V10, type="m.room.redaction", content={})
        self.assertIsNone(parse_pdu(encode(pdu), RoomVersions.V10).redacts)

    def test_redacts_ignored_on_other_types(self) -> None:
        pdu = make_pdu(RoomVersions.V10, redacts=5)
        self.assertIsNone(parse_pdu(encode(pdu), RoomVersions.V10).redacts)

    def test_floats_and_big_ints_allowed_before_v6(self) -> None:
        pdu = make_pdu(RoomVersions.V5, content={"f": 1.5, "i": 2**60})
        parsed = parse_pdu(encode(pdu), RoomVersions.V5)
        self.assertEqual(parsed.content, {"f": 1.5, "i": 2**60})

    def test_limits_of_strict_int_range_accepted(self) -> None:
        pdu = make_pdu(RoomVersions.V6, content={"max": 2**53 - 1, "min": -(2**53) + 1})
        self.assertEqual(parse_pdu(encode(pdu), RoomVersions.V6).content["max"], 2**53 - 1)

    def test_exactly_max_size_accepted(self) -> None:
        pdu = make_pdu(RoomVersions.V10, content={"body": ""})
        base = len(encode(pdu))
        pdu = make_pdu(RoomVersions.V10, content={"body": "x" * (MAX_PDU_SIZE - base)})
        raw = encode(pdu)
        self.assertEqual(len(raw), MAX_PDU_SIZE)
        self.assertEqual(parse_pdu(raw, RoomVersions.V10).raw, raw)

    def test_equality_uses_raw_and_is_hashable(self) -> None:
        raw = encode(make_pdu(RoomVersions.V10))
        a, b = parse_pdu(raw, RoomVersions.V10), parse_pdu(raw, RoomVersions.V10)
        self.assertEqual(a, b)
        self.assertEqual(hash(a), hash(b))
        self.assertNotIn("raw=", repr(a))
        self.assertIn("room version 10", repr(a))


class InvalidPduTests(unittest.TestCase):
    def assertInvalid(
        self,
        raw: bytes,
        version: RoomVersion,
        message: str,
        field: str | None = None,
    ) -> InvalidEventError:
        with self.assertRaises(InvalidEventError) as cm:
            parse_pdu(raw, version)
        self.assertIn(message, str(cm.exception))
        if field is not None:
            self.assertEqual(cm.exception.field, field)
        return cm.exception

    def assertInvalidPdu(
        self, pdu: dict[str, Any], version: RoomVersion, message: str, field: str | None = None
    ) -> None:
        self.assertInvalid(encode(pdu), version, message, field)

    def test_not_bytes(self) -> None:
        with self.assertRaises(TypeError):
            parse_pdu(encode(make_pdu(RoomVersions.V10)).decode(), RoomVersions.V10)  # type: ignore[arg-type]

    def test_not_utf8(self) -> None:
        good = encode(make_pdu(RoomVersions.V10))
        for bad in (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82"):
            raw = good.replace(b"hello", b"hel" + bad + b"lo")
            self.assertInvalid(raw, RoomVersions.V10, "not valid UTF-8")

    def test_not_json(self) -> None:
        raw = encode(make_pdu(RoomVersions.V10))
        for bad in (raw[:-1], raw + b"x", b"", b"\xef\xbb\xbf" + raw, b"{'a': 1}"):
            self.assertInvalid(bad, RoomVersions.V10, "not valid JSON")

    def test_byte_order_mark_named(self) -> None:
        raw = b"\xef\xbb\xbf" + encode(make_pdu(RoomVersions.V10))
        self.assertInvalid(raw, RoomVersions.V10, "begins with a byte order mark (U+FEFF)")

    def test_not_an_object(self) -> None:
        for raw, kind in (
            (b"[]", "an array"),
            (b'"s"', "a string"),
            (b"1", "a number"),
            (b"null", "null"),
            (b"true", "a boolean"),
        ):
            self.assertInvalid(raw, RoomVersions.V10, f"must be a JSON object, got {kind}")

    def test_too_big(self) -> None:
        pdu = make_pdu(RoomVersions.V10, content={"body": "x" * MAX_PDU_SIZE})
        self.assertInvalid(encode(pdu), RoomVersions.V10, "the limit is 65536 bytes")

    def test_one_byte_too_big(self) -> None:
        pdu = make_pdu(RoomVersions.V10, content={"body": ""})
        base = len(encode(pdu))
        pdu = make_pdu(RoomVersions.V10, content={"body": "x" * (MAX_PDU_SIZE - base + 1)})
        self.assertEqual(len(encode(pdu)), MAX_PDU_SIZE + 1)
        self.assertInvalidPdu(pdu, RoomVersions.V10, f"is {MAX_PDU_SIZE + 1} bytes")

    def test_canonical_encoding_too_big(self) -> None:
        # 1E5 is 3 bytes raw but 100000.0 once canonicalised (v1-v5 allow floats).
        raw = encode(make_pdu(RoomVersions.V5, content={"n": []}))
        numbers = b",".join([b"1E5"] * 16000)
        raw = raw.replace(b'"n":[]', b'"n":[' + numbers + b"]")
        self.assertLessEqual(len(raw), MAX_PDU_SIZE)
        self.assertInvalid(raw, RoomVersions.V5, "as canonical JSON")

    def test_missing_each_required_key(self) -> None:
        for version in ALL_VERSIONS:
            keys = REQUIRED + (["event_id"] if version.event_id_in_pdu else [])
            for key in keys:
                pdu = make_pdu(version, _drop=(key,))
                self.assertInvalidPdu(pdu, version, f"missing required key {key!r}", key)

    def test_v3_plus_reject_event_id(self) -> None:
        for version in ALL_VERSIONS[2:]:
            pdu = make_pdu(version, event_id="$whatever:example.org")
            self.assertInvalidPdu(pdu, version, "must not contain 'event_id'", "event_id")

    def test_wrong_types(self) -> None:
        v4, v1 = RoomVersions.V4, RoomVersions.V1
        cases: list[tuple[RoomVersion, str, Any, str]] = [
            (v4, "room_id", 5, "'room_id' must be a string, got a number"),
            (v4, "room_id", "room:example.org", "'room_id' must look like '!localpart:server'"),
            (v4, "room_id", "!nocolon", "'room_id' must look like"),
            (v4, "sender", ["@a:b"], "'sender' must be a string, got an array"),
            (v4, "sender", "alice:example.org", "'sender' must look like '@localpart:server'"),
            (v4, "type", None, "'type' must be a string, got null"),
            (v4, "state_key", 5, "'state_key' must be a string"),
            (v4, "content", [], "'content' must be an object, got an array"),
            (v4, "content", "text", "'content' must be an object, got a string"),
            (v4, "origin_server_ts", "1", "'origin_server_ts' must be an integer, got a string"),
            (v4, "origin_server_ts", True, "'origin_server_ts' must be an integer, got a boolean"),
            (v4, "origin_server_ts", 1.5, "'origin_server_ts' must be an integer, got a number"),
            (v4, "depth", "3", "'depth' must be an integer"),
            (v4, "depth", False, "'depth' must be an integer, got a boolean"),
            (v4, "depth", -1, "'depth' must be between 0 and"),
            (v4, "depth", 2**63, "'depth' must be between 0 and"),
            (v4, "prev_events", {}, "'prev_events' must be an array, got an object"),
            (v4, "prev_events", ["bad"], "'prev_events[0]' is not a room version 4 event ID"),
            (v4, "prev_events", [V3_REF], "'prev_events[0]' is not a room version 4 event ID"),
            (v4, "auth_events", [5], "'auth_events[0]' is not a room version 4 event ID"),
            (v4, "auth_events", [V4_REF + "x"], "is not a room version 4 event ID"),
            (v4, "auth_events", [[V1_REF, {}]], "is not a room version 4 event ID"),
            (RoomVersions.V3, "prev_events", [V4_REF], "is not a room version 3 event ID"),
            (v1, "prev_events", [V1_REF], "'prev_events[0]' must be an [event_id, hashes] pair"),
            (v1, "prev_events", [[V1_REF]], "must be an [event_id, hashes] pair"),
            (v1, "prev_events", [[V1_REF, "h"]], "'prev_events[0][1]' must be an object"),
            (v1, "auth_events", [["nodollar:x", {}]], "'auth_events[0]' is not a room version 1"),
            (v1, "auth_events", [[V4_REF, {}]], "is not a room version 1 event ID"),
            (v1, "event_id", "$nocolon", "'event_id' '$nocolon' is not a room version 1 event ID"),
            (v1, "event_id", 7, "is not a room version 1 event ID"),
            (v4, "hashes", [], "'hashes' must be an object, got an array"),
            (v4, "hashes", {}, "'hashes.sha256' must be a string, got null"),
            (v4, "hashes", {"sha256": 1}, "'hashes.sha256' must be a string, got a number"),
            (v4, "signatures", [], "'signatures' must be an object"),
            (v4, "signatures", {"s": "x"}, "'signatures.s' must be an object"),
            (v4, "signatures", {"s": {"ed25519:k": 1}}, "'signatures.s.ed25519:k' must be a string"),
            (v4, "unsigned", [], "'unsigned' must be an object"),
            (v4, "origin", 5, "'origin' must be a string"),
        ]
        for version, key, value, message in cases:
            pdu = make_pdu(version, **{key: value})
            self.assertInvalidPdu(pdu, version, message)

    def test_identifier_length_limits(self) -> None:
        v = RoomVersions.V10
        ok = make_pdu(v, type="t" * 255)
        self.assertEqual(parse_pdu(encode(ok), v).type, "t" * 255)
        self.assertInvalidPdu(make_pdu(v, type="t" * 256), v, "'type' is longer than 255 bytes")
        # Bytes, not characters: 128 two-byte characters are 256 bytes.
        self.assertInvalidPdu(make_pdu(v, state_key="\u00e9" * 128), v, "'state_key' is longer than 255 bytes")
        long_sender = "@" + "a" * 250 + ":example.org"
        self.assertInvalidPdu(make_pdu(v, sender=long_sender), v, "'sender' is longer")
        long_id = "$" + "a" * 250 + ":example.org"
        self.assertInvalidPdu(make_pdu(RoomVersions.V1, event_id=long_id), RoomVersions.V1, "event_id")

    def test_nan_and_infinity_rejected_in_every_version(self) -> None:
        for version in ALL_VERSIONS:
            raw = encode(make_pdu(version, content={"n": 0}))
            for constant in (b"NaN", b"Infinity", b"-Infinity"):
                bad = raw.replace(b'"n":0', b'"n":' + constant)
                self.assertInvalid(bad, version, "which is not valid JSON")
            overflow = raw.replace(b'"n":0', b'"n":1e400')
            self.assertInvalid(overflow, version, "overflows", "content.n")

    def test_floats_rejected_from_v6(self) -> None:
        for version in ALL_VERSIONS[5:]:
            pdu = make_pdu(version, content={"x": [1.5]})
            self.assertInvalidPdu(pdu, version, "floats are not allowed", "content.x[0]")
            # Even 1.0, which Python's json hands back as a float.
            raw = encode(make_pdu(version, content={"x": 0})).replace(b'"x":0', b'"x":1.0')
            self.assertInvalid(raw, version, "floats are not allowed")

    def test_out_of_range_ints_rejected_from_v6(self) -> None:
        for version in ALL_VERSIONS[5:]:
            for value in (2**53, -(2**53), 2**64):
                pdu = make_pdu(version, content={"big": value})
                self.assertInvalidPdu(pdu, version, "outside the range", "content.big")
            pdu = make_pdu(version, origin_server_ts=2**53)
            self.assertInvalidPdu(pdu, version, "outside the range", "origin_server_ts")

    def test_duplicate_keys_rejected(self) -> None:
        raw = encode(make_pdu(RoomVersions.V10))
        top = raw.replace(b'{"auth_events"', b'{"depth":1,"auth_events"', 1)
        self.assertInvalid(top, RoomVersions.V10, "duplicate object key 'depth'")
        nested = raw.replace(b'"body":"hello"', b'"body":"hello","body":"bye"')
        self.assertInvalid(nested, RoomVersions.V10, "duplicate object key 'body'")

    def test_lone_surrogate_escape_rejected(self) -> None:
        raw = encode(make_pdu(RoomVersions.V10)).replace(b'"hello"', b'"\\ud800"')
        self.assertInvalid(raw, RoomVersions.V10, "unpaired UTF-16 surrogate", "content.body")
        key = encode(make_pdu(RoomVersions.V10)).replace(b'"body"', b'"\\udfff"')
        self.assertInvalid(key, RoomVersions.V10, "unpaired UTF-16 surrogate")

    def test_surrogate_like_text_is_not_a_surrogate(self) -> None:
        # An escaped backslash followed by "uD800" is six ordinary characters;
        # parse_pdu looks closer at it and accepts it.
        raw = encode(make_pdu(RoomVersions.V10)).replace(b'"hello"', b'"\\\\uD800"')
        self.assertEqual(parse_pdu(raw, RoomVersions.V10).content["body"], "\\uD800")
        upper = encode(make_pdu(RoomVersions.V10)).replace(b'"hello"', b'"\\uDBFF"')
        self.assertInvalid(upper, RoomVersions.V10, "unpaired UTF-16 surrogate", "content.body")

    def test_deep_nesting_rejected_cleanly(self) -> None:
        raw = encode(make_pdu(RoomVersions.V10, content={"x": 0}))
        deep = raw.replace(b'"x":0', b'"x":' + b"[" * 30000 + b"]" * 30000)
        self.assertLessEqual(len(deep), MAX_PDU_SIZE)
        self.assertInvalid(deep, RoomVersions.V10, "nested too deeply")

    def test_member_event_requirements(self) -> None:
        v = RoomVersions.V10
        no_key = make_pdu(v, type="m.room.member", content={"membership": "join"})
        self.assertInvalidPdu(no_key, v, "m.room.member events must have a 'state_key'")
        no_membership = make_pdu(v, type="m.room.member", state_key="@a:b", content={})
        self.assertInvalidPdu(no_membership, v, "'content.membership' must be a string, got null", "content.membership")
        numeric = make_pdu(v, type="m.room.member", state_key="@a:b", content={"membership": 1})
        self.assertInvalidPdu(numeric, v, "'content.membership' must be a string")

    def test_redacts_wrong_type(self) -> None:
        v10 = make_pdu(RoomVersions.V10, type="m.room.redaction", redacts=5, content={})
        self.assertInvalidPdu(v10, RoomVersions.V10, "'redacts' must be a string", "redacts")
        v11 = make_pdu(RoomVersions.V11, type="m.room.redaction", content={"redacts": ["$x"]})
        self.assertInvalidPdu(v11, RoomVersions.V11, "'content.redacts' must be a string", "content.redacts")

    def test_error_is_a_value_error(self) -> None:
        self.assertTrue(issubclass(InvalidEventError, ValueError))


class EventIdFormatTests(unittest.TestCase):
    def test_formats(self) -> None:
        cases = [
            (RoomVersions.V1, "$abc:example.org", True),
            (RoomVersions.V1, "$abc:example.org:8448", True),
            (RoomVersions.V1, "$:example.org", False),
            (RoomVersions.V1, "$abc:", False),
            (RoomVersions.V1, "abc:example.org", False),
            (RoomVersions.V3, V3_REF, True),
            (RoomVersions.V3, V4_REF, False),
            (RoomVersions.V4, V4_REF, True),
            (RoomVersions.V4, V3_REF, False),
            (RoomVersions.V11, "$" + "a" * 42, False),
            (RoomVersions.V11, "$" + "a" * 44, False),
            (RoomVersions.V11, "$" + "a" * 42 + "=", False),
            (RoomVersions.V11, None, False),
        ]
        for version, event_id, valid in cases:
            self.assertEqual(is_valid_event_id(version, event_id), valid, (version.identifier, event_id))


class PickledPduTests(unittest.TestCase):
    """A PDU crossing a process boundary (a validation worker's reply)
    travels without its parsed dicts; they come back from ``raw`` when asked
    for, equal to the parser's, in every room version."""

    def test_round_trip_equal_and_dicts_decoded_when_asked(self) -> None:
        import pickle

        for version in ALL_VERSIONS:
            pdu = make_pdu(
                version,
                type="m.room.member",
                state_key="@bob:example.org",
                content={"membership": "join", "nested": {"list": [1, "two", None]}},
            )
            parsed = parse_pdu(encode(pdu), version)
            data = pickle.dumps(parsed, protocol=pickle.HIGHEST_PROTOCOL)
            back = pickle.loads(data)
            self.assertEqual(back, parsed)
            self.assertIs(back.room_version, parsed.room_version)
            self.assertEqual((back.membership, back.has_floats), (parsed.membership, parsed.has_floats))
            self.assertIsNone(back._event_dict)  # not decoded yet
            self.assertEqual(back.content, parsed.content)
            self.assertEqual(back.event_dict, parsed.event_dict)
            self.assertIs(back.content, back.event_dict["content"])
            # The pickle holds the bytes once and no dict of their JSON.
            self.assertLess(len(data), len(parsed.raw) + 600)
