"""Database engines: everything that differs between SQLite and PostgreSQL.

The rest of roomstore writes SQL once, with ``?`` placeholders and the
PostgreSQL type names of the schema files; an engine converts both for its
database, opens connections and classifies errors. Nothing outside this module
imports ``sqlite3`` or ``psycopg2`` but ``pg_connection.py``, the classes of
PostgreSQL's pooled connections.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import sqlite3
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from roomstore.storage.db_urls import masked_url, normalized_postgres_url
from roomstore.storage.errors import DatabaseConfigError, DatabaseUnavailableError
from roomstore.storage.pg_connection import CopyKinds, copy_in, is_stale_plan, preparing_connection, xact_status
from roomstore.storage.sqlite_connection import cannot_open, check_sqlite_file, connect_sqlite

Row = tuple[Any, ...]  #: A row as the driver gives it (its values typed by the column, not by us).


@functools.lru_cache(maxsize=1024)
def convert_placeholders(sql: str, numbered: bool = False) -> str:
    """Turn ``?`` placeholders into psycopg2's ``%s`` (and escape literal ``%``),
    or with ``numbered`` into PostgreSQL's ``$1``, ``$2``... for ``PREPARE``
    (sent without values, so ``%`` stays as it is).

    Every PostgreSQL statement passes here and the scan costs ~85 us per KiB
    of SQL (measured on this 2-core machine); statement texts repeat, so the
    last 1,024 are kept converted.

    Quoted literals and identifiers, and ``--`` comments, are copied
    untouched but for ``%`` (psycopg2 formats the whole text), so a ``?`` in
    them is no placeholder and an apostrophe in a comment opens no literal.
    """
    percent = "%" if numbered else "%%"
    out: list[str] = []
    quote: str | None = None
    comment = False
    previous = ""
    marks = 0
    for ch in sql:
        if comment:
            out.append(percent if ch == "%" else ch)
            comment = ch != "\n"
        elif quote is not None:
            out.append(percent if ch == "%" else ch)
            if ch == quote:
                quote = None
        elif ch in ("'", '"'):
            quote = ch
            out.append(ch)
        elif ch == "-" and previous == "-":
            comment = True
            out.append(ch)
        elif ch == "?":
            marks += 1
            out.append(f"${marks}" if numbered else "%s")
        elif ch == "%":
            out.append(percent)
        else:
            out.append(ch)
        previous = "" if comment or quote is not None else ch
    return "".join(out)


class Engine:
    """One database kind. Subclasses are stateless apart from their settings."""

    name: str = ""
    #: True where stream IDs come from database sequences shared by processes.
    supports_sequences: bool = False
    #: How many threads (each with its own connection) the pool may use.
    max_connections: int = 1
    #: True where the database runs in this process (SQLite): a statement
    #: costs no round trip, a lookup by key next to nothing, and its work
    #: (writing rows as JSON text too: ``json_array_sql``) runs without the
    #: GIL; a server's (PostgreSQL) spends twice what Python does on JSON.
    in_process: bool = False

    # --- Writing: how statements, new rows and ids reach this database ----

    #: True where a write transaction is the only writer of the whole database
    #: (SQLite's ``BEGIN IMMEDIATE``): it may count new serial ids up from the
    #: maximum, and every key its own reads did not find is its to insert.
    single_writer: bool = False
    #: True where writes can be held back and sent in one round trip
    #: (``Transaction.queue``); elsewhere a queued statement runs at once.
    batches_writes: bool = False
    #: True where ``insert_rows`` can return the inserted rows (``RETURNING``).
    returns_inserted_rows: bool = False
    #: A statement (table, column, count) returning ``count`` new ids from a
    #: serial column's sequence; None where the single writer counts them.
    serial_ids_sql: str | None = None

    def bind_statement(self, cursor: Any, sql: str, args: Sequence[Any]) -> bytes:
        """``sql`` (with ``?``) and its values bound into one statement's text,
        to be sent later with others (only where ``batches_writes``)."""
        raise NotImplementedError(f"{self.name} does not batch writes")

    def bind_insert(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Row], on_conflict: str
    ) -> list[bytes]:
        """Multi-row INSERT statements with ``rows`` bound in, at most 1,000
        rows each, to be sent later (only where ``batches_writes``)."""
        raise NotImplementedError(f"{self.name} does not batch writes")

    def insert_rows(
        self,
        cursor: Any,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Row],
        on_conflict: str,
        returning: str,
    ) -> list[Row] | None:
        """Insert ``rows`` in as few round trips as this database allows; the
        rows ``returning`` names if given (where ``returns_inserted_rows``)."""
        raise NotImplementedError

    def copy_rows(self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
        """Bulk-load new rows the fastest way this database has (no conflict clause)."""
        self.insert_rows(cursor, table, columns, rows, "", "")

    def table_bytes(self, txn: Any, table: str) -> int | None:
        """Bytes on disk of ``table`` and its indexes, or None if unknown."""
        return None

    def session_connection(self, application_name: str) -> Any:
        """A connection of its own, outside the pool, for session-level locks."""
        raise NotImplementedError(f"{self.name} has no server sessions")

    def connect(self, pooled: bool = False) -> Any:
        """A new connection. ``pooled``: one of ``Database``'s, whose
        transactions all begin with :meth:`begin` and end with the
        connection's ``commit()`` or ``rollback()``; an engine may then send
        ``BEGIN`` along with the transaction's first statement."""
        raise NotImplementedError

    def check_exists(self) -> None:
        """``DatabaseConfigError`` if the database is missing and may not be created."""

    def check_usable(self) -> None:
        """Connect once and leave, writing nothing: ``DatabaseConfigError`` or
        ``DatabaseUnavailableError`` (one line each) if the database is not
        there, not a database, or cannot be reached."""
        self.check_exists()
        self.connect().close()

    def convert_sql(self, sql: str) -> str:
        raise NotImplementedError

    def json_array_sql(self, items: Sequence[tuple[str, str]]) -> str:
        """SQL for the JSON text of an array (where ``in_process``), as
        Python's ``json`` writes it (compact; quotes, backslashes and control
        characters escaped as it escapes them) but for non-ASCII characters
        and DEL, left as they are. ``items`` are ``(kind, expression)``:
        ``text`` a text value (NULL: ``null``), ``bool`` a condition (``true``
        or ``false``), ``array`` another ``json_array_sql``."""
        raise NotImplementedError(f"{self.name} leaves JSON to Python")

    def execute_prepared(self, cursor: Any, sql: str, args: Sequence[Any]) -> None:
        """Run ``sql`` (with ``?``) as a statement the server keeps planned
        for this connection, where the engine has such statements; elsewhere
        (SQLite, whose own statement cache reuses the parse) a plain execute."""
        cursor.execute(self.convert_sql(sql), tuple(args))

    def translate_schema(self, sql: str) -> str:
        """Rewrite a schema file's portable DDL into this engine's dialect."""
        return sql

    def begin(self, cursor: Any) -> None:
        """Open a transaction on a fresh connection state."""

    def is_retryable(self, exc: BaseException) -> bool:
        """True for errors after which the whole transaction may be run again."""
        return False

    def is_connection_lost(self, exc: BaseException, conn: Any) -> bool:
        """True when ``exc`` says the server went away (``conn`` is dead, or
        none could be opened): the pool reconnects and tries again."""
        return False

    #: A query returning the running transaction's id as text, or NULL when
    #: it has written nothing; None where connections cannot be lost.
    xid_sql: str | None = None

    def transaction_status(self, cursor: Any, xid: str) -> str:
        """``committed``, ``aborted`` or ``in progress``: what became of the
        transaction ``xid`` (from ``xid_sql``) whose COMMIT went unanswered."""
        raise NotImplementedError(f"{self.name} does not lose connections")

    def is_storage_full(self, exc: BaseException) -> bool:
        """True for "out of space" errors (raised as ``StorageFullError``)."""
        return False

    def lock_schema(self, cursor: Any) -> None:
        """Serialise schema migrations between processes, until commit."""

    def table_exists(self, cursor: Any, table: str) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    # --- offline jobs (state compaction): row locks, bulk loads (Spark's JDBC
    # settings are the job's: roomstore.compaction.job.jdbc)

    #: SQL suffix that row-locks what a SELECT returns until commit; "" where a
    #: write transaction already excludes every other writer.
    for_update: str = ""

    def bulk_insert(
        self, cursor: Any, table: str, columns: str, rows: Sequence[Row], text: Callable[[Any], str] = str
    ) -> None:
        """Insert ``rows`` on a cursor of this engine; ``table`` and ``columns``
        (comma-separated) are the caller's SQL. ``text`` renders a non-NULL
        value where the engine loads text (PostgreSQL's COPY)."""
        if rows:
            marks = ", ".join("?" for _ in columns.split(","))
            cursor.executemany(self.convert_sql(f"INSERT INTO {table} ({columns}) VALUES ({marks})"), rows)

    def move_sequence_past(self, cursor: Any, table: str, column: str) -> None:
        """After inserting explicit ids into ``table.column``: make the ids the
        database generates continue after its maximum (no-op where they do anyway)."""

    # --- Reading: what the dialect offers queries -------------------------

    #: True where a subquery in FROM may refer to the tables before it
    #: (``CROSS JOIN LATERAL``, PostgreSQL); elsewhere a per-row search is
    #: written as a correlated ``IN`` (SQLite runs it once per outer row).
    lateral_joins: bool = False

    def packed_ints_sql(self, columns: Sequence[str]) -> str:
        """An aggregate that packs the integer ``columns`` of the rows it sees
        into one value, which :meth:`unpack_ints` turns into one list per
        column, aligned (the aggregates of one query level see the rows in
        the same order); NULLs are kept as None. No rows: empty lists, or none."""
        raise NotImplementedError

    def unpack_ints(self, packed: Any) -> list[list[int | None]]:
        """The lists of a :meth:`packed_ints_sql` value."""
        raise NotImplementedError


