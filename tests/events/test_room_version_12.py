"""Room version 12 (MSC4291, MSC4289, MSC4297) against the spec and, as an
oracle, Synapse's own event code (matrix-synapse from the test extra; never
imported by roomstore): reference hashes, event IDs, room IDs, redaction,
the implied create auth event, creators' power levels."""

from __future__ import annotations

import copy
import json
import math

from signedjson.key import generate_signing_key
from twisted.trial import unittest

from roomstore.demo.sample import RoomGraphBuilder
from roomstore.pdu.hashing import add_derived_ids, compute_event_id, compute_reference_hash
from roomstore.pdu.parsing import InvalidEventError, parse_pdu
from roomstore.pdu.power_levels import CREATOR_POWER_LEVEL, creators_listed, room_creators, user_power_level
from roomstore.pdu.redaction_algorithm import prune_event_dict
from roomstore.pdu.room_versions import RoomVersions, get_room_version
from tests.events.pdus import encode, make_pdu
from tests.synapse_oracle import prepare_synapse

V12 = RoomVersions.V12
CREATOR = "@alice:example.org"
COFOUNDER = "@carol:example.org"
BOB = "@bob:example.org"


def synapse():
    """Synapse's event modules, the oracle (they fail, never skip, without it)."""
    if not prepare_synapse():
        raise AssertionError("matrix-synapse (the test extra) is not installed: it is the oracle of these tests")
    from synapse.api.room_versions import KNOWN_ROOM_VERSIONS
    from synapse.crypto.event_signing import add_hashes_and_signatures, compute_event_reference_hash
    from synapse.event_auth import get_user_power_level
    from synapse.events import make_event_from_dict
    from synapse.events.utils import prune_event
    from synapse.federation.federation_base import event_from_pdu_json

    return (
        KNOWN_ROOM_VERSIONS,
        make_event_from_dict,
        prune_event,
        compute_event_reference_hash,
        add_hashes_and_signatures,
        event_from_pdu_json,
        get_user_power_level,
    )


def v12_room() -> RoomGraphBuilder:
    """A v12 room with an additional creator and one of each kind of event."""
    room = RoomGraphBuilder(version="12", creator=CREATOR, additional_creators=[COFOUNDER])
    room.create()
    room.join(CREATOR)
    room.power_levels({CREATOR: 100, COFOUNDER: 100, BOB: 50})
    room.state("m.room.join_rules", "", {"join_rule": "restricted", "allow": [{"type": "m.room_membership"}]})
    room.history_visibility("shared")
    room.join(BOB)
    room.build(
        "m.room.member",
        BOB,
        {
            "membership": "join",
            "displayname": "Bob",
            "join_authorised_via_users_server": CREATOR,
            "third_party_invite": {"display_name": "bob", "signed": {"mxid": BOB, "token": "t", "signatures": {}}},
        },
        BOB,
    )
    room.state("m.room.topic", "", {"topic": "secret topic"})
    message = room.message(BOB, "hello")
    room.redact(CREATOR, message.event_id)
    room.state(
        "m.room.power_levels",
        "",
        {
            "users": {BOB: 50},
            "invite": 0,
            "notifications": {"room": 50},
            "events": {"m.room.name": 50},
            "users_default": 0,
        },
    )
    return room


