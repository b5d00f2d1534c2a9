"""Random events in random rooms: our auth rules and Synapse's must give the
same verdict on each, in every room version (1 to 12).

Each room starts with a random join rule and power levels, then takes
random events from random senders (member events of every membership,
power levels with random values, some as strings, join rules, topics,
third-party invites, redactions, state keyed by user IDs); each is checked
against the current state by both, and applied when allowed.  Left out:
the cases where we read the spec otherwise than Synapse, each tested on its
own in ``test_auth_rules`` (``m.federate``, the authorising server's
signature on non-joins, user IDs with an empty localpart).
"""

from __future__ import annotations

import random

from twisted.trial import unittest

from roomstore.pdu.auth_rules import AuthError, check_event_auth
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS
from tests.pdu.rooms import ALICE, BOB, CAROL, DAVE, EVE, ZARA, Oracle, Room

USERS = (ALICE, BOB, CAROL, DAVE, EVE, ZARA)
MEMBERSHIPS = ("join", "invite", "leave", "ban", "knock", "wave")
JOIN_RULES = ("public", "invite", "knock", "restricted", "knock_restricted", "private")


class RandomEvents:
    """One random room and its random events."""

    def __init__(self, version: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.room = Room(version)
        self.stringy = not self.room.room_version.enforce_int_power_levels

    def level(self):
        value = self.rng.choice((0, 0, 10, 25, 50, 50, 75, 100, 101, -5))
        if self.rng.random() < 0.1:
            return self.rng.choice((str(value), f" {value} ", f"+{value}" if value >= 0 else f"{value}"))
        if self.rng.random() < 0.05 and not self.room.room_version.strict_canonicaljson:
            return value + 0.5
        return value

    def power_levels_content(self) -> dict:
        rng = self.rng
        users = {user: self.level() for user in rng.sample(USERS, rng.randint(0, 4))}
        if self.room.room_version.creators_have_infinite_power and rng.random() < 0.8:
            users.pop(ALICE, None)
        elif not self.room.room_version.creators_have_infinite_power and rng.random() < 0.7:
            users[ALICE] = 100
        content: dict = {"users": users}
        for name in rng.sample(
            ("ban", "kick", "invite", "redact", "state_default", "events_default", "users_default"), rng.randint(0, 3)
        ):
            content[name] = self.level()
        if rng.random() < 0.3:
            content["events"] = {rng.choice(("m.room.topic", "m.room.power_levels", "m.room.message")): self.level()}
        if rng.random() < 0.2:
            content["notifications"] = {"room": self.level()}
        if rng.random() < 0.03:
            content["users"]["not-a-user"] = 1
        return content

    def event(self):
        rng, room = self.rng, self.room
        sender, target = rng.choice(USERS), rng.choice(USERS)
        roll = rng.random()
        if roll < 0.45:
            membership = rng.choice(MEMBERSHIPS)
            sender = target if membership in ("join", "knock") and rng.random() < 0.85 else sender
            content, signers = {"membership": membership}, ()
            if membership == "join" and rng.random() < 0.3:
                authoriser = rng.choice(USERS)
                content["join_authorised_via_users_server"] = authoriser
                signers = (authoriser.partition(":")[2],)
            return room.member(target, membership, sender, apply=False, signers=signers, content=content)
        if roll < 0.6:
            return room.build("m.room.power_levels", sender, self.power_levels_content(), "", apply=False)
        if roll < 0.7:
            return room.build("m.room.join_rules", sender, {"join_rule": rng.choice(JOIN_RULES)}, "", apply=False)
        if roll < 0.8:
            return room.build("m.room.topic", sender, {"topic": "t"}, "", apply=False)
        if roll < 0.85:
            return room.build(
                "m.room.third_party_invite",
                sender,
                {"display_name": "x", "public_key": "AAAA"},
                f"tok{rng.randint(0, 3)}",
                apply=False,
            )
        if roll < 0.9:
            return room.build("m.custom", sender, {}, rng.choice((sender, target, "")), apply=False)
        if roll < 0.95:
            return room.build(
                "m.room.aliases", sender, {"aliases": []}, rng.choice(("example.org", "other.example")), apply=False
            )
        target_id = rng.choice(list(room.events))
        if room.room_version.redacts_in_content:
            return room.build("m.room.redaction", sender, {"redacts": target_id}, apply=False)
        return room.build("m.room.redaction", sender, {}, apply=False, extra={"redacts": target_id})

    def start(self) -> None:
        rng, room = self.rng, self.room
        rule = rng.choice([r for r in JOIN_RULES[:4] if r != "knock" or room.room_version.knock_join_rule])
        room.standard(
            rule if rule != "restricted" or room.room_version.restricted_join_rule else "invite",
            members=rng.sample(USERS[1:], rng.randint(1, 4)),
        )
        room.build(
            "m.room.power_levels",
            ALICE,
            self.power_levels_content()
            | ({"users": {}} if room.room_version.creators_have_infinite_power else {"users": {ALICE: 100}}),
            "",
        )
        users = {}
        for user in USERS[1:]:
            if rng.random() < 0.5:
                users[user] = rng.choice((0, 50, 75, 100))
        content = dict(room.state[("m.room.power_levels", "")].content)
        content["users"] = {**content["users"], **users}
        room.build("m.room.power_levels", ALICE, content, "")


class RandomVerdictTests(unittest.TestCase):
    def test_random_events_in_every_room_version(self):
        oracle = Oracle()
        counts = {True: 0, False: 0}
        for version in KNOWN_ROOM_VERSIONS:
            for seed in range(12):
                events = RandomEvents(version, seed)
                events.start()
                for _ in range(40):
                    event = events.event()
                    allowed = self.ours(events.room, event)
                    theirs = oracle.allows(event, events.room.state)
                    self.assertEqual(
                        allowed,
                        theirs,
                        f"v{version} seed {seed}: {event.type} by {event.sender} "
                        f"{dict(event.content)} state_key={event.state_key!r}",
                    )
                    counts[allowed] += 1
                    if allowed and event.state_key is not None:
                        events.room.state[(event.type, event.state_key)] = event
                        events.room.leaves = [event.event_id]
        # Both verdicts well represented: the comparison is not one-sided.
        self.assertGreater(counts[True], 1000)
        self.assertGreater(counts[False], 1000)

    @staticmethod
    def ours(room: Room, event) -> bool:
        try:
            check_event_auth(room.room_version, event, room.state)
        except AuthError:
            return False
        return True
