"""Property: whatever JSON an event's content holds, and whatever the
contents of the state's events, the auth rules answer (allow, or AuthError
naming a rule) and never fail otherwise; so do the auth events selection
and a resolution over such events."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from roomstore.pdu.auth_rules import AuthError, auth_types_for_event, check_event_auth
from roomstore.resolution import MemoryEventSource, resolve_state
from tests.pdu.rooms import ALICE, BOB, CAROL, Room

KEYS = st.sampled_from(
    [
        "membership",
        "join_rule",
        "users",
        "users_default",
        "events",
        "events_default",
        "state_default",
        "ban",
        "kick",
        "invite",
        "redact",
        "notifications",
        "third_party_invite",
        "signed",
        "mxid",
        "token",
        "signatures",
        "join_authorised_via_users_server",
        "public_key",
        "public_keys",
        "additional_creators",
        "room_version",
        "creator",
        "m.federate",
        ALICE,
        BOB,
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-200, 200),
    st.sampled_from(
        [
            "",
            "50",
            " 7 ",
            "+1",
            "abc",
            ALICE,
            BOB,
            "join",
            "invite",
            "public",
            "restricted",
            "knock",
            "ban",
            "leave",
            "AAAA",
            "ed25519:a",
        ]
    ),
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(KEYS, children, max_size=4)),
    max_leaves=12,
)
CONTENT = st.dictionaries(KEYS, JSON, max_size=5)
TYPES = st.sampled_from(
    [
        "m.room.member",
        "m.room.power_levels",
        "m.room.join_rules",
        "m.room.third_party_invite",
        "m.room.aliases",
        "m.room.redaction",
        "m.room.topic",
        "m.room.create",
    ]
)
VERSIONS = st.sampled_from(["1", "3", "6", "8", "10", "11", "12"])


class AuthFuzzTests(unittest.TestCase):
    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        version=VERSIONS,
        event_type=TYPES,
        content=CONTENT,
        state_content=CONTENT,
        state_type=TYPES,
        sender=st.sampled_from([ALICE, BOB, CAROL]),
        membership=st.sampled_from(["join", "invite", "leave", "ban", "knock", "x"]),
    )
    def test_rules_only_raise_auth_errors(
        self, version, event_type, content, state_content, state_type, sender, membership
    ):
        room = Room(version).standard("public", members=[BOB])
        state_key = BOB if state_type == "m.room.member" else ""
        if state_type == "m.room.member":
            state_content = {**state_content, "membership": membership}
        if state_type != "m.room.create":
            # A state event holding anything, as another server may have accepted it.
            room.build(state_type, ALICE, state_content, state_key)
        if event_type == "m.room.member":
            content = {**content, "membership": membership}
        key = CAROL if event_type == "m.room.member" else ("" if event_type != "m.room.redaction" else None)
        event = room.build(event_type, sender, content, key, apply=False)
        auth_types_for_event(room.room_version, event)
        try:
            check_event_auth(room.room_version, event, room.state)
        except AuthError as e:
            self.assertRegex(str(e), r"^rule \d")
        # A fork on that event resolves without an error either (a v12 create
        # event makes a room of its own: not a fork).
        if event.state_key is not None and not event.is_create:
            other = dict(room.state)
            other[(event.type, event.state_key)] = event
            room.events[event.event_id] = event
            sets = [{k: e.event_id for k, e in room.state.items()}, {k: e.event_id for k, e in other.items()}]
            resolve_state(room.room_version, sets, MemoryEventSource(room.events))