class HashesAndIdsAgainstSynapseTests(unittest.TestCase):
    def test_event_ids_reference_hashes_and_room_id_agree(self) -> None:
        known, make_event, _, reference_hash, *_ = synapse()
        room = v12_room()
        create = room.events[0]
        self.assertNotIn("room_id", create.event)
        for built in room.events:
            theirs = make_event(copy.deepcopy(built.event), known["12"])
            self.assertEqual(built.event_id, theirs.event_id, built.event["type"])
            self.assertEqual(compute_event_id(V12, built.event), theirs.event_id)
            self.assertEqual(compute_reference_hash(V12, built.event), reference_hash(theirs)[1])
            # Synapse derives the create event's room ID as we do.
            self.assertEqual(theirs.room_id, room.room_id)
            parsed = parse_pdu(built.raw, V12)
            self.assertEqual((parsed.event_id, parsed.room_id), (theirs.event_id, theirs.room_id))
            # The create event is implied in every auth chain: Synapse's
            # auth_event_ids() lists it after the PDU's own, as ours does.
            self.assertEqual(list(parsed.auth_chain_event_ids), list(theirs.auth_event_ids()), built.event["type"])
        self.assertEqual(room.room_id, "!" + create.event_id[1:])
        self.assertEqual(parse_pdu(create.raw, V12).auth_chain_event_ids, ())
        self.assertEqual(parse_pdu(room.events[1].raw, V12).auth_chain_event_ids, (create.event_id,))

    def test_events_hashed_and_signed_by_synapse_parse_with_synapses_ids(self) -> None:
        known, make_event, _, _, add_hashes_and_signatures, _, _ = synapse()
        key = generate_signing_key("v12")
        create = {
            "type": "m.room.create",
            "state_key": "",
            "sender": CREATOR,
            "depth": 1,
            "origin_server_ts": 5,
            "content": {"room_version": "12", "additional_creators": [COFOUNDER]},
            "prev_events": [],
            "auth_events": [],
        }
        add_hashes_and_signatures(known["12"], create, "example.org", key)
        create_event = make_event(copy.deepcopy(create), known["12"])
        message = {
            "type": "m.room.message",
            "sender": CREATOR,
            "room_id": create_event.room_id,
            "depth": 2,
            "origin_server_ts": 6,
            "content": {"msgtype": "m.text", "body": "hi"},
            "prev_events": [create_event.event_id],
            "auth_events": [],
        }
        add_hashes_and_signatures(known["12"], message, "example.org", key)
        for pdu in (create, message):
            theirs = make_event(copy.deepcopy(pdu), known["12"])
            ours = parse_pdu(json.dumps(pdu).encode(), V12)
            self.assertEqual((ours.event_id, ours.room_id), (theirs.event_id, theirs.room_id))


class RedactionAgainstSynapseTests(unittest.TestCase):
    def test_prune_matches_synapse_for_every_event(self) -> None:
        known, make_event, prune_event, *_ = synapse()
        for built in v12_room().events:
            event = dict(built.event, unsigned={"age_ts": 1, "prev_content": {"x": 1}})
            theirs = prune_event(make_event(copy.deepcopy(event), known["12"])).get_dict()
            theirs.pop("unsigned", None)  # Synapse keeps an (empty) unsigned; the spec's algorithm drops it
            self.assertEqual(prune_event_dict(V12, event), theirs, built.event["type"])

    def test_v12_prunes_as_v11(self) -> None:
        for built in v12_room().events:
            self.assertEqual(prune_event_dict(V12, built.event), prune_event_dict(RoomVersions.V11, built.event))

    def test_create_keeps_additional_creators(self) -> None:
        create = v12_room().events[0].event
        self.assertEqual(prune_event_dict(V12, create)["content"]["additional_creators"], [COFOUNDER])