@attrs.define
class SqliteEngine(Engine):
    """The embedded default: one file, WAL journal, one writer connection.

    A single connection serialises transactions inside the process (SQLite
    allows one writer at a time anyway); ``BEGIN IMMEDIATE`` takes the write
    lock up front so two processes on one file queue on ``busy_timeout``
    instead of failing half-way through a transaction.
    """

    path: str
    synchronous: str = "FULL"
    busy_timeout_ms: int = 30_000
    #: False: a missing file is an error (a mistyped path must not become a
    #: new, empty database), not created with its directories.
    create: bool = True
    #: Open the file so that nothing writes to it (``PRAGMA query_only``, no
    #: journal-mode change, plain ``BEGIN``): the read commands' stores.
    read_only: bool = False

    name = "sqlite"
    in_process = True
    supports_sequences = False
    max_connections = 1

    # --- Writing (see Engine) ---------------------------------------------
    single_writer = True

    def insert_rows(
        self,
        cursor: Any,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Row],
        on_conflict: str,
        returning: str,
    ) -> list[Row] | None:
        # In-process: one executemany costs no round trips.
        marks = ", ".join("?" for _ in columns)
        cursor.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}) {on_conflict}", rows)
        return None

    def table_bytes(self, txn: Any, table: str) -> int | None:
        try:
            size: int | None = txn.select_one_value(
                "SELECT SUM(pgsize) FROM dbstat WHERE name = ? OR name IN"
                " (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?)",
                (table, table),
            )
        except sqlite3.OperationalError:  # SQLite built without dbstat
            return None
        return size

    def check_exists(self) -> None:
        if self.path != ":memory:" and os.path.isdir(self.path):
            raise DatabaseConfigError(f"{self.path} is a directory: give the path of a database file in --db")
        if not self.create and self.path != ":memory:" and not os.path.isfile(self.path):
            raise DatabaseConfigError(
                f"the SQLite database {self.path} does not exist: check the path, or create it with `roomstore init`"
            )

    def check_usable(self) -> None:
        self.check_exists()
        if self.path != ":memory:" and os.path.exists(self.path):
            check_sqlite_file(self.path)

    def connect(self, pooled: bool = False) -> sqlite3.Connection:
        # (pooled or not: BEGIN costs SQLite no round trip)
        self.check_exists()
        if self.path != ":memory:" and self.create:
            parent = os.path.dirname(os.path.abspath(self.path))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as exc:
                raise cannot_open(self.path, exc) from None
        return connect_sqlite(self.path, self.synchronous, self.busy_timeout_ms, self.read_only)

    def convert_sql(self, sql: str) -> str:
        return sql

    def json_array_sql(self, items: Sequence[tuple[str, str]]) -> str:
        # SQLite's JSON functions write compact JSON; json('true') is a
        # constant, made once a statement.
        values = (
            f"CASE WHEN {expr} THEN json('true') ELSE json('false') END" if kind == "bool" else expr
            for kind, expr in items
        )
        return f"json_array({', '.join(values)})"

    _SCHEMA_REWRITES = (
        (re.compile(r"\bBIGSERIAL\s+PRIMARY\s+KEY\b", re.I), "INTEGER PRIMARY KEY"),
        (re.compile(r"\bBYTEA\b", re.I), "BLOB"),
    )

    def translate_schema(self, sql: str) -> str:
        for pattern, replacement in self._SCHEMA_REWRITES:
            sql = pattern.sub(replacement, sql)
        return sql

    def begin(self, cursor: Any) -> None:
        # A reader takes no write lock (and a read-only file could not).
        cursor.execute("BEGIN" if self.read_only else "BEGIN IMMEDIATE")

    # The sqlite3 module spends ~0.3 us a row (each step of the cursor lets
    # the GIL go and takes it back, then builds a tuple): for 10,000 rows
    # more than SQLite's own work. JSON text is built by SQLite in C and
    # parsed by json.loads in C.
    def packed_ints_sql(self, columns: Sequence[str]) -> str:
        return "json_array(" + ", ".join(f"json_group_array({c})" for c in columns) + ")"

    def unpack_ints(self, packed: Any) -> list[list[int | None]]:
        return list(json.loads(packed))

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def is_storage_full(self, exc: BaseException) -> bool:
        # SQLITE_FULL (13), extended codes included: SQLite's answer to ENOSPC.
        return isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == 13

    def table_exists(self, cursor: Any, table: str) -> bool:
        cursor.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
        return cursor.fetchone() is not None

    def describe(self) -> str:
        return f"sqlite:///{self.path}"


