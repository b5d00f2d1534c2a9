"""The content-hash check every persisted event passes, and signatures
checked against given verify keys (pure: no database)."""

from __future__ import annotations

import json

from canonicaljson import encode_canonical_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from signedjson.sign import sign_json
from twisted.trial import unittest

from roomstore.events.write.batch import EventToPersist, prepare_events
from roomstore.pdu.content_hash import ContentHashMismatch, checked_pdu, content_hash_matches
from roomstore.pdu.hashing import compute_content_hash, compute_event_id
from roomstore.pdu.parsing import InvalidEventError, parse_pdu
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import get_room_version
from roomstore.pdu.signatures import (
    InvalidSignature,
    KeysFileError,
    VerifyKeys,
    signatures_checked,
)
from tests.events.pdus import make_pdu

V10 = get_room_version("10")


def encoded(pdu: dict) -> bytes:
    return json.dumps(pdu).encode("utf-8")


class ContentHashTests(unittest.TestCase):
    def test_a_good_event_is_kept_byte_for_byte(self):
        for version in ("1", "3", "10", "11"):
            raw = encoded(make_pdu(get_room_version(version)))
            pdu = parse_pdu(raw, get_room_version(version))
            stored, mismatch = checked_pdu(pdu)
            self.assertFalse(mismatch)
            self.assertIs(stored, pdu)
            self.assertEqual(stored.raw, raw)

    def test_a_tampered_event_is_stored_redacted_under_the_same_id(self):
        for version in ("1", "2", "3", "4", "10", "11"):
            room_version = get_room_version(version)
            good = make_pdu(room_version)
            tampered = dict(good, content={"msgtype": "m.text", "body": "tampered"})
            pdu = parse_pdu(encoded(tampered), room_version)
            self.assertFalse(content_hash_matches(pdu))
            stored, mismatch = checked_pdu(pdu)
            self.assertTrue(mismatch, version)
            self.assertEqual(stored.event_id, pdu.event_id, version)
            if not room_version.event_id_in_pdu:
                # v3+: the ID is the reference hash, which covers the redacted form only.
                self.assertEqual(stored.event_id, compute_event_id(room_version, good))
            self.assertEqual(stored.raw, encode_canonical_json(prune_event_dict(room_version, tampered)))
            self.assertEqual(stored.content, {})
            self.assertNotIn("unsigned", stored.event_dict)

    def test_state_content_kept_by_redaction_survives(self):
        room_version = get_room_version("10")
        member = make_pdu(
            room_version,
            type="m.room.member",
            state_key="@alice:example.org",
            content={"membership": "join", "displayname": "Alice"},
        )
        member["content"]["displayname"] = "Mallory"  # after hashing: a mismatch
        stored, mismatch = checked_pdu(parse_pdu(encoded(member), room_version))
        self.assertTrue(mismatch)
        self.assertEqual(stored.content, {"membership": "join"})
        self.assertEqual(stored.membership, "join")

    def test_an_all_a_hash_is_a_mismatch(self):
        pdu = make_pdu(V10, hashes={"sha256": "A" * 43})
        self.assertTrue(checked_pdu(parse_pdu(encoded(pdu), V10))[1])

    def test_refused_when_asked(self):
        pdu = make_pdu(V10)
        pdu["content"]["body"] = "changed"
        parsed = parse_pdu(encoded(pdu), V10)
        with self.assertRaises(ContentHashMismatch) as caught:
            checked_pdu(parsed, refuse=True)
        self.assertIn(parsed.event_id, str(caught.exception))
        self.assertIn("content hash mismatch", str(caught.exception))
        with self.assertRaises(ContentHashMismatch):
            prepare_events([EventToPersist(encoded(pdu), "10")], {}, refuse_hash_mismatch=True)
        prepared = prepare_events([EventToPersist(encoded(pdu), "10")], {})
        self.assertTrue(prepared[0].content_hash_mismatch)
        self.assertEqual(prepared[0].event_id, parsed.event_id)

    # Every byte of the content's JSON, replaced by any other byte, is caught:
    # the bytes no longer parse (refused), or they parse to other content and
    # the hash check flags them. Only a change that parses to the same value
    # (none in practice for these encodings) may pass, and must then leave the
    # content unchanged.
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        content=st.dictionaries(
            st.text(min_size=1, max_size=8),
            st.one_of(
                st.text(max_size=20),
                st.integers(-(2**53) + 1, 2**53 - 1),
                st.booleans(),
                st.none(),
                st.lists(st.integers(0, 1000), max_size=3),
            ),
            min_size=1,
            max_size=4,
        ),
        ensure_ascii=st.booleans(),
        version=st.sampled_from(["1", "3", "10", "11"]),
        data=st.data(),
    )
    def test_any_byte_change_to_the_content_is_caught(self, content, ensure_ascii, version, data):
        room_version = get_room_version(version)
        pdu = make_pdu(room_version, content=content)
        rest = {k: v for k, v in pdu.items() if k != "content"}
        content_bytes = json.dumps(content, ensure_ascii=ensure_ascii).encode("utf-8")
        prefix = b'{"content": '
        raw = prefix + content_bytes + b", " + json.dumps(rest).encode("utf-8")[1:]
        self.assertFalse(checked_pdu(parse_pdu(raw, room_version))[1])  # the untouched event passes

        index = data.draw(st.integers(len(prefix), len(prefix) + len(content_bytes) - 1), label="index")
        new_byte = data.draw(st.integers(0, 255).filter(lambda b: b != raw[index]), label="byte")
        changed = raw[:index] + bytes([new_byte]) + raw[index + 1 :]
        try:
            parsed = parse_pdu(changed, room_version)
        except InvalidEventError:
            return  # refused outright: not stored at all
        if parsed.content == content:
            self.assertFalse(checked_pdu(parsed)[1])
            return
        stored, mismatch = checked_pdu(parsed)
        self.assertTrue(mismatch, f"{changed!r} not caught")
        with self.assertRaises(ContentHashMismatch):
            checked_pdu(parsed, refuse=True)
        # What is stored holds nothing of the changed content the redaction
        # algorithm drops (an m.room.message keeps no content).
        self.assertEqual(stored.content, {})