class CreateEventRoomIdTests(unittest.TestCase):
    """A v12 create event carries no room_id: one that does is refused, with
    a wrong room ID or with the one derived from its own hash (which it can
    never match: the hash covers room_id). Synapse refuses both too."""

    def test_create_with_a_room_id_is_refused_like_synapse(self) -> None:
        known, make_event, *_ = synapse()
        from synapse.api.errors import SynapseError

        create = v12_room().events[0].event
        derived = "!" + compute_event_id(V12, create)[1:]
        for room_id in ("!elsewhere:example.org", derived, "!" + "A" * 43):
            pdu = dict(create, room_id=room_id)
            with self.assertRaises(InvalidEventError) as cm:
                parse_pdu(encode(pdu), V12)
            self.assertEqual(cm.exception.field, "room_id")
            self.assertIn("must not carry 'room_id'", str(cm.exception))
            with self.assertRaises(SynapseError):  # 400: Invalid event JSON
                make_event(copy.deepcopy(pdu), known["12"])

    def test_create_in_older_versions_still_needs_a_room_id(self) -> None:
        pdu = make_pdu(
            RoomVersions.V11, type="m.room.create", state_key="", content={"room_version": "11"}, _drop=("room_id",)
        )
        with self.assertRaises(InvalidEventError) as cm:
            parse_pdu(encode(pdu), RoomVersions.V11)
        self.assertEqual(cm.exception.field, "room_id")

    def test_other_events_need_a_hash_room_id(self) -> None:
        for bad in (
            "!room:example.org",
            "!" + "A" * 42,
            "!" + "A" * 44,
            "!" + "A+/" + "b" * 40,
            "!" + "A" * 43 + ":example.org",
            "$" + "A" * 43,
        ):
            with self.assertRaises(InvalidEventError) as cm:
                parse_pdu(encode(make_pdu(V12, room_id=bad)), V12)
            self.assertEqual(cm.exception.field, "room_id", bad)
        with self.assertRaises(InvalidEventError) as cm:
            parse_pdu(encode(make_pdu(V12, _drop=("room_id",))), V12)
        self.assertIn("missing required key 'room_id'", str(cm.exception))
        # A create event with another state key is no room's create event.
        with self.assertRaises(InvalidEventError):
            parse_pdu(encode(make_pdu(V12, type="m.room.create", state_key="x", _drop=("room_id",))), V12)

    def test_auth_events_listing_the_create_event_are_refused_like_synapse(self) -> None:
        known, _, _, _, _, event_from_pdu_json, _ = synapse()
        room = v12_room()
        create_id = room.events[0].event_id
        pdu = make_pdu(V12, room_id=room.room_id, auth_events=[create_id])
        with self.assertRaises(InvalidEventError) as cm:
            parse_pdu(encode(pdu), V12)
        self.assertEqual(cm.exception.field, "auth_events")
        self.assertIn(create_id, str(cm.exception))
        with self.assertRaises(Exception) as theirs:
            event_from_pdu_json(copy.deepcopy(pdu), known["12"])
        self.assertIn("create event", str(theirs.exception))
        # Older versions list it as ever.
        v11 = make_pdu(RoomVersions.V11, auth_events=[create_id])
        self.assertEqual(parse_pdu(encode(v11), RoomVersions.V11).auth_chain_event_ids, (create_id,))

    def test_served_form_adds_the_room_id_back(self) -> None:
        room = v12_room()
        create = room.events[0]
        served = add_derived_ids(json.loads(create.raw), create.event_id, V12)
        self.assertEqual(served["room_id"], room.room_id)
        self.assertEqual(served["event_id"], create.event_id)
        message = room.events[1]
        self.assertEqual(add_derived_ids(json.loads(message.raw), message.event_id, V12)["room_id"], room.room_id)
        v10 = make_pdu(RoomVersions.V10, type="m.room.create", state_key="")
        self.assertEqual(add_derived_ids(dict(v10), "$x", RoomVersions.V10)["room_id"], "!room:example.org")