@attrs.define
class PostgresEngine(Engine):
    """PostgreSQL through psycopg2, at REPEATABLE READ.

    Repeatable read gives each transaction one snapshot; the price is
    serialisation failures under concurrent updates, which the pool retries.
    """

    dsn: str
    max_connections: int = 5
    #: Server-side prepared statements kept per connection (``execute_prepared``);
    #: beyond it the least recently used is deallocated. 0: none, every
    #: statement a plain execute (a pooler that hands each transaction another
    #: server session, such as pgbouncer's transaction mode, loses them).
    max_prepared: int = 64
    #: Every transaction read-only (``default_transaction_read_only``): the
    #: read commands' stores.
    read_only: bool = False
    #: (table, columns) -> ``copy_binary``'s kinds, or None (text): ``pg_connection.copy_in``.
    _copy_kinds: CopyKinds = attrs.field(factory=dict, init=False, repr=False, eq=False)

    name = "postgres"
    supports_sequences = True

    #: Key for pg_advisory_xact_lock while migrating: 'roomstor' as an int64.
    SCHEMA_LOCK_KEY = 0x726F6F6D73746F72

    # --- Writing (see Engine) ---------------------------------------------
    batches_writes = True
    returns_inserted_rows = True
    serial_ids_sql = "SELECT nextval(pg_get_serial_sequence(?, ?)) FROM generate_series(1, ?)"

    def bind_statement(self, cursor: Any, sql: str, args: Sequence[Any]) -> bytes:
        # Bound by psycopg2 exactly as ``execute`` binds them.
        return bytes(cursor.mogrify(self.convert_sql(sql), tuple(args)))  # the same object: mogrify gives bytes

    def bind_insert(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Row], on_conflict: str
    ) -> list[bytes]:
        one_row = "(" + ", ".join("%s" for _ in columns) + ")"
        head = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ".encode()
        return [
            head
            + b",".join(cursor.mogrify(one_row, row) for row in rows[start : start + 1000])
            + f" {on_conflict}".encode()
            for start in range(0, len(rows), 1000)
        ]

    def insert_rows(
        self,
        cursor: Any,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Row],
        on_conflict: str,
        returning: str,
    ) -> list[Row] | None:
        # Multi-row VALUES: psycopg2's executemany would be a round trip per row.
        from psycopg2.extras import execute_values

        suffix = f" RETURNING {returning}" if returning else ""
        result = execute_values(
            cursor,
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES %s {on_conflict}{suffix}",
            rows,
            page_size=1000,
            fetch=bool(returning),
        )
        return [tuple(r) for r in result] if returning else None

    def copy_rows(self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
        copy_in(cursor, table, columns, rows, self._copy_kinds)

    def table_bytes(self, txn: Any, table: str) -> int | None:
        size: int | None = txn.select_one_value("SELECT pg_total_relation_size(?)", (table,))
        return size

    def session_connection(self, application_name: str) -> Any:
        """A connection of its own, in autocommit, for session-level locks;
        ``application_name`` names this process to ``pg_stat_activity``."""
        import psycopg2

        try:
            conn = psycopg2.connect(self.dsn, application_name=application_name)
        except psycopg2.OperationalError as exc:
            raise self._unavailable(exc) from None
        conn.autocommit = True
        return conn

    def _unavailable(self, exc: Exception) -> DatabaseUnavailableError:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return DatabaseUnavailableError(
            f"cannot connect to PostgreSQL {self.describe()}: {reason}"
            " (is the server running, and are the URL's host, port, user and database right?)"
        )

    def connect(self, pooled: bool = False) -> Any:
        import psycopg2
        import psycopg2.extensions

        params = psycopg2.extensions.parse_dsn(self.dsn)
        # JIT off (before any options of the URL's, which may turn it back on):
        # the store's statements run in well under a millisecond, but once
        # the tables have statistics PostgreSQL costs the correlated
        # visibility subqueries of a timeline page above jit_above_cost and
        # compiles ~180 functions for it, 60-260 ms a page
        # (bench/timeline_reads.py, section p, after ANALYZE).
        read_only = "-c default_transaction_read_only=on" if self.read_only else None
        params["options"] = " ".join(filter(None, ["-c jit=off", read_only, params.get("options")]))
        try:
            conn = psycopg2.connect(**params, connection_factory=preparing_connection())
        except psycopg2.OperationalError as exc:
            raise self._unavailable(exc) from None
        conn.set_session(
            isolation_level=psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ,
            autocommit=False,
        )
        if pooled:
            # psycopg2 would send BEGIN on its own, a round trip before the
            # transaction's first statement; the connection sends it in the
            # same message as that statement instead (see pg_connection.py).
            conn.autocommit = True
            conn.deferred_begin = True
        return conn

    def begin(self, cursor: Any) -> None:
        conn = cursor.connection
        if getattr(conn, "deferred_begin", False):
            conn.begin_pending = True

    def convert_sql(self, sql: str) -> str:
        return convert_placeholders(sql)

    def execute_prepared(self, cursor: Any, sql: str, args: Sequence[Any]) -> None:
        # What the server holds is remembered on the connection object (see
        # pg_connection.py), so a new connection starts with nothing.
        # PREPARE and DEALLOCATE are not transactional (checked on the
        # server, tests/storage/test_prepared.py): a statement prepared in a
        # transaction that then rolls back or fails stays prepared, and one
        # whose PREPARE failed does not exist; so the memory, written only
        # after the server answered, is exact. The names are sent in their
        # own statements before the EXECUTE, never in the caller's.
        conn = cursor.connection
        prepared = getattr(conn, "prepared", None)
        if prepared is None or self.max_prepared <= 0:  # not made by connect(), or turned off
            cursor.execute(self.convert_sql(sql), tuple(args))
            return
        if conn.stale:
            # A plan the schema changed under (see is_retryable): gone now.
            cursor.execute("; ".join(f"DEALLOCATE {name}" for name in conn.stale))
            conn.stale.clear()
        name = prepared.get(sql)
        if name is None:
            name = "rs_" + hashlib.sha1(sql.encode()).hexdigest()[:20]
            cursor.execute(f"PREPARE {name} AS {convert_placeholders(sql, numbered=True)}")
            prepared[sql] = name
            while len(prepared) > self.max_prepared:
                oldest = next(iter(prepared))
                cursor.execute(f"DEALLOCATE {prepared[oldest]}")
                del prepared[oldest]
        else:
            prepared.move_to_end(sql)
        marks = ", ".join("%s" for _ in args)
        try:
            cursor.execute(f"EXECUTE {name} ({marks})" if args else f"EXECUTE {name}", tuple(args))
        except Exception as exc:
            if is_stale_plan(exc):
                # Another process altered a table this plan reads; the
                # transaction is aborted, and is retried (is_retryable) after
                # the statement is deallocated and prepared again.
                del prepared[sql]
                conn.stale.append(name)
            raise

    def is_retryable(self, exc: BaseException) -> bool:
        import psycopg2.errors

        return isinstance(
            exc, (psycopg2.errors.SerializationFailure, psycopg2.errors.DeadlockDetected)
        ) or is_stale_plan(exc)

    def is_storage_full(self, exc: BaseException) -> bool:
        return getattr(exc, "pgcode", None) == "53100"  # disk_full

    def is_connection_lost(self, exc: BaseException, conn: Any) -> bool:
        import psycopg2

        if isinstance(exc, DatabaseUnavailableError):
            return True
        # admin_shutdown (pg_terminate_backend, a fast shutdown), crash_shutdown
        # (another backend crashed: the server restarts), cannot_connect_now
        # (starting up, shutting down, in recovery).
        if getattr(exc, "pgcode", None) in ("57P01", "57P02", "57P03"):
            return True
        return isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)) and (
            conn is None or bool(getattr(conn, "closed", 0))
        )

    xid_sql = "SELECT pg_current_xact_id_if_assigned()::text"

    def transaction_status(self, cursor: Any, xid: str) -> str:
        return xact_status(cursor, xid)

    def lock_schema(self, cursor: Any) -> None:
        # Read committed, so that after waiting for the lock this transaction
        # sees what the process that held it committed (a repeatable-read
        # snapshot would predate it). Must be the transaction's first statement.
        cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        # Signed int64 form of the key; released automatically at commit/rollback.
        key = self.SCHEMA_LOCK_KEY - (1 << 64) if self.SCHEMA_LOCK_KEY >= 1 << 63 else self.SCHEMA_LOCK_KEY
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (key,))

    def table_exists(self, cursor: Any, table: str) -> bool:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", (table,))
        return bool(cursor.fetchone()[0])

    def describe(self) -> str:
        parsed = urllib.parse.urlsplit(self.dsn)
        host = parsed.hostname or "localhost"
        return f"postgresql://{host}:{parsed.port or 5432}{parsed.path}"

    # --- offline jobs (see Engine)
    for_update = " FOR UPDATE"

    def bulk_insert(
        self, cursor: Any, table: str, columns: str, rows: Sequence[Row], text: Callable[[Any], str] = str
    ) -> None:
        # COPY: one round trip, no statement per row.
        if not rows:
            return
        buf = io.StringIO()
        for row in rows:
            buf.write("\t".join("\\N" if v is None else text(v) for v in row))
            buf.write("\n")
        buf.seek(0)
        cursor.copy_expert(f"COPY {table} ({columns}) FROM STDIN", buf)

    def move_sequence_past(self, cursor: Any, table: str, column: str) -> None:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, %s),"
            f" (SELECT GREATEST(COALESCE(MAX({column}), 0), 1) FROM {table}))",
            (table, column),
        )

    # --- Reading (see Engine) -----------------------------------------------
    lateral_joins = True

    def packed_ints_sql(self, columns: Sequence[str]) -> str:
        # A two-dimensional BIGINT array, one row per column; psycopg2 parses
        # it into lists of ints in C. No rows: ARRAY[NULL, NULL] is '{}'.
        return "ARRAY[" + ", ".join(f"CAST(array_agg({c}) AS BIGINT[])" for c in columns) + "]"

    def unpack_ints(self, packed: list[list[int | None]]) -> list[list[int | None]]:
        return packed  # psycopg2 parsed the array


