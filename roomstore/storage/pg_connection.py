"""PostgreSQL connections of the pool: psycopg2's connection and cursor
classes with what ``PostgresEngine`` keeps on them.

* Prepared statements: the connection remembers which it holds
  (``PostgresEngine.execute_prepared``).
* Deferred BEGIN: a pooled connection runs in autocommit and sends the
  transaction's ``BEGIN`` in the same message as its first statement, one
  round trip instead of psycopg2's two; ``commit()`` and ``rollback()`` send
  ``COMMIT``/``ROLLBACK`` only when a ``BEGIN`` went out.

* Advisory locks (the writer lock, ``writer_lock.py``): taking, checking,
  naming the holder of, and releasing one, on a session connection.

Imported by ``engines.py`` and ``writer_lock.py``; psycopg2 is imported when
first needed.
"""

from __future__ import annotations

import collections
import functools
import io
import struct
from collections.abc import Sequence
from typing import Any


def is_stale_plan(exc: BaseException) -> bool:
    """The error EXECUTE gives when a table was altered after PREPARE so that
    the statement's result columns changed."""
    import psycopg2.errors

    return isinstance(exc, psycopg2.errors.FeatureNotSupported) and "cached plan must not change" in str(exc)


def xact_status(cursor: Any, xid: str) -> str:
    """``committed``, ``aborted`` or ``in progress``: what became of the
    transaction ``xid`` (``PostgresEngine.transaction_status``)."""
    import psycopg2.errors

    cursor.execute("SAVEPOINT xact_status")
    try:
        cursor.execute("SELECT pg_xact_status(%s::xid8)", (xid,))
        status = cursor.fetchone()[0]
    except psycopg2.errors.InvalidParameterValue:
        # "transaction ID ... is in the future": after a crash the server
        # restarted below it, so nothing of it reached the disk.
        cursor.execute("ROLLBACK TO SAVEPOINT xact_status")
        status = "aborted"
    cursor.execute("RELEASE SAVEPOINT xact_status")
    # NULL: too old to be known, which a transaction of seconds ago is not.
    return status or "aborted"


@functools.lru_cache(maxsize=1)
def preparing_connection() -> type:
    """psycopg2's connection class with a memory of the statements prepared
    on it (``PostgresEngine.execute_prepared``): ``prepared`` maps SQL text to
    statement name, least recently used first; ``stale`` lists names to
    deallocate before the next prepared statement runs."""
    import psycopg2.extensions

    class DeferredBeginCursor(psycopg2.extensions.cursor):
        """Sends a pending ``BEGIN`` with the first statement: one message,
        one round trip (the simple query protocol runs both)."""

        def _take_begin(self) -> bool:
            """True for the transaction's first statement, which carries the BEGIN."""
            # A PreparingConnection (below), whose flags psycopg2's connection type does not have.
            conn: Any = self.connection
            if not conn.begin_pending:
                return False
            conn.begin_pending = False
            conn.in_transaction = True
            return True

        def execute(self, query: Any, vars: Any = None) -> None:
            if self._take_begin():
                query = (_BEGIN_BYTES if isinstance(query, bytes) else _BEGIN) + query
            return super().execute(query, vars)

        def executemany(self, query: Any, vars_list: Any) -> None:
            if self._take_begin():
                super().execute(_BEGIN)
            return super().executemany(query, vars_list)

        def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> None:
            if self._take_begin():
                super().execute(_BEGIN)
            return super().copy_expert(sql, file, size)

    class PreparingConnection(psycopg2.extensions.connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.prepared: collections.OrderedDict[str, str] = collections.OrderedDict()
            self.stale: list[str] = []
            # Pooled connections (PostgresEngine.connect): in autocommit, the
            # transaction's BEGIN waiting for its first statement, COMMIT and
            # ROLLBACK sent here only when a BEGIN went out.
            self.deferred_begin = False
            self.begin_pending = False
            self.in_transaction = False
            self.cursor_factory = DeferredBeginCursor

        def _end(self, statement: str) -> None:
            self.begin_pending = False
            if self.in_transaction:
                self.in_transaction = False
                with psycopg2.extensions.cursor(self) as cursor:
                    cursor.execute(statement)

        def commit(self) -> None:
            if not self.deferred_begin:
                return super().commit()
            self._end("COMMIT")

        def rollback(self) -> None:
            if not self.deferred_begin:
                return super().rollback()
            self._end("ROLLBACK")

    return PreparingConnection


#: What a pooled PostgreSQL connection sends before a transaction's first
#: statement (the isolation level psycopg2 would have asked for).
_BEGIN = "BEGIN ISOLATION LEVEL REPEATABLE READ; "
_BEGIN_BYTES = _BEGIN.encode()


# ---------------------------------------------------------------- advisory locks
# ``key``: the two-int form, (classid, objid); pg_locks shows each half as an
# oid (its low 32 bits) with objsubid 2.


def try_advisory_lock(cursor: Any, key: tuple[int, int]) -> bool:
    """Take the session-level advisory lock ``key`` if free."""
    cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", key)
    return bool(cursor.fetchone()[0])


def holds_advisory_lock(cursor: Any, key: tuple[int, int]) -> bool:
    """True while this session holds the advisory lock ``key``."""
    classid, objid = key
    cursor.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()"
        " AND classid = %s::oid AND objid = %s::oid AND objsubid = 2",
        (classid & 0xFFFFFFFF, objid & 0xFFFFFFFF),
    )
    return bool(cursor.fetchone()[0])


