"""The connection pool: whole transactions, commit hooks, retries, metrics."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from twisted.internet import defer, reactor, task, threads
from twisted.trial import unittest

from roomstore.storage import DatabaseConfigError, engine_from_url
from roomstore.storage.engines import PostgresEngine, SqliteEngine, convert_placeholders
from tests.db import INTEGRITY_ERRORS, on_both_engines


class Boom(Exception):
    pass


def _create_counter(txn):
    txn.execute("CREATE TABLE counter (id INTEGER PRIMARY KEY, value INTEGER NOT NULL)")
    txn.execute("INSERT INTO counter (id, value) VALUES (1, 0)")


def _read_counter(txn):
    return txn.select_one_value("SELECT value FROM counter WHERE id = 1")


@on_both_engines
class TransactionTests:
    async def test_commit_whole(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)

        def two_writes(txn):
            txn.execute("UPDATE counter SET value = value + 1 WHERE id = ?", (1,))
            txn.execute("INSERT INTO counter (id, value) VALUES (?, ?)", (2, 7))
            return "ok"

        self.assertEqual(await db.run_interaction("two_writes", two_writes), "ok")
        rows = await db.run_interaction(
            "read", lambda txn: txn.execute("SELECT id, value FROM counter ORDER BY id").fetchall()
        )
        self.assertEqual([tuple(r) for r in rows], [(1, 1), (2, 7)])

    async def test_comments_with_apostrophes_and_question_marks(self):
        db = await self.make_database()
        row = await db.run_interaction(
            "commented",
            lambda txn: txn.execute("SELECT ? + 1, -- the caller's value? plus one\n ? * 2", (1, 4)).fetchone(),
        )
        self.assertEqual(tuple(row), (2, 8))

    async def test_exception_rolls_back_everything(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)

        def write_then_fail(txn):
            txn.execute("UPDATE counter SET value = 42 WHERE id = 1")
            txn.execute("INSERT INTO counter (id, value) VALUES (2, 2)")
            raise Boom("after two writes")

        with self.assertRaises(Boom):
            await db.run_interaction("fail", write_then_fail)
        self.assertEqual(await db.run_interaction("read", _read_counter), 0)
        count = await db.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM counter"))
        self.assertEqual(count, 1)

    async def test_ddl_rolls_back_too(self):
        db = await self.make_database()

        def create_then_fail(txn):
            txn.execute("CREATE TABLE doomed (x INTEGER)")
            raise Boom()

        with self.assertRaises(Boom):
            await db.run_interaction("ddl", create_then_fail)
        exists = await db.run_interaction("exists", lambda t: t.engine.table_exists(t._cursor, "doomed"))
        self.assertFalse(exists)

    async def test_call_after_runs_only_on_commit(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)
        seen = []

        def ok(txn):
            txn.call_after(lambda: seen.append(("committed", threading.current_thread() is threading.main_thread())))

        def bad(txn):
            txn.call_after(seen.append, "must not run")
            raise Boom()

        await db.run_interaction("ok", ok)
        with self.assertRaises(Boom):
            await db.run_interaction("bad", bad)
        # Ran once, on the reactor (main) thread.
        self.assertEqual(seen, [("committed", True)])

    async def test_undone_trial_run_leaves_the_transaction_as_it_was(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)
        seen = []

        def trial(txn, value):
            txn.queue("UPDATE counter SET value = ? WHERE id = 1", (value,))
            txn.call_after(seen.append, "trial")
            return txn.select_one_value("SELECT value FROM counter WHERE id = 1")

        def failing(txn):
            txn.execute("INSERT INTO counter (id, value) VALUES (1, 0)")  # a duplicate key: a database error

        def outer(txn):
            txn.execute("UPDATE counter SET value = 1 WHERE id = 1")
            txn.call_after(seen.append, "outer")
            seen_inside = txn.undone(trial, 5)
            with self.assertRaises(INTEGRITY_ERRORS):
                txn.undone(failing)
            # The transaction goes on, usable, with the trial's writes gone.
            return seen_inside, _read_counter(txn)

        self.assertEqual(await db.run_interaction("outer", outer), (5, 1))
        self.assertEqual(await db.run_interaction("read", _read_counter), 1)
        self.assertEqual(seen, ["outer"])

    async def test_bound_parameters_keep_quotes_and_percent(self):
        db = await self.make_database()
        nasty = "'; DROP TABLE counter; -- 100% ?"

        def roundtrip(txn):
            txn.execute("CREATE TABLE t (s TEXT)")
            txn.execute("INSERT INTO t (s) VALUES (?)", (nasty,))
            return txn.select_one_value("SELECT s FROM t WHERE s LIKE '%' || ? || '%'", ("DROP",))

        self.assertEqual(await db.run_interaction("roundtrip", roundtrip), nasty)

    async def test_insert_many(self):
        db = await self.make_database()

        def fill(txn):
            txn.execute("CREATE TABLE t (a BIGINT, b TEXT)")
            txn.insert_many("t", ("a", "b"), [(i, str(i)) for i in range(2500)])
            return txn.execute("SELECT COUNT(*), SUM(a) FROM t").fetchone()

        count, total = await db.run_interaction("fill", fill)
        self.assertEqual((count, total), (2500, sum(range(2500))))

    async def test_engine_write_paths(self):
        """Serial ids, RETURNING and table sizes go through the engine."""
        db = await self.make_database()

        def run(txn):
            txn.execute(txn.engine.translate_schema("CREATE TABLE t (id BIGSERIAL PRIMARY KEY, b TEXT UNIQUE)"))
            first = txn.allocate_ids("t", "id", 3)
            # Not inserted yet: the second reservation must not overlap the first.
            second = txn.allocate_ids("t", "id", 2)
            txn.insert_many("t", ("id", "b"), [(i, f"x{i}") for i in first + second], queue=True)
            if txn.engine.returns_inserted_rows:
                returned = txn.insert_many(
                    "t", ("b",), [("new",), (f"x{first[0]}",)], on_conflict="ON CONFLICT DO NOTHING", returning="b"
                )
            else:
                with self.assertRaises(ValueError):
                    txn.insert_many("t", ("b",), [("new",)], returning="b")
                returned = None
            rows = txn.select_one_value("SELECT COUNT(*) FROM t")
            return first, second, returned, rows, txn.engine.table_bytes(txn, "t")

        first, second, returned, rows, size = await db.run_interaction("write paths", run)
        self.assertEqual(first, sorted(first))
        self.assertEqual(len(set(first + second)), 5)
        self.assertGreater(min(second), max(first))
        if self.engine_name == "postgres":
            self.assertEqual((returned, rows), ([("new",)], 6))
        else:
            self.assertEqual((returned, rows), (None, 5))
        self.assertGreater(size, 0)

    async def test_concurrent_increments_are_not_lost(self):
        """Read-modify-write from many interactions at once: PostgreSQL's
        serialisation failures are retried, SQLite serialises; nothing is lost."""
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)

        def increment(txn):
            value = txn.select_one_value("SELECT value FROM counter WHERE id = 1")
            txn.execute("UPDATE counter SET value = ? WHERE id = 1", (value + 1,))

        await defer.gatherResults(
            [db.run_interaction_deferred("increment", increment) for _ in range(40)], consumeErrors=True
        )
        self.assertEqual(await db.run_interaction("read", _read_counter), 40)

    async def test_metrics_per_description(self):
        db = await self.make_database()
        before = (
            REGISTRY.get_sample_value("roomstore_db_transactions_total", {"desc": "metric_probe", "outcome": "commit"})
            or 0
        )
        await db.run_interaction("metric_probe", lambda txn: txn.execute("SELECT 1"))
        after = REGISTRY.get_sample_value(
            "roomstore_db_transactions_total", {"desc": "metric_probe", "outcome": "commit"}
        )
        self.assertEqual(after, before + 1)
        self.assertIsNotNone(
            REGISTRY.get_sample_value("roomstore_db_transaction_seconds_count", {"desc": "metric_probe"})
        )

    async def test_query_count(self):
        db = await self.make_database()
        before = db.query_count
        await db.run_interaction("q", lambda txn: (txn.execute("SELECT 1"), txn.execute("SELECT 2")))
        self.assertEqual(db.query_count - before, 2)

    async def test_queued_writes(self):
        """Queued writes are seen by the next statement, bind awkward values
        exactly, and an error among them rolls the whole transaction back."""
        db = await self.make_database()

        def create(txn):
            txn.execute(
                "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT, data BYTEA)"
                if self.engine_name == "postgres"
                else "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT, data BLOB)"
            )

        await db.run_interaction("create", create)
        awkward = "it's 100% \\ ; DROP TABLE notes; --"

        def write_then_read(txn):
            txn.queue("INSERT INTO notes (id, body, data) VALUES (?, ?, ?)", (1, awkward, b"\x00\xff'"))
            txn.insert_many("notes", ("id", "body", "data"), [(2, "two", b""), (3, None, b"3")], queue=True)
            txn.queue("UPDATE notes SET body = ? WHERE id = ?", ("three", 3))
            return txn.execute("SELECT id, body, data FROM notes ORDER BY id").fetchall()

        before = db.query_count
        rows = await db.run_interaction("write_then_read", write_then_read)
        self.assertEqual(db.query_count - before, 4)
        self.assertEqual(
            [(r[0], r[1], bytes(r[2])) for r in rows], [(1, awkward, b"\x00\xff'"), (2, "two", b""), (3, "three", b"3")]
        )

        def queued_at_commit(txn):
            txn.insert_many("notes", ("id", "body", "data"), [(4, "four", b"")], queue=True)

        await db.run_interaction("at_commit", queued_at_commit)
        self.assertEqual(await db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM notes")), 4)

        def duplicate_among_queued(txn):
            txn.queue("UPDATE notes SET body = ? WHERE id = ?", ("changed", 1))
            txn.insert_many("notes", ("id", "body", "data"), [(5, "five", b""), (2, "again", b"")], queue=True)

        with self.assertRaises(INTEGRITY_ERRORS):
            await db.run_interaction("duplicate", duplicate_among_queued)
        body = await db.run_interaction("body", lambda t: t.select_one_value("SELECT body FROM notes WHERE id = 1"))
        self.assertEqual(body, awkward)
        self.assertEqual(await db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM notes")), 4)
        with self.assertRaises(ValueError):
            await db.run_interaction(
                "bad", lambda t: t.insert_many("notes", ("id",), [(9,)], returning="id", queue=True)
            )

    async def test_copy_rows(self):
        """copy_rows loads awkward values exactly (COPY's delimiters, NULL, binary, booleans, big integers), after
        the writes queued before it, and a duplicate key rolls the whole transaction back."""
        db = await self.make_database()
        blob = "BYTEA" if self.engine_name == "postgres" else "BLOB"

        def create(txn):
            txn.execute(f"CREATE TABLE loaded (id BIGINT PRIMARY KEY, body TEXT, data {blob}, flag BOOLEAN)")

        await db.run_interaction("create", create)
        awkward = "tab\there\nnew line\r\\N \\ back\\slash \u00e9\U0001f600 'quote' \\."
        rows = [
            (1, awkward, b"\x00\t\n\\\xff", True),
            (2, None, None, False),
            (2**62, "", b"", None),
            (4, "\\N", b"\\N", True),
        ]

        def load(txn):
            txn.queue("INSERT INTO loaded (id, body) VALUES (?, ?)", (0, "queued first"))
            self.assertEqual(txn.copy_rows("loaded", ("id", "body", "data", "flag"), rows), 4)
            return txn.execute("SELECT id, body, data, flag FROM loaded ORDER BY id").fetchall()

        got = await db.run_interaction("load", load)
        self.assertEqual(
            [(r[0], r[1], None if r[2] is None else bytes(r[2]), None if r[3] is None else bool(r[3])) for r in got],
            [(0, "queued first", None, None), *rows[:2], rows[3], (2**62, "", b"", None)],
        )

        def duplicate(txn):
            txn.copy_rows("loaded", ("id", "body"), [(10, "new"), (1, "again")])

        with self.assertRaises(INTEGRITY_ERRORS):
            await db.run_interaction("duplicate", duplicate)
        self.assertEqual(await db.run_interaction("n", lambda t: t.select_one_value("SELECT COUNT(*) FROM loaded")), 5)
        self.assertEqual(await db.run_interaction("empty", lambda t: t.copy_rows("loaded", ("id",), [])), 0)
        if self.engine_name == "postgres":
            with self.assertRaises(ValueError):
                await db.run_interaction("nul", lambda t: t.copy_rows("loaded", ("id", "body"), [(20, "a\0b")]))

    async def test_copy_rows_of_every_column_type(self):
        """PostgreSQL loads rows in COPY's binary format where each column's
        type allows (integers of each width, booleans, text, bytea), in text
        where a column's type does not (numeric here) or a value is not
        plainly of its column's type (an int for a boolean, a string for an
        integer: text COPY reads them as the values they spell): either way
        the rows read back are those ``insert_many`` stores."""
        db = await self.make_database()
        blob = "BYTEA" if self.engine_name == "postgres" else "BLOB"
        columns = ("big", "mid", "small", "flag", "body", "data")

        def create(txn):
            for table in ("copied", "inserted"):
                txn.execute(
                    f"CREATE TABLE {table} (big BIGINT PRIMARY KEY, mid INTEGER, small SMALLINT, flag BOOLEAN,"
                    f" body TEXT, data {blob}, amount NUMERIC)"
                )

        await db.run_interaction("create", create)
        rows = [
            (-(2**63), -(2**31), -(2**15), False, "\u00e9\U0001f600\t\\", b"\x00\xff"),
            (2**63 - 1, 2**31 - 1, 2**15 - 1, True, "", b""),
            (3, None, None, None, None, None),
        ]
        loose = [(4, 5, 6, 1, "x", b"y"), (5, "7", 8, True, "z", bytearray(b"w"))]
        # As text COPY reads them (and SQLite stores them).
        read = [(4, 5, 6, True, "x", b"y"), (5, 7, 8, True, "z", b"w")]

        def load(txn):
            txn.copy_rows("copied", columns, rows)
            txn.copy_rows("copied", columns, loose)
            txn.copy_rows("copied", ("big", "amount"), [(6, 1)])
            txn.insert_many("inserted", columns, [*rows, *read])
            txn.insert_many("inserted", ("big", "amount"), [(6, 1)])
            return [
                [
                    tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                    for row in txn.execute(
                        f"SELECT big, mid, small, flag, body, data, amount FROM {table} ORDER BY big"
                    ).fetchall()
                ]
                for table in ("copied", "inserted")
            ]

        copied, inserted = await db.run_interaction("load", load)
        self.assertEqual(copied, inserted)
        self.assertEqual(len(copied), 6)
        if self.engine_name == "postgres":
            kinds = db.engine._copy_kinds
            self.assertIsNotNone(kinds[("copied", columns)])
            self.assertIsNone(kinds[("copied", ("big", "amount"))])

    async def test_close_waits_for_running_interactions(self):
        """close() during a transaction lets it commit, then refuses new ones
        (it used to close the connection under the running transaction)."""
        url = self.new_database_url()
        db = await self.make_database(url)
        await db.run_interaction("create", _create_counter)
        started, release = threading.Event(), threading.Event()
        attempts = []

        def slow_write(txn):
            attempts.append(1)
            txn.execute("UPDATE counter SET value = 5 WHERE id = 1")
            started.set()
            release.wait(10)
            txn.execute("UPDATE counter SET value = value + 1 WHERE id = 1")
            return "committed"

        running = db.run_interaction_deferred("slow", slow_write)
        await threads.deferToThread(started.wait, 10)
        closing = defer.ensureDeferred(db.close())
        self.assertTrue(db.closed)
        self.assertFalse(closing.called)
        with self.assertRaises(RuntimeError):
            await db.run_interaction("late", _read_counter)
        # Time for a close that does not wait to reach the connection.
        await task.deferLater(reactor, 0.3, lambda: None)
        self.assertFalse(closing.called)
        release.set()
        self.assertEqual(await running, "committed")
        await closing
        self.assertEqual(len(attempts), 1, "the transaction lost its connection and was retried")
        reopened = await self.make_database(url)
        self.assertEqual(await reopened.run_interaction("read", _read_counter), 6)


class PostgresSessionSettingsTests(unittest.TestCase):
    """Pool connections run with JIT off (short OLTP statements: compiling a
    timeline page once cost 60-260 ms), keeping the URL's own options."""

    async def test_jit_off_and_url_options_kept(self):
        from urllib.parse import quote

        from tests.db import DatabaseTestMixin

        helper = type("H", (DatabaseTestMixin,), {"engine_name": "postgres"})()
        helper.addCleanup = self.addCleanup
        helper.fail = self.fail
        url = helper.new_database_url()
        db = await helper.make_database(url)

        def settings(txn):
            return [txn.execute(f"SHOW {name}").fetchone()[0] for name in ("jit", "statement_timeout")]

        self.assertEqual((await db.run_interaction("show", settings))[0], "off")
        # Options in the URL still apply, after ours (so they may even turn JIT back on).
        options = quote("-c statement_timeout=4321 -c jit=on")
        with_options = await helper.make_database(f"{url}{'&' if '?' in url else '?'}options={options}", prepare=False)
        self.assertEqual(await with_options.run_interaction("show", settings), ["on", "4321ms"])


