"""Embedder schemas (``roomstore.storage.embedder_schema``) on both engines:
a homeserver's own numbered deltas, migrated with the store's."""

from __future__ import annotations

from pathlib import Path

from twisted.internet import defer
from twisted.trial import unittest

from roomstore.storage import SCHEMA_VERSION, Database, SchemaError, SchemaTooNewError
from roomstore.storage.embedder_schema import EmbedderSchema
from roomstore.store import RoomStore
from roomstore.store_config import StoreConfig
from tests.db import on_both_engines

ACCOUNTS = """
-- accounts of the homeserver; BIGSERIAL and BYTEA rewritten for SQLite
CREATE TABLE hs_accounts (
    id BIGSERIAL PRIMARY KEY,
    user_id TEXT NOT NULL UNIQUE,
    password_hash BYTEA
);
CREATE INDEX hs_accounts_user ON hs_accounts (user_id);
"""
TOKENS = "CREATE TABLE hs_tokens (token TEXT NOT NULL PRIMARY KEY, user_id TEXT NOT NULL);\n"
FILTERS = "CREATE TABLE hs_filters (user_id TEXT NOT NULL, filter_id BIGINT NOT NULL, json TEXT NOT NULL);\n"


def write_schema(root: Path, deltas: dict[str, str]) -> Path:
    """A schema directory under ``root`` holding ``{"1/01_x.sql": sql, ...}``."""
    for relative, sql in deltas.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sql, encoding="utf-8")
    return root


def _table_exists(txn, name):
    return txn.engine.table_exists(txn._cursor, name)


def _embedder_versions(txn):
    return dict(txn.execute("SELECT name, version FROM embedder_schema_versions").fetchall())


