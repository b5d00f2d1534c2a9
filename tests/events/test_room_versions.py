from twisted.trial import unittest

from roomstore.pdu.room_versions import (
    KNOWN_ROOM_VERSIONS,
    EventIdFormat,
    RoomVersions,
    UnknownRoomVersion,
    get_room_version,
)


class KnownRoomVersionsTests(unittest.TestCase):
    def test_exactly_versions_one_to_twelve_in_order(self) -> None:
        self.assertEqual(list(KNOWN_ROOM_VERSIONS), [str(n) for n in range(1, 13)])
        for identifier, version in KNOWN_ROOM_VERSIONS.items():
            self.assertEqual(version.identifier, identifier)

    def test_namespace_matches_dict(self) -> None:
        for n in range(1, 13):
            self.assertIs(getattr(RoomVersions, f"V{n}"), KNOWN_ROOM_VERSIONS[str(n)])

    def test_event_id_formats(self) -> None:
        expected = {
            "1": EventIdFormat.V1_V2,
            "2": EventIdFormat.V1_V2,
            "3": EventIdFormat.V3,
        }
        for identifier, version in KNOWN_ROOM_VERSIONS.items():
            self.assertIs(
                version.event_id_format,
                expected.get(identifier, EventIdFormat.V4_PLUS),
                identifier,
            )
            self.assertEqual(version.event_id_in_pdu, identifier in ("1", "2"))

    def test_feature_flags_switch_on_at_the_specified_version(self) -> None:
        # (attribute, first version with it set); all flags are monotone.
        first = {
            "enforce_key_validity": 5,
            "strict_canonicaljson": 6,
            "limit_notifications_power_levels": 6,
            "knock_join_rule": 7,
            "restricted_join_rule": 8,
            "knock_restricted_join_rule": 10,
            "enforce_int_power_levels": 10,
            "implicit_room_creator": 11,
            "redacts_in_content": 11,
            "redaction_create_keeps_all_content": 11,
            "redaction_keeps_third_party_invite_signed": 11,
            "room_id_is_create_hash": 12,
            "creators_have_infinite_power": 12,
            "state_res_v2_1": 12,
        }
        for n in range(1, 13):
            version = KNOWN_ROOM_VERSIONS[str(n)]
            for attribute, since in first.items():
                self.assertEqual(getattr(version, attribute), n >= since, (n, attribute))
            self.assertEqual(version.special_case_aliases_auth, n <= 5, n)
            self.assertEqual(version.state_res, 1 if n == 1 else 2, n)
            self.assertEqual(version.state_res_version, {1: "1", 12: "2.1"}.get(n, "2"), n)

    def test_v12_redaction_rules_are_v11s(self) -> None:
        # The spec's v12 page: redactions "unchanged from v11".
        for attribute in (
            "redaction_top_level_keys",
            "redaction_content_keys",
            "redacts_in_content",
            "redaction_create_keeps_all_content",
            "redaction_keeps_third_party_invite_signed",
            "event_id_format",
            "strict_canonicaljson",
        ):
            self.assertEqual(getattr(RoomVersions.V12, attribute), getattr(RoomVersions.V11, attribute), attribute)

    def test_versions_are_hashable_values(self) -> None:
        self.assertEqual(len(set(KNOWN_ROOM_VERSIONS.values())), 12)
        with self.assertRaises(AttributeError):
            RoomVersions.V1.identifier = "x"  # type: ignore[misc]

    def test_preserved_content_keys_for_unlisted_type_is_empty(self) -> None:
        self.assertEqual(RoomVersions.V11.preserved_content_keys("m.room.message"), frozenset())
        self.assertEqual(RoomVersions.V11.preserved_content_keys("m.room.name"), frozenset())


class GetRoomVersionTests(unittest.TestCase):
    def test_known(self) -> None:
        self.assertIs(get_room_version("10"), RoomVersions.V10)

    def test_unknown_string(self) -> None:
        with self.assertRaises(UnknownRoomVersion) as cm:
            get_room_version("13")
        self.assertEqual(cm.exception.identifier, "13")
        self.assertIn("'13'", str(cm.exception))
        self.assertIn("known room versions are: 1, 2, 3", str(cm.exception))
        self.assertIn(", 11, 12", str(cm.exception))
        self.assertNotIn("\n", str(cm.exception))

    def test_unknown_non_strings(self) -> None:
        for bad in (1, None, b"1", "v1", " 1", "org.matrix.msc3757.11"):
            with self.assertRaises(UnknownRoomVersion):
                get_room_version(bad)

    def test_unknown_room_version_is_a_value_error(self) -> None:
        self.assertTrue(issubclass(UnknownRoomVersion, ValueError))
