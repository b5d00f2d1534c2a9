"""The plan of a pagination page, on both engines: the statement walks the
(room, topological) index in its ORDER BY order and stops after its window,
rather than reading the room through the (room, stream) index and sorting it
(which tested the visibility of every event of the room for each page)."""

from __future__ import annotations

from roomstore.events.tokens import TopologicalToken
from roomstore.storage.interning import chunks
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

VIEWER = "@viewer:example.org"


def page_plan_txn(txn, store: RoomStore, room_id: str, start, direction: str) -> str:
    """The engine's plan of the statement ``_paginate_txn`` runs for a page."""
    captured = []
    execute = txn.execute

    def spy(sql, args=(), prepare=False):
        captured.append((sql, list(args)))
        return execute(sql, args, prepare)

    txn.execute = spy
    timeline = store.timeline
    try:
        store.pagination._paginate_txn(
            txn,
            room_id,
            timeline.cached_viewer(VIEWER),
            start,
            None,
            direction,
            10,
            timeline.positions.per_writer(timeline.positions.now()),
        )
    finally:
        txn.execute = execute
    sql, args = captured[-1]
    if txn.engine.name == "sqlite":
        # One line per node: "parent detail" (parent 0: the statement itself).
        rows = txn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall()
        return "\n".join(f"{row[1]} {row[3]}" for row in rows)
    rows = txn.execute("EXPLAIN " + sql, args).fetchall()
    return "\n".join(row[0] for row in rows)


@on_both_engines
class PaginationPlanTests:
    timeout = 300

    async def store_with(self, room: RoomBuilder, events: list) -> tuple:
        """(database, store) holding ``events`` of ``room``."""
        db = await self.make_database()
        store = await RoomStore.open(db)
        self.addCleanup(store.close)
        for part in chunks(events, 100):
            await store.persist_events([room.to_persist(e) for e in part])
        return db, store

    async def test_a_page_walks_the_topological_index(self):
        room = RoomBuilder("!plan:example.org")
        events = [room.create(), room.join(room.creator), room.join_rules(), room.join(VIEWER)]
        events += [room.message(room.creator, f"m{i}") for i in range(2_000)]
        db, store = await self.store_with(room, events)
        if self.engine_name == "postgres":
            await db.run_interaction("analyze", lambda txn: txn.execute("ANALYZE"))
        page = await store.paginate(room.room_id, VIEWER, None, "b", 10)
        token = page.next_token
        for start, direction in (
            (None, "b"),
            (TopologicalToken.parse(token), "b"),
            (TopologicalToken.parse(token), "f"),
        ):
            plan = await db.run_interaction("plan", page_plan_txn, store, room.room_id, start, direction)
            self.assertIn("events_room_topo", plan, plan)
            if self.engine_name == "sqlite":
                # The two walks over the room need no sort: the index gives
                # the order. ``hit``, the page tested event by event, and
                # ``edge``, the window's far end (index alone). (The statement
                # sorts only the page it keeps, at most twice ``limit`` keys.)
                lines = plan.splitlines()
                for cte, index in (("hit", "INDEX"), ("edge", "COVERING INDEX")):
                    found = [i for i, line in enumerate(lines) if line.endswith(f" MATERIALIZE {cte}")]
                    self.assertEqual(len(found), 1, (cte, plan))
                    # Its first step is the walk; no sort shares its parent.
                    parent, _, first = lines[found[0] + 1].partition(" ")
                    under = [line.partition(" ")[2] for line in lines if line.partition(" ")[0] == parent]
                    self.assertNotIn("USE TEMP B-TREE FOR ORDER BY", under, plan)
                    walk = [line for line in under if line.startswith("SEARCH e ")]
                    self.assertEqual(walk, [first], plan)
                    self.assertTrue(walk[0].startswith(f"SEARCH e USING {index} events_room_topo (room_nid=?"), plan)
                    # The walk starts at the token's key (or the end of the
                    # room), not at the end of the room every page.
                    self.assertIn("(topological_ordering,stream_ordering)", walk[0], plan)
                # Nothing else reads the room's events in order of the room.
                searches = [line for line in lines if " SEARCH e USING " in line and " events_room_topo " in line]
                self.assertEqual(len(searches), 2, plan)
            else:
                self.assertIn("Limit", plan.splitlines()[0], plan)
                self.assertNotIn("Sort Key: e.topological_ordering", plan, plan)

    async def test_a_served_redaction_is_found_from_its_target(self):
        # The first-redaction subquery of a page finds the redaction through
        # the redacted event (redactions_redacts), not by walking the room's
        # events in stream order (a walk of the room per redacted event).
        room = RoomBuilder("!redacted-plan:example.org")
        events = [room.create(), room.join(room.creator), room.join_rules(), room.join(VIEWER)]
        for i in range(300):
            message = room.message(room.creator, f"m{i}")
            events += [message, room.redact(room.creator, message.event_id)]
        db, store = await self.store_with(room, events)
        page = await store.paginate(room.room_id, VIEWER, None, "b", 10)
        self.assertTrue(any("redacted_because" in e.get("unsigned", {}) for e in page.events))
        plan = await db.run_interaction("plan", page_plan_txn, store, room.room_id, None, "b")
        self.assertIn("redactions_redacts", plan, plan)
        if self.engine_name == "sqlite":
            self.assertNotIn("SEARCH red USING INDEX events_room_stream", plan, plan)
