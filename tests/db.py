"""Run the same database test cases on SQLite and on a real PostgreSQL server.

Decorate a mixin class with ``@on_both_engines``: it becomes two trial test
cases, ``<Name>_sqlite`` and ``<Name>_postgres``, with ``self.engine_name``
set. ``await self.make_database()`` gives a prepared ``Database`` on a fresh,
empty database of that engine (a new file, or a new PostgreSQL database),
closed and dropped after the test.

PostgreSQL comes from ``ROOMSTORE_TEST_POSTGRES`` (an admin URL such as
``postgresql://postgres@127.0.0.1:5432/postgres``). Without it the PostgreSQL
cases are skipped with a reason, unless ``ROOMSTORE_REQUIRE_POSTGRES=1`` (set
by the test command and CI), in which case they fail: CI must never pass with
PostgreSQL silently left out.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import sys
import tempfile
import urllib.parse

import psycopg2
from twisted.trial import unittest

from roomstore.storage import Database

POSTGRES_ADMIN_URL = os.environ.get("ROOMSTORE_TEST_POSTGRES", "")
REQUIRE_POSTGRES = os.environ.get("ROOMSTORE_REQUIRE_POSTGRES") == "1"
ENGINES = ("sqlite", "postgres")
#: What a refused write raises on either engine (a duplicate key, a broken constraint).
INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg2.IntegrityError)
#: What any statement the database refuses raises on either engine (syntax, unknown column, constraint).
DATABASE_ERRORS = (sqlite3.DatabaseError, psycopg2.DatabaseError)

_counter = itertools.count()


def postgres_available() -> bool:
    return bool(POSTGRES_ADMIN_URL)


def pg_connect(url: str, **kwargs):
    """A psycopg2 connection to ``url`` in autocommit (keyword arguments to
    ``psycopg2.connect``, e.g. ``application_name``)."""
    import psycopg2

    conn = psycopg2.connect(url, **kwargs)
    conn.autocommit = True
    return conn


def pg_query(url: str, sql: str, args: tuple = ()) -> list:
    """One statement on its own autocommit connection to ``url``: its rows ([] when it returns none)."""
    conn = pg_connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def pg_admin(sql: str, args: tuple = ()) -> list:
    """:func:`pg_query` as the test server's administrator (``ROOMSTORE_TEST_POSTGRES``)."""
    return pg_query(POSTGRES_ADMIN_URL, sql, args)


def _admin_connect():
    return pg_connect(POSTGRES_ADMIN_URL)


def create_postgres_database(template: str = "template0") -> str:
    """Create a PostgreSQL database, a copy of ``template`` (default: empty); returns its URL."""
    name = f"rs_test_{os.getpid()}_{next(_counter)}"
    conn = _admin_connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        conn.close()
    parsed = urllib.parse.urlsplit(POSTGRES_ADMIN_URL)
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, "/" + name, parsed.query, ""))


def drop_postgres_database(url: str) -> None:
    name = urllib.parse.urlsplit(url).path.lstrip("/")
    conn = _admin_connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        conn.close()


class DatabaseTestMixin:
    """Helpers for test cases that need a database; see the module docstring."""

    engine_name: str = "sqlite"

    def new_database_url(self) -> str:
        """A URL naming a fresh, empty database of this test's engine."""
        if self.engine_name == "sqlite":
            directory = tempfile.mkdtemp(prefix="roomstore-test-")
            self.addCleanup(_rmtree, directory)
            return f"sqlite:///{directory}/test.db"
        if not postgres_available():
            if REQUIRE_POSTGRES:
                self.fail("ROOMSTORE_REQUIRE_POSTGRES=1 but ROOMSTORE_TEST_POSTGRES is not set")
            raise unittest.SkipTest("no PostgreSQL: set ROOMSTORE_TEST_POSTGRES (bin/test does)")
        url = create_postgres_database()
        self.addCleanup(drop_postgres_database, url)
        return url

    async def make_database(self, url: str | None = None, prepare: bool = True, reactor=None) -> Database:
        """A ``Database`` on ``url`` (default: a fresh one), closed after the test."""
        db = Database.from_url(url or self.new_database_url(), reactor)
        self.addCleanup(db.close)
        if prepare:
            await db.prepare()
        return db

    async def open_store(self, **open_kw):
        """A ``RoomStore`` on a fresh database of this engine
        (``RoomStore.open``'s keyword arguments), closed after the test."""
        from roomstore.store import RoomStore

        store = await RoomStore.open(await self.make_database(), **open_kw)
        self.addCleanup(store.close)
        return store


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def on_both_engines(cls):
    """Turn a mixin of test methods into one trial TestCase per engine."""
    module = sys.modules[cls.__module__]
    bases = (cls, DatabaseTestMixin, unittest.TestCase)
    for engine in ENGINES:
        name = f"{cls.__name__}_{engine}"
        attrs = {"engine_name": engine, "__module__": cls.__module__, "__qualname__": name}
        if engine == "postgres" and not postgres_available() and not REQUIRE_POSTGRES:
            attrs["skip"] = "no PostgreSQL: set ROOMSTORE_TEST_POSTGRES (bin/test does)"
        setattr(module, name, type(name, bases, attrs))
    return cls


#: Groups whose copy of a one-row delta (``state_groups.sole_*``, schema
#: version 6) disagrees with their rows in ``state_group_deltas``: set when
#: the group has not exactly that one row, or unset when it has exactly one.
SOLE_DELTA_MISMATCHES_SQL = """
SELECT g.state_group FROM state_groups AS g
LEFT JOIN (SELECT state_group, COUNT(*) AS n, MAX(type_key_nid) AS k, MAX(event_nid) AS e
           FROM state_group_deltas GROUP BY state_group) AS d ON d.state_group = g.state_group
WHERE (COALESCE(d.n, 0) = 1 AND (g.sole_type_key_nid IS NULL OR g.sole_type_key_nid <> d.k
                                  OR COALESCE(g.sole_event_nid, -1) <> COALESCE(d.e, -1)))
   OR (COALESCE(d.n, 0) <> 1 AND (g.sole_type_key_nid IS NOT NULL OR g.sole_event_nid IS NOT NULL))
ORDER BY g.state_group
"""


def refresh_sole_delta_sql(groups_sql: str) -> str:
    """An UPDATE setting ``state_groups.sole_*`` of the groups ``groups_sql``
    selects from their rows, for tests that write the tables by hand (the
    store's writers set the columns as they write the rows)."""
    only = (
        "(SELECT CASE WHEN COUNT(*) = 1 THEN MAX(d.{column}) END FROM state_group_deltas AS d"
        " WHERE d.state_group = state_groups.state_group)"
    )
    return (
        f"UPDATE state_groups SET sole_type_key_nid = {only.format(column='type_key_nid')},"
        f" sole_event_nid = {only.format(column='event_nid')} WHERE state_group IN ({groups_sql})"
    )


def sole_delta_mismatches_txn(txn) -> list[int]:
    """The groups of :data:`SOLE_DELTA_MISMATCHES_SQL` (a transaction's cursor)."""
    return [row[0] for row in txn.execute(SOLE_DELTA_MISMATCHES_SQL).fetchall()]
