"""State resolution in the store (issue 39, item 6's property): a random room
history with random concurrent branches (topics, names, power levels,
memberships, bans) resolves to the same state whatever order its events are
persisted in, and that state is the pure resolution's
(``roomstore.resolution``, itself checked against Synapse's in
tests/resolution), at every event and at the room's ends, on both engines.
The events the rules forbid (a topic by a user without the power, a ban by
one without it, an event citing a rejected one) are rejected as the pure
rules reject them, event by event in a replay, whatever the order; the
events soft-failed (allowed by the state before them, not by the room's
current state as they arrive) are those of a replay in the same order.

Each example persists one history twice, into two rooms of one store: in the
order it was built, one event a batch, and in a random topological order cut
into random batches.
"""

from __future__ import annotations

import itertools
import os
import random

from hypothesis import strategies as st

from roomstore.pdu.auth_rules import AuthError, auth_types_for_event, check_auth_events_shape, check_event_auth
from roomstore.pdu.parsing import parse_pdu
from tests.db import on_both_engines
from tests.hypothesis_examples import run_examples
from tests.store.builder import RoomBuilder, pure_resolution

ALICE, BOB, CAROL = "@alice:example.org", "@bob:example.org", "@carol:elsewhere.org"
BUDGET_SECONDS = float(os.environ.get("ROOMSTORE_PROPERTY_BUDGET", "60"))
_rooms = itertools.count()


def build_history(rng: random.Random, version: str, start_ts: int) -> RoomBuilder:
    """A room whose branches fork from and merge into each other's leaves
    (a room of its own: a new room ID, and from ``start_ts`` a new create
    event, whose hash is a version 12 room's ID)."""
    room = RoomBuilder(room_id=f"!order{next(_rooms)}:example.org", version=version, creator=ALICE, start_ts=start_ts)
    room.create()
    room.join(ALICE)
    room.power_levels({ALICE: 100, BOB: 50})
    room.join_rules()
    room.join(BOB)
    room.join(CAROL)
    heads = list(room.leaves)
    for i in range(rng.randint(4, 14)):
        prev = rng.sample(heads, min(len(heads), rng.choice([1, 1, 2, 2, 3])))
        kind = rng.choice(["topic", "topic", "name", "levels", "carol", "ban", "message"])
        sender = rng.choice([ALICE, BOB, CAROL])
        if kind == "topic":
            built = room.state("m.room.topic", "", {"topic": f"t{i}"}, sender=sender, prev=prev)
        elif kind == "name":
            built = room.state("m.room.name", "", {"name": f"n{i}"}, sender=sender, prev=prev)
        elif kind == "levels":
            built = room.power_levels(
                {ALICE: 100, BOB: rng.choice([0, 50, 100]), CAROL: rng.choice([0, 50])}, prev=prev
            )
        elif kind == "carol":
            built = room.member(CAROL, rng.choice(["join", "leave"]), prev=prev)
        elif kind == "ban":
            built = room.member(CAROL, "ban", sender=rng.choice([ALICE, BOB]), prev=prev)
        else:
            built = room.message(sender, f"m{i}", prev=prev)
        heads = [h for h in heads if h not in prev] + [built.event_id]
        if rng.random() < 0.4:  # keep an old head around: later events fork from it
            heads.append(rng.choice(list(room.depth_of)))
        heads = list(dict.fromkeys(heads))[-4:]
    return room


def prev_ids(built) -> list[str]:
    """An event's prev event IDs (v1/v2 cite [ID, hashes] pairs)."""
    return [p[0] if isinstance(p, list) else p for p in built.event["prev_events"]]


def topological_batches(rng: random.Random, room: RoomBuilder) -> list[list]:
    """The room's events in a random order with every event after its prevs, cut into batches."""
    events = {e.event_id: e for e in room.events}
    prevs = {e.event_id: [p for p in prev_ids(e) if p in events] for e in room.events}
    placed: set[str] = set()
    order = []
    while len(order) < len(events):
        ready = [e for e in events if e not in placed and all(p in placed for p in prevs[e])]
        pick = rng.choice(ready)
        placed.add(pick)
        order.append(events[pick])
    batches, start = [], 0
    while start < len(order):
        size = rng.randint(1, 4)
        batches.append(order[start : start + size])
        start += size
    return batches


