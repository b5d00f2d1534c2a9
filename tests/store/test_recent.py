"""recent() at scale: the event cache it serves from and fills, and the
index its statement reads a user's joined rooms from (schema version 4).

The results themselves (order, cursor, visibility, one statement) are tested
in ``tests.store.test_timeline.RecentTests``.
"""

from __future__ import annotations

from roomstore.storage.schema import prepare_database
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"


def index_names_txn(txn, table: str) -> set[str]:
    if txn.engine.name == "sqlite":
        sql = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?"
    else:
        sql = "SELECT indexname FROM pg_indexes WHERE tablename = ?"
    return {row[0] for row in txn.execute(sql, (table,)).fetchall()}


class Recording:
    """A transaction that remembers the statements run through it."""

    def __init__(self, txn):
        self.txn = txn
        self.statements: list[tuple[str, list]] = []

    def __getattr__(self, name):
        return getattr(self.txn, name)

    def execute(self, sql, args=(), prepare=False):
        self.statements.append((sql, list(args)))
        return self.txn.execute(sql, args, prepare)


def recent_plan_txn(txn, store: RoomStore, user_id: str) -> str:
    """The engine's plan of the statement ``_recent_txn`` runs."""
    timeline = store.timeline
    recording = Recording(txn)
    now = timeline.positions.per_writer(timeline.positions.now())
    timeline._recent_txn(recording, timeline.cached_viewer(user_id), 20, 10, None, now)
    sql, args = recording.statements[-1]
    if txn.engine.name == "sqlite":
        return "\n".join(row[3] for row in txn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall())
    return "\n".join(row[0] for row in txn.execute("EXPLAIN " + sql, args).fetchall())


@on_both_engines
class RecentCacheTests:
    async def room_with_messages(self, store: RoomStore, count: int = 3) -> tuple[RoomBuilder, list]:
        room = RoomBuilder(room_id="!cached:example.org")
        events = [room.create(), room.join(ALICE)]
        messages = [room.message(ALICE, f"m{i}") for i in range(count)]
        events += messages
        await store.persist_events([room.to_persist(e) for e in events])
        return room, messages

    async def test_recent_fills_the_event_cache(self):
        """The events recent() served are in the event cache after it:
        fetching them again runs no statement, and gives the same dicts."""
        store = await self.open_store()
        _, messages = await self.room_with_messages(store)
        result = await store.recent(ALICE, 1, 3)
        [(_, served)] = result.rooms
        self.assertEqual([e["event_id"] for e in served], [m.event_id for m in messages])
        before = store.db.query_count
        fetched = await store.get_events([m.event_id for m in messages])
        self.assertEqual(store.db.query_count, before)
        self.assertEqual(list(fetched.values()), served)
        # A second call serves the cached dicts themselves.
        again = await store.recent(ALICE, 1, 3)
        self.assertTrue(all(a is b for a, b in zip(again.rooms[0][1], served, strict=True)))

    async def test_a_redaction_after_a_cached_read_is_served(self):
        """An event recent() cached, then redacted: the next recent() serves
        the pruned event, as ``get_event`` does."""
        store = await self.open_store()
        room, messages = await self.room_with_messages(store)
        await store.recent(ALICE, 1, 3)
        redaction = room.redact(ALICE, messages[0].event_id)
        await store.persist_events([room.to_persist(redaction)])
        result = await store.recent(ALICE, 1, 4)
        [(_, served)] = result.rooms
        pruned = await store.get_event(messages[0].event_id)
        self.assertIn("redacted_because", pruned["unsigned"])
        self.assertEqual(served[0], pruned)
        self.assertNotIn("body", served[0]["content"])

    async def test_a_cached_event_that_disagrees_with_the_row_is_parsed_again(self):
        """A cached dict that is not pruned while the row says the event is
        redacted (a cache not yet told, as on a worker behind its writer) is
        not served: recent() parses the stored bytes and caches the result."""
        store = await self.open_store()
        room, messages = await self.room_with_messages(store)
        [(_, served)] = (await store.recent(ALICE, 1, 3)).rooms
        stale = served[0]
        redaction = room.redact(ALICE, messages[0].event_id)
        await store.persist_events([room.to_persist(redaction)])
        # Put the unpruned dict back, as if the invalidation had not arrived.
        store.reader.cache_events(store.reader.events_generation, {stale["event_id"]: stale})
        [(_, served)] = (await store.recent(ALICE, 1, 4)).rooms
        self.assertIn("redacted_because", served[0]["unsigned"])
        self.assertIs(store.reader.cached_event(stale["event_id"]), served[0])

    async def test_an_invalidation_during_the_read_keeps_its_events_out_of_the_cache(self):
        """A read whose transaction began before an invalidation must not fill
        the cache (its rows may be older than the invalidation)."""
        store = await self.open_store()
        _, messages = await self.room_with_messages(store)
        run = store.db.run_interaction

        async def invalidating(description, fn, *args):
            result = await run(description, fn, *args)
            if description == "recent":
                store.reader.invalidate_event("$unrelated")  # arrives while the rows are on their way
            return result

        store.db.run_interaction = invalidating
        try:
            await store.recent(ALICE, 1, 3)
        finally:
            store.db.run_interaction = run
        self.assertTrue(all(store.reader.cached_event(m.event_id) is None for m in messages))