class PostgresDeferredBeginTests(unittest.TestCase):
    """Pool connections send BEGIN in the same message as the transaction's
    first statement (one round trip less per transaction), and transactions
    stay what they were: repeatable read, whole or nothing, whatever kind of
    statement comes first."""

    async def make_database(self):
        from tests.db import DatabaseTestMixin

        helper = type("H", (DatabaseTestMixin,), {"engine_name": "postgres"})()
        helper.addCleanup = self.addCleanup
        helper.fail = self.fail
        return await helper.make_database()

    async def test_begin_travels_with_the_first_statement(self):
        db = await self.make_database()
        observer = db.engine.session_connection("deferred-begin-test")
        self.addCleanup(observer.close)

        def first_statement(txn):
            pid = txn.select_one_value("SELECT pg_backend_pid()")
            with observer.cursor() as cur:
                # What the server last received from this backend, as one message.
                cur.execute("SELECT query, state FROM pg_stat_activity WHERE pid = %s", (pid,))
                seen = cur.fetchone()
            isolation = txn.select_one_value("SHOW transaction_isolation")
            return seen, isolation

        (query, state), isolation = await db.run_interaction("first", first_statement)
        self.assertEqual(query, "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT pg_backend_pid()")
        self.assertEqual(state, "idle in transaction")
        self.assertEqual(isolation, "repeatable read")

    async def test_snapshot_holds_against_a_concurrent_commit(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)
        other = db.engine.session_connection("deferred-begin-test")
        self.addCleanup(other.close)

        def read_twice(txn):
            before = _read_counter(txn)
            with other.cursor() as cur:
                cur.execute("UPDATE counter SET value = 99 WHERE id = 1")  # autocommit: committed now
            return before, _read_counter(txn)

        self.assertEqual(await db.run_interaction("read twice", read_twice), (0, 0))
        self.assertEqual(await db.run_interaction("read", _read_counter), 99)

    async def test_every_kind_of_first_statement_rolls_back(self):
        db = await self.make_database()
        await db.run_interaction("create", _create_counter)
        firsts = {
            "execute": lambda txn: txn.execute("INSERT INTO counter (id, value) VALUES (?, ?)", (2, 2)),
            "executemany": lambda txn: txn.executemany("INSERT INTO counter (id, value) VALUES (?, ?)", [(2, 2)]),
            "queued": lambda txn: txn.insert_many("counter", ("id", "value"), [(2, 2)], queue=True),
            "copy": lambda txn: txn.engine.bulk_insert(txn._cursor, "counter", "id, value", [(2, 2)]),
        }
        for name, first in firsts.items():

            def write_then_fail(txn, first=first):
                first(txn)
                txn.execute("UPDATE counter SET value = 5 WHERE id = 1")
                raise Boom(name)

            with self.assertRaises(Boom):
                await db.run_interaction(name, write_then_fail)
            count = await db.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM counter"))
            self.assertEqual((name, count, await db.run_interaction("read", _read_counter)), (name, 1, 0))

            def write(txn, first=first):
                first(txn)

            await db.run_interaction(name, write)
            count = await db.run_interaction("count", lambda t: t.select_one_value("SELECT COUNT(*) FROM counter"))
            self.assertEqual((name, count), (name, 2))
            await db.run_interaction("reset", lambda t: t.execute("DELETE FROM counter WHERE id = 2"))

    async def test_a_transaction_without_statements_sends_nothing(self):
        db = await self.make_database()
        self.assertEqual(await db.run_interaction("nothing", lambda txn: "done"), "done")
        self.assertEqual(await db.run_interaction("then", lambda t: t.select_one_value("SELECT 1")), 1)


