"""``roomstore.pdu.build_event``: events of every room version built, hashed,
signed (the pruned form) and named as the spec says, checked by our own
parser, hash and signature code, and by Synapse's (``synapse_event_check.py``
under Synapse's virtualenv, the oracle)."""

from __future__ import annotations

import json
import os
import subprocess

from signedjson.key import decode_signing_key_base64, encode_verify_key_base64, get_verify_key
from signedjson.sign import sign_json
from twisted.trial import unittest

from roomstore.pdu import BuiltPdu, EventBuildError, build_event
from roomstore.pdu.canonical import canonical_json
from roomstore.pdu.content_hash import content_hash_matches
from roomstore.pdu.hashing import compute_content_hash, compute_event_id, compute_reference_hash, unpadded_base64
from roomstore.pdu.parsing import InvalidEventError, is_valid_event_id, parse_pdu
from roomstore.pdu.redaction_algorithm import prune_event_dict, redacts_of
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, EventIdFormat, UnknownRoomVersion, get_room_version
from roomstore.pdu.signatures import InvalidSignature, VerifyKeys, signatures_checked
from tests.synapse_server import SYNAPSE_PYTHON

SERVER = "example.org"
ALICE = f"@alice:{SERVER}"
BOB = "@bob:elsewhere.test"
#: A fixed key, so that the oracle can sign with it too (ed25519 signatures are deterministic).
SEED = unpadded_base64(bytes(range(32)))
KEY = decode_signing_key_base64("ed25519", "a", SEED)
KEYS = VerifyKeys.from_json({SERVER: {"ed25519:a": encode_verify_key_base64(get_verify_key(KEY))}})
TS = 1_700_000_000_000
ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synapse_event_check.py")


def create_content(version: str) -> dict:
    if get_room_version(version).implicit_room_creator:
        return {"room_version": version}
    return {"creator": ALICE, "room_version": version}


def small_room(version: str) -> list[BuiltPdu]:
    """create, join, power levels, a message (with ``unsigned``), its
    redaction; each citing the ones before as BuiltPdus."""
    v12 = get_room_version(version).room_id_is_create_hash

    def event(**kw) -> BuiltPdu:
        kw.setdefault("sender", ALICE)
        kw.setdefault("state_key", None)
        kw.setdefault("room_id", room_id)
        return build_event(version, origin_server_ts=TS + kw["depth"], signing_key=KEY, **kw)

    room_id = None if v12 else f"!room:{SERVER}"
    create = event(
        type="m.room.create", state_key="", content=create_content(version), prev_events=[], auth_events=[], depth=1
    )
    room_id = create.room_id
    implied = [] if v12 else [create]  # v12: the create event is never listed
    join = event(
        type="m.room.member",
        state_key=ALICE,
        content={"membership": "join", "displayname": "Alice"},
        prev_events=[create],
        auth_events=implied,
        depth=2,
    )
    levels = event(
        type="m.room.power_levels",
        state_key="",
        content={"users": {ALICE: 100}, "redact": 50},
        prev_events=[join],
        auth_events=[*implied, join],
        depth=3,
    )
    message = event(
        type="m.room.message",
        content={"msgtype": "m.text", "body": "hello"},
        prev_events=[levels],
        auth_events=[*implied, levels, join],
        depth=4,
        unsigned={"transaction_id": "t1"},
    )
    redaction = event(
        type="m.room.redaction",
        content={"reason": "oops"},
        redacts=message,
        prev_events=[message],
        auth_events=[*implied, levels, join],
        depth=5,
    )
    return [create, join, levels, message, redaction]


