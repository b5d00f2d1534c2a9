"""The connection pool: named transactions run on a thread pool.

``Database.run_interaction(description, fn, *args)`` runs ``fn(txn, *args)`` in
a worker thread inside one transaction that commits whole or rolls back whole.
Serialisation failures and deadlocks (PostgreSQL) and a locked file (SQLite)
make the pool roll back and run ``fn`` again, so ``fn`` must not have effects
outside the transaction; effects that belong to a successful commit (cache
updates, notifications) are registered with ``txn.call_after`` and run on the
reactor thread once the commit has happened. A connection that dies (the
server restarted, the backend was terminated) is dropped and the transaction
run again on a new one after a backoff (``reconnect.py``); a COMMIT left
unanswered is first settled by asking the server (see ``run_interaction``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from prometheus_client import Counter, Histogram
from twisted.internet import defer, threads
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from roomstore.storage.engines import Engine, engine_from_url
from roomstore.storage.errors import DatabaseUnavailableError, StorageFullError
from roomstore.storage.reconnect import Backoff, ConnectionLost, Outages
from roomstore.storage.transaction import AfterCallback, RetryTransaction, Transaction

if TYPE_CHECKING:  # embedder_schema imports this module's neighbours; only its type is needed here
    from roomstore.storage.embedder_schema import EmbedderSchema

__all__ = ["Database", "RetryTransaction", "Transaction", "open_database", "run_transaction"]

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


def run_transaction(
    engine: Engine,
    connection: Callable[[], Any],
    body: Callable[[Any], R],
    *,
    attempts: int = MAX_ATTEMPTS,
    backoff_s: float = 0.005,
    max_backoff_s: float = 0.5,
    on_retry: Callable[[], None] | None = None,
    on_connection_lost: Callable[[BaseException, Any, bool], None] | None = None,
) -> R:
    """``body(cursor)`` in one transaction on ``connection()``: committed
    whole, or rolled back and raised.

    The one retry loop of roomstore (the pool's interactions and the offline
    jobs' plain connections). Serialisation failures, deadlocks, a locked
    SQLite file and :class:`RetryTransaction` roll back and run ``body`` again,
    after ``backoff_s * 2**attempt`` seconds (at most ``max_backoff_s``), up
    to ``attempts`` times. With ``on_connection_lost``, a connection that
    died (or could not be opened) is reported to it as ``(exc, conn,
    committing)`` (``committing``: it died while COMMIT was on its way), and
    it raises (the pool's ``ConnectionLost``); without, the error is raised.
    """
    attempt = 0
    while True:
        attempt += 1
        conn = cursor = None
        committing = False
        try:
            conn = connection()
            cursor = conn.cursor()
            engine.begin(cursor)
            result = body(cursor)
            committing = True
            conn.commit()
            return result
        except BaseException as exc:
            if conn is not None:
                try:
                    conn.rollback()
                except Exception:
                    pass
            if on_connection_lost is not None and engine.is_connection_lost(exc, conn):
                on_connection_lost(exc, conn, committing)
                raise
            if (isinstance(exc, RetryTransaction) or engine.is_retryable(exc)) and attempt < attempts:
                if on_retry is not None:
                    on_retry()
                time.sleep(min(backoff_s * 2**attempt, max_backoff_s))
                continue
            if engine.is_storage_full(exc):
                reason = " ".join(str(exc).split())  # one line (PostgreSQL adds a HINT line)
                raise StorageFullError(f"{engine.describe()} is out of space ({reason})") from exc
            raise
        finally:
            if cursor is not None:
                try:
                    cursor.close()
                except Exception:
                    pass


class _TransactionMetrics(NamedTuple):
    """One transaction description's labelled metrics."""

    retries: Any
    seconds: Any
    commits: Any
    errors: Any


class Database:
    """A pool of connections to one database, used through ``run_interaction``.

    Construct with ``Database(engine, reactor)`` or ``Database.from_url(url)``;
    then ``await db.prepare()`` (schema migrations) before use, and
    ``await db.close()`` at the end. Counts every statement in
    ``query_count`` (tests use it to prove a read touched no database).
    """

    def __init__(
        self,
        engine: Engine,
        reactor: Any = None,
        name: str = "db",
        clock: Any = None,
        backoff: Backoff = Backoff(),
        give_up_after_s: float = 60.0,
    ):
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.engine = engine
        self.reactor = reactor
        self._metrics_by_description: dict[str, _TransactionMetrics] = {}
        #: Lost connections and the waits between attempts (reconnect.py);
        #: ``clock`` times the waits (default: the reactor).
        self.outages = Outages(clock if clock is not None else reactor, engine.describe(), backoff, give_up_after_s)
        # Until a first connection was made, a server that cannot be reached
        # is a wrong URL or a server not started: say so at once.
        self._ever_connected = False
        self.query_count = 0
        self._query_lock = threading.Lock()
        self._local = threading.local()
        self._connections: list[Any] = []
        self._connections_lock = threading.Lock()
        self._threadpool = ThreadPool(minthreads=1, maxthreads=engine.max_connections, name=f"roomstore-{name}")
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
        self._drained: list[defer.Deferred[None]] = []

    @classmethod
    def from_url(cls, url: str, reactor: Any = None, create: bool = True, read_only: bool = False) -> Database:
        """``create=False``: a SQLite file that does not exist is refused
        (``DatabaseConfigError``) rather than created. ``read_only``:
        connections that cannot write (``engine_from_url``)."""
        engine = engine_from_url(url, create, read_only)
        engine.check_exists()
        return cls(engine, reactor)

    async def prepare(self, schema_dir: str | None = None, embedder_schemas: Sequence[EmbedderSchema] = ()) -> int:
        """Bring the schema up to date (see ``roomstore.storage.schema``),
        then each of ``embedder_schemas`` (``EmbedderSchema``, in
        ``roomstore.storage.embedder_schema``), in one transaction; returns
        the store's schema version."""
        from roomstore.storage.embedder_schema import prepare_with_embedders_txn

        return await self.run_interaction(
            "prepare_database", prepare_with_embedders_txn, schema_dir, tuple(embedder_schemas)
        )

    async def check_schema(self, embedder_schemas: Sequence[EmbedderSchema] = ()) -> int:
        """The schema version, which must be current, as must each of
        ``embedder_schemas``; writes nothing
        (``roomstore.storage.schema.check_schema_txn``)."""
        from roomstore.storage.embedder_schema import check_embedders_txn

        return await self.run_interaction("check_schema", check_embedders_txn, tuple(embedder_schemas))

    @property
    def closed(self) -> bool:
        return self._closed

    def _count_query(self) -> None:
        with self._query_lock:
            self.query_count += 1

    # --- connections (worker threads only) -------------------------------

    def _get_connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.generation < self.outages.generation:
            # Opened before the last outage began: its server is gone.
            self._drop_connection()
            conn = None
        if conn is None:
            generation = self.outages.generation
            conn = self.engine.connect(pooled=True)
            self._ever_connected = True
            self._local.conn = conn
            self._local.generation = generation
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
        self,
        description: str,
        fn: Callable[..., R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_doubt: tuple[str, tuple[R, list[AfterCallback]]] | None = None,
    ) -> tuple[R, list[AfterCallback]]:
        def lost(exc: BaseException, conn: Any, committing: bool, xid: str | None = None) -> None:
            generation = getattr(self._local, "generation", self.outages.generation)
            if conn is None and not self._ever_connected:
                return  # never reached the server: the error as it is, now
            self._drop_connection()
            pending = (xid, outcome_box[0]) if committing and xid is not None and outcome_box else None
            raise ConnectionLost(exc, generation, pending) from exc

        if in_doubt is not None:
            # The last attempt's COMMIT went unanswered: did it happen?
            xid, outcome = in_doubt
            status = run_transaction(
                self.engine,
                self._get_connection,
                lambda cur: self.engine.transaction_status(cur, xid),
                on_connection_lost=lambda exc, conn, committing: lost(exc, conn, False),
            )
            if status == "committed":
                log.info("{desc}: committed before the connection was lost", desc=description)
                return outcome
            if status == "in progress":
                # The old session is still ending: part of the outage that
                # left the commit in doubt (an older generation), not a new one.
                raise ConnectionLost(
                    RuntimeError(f"transaction {xid} still in progress"), self.outages.generation - 1, in_doubt
                )

        txn_box: list[Transaction] = []
        outcome_box: list[tuple[R, list[AfterCallback]]] = []

        def body(cursor: Any) -> tuple[R, list[AfterCallback]]:
            txn = Transaction(self, self.engine, cursor, description)
            txn_box[:] = [txn]
            result = fn(txn, *args, **kwargs)
            txn.finish()
            outcome_box[:] = [(result, txn._after_callbacks)]
            return outcome_box[0]

        return run_transaction(
            self.engine,
            self._get_connection,
            body,
            on_retry=self._metrics(description).retries.inc,
            on_connection_lost=lambda exc, conn, committing: lost(
                exc, conn, committing, txn_box[0].xid if txn_box else None
            ),
        )

    def _metrics(self, description: str) -> _TransactionMetrics:
        """``description``'s transaction metrics: labelled once, not per
        transaction (``labels`` takes a lock and builds its key every time)."""
        found = self._metrics_by_description.get(description)
        if found is None:
            found = self._metrics_by_description[description] = _TransactionMetrics(
                transaction_retries.labels(description),
                transaction_seconds.labels(description),
                transaction_outcomes.labels(description, "commit"),
                transaction_outcomes.labels(description, "error"),
            )
        return found

    async def run_interaction(self, description: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn(txn, *args, **kwargs)`` in one transaction on a pool thread.

        Returns what ``fn`` returns, after running the callbacks registered with
        ``txn.call_after``. Raises what ``fn`` raised (nothing is committed then).

        A connection that dies is dropped and the transaction tried again on a
        new one, after a backoff (``reconnect.py``), for up to
        ``give_up_after_s`` of outage: before COMMIT nothing was written; a
        COMMIT left unanswered is settled first by asking the server whether
        the transaction committed (then ``fn``'s result stands), so ``fn``
        never runs again after its transaction committed.
        """
        if self._closed:
            raise RuntimeError(f"database is closed (interaction {description!r})")
        start = time.perf_counter()
        metrics = self._metrics(description)
        self._in_flight += 1
        attempt = 0
        in_doubt = None
        result: R
        after: list[AfterCallback]
        try:
            while True:
                attempt += 1
                try:
                    result, after = await threads.deferToThreadPool(
                        self.reactor,
                        self._threadpool,
                        self._run_in_thread,
                        description,
                        fn,
                        args,
                        kwargs,
                        in_doubt,
                    )
                    break
                except ConnectionLost as lost:
                    if lost.in_doubt is not None:
                        in_doubt = lost.in_doubt
                    delay = self.outages.lost(lost, attempt)
                    metrics.retries.inc()
                    await deferLater(self.outages.clock, delay, lambda: None)
                    if self._closed:
                        raise DatabaseUnavailableError(
                            f"{self.engine.describe()}: closed while reconnecting ({lost})"
                        ) from None
            self.outages.committed()
        except BaseException:
            metrics.errors.inc()
            raise
        finally:
            metrics.seconds.observe(time.perf_counter() - start)
            self._in_flight -= 1
            if self._in_flight == 0 and self._drained:
                waiting, self._drained = self._drained, []
                for d in waiting:
                    d.callback(None)
        metrics.commits.inc()
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
    ) -> defer.Deferred[R]:
        """``run_interaction`` for callers that want a Deferred."""
        return defer.ensureDeferred(self.run_interaction(description, fn, *args, **kwargs))

    async def close(self) -> None:
        """Close every connection and stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight:
            # New interactions are refused from here on; let running ones finish.
            drained: defer.Deferred[None] = defer.Deferred()
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