@on_both_engines
class JoinedRoomsIndexTests:
    timeout = 120

    async def test_version_4_replaces_the_user_index(self):
        """Upgrading a version 3 database swaps (user, membership) for
        (user, membership, room) and keeps every row readable by it."""
        db = await self.make_database(prepare=False)
        self.assertEqual(await db.run_interaction("to 3", prepare_database, None, 3), 3)
        self.assertIn("current_memberships_user", await db.run_interaction("i", index_names_txn, "current_memberships"))
        rows = [(room, user, 1, 100 + room * 10 + user, room * 10 + user) for room in range(1, 4) for user in (7, 8)]
        await db.run_interaction(
            "rows",
            lambda t: t.insert_many(
                "current_memberships", ("room_nid", "user_nid", "membership", "event_nid", "stream_ordering"), rows
            ),
        )
        self.assertEqual(await db.run_interaction("to 4", prepare_database, None, 4), 4)
        names = await db.run_interaction("i", index_names_txn, "current_memberships")
        self.assertIn("current_memberships_user_rooms", names)
        self.assertNotIn("current_memberships_user", names)
        joined = await db.run_interaction(
            "joined",
            lambda t: [
                r[0]
                for r in t.execute(
                    "SELECT room_nid FROM current_memberships WHERE user_nid = ? AND membership = ? ORDER BY room_nid",
                    (7, 1),
                ).fetchall()
            ],
        )
        self.assertEqual(joined, [1, 2, 3])

    async def test_joined_rooms_come_from_the_index_alone(self):
        """The plan of recent()'s statement reads a user's joined rooms from
        the (user, membership, room) index without the table (SQLite: a
        covering index; on PostgreSQL, with sequential scans off so that the
        tiny table's plan shows which index it would take, that index)."""
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        for i in range(30):
            room = RoomBuilder(room_id=f"!plan{i}:example.org")
            await store.persist_events(
                [room.to_persist(e) for e in (room.create(), room.join(ALICE), room.join_rules(), room.join(BOB))]
            )
        await store.get_rooms_for_user(BOB)
        if self.engine_name == "sqlite":
            plan = await store.db.run_interaction("plan", recent_plan_txn, store, BOB)
            self.assertIn("USING COVERING INDEX current_memberships_user_rooms", plan)
        else:

            def plan_txn(txn):
                txn.execute("SET LOCAL enable_seqscan = off")
                return recent_plan_txn(txn, store, BOB)

            plan = await store.db.run_interaction("plan", plan_txn)
            self.assertIn("current_memberships_user_rooms", plan)


