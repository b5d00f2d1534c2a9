"""``txn.execute(sql, args, prepare=True)``: server-side prepared statements
on PostgreSQL (a plain execute on SQLite), checked on the real server."""

from __future__ import annotations

import psycopg2
from prometheus_client import REGISTRY
from twisted.trial import unittest

from roomstore.storage.engines import convert_placeholders
from tests.db import DATABASE_ERRORS, DatabaseTestMixin, on_both_engines


class Boom(Exception):
    pass


def _create(txn):
    txn.execute("CREATE TABLE things (id BIGINT PRIMARY KEY, name TEXT NOT NULL, flag BOOLEAN NOT NULL)")
    txn.insert_many("things", ("id", "name", "flag"), [(1, "a%b", True), (2, "it's ?", False), (3, "c", True)])


# Every parameter stands where the server can infer its type: bigint, text,
# boolean, a list of bigint, LIMIT; a literal '%' and '?' are no placeholders.
_SELECT = (
    "SELECT id, name, flag, name LIKE '%?%' FROM things"
    " WHERE id >= ? AND name <> ? AND flag = ? AND id IN (?, ?, ?) -- it's a comment?\n"
    " ORDER BY id LIMIT ?"
)


def _both_ways(txn, args):
    return (
        txn.execute(_SELECT, args).fetchall(),
        txn.execute(_SELECT, args, prepare=True).fetchall(),
    )


def _prepared_names(txn):
    return sorted(r[0] for r in txn.execute("SELECT name FROM pg_prepared_statements").fetchall())


@on_both_engines
class PreparedResultsTests:
    async def test_same_rows_as_a_plain_execute(self):
        db = await self.make_database()
        await db.run_interaction("create", _create)
        cases = [
            (1, "zzz", True, 1, 3, 2, 10),
            (2, "c", True, 1, 3, 3, 10),
            (1, "it's ?", False, 2, 2, 2, 1),
            (0, "", True, 1, 3, 2, 1),
        ]
        # Past five executions, where PostgreSQL may switch to a generic plan.
        for round_ in range(3):
            for args in cases:
                plain, prepared = await db.run_interaction("both", _both_ways, args)
                self.assertEqual(prepared, plain, (round_, args))
        plain, prepared = await db.run_interaction("both", _both_ways, (1, "zzz", True, 1, 3, 2, 10))
        self.assertEqual(prepared, [(1, "a%b", True, False), (3, "c", True, False)])

    async def test_one_statement_counted(self):
        db = await self.make_database()
        await db.run_interaction("create", _create)
        before = db.query_count
        await db.run_interaction(
            "read", lambda txn: txn.execute("SELECT name FROM things WHERE id = ?", (1,), prepare=True)
        )
        self.assertEqual(db.query_count - before, 1)

    async def test_errors_reach_the_caller_and_the_transaction_rolls_back(self):
        db = await self.make_database()
        await db.run_interaction("create", _create)

        def bad(txn):
            txn.execute("INSERT INTO things (id, name, flag) VALUES (?, ?, ?)", (9, "new", True))
            txn.execute("SELECT nosuch FROM things WHERE id = ?", (1,), prepare=True)

        with self.assertRaises(DATABASE_ERRORS):
            await db.run_interaction("bad", bad)
        count = await db.run_interaction("count", lambda txn: txn.select_one_value("SELECT COUNT(*) FROM things"))
        self.assertEqual(count, 3)