class PostgresRetryTests(unittest.TestCase):
    """A serialisation failure is retried: forced with two transactions that
    both read a row before either updates it."""

    async def test_serialization_failure_is_retried(self):
        from tests.db import DatabaseTestMixin

        helper = type("H", (DatabaseTestMixin,), {"engine_name": "postgres"})()
        helper.addCleanup = self.addCleanup
        helper.fail = self.fail
        db = await helper.make_database()
        await db.run_interaction("create", _create_counter)
        barrier = threading.Barrier(2, timeout=10)
        attempts = []

        def increment(txn):
            attempts.append(1)
            value = txn.select_one_value("SELECT value FROM counter WHERE id = 1")
            if len(attempts) <= 2:
                barrier.wait()  # both first attempts have read the old value
            txn.execute("UPDATE counter SET value = ? WHERE id = 1", (value + 1,))

        retries_before = (
            REGISTRY.get_sample_value("roomstore_db_transaction_retries_total", {"desc": "racing_increment"}) or 0
        )
        await defer.gatherResults(
            [db.run_interaction_deferred("racing_increment", increment) for _ in range(2)], consumeErrors=True
        )
        self.assertEqual(await db.run_interaction("read", _read_counter), 2)
        self.assertGreaterEqual(len(attempts), 3)
        retries_after = REGISTRY.get_sample_value(
            "roomstore_db_transaction_retries_total", {"desc": "racing_increment"}
        )
        self.assertGreaterEqual(retries_after - retries_before, 1)