@on_both_engines
class RecentFloorTests:
    """Each room's events come from its floor up: the ``events``-th newest
    visible event, found by testing the newest events only until enough are
    visible. Checked against a brute force: every event of the room tested
    with ``is_visible`` (the same predicate, one event at a time), in stream
    order, the newest ``events`` kept."""

    timeout = 120

    async def expected(self, store: RoomStore, room: RoomBuilder, viewer: str, count: int) -> list[str]:
        def streams(txn):
            return txn.execute(
                "SELECT i.event_id FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
                " JOIN rooms AS r ON r.room_nid = e.room_nid"
                " WHERE r.room_id = ? AND e.outlier = ? AND e.rejected_reason IS NULL ORDER BY e.stream_ordering",
                (room.room_id, False),
            ).fetchall()

        visible = [
            r[0] for r in await store.db.run_interaction("streams", streams) if await store.is_visible(viewer, r[0])
        ]
        return visible[-count:] if count else []

    async def test_rooms_long_short_hidden_and_backfilled(self):
        store = await RoomStore.open(await self.make_database())
        self.addCleanup(store.close)
        persist = store.persist_events
        # A long room, everything visible.
        long = RoomBuilder(room_id="!long:example.org")
        events = [long.create(), long.join(ALICE), long.join_rules(), long.join(BOB)]
        events += [long.message(ALICE, f"long {i}") for i in range(40)]
        await persist([long.to_persist(e) for e in events])
        # History "joined", Bob joins late: two messages and his join are his.
        late = RoomBuilder(room_id="!late:example.org")
        events = [late.create(), late.join(ALICE), late.join_rules(), late.history_visibility("joined")]
        events += [late.message(ALICE, f"before {i}") for i in range(30)]
        events += [late.join(BOB), late.message(ALICE, "after 0"), late.message(ALICE, "after 1")]
        await persist([late.to_persist(e) for e in events])
        # History "joined", Bob leaves and comes back: what was sent while he
        # was away lies between his newest visible events and older ones.
        away = RoomBuilder(room_id="!away:example.org")
        events = [away.create(), away.join(ALICE), away.join_rules(), away.history_visibility("joined"), away.join(BOB)]
        events += [away.message(ALICE, f"there {i}") for i in range(4)]
        events += [away.member(BOB, "leave")]
        events += [away.message(ALICE, f"away {i}") for i in range(20)]
        events += [away.join(BOB), away.message(ALICE, "back")]
        await persist([away.to_persist(e) for e in events])
        # Backfilled history: negative stream orderings, below the others.
        old = RoomBuilder(room_id="!old:example.org")
        create, join_alice, rules, join_bob = old.create(), old.join(ALICE), old.join_rules(), old.join(BOB)
        older = [old.message(ALICE, f"old {i}") for i in range(3)]
        newer = old.message(ALICE, "new")
        state = {
            ("m.room.create", ""): create.event_id,
            ("m.room.member", ALICE): join_alice.event_id,
            ("m.room.join_rules", ""): rules.event_id,
            ("m.room.member", BOB): join_bob.event_id,
        }
        await persist([old.to_persist(e) for e in (create, join_alice, rules, join_bob)])
        await persist([old.to_persist(newer, state_before=state)])
        await persist([old.to_persist(e, backfilled=True, state_before=state) for e in reversed(older)])

        rooms = (long, late, away, old)
        for count in (1, 2, 3, 5, 8, 100):
            result = await store.recent(BOB, 10, count)
            self.assertEqual(sorted(r for r, _ in result.rooms), sorted(r.room_id for r in rooms))
            for room_id, served in result.rooms:
                room = next(r for r in rooms if r.room_id == room_id)
                want = await self.expected(store, room, BOB, count)
                self.assertEqual([e["event_id"] for e in served], want, (room_id, count))
        # The late joiner's room shows him his join and the two messages
        # after it, however many are asked for; the room where he was away
        # skips what was sent meanwhile.
        [(_, served)] = [(r, e) for r, e in (await store.recent(BOB, 10, 100)).rooms if r == late.room_id]
        self.assertEqual([e["content"].get("body") for e in served][-2:], ["after 0", "after 1"])
        self.assertEqual(
            len(served), 4 + 3
        )  # create, Alice's join, join rules, history visibility; his join, two after
        [(_, served)] = [(r, e) for r, e in (await store.recent(BOB, 10, 7)).rooms if r == away.room_id]
        bodies = [e["content"].get("body") for e in served]
        self.assertNotIn("away 0", bodies)
        self.assertEqual(bodies[-1], "back")
