"""The authorization rules (``roomstore.pdu.auth_rules``) against Synapse
1.163.2 as the oracle: every membership transition and power level case,
each once allowed and once rejected, on room versions 1, 3, 6, 8, 10, 11
and 12 (and the versions a feature starts in).

Each case builds real events in a :class:`tests.pdu.rooms.Room`, then checks
the event four ways that must all give the expected verdict: our rules and
Synapse's state-dependent rules against the state before the event, and
both against the event's own auth events (after both sides' checks of the
auth events' shape passed).
"""

from __future__ import annotations

import base64
import json

from signedjson.key import generate_signing_key, get_verify_key
from signedjson.sign import sign_json
from twisted.trial import unittest

from roomstore.pdu.auth_rules import AuthError, auth_types_for_event, check_auth_events_shape, check_event_auth
from roomstore.pdu.parsing import parse_pdu
from roomstore.pdu.room_versions import get_room_version
from tests.pdu.rooms import ALICE, BOB, CAROL, DAVE, EVE, Oracle, Room

VERSIONS = ("1", "3", "6", "8", "10", "11", "12")
KNOCK_VERSIONS = ("7", "8", "10", "11", "12")
RESTRICTED_VERSIONS = ("8", "9", "10", "11", "12")
KNOCK_RESTRICTED_VERSIONS = ("10", "11", "12")


class OracleCase(unittest.TestCase):
    """Verdicts of ours and Synapse's, compared."""

    oracle: Oracle | None = None

    def setUp(self) -> None:
        if OracleCase.oracle is None:
            OracleCase.oracle = Oracle()

    def ours(self, room: Room, event, state) -> str | None:
        """None when allowed, else our error message."""
        try:
            check_event_auth(room.room_version, event, state)
        except AuthError as e:
            self.assertNotIn("\n", str(e))
            self.assertRegex(str(e), r"^rule \d+")
            return str(e)
        return None

    def verdict(self, room: Room, event, allowed: bool, state=None) -> None:
        """``event`` (built with apply=False) against the room's current state
        (or ``state``) and against its auth events, ours and Synapse's."""
        state = room.state if state is None else state
        oracle = self.oracle
        label = f"v{room.version} {event.type} {event.content.get('membership', '')} by {event.sender}"
        ours = self.ours(room, event, state)
        self.assertEqual(ours is None, allowed, f"{label}: ours on the state: {ours}")
        self.assertEqual(oracle.allows(event, state), allowed, f"{label}: Synapse on the state")
        auth_state = check_auth_events_shape(room.room_version, event, room.events)
        self.assertTrue(oracle.allows_auth_events(event, room.events), f"{label}: Synapse on the auth events' shape")
        ours = self.ours(room, event, auth_state)
        self.assertEqual(ours is None, allowed, f"{label}: ours on the auth events: {ours}")
        self.assertEqual(oracle.allows(event, auth_state), allowed, f"{label}: Synapse on the auth events")

    def each(self, versions, case) -> None:
        for version in versions:
            case(version)


