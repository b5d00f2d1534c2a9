"""The fast canonical JSON path (orjson) writes canonicaljson's bytes exactly.

Beside these tests, ``bin/test`` turns on the cross-check of
``roomstore.pdu.canonical``: every fast encoding any test makes (every event
parsed, hashed or given an ID) is compared with canonicaljson's there too.
"""

from __future__ import annotations

import itertools
import json

from canonicaljson import encode_canonical_json
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from bench.event_store import persist_workload
from roomstore.demo.sample import sample_lines
from roomstore.pdu import canonical
from roomstore.pdu.canonical import canonical_json
from roomstore.pdu.hashing import compute_content_hash, compute_event_id
from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, get_room_version
from tests.events.pdus import encode, make_pdu

#: Every code point a JSON string can hold (surrogates cannot be UTF-8).
ALL_CODE_POINTS = "".join(chr(c) for c in itertools.chain(range(0xD800), range(0xE000, 0x110000)))

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1),
    st.integers(),  # beyond 64 bits: orjson refuses, canonicaljson writes
    st.text(),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=40,
)


class FastPathIsCanonicalJson(unittest.TestCase):
    def test_every_code_point_in_keys_and_values(self):
        for start in range(0, len(ALL_CODE_POINTS), 4096):
            chunk = ALL_CODE_POINTS[start : start + 4096]
            value = {chunk: [chunk, {c: c for c in chunk[:64]}]}
            self.assertEqual(canonical_json(value, floats=False), encode_canonical_json(value))

    def test_keys_sort_by_code_point(self):
        # UTF-16 order would put U+10000 before U+E000 and U+FFFF.
        keys = ["\U00010000", "\uffff", "\ue000", "\x7f", "a", "B", "", "aa", "\u2028"]
        for perm in itertools.islice(itertools.permutations(keys), 500):
            value = {k: 1 for k in perm}
            self.assertEqual(canonical_json(value, floats=False), encode_canonical_json(value))

    @settings(max_examples=400, deadline=None)
    @given(json_values)
    def test_any_json_without_floats(self, value):
        self.assertEqual(canonical_json(value, floats=False), encode_canonical_json(value))

    def test_floats_take_canonicaljsons_path(self):
        # orjson writes 1e16 as "1e16", canonicaljson (Python's repr) as "1e+16".
        value = {"a": 1e16, "b": [0.1, -2.5e-7, 1e300]}
        self.assertEqual(canonical_json(value), encode_canonical_json(value))
        self.assertIn(b"1e+16", canonical_json(value))

    def test_a_float_in_an_old_room_version_event_keeps_its_hashes(self):
        # Room versions 1-5 allow floats: the sender hashed with canonicaljson.
        for version_id in ("1", "3", "5"):
            version = get_room_version(version_id)
            pdu = make_pdu(version, content={"body": "x", "weight": 1e16, "ratio": 0.5})
            parsed = parse_pdu(encode(pdu), version)
            self.assertTrue(parsed.has_floats)
            self.assertEqual(pdu["hashes"]["sha256"], compute_content_hash(json.loads(encode(pdu))))
            self.assertEqual(compute_content_hash(parsed.event_dict, floats=parsed.has_floats), pdu["hashes"]["sha256"])
            if not version.event_id_in_pdu:
                self.assertEqual(parsed.event_id, compute_event_id(version, json.loads(encode(pdu))))

    def test_the_cross_check_catches_a_difference(self):
        original = canonical.encode_canonical_json
        self.patch(canonical, "_CROSS_CHECK", True)
        self.patch(canonical, "encode_canonical_json", lambda value: original(value) + b" ")
        with self.assertRaises(canonical.CanonicalMismatch):
            canonical_json({"a": 1}, floats=False)


class GeneratedEventsHashAlike(unittest.TestCase):
    """Every event the generators make: the fast path's hashes and IDs are canonicaljson's."""

    def _check(self, raw: bytes, version_id: str):
        version = get_room_version(version_id)
        parsed = parse_pdu(raw, version)
        event = json.loads(raw)
        self.assertFalse(parsed.has_floats)
        self.assertEqual(
            compute_content_hash(parsed.event_dict, floats=False), compute_content_hash(event, floats=True)
        )
        if not version.event_id_in_pdu:
            self.assertEqual(
                compute_event_id(version, parsed.event_dict, floats=False),
                compute_event_id(version, event, floats=True),
            )

    def test_the_benchmarks_workload(self):
        room, setup, events = persist_workload(2000)
        for item in [*setup, *events]:
            self._check(item.raw, item.room_version or room.version)

    def test_the_sample_rooms(self):
        versions: dict[str, str] = {}
        checked = 0
        for line in sample_lines(rooms=3, events_per_room=300):
            record = json.loads(line)
            event = record.get("event", record)
            if "room_version" in record:
                versions.setdefault(event.get("room_id"), record["room_version"])
            version_id = record.get("room_version") or versions[event["room_id"]]
            self._check(encode(event), version_id)
            checked += 1
        self.assertGreater(checked, 900)

    def test_every_room_version_builder(self):
        for version in KNOWN_ROOM_VERSIONS.values():
            self._check(encode(make_pdu(version)), version.identifier)
