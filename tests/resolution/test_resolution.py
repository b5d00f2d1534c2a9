"""State resolution (``roomstore.resolution``) against Synapse 1.163.2's
``synapse.state.v1``/``v2`` on the same events: the classic cases (ban
against a power level change, topic reset, join rule evasion, off-topic
power levels, topic basic, mainline sort), written here as forks of a
:class:`tests.pdu.rooms.Room`, each with its expected outcome; random forked
histories; and the pure auth chain walks.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from twisted.trial import unittest

from roomstore.pdu.auth_rules import AuthError, check_event_auth
from roomstore.resolution import MemoryEventSource, ResolutionError, resolve_state
from roomstore.resolution.source import auth_chain_difference, conflicted_subgraph
from tests.pdu.rooms import ALICE, BOB, CAROL, EVE, ZARA, Oracle, Room

VERSIONS = ("1", "2", "3", "6", "10", "11", "12")
V2_VERSIONS = tuple(v for v in VERSIONS if v != "1")
TOPIC = ("m.room.topic", "")
PL = ("m.room.power_levels", "")
JR = ("m.room.join_rules", "")


class Fork:
    """A branch of a room's history: its own state and leaves."""

    def __init__(self, room: Room, state: Mapping | None = None, leaves: list[str] | None = None) -> None:
        self.room = room
        self.state = dict(room.state if state is None else state)
        self.leaves = list(room.leaves if leaves is None else leaves)

    def branch(self) -> Fork:
        return Fork(self.room, self.state, self.leaves)

    def try_build(self, event_type: str, sender: str, content: dict, state_key: str | None = None):
        """Build an event on this branch; apply it if the auth rules allow it
        against the branch's state.  Returns it, or None when not allowed."""
        event = self.room.build(event_type, sender, content, state_key, prev=self.leaves, state=self.state, apply=False)
        try:
            check_event_auth(self.room.room_version, event, self.state)
        except AuthError:
            return None
        self.leaves = [event.event_id]
        if event.state_key is not None:
            self.state[(event.type, event.state_key)] = event
        return event

    def build(self, *args: Any, **kw: Any):
        event = self.try_build(*args, **kw)
        assert event is not None, f"the scenario's event {args} is not allowed"
        return event

    def topic(self, sender: str, text: str):
        return self.build("m.room.topic", sender, {"topic": text}, "")

    def levels(self, sender: str, **users: int):
        base = {} if self.room.room_version.creators_have_infinite_power else {ALICE: 100}
        base.update({f"@{name}:example.org": level for name, level in users.items()})
        return self.build("m.room.power_levels", sender, {"users": base}, "")

    def member(self, target: str, membership: str, sender: str | None = None):
        return self.build("m.room.member", sender or target, {"membership": membership}, target)

    def ids(self) -> dict:
        return {key: event.event_id for key, event in self.state.items()}


class ResolutionCase(unittest.TestCase):
    oracle: Oracle | None = None

    def setUp(self) -> None:
        if ResolutionCase.oracle is None:
            ResolutionCase.oracle = Oracle()

    def resolve(self, room: Room, *forks: Fork, rejected=()) -> dict:
        """Ours and Synapse's resolution of the forks' states, which must agree."""
        sets = [fork.ids() for fork in forks]
        ours = resolve_state(room.room_version, sets, MemoryEventSource(room.events, rejected))
        theirs = self.oracle.resolve(room.version, sets, room.events, rejected)
        self.assertEqual(self.named(room, ours), self.named(room, theirs), f"room version {room.version}")
        # The order of the state sets does not matter.
        backwards = resolve_state(room.room_version, sets[::-1], MemoryEventSource(room.events, rejected))
        self.assertEqual(backwards, ours)
        return ours

    @staticmethod
    def named(room: Room, state: Mapping) -> dict:
        """A state with each event shown by type, sender and content (readable diffs)."""
        return {
            key: (event_id, room.events[event_id].sender, dict(room.events[event_id].content))
            for key, event_id in sorted(state.items())
        }

    def each(self, versions, case) -> None:
        for version in versions:
            case(version)


