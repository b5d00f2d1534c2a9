"""Pagination (topological order, every token form) and recent (newest events of the most active rooms)."""

from __future__ import annotations

import attrs

from roomstore.events.tokens import InvalidToken
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder, UncheckedRoomBuilder, fake_event_id

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
CAROL = "@carol:example.org"


def ids(events):
    return [e["event_id"] for e in events]


class TimelineHelpers:
    async def open_store(self) -> RoomStore:
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        return store

    async def settle(self, store) -> int:
        """Let background stream-position writes finish; the query count."""
        for generator in store.generators.values():
            await generator.flush()
        return store.db.query_count


@on_both_engines
class PaginationTests(TimelineHelpers):
    async def build_forked_room(self, store):
        """A room with forks, a merge, a late-arriving fork, a history
        visibility change, a redaction, a rejected event and an outlier.

        Returns (room, keys: event_id -> (topo, stream) of every graph event
        in it, the special events by name).
        """
        room = RoomBuilder(room_id="!pages:example.org")
        keys: dict[str, tuple[int, int]] = {}
        named = {}

        async def persist(*events, **flags):
            results = await store.persist_events([room.to_persist(e, **flags) for e in events])
            for r in results:
                keys[r.event_id] = (r.topological_ordering, r.stream_ordering)
            return results

        await persist(room.create(), room.join(ALICE), room.join_rules(), room.join(BOB))
        m = [room.message(ALICE, f"m{i}") for i in range(4)]
        await persist(*m)
        named["base"] = m[1]
        # Two branches from m1, persisted interleaved, then merged.
        a1 = room.message(ALICE, "a1", prev=[m[1].event_id])
        b1 = room.message(BOB, "b1", prev=[m[1].event_id])
        a2 = room.message(ALICE, "a2", prev=[a1.event_id])
        b2 = room.message(BOB, "b2", prev=[b1.event_id])
        await persist(a1, b1)
        await persist(b2, a2)
        room.leaves = [m[3].event_id, a2.event_id, b2.event_id]
        merge = room.message(ALICE, "merge")
        await persist(merge)
        named["secret"] = room.message(BOB, "to be redacted")
        await persist(named["secret"])
        await persist(room.redact(BOB, named["secret"].event_id))
        named["rejected"] = room.message(BOB, "rejected")
        await persist(named["rejected"], rejected_reason="auth_error")
        named["rejected_key"] = keys.pop(named["rejected"].event_id)
        named["hv"] = room.history_visibility("joined")
        named["hidden"] = room.message(ALICE, "before carol joined")
        named["carol"] = room.join(CAROL)
        await persist(named["hv"], named["hidden"], named["carol"])
        for i in range(3):
            await persist(room.message(CAROL, f"c{i}"))
        # A late event on an old branch: low in topological order, high in stream order.
        leaves = list(room.leaves)
        named["late"] = room.message(BOB, "late", prev=[m[2].event_id])
        room.leaves = leaves
        await persist(named["late"])
        await persist(room.message(ALICE, "last"))
        # An outlier of the room: no place in the timeline.
        named["outlier"] = room.message(ALICE, "outlier", prev=[fake_event_id("gone")], set_leaves=False)
        await persist(named["outlier"], outlier=True)
        del keys[named["outlier"].event_id]
        return room, keys, named

    async def walk(self, store, room_id, user, direction, start, limit):
        """Every page from ``start`` to the end; (events, tokens handed out)."""
        events, tokens = [], []
        token = start
        for _ in range(200):
            page = await store.paginate(room_id, user, token, direction, limit)
            self.assertLessEqual(len(page.events), limit)
            if page.next_token is None:
                self.assertEqual(page.events, [])
                return events, tokens
            events += page.events
            tokens.append(page.next_token)
            token = page.next_token
        self.fail("pagination did not end")

    async def test_pages_in_every_direction_from_every_token(self):
        store = await self.open_store()
        room, keys, named = await self.build_forked_room(store)
        rejected_key = named.pop("rejected_key")
        instance_id = await store.db.run_interaction(
            "id", lambda t: t.select_one_value("SELECT instance_id FROM instances WHERE instance_name = ?", ("master",))
        )
        for user in (ALICE, CAROL):
            visible = {e for e in keys if await store.is_visible(user, e)}
            if user == ALICE:
                self.assertEqual(visible, set(keys))  # the creator, joined throughout
            else:
                self.assertNotIn(named["hidden"].event_id, visible)
                self.assertIn(named["carol"].event_id, visible)
                self.assertIn(named["base"].event_id, visible)  # shared history, joined after
            ascending = sorted(visible, key=keys.__getitem__)
            descending = ascending[::-1]

            def expect(direction, bound):
                if direction == "b":
                    return [e for e in descending if bound is not None and keys[e] <= bound]
                return [e for e in ascending if bound is None or keys[e] > bound]

            all_tokens = []
            for limit in (1, 2, 3, 7, 100):
                back, back_tokens = await self.walk(store, room.room_id, user, "b", None, limit)
                self.assertEqual(ids(back), descending, (user, limit))
                forward, forward_tokens = await self.walk(store, room.room_id, user, "f", None, limit)
                self.assertEqual(ids(forward), ascending, (user, limit))
                all_tokens += back_tokens + forward_tokens
            # Back and forth: from any token handed out, either way gives
            # exactly the events on that side of it.
            all_tokens += [f"t{t}-{s}" for t, s in keys.values()]
            for token in set(all_tokens):
                topo, stream = token[1:].split("-", 1)
                bound = (int(topo), int(stream))
                for direction in ("b", "f"):
                    page = await store.paginate(room.room_id, user, token, direction, 1000)
                    self.assertEqual(ids(page.events), expect(direction, bound), (user, token, direction))
            # Stream tokens: the position after the last event, in
            # topological order, of those at or before it.
            # Rejected events have a place in the graph (not in a page).
            placed = list(keys.values()) + [rejected_key]
            top = max(s for _, s in placed)
            for n in range(0, top + 2):
                at_or_before = [k for k in placed if k[1] <= n]
                bound = max(at_or_before) if at_or_before else None
                for direction in ("b", "f"):
                    page = await store.paginate(room.room_id, user, f"s{n}", direction, 1000)
                    self.assertEqual(ids(page.events), expect(direction, bound), (user, n, direction))
                    if n >= 2:
                        # The multi-writer form: this writer at n, any other at n - 2;
                        # every event here is this writer's, so it is s<n> again.
                        page = await store.paginate(room.room_id, user, f"m{n - 2}~{instance_id}.{n}", direction, 1000)
                        self.assertEqual(ids(page.events), expect(direction, bound), (user, n, direction, "m"))

        # The special events: pruned, never rejected or outliers.
        page = await store.paginate(room.room_id, ALICE, None, "b", 1000)
        served = {e["event_id"]: e for e in page.events}
        self.assertEqual(served[named["secret"].event_id]["content"], {})
        self.assertNotIn(named["rejected"].event_id, served)
        self.assertNotIn(named["outlier"].event_id, served)
        # The late fork event sorts by its place in the graph.
        order = ids(page.events)
        self.assertLess(order.index(named["late"].event_id), order.index(named["base"].event_id) - 1)

    async def test_pages_across_long_invisible_runs_with_forks(self):
        """Runs of events the viewer may not see, longer than a page's window
        (so the page goes on by snapshots), between forks whose branches
        interleave snapshots in topological order, an invite under "invited",
        a leave and a rejoin under "joined", "shared" history before a later
        join, and "world_readable": every page, either way, with the window
        and without, is exactly the events ``is_visible`` accepts."""
        store = await self.open_store()
        room = UncheckedRoomBuilder(room_id="!gaps:example.org")
        keys: dict[str, tuple[int, int]] = {}

        async def persist(*events, resolved=None, state_before=None):
            flags = {} if state_before is None else {"state_before": state_before}
            results = await store.persist_events(
                [room.to_persist(e, **flags) for e in events], None if resolved is None else {room.room_id: resolved}
            )
            for r in results:
                keys[r.event_id] = (r.topological_ordering, r.stream_ordering)

        def chat(sender, n, tag):
            return [room.message(sender, f"{tag}{i}") for i in range(n)]

        await persist(room.create(), room.join(ALICE), room.history_visibility("shared"))
        await persist(*chat(ALICE, 5, "shared"))  # seen later by carol's join
        await persist(room.history_visibility("invited"), *chat(ALICE, 60, "before-invite"))
        await persist(room.member(CAROL, "invite", sender=ALICE), *chat(ALICE, 3, "invited"))
        await persist(room.history_visibility("joined"), *chat(ALICE, 60, "joined-not-carol"))
        # A fork: branch A has carol join and talk; branch B, from before it,
        # has bob join and leave between long talks; both persisted
        # interleaved, so their snapshots interleave in topological order.
        fork = room.leaves[0]
        a = [room.join(CAROL, prev=[fork])]
        b = [room.join(BOB, prev=[fork])]
        for i in range(70):
            a.append(room.message(CAROL, f"a{i}", prev=[a[-1].event_id]))
            b.append(room.message(BOB if i < 35 else ALICE, f"b{i}", prev=[b[-1].event_id]))
            if i == 35:
                b.append(room.member(BOB, "leave", prev=[b[-1].event_id]))
        # The branches' states differ on carol (A: join) and bob (B): the
        # room's current state takes A's carol and B's bob.
        at_fork = dict(await store.get_state_ids(fork))
        resolved = dict(at_fork)
        resolved[("m.room.member", CAROL)] = a[0].event_id
        for i in range(0, max(len(a), len(b)), 10):
            for event in b[i : i + 10]:
                if event.event["type"] == "m.room.member":
                    resolved[("m.room.member", BOB)] = event.event_id
            await persist(*a[i : i + 10], *b[i : i + 10], resolved=dict(resolved))
        room.leaves = [a[-1].event_id, b[-1].event_id]
        await persist(room.message(ALICE, "merge"), resolved=dict(resolved), state_before=dict(resolved))
        await persist(room.member(CAROL, "leave"), *chat(ALICE, 80, "after-leave"))
        await persist(room.join(CAROL), *chat(CAROL, 4, "rejoined"))
        await persist(room.history_visibility("world_readable"), *chat(ALICE, 3, "public"))

        for user in (CAROL, BOB, ALICE, "@stranger:example.org"):
            visible = [e for e in keys if await store.is_visible(user, e)]
            ascending = sorted(visible, key=keys.__getitem__)
            if user == CAROL:
                self.assertGreater(len(ascending), 20)
                self.assertLess(len(ascending), len(keys) - 150)  # long gaps
            paginator = store.pagination
            for slack in (paginator.pagination_slack, 0):
                store.pagination = attrs.evolve(paginator, pagination_slack=slack)
                try:
                    for limit in (3, 10):
                        back, _ = await self.walk(store, room.room_id, user, "b", None, limit)
                        self.assertEqual(ids(back), ascending[::-1], (user, slack, limit))
                        forward, _ = await self.walk(store, room.room_id, user, "f", None, limit)
                        self.assertEqual(ids(forward), ascending, (user, slack, limit))
                    # Every page but the last of each walk is full.
                    token, sizes = None, []
                    while True:
                        page = await store.paginate(room.room_id, user, token, "b", 7)
                        sizes.append(len(page.events))
                        if page.next_token is None:
                            break
                        token = page.next_token
                    self.assertTrue(all(n == 7 for n in sizes[:-2]), (user, slack, sizes))
                finally:
                    store.pagination = paginator

    async def test_backfilled_history_pages_too(self):
        store = await self.open_store()
        room = RoomBuilder(room_id="!backfilled:example.org")
        create, join = room.create(), room.join(ALICE)
        older = [room.message(ALICE, f"old{i}") for i in range(3)]
        newer = room.message(ALICE, "new")
        # The server joined late: it has create, join and the new message; the
        # old ones arrive later through backfill (negative stream orderings).
        state = {("m.room.create", ""): create.event_id, ("m.room.member", ALICE): join.event_id}
        await store.persist_events([room.to_persist(create), room.to_persist(join)])
        await store.persist_events([room.to_persist(newer, state_before=state)])
        results = await store.persist_events(
            [room.to_persist(e, backfilled=True, state_before=state) for e in reversed(older)]
        )
        self.assertTrue(all(r.stream_ordering < 0 for r in results))
        page = await store.paginate(room.room_id, ALICE, None, "b", 100)
        self.assertEqual(
            ids(page.events),
            [newer.event_id] + [e.event_id for e in reversed(older)] + [join.event_id, create.event_id],
        )
        back = await store.paginate(room.room_id, ALICE, None, "b", 2)
        rest = await store.paginate(room.room_id, ALICE, back.next_token, "b", 100)
        self.assertEqual(ids(back.events) + ids(rest.events), ids(page.events))
        self.assertEqual(
            ids((await store.paginate(room.room_id, ALICE, back.next_token, "f", 100)).events),
            ids(page.events)[:2][::-1],
        )

    async def test_bad_arguments(self):
        store = await self.open_store()
        room = RoomBuilder()
        await store.persist_events([room.to_persist(room.create()), room.to_persist(room.join(ALICE))])
        for token in ("x", "t1", "t-1-1", "s-1", "s01", "m3", "", "t1-01", "m1~999.5"):
            with self.assertRaises(InvalidToken, msg=token):
                await store.paginate(room.room_id, ALICE, token, "b", 10)
        with self.assertRaises(ValueError):
            await store.paginate(room.room_id, ALICE, None, "x", 10)
        with self.assertRaises(ValueError):
            await store.paginate(room.room_id, ALICE, None, "b", 0)
        page = await store.paginate("!nowhere:example.org", ALICE, None, "b", 10)
        self.assertEqual((page.events, page.next_token), ([], None))
        # A viewer the store never heard of sees world-readable history only.
        self.assertEqual((await store.paginate(room.room_id, "@nobody:example.org", None, "b", 10)).events, [])
        await store.persist_events([room.to_persist(room.history_visibility("world_readable"))])
        page = await store.paginate(room.room_id, "@nobody:example.org", None, "b", 10)
        self.assertEqual([e["type"] for e in page.events], ["m.room.history_visibility"])