class MembershipJoinTests(OracleCase):
    def test_creator_first_join(self):
        def case(v):
            room = Room(v)
            room.create()
            self.verdict(room, room.member(ALICE, "join", apply=False), True)
            self.verdict(room, room.member(BOB, "join", apply=False), False)

        self.each(VERSIONS, case)

    def test_public_join(self):
        def case(v):
            room = Room(v).standard("public")
            self.verdict(room, room.member(BOB, "join", apply=False), True)
            self.verdict(room, room.member(BOB, "join", sender=CAROL, apply=False), False)

        self.each(VERSIONS, case)

    def test_invite_only_join(self):
        def case(v):
            room = Room(v).standard("invite")
            self.verdict(room, room.member(BOB, "join", apply=False), False)
            room.member(BOB, "invite", ALICE)
            self.verdict(room, room.member(BOB, "join", apply=False), True)

        self.each(VERSIONS, case)

    def test_join_again_while_joined(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB])
            self.verdict(room, room.member(BOB, "join", apply=False, content={"displayname": "B"}), True)
            self.verdict(room, room.member(CAROL, "join", apply=False), False)

        self.each(VERSIONS, case)

    def test_banned_cannot_join(self):
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            room.member(CAROL, "ban", ALICE)
            self.verdict(room, room.member(CAROL, "join", apply=False), False)
            room.member(CAROL, "leave", ALICE)  # unban
            self.verdict(room, room.member(CAROL, "join", apply=False), True)

        self.each(VERSIONS, case)

    def test_private_join_rule(self):
        def case(v):
            room = Room(v).standard("private")
            self.verdict(room, room.member(BOB, "join", apply=False), False)
            room.join_rules("public")
            self.verdict(room, room.member(BOB, "join", apply=False), True)

        self.each(VERSIONS, case)

    def test_knock_join_rule(self):
        def case(v):
            room = Room(v).standard("knock")
            self.verdict(room, room.member(BOB, "join", apply=False), False)
            room.member(BOB, "knock")
            self.verdict(room, room.member(BOB, "join", apply=False), False)
            room.member(BOB, "invite", ALICE)
            self.verdict(room, room.member(BOB, "join", apply=False), True)

        self.each(KNOCK_VERSIONS, case)

    def test_restricted_join(self):
        def case(v):
            room = Room(v).standard("restricted", members=[BOB], users={CAROL: 10})
            authorised = {"join_authorised_via_users_server": ALICE}
            self.verdict(room, room.member(EVE, "join", apply=False, content=authorised), True)
            self.verdict(room, room.member(EVE, "join", apply=False), False)
            # The authoriser must be joined ...
            self.verdict(
                room, room.member(EVE, "join", apply=False, content={"join_authorised_via_users_server": CAROL}), False
            )
            # ... and able to invite.
            room.power_levels({ALICE: 100} if v != "12" else {}, invite=50)
            self.verdict(
                room, room.member(EVE, "join", apply=False, content={"join_authorised_via_users_server": BOB}), False
            )
            room.member(EVE, "invite", ALICE)
            self.verdict(room, room.member(EVE, "join", apply=False), True)

        self.each(RESTRICTED_VERSIONS, case)

    def test_knock_restricted_join(self):
        def case(v):
            room = Room(v).standard("knock_restricted")
            authorised = {"join_authorised_via_users_server": ALICE}
            self.verdict(room, room.member(EVE, "join", apply=False, content=authorised), True)
            self.verdict(room, room.member(EVE, "join", apply=False), False)

        self.each(KNOCK_RESTRICTED_VERSIONS, case)

    def test_restricted_is_unknown_before_v8(self):
        def case(v):
            room = Room(v).standard("restricted")
            self.verdict(room, room.member(EVE, "join", apply=False), False)
            room.member(EVE, "invite", ALICE)
            self.verdict(room, room.member(EVE, "join", apply=False), False)

        self.each(("1", "3", "6", "7"), case)


class MembershipInviteTests(OracleCase):
    def test_invite(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB])
            self.verdict(room, room.member(CAROL, "invite", BOB, apply=False), True)
            self.verdict(room, room.member(CAROL, "invite", EVE, apply=False), False)  # not joined

        self.each(VERSIONS, case)

    def test_invite_of_joined_or_banned(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB])
            self.verdict(room, room.member(BOB, "invite", ALICE, apply=False), False)
            room.member(CAROL, "ban", ALICE)
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False), False)
            room.member(CAROL, "leave", ALICE)
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False), True)

        self.each(VERSIONS, case)

    def test_invite_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={CAROL: 50})
            room.power_levels({ALICE: 100, CAROL: 50} if v != "12" else {CAROL: 50}, invite=50)
            room.member(CAROL, "invite", ALICE)
            room.member(CAROL, "join")
            self.verdict(room, room.member(EVE, "invite", BOB, apply=False), False)
            self.verdict(room, room.member(EVE, "invite", CAROL, apply=False), True)

        self.each(VERSIONS, case)


def third_party_room(v: str):
    """A room where Alice issued a third-party invite; returns (room, signing key, token)."""
    key = generate_signing_key("1")
    public = base64.b64encode(get_verify_key(key).encode()).decode().rstrip("=")
    room = Room(v).standard("invite", members=[BOB])
    room.build(
        "m.room.third_party_invite",
        ALICE,
        {"display_name": "c...", "public_key": public, "key_validity_url": "https://id.example/v"},
        "tok",
    )
    return room, key, "tok"


def signed_bundle(key, mxid: str, token: str) -> dict:
    return sign_json({"mxid": mxid, "token": token, "sender": ALICE}, "id.example", key)


