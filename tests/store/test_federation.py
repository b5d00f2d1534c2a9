"""Federation reads: backfill and missing events over a forked room graph.

The expected answers are computed here from the builder's graph (prev
events and depths as built, stream orderings as persisted): a deepest-first
breadth-first walk for backfill, set arithmetic on ancestors for missing
events.
"""

from __future__ import annotations

import heapq
import itertools

from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


class Graph:
    """The test's own view of the room graph."""

    def __init__(self):
        self.prevs: dict[str, list[str]] = {}
        self.key: dict[str, tuple[int, int]] = {}  # (depth, stream)
        self.rejected: set[str] = set()

    def add(self, built, result, rejected=False):
        self.prevs[built.event_id] = list(built.event["prev_events"])
        self.key[built.event_id] = (built.event["depth"], result.stream_ordering)
        if rejected:
            self.rejected.add(built.event_id)

    def ancestors(self, starts, inclusive):
        seen, stack = set(), [s for s in starts if s in self.key]
        found = set(stack) if inclusive else set()
        while stack:
            for prev in self.prevs[stack.pop()]:
                if prev in self.key and prev not in seen:
                    seen.add(prev)
                    found.add(prev)
                    stack.append(prev)
        return found

    def backfill(self, starts, limit):
        """Breadth first over prev events, deepest first (a priority queue)."""
        starts = [s for s in dict.fromkeys(starts) if s in self.key]
        heap = [(-self.key[s][0], -self.key[s][1], s) for s in starts]
        heapq.heapify(heap)
        seen, out = set(starts), []
        while heap and len(out) < limit:
            _, _, event_id = heapq.heappop(heap)
            if event_id not in self.rejected:
                out.append(event_id)
            for prev in self.prevs[event_id]:
                if prev in self.key and prev not in seen:
                    seen.add(prev)
                    heapq.heappush(heap, (-self.key[prev][0], -self.key[prev][1], prev))
        return sorted(out, key=self.key.__getitem__)

    def missing(self, earliest, latest, limit):
        have = set(earliest) | self.ancestors(earliest, inclusive=False)
        wanted = self.ancestors(latest, inclusive=False) - set(latest) - have - self.rejected
        deepest = sorted(wanted, key=self.key.__getitem__, reverse=True)[:limit]
        return sorted(deepest, key=self.key.__getitem__)


