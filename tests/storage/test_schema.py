"""Schema creation and migrations on both engines."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from twisted.internet import defer

from roomstore.storage import SCHEMA_VERSION, Database, SchemaTooNewError
from roomstore.storage.schema import DEFAULT_SCHEMA_DIR, SCHEMA_TABLES, split_statements
from tests.db import DATABASE_ERRORS, on_both_engines

#: The schema's tables (the one list, which the architecture test checks against the schema files) and the
#: bookkeeping tables the migrations keep.
EXPECTED_TABLES = [*SCHEMA_TABLES, "schema_version", "applied_schema_deltas"]


def _version(txn):
    return txn.select_one_value("SELECT version FROM schema_version")


def _copy_schema_with_delta(delta_sql: str, engine_specific: dict[str, str] | None = None) -> str:
    """A schema dir: the real full schema plus a delta to version SCHEMA_VERSION + 1."""
    directory = tempfile.mkdtemp(prefix="roomstore-schema-")
    shutil.copytree(DEFAULT_SCHEMA_DIR / "full", Path(directory) / "full")
    delta_dir = Path(directory) / "deltas" / str(SCHEMA_VERSION + 1)
    delta_dir.mkdir(parents=True)
    (delta_dir / "01_add_things.sql").write_text(delta_sql)
    for engine, sql in (engine_specific or {}).items():
        (delta_dir / f"01_add_things.{engine}.sql").write_text(sql)
    return directory


@on_both_engines
class SchemaTests:
    async def test_fresh_database_gets_every_table(self):
        db = await self.make_database()
        self.assertEqual(await db.run_interaction("v", _version), SCHEMA_VERSION)
        for table in EXPECTED_TABLES:
            exists = await db.run_interaction("exists", lambda t, n=table: t.engine.table_exists(t._cursor, n))
            self.assertTrue(exists, table)

    async def test_prepare_twice_is_a_no_op(self):
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("mark", lambda t: t.execute("INSERT INTO users (user_id) VALUES ('@a:x')"))
        await db.close()
        again = await self.make_database(url)
        self.assertEqual(await again.prepare(), SCHEMA_VERSION)
        count = await again.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM users"))
        self.assertEqual(count, 1)

    async def test_newer_database_is_refused(self):
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction(
            "bump", lambda t: t.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 5,))
        )
        with self.assertRaises(SchemaTooNewError) as caught:
            await db.prepare()
        self.assertIn(f"version {SCHEMA_VERSION + 5}", str(caught.exception))
        self.assertIn("newer than this code", str(caught.exception))

    async def test_delta_is_applied_once(self):
        schema = _copy_schema_with_delta(
            "CREATE TABLE widgets (id BIGINT NOT NULL, blob BYTEA);\nCREATE INDEX widgets_id ON widgets (id);\n",
            {"postgres": "CREATE SEQUENCE widgets_seq;", "sqlite": "CREATE TABLE lite_only (x INTEGER);"},
        )
        self.addCleanup(shutil.rmtree, schema, True)
        url = self.new_database_url()
        db = await self.make_database(url)  # version SCHEMA_VERSION
        version = await db.run_interaction(
            "upgrade",
            __import__("roomstore.storage.schema", fromlist=["x"]).prepare_database,
            schema,
            SCHEMA_VERSION + 1,
        )
        self.assertEqual(version, SCHEMA_VERSION + 1)
        files = await db.run_interaction(
            "files",
            lambda t: [
                r[0]
                for r in t.execute(
                    "SELECT file FROM applied_schema_deltas WHERE version = ? ORDER BY file", (SCHEMA_VERSION + 1,)
                ).fetchall()
            ],
        )
        self.assertEqual(sorted(files), sorted(["01_add_things.sql", f"01_add_things.{self.engine_name}.sql"]))
        await db.run_interaction(
            "use", lambda t: t.execute("INSERT INTO widgets (id, blob) VALUES (?, ?)", (1, b"\x00\xff"))
        )
        # Running it again changes nothing.
        from roomstore.storage.schema import prepare_database

        await db.run_interaction("again", prepare_database, schema, SCHEMA_VERSION + 1)
        count = await db.run_interaction(
            "n",
            lambda t: t.select_one_value(
                "SELECT COUNT(*) FROM applied_schema_deltas WHERE version = ?", (SCHEMA_VERSION + 1,)
            ),
        )
        self.assertEqual(count, 2)

    async def test_failing_delta_leaves_database_unchanged(self):
        schema = _copy_schema_with_delta("CREATE TABLE half_done (x INTEGER);\nTHIS IS NOT SQL;\n")
        self.addCleanup(shutil.rmtree, schema, True)
        db = await self.make_database()
        from roomstore.storage.schema import prepare_database

        with self.assertRaises(DATABASE_ERRORS):
            await db.run_interaction("upgrade", prepare_database, schema, SCHEMA_VERSION + 1)
        self.assertEqual(await db.run_interaction("v", _version), SCHEMA_VERSION)
        exists = await db.run_interaction("exists", lambda t: t.engine.table_exists(t._cursor, "half_done"))
        self.assertFalse(exists)

    async def test_two_processes_starting_at_once_migrate_once(self):
        """Two pools (separate connections) prepare one fresh database at the
        same moment: one migrates, the other waits and finds nothing to do."""
        url = self.new_database_url()
        first = Database.from_url(url)
        second = Database.from_url(url)
        self.addCleanup(first.close)
        self.addCleanup(second.close)
        versions = await defer.gatherResults(
            [defer.ensureDeferred(first.prepare()), defer.ensureDeferred(second.prepare())], consumeErrors=True
        )
        self.assertEqual(versions, [SCHEMA_VERSION, SCHEMA_VERSION])
        rows = await first.run_interaction("rows", lambda t: t.select_one_value("SELECT COUNT(*) FROM schema_version"))
        self.assertEqual(rows, 1)


class SplitTests(__import__("twisted.trial.unittest", fromlist=["TestCase"]).TestCase):
    def test_split_statements(self):
        sql = (
            "-- comment; with semicolon\nCREATE TABLE a (x INT);\nCREATE TABLE b (\n  y INT -- trailing\n);  -- done\n"
        )
        self.assertEqual(split_statements(sql), ["CREATE TABLE a (x INT)", "CREATE TABLE b (\n  y INT -- trailing\n)"])