class ThirdPartyInviteTests(OracleCase):
    def test_signed_invite(self):
        def case(v):
            room, key, token = third_party_room(v)
            good = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, CAROL, token)}}
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False, content=good), True)
            other = generate_signing_key("1")
            bad = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(other, CAROL, token)}}
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False, content=bad), False)

        self.each(VERSIONS, case)

    def test_mxid_sender_and_token_must_match(self):
        def case(v):
            room, key, token = third_party_room(v)
            wrong_mxid = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, EVE, token)}}
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False, content=wrong_mxid), False)
            good = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, CAROL, token)}}
            self.verdict(room, room.member(CAROL, "invite", BOB, apply=False, content=good), False)
            no_token = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, CAROL, "nope")}}
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False, content=no_token), False)

        self.each(("1", "6", "11", "12"), case)

    def test_banned_target(self):
        def case(v):
            room, key, token = third_party_room(v)
            room.member(CAROL, "ban", ALICE)
            good = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, CAROL, token)}}
            self.verdict(room, room.member(CAROL, "invite", ALICE, apply=False, content=good), False)

        self.each(("3", "10", "12"), case)

    def test_third_party_invite_event_needs_invite_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB])
            content = {"display_name": "x", "public_key": "AAAA"}
            self.verdict(room, room.build("m.room.third_party_invite", BOB, content, "t2", apply=False), True)
            room.power_levels({ALICE: 100} if v != "12" else {}, invite=10)
            self.verdict(room, room.build("m.room.third_party_invite", BOB, content, "t2", apply=False), False)

        self.each(VERSIONS, case)


class MembershipLeaveBanTests(OracleCase):
    def test_leave_self(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB])
            self.verdict(room, room.member(BOB, "leave", apply=False), True)
            self.verdict(room, room.member(CAROL, "leave", apply=False), False)

        self.each(VERSIONS, case)

    def test_reject_invite(self):
        def case(v):
            room = Room(v).standard("invite")
            room.member(BOB, "invite", ALICE)
            self.verdict(room, room.member(BOB, "leave", apply=False), True)
            room.member(BOB, "leave")
            self.verdict(room, room.member(BOB, "leave", apply=False), False)

        self.each(VERSIONS, case)

    def test_kick(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50})
            self.verdict(room, room.member(CAROL, "leave", BOB, apply=False), True)
            self.verdict(room, room.member(BOB, "leave", CAROL, apply=False), False)

        self.each(VERSIONS, case)

    def test_kick_equal_level_and_kick_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50, CAROL: 50})
            self.verdict(room, room.member(CAROL, "leave", BOB, apply=False), False)
            levels = {BOB: 50, CAROL: 40} if v == "12" else {ALICE: 100, BOB: 50, CAROL: 40}
            room.power_levels(levels, kick=60)
            self.verdict(room, room.member(CAROL, "leave", BOB, apply=False), False)
            room.power_levels(levels, kick=50)
            self.verdict(room, room.member(CAROL, "leave", BOB, apply=False), True)

        self.each(VERSIONS, case)

    def test_kicker_must_be_joined(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50})
            room.member(BOB, "leave")
            self.verdict(room, room.member(CAROL, "leave", BOB, apply=False), False)
            self.verdict(room, room.member(CAROL, "leave", ALICE, apply=False), True)

        self.each(VERSIONS, case)

    def test_unban(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50, CAROL: 40})
            room.member(EVE, "ban", ALICE)
            self.verdict(room, room.member(EVE, "leave", BOB, apply=False), True)
            self.verdict(room, room.member(EVE, "leave", CAROL, apply=False), False)
            self.verdict(room, room.member(EVE, "leave", apply=False), False)  # the banned cannot leave

        self.each(VERSIONS, case)

    def test_ban(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50})
            self.verdict(room, room.member(CAROL, "ban", BOB, apply=False), True)
            self.verdict(room, room.member(BOB, "ban", CAROL, apply=False), False)
            self.verdict(room, room.member(EVE, "ban", BOB, apply=False), True)  # never a member
            self.verdict(room, room.member(CAROL, "ban", EVE, apply=False), False)  # sender not joined

        self.each(VERSIONS, case)

    def test_ban_equal_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50, CAROL: 50})
            self.verdict(room, room.member(CAROL, "ban", BOB, apply=False), False)
            self.verdict(room, room.member(CAROL, "ban", ALICE, apply=False), True)

        self.each(VERSIONS, case)

    def test_creators_cannot_be_banned_in_v12(self):
        room = Room("12", additional_creators=[CAROL]).standard("invite", members=[BOB, CAROL], users={BOB: 100})
        self.verdict(room, room.member(CAROL, "ban", BOB, apply=False), False)
        self.verdict(room, room.member(BOB, "ban", CAROL, apply=False), True)