class ShutdownTests(unittest.TestCase):
    def test_process_exits_without_close(self):
        """Stopping the reactor stops the pool's threads, close() or not."""
        import shutil
        import subprocess
        import sys
        import tempfile

        directory = tempfile.mkdtemp(prefix="roomstore-test-")
        self.addCleanup(shutil.rmtree, directory, True)
        script = (
            "import sys\n"
            "from twisted.internet import defer, task\n"
            "from roomstore.storage import Database\n"
            "async def main(reactor):\n"
            f"    db = Database.from_url('sqlite:///{directory}/x.db')\n"
            "    await db.prepare()\n"
            "task.react(lambda r: defer.ensureDeferred(main(r)))\n"
        )
        result = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
        self.assertEqual(result.returncode, 0, result.stderr.decode())


class UrlTests(unittest.TestCase):
    def test_sqlite_urls(self):
        engine = engine_from_url("sqlite:///relative/dir/store.db")
        self.assertIsInstance(engine, SqliteEngine)
        self.assertEqual(engine.path, "relative/dir/store.db")
        self.assertEqual(engine_from_url("sqlite:////abs/store.db").path, "/abs/store.db")
        self.assertEqual(engine_from_url("sqlite:///x.db?synchronous=normal").synchronous, "NORMAL")

    def test_postgres_urls(self):
        engine = engine_from_url("postgresql://alice@db.example:5433/rooms?cp_max=3&sslmode=disable")
        self.assertIsInstance(engine, PostgresEngine)
        self.assertEqual(engine.max_connections, 3)
        self.assertNotIn("cp_max", engine.dsn)
        self.assertIn("sslmode=disable", engine.dsn)
        self.assertEqual(engine.max_prepared, 64)
        engine = engine_from_url("postgresql://alice@db.example/rooms?max_prepared=0&sslmode=disable")
        self.assertEqual(engine.max_prepared, 0)
        self.assertNotIn("max_prepared", engine.dsn)

    def test_bad_urls_are_clear_errors(self):
        for url in (
            "",
            "store.db",
            "mysql://x/y",
            "sqlite://",
            "sqlite:///",
            "postgresql://host:5432/",
            "postgresql://h/db?cp_max=zero",
            "postgresql://h/db?max_prepared=-1",
            "postgresql://h/db?max_prepared=many",
            "sqlite:///x.db?synchronous=sometimes",
        ):
            with self.assertRaises(DatabaseConfigError, msg=url):
                engine_from_url(url)

    def test_placeholder_conversion(self):
        self.assertEqual(convert_placeholders("SELECT ? WHERE a LIKE '%?%'"), "SELECT %s WHERE a LIKE '%%?%%'")
        self.assertEqual(convert_placeholders("SELECT 5 % 2, ?"), "SELECT 5 %% 2, %s")
        # A comment is no literal: its apostrophe opens no quote, its ? is no
        # placeholder, its % is still escaped for psycopg2.
        self.assertEqual(
            convert_placeholders("SELECT ? -- the token's end? 5%\nFROM t WHERE x = ?"),
            "SELECT %s -- the token's end? 5%%\nFROM t WHERE x = %s",
        )
        self.assertEqual(convert_placeholders("SELECT '--', ?"), "SELECT '--', %s")
