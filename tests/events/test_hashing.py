"""Content hashes, reference hashes, event IDs and signing.

Published vectors used:

* The spec's "Cryptographic test vectors" appendix (seed
  ``YJDBA9Xnr2sVqXD9Vj7XVUnmFZcZrlw8Md7kMW+3XA1``, server ``domain``, key
  ``ed25519:1``): content hashes and event signatures for two events.  The
  event signature is computed over the *redacted* event, so it checks the
  v1 redaction algorithm too.
* gomatrixserverlib's ``eventversion_test.go``: a real ``m.room.create``
  event from jki.re with its v3 and v4 event IDs.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from typing import Any

from canonicaljson import encode_canonical_json
from signedjson.key import (
    decode_signing_key_base64,
    decode_verify_key_bytes,
    generate_signing_key,
    get_verify_key,
)
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from twisted.trial import unittest

from roomstore.pdu.hashing import (
    compute_content_hash,
    compute_event_id,
    compute_reference_hash,
    unpadded_base64,
)
from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, RoomVersions
from tests.events.pdus import encode, make_pdu

SPEC_SEED = "YJDBA9Xnr2sVqXD9Vj7XVUnmFZcZrlw8Md7kMW+3XA1"

SPEC_MINIMAL_EVENT = {
    "room_id": "!x:domain",
    "sender": "@a:domain",
    "origin": "domain",
    "origin_server_ts": 1000000,
    "signatures": {},
    "hashes": {},
    "type": "X",
    "content": {},
    "prev_events": [],
    "auth_events": [],
    "depth": 3,
    "unsigned": {"age_ts": 1000000},
}
SPEC_REDACTABLE_EVENT = {
    "content": {"body": "Here is the message content"},
    "event_id": "$0:domain",
    "origin": "domain",
    "origin_server_ts": 1000000,
    "type": "m.room.message",
    "room_id": "!r:domain",
    "sender": "@u:domain",
    "signatures": {},
    "unsigned": {"age_ts": 1000000},
}

JKI_CREATE = {
    "auth_events": [],
    "prev_events": [],
    "type": "m.room.create",
    "room_id": "!uXDCzlYgCTHtiWCkEx:jki.re",
    "sender": "@erikj:jki.re",
    "content": {
        "room_version": "5",
        "predecessor": {
            "room_id": "!gdRMqOrTFdOCYHNwOo:half-shot.uk",
            "event_id": "$LP7ROBc4b+cMc1UE9haIz8q5AK2AIW4eJ90FfKLvyZI",
        },
        "creator": "@erikj:jki.re",
    },
    "depth": 1,
    "prev_state": [],
    "state_key": "",
    "origin": "jki.re",
    "origin_server_ts": 1560284621137,
    "hashes": {"sha256": "IX6zuNiJpJPNf70BLleL3HSCpjKeq9Uhu7uUpyDjBmc"},
    "signatures": {
        "jki.re": {
            "ed25519:auto": "O4IyFfF2PPtGp5uaDm8t57dZbdh8vc8Q64LgCwvzYRVItAMI0uisfiAFaxkVT7MRpzh6N2QNN5NMRXZKmgPYDA"
        }
    },
    "unsigned": {"age": 1321650},
}


def spec_sign_event(event: dict[str, Any], room_version: Any) -> dict[str, Any]:
    """The spec's event signing algorithm, with the spec's test key."""
    key = decode_signing_key_base64("ed25519", "1", SPEC_SEED)
    event = copy.deepcopy(event)
    event["hashes"] = {"sha256": compute_content_hash(event)}
    signed_redacted = sign_json(prune_event_dict(room_version, event), "domain", key)
    event["signatures"] = signed_redacted["signatures"]
    return event


class SpecVectorTests(unittest.TestCase):
    def test_content_hash_minimal_event(self) -> None:
        self.assertEqual(
            compute_content_hash(SPEC_MINIMAL_EVENT),
            "5jM4wQpv6lnBo7CLIghJuHdW+s2CMBJPUOGOC89ncos",
        )

    def test_content_hash_redactable_event(self) -> None:
        self.assertEqual(
            compute_content_hash(SPEC_REDACTABLE_EVENT),
            "onLKD1bGljeBWQhWZ1kaP9SorVmRQNdN5aM2JYU2n/g",
        )

    def test_signature_minimal_event(self) -> None:
        signed = spec_sign_event(SPEC_MINIMAL_EVENT, RoomVersions.V1)
        self.assertEqual(
            signed["signatures"],
            {
                "domain": {
                    "ed25519:1": "KxwGjPSDEtvnFgU00fwFz+l6d2pJM6XBIaMEn81SXPTRl16AqLAYqfIReFGZlHi5KLjAWbOoMszkwsQma+lYAg"  # noqa: E501 (a signature, whole)
                }
            },
        )

    def test_signature_redactable_event(self) -> None:
        # The body is redacted before signing, so this pins the v1 algorithm
        # (content emptied, event_id/origin kept, unsigned dropped).
        signed = spec_sign_event(SPEC_REDACTABLE_EVENT, RoomVersions.V1)
        self.assertEqual(
            signed["signatures"]["domain"]["ed25519:1"],
            "Wm+VzmOUOz08Ds+0NTWb1d4CZrVsJSikkeRxh6aCcUwu6pNC78FunoD7KNWzqFn241eYHYMGCA5McEiVPdhzBA",
        )

    def test_content_hash_does_not_modify_input(self) -> None:
        event = copy.deepcopy(SPEC_MINIMAL_EVENT)
        compute_content_hash(event)
        self.assertEqual(event, SPEC_MINIMAL_EVENT)


class EventIdVectorTests(unittest.TestCase):
    def test_jki_create_event_v3(self) -> None:
        self.assertEqual(
            compute_event_id(RoomVersions.V3, JKI_CREATE),
            "$RrGxF28UrHLmoASHndYb9Jb/1SFww2ptmtur9INS438",
        )

    def test_jki_create_event_v4_to_v10(self) -> None:
        # v4-v10 redact a create event identically, so the ID is the same.
        for n in range(4, 11):
            self.assertEqual(
                compute_event_id(KNOWN_ROOM_VERSIONS[str(n)], JKI_CREATE),
                "$RrGxF28UrHLmoASHndYb9Jb_1SFww2ptmtur9INS438",
                n,
            )

    def test_jki_content_hash(self) -> None:
        self.assertEqual(compute_content_hash(JKI_CREATE), JKI_CREATE["hashes"]["sha256"])

    def test_jki_create_event_v11_differs_and_matches_hand_computation(self) -> None:
        # v11 keeps all create content and drops origin/prev_state: redact by hand.
        by_hand = {k: v for k, v in JKI_CREATE.items() if k not in ("origin", "prev_state", "unsigned", "signatures")}
        digest = hashlib.sha256(encode_canonical_json(by_hand)).digest()
        expected = "$" + base64.urlsafe_b64encode(digest).decode().rstrip("=")
        self.assertEqual(compute_event_id(RoomVersions.V11, JKI_CREATE), expected)
        self.assertNotEqual(expected, "$RrGxF28UrHLmoASHndYb9Jb_1SFww2ptmtur9INS438")

    def test_message_event_hand_computation(self) -> None:
        event = make_pdu(RoomVersions.V10)
        by_hand = {
            "room_id": event["room_id"],
            "sender": event["sender"],
            "type": "m.room.message",
            "content": {},
            "origin_server_ts": event["origin_server_ts"],
            "depth": event["depth"],
            "prev_events": event["prev_events"],
            "auth_events": event["auth_events"],
            "hashes": event["hashes"],
        }
        digest = hashlib.sha256(encode_canonical_json(by_hand)).digest()
        self.assertEqual(compute_reference_hash(RoomVersions.V10, event), digest)
        self.assertEqual(
            compute_event_id(RoomVersions.V3, event),
            "$" + base64.b64encode(digest).decode().rstrip("="),
        )

    def test_ids_have_43_characters_of_the_right_alphabet(self) -> None:
        event = make_pdu(RoomVersions.V4)
        for n in range(3, 12):
            event_id = compute_event_id(KNOWN_ROOM_VERSIONS[str(n)], event)
            self.assertEqual(len(event_id), 44)
            self.assertTrue(event_id.startswith("$"))
            self.assertNotIn("=", event_id)
            if n >= 4:
                self.assertFalse(set(event_id) & set("+/"))

    def test_v1_v2_ids_cannot_be_computed(self) -> None:
        for version in (RoomVersions.V1, RoomVersions.V2):
            with self.assertRaises(ValueError):
                compute_event_id(version, make_pdu(version))

    def test_signatures_and_unsigned_do_not_affect_the_id(self) -> None:
        event = make_pdu(RoomVersions.V10)
        other = dict(event, signatures={"x": {"ed25519:y": "z"}}, unsigned={"age_ts": 5})
        self.assertEqual(compute_event_id(RoomVersions.V10, event), compute_event_id(RoomVersions.V10, other))

    def test_content_is_covered_through_the_content_hash(self) -> None:
        event = make_pdu(RoomVersions.V10)
        # Redacted content is outside the reference hash...
        tampered = dict(event, content={"body": "changed"})
        self.assertEqual(
            compute_event_id(RoomVersions.V10, event),
            compute_event_id(RoomVersions.V10, tampered),
        )
        # ...but a correct content hash for the new content changes the ID.
        rehashed = make_pdu(RoomVersions.V10, content={"body": "changed"})
        self.assertNotEqual(
            compute_event_id(RoomVersions.V10, event),
            compute_event_id(RoomVersions.V10, rehashed),
        )

    def test_unpadded_base64(self) -> None:
        self.assertEqual(unpadded_base64(b"\xfb\xff"), "+/8")
        self.assertEqual(unpadded_base64(b"\xfb\xff", urlsafe=True), "-_8")
        self.assertEqual(unpadded_base64(b""), "")


class SignedJsonRoundTripTests(unittest.TestCase):
    def setUp(self) -> None:
        self.key = generate_signing_key("k1")
        self.verify_key = get_verify_key(self.key)

    def _signed_pdu(self, version: Any) -> dict[str, Any]:
        event = make_pdu(version, signatures={})
        redacted_signed = sign_json(prune_event_dict(version, event), "example.org", self.key)
        event["signatures"] = redacted_signed["signatures"]
        return event

    def test_sign_parse_verify_every_version(self) -> None:
        for version in KNOWN_ROOM_VERSIONS.values():
            event = self._signed_pdu(version)
            parsed = parse_pdu(encode(event), version)
            # Verification works from the parsed dict, via the redacted form.
            verify_signed_json(prune_event_dict(version, dict(parsed.event_dict)), "example.org", self.verify_key)
            self.assertEqual(compute_content_hash(parsed.event_dict), event["hashes"]["sha256"])

    def test_verify_key_round_trips_through_bytes(self) -> None:
        event = self._signed_pdu(RoomVersions.V11)
        restored = decode_verify_key_bytes("ed25519:k1", self.verify_key.encode())
        verify_signed_json(prune_event_dict(RoomVersions.V11, event), "example.org", restored)

    def test_tampering_with_protected_fields_breaks_the_signature(self) -> None:
        event = self._signed_pdu(RoomVersions.V11)
        tampered = dict(event, depth=event["depth"] + 1)
        with self.assertRaises(SignatureVerifyException):
            verify_signed_json(prune_event_dict(RoomVersions.V11, tampered), "example.org", self.verify_key)

    def test_wrong_key_fails(self) -> None:
        event = self._signed_pdu(RoomVersions.V9)
        other = get_verify_key(generate_signing_key("k1"))
        with self.assertRaises(SignatureVerifyException):
            verify_signed_json(prune_event_dict(RoomVersions.V9, event), "example.org", other)
