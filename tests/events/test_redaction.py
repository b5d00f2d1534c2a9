"""The redaction algorithm against the spec's per-version key lists.

The expected tables below are transcribed from the spec pages (/rooms/v1,
v6, v8, v9, v11; /rooms/v12 lists its redactions "unchanged from v11")
independently of roomstore.pdu.room_versions.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from roomstore.pdu.redaction_algorithm import (
    KEPT_UNSIGNED_KEYS,
    copy_json,
    prune_event_dict,
    redacted_copy,
    redacts_of,
)
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, RoomVersions

TOP_V1 = {
    "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
    "signatures", "depth", "prev_events", "prev_state", "auth_events", "origin",
    "origin_server_ts", "membership",
}  # fmt: skip
TOP_V11 = TOP_V1 - {"origin", "membership", "prev_state"}

PL_KEYS = {
    "ban", "events", "events_default", "kick", "redact", "state_default", "users",
    "users_default",
}  # fmt: skip

# Spec "allows keys" per event type, v1 ... v5.
CONTENT_V1 = {
    "m.room.member": {"membership"},
    "m.room.create": {"creator"},
    "m.room.join_rules": {"join_rule"},
    "m.room.power_levels": PL_KEYS,
    "m.room.aliases": {"aliases"},
    "m.room.history_visibility": {"history_visibility"},
}
CONTENT_V6 = {k: v for k, v in CONTENT_V1.items() if k != "m.room.aliases"}
CONTENT_V8 = dict(CONTENT_V6, **{"m.room.join_rules": {"join_rule", "allow"}})
CONTENT_V9 = dict(CONTENT_V8, **{"m.room.member": {"membership", "join_authorised_via_users_server"}})
CONTENT_V11 = dict(
    CONTENT_V9,
    **{
        "m.room.power_levels": PL_KEYS | {"invite"},
        "m.room.redaction": {"redacts"},
        # create: "allows all keys" -- checked separately
    },
)
del CONTENT_V11["m.room.create"]

SPEC_TABLE: dict[str, tuple[set[str], dict[str, set[str]]]] = {
    "1": (TOP_V1, CONTENT_V1),
    "2": (TOP_V1, CONTENT_V1),
    "3": (TOP_V1, CONTENT_V1),
    "4": (TOP_V1, CONTENT_V1),
    "5": (TOP_V1, CONTENT_V1),
    "6": (TOP_V1, CONTENT_V6),
    "7": (TOP_V1, CONTENT_V6),
    "8": (TOP_V1, CONTENT_V8),
    "9": (TOP_V1, CONTENT_V9),
    "10": (TOP_V1, CONTENT_V9),
    "11": (TOP_V11, CONTENT_V11),
    "12": (TOP_V11, CONTENT_V11),
}

# Every content key any version keeps for any type, plus junk.
ALL_CANDIDATE_CONTENT = {
    "membership": "join",
    "join_authorised_via_users_server": "@bob:example.org",
    "creator": "@alice:example.org",
    "room_version": "9",
    "predecessor": {"room_id": "!old:example.org"},
    "m.federate": False,
    "join_rule": "restricted",
    "allow": [{"type": "m.room_membership", "room_id": "!space:example.org"}],
    "ban": 50,
    "events": {"m.room.name": 50},
    "events_default": 0,
    "invite": 0,
    "kick": 50,
    "redact": 50,
    "state_default": 50,
    "users": {"@alice:example.org": 100},
    "users_default": 0,
    "notifications": {"room": 50},
    "aliases": ["#a:example.org"],
    "history_visibility": "joined",
    "redacts": "$target",
    "displayname": "Alice",
    "avatar_url": "mxc://example.org/abc",
    "body": "secret",
    "name": "Room name",
}

ALL_TOP_LEVEL = {
    "event_id": "$event:example.org",
    "type": None,  # filled per test
    "room_id": "!room:example.org",
    "sender": "@alice:example.org",
    "state_key": "",
    "content": None,  # filled per test
    "hashes": {"sha256": "abc"},
    "signatures": {"example.org": {"ed25519:1": "sig"}},
    "depth": 5,
    "prev_events": ["$prev"],
    "prev_state": [],
    "auth_events": ["$auth"],
    "origin": "example.org",
    "origin_server_ts": 1234,
    "membership": "join",
    "unsigned": {"age_ts": 1, "replaces_state": "$old", "prev_content": {"a": 1}},
    "redacts": "$target",
    "age_ts": 99,
    "outlier": True,
    "custom_key": "dropped",
}


def kitchen_sink(event_type: str) -> dict[str, Any]:
    event = copy.deepcopy(ALL_TOP_LEVEL)
    event["type"] = event_type
    event["content"] = copy.deepcopy(ALL_CANDIDATE_CONTENT)
    event["content"]["third_party_invite"] = {
        "display_name": "alice@example.com",
        "signed": {"mxid": "@alice:example.org", "token": "abc", "signatures": {}},
    }
    return event


EVENT_TYPES = [
    "m.room.member",
    "m.room.create",
    "m.room.join_rules",
    "m.room.power_levels",
    "m.room.aliases",
    "m.room.history_visibility",
    "m.room.redaction",
    "m.room.message",
    "m.room.name",
    "m.room.topic",
    "m.room.encrypted",
]


class SpecTableTests(unittest.TestCase):
    """Every version x every interesting type against the transcribed table."""

    def test_top_level_keys(self) -> None:
        for identifier, version in KNOWN_ROOM_VERSIONS.items():
            top, _ = SPEC_TABLE[identifier]
            pruned = prune_event_dict(version, kitchen_sink("m.room.message"))
            self.assertEqual(set(pruned), top, identifier)
            self.assertNotIn("unsigned", pruned)
            self.assertNotIn("redacts", pruned)

    def test_content_keys(self) -> None:
        for identifier, version in KNOWN_ROOM_VERSIONS.items():
            _, table = SPEC_TABLE[identifier]
            for event_type in EVENT_TYPES:
                if event_type == "m.room.create" and identifier in ("11", "12"):
                    continue  # all keys: see CreateTests
                event = kitchen_sink(event_type)
                pruned = prune_event_dict(version, event)
                expected = {k: event["content"][k] for k in table.get(event_type, set())}
                if identifier in ("11", "12") and event_type == "m.room.member":
                    expected["third_party_invite"] = {"signed": event["content"]["third_party_invite"]["signed"]}
                self.assertEqual(pruned["content"], expected, (identifier, event_type))


class PowerLevelsTests(unittest.TestCase):
    CONTENT = {
        "ban": 50,
        "events": {"m.room.name": 100},
        "events_default": 0,
        "invite": 50,
        "kick": 50,
        "notifications": {"room": 20},
        "redact": 50,
        "state_default": 50,
        "users": {"@alice:example.org": 100},
        "users_default": 0,
    }

    def _prune(self, version_id: str) -> dict[str, Any]:
        event = {"type": "m.room.power_levels", "state_key": "", "content": self.CONTENT}
        return prune_event_dict(KNOWN_ROOM_VERSIONS[version_id], event)["content"]

    def test_v10_drops_invite_and_notifications(self) -> None:
        content = self._prune("10")
        self.assertNotIn("invite", content)
        self.assertNotIn("notifications", content)
        self.assertEqual(content["users"], {"@alice:example.org": 100})
        self.assertEqual(len(content), 8)

    def test_v11_keeps_invite_but_not_notifications(self) -> None:
        content = self._prune("11")
        self.assertEqual(content["invite"], 50)
        self.assertNotIn("notifications", content)
        self.assertEqual(len(content), 9)


class JoinRulesTests(unittest.TestCase):
    EVENT = {
        "type": "m.room.join_rules",
        "state_key": "",
        "content": {
            "join_rule": "restricted",
            "allow": [{"type": "m.room_membership", "room_id": "!s:example.org"}],
            "extra": 1,
        },
    }

    def test_allow_kept_from_v8(self) -> None:
        for n in range(1, 12):
            content = prune_event_dict(KNOWN_ROOM_VERSIONS[str(n)], self.EVENT)["content"]
            self.assertEqual(content["join_rule"], "restricted")
            self.assertEqual("allow" in content, n >= 8, n)
            self.assertNotIn("extra", content)


class CreateTests(unittest.TestCase):
    EVENT = {
        "type": "m.room.create",
        "state_key": "",
        "sender": "@alice:example.org",
        "content": {
            "creator": "@alice:example.org",
            "room_version": "11",
            "m.federate": False,
            "predecessor": {"room_id": "!old:example.org", "event_id": "$x"},
            "type": "m.space",
        },
    }

    def test_v10_keeps_only_creator(self) -> None:
        content = prune_event_dict(RoomVersions.V10, self.EVENT)["content"]
        self.assertEqual(content, {"creator": "@alice:example.org"})

    def test_v11_keeps_all_content(self) -> None:
        content = prune_event_dict(RoomVersions.V11, self.EVENT)["content"]
        self.assertEqual(content, self.EVENT["content"])
        self.assertIsNot(content, self.EVENT["content"])
        self.assertIsNot(content["predecessor"], self.EVENT["content"]["predecessor"])


class MemberTests(unittest.TestCase):
    def _member(self, **content: Any) -> dict[str, Any]:
        return {
            "type": "m.room.member",
            "state_key": "@bob:example.org",
            "content": dict(membership="join", displayname="Bob", **content),
        }

    def test_join_authorised_via_users_server_kept_from_v9(self) -> None:
        event = self._member(join_authorised_via_users_server="@admin:example.org")
        for n in range(1, 12):
            content = prune_event_dict(KNOWN_ROOM_VERSIONS[str(n)], event)["content"]
            self.assertEqual(content["membership"], "join")
            self.assertNotIn("displayname", content)
            self.assertEqual("join_authorised_via_users_server" in content, n >= 9, n)

    def test_third_party_invite_signed_only_in_v11(self) -> None:
        signed = {"mxid": "@bob:example.org", "token": "tok", "signatures": {"id": {}}}
        event = self._member(third_party_invite={"display_name": "bob@example.com", "signed": signed})
        v10 = prune_event_dict(RoomVersions.V10, event)["content"]
        self.assertEqual(v10, {"membership": "join"})
        v11 = prune_event_dict(RoomVersions.V11, event)["content"]
        self.assertEqual(v11, {"membership": "join", "third_party_invite": {"signed": signed}})

    def test_v11_third_party_invite_without_signed_becomes_empty(self) -> None:
        event = self._member(third_party_invite={"display_name": "x"})
        content = prune_event_dict(RoomVersions.V11, event)["content"]
        self.assertEqual(content, {"membership": "join", "third_party_invite": {}})

    def test_v11_non_object_third_party_invite_dropped(self) -> None:
        event = self._member(third_party_invite="not an object")
        content = prune_event_dict(RoomVersions.V11, event)["content"]
        self.assertEqual(content, {"membership": "join"})

    def test_top_level_membership_dropped_in_v11_only(self) -> None:
        event = dict(self._member(), membership="join")
        self.assertEqual(prune_event_dict(RoomVersions.V10, event)["membership"], "join")
        self.assertNotIn("membership", prune_event_dict(RoomVersions.V11, event))


class HistoryVisibilityTests(unittest.TestCase):
    def test_kept_in_every_version(self) -> None:
        event = {
            "type": "m.room.history_visibility",
            "state_key": "",
            "content": {"history_visibility": "invited", "other": True},
        }
        for version in KNOWN_ROOM_VERSIONS.values():
            self.assertEqual(
                prune_event_dict(version, event)["content"],
                {"history_visibility": "invited"},
            )


class AliasesTests(unittest.TestCase):
    def test_aliases_kept_only_before_v6(self) -> None:
        event = {
            "type": "m.room.aliases",
            "state_key": "example.org",
            "content": {"aliases": ["#a:example.org"]},
        }
        for n in range(1, 12):
            content = prune_event_dict(KNOWN_ROOM_VERSIONS[str(n)], event)["content"]
            self.assertEqual(content, {"aliases": ["#a:example.org"]} if n <= 5 else {}, n)


class RedactionEventTests(unittest.TestCase):
    def test_v10_redaction_loses_redacts_entirely(self) -> None:
        event = {
            "type": "m.room.redaction",
            "redacts": "$target",
            "content": {"reason": "spam", "redacts": "$target"},
        }
        pruned = prune_event_dict(RoomVersions.V10, event)
        self.assertNotIn("redacts", pruned)
        self.assertEqual(pruned["content"], {})

    def test_v11_redacts_in_content_survives(self) -> None:
        event = {
            "type": "m.room.redaction",
            "redacts": "$legacy",
            "content": {"reason": "spam", "redacts": "$target"},
        }
        pruned = prune_event_dict(RoomVersions.V11, event)
        self.assertEqual(pruned["content"], {"redacts": "$target"})
        self.assertNotIn("redacts", pruned)

    def test_redacts_of_reads_the_version_location(self) -> None:
        event = {
            "type": "m.room.redaction",
            "redacts": "$top",
            "content": {"redacts": "$inner"},
        }
        self.assertEqual(redacts_of(RoomVersions.V10, event), "$top")
        self.assertEqual(redacts_of(RoomVersions.V11, event), "$inner")
        self.assertIsNone(redacts_of(RoomVersions.V11, {"type": "m.room.redaction", "content": {}}))
        self.assertIsNone(redacts_of(RoomVersions.V10, {"type": "m.room.redaction", "redacts": 5}))
        self.assertIsNone(redacts_of(RoomVersions.V10, dict(event, type="m.room.message")))


class RobustnessTests(unittest.TestCase):
    def test_input_not_mutated_and_output_not_aliased(self) -> None:
        event = kitchen_sink("m.room.power_levels")
        before = copy.deepcopy(event)
        pruned = prune_event_dict(RoomVersions.V11, event)
        self.assertEqual(event, before)
        pruned["content"]["users"]["@mallory:example.org"] = 100
        pruned["signatures"]["evil"] = {}
        self.assertEqual(event, before)

    def test_missing_or_non_object_content(self) -> None:
        for content in (None, [], "x", 5):
            event = {"type": "m.room.member", "content": content}
            self.assertEqual(prune_event_dict(RoomVersions.V11, event)["content"], {})
        self.assertEqual(prune_event_dict(RoomVersions.V1, {"type": "m.room.member"})["content"], {})

    def test_missing_or_non_string_type_keeps_no_content(self) -> None:
        for event in ({"content": {"membership": "join"}}, {"type": 5, "content": {"membership": "join"}}):
            self.assertEqual(prune_event_dict(RoomVersions.V1, event)["content"], {})

    def test_deeply_nested_content_does_not_overflow(self) -> None:
        nested: Any = "leaf"
        for _ in range(5000):
            nested = {"x": nested}
        event = {"type": "m.room.create", "content": {"deep": nested}}
        pruned = prune_event_dict(RoomVersions.V11, event)
        node = pruned["content"]["deep"]
        depth = 0
        while isinstance(node, dict):
            node = node["x"]
            depth += 1
        self.assertEqual((depth, node), (5000, "leaf"))

    def test_copy_json_converts_tuples_and_keeps_order(self) -> None:
        self.assertEqual(copy_json({"a": (1, [2, {"b": (3,)}])}), {"a": [1, [2, {"b": [3]}]]})
        self.assertEqual(copy_json(7), 7)

    # A small ASCII alphabet: building Hypothesis's full Unicode tables on first
    # use can take seconds on a loaded machine and trip the too_slow check.
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text("abc\x00\u00e9", max_size=5),
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(st.text("abc", max_size=5), children, max_size=3)
        ),
        max_leaves=6,
    )

    @settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
    @given(
        version=st.sampled_from(list(KNOWN_ROOM_VERSIONS.values())),
        event_type=st.sampled_from(EVENT_TYPES),
        content=st.dictionaries(
            st.sampled_from(sorted(ALL_CANDIDATE_CONTENT) + ["third_party_invite"]),
            json_values,
            max_size=6,
        ),
        extra=st.dictionaries(st.sampled_from(sorted(ALL_TOP_LEVEL)), json_values, max_size=6),
    )
    def test_prune_is_idempotent_and_shrinks(self, version: Any, event_type: str, content: dict, extra: dict) -> None:
        event = dict(extra, type=event_type, content=content)
        once = prune_event_dict(version, event)
        self.assertEqual(prune_event_dict(version, once), once)
        self.assertLessEqual(set(once), set(event) | {"content"})
        self.assertLessEqual(set(once["content"]), set(content))


class RedactedCopyTests(unittest.TestCase):
    EVENT = {
        "event_id": "$msg:example.org",
        "room_id": "!room:example.org",
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "content": {"body": "secret"},
        "unsigned": {
            "age_ts": 100,
            "replaces_state": "$old:example.org",
            "prev_content": {"body": "older"},
            "transaction_id": "txn1",
            "invite_room_state": [],
        },
    }
    REDACTION_V1 = {
        "event_id": "$red:example.org",
        "room_id": "!room:example.org",
        "type": "m.room.redaction",
        "sender": "@mod:example.org",
        "redacts": "$msg:example.org",
        "content": {"reason": "spam"},
    }

    def test_unsigned_keeps_only_allowed_keys_and_redacted_because(self) -> None:
        result = redacted_copy(self.EVENT, RoomVersions.V1, self.REDACTION_V1)
        self.assertEqual(result["content"], {})
        self.assertEqual(
            result["unsigned"],
            {
                "age_ts": 100,
                "replaces_state": "$old:example.org",
                "redacted_because": self.REDACTION_V1,
            },
        )
        self.assertEqual(KEPT_UNSIGNED_KEYS, {"age_ts", "replaces_state"})
        # The rest is exactly the spec algorithm.
        without_unsigned = {k: v for k, v in result.items() if k != "unsigned"}
        self.assertEqual(without_unsigned, prune_event_dict(RoomVersions.V1, self.EVENT))

    def test_redacted_because_is_a_copy(self) -> None:
        redaction = copy.deepcopy(self.REDACTION_V1)
        result = redacted_copy(self.EVENT, RoomVersions.V1, redaction)
        redaction["content"]["reason"] = "changed"
        self.assertEqual(result["unsigned"]["redacted_because"]["content"], {"reason": "spam"})

    def test_event_without_unsigned(self) -> None:
        event = {k: v for k, v in self.EVENT.items() if k != "unsigned"}
        result = redacted_copy(event, RoomVersions.V1, self.REDACTION_V1)
        self.assertEqual(list(result["unsigned"]), ["redacted_because"])

    def test_v11_target_in_content(self) -> None:
        redaction = dict(self.REDACTION_V1, content={"redacts": "$msg:example.org"})
        del redaction["redacts"]
        result = redacted_copy(self.EVENT, RoomVersions.V11, redaction)
        self.assertEqual(result["unsigned"]["redacted_because"], redaction)
        wrong = dict(redaction, content={"redacts": "$other:example.org"})
        with self.assertRaises(ValueError):
            redacted_copy(self.EVENT, RoomVersions.V11, wrong)

    def test_rejects_non_redaction(self) -> None:
        with self.assertRaises(ValueError) as cm:
            redacted_copy(self.EVENT, RoomVersions.V1, dict(self.REDACTION_V1, type="m.room.message"))
        self.assertIn("m.room.redaction", str(cm.exception))

    def test_rejects_other_target_or_room(self) -> None:
        with self.assertRaises(ValueError):
            redacted_copy(self.EVENT, RoomVersions.V1, dict(self.REDACTION_V1, redacts="$x:y"))
        with self.assertRaises(ValueError):
            redacted_copy(self.EVENT, RoomVersions.V1, dict(self.REDACTION_V1, room_id="!other:y"))

    def test_v3_event_without_event_id_is_not_target_checked(self) -> None:
        event = {k: v for k, v in self.EVENT.items() if k != "event_id"}
        redaction = dict(self.REDACTION_V1, redacts="$" + "a" * 43)
        result = redacted_copy(event, RoomVersions.V4, redaction)
        self.assertEqual(result["unsigned"]["redacted_because"]["redacts"], "$" + "a" * 43)