class MembershipKnockTests(OracleCase):
    def test_knock(self):
        def case(v):
            room = Room(v).standard("knock")
            self.verdict(room, room.member(BOB, "knock", apply=False), True)
            self.verdict(room, room.member(BOB, "knock", CAROL, apply=False), False)

        self.each(KNOCK_VERSIONS, case)

    def test_knock_needs_knock_rule(self):
        def case(v):
            room = Room(v).standard("invite")
            self.verdict(room, room.member(BOB, "knock", apply=False), False)
            room.join_rules("knock")
            self.verdict(room, room.member(BOB, "knock", apply=False), True)

        self.each(KNOCK_VERSIONS, case)

    def test_knock_restricted(self):
        def case(v):
            room = Room(v).standard("knock_restricted")
            self.verdict(room, room.member(BOB, "knock", apply=False), True)

        self.each(KNOCK_RESTRICTED_VERSIONS, case)
        room = Room("8").standard("knock_restricted")
        self.verdict(room, room.member(BOB, "knock", apply=False), False)

    def test_knock_when_member_invited_or_banned(self):
        def case(v):
            room = Room(v).standard("knock", members=[BOB])
            self.verdict(room, room.member(BOB, "knock", apply=False), False)
            room.member(CAROL, "invite", ALICE)
            self.verdict(room, room.member(CAROL, "knock", apply=False), False)
            room.member(EVE, "ban", ALICE)
            self.verdict(room, room.member(EVE, "knock", apply=False), False)
            self.verdict(room, room.member(DAVE, "knock", apply=False), True)

        self.each(KNOCK_VERSIONS, case)

    def test_retract_knock(self):
        def case(v):
            room = Room(v).standard("knock")
            room.member(BOB, "knock")
            self.verdict(room, room.member(BOB, "leave", apply=False), True)
            self.verdict(room, room.member(CAROL, "leave", apply=False), False)

        self.each(KNOCK_VERSIONS, case)

    def test_knock_unknown_before_v7_and_unknown_membership(self):
        def case(v):
            room = Room(v).standard("public")
            self.verdict(room, room.member(BOB, "join", apply=False), True)
            self.verdict(room, room.member(BOB, "wave", apply=False), False)
            if not room.room_version.knock_join_rule:
                self.verdict(room, room.member(BOB, "knock", apply=False), False)

        self.each(("1", "3", "6", "12"), case)