def _single(options: Mapping[str, list[str]], key: str) -> str | None:
    values = options.get(key)
    return values[-1] if values else None


def engine_from_url(url: str, create: bool = True, read_only: bool = False) -> Engine:
    """Build the engine a URL names.

    ``sqlite:///relative/path.db``, ``sqlite:////abs/path.db`` or
    ``sqlite:///:memory:``; ``postgresql://user@host:port/dbname`` (any libpq
    URL). Options of ours ride in the query string and are removed before the
    URL reaches libpq: ``synchronous`` (SQLite), ``cp_max`` (PostgreSQL pool size),
    ``max_prepared`` (PostgreSQL prepared statements kept per connection, 0 for none).
    ``read_only``: connections that cannot write (SQLite ``mode=ro``,
    PostgreSQL read-only transactions).
    """
    if not isinstance(url, str) or "://" not in url:
        raise DatabaseConfigError(
            f"database URL {masked_url(url) if isinstance(url, str) else url!r} is not of the form"
            " sqlite:///path or postgresql://..."
        )
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == "sqlite":
        path, _, query = rest.partition("?")
        if not path.startswith("/") or path == "/":
            raise DatabaseConfigError(f"SQLite URL {url!r} needs a path: sqlite:///path/to/file.db")
        path = path[1:]
        options = urllib.parse.parse_qs(query)
        synchronous = (_single(options, "synchronous") or "FULL").upper()
        if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise DatabaseConfigError(f"unknown SQLite synchronous mode {synchronous!r}")
        return SqliteEngine(path=path, synchronous=synchronous, create=create and not read_only, read_only=read_only)
    if scheme in ("postgresql", "postgres"):
        parsed = normalized_postgres_url(url)
        options = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        cp_max = _single(options, "cp_max")
        max_prepared = _single(options, "max_prepared")
        options.pop("cp_max", None)
        options.pop("max_prepared", None)
        query = urllib.parse.urlencode(options, doseq=True, quote_via=urllib.parse.quote)
        dsn = urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, parsed.path, query, ""))
        if not parsed.path.strip("/"):
            raise DatabaseConfigError(f"PostgreSQL URL {masked_url(url)!r} must name a database")
        try:
            size = int(cp_max) if cp_max is not None else 5
        except ValueError:
            raise DatabaseConfigError(f"cp_max must be an integer, not {cp_max!r}") from None
        if size < 1:
            raise DatabaseConfigError("cp_max must be at least 1")
        engine = PostgresEngine(dsn=dsn, max_connections=size, read_only=read_only)
        if max_prepared is not None:
            try:
                engine.max_prepared = int(max_prepared)
            except ValueError:
                raise DatabaseConfigError(f"max_prepared must be an integer, not {max_prepared!r}") from None
            if engine.max_prepared < 0:
                raise DatabaseConfigError("max_prepared must be 0 (none) or more")
        return engine
    raise DatabaseConfigError(f"unsupported database scheme {scheme!r}: use sqlite or postgresql")