@on_both_engines
class RecentTests(TimelineHelpers):
    async def make_rooms(self, store, count=5):
        rooms = []
        for i in range(count):
            room = RoomBuilder(room_id=f"!recent{i}:example.org")
            await store.persist_events(
                [room.to_persist(e) for e in (room.create(), room.join(ALICE), room.join_rules())]
            )
            rooms.append(room)
        return rooms

    async def test_most_active_rooms_paged_by_cursor(self):
        store = await self.open_store()
        rooms = await self.make_rooms(store)
        sent = {r.room_id: [] for r in rooms}
        # Activity order (newest last): 3, 0, 4, 1, 2.
        for index, n in ((3, 2), (0, 4), (4, 1), (1, 5), (2, 3)):
            room = rooms[index]
            for i in range(n):
                event = room.message(ALICE, f"{index}:{i}")
                await store.persist_events([room.to_persist(event)])
                sent[room.room_id].append(event.event_id)
        order = [rooms[i].room_id for i in (2, 1, 4, 0, 3)]

        first = await store.recent(ALICE, 2, 3)
        self.assertEqual([r for r, _ in first.rooms], order[:2])
        for room_id, events in first.rooms:
            self.assertEqual(ids(events), sent[room_id][-3:])
        self.assertEqual(first.token, store.get_current_token())
        # Activity after the first page does not move rooms between pages:
        # the walk is pinned to the first page's position.
        late = rooms[3].message(ALICE, "late")
        await store.persist_events([rooms[3].to_persist(late)])
        second = await store.recent(ALICE, 2, 3, first.next_cursor)
        third = await store.recent(ALICE, 2, 3, second.next_cursor)
        self.assertIsNone(third.next_cursor)
        walked = first.rooms + second.rooms + third.rooms
        self.assertEqual([r for r, _ in walked], order)
        for room_id, events in walked:
            # The join counts when a room has fewer than 3 messages.
            want = sent[room_id][-3:]
            self.assertEqual(ids(events)[-len(want) :], want)
            self.assertEqual(len(events), 3)
        self.assertNotIn(late.event_id, [e["event_id"] for _, evs in walked for e in evs])
        self.assertEqual({second.token, third.token}, {first.token})
        # A fresh walk sees the late message, in a room now first.
        fresh = await store.recent(ALICE, 1, 1)
        self.assertEqual(fresh.rooms, [(rooms[3].room_id, [await store.get_event(late.event_id)])])
        # No events asked for: just the rooms.
        bare = await store.recent(ALICE, 10, 0)
        self.assertEqual([r for r, _ in bare.rooms], [rooms[3].room_id] + order[:-1])
        self.assertTrue(all(events == [] for _, events in bare.rooms))
        self.assertIsNone(bare.next_cursor)

    async def test_room_activity_is_the_newest_timeline_event(self):
        """``rooms.activity`` (what recent orders rooms by) moves with live
        timeline events only: an outlier, a rejected event or backfilled
        history leave it, and the migration's backfill gives the same values."""
        store = await self.open_store()
        [quiet, busy] = await self.make_rooms(store, 2)
        await store.persist_events([busy.to_persist(busy.message(ALICE, "busy"))])
        refused = quiet.message(ALICE, "rejected")
        await store.persist_events([quiet.to_persist(refused, rejected_reason="auth_error")])
        stray = quiet.message(ALICE, "an outlier")
        await store.persist_events([quiet.to_persist(stray, outlier=True)])
        state = {("m.room.create", ""): quiet.events[0].event_id, ("m.room.member", ALICE): quiet.events[1].event_id}
        old = quiet.message(ALICE, "history")
        await store.persist_events([quiet.to_persist(old, backfilled=True, state_before=state)])
        result = await store.recent(ALICE, 2, 1)
        self.assertEqual([r for r, _ in result.rooms], [busy.room_id, quiet.room_id])

        def columns(txn):
            return txn.execute("SELECT room_nid, activity FROM rooms ORDER BY room_nid").fetchall()

        def definition(txn):
            return txn.execute(
                "SELECT r.room_nid, (SELECT MAX(e.stream_ordering) FROM events AS e WHERE e.room_nid = r.room_nid"
                " AND e.outlier = ? AND e.rejected_reason IS NULL) FROM rooms AS r ORDER BY r.room_nid",
                (False,),
            ).fetchall()

        kept = await store.db.run_interaction("columns", columns)
        self.assertEqual(kept, await store.db.run_interaction("definition", definition))
        self.assertEqual(len(kept), 2)

        # The schema delta's backfill of the column, run on a store whose
        # column is cleared, gives what the persister kept.
        from roomstore.storage.schema import DEFAULT_SCHEMA_DIR, split_statements

        delta = (DEFAULT_SCHEMA_DIR / "deltas" / "3" / "02_room_activity.sql").read_text()
        [backfill] = [s for s in split_statements(delta) if s.startswith("UPDATE")]

        def migrate(txn):
            txn.execute("UPDATE rooms SET activity = NULL")
            txn.execute(backfill)

        await store.db.run_interaction("migrate", migrate)
        self.assertEqual(await store.db.run_interaction("columns", columns), kept)

    async def test_visibility_counts_and_one_statement(self):
        store = await self.open_store()
        [open_room, closed] = await self.make_rooms(store, 2)
        hv = closed.history_visibility("joined")
        await store.persist_events([closed.to_persist(hv)])
        hidden = [closed.message(ALICE, f"hidden {i}") for i in range(5)]
        await store.persist_events([closed.to_persist(e) for e in hidden])
        join = closed.join(BOB)
        shown = closed.message(ALICE, "shown")
        await store.persist_events([closed.to_persist(join), closed.to_persist(shown)])
        rejected = closed.message(ALICE, "rejected")
        await store.persist_events([closed.to_persist(rejected, rejected_reason="auth_error")])
        # Bob is not in the open room; the closed room shows him what he may see only.
        await store.get_rooms_for_user(BOB)
        queries = await self.settle(store)
        result = await store.recent(BOB, 5, 4)
        self.assertEqual(store.db.query_count - queries, 1)
        # The messages sent under "joined" before he joined are not his; what
        # came before the change is (shared history, and he joined after).
        newest = [closed.events[2].event_id, hv.event_id, join.event_id, shown.event_id]
        self.assertEqual(result.rooms, [(closed.room_id, list((await store.get_events(newest)).values()))])
        # Alice sees the newest 4 of everything (the rejected event is not one).
        result = await store.recent(ALICE, 5, 4)
        self.assertEqual(result.rooms[0][0], closed.room_id)
        self.assertEqual(
            ids(result.rooms[0][1]), [hidden[-2].event_id, hidden[-1].event_id, join.event_id, shown.event_id]
        )
        self.assertEqual(result.rooms[1][0], open_room.room_id)

    async def test_bad_arguments(self):
        store = await self.open_store()
        await self.make_rooms(store, 1)
        for cursor in ("x", "1_2", "1_2_x", "a_1_s3", "1_2_t1-1", "1_2_s01"):
            with self.assertRaises(InvalidToken, msg=cursor):
                await store.recent(ALICE, 1, 1, cursor)
        with self.assertRaises(ValueError):
            await store.recent(ALICE, 0, 1)
        with self.assertRaises(ValueError):
            await store.recent(ALICE, 1, -1)
        self.assertEqual((await store.recent("@nobody:example.org", 3, 3)).rooms, [])