def signed(pdu: dict, room_version, server: str, key) -> dict:
    """``pdu`` with ``server``'s signature over its redacted form."""
    redacted = prune_event_dict(room_version, pdu)
    sign_json(redacted, server, key)
    return dict(pdu, signatures={server: redacted["signatures"][server]})


class SignatureTests(unittest.TestCase):
    def setUp(self):
        self.key = generate_signing_key("k1")
        self.keys = VerifyKeys.from_json(
            {"example.org": {"ed25519:k1": encode_verify_key_base64(get_verify_key(self.key))}}
        )

    def test_good_signature_is_checked(self):
        pdu = signed(make_pdu(V10), V10, "example.org", self.key)
        self.assertTrue(signatures_checked(parse_pdu(encoded(pdu), V10), self.keys))
        prepared = prepare_events([EventToPersist(encoded(pdu), "10")], {}, verify_keys=self.keys)
        self.assertTrue(prepared[0].signatures_checked)

    def test_content_tampering_keeps_a_valid_signature_but_fails_the_hash(self):
        pdu = signed(make_pdu(V10), V10, "example.org", self.key)
        pdu["content"]["body"] = "changed"
        parsed = parse_pdu(encoded(pdu), V10)
        self.assertTrue(signatures_checked(parsed, self.keys))  # signatures cover the redacted form
        self.assertTrue(checked_pdu(parsed)[1])

    def test_bad_signature_is_refused(self):
        pdu = signed(make_pdu(V10), V10, "example.org", self.key)
        pdu["origin_server_ts"] += 1  # covered by the redacted form: the signature breaks
        pdu["hashes"] = {"sha256": compute_content_hash(pdu)}
        with self.assertRaises(InvalidSignature) as caught:
            signatures_checked(parse_pdu(encoded(pdu), V10), self.keys)
        self.assertIn("bad signature by example.org", str(caught.exception))
        with self.assertRaises(InvalidSignature):
            prepare_events([EventToPersist(encoded(pdu), "10")], {}, verify_keys=self.keys)

    def test_signed_by_another_key_of_a_known_server(self):
        other = generate_signing_key("k2")
        pdu = signed(make_pdu(V10), V10, "example.org", other)
        self.assertFalse(signatures_checked(parse_pdu(encoded(pdu), V10), self.keys))

    def test_unsigned_by_a_known_server_is_refused(self):
        pdu = make_pdu(V10, signatures={"elsewhere.org": {"ed25519:x": "c2ln"}})
        with self.assertRaises(InvalidSignature):
            signatures_checked(parse_pdu(encoded(pdu), V10), self.keys)

    def test_unknown_server_is_unchecked(self):
        pdu = make_pdu(V10, sender="@bob:other.org")
        self.assertFalse(signatures_checked(parse_pdu(encoded(pdu), V10), self.keys))

    def test_v1_needs_the_event_id_server_too(self):
        v1 = get_room_version("1")
        pdu = make_pdu(v1, event_id="$abc:other.org")
        pdu = signed(pdu, v1, "example.org", self.key)
        self.assertFalse(signatures_checked(parse_pdu(encoded(pdu), v1), self.keys))  # other.org: no keys

    def test_key_response_format(self):
        verify = encode_verify_key_base64(get_verify_key(self.key))
        keys = VerifyKeys.from_json(
            {
                "example.org": {
                    "server_name": "example.org",
                    "valid_until_ts": 1,
                    "verify_keys": {"ed25519:k1": {"key": verify}},
                    "old_verify_keys": {},
                    "signatures": {},
                }
            }
        )
        pdu = signed(make_pdu(V10), V10, "example.org", self.key)
        self.assertTrue(signatures_checked(parse_pdu(encoded(pdu), V10), keys))

    def test_bad_keys_files(self):
        for bad in (
            [],
            {"example.org": "x"},
            {"example.org": {"k1": "AAAA"}},
            {"example.org": {"ed25519:k1": "not base64!"}},
            {"example.org": {"ed25519:k1": "AAAA"}},
            {"example.org": {"verify_keys": {"ed25519:k1": "AAAA"}}},
        ):
            with self.assertRaises(KeysFileError, msg=repr(bad)):
                VerifyKeys.from_json(bad)