class ClassicCaseTests(ResolutionCase):
    def test_ban_vs_power_level_change(self):
        # Alice bans Bob while Bob (50) raises Carol: the ban comes first
        # (Alice's power is higher), and Bob's change fails after it.
        def case(v):
            room = Room(v).standard("public", users={BOB: 50}, members=[BOB, CAROL])
            original = room.state[PL].event_id
            a, b = Fork(room), Fork(room)
            ban = a.member(BOB, "ban", ALICE)
            b.levels(BOB, bob=50, carol=50)
            resolved = self.resolve(room, a, b)
            if v != "1":
                self.assertEqual(resolved[("m.room.member", BOB)], ban.event_id)
                self.assertEqual(resolved[PL], original)

        self.each(VERSIONS, case)

    def test_topic_reset(self):
        # Bob's topic, then his ban, on one branch; the other still has the
        # first topic: Bob's topic cannot stand once he is banned.
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            main = Fork(room)
            first = main.topic(ALICE, "first")
            a, b = main.branch(), main.branch()
            a.levels(ALICE, bob=50)
            a.topic(BOB, "bob's")
            ban = a.member(BOB, "ban", ALICE)
            resolved = self.resolve(room, a, b)
            if v != "1":
                self.assertEqual(resolved[TOPIC], first.event_id)
                self.assertEqual(resolved[("m.room.member", BOB)], ban.event_id)

        self.each(VERSIONS, case)

    def test_join_rule_evasion(self):
        def case(v):
            room = Room(v).standard("public")
            a, b = Fork(room), Fork(room)
            rule = a.build("m.room.join_rules", ALICE, {"join_rule": "invite"}, "")
            b.member(EVE, "join")
            resolved = self.resolve(room, a, b)
            self.assertEqual(resolved[JR], rule.event_id)
            if v != "1":
                self.assertNotIn(("m.room.member", EVE), resolved)

        self.each(VERSIONS, case)

    def test_offtopic_power_levels(self):
        # Two changes of the power levels on top of Alice's grant to Bob:
        # Alice's (higher power) is applied first, Bob's, still allowed
        # after it, last.
        def case(v):
            room = Room(v).standard("public", members=[BOB, CAROL])
            main = Fork(room)
            main.levels(ALICE, bob=50)
            a, b = main.branch(), main.branch()
            by_bob = a.levels(BOB, bob=50, carol=50)
            b.levels(ALICE, bob=50, carol=10)
            resolved = self.resolve(room, a, b)
            if v != "1":
                self.assertEqual(resolved[PL], by_bob.event_id)

        self.each(VERSIONS, case)

    def test_topic_basic(self):
        # Alice changes the topic and takes Bob's power; Bob's concurrent
        # topic, sorted after Alice's on the mainline, is then refused.
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            main = Fork(room)
            main.topic(ALICE, "first")
            main.levels(ALICE, bob=50)
            a, b = main.branch(), main.branch()
            second = a.topic(ALICE, "second")
            demotion = a.levels(ALICE, bob=0)
            b.topic(BOB, "bob's")
            resolved = self.resolve(room, a, b)
            if v != "1":
                self.assertEqual(resolved[TOPIC], second.event_id)
                self.assertEqual(resolved[PL], demotion.event_id)

        self.each(VERSIONS, case)

    def test_mainline_sort(self):
        # Alice's second power levels win (Bob's, applied after them, would
        # drop their m.room.name level, above his own). Of the topics, the
        # one citing the newest power levels of the mainline sorts last and
        # wins, though Bob's was sent later.
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            main = Fork(room)
            main.levels(ALICE, bob=50)
            a, b = main.branch(), main.branch()
            a.topic(ALICE, "a1")
            by_alice = a.build(
                "m.room.power_levels",
                ALICE,
                {"users": {**({} if v == "12" else {ALICE: 100}), BOB: 50}, "events": {"m.room.name": 60}},
                "",
            )
            newest = a.topic(ALICE, "a2")
            b.build(
                "m.room.power_levels",
                BOB,
                {"users": {**({} if v == "12" else {ALICE: 100}), BOB: 50}, "events": {"m.room.avatar": 40}},
                "",
            )
            later = b.topic(BOB, "b1")
            self.assertGreater(later.origin_server_ts, newest.origin_server_ts)
            resolved = self.resolve(room, a, b)
            if v != "1":
                self.assertEqual(resolved[PL], by_alice.event_id)
                self.assertEqual(resolved[TOPIC], newest.event_id)

        self.each(VERSIONS, case)

    def test_v2_1_starts_from_an_empty_state(self):
        # Bob changed the power levels on one branch and left on the other;
        # the merge kept his change. Resolving that merge against the branch
        # where he left: his leave is unconflicted. v2 checks his change
        # against it (he is not joined: refused, the power levels reset to
        # Alice's); v2.1 starts from an empty state, checks the change against
        # its own auth events, and keeps it.
        def case(v):
            room = Room(v).standard("public", members=[BOB, CAROL])
            # Granted after Bob joined: his join is on no auth path between
            # the conflicted power levels, so not in the conflicted subgraph.
            original = room.power_levels({BOB: 50} if v == "12" else {ALICE: 100, BOB: 50}).event_id
            a, b = Fork(room), Fork(room)
            change = a.levels(BOB, bob=50, carol=10)
            leave = b.member(BOB, "leave")
            merged = self.resolve(room, a, b)
            self.assertEqual((merged[PL], merged[("m.room.member", BOB)]), (change.event_id, leave.event_id))
            m = Fork(room, {key: room.events[event_id] for key, event_id in merged.items()}, a.leaves + b.leaves)
            resolved = self.resolve(room, m, b)
            self.assertEqual(resolved[PL], change.event_id if v == "12" else original)

        self.each(("10", "11", "12"), case)

    def test_v2_1_conflicted_subgraph(self):
        # A state reset: one state has the power levels P3 (Bob's, on Alice's
        # grant P2, on P1 where Bob has 0), the other P1 with Bob's topic,
        # which cites P2. P2 is in both auth chains, so not in the auth
        # difference; v2.1 replays it as part of the conflicted subgraph
        # (P3 -> P2 -> P1) and P3 stands. v2 checks P3 against P1: refused.
        def case(v):
            room = Room(v).standard("public", members=[BOB, CAROL])
            main = Fork(room)
            p1 = main.levels(ALICE, bob=0)
            main.levels(ALICE, bob=50)
            main.topic(BOB, "bob's")
            p3 = main.levels(BOB, bob=50, carol=50)
            after = main.ids()
            reset = Fork(room, {**main.state, PL: p1}, main.leaves)
            self.assertEqual(after[TOPIC], reset.ids()[TOPIC])
            resolved = self.resolve(room, main, reset)
            self.assertEqual(resolved[PL], p3.event_id if v == "12" else p1.event_id)

        self.each(("10", "11", "12"), case)

    def test_v2_1_keeps_join_rules_the_admin_set_before_leaving(self):
        # (MSC4297's problem A.) Alice made the room invite-only and left;
        # Bob and Carol then renamed themselves. One server's state was reset
        # to the public join rules. Alice's leave is unconflicted, so v2
        # checks both join rules events against it and admits neither: the
        # room has no join rules. v2.1 checks them against their own auth
        # events: invite-only stands.
        def case(v):
            room = Room(v).standard("public", members=[BOB, CAROL])
            public = room.state[JR]
            main = Fork(room)
            invite_only = main.build("m.room.join_rules", ALICE, {"join_rule": "invite"}, "")
            main.member(ALICE, "leave")
            bob, carol = main.branch(), main.branch()
            bob.build("m.room.member", BOB, {"membership": "join", "displayname": "bob++"}, BOB)
            carol.build("m.room.member", CAROL, {"membership": "join", "displayname": "carol++"}, CAROL)
            reset = Fork(room, {**carol.state, JR: public}, carol.leaves)
            resolved = self.resolve(room, bob, reset)
            if v == "12":
                self.assertEqual(resolved[JR], invite_only.event_id)
            else:
                self.assertNotIn(JR, resolved)
            for user, name in ((BOB, "bob++"), (CAROL, "carol++")):
                self.assertEqual(room.events[resolved[("m.room.member", user)]].content["displayname"], name)

        self.each(("10", "11", "12"), case)

    def test_v1_picks_the_deepest_other_event(self):
        # Two topics: one two events deep on its branch, one a single event
        # deep but sent last. v1 takes the deeper; v2 orders both on the
        # same mainline by origin_server_ts, so the last sent wins.
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            a, b = Fork(room), Fork(room)
            b.topic(ALICE, "b1")
            deeper = b.topic(ALICE, "b2")
            last = a.topic(ALICE, "a1")
            self.assertGreater(deeper.depth, last.depth)
            resolved = self.resolve(room, a, b)
            self.assertEqual(resolved[TOPIC], deeper.event_id if v == "1" else last.event_id)

        self.each(("1", "2", "11"), case)

    def test_unconflicted_state_is_kept(self):
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            a, b = Fork(room), Fork(room)
            a.topic(ALICE, "a")
            b.topic(ALICE, "b")
            resolved = self.resolve(room, a, b)
            for key in (PL, JR, ("m.room.member", BOB)):
                self.assertEqual(resolved[key], room.state[key].event_id)

        self.each(VERSIONS, case)

    def test_rejected_events_stay_out(self):
        # An event stored rejected is never admitted by the iterative auth checks.
        def case(v):
            room = Room(v).standard("public", members=[BOB])
            a, b = Fork(room), Fork(room)
            a.topic(ALICE, "a")
            later = b.topic(ALICE, "b")
            resolved = self.resolve(room, a, b, rejected={later.event_id})
            self.assertNotEqual(resolved[TOPIC], later.event_id)

        self.each(V2_VERSIONS, case)

    def test_trivial_inputs(self):
        room = Room("10").standard("public")
        source = MemoryEventSource(room.events)
        self.assertEqual(resolve_state(room.room_version, [], source), {})
        state = Fork(room).ids()
        self.assertEqual(resolve_state(room.room_version, [state], source), state)
        self.assertEqual(resolve_state(room.room_version, [state, dict(state)], source), state)

    def test_event_of_another_room(self):
        room = Room("10").standard("public", members=[BOB])
        other = Room("10", room_id="!other:example.org").standard("public", members=[BOB])
        a = Fork(room)
        a.topic(ALICE, "a")
        foreign = Fork(other)
        foreign.topic(ALICE, "b")
        source = MemoryEventSource({**room.events, **other.events})
        with self.assertRaises(ResolutionError):
            resolve_state(room.room_version, [a.ids(), {**a.ids(), TOPIC: foreign.state[TOPIC].event_id}], source)