class PowerLevelTests(OracleCase):
    def levels(self, v: str, **users: int) -> dict:
        return ({} if v == "12" else {ALICE: 100}) | {f"@{name}:example.org": level for name, level in users.items()}

    def test_grant_up_to_own_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50})
            self.verdict(room, room.power_levels(self.levels(v, bob=50, carol=50), BOB, apply=False), True)
            self.verdict(room, room.power_levels(self.levels(v, bob=50, carol=51), BOB, apply=False), False)

        self.each(VERSIONS, case)

    def test_raise_self(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            self.verdict(room, room.power_levels(self.levels(v, bob=60), BOB, apply=False), False)
            self.verdict(room, room.power_levels(self.levels(v, bob=40), BOB, apply=False), True)

        self.each(VERSIONS, case)

    def test_change_users_at_or_above_own_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50, CAROL: 50})
            self.verdict(room, room.power_levels(self.levels(v, bob=50, carol=0), BOB, apply=False), False)
            room.power_levels(self.levels(v, bob=50, carol=49))
            self.verdict(room, room.power_levels(self.levels(v, bob=50, carol=0), BOB, apply=False), True)
            self.verdict(room, room.power_levels(self.levels(v, bob=50), BOB, apply=False), True)  # removed

        self.each(VERSIONS, case)

    def test_named_levels(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            levels = self.levels(v, bob=50)
            self.verdict(room, room.power_levels(levels, BOB, ban=50, apply=False), True)  # added at own level
            self.verdict(room, room.power_levels(levels, BOB, ban=51, apply=False), False)
            room.power_levels(levels, kick=75)
            self.verdict(room, room.power_levels(levels, BOB, kick=20, apply=False), False)  # current above
            self.verdict(room, room.power_levels(levels, BOB, kick=75, state_default=10, apply=False), True)
            self.verdict(room, room.power_levels(levels, BOB, kick=75, users_default=60, apply=False), False)

        self.each(VERSIONS, case)

    def test_events_levels(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            levels = self.levels(v, bob=50)
            self.verdict(room, room.power_levels(levels, BOB, events={"m.room.name": 50}, apply=False), True)
            self.verdict(room, room.power_levels(levels, BOB, events={"m.room.name": 70}, apply=False), False)
            room.power_levels(levels, events={"m.room.tombstone": 100})
            self.verdict(room, room.power_levels(levels, BOB, apply=False), False)  # removes one above
            self.verdict(
                room, room.power_levels(levels, BOB, events={"m.room.tombstone": 100, "x": 1}, apply=False), True
            )

        self.each(VERSIONS, case)

    def test_notifications_levels_from_v6(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            levels = self.levels(v, bob=50)
            self.verdict(room, room.power_levels(levels, BOB, notifications={"room": 50}, apply=False), True)
            self.verdict(
                room,
                room.power_levels(levels, BOB, notifications={"room": 70}, apply=False),
                not room.room_version.limit_notifications_power_levels,
            )

        self.each(VERSIONS, case)

    def test_string_levels(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            stringy = room.power_levels({**self.levels(v), BOB: "50"}, BOB, ban="50", apply=False)
            self.verdict(room, stringy, not room.room_version.enforce_int_power_levels)
            self.verdict(room, room.power_levels(self.levels(v, bob=50), BOB, apply=False), True)

        self.each(VERSIONS + ("9",), case)

    def test_users_must_be_user_ids(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            self.verdict(room, room.power_levels({**self.levels(v, bob=50), "bob": 10}, BOB, apply=False), False)
            self.verdict(room, room.power_levels({**self.levels(v, bob=50), EVE: 10}, BOB, apply=False), True)

        self.each(VERSIONS, case)

    def test_historical_user_ids_in_users(self):
        # Keys are checked for the shape of a user ID, as sender is: servers
        # accepted power levels naming historical IDs, and so must we.
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            odd = {**self.levels(v, bob=50), "@Old.User:my_server": 10, "@x:": 1}
            self.verdict(room, room.power_levels(odd, BOB, apply=False), True)
            self.verdict(room, room.power_levels({**self.levels(v, bob=50), "@nocolon": 1}, BOB, apply=False), False)

        self.each(VERSIONS, case)

    def test_sender_must_be_joined_and_have_the_level(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            self.verdict(room, room.power_levels(self.levels(v, bob=50, carol=1), CAROL, apply=False), False)
            room.power_levels(self.levels(v, bob=50), events={"m.room.power_levels": 100})
            self.verdict(room, room.power_levels(self.levels(v, bob=50, eve=1), BOB, apply=False), False)
            self.verdict(room, room.power_levels(self.levels(v, bob=50, eve=1), ALICE, apply=False), True)

        self.each(VERSIONS, case)

    def test_v12_creators_not_listed_and_infinite(self):
        room = Room("12", additional_creators=[CAROL]).standard("invite", members=[BOB, CAROL], users={BOB: 50})
        self.verdict(room, room.power_levels({BOB: 50, ALICE: 100}, apply=False), False)
        self.verdict(room, room.power_levels({BOB: 50, CAROL: 100}, apply=False), False)
        self.verdict(room, room.power_levels({BOB: 10**9}, CAROL, ban=10**9, apply=False), True)
        self.verdict(room, room.power_levels({BOB: 50, EVE: 51}, BOB, apply=False), False)

    def test_first_power_levels(self):
        def case(v):
            room = Room(v)
            room.create()
            room.member(ALICE, "join")
            self.verdict(room, room.power_levels(self.levels(v, bob=100), apply=False), True)
            self.verdict(room, room.power_levels(self.levels(v, bob=100), BOB, apply=False), False)

        self.each(VERSIONS, case)


class OtherEventTests(OracleCase):
    def test_state_default_and_events_default(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB, CAROL], users={BOB: 50})
            self.verdict(room, room.build("m.room.topic", BOB, {"topic": "t"}, "", apply=False), True)
            self.verdict(room, room.build("m.room.topic", CAROL, {"topic": "t"}, "", apply=False), False)
            self.verdict(room, room.build("m.room.message", CAROL, {"body": "hi"}, apply=False), True)
            room.power_levels(self.levels(v), events_default=10, events={"m.room.topic": 0})
            self.verdict(room, room.build("m.room.message", CAROL, {"body": "hi"}, apply=False), False)
            self.verdict(room, room.build("m.room.topic", CAROL, {"topic": "t"}, "", apply=False), True)

        self.each(VERSIONS, case)

    levels = PowerLevelTests.levels

    def test_sender_must_be_joined(self):
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            self.verdict(room, room.build("m.room.message", BOB, {"body": "hi"}, apply=False), True)
            self.verdict(room, room.build("m.room.message", EVE, {"body": "hi"}, apply=False), False)
            room.member(BOB, "leave")
            self.verdict(room, room.build("m.room.message", BOB, {"body": "hi"}, apply=False), False)

        self.each(VERSIONS, case)

    def test_user_state_keys(self):
        def case(v):
            room = Room(v).standard("invite", members=[BOB], users={BOB: 50})
            self.verdict(room, room.build("m.custom", BOB, {}, BOB, apply=False), True)
            self.verdict(room, room.build("m.custom", BOB, {}, ALICE, apply=False), False)
            self.verdict(room, room.build("m.custom", BOB, {}, "@", apply=False), False)

        self.each(VERSIONS, case)

    def test_aliases_before_v6(self):
        def case(v):
            room = Room(v).standard("invite")
            allowed = room.room_version.special_case_aliases_auth
            self.verdict(
                room, room.build("m.room.aliases", DAVE, {"aliases": []}, "other.example", apply=False), allowed
            )
            self.verdict(room, room.build("m.room.aliases", DAVE, {"aliases": []}, "example.org", apply=False), False)
            self.verdict(room, room.build("m.room.aliases", ALICE, {"aliases": []}, "example.org", apply=False), True)

        self.each(("1", "3", "5", "6", "11"), case)

    def test_redaction_v1_v2_domain_rule(self):
        def case(v):
            room = Room(v).standard("public", members=[BOB, DAVE])
            message = room.build("m.room.message", BOB, {"body": "hi"})
            redacts = {"redacts": message.event_id}
            by_dave = room.build("m.room.redaction", DAVE, {}, extra=redacts, apply=False)
            self.verdict(room, by_dave, not room.room_version.event_id_in_pdu)
            self.verdict(room, room.build("m.room.redaction", ALICE, {}, extra=redacts, apply=False), True)
            room.member(EVE, "join")
            self.verdict(room, room.build("m.room.redaction", EVE, {}, extra=redacts, apply=False), True)

        self.each(("1", "2", "3", "6"), case)

    def test_redaction_v11_is_an_ordinary_event(self):
        def case(v):
            room = Room(v).standard("public", members=[BOB, DAVE])
            message = room.build("m.room.message", BOB, {"body": "hi"})
            self.verdict(room, room.build("m.room.redaction", DAVE, {"redacts": message.event_id}, apply=False), True)
            room.power_levels(self.levels(v), events={"m.room.redaction": 10})
            self.verdict(room, room.build("m.room.redaction", DAVE, {"redacts": message.event_id}, apply=False), False)

        self.each(("11", "12"), case)

    def test_unfederated_room(self):
        def case(v):
            room = Room(v)
            room.create(**{"m.federate": False})
            room.member(ALICE, "join")
            room.join_rules("public")
            self.verdict(room, room.member(DAVE, "join", apply=False), False)
            self.verdict(room, room.member(BOB, "join", apply=False), True)

        self.each(VERSIONS, case)


class RareKeySkipTests(unittest.TestCase):
    """The selection and the member rules skip decoding ``content`` where its
    bytes cannot hold a rare key; a key spelled with ``\\u`` escapes still counts."""

    def invite_with(self, spelled: str):
        room, key, token = third_party_room("10")
        good = {"third_party_invite": {"display_name": "c", "signed": signed_bundle(key, CAROL, token)}}
        pdu = room.member(CAROL, "invite", ALICE, apply=False, content=good)
        raw = json.dumps(pdu.event_dict).replace('"third_party_invite"', spelled, 1).encode()
        return room, parse_pdu(raw, get_room_version("10"))

    def test_escaped_key_is_read(self):
        for spelled in ('"third_party_invite"', '"\\u0074hird_party_invite"'):
            room, pdu = self.invite_with(spelled)
            self.assertTrue(pdu.may_hold_key("third_party_invite"))
            self.assertIn(("m.room.third_party_invite", "tok"), auth_types_for_event(pdu.room_version, pdu))

    def test_absent_key_is_known_absent(self):
        room = Room("10").standard("invite", members=[BOB])
        pdu = room.member(CAROL, "invite", ALICE, apply=False)
        self.assertFalse(pdu.may_hold_key("third_party_invite"))
        self.assertEqual(
            auth_types_for_event(pdu.room_version, pdu),
            {
                ("m.room.create", ""),
                ("m.room.power_levels", ""),
                ("m.room.member", ALICE),
                ("m.room.member", CAROL),
                ("m.room.join_rules", ""),
            },
        )
