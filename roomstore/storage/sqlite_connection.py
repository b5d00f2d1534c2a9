"""Opening a SQLite file for ``SqliteEngine`` (as ``pg_connection.py`` holds
psycopg2's classes): the writer's connection in WAL mode, the read-only
connection of the read commands, and the check that a file is a database.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
import urllib.parse

from roomstore.storage.errors import DatabaseConfigError

__all__ = ["cannot_open", "check_sqlite_file", "connect_sqlite"]


def _not_a_database(path: str, exc: Exception) -> DatabaseConfigError:
    return DatabaseConfigError(f"{path} is not a SQLite database ({exc}): check the path in --db")


def cannot_open(path: str, exc: BaseException) -> DatabaseConfigError:
    """The one line for an OS or SQLite error met opening ``path``."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return DatabaseConfigError(
            f"cannot write the SQLite database {path}: its file system is read-only"
            " (the read commands can read it there; the others need a writable directory)"
        )
    return DatabaseConfigError(
        f"cannot open the SQLite database {path}: {reason}: check the path in --db and that you may write its directory"
    )


def check_sqlite_file(path: str) -> None:
    """``DatabaseConfigError`` if the existing file at ``path`` is not a
    SQLite database; opened read-only, nothing written or created."""
    try:
        conn = sqlite3.connect(_read_only_uri(path, "ro"), uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise _not_a_database(path, exc) from None


def connect_sqlite(path: str, synchronous: str, busy_timeout_ms: int, read_only: bool) -> sqlite3.Connection:
    """A connection in autocommit (``isolation_level=None``: the engine issues
    ``BEGIN`` itself, so DDL is transactional too)."""
    conn = _connect_read_only(path, busy_timeout_ms) if read_only else _connect_writer(path, busy_timeout_ms)
    if not read_only:
        conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    try:
        conn.execute("SELECT json_group_array(1)")  # packed_ints_sql's functions
    except sqlite3.OperationalError:
        conn.close()
        raise DatabaseConfigError(
            f"this Python's SQLite ({sqlite3.sqlite_version}) has no JSON functions:"
            " use a Python built with SQLite 3.38 or later (or with its JSON1 extension)"
        ) from None
    return conn


def _read_only_uri(path: str, mode: str) -> str:
    """The URI a reader opens ``path`` by. On a read-only file system SQLite
    cannot make a WAL database's shared-memory file, so it opens none there:
    ``immutable`` reads the file as it stands, which is whole when no
    write-ahead log holds changes beside it (one that does is refused: its
    changes cannot be read without writing)."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path))
    if not _on_read_only_file_system(path):
        return f"{uri}?mode={mode}"
    wal = path + "-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        raise DatabaseConfigError(
            f"cannot read the SQLite database {path}: its file system is read-only and its write-ahead log {wal}"
            " holds changes not yet in the file; open it once where it is writable (or copy both files elsewhere)"
        )
    return f"{uri}?mode=ro&immutable=1"


def _on_read_only_file_system(path: str) -> bool:
    try:
        return bool(os.statvfs(os.path.dirname(os.path.abspath(path)) or ".").f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _connect_writer(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000)
    except sqlite3.OperationalError as exc:
        raise cannot_open(path, exc) from None
    # A journal-mode change needs the file to itself, and SQLite may answer
    # "database is locked" at once (without its busy handler) while another
    # process is creating or migrating it: retry up to the busy timeout.
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return conn
        except sqlite3.OperationalError as exc:
            if "readonly" in str(exc) or "unable to open" in str(exc):
                conn.close()
                raise cannot_open(path, exc) from None
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                conn.close()
                raise
            time.sleep(0.01)
        except sqlite3.DatabaseError as exc:  # "file is not a database": the first read of the file
            conn.close()
            raise _not_a_database(path, exc) from None


def _connect_read_only(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """The existing file (``mode=rw``: never created), with no journal-mode
    change and ``PRAGMA query_only``: no statement can write. Not
    ``mode=ro``: a read-only connection to a WAL database leaves its ``-wal``
    and ``-shm`` files behind, while this one, as the last to close, removes
    those it made (a live writer's stay, as they must)."""
    if path == ":memory:":
        raise DatabaseConfigError("an in-memory SQLite database cannot be opened read-only")
    uri = _read_only_uri(path, "rw")
    try:
        conn = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000
        )
    except sqlite3.OperationalError as exc:
        raise DatabaseConfigError(f"cannot open the SQLite database {path}: {exc}") from None
    try:
        conn.execute("PRAGMA query_only = 1")
        conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise _not_a_database(path, exc) from None
    return conn