class BuildEventTests(unittest.TestCase):
    def test_every_room_version_builds_what_the_store_checks_accept(self):
        for version in KNOWN_ROOM_VERSIONS:
            room_version = get_room_version(version)
            for built in small_room(version):
                pdu = parse_pdu(built.raw, room_version)
                self.assertEqual(pdu.event_id, built.event_id)
                self.assertEqual(json.loads(built.raw), built.event)
                self.assertEqual(built.raw, canonical_json(built.event))
                self.assertTrue(is_valid_event_id(room_version, built.event_id), built.event_id)
                self.assertTrue(content_hash_matches(pdu))
                self.assertTrue(signatures_checked(pdu, KEYS), (version, built.event_id))
                self.assertEqual(list(built.event["signatures"]), [SERVER])
                self.assertEqual(
                    built.reference_hash, unpadded_base64(compute_reference_hash(room_version, built.event))
                )

    def test_the_signature_is_over_the_pruned_form_so_the_redacted_event_still_verifies(self):
        for version in ("1", "10", "12"):
            room_version = get_room_version(version)
            message = small_room(version)[3]
            pruned = prune_event_dict(room_version, message.event)
            self.assertEqual(pruned["content"], {})
            redacted = parse_pdu(canonical_json(pruned), room_version)
            self.assertEqual(redacted.event_id, message.event_id)
            self.assertTrue(signatures_checked(redacted, KEYS))
            # Signing the whole event instead (the old doc's mistake) gives a signature no receiver accepts.
            whole = {k: v for k, v in message.event.items() if k != "signatures"}
            wrong = sign_json(whole, SERVER, KEY)
            with self.assertRaises(InvalidSignature):
                signatures_checked(parse_pdu(canonical_json(wrong), room_version), KEYS)

    def test_event_ids_by_version(self):
        for version in KNOWN_ROOM_VERSIONS:
            room_version = get_room_version(version)
            create, join, *_ = small_room(version)
            if room_version.event_id_in_pdu:
                self.assertEqual(create.event["event_id"], create.event_id)
                self.assertTrue(create.event_id.endswith(f":{SERVER}"))
                continue
            self.assertNotIn("event_id", create.event)
            self.assertEqual(create.event_id, compute_event_id(room_version, create.event))
            digest = compute_reference_hash(room_version, create.event)
            urlsafe = room_version.event_id_format is EventIdFormat.V4_PLUS
            self.assertEqual(create.event_id, "$" + unpadded_base64(digest, urlsafe=urlsafe))

    def test_v3_uses_standard_and_v4_url_safe_base64(self):
        seen = {"3": set(), "4": set()}
        for version in seen:
            for depth in range(40):  # some of 40 IDs hold the characters that differ
                built = build_event(
                    version,
                    room_id="!r:example.org",
                    sender=ALICE,
                    type="m.room.message",
                    content={"body": str(depth)},
                    prev_events=[],
                    auth_events=[],
                    depth=depth,
                    origin_server_ts=TS,
                    signing_key=KEY,
                )
                seen[version] |= set(built.event_id) & set("+/-_")
        self.assertEqual((seen["3"], seen["4"]), ({"+", "/"}, {"-", "_"}))

    def test_v1_v2_cite_events_with_their_reference_hashes(self):
        for version in ("1", "2"):
            create, join, levels, message, redaction = small_room(version)
            self.assertEqual(message.event["prev_events"], [[levels.event_id, {"sha256": levels.reference_hash}]])
            self.assertEqual(
                [ref[0] for ref in message.event["auth_events"]], [create.event_id, levels.event_id, join.event_id]
            )
            # An ID alone needs its hash given; the same event results.
            by_id = build_event(
                version,
                room_id=create.room_id,
                sender=ALICE,
                type="m.room.member",
                state_key=ALICE,
                content={"membership": "join", "displayname": "Alice"},
                prev_events=[create.event_id],
                auth_events=[create.event_id],
                depth=2,
                origin_server_ts=TS + 2,
                signing_key=KEY,
                reference_hashes={create.event_id: create.reference_hash},
            )
            self.assertEqual(by_id.raw, join.raw)
            with self.assertRaisesRegex(EventBuildError, "reference hash"):
                build_event(
                    version,
                    room_id=create.room_id,
                    sender=ALICE,
                    type="m.room.message",
                    content={},
                    prev_events=[create.event_id],
                    auth_events=[],
                    depth=2,
                    origin_server_ts=TS,
                    signing_key=KEY,
                )

    def test_v1_chosen_event_ids(self):
        built = build_event(
            "1",
            room_id="!r:example.org",
            sender=ALICE,
            type="m.room.message",
            content={},
            prev_events=[],
            auth_events=[],
            depth=1,
            origin_server_ts=TS,
            signing_key=KEY,
            event_id="$mine:example.org",
        )
        self.assertEqual((built.event_id, built.event["event_id"]), ("$mine:example.org",) * 2)
        with self.assertRaisesRegex(EventBuildError, "another server"):
            build_event(
                "1",
                room_id="!r:example.org",
                sender=ALICE,
                type="m.room.message",
                content={},
                prev_events=[],
                auth_events=[],
                depth=1,
                origin_server_ts=TS,
                signing_key=KEY,
                event_id="$mine:other.test",
            )
        with self.assertRaisesRegex(EventBuildError, "reference hash"):
            build_event(
                "10",
                room_id="!r:example.org",
                sender=ALICE,
                type="m.room.message",
                content={},
                prev_events=[],
                auth_events=[],
                depth=1,
                origin_server_ts=TS,
                signing_key=KEY,
                event_id="$mine:example.org",
            )

    def test_v12_room_id_is_the_create_events_hash(self):
        create, join, levels, message, redaction = small_room("12")
        self.assertNotIn("room_id", create.event)
        self.assertEqual(create.room_id, "!" + create.event_id[1:])
        for built in (join, levels, message, redaction):
            self.assertEqual(built.event["room_id"], create.room_id)
            self.assertNotIn(create.event_id, built.event["auth_events"])
        self.assertEqual(parse_pdu(create.raw, get_room_version("12")).room_id, create.room_id)

    def test_redacts_where_the_version_keeps_it(self):
        for version in KNOWN_ROOM_VERSIONS:
            room_version = get_room_version(version)
            message, redaction = small_room(version)[3:]
            self.assertEqual(redacts_of(room_version, redaction.event), message.event_id)
            self.assertEqual("redacts" in redaction.event, not room_version.redacts_in_content)
            self.assertEqual("redacts" in redaction.event["content"], room_version.redacts_in_content)

    def test_unsigned_is_outside_hash_and_signature(self):
        message = small_room("10")[3]
        self.assertEqual(message.event["unsigned"], {"transaction_id": "t1"})
        bare = {k: v for k, v in message.event.items() if k != "unsigned"}
        self.assertEqual(compute_content_hash(bare), message.event["hashes"]["sha256"])
        self.assertTrue(signatures_checked(parse_pdu(canonical_json(bare), get_room_version("10")), KEYS))

    def test_content_is_copied(self):
        content = {"body": "x", "nested": {"a": [1]}}
        built = build_event(
            "10",
            room_id="!r:example.org",
            sender=ALICE,
            type="m.room.message",
            content=content,
            prev_events=[],
            auth_events=[],
            depth=1,
            origin_server_ts=TS,
            signing_key=KEY,
        )
        content["nested"]["a"].append(2)
        self.assertEqual(built.event["content"], {"body": "x", "nested": {"a": [1]}})
        self.assertEqual(json.loads(built.raw), built.event)


