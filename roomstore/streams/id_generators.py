"""Stream ID generators with reserve/complete semantics.

A stream is an append-only log of facts, each with a stream ID; writers
reserve an ID, write the fact in a transaction, then complete the ID (a
rolled-back write completes too). Definitions, from docs/streams (the seed):

- the *per-writer* current position of writer W is the largest ID such that
  every fact W added with an equal or smaller ID has completed;
- the *linear* current position is the largest ID such that every fact, by any
  writer, with an equal or smaller ID has completed: the minimum over writers.

IDs come from a PostgreSQL sequence (``nextval``) where there is PostgreSQL, so
several writer processes share one ID space; on SQLite from an in-process
counter, which is only sound for a single writer (a multi-writer stream on
SQLite is refused). Positions are persisted in ``stream_positions`` and
recovered at start-up, together with the newest IDs in the stream's backing
tables, so a crash between a fact's commit and the position update loses
nothing.

Who calls it: writers use ``get_next``/``get_next_mult`` (IDs of several
streams at once, or inside the caller's transaction: ``reservations``);
readers learning positions over replication call ``advance``; anything that
must wait for a position uses ``wait_for_position``.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TypeVar

import attrs
from prometheus_client import Gauge
from twisted.internet import defer
from twisted.logger import Logger

from roomstore.storage.database import Database, Transaction
from roomstore.storage.errors import StorageFullError

log = Logger()
R = TypeVar("R")

stream_position_gauge = Gauge(
    "roomstore_stream_position",
    "Per-writer current position of each stream, as this process knows it",
    # "writer", not "instance": Prometheus sets "instance" on every scraped series (the target).
    ["stream", "writer"],
)
stream_linear_position_gauge = Gauge(
    "roomstore_stream_linear_position",
    "Linear (minimum over writers) current position of each stream",
    ["stream"],
)


def _linear_position(positions: dict[str, int]) -> int:
    return min(positions.values())


def _writer_position(positions: dict[str, int], writer: str) -> int:
    return positions.get(writer, 0)


class StreamConfigError(ValueError):
    """A stream is configured in a way the database cannot support."""


class SequenceLagError(RuntimeError):
    """A PostgreSQL sequence is behind IDs already used: new IDs would repeat."""


@attrs.frozen
class BackingTable:
    """A table whose rows carry a stream's IDs, read at start-up for recovery.

    ``instance_column`` is None when every row belongs to the one writer.
    ``negate`` is for tables that store IDs as negative numbers (backfill).
    ``newest_ids_sql``: the statement reading the newest IDs, from the table's
    owner, so a store table's SQL stays there: rows ``(instance, newest ID)``
    with an ``instance_column``, else one value, of IDs above 0. None (an
    embedder's own table, named by the embedder): built from the names above.
    """

    table: str
    id_column: str
    instance_column: str | None = None
    negate: bool = False
    newest_ids_sql: str | None = None

    def newest_ids_statement(self) -> str:
        """``newest_ids_sql``, or the statement built from the names."""
        if self.newest_ids_sql is not None:
            return self.newest_ids_sql
        id_expr = f"-{self.id_column}" if self.negate else self.id_column
        if self.instance_column:
            return (
                f"SELECT {self.instance_column}, MAX({id_expr}) FROM {self.table}"
                f" WHERE {id_expr} > 0 GROUP BY {self.instance_column}"
            )
        return f"SELECT MAX({id_expr}) FROM {self.table} WHERE {id_expr} > 0"


def persisted_positions_txn(txn: Transaction, stream_name: str) -> dict[str, int]:
    """Each writer's position of ``stream_name`` as written to ``stream_positions``."""
    return dict(
        txn.execute(
            "SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = ?", (stream_name,)
        ).fetchall()
    )


class StreamIdGenerator:
    """Allocates, tracks and persists the IDs of one stream.

    Construct with ``await StreamIdGenerator.create(db, stream_name,
    instance_name, writers=[...], backing_tables=[...])``. ``writers`` lists
    every instance that writes the stream (a single-writer stream has one);
    this process may write only if ``instance_name`` is among them.
    """

    def __init__(
        self,
        db: Database,
        stream_name: str,
        instance_name: str,
        writers: Sequence[str],
        backing_tables: Sequence[BackingTable] = (),
        sequence_name: str | None = None,
        read_only: bool = False,
    ):
        if not writers:
            raise StreamConfigError(f"stream {stream_name!r} has no writers")
        if len(set(writers)) != len(writers):
            raise StreamConfigError(f"stream {stream_name!r} lists a writer twice: {list(writers)}")
        if len(writers) > 1 and not db.engine.supports_sequences:
            raise StreamConfigError(
                f"stream {stream_name!r} has {len(writers)} writers {list(writers)}, but "
                f"{db.engine.describe()} has no shared sequences: a multi-writer stream needs PostgreSQL"
            )
        self.db = db
        self.stream_name = stream_name
        self.instance_name = instance_name
        self.writers = tuple(writers)
        # A read-only process never writes, also under a writer's name.
        self.is_writer = instance_name in self.writers and not read_only
        self._backing_tables = tuple(backing_tables)
        self._sequence = sequence_name or f"{stream_name}_stream_seq"
        self._use_sequence = db.engine.supports_sequences

        self._positions: dict[str, int] = {w: 0 for w in self.writers}
        # IDs this process reserved and has not completed, sorted.
        self._unfinished: list[int] = []
        # For each allocation still waiting on the database: _max_seen when
        # it started. Its IDs are above that, and until they are known no
        # position may pass it.
        self._allocating: list[int] = []
        # Largest ID this process has reserved or heard of from any writer.
        self._max_seen = 0
        # In-process counter (SQLite): next ID to hand out is _last_allocated + 1.
        self._last_allocated = 0
        self._counter_lock = threading.Lock()
        self._waiters: list[tuple[int, str | None, defer.Deferred[int]]] = []

        self._persisted: dict[str, int] = {}
        self._persist_running = False
        self._persist_again = False
        self._persist_done: list[defer.Deferred[None]] = []

    # ------------------------------------------------------------------ start-up

    @classmethod
    async def create(
        cls,
        db: Database,
        stream_name: str,
        instance_name: str,
        writers: Sequence[str] | None = None,
        backing_tables: Sequence[BackingTable] = (),
        sequence_name: str | None = None,
        read_only: bool = False,
    ) -> StreamIdGenerator:
        """Build a generator and recover its positions from the database.

        ``read_only``: this process reads the stream only (no IDs, no position
        writes), even if ``instance_name`` is one of its writers.
        """
        gen = cls(db, stream_name, instance_name, writers or [instance_name], backing_tables, sequence_name, read_only)
        await db.run_interaction(f"load_stream_positions:{stream_name}", gen._load_txn)
        gen._publish_metrics()
        if gen.is_writer and gen._persisted.get(instance_name, -1) < gen._positions[instance_name]:
            # Recovered past what was persisted (rows newer than the last
            # position write): record it, so other processes starting now
            # need not wait for our next write to see it.
            await gen.flush()
        return gen

    def _load_txn(self, txn: Transaction) -> None:
        stored = persisted_positions_txn(txn, self.stream_name)
        newest_row_by_writer: dict[str, int] = {}
        newest_row = 0
        for backing in self._backing_tables:
            if backing.instance_column:
                rows = txn.execute(backing.newest_ids_statement()).fetchall()
            else:
                value = txn.select_one_value(backing.newest_ids_statement())
                rows = [(self.writers[0], value)] if value is not None else []
            for instance, value in rows:
                if value is None:
                    continue
                newest_row = max(newest_row, value)
                newest_row_by_writer[instance] = max(newest_row_by_writer.get(instance, 0), value)

        for writer in self.writers:
            if writer != self.instance_name and writer in stored:
                # Another process's position: the newest row it wrote may sit
                # above an ID it is still writing, while its persisted
                # position never does. Replication moves it on from there.
                self._positions[writer] = stored[writer]
            else:
                # Our own (nothing of ours is in flight at start-up), or a
                # writer that never persisted one: its rows are all we know.
                self._positions[writer] = max(stored.get(writer, 0), newest_row_by_writer.get(writer, 0))
        highest = max([newest_row, *stored.values(), *self._positions.values(), 0])
        self._persisted = {w: stored[w] for w in self.writers if w in stored}

        if self._use_sequence:
            row = txn.execute(f"SELECT last_value, is_called FROM {self._sequence}").fetchone()
            if row is None:
                raise StreamConfigError(f"sequence {self._sequence} is missing")
            last_value, is_called = row
            sequence_at = last_value if is_called else last_value - 1
            if sequence_at < highest:
                raise SequenceLagError(
                    f"PostgreSQL sequence {self._sequence} is at {sequence_at} but stream "
                    f"{self.stream_name!r} already used IDs up to {highest}; new IDs would repeat. "
                    f"Fix it with: SELECT setval('{self._sequence}', {highest});"
                )
            self._max_seen = max(highest, sequence_at)
        else:
            self._last_allocated = highest
            self._max_seen = highest

        if self.is_writer:
            # Nothing of ours is in flight after a restart: we are caught up to
            # everything allocated so far.
            self._positions[self.instance_name] = max(self._positions[self.instance_name], self._max_seen)

    # ------------------------------------------------------------------ reading

    def get_current_token(self) -> int:
        """The linear position: every fact at or below it has completed."""
        return min(self._positions.values())

    def get_current_token_for_writer(self, instance_name: str) -> int:
        """The per-writer position of ``instance_name``."""
        try:
            return self._positions[instance_name]
        except KeyError:
            raise KeyError(f"{instance_name!r} is not a writer of stream {self.stream_name!r}") from None

    def get_max_token(self) -> int:
        """The largest per-writer position: readers may peek up to here per writer."""
        return max(self._positions.values())

    async def read_persisted_positions(self) -> dict[str, int]:
        """Every writer's position as last written to ``stream_positions``:
        what a reader may catch up to from the database when no live process
        of that writer is left to announce it (each is complete up to there)."""
        return await self.db.run_interaction(
            f"read_stream_positions:{self.stream_name}", persisted_positions_txn, self.stream_name
        )

    def get_positions(self) -> dict[str, int]:
        return dict(self._positions)

    def get_unfinished(self) -> list[int]:
        return list(self._unfinished)

    # ------------------------------------------------------------------ writing

    def get_next(self) -> contextlib.AbstractAsyncContextManager[int]:
        """``async with gen.get_next() as stream_id``: reserve one ID, complete on exit."""
        return self._reserve_one()

    def get_next_mult(self, n: int) -> contextlib.AbstractAsyncContextManager[list[int]]:
        """``async with gen.get_next_mult(n) as ids``: reserve ``n`` ascending IDs."""
        return self._reserve_many(n)

    @contextlib.asynccontextmanager
    async def _reserve_one(self) -> AsyncIterator[int]:
        async with self._reserve_many(1) as ids:
            yield ids[0]

    @contextlib.asynccontextmanager
    async def _reserve_many(self, n: int) -> AsyncIterator[list[int]]:
        # The steps ``reservations.reserve_together`` takes for several generators, for this one.
        # Here 0 is an error; reserve_together takes it as "none of this stream".
        floor = self._begin_allocation(n)
        try:
            if self._use_sequence:
                ids = await self.db.run_interaction(f"allocate_stream_ids:{self.stream_name}", self._allocate_txn, n)
            else:
                ids = self._allocate_locally(n)
        except BaseException:
            self._end_allocation(floor, None)
            raise
        self._end_allocation(floor, ids)
        try:
            yield ids
        finally:
            # Completion happens whether the body succeeded or raised.
            self._complete(ids)

    def _check_reservation(self, n: int) -> None:
        if not self.is_writer:
            raise StreamConfigError(
                f"{self.instance_name!r} is not a writer of stream {self.stream_name!r} (writers: {list(self.writers)})"
            )
        if n < 1:
            raise ValueError("must reserve at least one ID")

    def _begin_allocation(self, n: int) -> int:
        """Checks, then holds this writer's position until ``_end_allocation``; returns the floor."""
        self._check_reservation(n)
        floor = self._max_seen
        self._allocating.append(floor)
        return floor

    def _end_allocation(self, floor: int, ids: Sequence[int] | None) -> None:
        """The allocation from ``floor`` returned ``ids`` (None: it failed)."""
        # No await between here and the insort: the IDs become unfinished in
        # the same step as the allocation stops holding the position back
        # (first unfinished, then out of ``_allocating``: see ``_reached_by``).
        if ids is None:
            self._allocating.remove(floor)
            self._recompute_own_position()
            return
        for stream_id in ids:
            bisect.insort(self._unfinished, stream_id)
        self._max_seen = max(self._max_seen, ids[-1])
        self._allocating.remove(floor)

    def _allocate_locally(self, n: int) -> list[int]:
        # Also called on a transaction's thread (reserve_in_transaction).
        with self._counter_lock:
            first = self._last_allocated + 1
            self._last_allocated += n
        return list(range(first, first + n))

    def _allocate_txn(self, txn: Transaction, n: int) -> list[int]:
        rows = txn.execute(f"SELECT nextval('{self._sequence}') FROM generate_series(1, ?)", (n,)).fetchall()
        return sorted(r[0] for r in rows)

    def _complete(self, ids: Iterable[int]) -> None:
        for stream_id in ids:
            index = bisect.bisect_left(self._unfinished, stream_id)
            if index < len(self._unfinished) and self._unfinished[index] == stream_id:
                del self._unfinished[index]
        self._recompute_own_position()

    def _recompute_own_position(self) -> None:
        if not self.is_writer:
            return
        if self._unfinished:
            own = self._unfinished[0] - 1
        else:
            # Nothing of ours in flight: every ID allocated so far that is ours
            # has completed, so we are at the newest ID we know of.
            own = self._max_seen
        if self._allocating:
            # An allocation whose result has not reached us yet holds IDs
            # above its floor that may be below IDs already completed.
            own = min(own, min(self._allocating))
        if own > self._positions[self.instance_name]:
            self._positions[self.instance_name] = own
            self._on_positions_changed()
            self._schedule_persist()

    # ------------------------------------------------------------------ readers

    def advance(self, instance_name: str, new_id: int) -> None:
        """A position learnt from elsewhere (replication): ``instance_name`` is at ``new_id``.

        Never moves a position backwards. An idle local writer moves up with
        it, since it has nothing in flight at or below ``new_id``.
        """
        if instance_name not in self._positions:
            log.warn(
                "stream {stream}: position from unknown writer {instance}; ignored",
                stream=self.stream_name,
                instance=instance_name,
            )
            return
        self._max_seen = max(self._max_seen, new_id)
        if not self._use_sequence:
            with self._counter_lock:
                self._last_allocated = max(self._last_allocated, new_id)
        changed = False
        if new_id > self._positions[instance_name]:
            self._positions[instance_name] = new_id
            changed = True
        if changed:
            self._on_positions_changed()
        self._recompute_own_position()

    def wait_for_position(self, token: int, instance_name: str | None = None) -> defer.Deferred[int]:
        """A Deferred firing (with the position) once the stream reaches ``token``.

        With ``instance_name`` it waits for that writer's position, otherwise
        for the linear position.
        """
        current = self._position_of(instance_name)
        if current >= token:
            return defer.succeed(current)
        d: defer.Deferred[int] = defer.Deferred(lambda d: self._forget_waiter(d))
        self._waiters.append((token, instance_name, d))
        return d

    def _forget_waiter(self, d: defer.Deferred[int]) -> None:
        self._waiters = [w for w in self._waiters if w[2] is not d]

    def _position_of(self, instance_name: str | None) -> int:
        if instance_name is None:
            return self.get_current_token()
        return self.get_current_token_for_writer(instance_name)

    def _on_positions_changed(self) -> None:
        if not self._waiters:
            return
        remaining = []
        ready = []
        for token, instance, d in self._waiters:
            current = self._position_of(instance)
            if current >= token:
                ready.append((d, current))
            else:
                remaining.append((token, instance, d))
        self._waiters = remaining
        for d, current in ready:
            d.callback(current)

    def _publish_metrics(self) -> None:
        # The gauges read the positions when scraped: nothing to do per
        # position update, which a replicating worker makes for every token
        # (a gauge's set takes a lock, which cost more than the update). The
        # newest generator of a stream in a process reports it.
        for writer in self._positions:
            stream_position_gauge.labels(self.stream_name, writer).set_function(
                functools.partial(_writer_position, self._positions, writer)
            )
        # The positions alone, not the generator: the registry outlives it.
        stream_linear_position_gauge.labels(self.stream_name).set_function(
            functools.partial(_linear_position, self._positions)
        )

    # ------------------------------------------------------------------ persistence

    def position_after(self, ids: Sequence[int]) -> int | None:
        """The position this writer will be at once ``ids`` complete, if known now.

        Known when nothing else of ours is reserved or being allocated: then
        every ID of ours below ``ids`` has completed, and completing ``ids``
        takes this writer to at least ``max(ids)``. The transaction writing
        ``ids``' facts may then persist it (``persist_position_txn``), which
        spares a transaction of its own afterwards. Call on the reactor thread.
        """
        if not self.is_writer or not ids or self._allocating:
            return None
        ours = set(ids)
        if any(stream_id not in ours for stream_id in self._unfinished):
            return None
        return max(ids)

    def _reached_by(self, ids: Sequence[int]) -> int | None:
        """``position_after(ids)`` asked on ``reserve_in_transaction``'s thread: an
        allocation beginning after this read takes higher IDs; one ending during it
        is in a list (``_end_allocation`` lists IDs before leaving ``_allocating``)."""
        if not self.is_writer or not ids:
            return None
        if len(self._allocating) != 1 or self._unfinished:
            return None
        return max(ids)

    def persist_position_txn(self, txn: Transaction, position: int) -> None:
        """Write ``position`` (from ``position_after``) inside the caller's transaction."""
        persist_positions_txn(txn, [(self, position)])

    def _note_persisted(self, position: int) -> None:
        if position > self._persisted.get(self.instance_name, -1):
            self._persisted[self.instance_name] = position

    def _schedule_persist(self) -> None:
        if self._persist_running:
            self._persist_again = True
            return
        self._persist_running = True
        defer.ensureDeferred(self._persist_loop())

    async def _persist_loop(self) -> None:
        try:
            while True:
                self._persist_again = False
                position = self._positions[self.instance_name]
                if self.db.closed:
                    # Shutting down without close(): start-up recovers the
                    # position from the backing tables instead.
                    break
                if self._persisted.get(self.instance_name, -1) < position:
                    try:
                        await self.db.run_interaction(
                            f"persist_stream_position:{self.stream_name}",
                            self._persist_txn,
                            self.instance_name,
                            position,
                        )
                        self._note_persisted(position)
                    except StorageFullError as exc:
                        # Out of space: the writes of the facts fail too, and
                        # say so; this one loses nothing (see below).
                        log.info("stream {stream}: could not persist position: {exc}", stream=self.stream_name, exc=exc)
                    except Exception:
                        # Recovery at start-up also reads the backing tables, so
                        # a failed write here loses nothing; log and carry on.
                        log.failure("stream {stream}: could not persist position", stream=self.stream_name)
                if not self._persist_again:
                    break
        finally:
            self._persist_running = False
            done, self._persist_done = self._persist_done, []
            for d in done:
                d.callback(None)

    def _persist_txn(self, txn: Transaction, instance_name: str, position: int) -> None:
        _upsert_positions(txn, [(self.stream_name, instance_name, position)])

    async def flush(self) -> None:
        """Wait until this writer's current position is written to the database."""
        if not self.is_writer:
            return
        if self._persist_running:
            d: defer.Deferred[None] = defer.Deferred()
            self._persist_done.append(d)
            await d
        if self._persisted.get(self.instance_name, -1) < self._positions[self.instance_name]:
            self._schedule_persist()
            if self._persist_running:
                d = defer.Deferred()
                self._persist_done.append(d)
                await d

    async def close(self) -> None:
        """Persist the final position; call before closing the database."""
        await self.flush()

    def __repr__(self) -> str:
        return (
            f"<StreamIdGenerator {self.stream_name} instance={self.instance_name} "
            f"positions={self._positions} unfinished={self._unfinished}>"
        )


def _upsert_positions(txn: Transaction, rows: Sequence[tuple[str, str, int]]) -> None:
    # The greatest position wins, so a slow, stale write never moves it back.
    txn.insert_many(
        "stream_positions",
        ("stream_name", "instance_name", "stream_id"),
        rows,
        on_conflict="ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id ="
        " CASE WHEN excluded.stream_id > stream_positions.stream_id"
        " THEN excluded.stream_id ELSE stream_positions.stream_id END",
        queue=True,
    )


def persist_positions_txn(txn: Transaction, positions: Sequence[tuple[StreamIdGenerator, int]]) -> None:
    """Write several writers' positions (each from ``position_after``) in one
    statement of the caller's transaction."""
    _upsert_positions(txn, [(gen.stream_name, gen.instance_name, position) for gen, position in positions])
    for gen, position in positions:
        txn.call_after(gen._note_persisted, position)
