"""Purges (``RoomStore.purge_history``, ``purge_room``) on both engines.

History: the state before and after every remaining timeline event reads as
it did, state groups nothing uses any more are gone, the reads (pagination,
sync, recent, get_event) see the purge point, what the room needs stays (as
outliers), and a re-run changes nothing. Room: no row of the room is left in
any table of the schema, another room is untouched, also while it is written.
"""

from __future__ import annotations

import attrs
from twisted.internet import defer

from roomstore.events.caches import HISTORY_PURGED, ROOM_PURGED
from roomstore.events.write.batch import ClientTxn
from roomstore.storage.stats import STATS_TABLES
from roomstore.store import RoomStore, StoreConfig
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:remote.org"
CAROL = "@carol:local.org"
LOCAL = "local.org"

#: Tables the purge of a room leaves as they are, and why: shared interning
#: (a user or state key is no room's), the streams' positions and history
#: (the caches stream's rows name a room only as a key to drop), locks,
#: schema versions and compaction runs (no room in them).
NOT_ROOM_TABLES = {
    "users",
    "state_keys",
    "stream_positions",
    "cache_invalidations",
    "instances",
    "maintenance_locks",
    "embedder_schema_versions",
    "state_compaction_runs",
}


def build_room(room_id: str = "!purge:example.org", messages: int = 40) -> tuple[RoomBuilder, list, object, object]:
    """A room of three users, one local, with state changes and a redaction
    on both sides of the purge point; (builder, events, the event the purge
    point follows, the redacted state event)."""
    room = RoomBuilder(room_id=room_id)
    users = (ALICE, BOB, CAROL)
    events = [
        room.create(),
        room.join(ALICE),
        room.power_levels({ALICE: 100}),
        room.join_rules(),
        room.join(BOB),
        room.join(CAROL),
    ]
    topic = None
    for i in range(messages):
        events.append(room.message(users[i % 3], f"m{i}"))
        if i == 5:
            topic = room.state("m.room.topic", "", {"topic": "first"}, sender=ALICE)
            events.append(topic)
        if i == 7:
            events.append(room.redact(ALICE, topic.event_id))  # a redaction before the point of a state event
        if i == 9:
            events.append(room.redact(ALICE, events[-3].event_id))  # of a message that goes
        if i == messages // 2:
            point = events[-1]
        if i == messages // 2 + 3:
            events.append(room.state("m.room.topic", "", {"topic": "second"}, sender=BOB))
            events.append(room.redact(ALICE, events[-4].event_id))  # after the point, of a message that stays
    return room, events, point, topic


