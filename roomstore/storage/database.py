"""The connection pool: named transactions run on a thread pool.

``Database.run_interaction(description, fn, *args)`` runs ``fn(txn, *args)`` in
a worker thread inside one transaction that commits whole or rolls back whole.
Serialisation failures and deadlocks (PostgreSQL) and a locked file (SQLite)
make the pool roll back and run ``fn`` again, so ``fn`` must not have effects
outside the transaction; effects that belong to a successful commit (cache
updates, notifications) are registered with ``txn.call_after`` and run on the
reactor thread once the commit has happened.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Sequence, TypeVar

from prometheus_client import Counter, Histogram
from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from roomstore.storage.engines import Engine, engine_from_url

log = Logger()

R = TypeVar("R")

transaction_seconds = Histogram(
    "roomstore_db_transaction_seconds",
    "Wall time of database transactions, by description (retries included)",
    ["desc"],
)
transaction_outcomes = Counter(
    "roomstore_db_transactions",
    "Database transactions by description and outcome",
    ["desc", "outcome"],
)
transaction_retries = Counter(
    "roomstore_db_transaction_retries",
    "Transactions run again after a serialisation failure, deadlock or lock",
    ["desc"],
)

MAX_ATTEMPTS = 8


class RetryTransaction(Exception):
    """Raised by an interaction function to roll back and run again.

    For conflicts the database did not report itself, e.g. a row another
    writer committed after this transaction's snapshot was taken.
    """


def run_transaction(
    engine: Engine,
    connection: Callable[[], Any],
    body: Callable[[Any], R],
    *,
    attempts: int = MAX_ATTEMPTS,
    backoff_s: float = 0.005,
    max_backoff_s: float = 0.5,
    on_retry: Callable[[], None] | None = None,
    on_connection_lost: Callable[[BaseException], None] | None = None,
) -> R:
    """``body(cursor)`` in one transaction on ``connection()``: committed
    whole, or rolled back and raised.

    The one retry loop of roomstore (the pool's interactions and the offline
    jobs' plain connections). Serialisation failures, deadlocks, a locked
    SQLite file and :class:`RetryTransaction` roll back and run ``body`` again,
    after ``backoff_s * 2**attempt`` seconds (at most ``max_backoff_s``), up
    to ``attempts`` times. With ``on_connection_lost``, a connection lost
    before commit (nothing written) is reported to it, which drops the
    connection, and the next attempt runs on a new one from ``connection()``.
    """
    attempt = 0
    while True:
        attempt += 1
        conn = connection()
        cursor = conn.cursor()
        try:
            engine.begin(cursor)
            result = body(cursor)
            conn.commit()
            return result
        except BaseException as exc:
            try:
                conn.rollback()
            except Exception:
                pass
            if on_connection_lost is not None and engine.is_connection_lost(exc, conn) and attempt < attempts:
                on_connection_lost(exc)
                continue
            if (isinstance(exc, RetryTransaction) or engine.is_retryable(exc)) and attempt < attempts:
                if on_retry is not None:
                    on_retry()
                time.sleep(min(backoff_s * 2**attempt, max_backoff_s))
                continue
            raise
        finally:
            try:
                cursor.close()
            except Exception:
                pass


class Transaction:
    """A cursor inside one transaction, handed to interaction functions.

    SQL uses ``?`` placeholders and is converted for the engine. Only the
    thread running the interaction may use it.
    """

    def __init__(self, db: "Database", engine: Engine, cursor: Any, description: str):
        self.db = db
        self.engine = engine
        self.description = description
        self._cursor = cursor
        self._after_callbacks: list[tuple[Callable[..., Any], tuple, dict]] = []
        self._allocated: dict[tuple[str, str], int] = {}
        self._free_ids: dict[tuple[str, str], list[int]] = {}
        self._queued: list[bytes] = []

    # --- SQL -------------------------------------------------------------

    def execute(self, sql: str, args: Sequence[Any] = ()) -> "Transaction":
        self.flush_queue()
        self.db._count_query()
        self._cursor.execute(self.engine.convert_sql(sql), tuple(args))
        return self

    def queue(self, sql: str, args: Sequence[Any] = ()) -> None:
        """Run a write whose result is not needed, perhaps a little later.

        On PostgreSQL queued statements travel to the server together, in one
        round trip, before the next statement that is not queued and before
        commit; so every later statement still sees their effects, and an
        error in one still fails the transaction (at that point). Values are
        bound by psycopg2 exactly as ``execute`` binds them. SQLite, being
        in-process, runs the statement now.
        """
        if self.engine.name != "postgres":
            self.execute(sql, args)
            return
        self.db._count_query()
        self._queued.append(self._cursor.mogrify(self.engine.convert_sql(sql), tuple(args)))

    def flush_queue(self) -> None:
        """Send the queued statements (see ``queue``) now."""
        if self._queued:
            statements, self._queued = self._queued, []
            # No arguments: the text is sent as it is (already bound).
            self._cursor.execute(b";\n".join(statements))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = [tuple(r) for r in rows]
        if not rows:
            return
        self.flush_queue()
        self.db._count_query()
        self._cursor.executemany(self.engine.convert_sql(sql), rows)

    def insert_many(
        self,
        table: str,
        columns: Sequence[str],
        rows: Iterable[Sequence[Any]],
        on_conflict: str = "",
        returning: str = "",
        queue: bool = False,
    ) -> list[tuple] | None:
        """Insert many rows in as few round trips as the engine allows.

        ``table``, ``columns`` and ``on_conflict`` (e.g. ``"ON CONFLICT DO
        NOTHING"``, or an upsert's ``DO UPDATE SET`` clause, written with
        ``excluded.``) are SQL written by the caller's code, never user input;
        values are bound. PostgreSQL gets multi-row VALUES statements (psycopg2's
        executemany would be one round trip per row); SQLite runs in-process.
        ``returning`` (PostgreSQL only: SQLite's executemany cannot return
        rows) is a ``RETURNING`` column list; the rows it returns are returned.
        ``queue=True`` sends the insert with the other queued writes (``queue``).
        """
        rows = [tuple(r) for r in rows]
        if returning and self.engine.name != "postgres":
            raise ValueError("insert_many(returning=...) needs PostgreSQL")
        if returning and queue:
            raise ValueError("insert_many: a queued insert cannot return rows")
        if not rows:
            return [] if returning else None
        cols = ", ".join(columns)
        if queue and self.engine.name == "postgres":
            one_row = "(" + ", ".join("%s" for _ in columns) + ")"
            for start in range(0, len(rows), 1000):
                values = b",".join(self._cursor.mogrify(one_row, row) for row in rows[start:start + 1000])
                self.db._count_query()
                self._queued.append(f"INSERT INTO {table} ({cols}) VALUES ".encode() + values + f" {on_conflict}".encode())
            return None
        if self.engine.name == "postgres":
            from psycopg2.extras import execute_values

            self.flush_queue()
            self.db._count_query()
            suffix = f" RETURNING {returning}" if returning else ""
            result = execute_values(
                self._cursor, f"INSERT INTO {table} ({cols}) VALUES %s {on_conflict}{suffix}", rows,
                page_size=1000, fetch=bool(returning),
            )
            return [tuple(r) for r in result] if returning else None
        else:
            marks = ", ".join("?" for _ in columns)
            self.executemany(f"INSERT INTO {table} ({cols}) VALUES ({marks}) {on_conflict}", rows)

    def fetchone(self) -> tuple | None:
        return self._cursor.fetchone()

    def fetchall(self) -> list[tuple]:
        return self._cursor.fetchall()

    def __iter__(self):
        return iter(self._cursor)

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    def allocate_ids(self, table: str, column: str, count: int) -> list[int]:
        """Reserve ``count`` new ids for a serial primary key, to insert in bulk.

        PostgreSQL takes them from the column's sequence (never reused);
        SQLite counts up from the current maximum, which is safe because
        ``BEGIN IMMEDIATE`` makes this the only writer of the file.
        """
        if count <= 0:
            return []
        if self.engine.name == "postgres":
            rows = self.execute(
                "SELECT nextval(pg_get_serial_sequence(?, ?)) FROM generate_series(1, ?)", (table, column, count)
            ).fetchall()
            return sorted(r[0] for r in rows)
        top = self.select_one_value(f"SELECT COALESCE(MAX({column}), 0) FROM {table}")
        # Two allocations before the rows are inserted must not overlap.
        top = max(top, self._allocated.get((table, column), 0))
        self._allocated[(table, column)] = top + count
        return list(range(top + 1, top + 1 + count))

    def next_id(self, table: str, column: str, reserve: int = 1) -> int:
        """One new id for a serial primary key.

        When this transaction has none left over it reserves ``reserve`` at
        once (one statement), so a batch making many rows of ``table`` asks
        the database once. Ids left unused are never reused on PostgreSQL
        (a sequence gap) and are simply not taken on SQLite.
        """
        free = self._free_ids.get((table, column))
        if not free:
            free = self._free_ids[(table, column)] = self.allocate_ids(table, column, max(reserve, 1))[::-1]
        return free.pop()

    def undone(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn(self, *args, **kwargs)`` and undo what it wrote: a savepoint
        rolled back, its ``call_after`` callbacks and left-over ids dropped.

        Returns what ``fn`` returns, raises what it raises; either way the
        transaction goes on as before the call (a trial run of a write).
        """
        self.flush_queue()
        callbacks = len(self._after_callbacks)
        allocated, free = dict(self._allocated), {k: list(v) for k, v in self._free_ids.items()}
        self.execute("SAVEPOINT trial_run")
        try:
            result = fn(self, *args, **kwargs)
            self.flush_queue()
            return result
        finally:
            self._queued = []
            self._cursor.execute("ROLLBACK TO SAVEPOINT trial_run")
            self._cursor.execute("RELEASE SAVEPOINT trial_run")
            del self._after_callbacks[callbacks:]
            self._allocated, self._free_ids = allocated, free

    def select_one_value(self, sql: str, args: Sequence[Any] = ()) -> Any:
        row = self.execute(sql, args).fetchone()
        return None if row is None else row[0]

    # --- commit hooks ----------------------------------------------------

    def call_after(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` on the reactor thread after a successful commit.

        Dropped if this attempt rolls back (a retry registers its own).
        """
        self._after_callbacks.append((fn, args, kwargs))


class Database:
    """A pool of connections to one database, used through ``run_interaction``.

    Construct with ``Database(engine, reactor)`` or ``Database.from_url(url)``;
    then ``await db.prepare()`` (schema migrations) before use, and
    ``await db.close()`` at the end. Counts every statement in
    ``query_count`` (tests use it to prove a read touched no database).
    """

    def __init__(self, engine: Engine, reactor: Any = None, name: str = "db"):
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.engine = engine
        self.reactor = reactor
        self.query_count = 0
        self._query_lock = threading.Lock()
        self._local = threading.local()
        self._connections: list[Any] = []
        self._connections_lock = threading.Lock()
        self._threadpool = ThreadPool(
            minthreads=1, maxthreads=engine.max_connections, name=f"roomstore-{name}"
        )
        self._threadpool.start()
        # A process that stops its reactor without close() must not hang
        # waiting for these threads: stop them with the reactor.
        self._shutdown_trigger = None
        if hasattr(self.reactor, "addSystemEventTrigger"):
            self._shutdown_trigger = self.reactor.addSystemEventTrigger("during", "shutdown", self._threadpool.stop)
        self._closed = False
        # Interactions handed to the pool and not yet returned; close() waits
        # for them so it never closes a connection a transaction is using.
        self._in_flight = 0
        self._drained: list[defer.Deferred] = []

    @classmethod
    def from_url(cls, url: str, reactor: Any = None, create: bool = True) -> "Database":
        """``create=False``: a SQLite file that does not exist is refused
        (``DatabaseConfigError``) rather than created."""
        engine = engine_from_url(url, create)
        engine.check_exists()
        return cls(engine, reactor)

    async def prepare(self, schema_dir: str | None = None) -> int:
        """Bring the schema up to date (see ``roomstore.storage.schema``); returns its version."""
        from roomstore.storage.schema import prepare_database

        return await self.run_interaction("prepare_database", prepare_database, schema_dir)

    @property
    def closed(self) -> bool:
        return self._closed

    def _count_query(self) -> None:
        with self._query_lock:
            self.query_count += 1

    # --- connections (worker threads only) -------------------------------

    def _get_connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self.engine.connect()
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._connections_lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            try:
                conn.close()
            except Exception:
                pass

    def _run_in_thread(
        self, description: str, fn: Callable[..., R], args: tuple, kwargs: dict
    ) -> tuple[R, list]:
        def body(cursor: Any) -> tuple[R, list]:
            txn = Transaction(self, self.engine, cursor, description)
            result = fn(txn, *args, **kwargs)
            txn.flush_queue()
            return result, txn._after_callbacks

        def connection_lost(exc: BaseException) -> None:
            # The server went away before commit: nothing was written.
            log.warn("{desc}: connection lost ({exc}); reconnecting", desc=description, exc=exc)
            self._drop_connection()
            transaction_retries.labels(description).inc()

        return run_transaction(
            self.engine,
            self._get_connection,
            body,
            on_retry=transaction_retries.labels(description).inc,
            on_connection_lost=connection_lost,
        )

    async def run_interaction(
        self, description: str, fn: Callable[..., R], *args: Any, **kwargs: Any
    ) -> R:
        """Run ``fn(txn, *args, **kwargs)`` in one transaction on a pool thread.

        Returns what ``fn`` returns, after running the callbacks registered with
        ``txn.call_after``. Raises what ``fn`` raised (nothing is committed then).
        """
        if self._closed:
            raise RuntimeError(f"database is closed (interaction {description!r})")
        start = time.perf_counter()
        self._in_flight += 1
        try:
            result, after = await threads.deferToThreadPool(
                self.reactor, self._threadpool, self._run_in_thread, description, fn, args, kwargs
            )
        except BaseException:
            transaction_outcomes.labels(description, "error").inc()
            raise
        finally:
            transaction_seconds.labels(description).observe(time.perf_counter() - start)
            self._in_flight -= 1
            if self._in_flight == 0 and self._drained:
                waiting, self._drained = self._drained, []
                for d in waiting:
                    d.callback(None)
        transaction_outcomes.labels(description, "commit").inc()
        for callback, cb_args, cb_kwargs in after:
            callback(*cb_args, **cb_kwargs)
        return result

    async def run_blocking(self, fn: Callable[..., R], *args: Any) -> R:
        """Run a blocking ``fn(*args)`` that is not a transaction (e.g. taking
        a lock on a connection of its own) on the pool's threads."""
        if self._closed:
            raise RuntimeError("database is closed")
        return await threads.deferToThreadPool(self.reactor, self._threadpool, fn, *args)

    def run_interaction_deferred(
        self, description: str, fn: Callable[..., R], *args: Any, **kwargs: Any
    ) -> "defer.Deferred[R]":
        """``run_interaction`` for callers that want a Deferred."""
        return defer.ensureDeferred(self.run_interaction(description, fn, *args, **kwargs))

    async def close(self) -> None:
        """Close every connection and stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight:
            # New interactions are refused from here on; let running ones finish.
            drained: defer.Deferred = defer.Deferred()
            self._drained.append(drained)
            await drained

        def close_all() -> None:
            with self._connections_lock:
                conns, self._connections = self._connections, []
            for conn in conns:
                try:
                    conn.close()
                except Exception:
                    pass

        await threads.deferToThreadPool(self.reactor, self._threadpool, close_all)
        if self._shutdown_trigger is not None:
            self.reactor.removeSystemEventTrigger(self._shutdown_trigger)
            self._shutdown_trigger = None
        self._threadpool.stop()


async def open_database(url: str, reactor: Any = None, schema_dir: str | None = None) -> Database:
    """Open the database a URL names and bring its schema up to date."""
    db = Database.from_url(url, reactor)
    try:
        await db.prepare(schema_dir)
    except BaseException:
        await db.close()
        raise
    return db