class CreatorPowerTests(unittest.TestCase):
    def synapse_level(self, version: str, create: dict, power_levels: dict | None, user: str) -> int:
        known, make_event, _, _, _, _, get_user_power_level = synapse()
        create_event = make_event(copy.deepcopy(create), known[version])
        auth = {("m.room.create", ""): create_event}
        if power_levels is not None:
            auth[("m.room.power_levels", "")] = make_event(
                {
                    "type": "m.room.power_levels",
                    "state_key": "",
                    "sender": CREATOR,
                    "room_id": create_event.room_id,
                    "content": power_levels,
                    "depth": 3,
                    "origin_server_ts": 1,
                    "prev_events": [],
                    "auth_events": [],
                    "hashes": {"sha256": "x"},
                    "signatures": {},
                },
                known[version],
            )
        return get_user_power_level(user, auth)

    def test_levels_agree_with_synapse(self) -> None:
        dave = "@dave:example.org"
        for version in ("10", "11", "12"):
            room = RoomGraphBuilder(
                room_id="!r:example.org", version=version, creator=CREATOR, additional_creators=[COFOUNDER]
            )
            create = room.create().event
            for power_levels in (
                None,
                {"users": {BOB: 50, dave: 0}, "users_default": 10},
                {"users": {CREATOR: 1, COFOUNDER: 2}},
            ):
                for user in (CREATOR, COFOUNDER, BOB, dave, "@eve:example.org"):
                    ours = user_power_level(get_room_version(version), create, power_levels, user)
                    theirs = self.synapse_level(version, create, power_levels, user)
                    if math.isinf(ours):
                        # Synapse stands infinity in with an integer above any level.
                        self.assertEqual((version, user in (CREATOR, COFOUNDER)), ("12", True))
                        self.assertGreater(theirs, 2**53 - 1)  # above the largest canonical JSON integer
                    else:
                        self.assertEqual(ours, theirs, (version, power_levels, user))

    def test_creators_and_listing_them(self) -> None:
        room = RoomGraphBuilder(version="12", creator=CREATOR, additional_creators=[COFOUNDER, 5])
        create = room.create().event
        self.assertEqual(room_creators(V12, create), {CREATOR, COFOUNDER})
        self.assertEqual(user_power_level(V12, create, {"users": {COFOUNDER: 0}}, COFOUNDER), CREATOR_POWER_LEVEL)
        self.assertEqual(creators_listed(V12, create, {"users": {COFOUNDER: 100, BOB: 50}}), [COFOUNDER])
        self.assertEqual(creators_listed(V12, create, {"users": {BOB: 50}}), [])
        v11 = RoomGraphBuilder(version="11", creator=CREATOR, additional_creators=[COFOUNDER]).create().event
        self.assertEqual(room_creators(RoomVersions.V11, v11), {CREATOR})
        self.assertEqual(creators_listed(RoomVersions.V11, v11, {"users": {CREATOR: 100}}), [])
        v10 = dict(v11, content={"creator": BOB})
        self.assertEqual(room_creators(RoomVersions.V10, v10), {BOB})

    def test_sample_power_levels_do_not_list_creators(self) -> None:
        room = v12_room()
        levels = room.events[2].event["content"]
        self.assertEqual(levels["users"], {BOB: 50})
        self.assertEqual(creators_listed(V12, room.events[0].event, levels), [])


class BundledSampleAgainstSynapseTests(unittest.TestCase):
    def test_the_samples_v12_room_agrees_with_synapse(self) -> None:
        from roomstore.cli.demo import SAMPLE_PATH

        known, make_event, prune_event, *_ = synapse()
        room_id, count = None, 0
        with open(SAMPLE_PATH, encoding="utf-8") as handle:
            for line in handle:
                obj = json.loads(line)
                event = obj.get("event", obj)
                if obj.get("room_version") != "12" and (room_id is None or event.get("room_id") != room_id):
                    continue
                theirs = make_event(copy.deepcopy(event), known["12"])
                ours = parse_pdu(json.dumps(event).encode(), V12)
                self.assertEqual((ours.event_id, ours.room_id), (theirs.event_id, theirs.room_id))
                pruned = prune_event(theirs).get_dict()
                pruned.pop("unsigned", None)
                self.assertEqual(prune_event_dict(V12, event), pruned)
                room_id = ours.room_id
                count += 1
        # The sample's first room: 800 events of a version 12 room.
        self.assertEqual(count, 800)