@on_both_engines
class PurgeHistoryTests:
    async def open_store(self, **config) -> RoomStore:
        config.setdefault("max_state_chain_length", 3)
        db = await self.make_database()
        store = await RoomStore.open(db, StoreConfig(server_name=LOCAL, **config))
        self.addCleanup(store.close)
        return store

    async def stored(self, store: RoomStore, room: RoomBuilder, events) -> None:
        await store.persist_events([room.to_persist(e) for e in events])

    async def states(self, store: RoomStore, event_ids) -> dict:
        """event ID -> (state after, state before) of the graph events among ``event_ids``."""
        flags = await store.get_event_flags(list(event_ids))
        graph = [e for e in event_ids if e in flags and not flags[e].outlier]
        after = await store.get_state_ids_for_events(graph)
        before = await store.get_state_ids_for_events(graph, before=True)
        # get_state_ids reads each event alone: what the cache-less path gives.
        for event_id in graph[:5]:
            self.assertEqual(await store.get_state_ids(event_id), after[event_id])
        return {e: (after[e], before[e]) for e in graph}

    async def orphan_groups(self, store: RoomStore, room_id: str) -> list[int]:
        """The room's groups that neither an event nor the current state uses, nor a used group's chain has
        (failing if a used group's chain reaches a group that is gone)."""

        def txn_fn(txn):
            room_nid = txn.select_one_value("SELECT room_nid FROM rooms WHERE room_id = ?", (room_id,))
            links = dict(
                txn.execute(
                    "SELECT state_group, prev_state_group FROM state_groups WHERE room_nid = ?", (room_nid,)
                ).fetchall()
            )
            used = {
                g
                for row in txn.execute(
                    "SELECT state_group_before, state_group FROM events WHERE room_nid = ?", (room_nid,)
                ).fetchall()
                for g in row
                if g is not None
            }
            used.add(txn.select_one_value("SELECT current_state_group FROM rooms WHERE room_nid = ?", (room_nid,)))
            reach = set()
            for group in used:
                while group is not None and group not in reach:
                    reach.add(group)
                    group = links.get(group)
            return sorted(set(links) - reach), sorted(reach - set(links))

        orphans, missing = await store.db.run_interaction("orphans", txn_fn)
        self.assertEqual(missing, [], "a used group (or a predecessor of one) is gone")
        return orphans

    async def test_history_keeps_every_remaining_state_and_drops_orphans(self):
        store = await self.open_store()
        room, events, point, topic = build_room()
        await self.stored(store, room, events)
        ids = [e.event_id for e in events]
        before = await self.states(store, ids)
        newest = await store.paginate(room.room_id, ALICE, None, "b", 1000)
        token = await store.get_topological_token(point.event_id)

        result = await store.purge_history(room.room_id, token)

        self.assertGreater(result.state_groups_deleted, 0)
        self.assertEqual(result.rows_deleted["state_groups"], result.state_groups_deleted)
        self.assertGreater(result.rows_deleted["events"], 0)
        self.assertEqual(result.rows_deleted["events"], result.rows_deleted["event_json"])
        after = await self.states(store, ids)
        self.assertTrue(after)
        for event_id, state in after.items():
            self.assertEqual(state, before[event_id], event_id)
        self.assertEqual(await self.orphan_groups(store, room.room_id), [])
        # Every event at or before the point left the timeline; the later ones stayed.
        position = {e.event_id: i for i, e in enumerate(events)}
        cut = position[point.event_id]
        self.assertEqual(sorted(after, key=position.get), ids[cut + 1 :])
        page = await store.paginate(room.room_id, ALICE, None, "b", 1000)
        self.assertEqual(
            [e["event_id"] for e in page.events],
            [e["event_id"] for e in newest.events if position[e["event_id"]] > cut],
        )
        self.assertEqual((await store.paginate(room.room_id, ALICE, page.next_token, "b", 10)).events, [])
        # The current state is as it was, and its events are served.
        current = await store.get_current_state_ids(room.room_id)
        self.assertEqual(len(await store.get_events(current.values())), len(current))

    async def test_what_goes_and_what_stays(self):
        store = await self.open_store()
        room, events, point, topic = build_room()
        await self.stored(store, room, events)
        cut = events.index(point)
        token = await store.get_topological_token(point.event_id)
        await store.purge_history(room.room_id, token)
        early = events[: cut + 1]
        served = await store.get_events([e.event_id for e in early])
        flags = await store.get_event_flags([e.event_id for e in early])
        for built in early:
            pdu = built.event
            kept = (
                "state_key" in pdu
                or pdu["sender"] == CAROL
                or (pdu["type"] == "m.room.redaction" and pdu["redacts"] == topic.event_id)
            )
            self.assertEqual(built.event_id in served, kept, pdu)
            if kept:
                self.assertTrue(flags[built.event_id].outlier, pdu)
        # The redaction of the topic stays: the topic is served redacted still.
        self.assertNotIn("topic", served[topic.event_id]["content"])
        # Where the remaining timeline begins, backfill would go on.
        first = events[cut + 1]
        self.assertEqual(set(await store.get_backward_extremities(room.room_id)), set(first.event["prev_events"]))

    async def test_delete_local_events(self):
        store = await self.open_store()
        room, events, point, _ = build_room()
        await self.stored(store, room, events)
        token = await store.get_topological_token(point.event_id)
        await store.purge_history(room.room_id, token, delete_local_events=True)
        carol = [
            e.event_id
            for e in events[: events.index(point) + 1]
            if e.event["sender"] == CAROL and "state_key" not in e.event
        ]
        self.assertTrue(carol)
        self.assertEqual(await store.get_events(carol), {})

    async def test_rerun_and_stream_token(self):
        store = await self.open_store()
        room, events, point, _ = build_room()
        await self.stored(store, room, events)
        stream_token = f"s{(await store.get_event_flags([point.event_id]))[point.event_id].stream_ordering}"
        first = await store.purge_history(room.room_id, stream_token)
        self.assertTrue(first.changed)
        position = store.get_current_token()
        again = await store.purge_history(room.room_id, stream_token)
        self.assertFalse(again.changed)
        self.assertEqual((again.rows_deleted, again.state_groups_deleted), ({}, 0))
        self.assertEqual(store.get_current_token(), position)
        self.assertIsNone(await store.get_event(events[7].event_id))  # bob's m1

    async def test_reads_after_purge(self):
        store = await self.open_store()
        room, events, point, _ = build_room()
        await self.stored(store, room, events)
        gone = events[7]  # a message of bob's before the point
        self.assertIsNotNone(await store.get_event(gone.event_id))  # cached now
        current = await store.get_current_state_ids(room.room_id)
        sync_before = await store.sync(ALICE, None, 5)
        recent_before = await store.recent(ALICE, 5, 5)
        await store.purge_history(room.room_id, await store.get_topological_token(point.event_id))
        self.assertIsNone(await store.get_event(gone.event_id))
        self.assertEqual(await store.get_event_flags([gone.event_id]), {})
        sync_after = await store.sync(ALICE, None, 5)
        self.assertEqual(sync_after.rooms, sync_before.rooms)
        self.assertEqual((await store.recent(ALICE, 5, 5)).rooms, recent_before.rooms)
        # The room goes on: a new event on its leaves, its state as the builder says.
        new = room.message(ALICE, "after the purge")
        await self.stored(store, room, [new])
        self.assertEqual(await store.get_state_ids(new.event_id, before=True), current)
        incremental = await store.sync(ALICE, sync_after.next_token, 5)
        self.assertIn(new.event_id, [e["event_id"] for e in incremental.rooms[room.room_id]])

    async def test_caches_stream_tells_other_processes(self):
        store = await self.open_store()
        room, events, point, _ = build_room()
        await self.stored(store, room, events)
        position = store.caches_stream.get_current_token()
        await store.purge_history(room.room_id, await store.get_topological_token(point.event_id))
        rows, _ = await store.read_caches_stream(
            store.instance_name, position, store.caches_stream.get_current_token(), 100
        )
        self.assertEqual([(name, keys) for _, name, keys, _ in rows], [(HISTORY_PURGED, [room.room_id])])

    async def test_writer_process(self):
        url = self.new_database_url()
        store = await RoomStore.open(url, StoreConfig(server_name=LOCAL, writer_process=True))
        self.addCleanup(store.close)
        room, events, point, _ = build_room()
        await self.stored(store, room, events)
        gone = events[7]
        self.assertIsNotNone(await store.get_event(gone.event_id))
        result = await store.purge_history(room.room_id, await store.get_topological_token(point.event_id))
        self.assertTrue(result.changed)
        self.assertIsNone(await store.get_event(gone.event_id))
        result = await store.purge_room(room.room_id)
        self.assertIn("rooms", result.rows_deleted)
        self.assertEqual(await store.get_room_ids(), [])