@on_both_engines
class FederationTests:
    async def build(self):
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        room = RoomBuilder(room_id="!fed:example.org")
        graph = Graph()
        named = {}

        async def persist(*events, rejected=False, **flags):
            results = await store.persist_events(
                [room.to_persist(e, rejected_reason="bad" if rejected else None, **flags) for e in events]
            )
            for built, result in zip(events, results, strict=True):
                if not flags.get("outlier"):
                    graph.add(built, result, rejected)
            return results

        for name, event in (
            ("create", room.create()),
            ("join", room.join(ALICE)),
            ("rules", room.join_rules()),
            ("bob", room.join(BOB)),
        ):
            named[name] = event
        await persist(named["create"], named["join"], named["rules"], named["bob"])
        m0 = named["m0"] = room.message(ALICE, "m0")
        m1 = named["m1"] = room.message(ALICE, "m1")
        await persist(m0, m1)
        # Three branches: two from m1 of different lengths, one from m0.
        a = [room.message(ALICE, "a1", prev=[m1.event_id])]
        for i in (2, 3):
            a.append(room.message(ALICE, f"a{i}", prev=[a[-1].event_id]))
        b = [room.message(BOB, "b1", prev=[m1.event_id])]
        b.append(room.message(BOB, "b2", prev=[b[-1].event_id]))
        c = [room.message(BOB, "c1", prev=[m0.event_id])]
        # Persisted interleaved, so stream order differs from graph order.
        await persist(b[0], a[0])
        await persist(c[0], a[1], b[1])
        await persist(a[2])
        named.update({e.event["content"]["body"]: e for e in a + b + c})
        room.leaves = [a[2].event_id, b[1].event_id, c[0].event_id]
        merge = named["merge"] = room.message(ALICE, "merge")
        await persist(merge)
        # A rejected event in the middle of the graph: walked through.
        bad = named["rejected"] = room.message(BOB, "rejected")
        await persist(bad, rejected=True)
        n1 = named["n1"] = room.message(ALICE, "n1")
        side = named["side"] = room.message(ALICE, "side", prev=[merge.event_id])
        await persist(n1, side)
        n2 = named["n2"] = room.message(ALICE, "n2")
        await persist(n2)
        # An outlier: stored, but not part of the graph.
        named["outlier"] = room.message(ALICE, "outlier", prev=[fake_event_id("x")], set_leaves=False)
        await persist(named["outlier"], outlier=True)
        # Another room.
        other = RoomBuilder(room_id="!other:example.org")
        named["other"] = other.create()
        await store.persist_events([other.to_persist(named["other"])])
        return store, room, graph, named

    async def test_backfill_matches_breadth_first_walk(self):
        store, room, graph, named = await self.build()
        starts_cases = [["n2"], ["n1"], ["a3", "b2"], ["merge"], ["c1", "a1"], ["create"], ["n2", "side"]]
        for names, limit in itertools.product(starts_cases, (1, 2, 3, 5, 8, 100)):
            starts = [named[n].event_id for n in names]
            got = await store.backfill(room.room_id, starts, limit)
            want = graph.backfill(starts, limit)
            self.assertEqual([e["event_id"] for e in got], want, (names, limit))
            # Equivalently: the deepest `limit` ancestors (inclusive), as depth
            # grows along every edge.
            pool = graph.ancestors(starts, inclusive=True) - graph.rejected
            self.assertEqual(set(want), set(sorted(pool, key=graph.key.__getitem__, reverse=True)[:limit]))
        # The whole room back from the end, rejected event left out, and
        # the events as get_events serves them.
        everything = await store.backfill(room.room_id, [named["n2"].event_id, named["side"].event_id], 1000)
        self.assertEqual(len(everything), len(graph.key) - 1)
        self.assertNotIn(named["rejected"].event_id, [e["event_id"] for e in everything])
        served = await store.get_events([e["event_id"] for e in everything])
        self.assertEqual(everything, [served[e["event_id"]] for e in everything])
        # What is not a graph event of the room is ignored.
        for ids in ([named["outlier"].event_id], [named["other"].event_id], [fake_event_id("unknown")], []):
            self.assertEqual(await store.backfill(room.room_id, ids, 10), [])
        self.assertEqual(await store.backfill("!nowhere:example.org", [named["n2"].event_id], 10), [])
        self.assertEqual(await store.backfill(room.room_id, [named["n2"].event_id], 0), [])

    async def test_missing_events_between_earliest_and_latest(self):
        store, room, graph, named = await self.build()
        latest_cases = [["n2"], ["n1", "side"], ["merge"], ["a3", "b2"], ["c1"]]
        earliest_cases = [[], ["m1"], ["a1"], ["b1", "c1"], ["create"], ["a2", "m0"], ["merge"], ["rejected"]]
        nonempty = 0
        for latest, earliest, limit in itertools.product(latest_cases, earliest_cases, (1, 3, 100)):
            latest_ids = [named[n].event_id for n in latest]
            earliest_ids = [named[n].event_id for n in earliest]
            got = await store.get_missing_events(room.room_id, earliest_ids, latest_ids, limit)
            want = graph.missing(earliest_ids, latest_ids, limit)
            self.assertEqual([e["event_id"] for e in got], want, (latest, earliest, limit))
            nonempty += bool(want)
        self.assertGreater(nonempty, 50)
        # The fork from m0: with m1 known, c1's branch is missing but m0 and
        # what precedes it are not (not even reached through c1).
        got = await store.get_missing_events(room.room_id, [named["m1"].event_id], [named["merge"].event_id], 100)
        self.assertEqual(
            {e["event_id"] for e in got},
            {named[n].event_id for n in ("a1", "a2", "a3", "b1", "b2", "c1")},
        )
        # Unknown, outlier and foreign events are ignored.
        foreign = [named["outlier"].event_id, named["other"].event_id]
        self.assertEqual(await store.get_missing_events(room.room_id, [], foreign, 10), [])
        self.assertEqual(await store.get_missing_events(room.room_id, [], [named["n2"].event_id], 0), [])
