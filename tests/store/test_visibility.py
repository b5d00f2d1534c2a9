"""History visibility through the timelines, against the spec oracle.

The property test draws room histories (joins, leaves, invites, kicks, bans,
all four history visibilities, forks off older events and merges of
branches whose states do not conflict), persists them through
``persist_events`` and checks, for every (viewer, event), that
``RoomStore.is_visible`` and ``paginate`` agree with
``roomstore.visibility.rules.is_event_visible`` fed with the state the store
reports before and after the event.

The storage test checks the point of the eager design: in a room of 2,000
members plain messages add no visibility rows, a join adds one membership row.

Hypothesis runs in a worker thread and blocks on the reactor for each store
call (``blockingCallFromThread``), as in test_state_property.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor, threads
from twisted.internet.threads import blockingCallFromThread

from roomstore.store import RoomStore
from roomstore.visibility.rules import is_event_visible
from tests.db import on_both_engines
from tests.store.builder import BuiltEvent, RoomBuilder, UncheckedRoomBuilder

ALICE = "@alice:example.org"
MEMBERS = ["@bob:example.org", "@carol:example.org", "@dave:example.org"]
OUTSIDER = "@eve:example.org"  # never has a membership event
VIEWERS = [ALICE, *MEMBERS, OUTSIDER]
VISIBILITIES = ["world_readable", "shared", "invited", "joined"]
ACTIONS = ["join", "join", "leave", "invite", "invite", "kick", "ban"]

_rooms = itertools.count()

StateMap = dict[tuple[str, str], str]


@attrs.define
class History:
    room: RoomBuilder
    batches: list[tuple[list[BuiltEvent], StateMap | None]]
    order: list[str]


def _merge(states: list[StateMap]) -> tuple[StateMap, bool]:
    merged: StateMap = {}
    conflicted = False
    for state in states:
        for key, event in state.items():
            if merged.setdefault(key, event) != event:
                conflicted = True
    return merged, conflicted


def draw_history(data: Any) -> History:
    room = UncheckedRoomBuilder(room_id=f"!vis{next(_rooms)}:example.org")
    after: dict[str, StateMap] = {}
    order: list[str] = []
    has_child: set[str] = set()
    batches: list[tuple[list[BuiltEvent], StateMap | None]] = []
    batch: list[BuiltEvent] = []

    def add(built: BuiltEvent, prevs: list[str]) -> None:
        state, conflicted = _merge([after[p] for p in prevs])
        assert not conflicted
        if "state_key" in built.event:
            state[(built.event["type"], built.event["state_key"])] = built.event_id
        after[built.event_id] = state
        order.append(built.event_id)
        has_child.update(prevs)
        batch.append(built)

    def close_batch() -> None:
        nonlocal batch
        if not batch:
            return
        # The store follows the forward extremities; where their states
        # conflict it needs a resolution: the newest event wins here.
        leaves = [e for e in order if e not in has_child]
        resolved: StateMap | None = None
        if _merge([after[e] for e in leaves])[1]:
            resolved = {}
            for leaf in sorted(leaves, key=order.index):
                resolved.update(after[leaf])
        batches.append((data.draw(st.permutations(batch), label="batch order"), resolved))
        batch = []

    create = room.create()
    add(create, [])
    join = room.join(ALICE, prev=[create.event_id])
    add(join, [create.event_id])
    if data.draw(st.booleans(), label="initial visibility"):
        hv = room.history_visibility(data.draw(st.sampled_from(VISIBILITIES), label="hv"), prev=[join.event_id])
        add(hv, [join.event_id])
    close_batch()

    for i in range(data.draw(st.integers(3, 22), label="events")):
        leaves = [e for e in order if e not in has_child]
        shape = data.draw(st.sampled_from(["extend", "extend", "extend", "fork", "merge"]), label="shape")
        if shape == "fork":
            # Off an older event: a new branch.
            prevs = [data.draw(st.sampled_from(order[-6:]), label="fork from")]
        elif shape == "merge" and len(leaves) > 1:
            pair = data.draw(st.lists(st.sampled_from(leaves), min_size=2, max_size=2, unique=True), label="merge")
            prevs = pair if not _merge([after[p] for p in pair])[1] else pair[:1]
        else:
            prevs = [data.draw(st.sampled_from(leaves[-3:]), label="extend")]
        kinds = ["message", "message", "visibility", "member", "member", "member"]
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "message":
            sender = data.draw(st.sampled_from([ALICE, *MEMBERS]), label="sender")
            built = room.message(sender, f"m{i}", prev=prevs)
        elif kind == "visibility":
            built = room.history_visibility(data.draw(st.sampled_from(VISIBILITIES), label="hv"), prev=prevs)
        else:
            user = data.draw(st.sampled_from(MEMBERS), label="user")
            action = data.draw(st.sampled_from(ACTIONS), label="action")
            if action in ("join", "leave"):
                built = room.member(user, action, prev=prevs)
            else:
                membership = {"invite": "invite", "kick": "leave", "ban": "ban"}[action]
                built = room.member(user, membership, sender=ALICE, prev=prevs)
        add(built, prevs)
        if data.draw(st.integers(0, 2), label="cut") == 0:
            close_batch()
    close_batch()
    return History(room, batches, order)


async def check_history(test, store: RoomStore, history: History) -> int:
    """Persist the history, then compare every (viewer, event); returns the number of visible pairs."""
    room = history.room
    stream: dict[str, int] = {}
    topo: dict[str, int] = {}
    for events, resolved in history.batches:
        results = await store.persist_events(
            [room.to_persist(e) for e in events], {room.room_id: resolved} if resolved else None
        )
        for r in results:
            stream[r.event_id] = r.stream_ordering
            topo[r.event_id] = r.topological_ordering
    events = await store.get_events(history.order)
    joins = [
        (stream[e], event["state_key"])
        for e, event in events.items()
        if event["type"] == "m.room.member" and event["content"]["membership"] == "join"
    ]
    expected: dict[str, set[str]] = {viewer: set() for viewer in VIEWERS}
    for event_id in history.order:
        before_ids = await store.get_state_ids(event_id, before=True)
        after_ids = await store.get_state_ids(event_id)
        state_events = await store.get_events(set(before_ids.values()) | set(after_ids.values()))
        before = {k: state_events[e] for k, e in before_ids.items()}
        after = {k: state_events[e] for k, e in after_ids.items()}
        for viewer in VIEWERS:
            joined_after = any(s > stream[event_id] and u == viewer for s, u in joins)
            want = is_event_visible(viewer, events[event_id], before, after, joined_after)
            got = await store.is_visible(viewer, event_id)
            if got != want:
                test.fail(
                    f"{viewer} / {events[event_id]['type']} {event_id} (stream {stream[event_id]}): store says {got},"
                    f" rules say {want}; before={ {k: state_events[e]['content'] for k, e in before_ids.items()} }"
                    f" joined_after={joined_after}"
                )
            if want:
                expected[viewer].add(event_id)
    for viewer in VIEWERS:
        ascending = sorted(expected[viewer], key=lambda e: (topo[e], stream[e]))
        page = await store.paginate(room.room_id, viewer, None, "f", 1000)
        test.assertEqual([e["event_id"] for e in page.events], ascending, viewer)
        # And in small pages backwards, through the tokens.
        got, token = [], None
        while True:
            page = await store.paginate(room.room_id, viewer, token, "b", 4)
            if page.next_token is None:
                break
            got += [e["event_id"] for e in page.events]
            token = page.next_token
        test.assertEqual(got, ascending[::-1], viewer)
    await check_pages_by_snapshot(test, store, room.room_id, expected, topo, stream)
    return sum(len(v) for v in expected.values())


async def check_pages_by_snapshot(test, store: RoomStore, room_id: str, expected, topo, stream) -> None:
    """Pages again with no slack: every page whose next ``limit`` events hold
    an invisible one goes on through the snapshots the viewer may see (the
    second part of ``_paginate_txn``), and must give exactly the same pages."""
    paginator = store.pagination
    store.pagination = attrs.evolve(paginator, pagination_slack=0)
    try:
        for viewer in VIEWERS:
            ascending = sorted(expected[viewer], key=lambda e: (topo[e], stream[e]))
            for direction, want in (("b", ascending[::-1]), ("f", ascending)):
                for limit in (1, 3):
                    got, token = [], None
                    while True:
                        page = await store.paginate(room_id, viewer, token, direction, limit)
                        if page.next_token is None:
                            break
                        test.assertLessEqual(len(page.events), limit)
                        got += [e["event_id"] for e in page.events]
                        # Full, or the last page before the end of what they may see.
                        if len(page.events) < limit:
                            test.assertEqual(len(got), len(want), (viewer, direction, limit))
                        token = page.next_token
                    test.assertEqual(got, want, (viewer, direction, limit))
    finally:
        store.pagination = paginator


@on_both_engines
class VisibilityOracleTests:
    timeout = 300

    async def test_visibility_matches_spec_rules(self):
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        stats = {"examples": 0, "visible": 0}

        # No shrinking: each example is a database round trip per (viewer,
        # event), and shrinking a failure would outlast the test's timeout.
        # The failure message names the viewer, the event and its state; add
        # Phase.shrink here to get a minimal history when debugging.
        @settings(
            max_examples=75,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def check(data):
            history = draw_history(data)
            stats["examples"] += 1
            stats["visible"] += blockingCallFromThread(
                reactor, lambda: defer.ensureDeferred(check_history(self, store, history))
            )

        await threads.deferToThread(check)
        self.assertGreater(stats["examples"], 0)
        self.assertGreater(stats["visible"], 0)
        # The histories did fork: some snapshots started branches of their own.
        branched = await store.db.run_interaction(
            "branched",
            lambda t: t.select_one_value(
                "SELECT COUNT(*) FROM visibility_branches WHERE base_snapshot_nid IS NOT NULL"
            ),
        )
        self.assertGreater(branched, 0)


@on_both_engines
class VisibilityStorageTests:
    timeout = 300

    async def count_rows(self, store) -> dict[str, int]:
        def txn(t):
            return {
                table: t.select_one_value(f"SELECT COUNT(*) FROM {table}")
                for table in ("visibility_snapshots", "visibility_memberships", "visibility_branches")
            }

        return await store.db.run_interaction("count_rows", txn)

    async def test_messages_add_no_rows_and_a_join_adds_one(self):
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        room = RoomBuilder(room_id="!big:example.org")
        members = [ALICE] + [f"@user{i}:example.org" for i in range(1999)]
        batch = [room.create(), room.join(ALICE), room.join_rules(), room.history_visibility("joined")]
        batch += [room.join(user) for user in members[1:]]
        await store.persist_events([room.to_persist(e) for e in batch])
        self.assertEqual(len(await store.get_users_in_room(room.room_id)), 2000)

        rows = await self.count_rows(store)
        self.assertGreaterEqual(rows["visibility_memberships"], 2000)
        messages = [room.message(members[i * 7 % 2000], f"message {i}") for i in range(200)]
        for start in range(0, 200, 50):
            await store.persist_events([room.to_persist(e) for e in messages[start : start + 50]])
        self.assertEqual(await self.count_rows(store), rows)

        newcomer = "@newcomer:example.org"
        join = room.join(newcomer)
        await store.persist_events([room.to_persist(join)])
        grown = await self.count_rows(store)
        self.assertEqual(grown["visibility_memberships"], rows["visibility_memberships"] + 1)
        self.assertEqual(grown["visibility_branches"], rows["visibility_branches"])

        # And the rows say the right thing: members see the messages, the
        # newcomer (joined-only history) and strangers do not.
        self.assertTrue(await store.is_visible(members[1234], messages[-1].event_id))
        self.assertFalse(await store.is_visible(newcomer, messages[-1].event_id))
        self.assertTrue(await store.is_visible(newcomer, join.event_id))
        self.assertFalse(await store.is_visible(OUTSIDER, messages[0].event_id))