@on_both_engines
class PurgeRoomTests:
    async def open_store(self) -> RoomStore:
        db = await self.make_database()
        store = await RoomStore.open(db, StoreConfig(max_state_chain_length=3))
        self.addCleanup(store.close)
        return store

    async def room_rows(self, store: RoomStore, room_id: str) -> dict:
        """The room's nid, its events' nids (and the IDs they name), its state groups and branches."""

        def txn_fn(txn):
            room_nid = txn.select_one_value("SELECT room_nid FROM rooms WHERE room_id = ?", (room_id,))
            events = [r[0] for r in txn.execute("SELECT event_nid FROM events WHERE room_nid = ?", (room_nid,))]
            marks = ", ".join("?" for _ in events)
            named = {
                r[0]
                for r in txn.execute(
                    f"SELECT prev_event_nid FROM event_edges WHERE event_nid IN ({marks})"
                    f" UNION SELECT auth_event_nid FROM event_auth_edges WHERE event_nid IN ({marks})",
                    events * 2,
                )
            }
            groups = [r[0] for r in txn.execute("SELECT state_group FROM state_groups WHERE room_nid = ?", (room_nid,))]
            branches = [
                r[0] for r in txn.execute("SELECT branch_nid FROM visibility_branches WHERE room_nid = ?", (room_nid,))
            ]
            return {
                "room": room_nid,
                "events": events,
                "ids": sorted(named | set(events)),
                "groups": groups,
                "branches": branches,
            }

        return await store.db.run_interaction("room_rows", txn_fn)

    async def rows_left(self, store: RoomStore, room_id: str, of: dict) -> dict:
        """table -> rows of the room still there, for every table of the schema."""
        by_column = {
            "room_nid": [of["room"]],
            "event_nid": of["ids"],
            "state_group": of["groups"],
            "branch_nid": of["branches"],
            "redaction_event_nid": of["events"],
        }

        def txn_fn(txn):
            left = {}
            for table in STATS_TABLES:
                if table in NOT_ROOM_TABLES:
                    continue
                txn.execute(f"SELECT * FROM {table} LIMIT 0")
                columns = [d[0] for d in txn._cursor.description]  # the table's columns, on either engine
                count = 0
                for column, values in by_column.items():
                    if column in columns and values:
                        marks = ", ".join("?" for _ in values)
                        count += txn.select_one_value(
                            f"SELECT COUNT(*) FROM {table} WHERE {column} IN ({marks})", list(values)
                        )
                if table == "rooms":
                    count += txn.select_one_value("SELECT COUNT(*) FROM rooms WHERE room_id = ?", (room_id,))
                self.assertTrue(
                    count or any(c in columns for c in by_column) or table == "rooms",
                    f"{table}: no column to find the room's rows by",
                )
                if count:
                    left[table] = count
            return left

        return await store.db.run_interaction("rows_left", txn_fn)

    async def test_purge_room_leaves_no_row(self):
        store = await self.open_store()
        doomed, doomed_events, _, _ = build_room("!doomed:example.org")
        other, other_events, _, _ = build_room("!other:example.org", messages=12)
        to_persist = [doomed.to_persist(e) for e in doomed_events]
        # Its last message sent by a client, whose transaction goes with the room.
        to_persist[-1] = attrs.evolve(to_persist[-1], client_txn=ClientTxn(ALICE, "DEVICE", "txn1"))
        await store.persist_events(to_persist)
        await store.persist_events([other.to_persist(e) for e in other_events])
        self.assertEqual(await store.get_event_id_for_txn(ALICE, "DEVICE", "txn1"), doomed_events[-1].event_id)
        other_ids = [e.event_id for e in other_events]
        other_state = await store.get_state_ids_for_events(other_ids)
        doomed_current = await store.get_current_state_ids(doomed.room_id)
        of = await self.room_rows(store, doomed.room_id)
        self.assertTrue(await self.rows_left(store, doomed.room_id, of))

        result = await store.purge_room(doomed.room_id)

        self.assertEqual(await self.rows_left(store, doomed.room_id, of), {})
        self.assertEqual(result.rows_deleted["events"], len(doomed_events))
        self.assertEqual(result.rows_deleted["rooms"], 1)
        self.assertEqual(result.rows_deleted["client_txn_ids"], 1)
        self.assertIsNone(await store.get_event_id_for_txn(ALICE, "DEVICE", "txn1"))
        self.assertEqual(result.state_groups_deleted, len(of["groups"]))
        self.assertEqual(await store.get_room_ids(), [other.room_id])
        self.assertEqual(await store.get_event(doomed_events[-1].event_id), None)
        self.assertEqual(await store.get_current_state_ids(doomed.room_id), {})
        self.assertNotIn(doomed.room_id, await store.get_rooms_for_user(ALICE))
        self.assertEqual(await store.get_state_ids_for_events(other_ids), other_state)
        self.assertEqual(len(await store.get_events(other_ids, allow_rejected=True)), len(other_ids))
        # Again: nothing to do, nothing written.
        position = store.caches_stream.get_current_token()
        again = await store.purge_room(doomed.room_id)
        self.assertEqual((again.rows_deleted, again.changed), ({}, False))
        self.assertEqual(store.caches_stream.get_current_token(), position)
        # The room can come back, with new interned IDs.
        await store.persist_events([doomed.to_persist(e) for e in doomed_events])
        self.assertEqual(
            len(await store.get_events([e.event_id for e in doomed_events], allow_rejected=True)), len(doomed_events)
        )
        self.assertEqual(await store.get_current_state_ids(doomed.room_id), doomed_current)

    async def test_purge_while_another_room_is_written(self):
        store = await self.open_store()
        doomed, doomed_events, _, _ = build_room("!doomed:example.org")
        other, other_events, _, _ = build_room("!other:example.org", messages=60)
        await store.persist_events([doomed.to_persist(e) for e in doomed_events])
        await store.persist_events([other.to_persist(e) for e in other_events[:10]])
        of = await self.room_rows(store, doomed.room_id)
        position = store.caches_stream.get_current_token()

        async def write_other():
            for start in range(10, len(other_events), 5):
                await store.persist_events([other.to_persist(e) for e in other_events[start : start + 5]])

        results = await defer.gatherResults(
            [
                defer.ensureDeferred(write_other()),
                defer.ensureDeferred(store.purge_room(doomed.room_id)),
            ],
            consumeErrors=True,
        )
        self.assertIn("rooms", results[1].rows_deleted)
        self.assertEqual(await self.rows_left(store, doomed.room_id, of), {})
        ids = [e.event_id for e in other_events]
        self.assertEqual(len(await store.get_events(ids, allow_rejected=True)), len(ids))
        state = await store.get_state_ids_for_events(ids)
        self.assertEqual(await store.get_current_state_ids(other.room_id), state[ids[-1]])
        rows, _ = await store.read_caches_stream(
            store.instance_name, position, store.caches_stream.get_current_token(), 100
        )
        self.assertIn((ROOM_PURGED, [doomed.room_id]), [(name, keys) for _, name, keys, _ in rows])