class RandomForkTests(ResolutionCase):
    """Random histories forking into branches (and merging again), each
    branch's events allowed by the rules against its own state; every
    resolution ours and Synapse's alike."""

    USERS = (ALICE, BOB, CAROL, EVE, ZARA)

    def random_event(self, rng: random.Random, fork: Fork) -> None:
        sender, target = rng.choice(self.USERS), rng.choice(self.USERS)
        roll = rng.random()
        if roll < 0.2:
            fork.try_build("m.room.topic", sender, {"topic": f"t{rng.random():.3f}"}, "")
        elif roll < 0.4:
            users = {} if fork.room.room_version.creators_have_infinite_power else {ALICE: 100}
            users.update({user: rng.choice((0, 25, 50, 75)) for user in rng.sample(self.USERS[1:], 2)})
            fork.try_build("m.room.power_levels", sender, {"users": users, "state_default": rng.choice((0, 50))}, "")
        elif roll < 0.55:
            fork.try_build("m.room.member", sender, {"membership": rng.choice(("ban", "leave"))}, target)
        elif roll < 0.75:
            fork.try_build("m.room.member", sender, {"membership": rng.choice(("join", "leave"))}, sender)
        elif roll < 0.85:
            fork.try_build("m.room.member", sender, {"membership": "invite"}, target)
        else:
            fork.try_build("m.room.join_rules", sender, {"join_rule": rng.choice(("public", "invite"))}, "")

    def history(self, version: str, seed: int) -> int:
        rng = random.Random(seed)
        room = Room(version).standard("public", users={BOB: 50, CAROL: 25}, members=[BOB, CAROL, EVE])
        forks = [Fork(room) for _ in range(rng.randint(2, 3))]
        resolutions = 0
        for _ in range(rng.randint(6, 16)):
            roll = rng.random()
            if roll < 0.15 and len(forks) > 1:
                merged = rng.sample(forks, 2)
                resolved = self.resolve(room, *merged)
                resolutions += 1
                state = {key: room.events[event_id] for key, event_id in resolved.items()}
                forks = [f for f in forks if f not in merged]
                forks.append(Fork(room, state, [leaf for f in merged for leaf in f.leaves]))
            elif roll < 0.25:
                forks.append(rng.choice(forks).branch())
            else:
                self.random_event(rng, rng.choice(forks))
        if len(forks) > 1:
            self.resolve(room, *forks)
            resolutions += 1
        return resolutions

    def test_random_histories(self):
        resolutions = 0
        for version in VERSIONS:
            for seed in range(25):
                resolutions += self.history(version, seed)
        self.assertGreater(resolutions, 150)