def advisory_lock_holder(cursor: Any, key: tuple[int, int]) -> tuple[Any, ...] | None:
    """(application_name, client address, backend start) of the session holding the advisory lock ``key``."""
    classid, objid = key
    cursor.execute(
        "SELECT a.application_name, a.client_addr, a.backend_start FROM pg_locks AS l"
        " JOIN pg_stat_activity AS a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid AND l.objid = %s::oid"
        " AND l.objsubid = 2"
        # Advisory locks are per database: the same key elsewhere is someone else's.
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (classid & 0xFFFFFFFF, objid & 0xFFFFFFFF),
    )
    holder: tuple[Any, ...] | None = cursor.fetchone()
    return holder


def advisory_unlock(cursor: Any, key: tuple[int, int]) -> None:
    cursor.execute("SELECT pg_advisory_unlock(%s, %s)", key)


#: COPY's text format: backslash escapes for the characters that delimit it.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_value(value: Any) -> str:
    kind = type(value)
    if kind is int:  # the most common value: ids, orderings, timestamps
        return str(value)
    if value is None:
        return "\\N"
    if kind is str:
        if "\0" in value:
            raise ValueError("COPY cannot carry a NUL character in text")
        text: str = value.translate(_COPY_ESCAPES)
        return text
    if value is True or value is False:
        return "t" if value else "f"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\\\x" + bytes(value).hex()  # bytea's hex input, its backslash escaped for COPY
    if isinstance(value, str):
        return _copy_value(str(value))
    return str(value)


def copy_text(rows: Any) -> str:
    """``rows`` as the body of ``COPY ... FROM STDIN`` in text format."""
    return "".join("\t".join(map(_copy_value, row)) + "\n" for row in rows)


#: Column types ``copy_binary`` writes, by ``regtype`` name: kind codes.
BINARY_COPY_KINDS = {"bigint": 8, "integer": 4, "smallint": 2, "boolean": 1, "text": 0, "bytea": -1}
_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_NULL = b"\xff\xff\xff\xff"
_TRUE = b"\x00\x00\x00\x01\x01"
_FALSE = b"\x00\x00\x00\x01\x00"
_INT_FORMATS = {8: struct.Struct(">iq").pack, 4: struct.Struct(">ii").pack, 2: struct.Struct(">ih").pack}
_LENGTH = struct.Struct(">i").pack


def copy_binary(rows: Sequence[Sequence[Any]], kinds: Sequence[int]) -> bytes | None:
    """``rows`` as the body of ``COPY ... FROM STDIN (FORMAT binary)`` for
    columns of ``kinds`` (``BINARY_COPY_KINDS``' codes; text in UTF-8, the
    server's encoding), or None where a value is not plainly of its column's
    type (a bool for an integer, a NUL in text...): the text format then
    carries the rows and words any error as it always did. Binary spares
    the server parsing every value, and bytea its hex (twice the bytes)."""
    out = [_BINARY_HEADER]
    add = out.append
    count = struct.pack(">h", len(kinds))
    ints = {kind: _INT_FORMATS[kind] for kind in kinds if kind in _INT_FORMATS}
    try:
        for row in rows:
            add(count)
            for kind, value in zip(kinds, row, strict=True):
                if value is None:
                    add(_NULL)
                elif kind > 1:
                    if type(value) is not int:
                        return None
                    add(ints[kind](kind, value))
                elif kind == 1:
                    if type(value) is not bool:
                        return None
                    add(_TRUE if value else _FALSE)
                elif kind == 0:
                    if type(value) is not str or "\0" in value:
                        return None
                    data = value.encode("utf-8")
                    add(_LENGTH(len(data)))
                    add(data)
                else:
                    if not isinstance(value, (bytes, bytearray, memoryview)):
                        return None
                    data = bytes(value)
                    add(_LENGTH(len(data)))
                    add(data)
    except (struct.error, UnicodeEncodeError, ValueError):  # out of range, a lone surrogate, a short row
        return None
    add(b"\xff\xff")
    return b"".join(out)


#: (table, columns) -> ``copy_binary``'s kinds of those columns, or None (text).
CopyKinds = dict[tuple[str, tuple[str, ...]], "tuple[int, ...] | None"]


def copy_in(
    cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], kinds_of: CopyKinds
) -> None:
    """``COPY table (columns) FROM STDIN`` of ``rows``: one message stream, no
    per-row statement parse or bind; in binary where every column's type
    allows (the server then parses no value), else in text. ``kinds_of``:
    the caller's cache of ``_copy_kinds``."""
    key = (table, tuple(columns))
    if key not in kinds_of:
        kinds_of[key] = _copy_kinds(cursor, table, key[1])
    kinds = kinds_of[key]
    body = copy_binary(rows, kinds) if kinds is not None else None
    target = f"{table} ({', '.join(columns)})"
    if body is not None:
        cursor.copy_expert(f"COPY {target} FROM STDIN (FORMAT binary)", io.BytesIO(body), size=1 << 20)
    else:
        cursor.copy_expert(f"COPY {target} FROM STDIN", io.StringIO(copy_text(rows)), size=1 << 20)


def _copy_kinds(cursor: Any, table: str, columns: tuple[str, ...]) -> tuple[int, ...] | None:
    """``copy_binary``'s kinds of ``table``'s ``columns``, from the catalog;
    None where one has a type it does not write or the server's encoding
    is not UTF-8 (text then)."""
    cursor.execute(
        "SELECT a.attname, a.atttypid::regtype::text, current_setting('server_encoding')"
        " FROM pg_attribute AS a WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped",
        (table,),
    )
    found = cursor.fetchall()
    types = {name: kind for name, kind, _ in found}
    kinds = [BINARY_COPY_KINDS.get(types.get(column, "")) for column in columns]
    if not found or found[0][2] != "UTF8" or None in kinds:
        return None
    return tuple(k for k in kinds if k is not None)