@on_both_engines
class EmbedderSchemaTests:
    def schema_dir(self, deltas: dict[str, str]) -> Path:
        return write_schema(Path(self.mktemp()), deltas)

    async def open(self, url: str, *schemas: EmbedderSchema, **config) -> RoomStore:
        store = await RoomStore.open(url, StoreConfig(embedder_schemas=schemas, **config))
        self.addCleanup(store.close)
        return store

    async def exists(self, store, table: str) -> bool:
        return await store.db.run_interaction("exists", _table_exists, table)

    async def test_fresh_install(self):
        directory = self.schema_dir(
            {
                "1/01_accounts.sql": ACCOUNTS,
                "1/02_tokens.sql": TOKENS,
                f"1/02_tokens.{self.engine_name}.sql": "CREATE INDEX hs_tokens_user ON hs_tokens (user_id);\n",
                "README.md": "not a delta",
                "notes/01_ignored.sql": "THIS IS NOT SQL;\n",
            }
        )
        url = self.new_database_url()
        store = await self.open(url, EmbedderSchema("homeserver", directory))
        self.assertEqual(store.schema_version, SCHEMA_VERSION)
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 1})
        for table in ("hs_accounts", "hs_tokens", "events", "embedder_schema_versions"):
            self.assertTrue(await self.exists(store, table), table)

        # The tables are the embedder's to use, through the store's database.
        def use(txn):
            txn.execute("INSERT INTO hs_accounts (user_id, password_hash) VALUES (?, ?)", ("@a:hs", b"\x00\xff"))
            txn.execute("INSERT INTO hs_accounts (user_id, password_hash) VALUES (?, ?)", ("@b:hs", None))
            txn.execute("INSERT INTO hs_tokens (token, user_id) VALUES (?, ?)", ("tok", "@a:hs"))
            return txn.execute(
                "SELECT a.id, a.user_id, a.password_hash FROM hs_accounts AS a"
                " JOIN hs_tokens AS t ON t.user_id = a.user_id WHERE t.token = ?",
                ("tok",),
            ).fetchall()

        [(account_id, user_id, password_hash)] = await store.db.run_interaction("use", use)
        self.assertEqual((account_id, user_id, bytes(password_hash)), (1, "@a:hs", b"\x00\xff"))

    async def test_upgrade_from_1_to_2(self):
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS, "2/01_filters.sql": FILTERS})
        url = self.new_database_url()
        store = await self.open(url, EmbedderSchema("homeserver", directory, version=1))
        self.assertFalse(await self.exists(store, "hs_filters"))
        await store.db.run_interaction(
            "add", lambda t: t.execute("INSERT INTO hs_accounts (user_id) VALUES (?)", ("@a:hs",))
        )
        await store.close()

        store = await self.open(url, EmbedderSchema("homeserver", directory))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 2})
        self.assertTrue(await self.exists(store, "hs_filters"))
        count = await store.db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM hs_accounts"))
        self.assertEqual(count, 1)
        await store.close()

        # Opening again at the same version runs nothing (a delta run twice would fail: its table exists).
        store = await self.open(url, EmbedderSchema("homeserver", directory))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 2})

    async def test_failing_delta_on_a_fresh_database_leaves_nothing(self):
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS, "1/02_broken.sql": TOKENS + "THIS IS NOT SQL;\n"})
        url = self.new_database_url()
        with self.assertRaises(SchemaError) as caught:
            await self.open(url, EmbedderSchema("homeserver", directory))
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        self.assertIn(str(directory / "1" / "02_broken.sql"), message)
        self.assertIn("'homeserver' version 1", message)
        # The store's own schema went with it: one transaction.
        db = await self.make_database(url, prepare=False)
        for table in ("schema_version", "events", "hs_accounts", "hs_tokens", "embedder_schema_versions"):
            self.assertFalse(await db.run_interaction("exists", _table_exists, table), table)

    async def test_failing_upgrade_keeps_the_version_before(self):
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS})
        url = self.new_database_url()
        await (await self.open(url, EmbedderSchema("homeserver", directory))).close()
        write_schema(directory, {"2/01_filters.sql": FILTERS, "2/02_broken.sql": "ALTER TABLE no_such ADD x INT;\n"})
        with self.assertRaises(SchemaError) as caught:
            await self.open(url, EmbedderSchema("homeserver", directory))
        self.assertIn("02_broken.sql", str(caught.exception))
        self.assertNotIn("\n", str(caught.exception))
        store = await self.open(url, EmbedderSchema("homeserver", directory, version=1))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 1})
        self.assertFalse(await self.exists(store, "hs_filters"))
        self.assertTrue(await self.exists(store, "hs_accounts"))

    async def test_newer_embedder_version_is_refused(self):
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS, "2/01_filters.sql": FILTERS})
        url = self.new_database_url()
        await (await self.open(url, EmbedderSchema("homeserver", directory))).close()
        for config in ({}, {"read_only": True}):
            with self.assertRaises(SchemaTooNewError) as caught:
                await self.open(url, EmbedderSchema("homeserver", directory, version=1), **config)
            self.assertIn(
                "embedder schema 'homeserver' is version 2 in the database, newer than this code's 1",
                str(caught.exception),
            )
        # Nothing was changed by the refusals.
        store = await self.open(url, EmbedderSchema("homeserver", directory))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 2})

    async def test_two_embedders_side_by_side(self):
        homeserver = self.schema_dir({"1/01_accounts.sql": ACCOUNTS, "2/01_tokens.sql": TOKENS})
        media = self.schema_dir({"1/01_media.sql": "CREATE TABLE media_files (media_id TEXT NOT NULL, size BIGINT);\n"})
        url = self.new_database_url()
        store = await self.open(
            url, EmbedderSchema("homeserver", homeserver, version=1), EmbedderSchema("media", media)
        )
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 1, "media": 1})
        await store.close()
        # Each moves on its own; one not named this time is left as it is.
        store = await self.open(url, EmbedderSchema("homeserver", homeserver))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 2, "media": 1})
        for table in ("hs_accounts", "hs_tokens", "media_files"):
            self.assertTrue(await self.exists(store, table), table)

    async def test_read_only_never_migrates(self):
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS})
        url = self.new_database_url()
        await (await self.open(url, EmbedderSchema("homeserver", directory))).close()
        reader = await self.open(url, EmbedderSchema("homeserver", directory), read_only=True)
        await reader.close()
        write_schema(directory, {"2/01_filters.sql": FILTERS})
        with self.assertRaises(SchemaError) as caught:
            await self.open(url, EmbedderSchema("homeserver", directory), read_only=True)
        self.assertIn("version 1 in the database, older than this code's 2", str(caught.exception))
        with self.assertRaises(SchemaError):  # never installed: version 0
            await self.open(url, EmbedderSchema("other", directory), read_only=True)
        store = await self.open(url, EmbedderSchema("homeserver", directory, version=1))
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 1})
        self.assertFalse(await self.exists(store, "hs_filters"))

    async def test_the_child_writer_migrates(self):
        # writer_process: the child opens the database as the writer and migrates
        # (the schemas go to it with the config); this process checks, read-only.
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS})
        url = self.new_database_url()
        store = await self.open(url, EmbedderSchema("homeserver", directory), writer_process=True)
        self.assertEqual(await store.db.run_interaction("v", _embedder_versions), {"homeserver": 1})
        self.assertTrue(await self.exists(store, "hs_accounts"))

    async def test_two_processes_starting_at_once_migrate_once(self):
        # Two pools on one fresh database: the store's migration lock covers the embedders' deltas too.
        directory = self.schema_dir({"1/01_accounts.sql": ACCOUNTS, "2/01_filters.sql": FILTERS})
        url = self.new_database_url()
        first, second = Database.from_url(url), Database.from_url(url)
        self.addCleanup(first.close)
        self.addCleanup(second.close)
        schemas = [EmbedderSchema("homeserver", directory)]
        versions = await defer.gatherResults(
            [defer.ensureDeferred(db.prepare(embedder_schemas=schemas)) for db in (first, second)], consumeErrors=True
        )
        self.assertEqual(versions, [SCHEMA_VERSION, SCHEMA_VERSION])
        self.assertEqual(await second.run_interaction("v", _embedder_versions), {"homeserver": 2})


class EmbedderSchemaValueTests(unittest.TestCase):
    def test_names_and_versions_checked(self):
        for name in ("", "Homeserver", "1st", "a-b", "a" * 65, None):
            with self.assertRaises(ValueError):
                EmbedderSchema(name, "/tmp")
        with self.assertRaises(ValueError):
            EmbedderSchema("hs", "/tmp", version=-1)
        with self.assertRaises(ValueError):
            StoreConfig(embedder_schemas=[EmbedderSchema("hs", "/a"), EmbedderSchema("hs", "/b")])
        with self.assertRaises(TypeError):
            StoreConfig(embedder_schemas=[("hs", "/a")])

    def test_code_version_is_the_highest_folder(self):
        directory = write_schema(Path(self.mktemp()), {"1/01_a.sql": "", "3/01_b.sql": "", "v4/x.sql": ""})
        self.assertEqual(EmbedderSchema("hs", directory).code_version(), 3)
        self.assertEqual(EmbedderSchema("hs", directory, version=2).code_version(), 2)
        self.assertEqual(sorted(EmbedderSchema("hs", directory).folders()), [1, 3])
        with self.assertRaises(SchemaError):
            EmbedderSchema("hs", Path(self.mktemp())).code_version()
        write_schema(directory, {"04/01_c.sql": ""})
        with self.assertRaises(SchemaError):
            EmbedderSchema("hs", directory).code_version()
