"""Schema version 11: on SQLite the tables written for every event keep
each row once (``events`` and ``event_json`` by their nid as the rowid, the
edges WITHOUT ROWID). A database written at version 10 upgrades with every
row and every read the same; PostgreSQL's tables are left as they were."""

from __future__ import annotations

from roomstore.storage import schema as schema_module
from roomstore.store import RoomStore
from tests.db import on_both_engines
from tests.store.builder import RoomBuilder

ALICE = "@alice:example.org"
BOB = "@bob:example.org"
TABLES = {
    "events": "event_nid",
    "event_json": "event_nid",
    "event_edges": "event_nid, prev_event_nid",
    "event_auth_edges": "event_nid, auth_event_nid",
}


def a_room() -> tuple[RoomBuilder, list]:
    room = RoomBuilder()
    built = [room.create(), room.join(ALICE), room.join_rules("public"), room.join(BOB)]
    for i in range(40):
        built.append(room.message((ALICE, BOB)[i % 2], f"message {i}"))
        if i % 9 == 4:
            built.append(room.state("m.room.topic", "", {"topic": f"topic {i}"}, ALICE))
    built.append(room.redact(ALICE, built[-1].event_id))
    built.append(room.member(BOB, "leave"))
    built.append(room.message(ALICE, "after bob left"))
    return room, built


def layout(txn):
    """(table -> its SQL, the key columns of events and event_json) on SQLite; None elsewhere."""
    if txn.engine.name != "sqlite":
        return None
    tables = dict(txn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
    rowid_keys = {
        table: [(name, kind, pk) for _, name, kind, _, _, pk in txn.execute(f"PRAGMA table_info({table})")]
        for table in ("events", "event_json")
    }
    return tables, rowid_keys


@on_both_engines
class RowidKeysTests:
    async def reads(self, store: RoomStore, room: RoomBuilder, built: list) -> dict:
        page = await store.paginate(room.room_id, BOB, None, "b", 100)
        return {
            "states": [await store.get_state_ids(b.event_id) for b in built],
            "current": await store.get_current_state_ids(room.room_id),
            "page": [e["event_id"] for e in page.events],
            "bytes": [await store.get_event_json_bytes(b.event_id) for b in built],
            "flags": await store.get_event_flags([b.event_id for b in built]),
        }

    async def rows(self, store: RoomStore) -> dict:
        def read(txn):
            return {
                table: txn.execute(f"SELECT * FROM {table} ORDER BY {key}").fetchall() for table, key in TABLES.items()
            }

        return await store.db.run_interaction("rows", read)

    async def test_a_version_10_database_upgrades_with_every_row_and_read_the_same(self):
        url = self.new_database_url()
        room, built = a_room()
        original = schema_module.SCHEMA_VERSION
        schema_module.SCHEMA_VERSION = 10
        try:
            old = await RoomStore.open(url)
            await old.persist_events([room.to_persist(b) for b in built])
            self.assertEqual(await old.db.run_interaction("v", schema_module.check_schema_txn), 10)
            before, rows_before = await self.reads(old, room, built), await self.rows(old)
            old_layout = await old.db.run_interaction("layout", layout)
            await old.close()
        finally:
            schema_module.SCHEMA_VERSION = original

        store = await RoomStore.open(url)
        self.addCleanup(store.close)
        self.assertEqual(await store.db.run_interaction("v", schema_module.check_schema_txn), original)
        self.assertEqual(await self.reads(store, room, built), before)
        self.assertEqual(await self.rows(store), rows_before)
        self.assertEqual(len(rows_before["events"]), len(built))
        # And it goes on writing.
        more = room.message(ALICE, "written after the upgrade")
        (result,) = await store.persist_events([room.to_persist(more)])
        self.assertEqual(result.stream_ordering, len(built) + 1)
        self.assertEqual(await store.get_state_ids(more.event_id), before["current"])

        found = await store.db.run_interaction("layout", layout)
        if found is None:  # PostgreSQL: version 11 changes nothing there
            return
        tables, rowid_keys = found
        self.assertNotIn("WITHOUT ROWID", old_layout[0]["event_auth_edges"])  # as version 10 made it
        for table in ("event_edges", "event_auth_edges"):
            self.assertIn("WITHOUT ROWID", tables[table])
        for table in ("events", "event_json"):
            self.assertIn(("event_nid", "INTEGER", 1), rowid_keys[table])
        for table in TABLES:
            self.assertNotIn(f"{table}_by_", " ".join(tables))