class BuildErrorTests(unittest.TestCase):
    """Each bad argument: a one-line ValueError naming it."""

    def build(self, version="10", **overrides):
        kw = dict(
            room_id="!r:example.org",
            sender=ALICE,
            type="m.room.message",
            content={"body": "x"},
            prev_events=[],
            auth_events=[],
            depth=1,
            origin_server_ts=TS,
            signing_key=KEY,
        )
        kw.update(overrides)
        return build_event(version, **kw)

    def refused(self, pattern: str, version="10", error=EventBuildError, **overrides) -> str:
        with self.assertRaisesRegex(error, pattern) as caught:
            self.build(version, **overrides)
        message = str(caught.exception)
        self.assertIsInstance(caught.exception, ValueError)
        self.assertNotIn("\n", message)
        return message

    def test_unknown_room_version(self):
        self.refused("Unknown room version '13'", "13", UnknownRoomVersion)
        self.refused("Unknown room version 10", 10, UnknownRoomVersion)

    def test_v12_room_ids(self):
        v12 = get_room_version("12")
        self.refused("build the create event first", "12", room_id=None)
        self.refused("not a room version 12 room ID", "12", room_id="!r:example.org")
        self.refused(
            "carries no room_id",
            "12",
            room_id="!r:example.org",
            type="m.room.create",
            state_key="",
            content={"room_version": "12"},
        )
        create = self.build("12", room_id=None, type="m.room.create", state_key="", content={"room_version": "12"})
        self.refused("implies it and forbids listing it", "12", room_id=create.room_id, auth_events=[create])
        self.refused("implies it", "12", room_id=create.room_id, auth_events=[create.event_id])
        other = self.build(
            "12", room_id=None, type="m.room.create", state_key="", content={"room_version": "12", "x": 1}
        )
        self.refused("is in room", "12", room_id=create.room_id, prev_events=[other])
        self.assertEqual(
            parse_pdu(self.build("12", room_id=create.room_id, prev_events=[create]).raw, v12).room_id, create.room_id
        )

    def test_room_ids_before_v12(self):
        self.refused("events carry their room's ID", room_id=None)
        self.refused("must look like '!opaque:server'", room_id="room")
        self.refused("must look like '!opaque:server'", room_id=5)

    def test_citations(self):
        self.refused(r"prev_events\[0\]: 'nope' is not a room version 10 event ID", prev_events=["nope"])
        self.refused(
            r"auth_events\[1\]: '\$a:example.org' is not a room version 10",
            auth_events=["$" + "A" * 43, "$a:example.org"],
        )
        self.refused("must be a list", prev_events="$" + "A" * 43)
        v1_event = self.build("1")
        self.refused("is a room version 1 event, this is room version 10", prev_events=[v1_event])
        self.refused("is in room", prev_events=[self.build(room_id="!other:example.org")])

    def test_redacts(self):
        target = self.build()
        self.refused("needs redacts=", type="m.room.redaction")
        self.refused("only m.room.redaction events redact", redacts=target)
        self.refused("is not a room version 10 event ID", type="m.room.redaction", redacts="$x:example.org")
        self.refused(
            "but content.redacts is",
            "11",
            type="m.room.redaction",
            content={"redacts": "$" + "B" * 43},
            redacts="$" + "A" * 43,
        )
        # v11+: redacts already in content is enough.
        built = self.build("11", type="m.room.redaction", content={"redacts": target.event_id})
        self.assertEqual(parse_pdu(built.raw, get_room_version("11")).redacts, target.event_id)

    def test_arguments(self):
        self.refused("sender must look like '@localpart:server'", sender="alice")
        self.refused("type must be a string", type=None)
        self.refused("state_key must be a string", state_key=5)
        self.refused("depth must be an integer, got bool", depth=True)
        self.refused("origin_server_ts must be an integer", origin_server_ts="now")
        self.refused("content must be a JSON object", content=[1])
        self.refused("unsigned must be a JSON object", unsigned="x")
        self.refused("signing_key must be a signedjson signing key", signing_key="secret")
        self.refused("origin must be a string", origin=1)
        create = dict(type="m.room.create", state_key="")
        self.refused(
            "content.room_version '11' of a create event built as room version 10",
            content={"room_version": "11"},
            **create,
        )
        self.refused(
            r"content.room_version '1 \(by default\)' of a create event built as room version 10", content={}, **create
        )
        self.assertEqual(self.build("1", content={}, **create).event["content"], {})

    def test_what_the_parser_refuses(self):
        # Checks past the builder's own are parse_pdu's, as for any PDU the store is given.
        self.refused("'depth' must be between", error=InvalidEventError, depth=-1)
        self.refused("floats are not allowed in room version 10", error=InvalidEventError, content={"x": 1.5})
        self.refused(r"PDU is \d+ bytes; the limit is 65536", error=InvalidEventError, content={"x": "a" * 70_000})