class AuthChainTests(unittest.TestCase):
    """The pure walks of ``roomstore.resolution.source`` on a small graph."""

    GRAPH = {"c": [], "p": ["c"], "m": ["c", "p"], "x": ["m", "p"], "y": ["m"], "z": ["c"], "w": ["x", "y"]}

    def auth_of(self, event_id):
        return self.GRAPH.get(event_id, [])

    def test_difference_includes_the_sets_own_events(self):
        self.assertEqual(auth_chain_difference([{"x"}, {"y"}], self.auth_of), {"x", "y"})
        self.assertEqual(auth_chain_difference([{"m"}, {"z"}], self.auth_of), {"m", "p", "z"})
        self.assertEqual(auth_chain_difference([{"x", "z"}, {"x"}], self.auth_of), {"z"})
        self.assertEqual(auth_chain_difference([{"w"}, {"w"}], self.auth_of), set())
        self.assertEqual(auth_chain_difference([], self.auth_of), set())

    def test_conflicted_subgraph(self):
        # Paths from w down to p: w-x-p, w-x-m-p, w-y-m-p; c is below p only.
        self.assertEqual(conflicted_subgraph({"w", "p"}, self.auth_of), {"w", "x", "y", "m", "p"})
        self.assertEqual(conflicted_subgraph({"x", "z"}, self.auth_of), {"x", "z"})

    def test_cycles_end(self):
        cyclic = {"a": ["b"], "b": ["a"], "c": ["a"]}
        # A cycle (impossible with hashed event IDs, forgeable in v1/v2) is walked once.
        self.assertLessEqual({"a", "c"}, conflicted_subgraph({"c", "a"}, lambda e: cyclic.get(e, [])))


class IterativeAuthCheckTests(unittest.TestCase):
    """``iterative_auth_checks`` alone, on inputs resolution never gets from a checked store."""

    def test_a_non_state_event_fills_no_state_key(self):
        # An allowed message among the events to apply (a hostile auth chain
        # can cite one): before, it was put in the state under
        # (type, None), a key no state has.
        from roomstore.resolution.events import EventCache
        from roomstore.resolution.v2 import iterative_auth_checks

        room = Room("10").standard("public", members=[BOB])
        message = room.build("m.room.message", BOB, {"body": "hello"})
        topic = room.build("m.room.topic", ALICE, {"topic": "hi"}, "")
        base = {key: event.event_id for key, event in room.state.items() if key != ("m.room.topic", "")}
        cache = EventCache(None, MemoryEventSource(room.events))
        cache.load([message.event_id, topic.event_id])
        cache.load_auth_events([message.event_id, topic.event_id])
        state = iterative_auth_checks(room.room_version, [message.event_id, topic.event_id], base, cache)
        self.assertEqual(state, {**base, ("m.room.topic", ""): topic.event_id})
