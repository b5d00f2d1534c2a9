"""A cursor inside one transaction, handed to interaction functions.

``Database.run_interaction`` (``roomstore.storage.database``) opens the
transaction, runs the function with a ``Transaction`` and commits or rolls
back; the ``Transaction`` binds SQL written once with ``?`` placeholders for
its engine, batches writes where the engine can, reserves serial ids, runs
trial writes in a savepoint, and collects what must happen after the commit
(``call_after``). Kept apart from the pool so that code which only runs inside
a transaction (schema migrations, the tables' SQL) needs nothing of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from roomstore.storage.engines import Engine, Row

#: A function ``call_after`` queued, with its arguments: run once the transaction commits.
AfterCallback = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

R = TypeVar("R")


class RetryTransaction(Exception):
    """Raised by an interaction function to roll back and run again.

    For conflicts the database did not report itself, e.g. a row another
    writer committed after this transaction's snapshot was taken.
    """


class Transaction:
    """A cursor inside one transaction, handed to interaction functions.

    SQL uses ``?`` placeholders and is converted for the engine. Only the
    thread running the interaction may use it.
    """

    def __init__(self, db: Any, engine: Engine, cursor: Any, description: str):
        # db: the pool that opened the transaction; only its statement
        # counter (``_count_query``) is used here.
        self.db = db
        self.engine = engine
        self.description = description
        self._cursor = cursor
        self._after_callbacks: list[AfterCallback] = []
        self._allocated: dict[tuple[str, str], int] = {}
        self._free_ids: dict[tuple[str, str], list[int]] = {}
        self._queued: list[bytes] = []
        #: What this transaction learned of the database, for a later step of
        #: it to reuse instead of asking again: owner -> {key: value}. Put
        #: back as it was when a trial run (``undone``) rolls back.
        self.memo: dict[object, dict[Any, Any]] = {}
        #: True once a statement that may write has run (anything but a plain
        #: SELECT); ``finish`` then asks the server for the transaction's id.
        self.wrote = False
        #: The server's id of this transaction once ``finish`` ran, if it
        #: wrote: what the pool asks about when a COMMIT goes unanswered.
        self.xid: str | None = None

    # --- SQL -------------------------------------------------------------

    def execute(self, sql: str, args: Sequence[Any] = (), prepare: bool = False) -> Transaction:
        """Run ``sql`` with ``args`` bound to its ``?`` placeholders.

        ``prepare=True``, for a hot read whose planning costs more than its
        running: PostgreSQL keeps the statement prepared on this connection
        (``Engine.execute_prepared``), so later calls skip parsing and
        analysis, and after five may reuse a generic plan. Every ``?`` must
        have a type the server can infer from where it stands (a column it
        is compared with, ``LIMIT``...): one it cannot, as in ``SELECT ?``,
        comes back as text. SQLite runs it as usual (its statement cache
        already reuses the parse).
        """
        self.flush_queue()
        self.db._count_query()
        if prepare:
            self.engine.execute_prepared(self._cursor, sql, args)
        else:
            if not self.wrote and not _is_plain_select(sql):
                self.wrote = True
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
        if not self.engine.batches_writes:
            self.execute(sql, args)
            return
        self.db._count_query()
        self.wrote = True
        self._queued.append(self.engine.bind_statement(self._cursor, sql, args))

    def flush_queue(self) -> None:
        """Send the queued statements (see ``queue``) now."""
        if self._queued:
            statements, self._queued = self._queued, []
            # No arguments: the text is sent as it is (already bound).
            self._cursor.execute(b";\n".join(statements))

    def finish(self) -> None:
        """Before commit (the pool calls it): send what is queued and, where
        connections can be lost and this transaction wrote, learn its id
        (``xid``), in the same round trip as the queued statements if any."""
        xid_sql = self.engine.xid_sql
        if xid_sql is None or not self.wrote:
            self.flush_queue()
            return
        statements, self._queued = self._queued, []
        self._cursor.execute(b";\n".join([*statements, xid_sql.encode()]))
        row = self._cursor.fetchone()
        self.xid = row[0] if row else None

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = [tuple(r) for r in rows]
        if not rows:
            return
        self.flush_queue()
        self.db._count_query()
        self.wrote = True
        self._cursor.executemany(self.engine.convert_sql(sql), rows)

    def insert_many(
        self,
        table: str,
        columns: Sequence[str],
        rows: Iterable[Sequence[Any]],
        on_conflict: str = "",
        returning: str = "",
        queue: bool = False,
    ) -> list[Row] | None:
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
        tuples = [tuple(r) for r in rows]
        if returning and not self.engine.returns_inserted_rows:
            raise ValueError("insert_many(returning=...) needs PostgreSQL")
        if returning and queue:
            raise ValueError("insert_many: a queued insert cannot return rows")
        if not tuples:
            return [] if returning else None
        self.wrote = True
        if queue and self.engine.batches_writes:
            for statement in self.engine.bind_insert(self._cursor, table, columns, tuples, on_conflict):
                self.db._count_query()
                self._queued.append(statement)
            return None
        self.flush_queue()
        self.db._count_query()
        return self.engine.insert_rows(self._cursor, table, columns, tuples, on_conflict, returning)

    def copy_rows(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
        """Bulk-load ``rows`` (new rows only: no conflict clause) the fastest
        way the engine has: ``COPY ... FROM STDIN`` on PostgreSQL, one
        ``executemany`` of a prepared INSERT on SQLite. ``table`` and
        ``columns`` are the caller's SQL, values are bound or escaped by the
        engine. Queued writes are sent first, so order is kept. Returns the
        number of rows."""
        tuples = [tuple(r) for r in rows]
        if not tuples:
            return 0
        self.wrote = True
        self.flush_queue()
        self.db._count_query()
        self.engine.copy_rows(self._cursor, table, columns, tuples)
        return len(tuples)

    def fetchone(self) -> Row | None:
        row: Row | None = self._cursor.fetchone()
        return row

    def fetchall(self) -> list[Row]:
        rows: list[Row] = self._cursor.fetchall()
        return rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self._cursor)

    @property
    def connection(self) -> Any:
        """The connection this attempt runs on (a new one after a lost one)."""
        return self._cursor.connection

    @property
    def rowcount(self) -> int:
        count: int = self._cursor.rowcount
        return count

    def allocate_ids(self, table: str, column: str, count: int) -> list[int]:
        """Reserve ``count`` new ids for a serial primary key, to insert in bulk.

        PostgreSQL takes them from the column's sequence (never reused);
        SQLite counts up from the current maximum, which is safe because
        ``BEGIN IMMEDIATE`` makes this the only writer of the file.
        """
        if count <= 0:
            return []
        if self.engine.serial_ids_sql is not None:
            rows = self.execute(self.engine.serial_ids_sql, (table, column, count)).fetchall()
            return sorted(r[0] for r in rows)
        top = self.select_one_value(f"SELECT COALESCE(MAX({column}), 0) FROM {table}")
        # Two allocations before the rows are inserted must not overlap.
        top = max(top, self._allocated.get((table, column), 0))
        self._allocated[(table, column)] = top + count
        return list(range(top + 1, top + 1 + count))

    def reserve_ids(self, requests: Sequence[tuple[str, str, int]]) -> None:
        """Reserve ids for several serial keys, ``(table, column, count)``
        each, for ``next_id`` to hand out: on PostgreSQL in one statement
        where ``next_id`` would have made one per table; elsewhere nothing
        is done now (SQLite's ids cost no round trip)."""
        sql = self.engine.serial_ids_sql
        wanted = [(t, c, n) for t, c, n in requests if n > 0 and not self._free_ids.get((t, c))]
        if sql is None or not wanted:
            return
        union = " UNION ALL ".join(sql.replace("SELECT ", f"SELECT {index}, ", 1) for index in range(len(wanted)))
        rows = self.execute(union, [value for request in wanted for value in request]).fetchall()
        for index, (table, column, _count) in enumerate(wanted):
            self._free_ids[(table, column)] = sorted((r[1] for r in rows if r[0] == index), reverse=True)

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
        memo = {owner: _copied(known) for owner, known in self.memo.items()}
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
            self._allocated, self._free_ids, self.memo = allocated, free, memo

    def select_one_value(self, sql: str, args: Sequence[Any] = ()) -> Any:
        row = self.execute(sql, args).fetchone()
        return None if row is None else row[0]

    # --- commit hooks ----------------------------------------------------

    def call_after(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` on the reactor thread after a successful commit.

        Dropped if this attempt rolls back (a retry registers its own).
        """
        self._after_callbacks.append((fn, args, kwargs))


def _copied(known: dict[Any, Any]) -> dict[Any, Any]:
    """A memo's entries, their set and dict values copied (not shared with the trial run's)."""
    return {key: value.copy() if isinstance(value, (set, dict)) else value for key, value in known.items()}


def _is_plain_select(sql: str) -> bool:
    """A statement that writes nothing (a plain SELECT; ``WITH`` may hide a write)."""
    return sql.lstrip()[:6].upper() == "SELECT"