class SynapseOracleTests(unittest.TestCase):
    """Synapse 1.163.2's own functions agree on every built event: content
    hash, event ID, room ID (v12), reference hash, the signature's check, and
    the hashes and signature Synapse itself computes with the same key."""

    def test_synapse_agrees(self):
        if not os.path.exists(SYNAPSE_PYTHON):
            raise AssertionError(f"{SYNAPSE_PYTHON} missing (bin/setup makes it): Synapse is this test's oracle")
        versions = ("1", "3", "4", "10", "11", "12")
        built = [(version, event) for version in versions for event in small_room(version)]
        request = {
            "server": SERVER,
            "seed": SEED,
            "key_version": "a",
            "events": [{"room_version": version, "event": event.event} for version, event in built],
        }
        proc = subprocess.run(
            [SYNAPSE_PYTHON, ORACLE],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": os.environ.get("PATH", "")},
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        results = json.loads(proc.stdout)
        self.assertEqual(len(results), len(built))
        for (version, event), synapse in zip(built, results, strict=True):
            where = f"room version {version}, {event.event['type']}"
            self.assertEqual(synapse["event_id"], event.event_id, where)
            self.assertEqual(synapse["room_id"], event.room_id, where)
            self.assertTrue(synapse["content_hash_ok"], where)
            self.assertTrue(synapse["signature_ok"], where)
            self.assertEqual(synapse["reference_hash"], event.reference_hash, where)
            self.assertEqual(synapse["hashes"], event.event["hashes"], where)
            self.assertEqual(synapse["signatures"], event.event["signatures"], where)