class PostgresPreparedTests(unittest.TestCase):
    """What the server holds, per connection, through rollbacks, failures,
    reconnections and a schema change made by another process."""

    async def database(self, max_prepared=None):
        helper = type("H", (DatabaseTestMixin,), {"engine_name": "postgres"})()
        helper.addCleanup = self.addCleanup
        helper.fail = self.fail
        url = helper.new_database_url()
        self.url = url
        # One connection, so every interaction sees the same server session.
        db = await helper.make_database(f"{url}?cp_max=1")
        if max_prepared is not None:
            db.engine.max_prepared = max_prepared
        await db.run_interaction("create", _create)
        return db

    def read(self, db, sql, args=(), fail=None):
        def run(txn):
            rows = txn.execute(sql, args, prepare=True).fetchall()
            if fail is not None:
                raise fail
            return rows

        return db.run_interaction("read", run)

    async def test_prepared_once_named_by_the_sql(self):
        db = await self.database()
        sql = "SELECT name FROM things WHERE id = ?"
        for _ in range(3):
            self.assertEqual(await self.read(db, sql, (1,)), [("a%b",)])
        names = await db.run_interaction("names", _prepared_names)
        self.assertEqual(len(names), 1)
        self.assertTrue(names[0].startswith("rs_"))
        statement = await db.run_interaction(
            "text", lambda txn: txn.select_one_value("SELECT statement FROM pg_prepared_statements")
        )
        self.assertIn("WHERE id = $1", statement)

    async def test_bounded_least_recently_used_deallocated(self):
        db = await self.database(max_prepared=3)
        sqls = [f"SELECT name FROM things WHERE id = ? AND {n} = {n}" for n in range(5)]
        for sql in sqls[:3]:
            await self.read(db, sql, (1,))
        await self.read(db, sqls[0], (1,))  # now the most recently used
        await self.read(db, sqls[3], (1,))  # evicts sqls[1]
        await self.read(db, sqls[4], (1,))  # evicts sqls[2]
        statements = await db.run_interaction(
            "texts", lambda txn: txn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
        )
        held = sorted(r[0].split(" AS ", 1)[1] for r in statements)
        self.assertEqual(held, sorted(convert_placeholders(sqls[i], numbered=True) for i in (0, 3, 4)))
        for sql in sqls:  # all still run, the evicted ones prepared again
            self.assertEqual(await self.read(db, sql, (2,)), [("it's ?",)])

    async def test_prepared_in_a_transaction_that_rolls_back(self):
        # PREPARE is not transactional: the statement outlives the rollback,
        # and the memory of it must say so (else: "already exists").
        db = await self.database()
        sql = "SELECT name FROM things WHERE id = ?"
        with self.assertRaises(Boom):
            await self.read(db, sql, (1,), fail=Boom())
        self.assertEqual(len(await db.run_interaction("names", _prepared_names)), 1)
        self.assertEqual(await self.read(db, sql, (3,)), [("c",)])

    async def test_failed_prepare_leaves_nothing(self):
        # A PREPARE the server refused does not exist; the next attempt prepares it.
        db = await self.database()

        def bad(txn):
            txn.execute("SELECT name FROM things WHERE id = ? AND broken = 1", (1,), prepare=True)

        with self.assertRaises(psycopg2.errors.UndefinedColumn):
            await db.run_interaction("bad", bad)
        await db.run_interaction("alter", lambda txn: txn.execute("ALTER TABLE things ADD COLUMN broken INT DEFAULT 1"))
        self.assertEqual(await self.read(db, "SELECT name FROM things WHERE id = ? AND broken = 1", (1,)), [("a%b",)])

    async def test_execute_failing_after_prepare_keeps_the_statement(self):
        # The EXECUTE fails (division by zero), not the PREPARE: the
        # statement exists afterwards and is reused, not prepared twice.
        db = await self.database()
        sql = "SELECT 10 / (id - ?) FROM things WHERE id = ?"
        with self.assertRaises(psycopg2.errors.DivisionByZero):
            await self.read(db, sql, (1, 1))
        self.assertEqual(await self.read(db, sql, (0, 2)), [(5,)])
        self.assertEqual(len(await db.run_interaction("names", _prepared_names)), 1)

    async def test_new_connection_starts_empty(self):
        db = await self.database()
        sql = "SELECT name FROM things WHERE id = ?"
        await self.read(db, sql, (1,))
        first = await db.run_interaction("pid", lambda txn: txn.select_one_value("SELECT pg_backend_pid()"))
        await db.run_blocking(db._drop_connection)
        self.assertEqual(await self.read(db, sql, (3,)), [("c",)])
        second = await db.run_interaction("pid", lambda txn: txn.select_one_value("SELECT pg_backend_pid()"))
        self.assertNotEqual(first, second)
        self.assertEqual(len(await db.run_interaction("names", _prepared_names)), 1)

    async def test_server_closed_connection_reconnects_and_prepares_again(self):
        db = await self.database()
        sql = "SELECT name FROM things WHERE id = ?"
        await self.read(db, sql, (1,))
        pid = await db.run_interaction("pid", lambda txn: txn.select_one_value("SELECT pg_backend_pid()"))
        admin = psycopg2.connect(self.url)
        admin.autocommit = True
        self.addCleanup(admin.close)
        admin.cursor().execute("SELECT pg_terminate_backend(%s)", (pid,))
        self.assertEqual(await self.read(db, sql, (2,)), [("it's ?",)])

    async def test_table_altered_by_another_process_after_prepare(self):
        # "cached plan must not change result type": the transaction is
        # retried, the stale statement deallocated and prepared anew.
        db = await self.database()
        sql = "SELECT * FROM things WHERE id = ?"
        self.assertEqual(await self.read(db, sql, (1,)), [(1, "a%b", True)])
        other = psycopg2.connect(self.url)
        other.autocommit = True
        self.addCleanup(other.close)
        other.cursor().execute("ALTER TABLE things ADD COLUMN extra INT DEFAULT 7")
        retries = REGISTRY.get_sample_value("roomstore_db_transaction_retries_total", {"desc": "read"}) or 0
        self.assertEqual(await self.read(db, sql, (1,)), [(1, "a%b", True, 7)])
        after = REGISTRY.get_sample_value("roomstore_db_transaction_retries_total", {"desc": "read"})
        self.assertEqual(after - retries, 1)
        self.assertEqual(len(await db.run_interaction("names", _prepared_names)), 1)

    async def test_a_parameter_without_context_comes_back_as_text(self):
        # The limit Transaction.execute's docstring states: the server types
        # a bare parameter as text, where a plain execute's literal is a number.
        db = await self.database()
        self.assertEqual(await self.read(db, "SELECT ?, ? + 1 FROM things WHERE id = ?", (5, 5, 1)), [("5", 6)])

    async def test_none_kept_when_the_url_says_max_prepared_0(self):
        # For a pooler that gives each transaction another server session
        # (pgbouncer's transaction mode), where a prepared statement is lost.
        helper = type("H", (DatabaseTestMixin,), {"engine_name": "postgres"})()
        helper.addCleanup = self.addCleanup
        helper.fail = self.fail
        db = await helper.make_database(f"{helper.new_database_url()}?cp_max=1&max_prepared=0")
        self.assertEqual(db.engine.max_prepared, 0)
        await db.run_interaction("create", _create)
        for _ in range(3):
            self.assertEqual(await self.read(db, "SELECT name FROM things WHERE id = ?", (3,)), [("c",)])
        self.assertEqual(await db.run_interaction("names", _prepared_names), [])