def expected_states(room: RoomBuilder, arrival: list | None = None) -> tuple[dict, dict, dict, set, set]:
    """(state before, state after each event, the room's current state, the
    rejected events, the soft-failed ones) by the pure auth rules and
    resolution, event by event in ``arrival`` order (default: built order),
    as the spec's checks of a PDU run: against its auth events, then the
    state before it (rejected: no state change, no end of the room), then the
    room's current state as it arrives, the resolution of its ends' states
    and the state before it (soft-failed: no end of the room). States and
    rejections do not depend on the order; soft failures and so the current
    state do."""
    events = {e.event_id: parse_pdu(e.raw, room.room_version) for e in room.events}
    version = room.room_version
    before: dict[str, dict] = {}
    after: dict[str, dict] = {}
    rejected: set[str] = set()
    soft_failed: set[str] = set()
    ends: list[str] = []

    def allowed(pdu, state) -> bool:
        keys = auth_types_for_event(version, pdu) | {("m.room.create", "")}
        try:
            check_event_auth(version, pdu, {k: events[state[k]] for k in keys if k in state})
        except AuthError:
            return False
        return True

    def resolved(states: list) -> dict:
        if all(s == states[0] for s in states[1:]):
            return dict(states[0])
        return pure_resolution(room, states, rejected)

    for built in arrival or room.events:
        prevs = prev_ids(built)
        state = resolved([after[p] for p in prevs]) if prevs else {}
        before[built.event_id] = state
        pdu = events[built.event_id]
        try:
            check_event_auth(version, pdu, check_auth_events_shape(version, pdu, events, rejected))
        except AuthError:
            rejected.add(built.event_id)
        if built.event_id not in rejected and not allowed(pdu, state):
            rejected.add(built.event_id)
        if built.event_id not in rejected and ends and set(ends) != set(prevs):
            if not allowed(pdu, resolved([after[e] for e in ends] + [state])):
                soft_failed.add(built.event_id)
        state_key = built.event.get("state_key")
        after[built.event_id] = (
            {**state, (built.event["type"], state_key): built.event_id}
            if state_key is not None and built.event_id not in rejected
            else dict(state)
        )
        if built.event_id not in rejected and built.event_id not in soft_failed:
            ends = [e for e in ends if e not in prevs] + [built.event_id]
    current = resolved([after[e] for e in ends])
    return before, after, current, rejected, soft_failed


async def check_history(store, seed: int, version: str) -> None:
    rng = random.Random(seed)
    start_ts = 1_700_000_000_000 + next(_rooms) * 10_000_000
    room = build_history(rng, version, start_ts)
    expected = expected_states(room)
    # The built order, one event a batch.
    for built in room.events:
        await store.persist_events([room.to_persist(built)])
    await assert_states(store, room, *expected)
    # The same history (the same draws) rebuilt in a room of its own, whose
    # timestamps are all moved by one constant, persisted in another order.
    copy = build_history(random.Random(seed), version, start_ts + 5_000_000)
    batches = topological_batches(rng, copy)
    copy_expected = expected_states(copy, [e for batch in batches for e in batch])
    for batch in batches:
        await store.persist_events([copy.to_persist(e) for e in batch])
    await assert_states(store, copy, *copy_expected)
    # The same states and rejections in both rooms, event by event, mapped
    # by position, whatever the order (soft failures depend on it).
    position = {e.event_id: i for i, e in enumerate(room.events)}
    copy_position = {e.event_id: i for i, e in enumerate(copy.events)}
    after, copy_after = expected[1], copy_expected[1]
    assert {position[e] for e in expected[3]} == {copy_position[e] for e in copy_expected[3]}
    for built, copied in zip(room.events, copy.events, strict=True):
        assert {k: position[v] for k, v in after[built.event_id].items()} == {
            k: copy_position[v] for k, v in copy_after[copied.event_id].items()
        }, built.event_id


async def assert_states(store, room, before, after, current, rejected, soft_failed) -> None:
    flags = await store.get_event_flags([e.event_id for e in room.events])
    got_rejected = {event_id for event_id, f in flags.items() if f.rejected_reason is not None}
    assert got_rejected == rejected, ("rejected", got_rejected, rejected)
    got_soft_failed = {event_id for event_id, f in flags.items() if f.soft_failed}
    assert got_soft_failed == soft_failed, ("soft-failed", got_soft_failed, soft_failed)
    for built in room.events:
        got = await store.get_state_ids(built.event_id, before=True)
        assert got == before[built.event_id], ("before", built.event_id, got, before[built.event_id])
        got = await store.get_state_ids(built.event_id)
        assert got == after[built.event_id], ("after", built.event_id, got, after[built.event_id])
    got = await store.get_current_state_ids(room.room_id)
    assert got == current, ("current", got, current)


@on_both_engines
class ResolutionOrderTests:
    timeout = 300

    async def test_any_persist_order_resolves_as_the_pure_resolution(self):
        store = await self.open_store()
        tried = await run_examples(
            self,
            lambda seed, version: check_history(store, seed, version),
            [st.integers(0, 2**32), st.sampled_from(["2", "6", "10", "11", "12"])],
            40,
            BUDGET_SECONDS,
        )
        self.assertGreater(tried, 5, "too few examples ran within the time budget")
