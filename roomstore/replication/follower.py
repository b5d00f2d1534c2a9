"""A worker following the server's streams: positions, batches, catch-up.

:class:`StreamPositions` is the worker's memory of how far it has applied each
``(stream, writer)``; it outlives connections, which is what lets a
reconnecting client ask the server to replay from where it stopped.

:class:`StreamFollower` serves one client connection. It turns RDATA and
POSITION into calls on the worker's handler, in order:

- ``RDATA ... batch`` rows are buffered until the line carrying the token
  arrives; then the handler's ``on_rdata`` is called once with every row of
  that token. Rows at or below the position already applied are dropped
  (after a reconnect the server may replay a few rows we have).
- A ``POSITION`` whose ``prev_token`` is ahead of our position means rows were
  missed: they are fetched with the stream's ``get_updates`` in pages and
  applied before the position moves.
- Work for one stream is done strictly in arrival order (a slow fetch holds
  back the RDATA behind it); different streams do not wait for each other.
- Streams the handler's registry does not know are ignored, with a warning.

Rows from RDATA are JSON-decoded with the top-level array turned into a
tuple, so they look like the tuples ``get_updates`` returns.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from itertools import pairwise
from typing import Any, cast

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from roomstore.replication.commands import PositionCommand, RdataCommand, describe
from roomstore.replication.dispatch import CloseConnection
from roomstore.replication.handler_interface import IBatchHandler, IRowsHandler, ReplicationClientHandler
from roomstore.replication.metrics import APPLIED_POSITION, child
from roomstore.replication.stream_interface import Stream, StreamRow, UnknownStreamError
from roomstore.storage.collector import collector_paused

__all__ = ["StreamFollower", "StreamPositions"]

# Stop warning about new unknown stream names after this many (a confused
# server must not grow our memory or our logs without bound).
_MAX_UNKNOWN_STREAMS_WARNED = 100


class StreamPositions:
    """The last token applied per ``(stream_name, instance_name)``.

    Owned by the client factory, so it survives reconnections; updated only
    by the follower after the handler has applied rows.
    """

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, str], int] = {}

    def get(self, stream_name: str, instance_name: str) -> int | None:
        return self._tokens.get((stream_name, instance_name))

    def set(self, stream_name: str, instance_name: str, token: int) -> None:
        key = (stream_name, instance_name)
        if key not in self._tokens:
            # The gauge reads the position when scraped: nothing to do per
            # token (a set takes a lock, which costs more than applying a
            # row). The newest StreamPositions to track a key reports it.
            child(APPLIED_POSITION, stream_name, instance_name).set_function(partial(self._tokens.get, key, 0))
        self._tokens[key] = token

    def items(self) -> Iterator[tuple[tuple[str, str], int]]:
        return iter(list(self._tokens.items()))

    def resume_tokens(self) -> dict[str, int]:
        """Per stream, the token to resume from after a reconnect.

        The legacy ``REPLICATE <stream> <token>`` has one token for all
        writers, so this is the lowest one; rows the server replays for the
        writers that were further ahead are dropped as duplicates.
        """
        resume: dict[str, int] = {}
        for (stream_name, _instance), token in self._tokens.items():
            resume[stream_name] = min(token, resume.get(stream_name, token))
        return resume


async def _maybe_await(result: Any) -> None:
    if inspect.isawaitable(result):
        await result


def _as_row(value: Any) -> StreamRow:
    return tuple(value) if isinstance(value, list) else value


#: The share of page_size the ranges read ahead aim at (rows per token vary).
_FILL = 0.9


def _by_token(updates: list[tuple[int, StreamRow]]) -> list[tuple[int, list[StreamRow]]]:
    """``(token, rows)`` for each token of ``(token, row)`` pairs in token order."""
    grouped: list[tuple[int, list[StreamRow]]] = []
    last = None
    for token, row in updates:
        if token == last:
            grouped[-1][1].append(row)
        else:
            grouped.append((token, [row]))
            last = token
    return grouped


class StreamFollower:
    """Applies one connection's stream commands through the handler.

    Called by the client session from the protocol's ``on_RDATA`` and
    ``on_POSITION``; may raise :class:`CloseConnection` when the server
    sends more than we are willing to buffer.
    """

    log = Logger()

    def __init__(
        self,
        handler: ReplicationClientHandler,
        positions: StreamPositions,
        *,
        page_size: int = 100,
        max_batch_rows: int = 10_000,
        max_queued: int = 10_000,
        follow_moves_back: bool = True,
        read_ahead: int = 1,
    ) -> None:
        #: Whether a POSITION below what was applied moves the position back
        #: (one server, the source of truth: TCP) or is a stale announcement
        #: to ignore (many publishers, rows applied from the shared database
        #: are complete: Redis).
        self._follow_moves_back = follow_moves_back
        self._handler = handler
        #: The handler as the optional interfaces it declares, or None.
        self._batch_handler = cast(IBatchHandler, handler) if IBatchHandler.providedBy(handler) else None
        self._rows_handler = cast(IRowsHandler, handler) if IRowsHandler.providedBy(handler) else None
        self._positions = positions
        self._page_size = page_size
        #: Pages read while one is applied, filling from the database.
        self._read_ahead = max(1, read_ahead)
        self._max_batch_rows = max_batch_rows
        self._max_queued = max_queued
        self._batches: dict[tuple[str, str], list[StreamRow]] = {}
        self._queues: dict[str, deque[Callable[[], Awaitable[None]]]] = {}
        self._draining: set[str] = set()
        self._warned_unknown: set[str] = set()
        self._stopped = False

    def is_idle(self) -> bool:
        """True if no stream work is queued or running."""
        return not self._draining

    def stop(self) -> None:
        """The connection is gone: drop buffered batches and queued work.

        Work already running finishes (its rows were fetched, so applying
        them keeps positions honest).
        """
        self._stopped = True
        self._batches.clear()
        for queue in self._queues.values():
            queue.clear()

    def drop_partial_batches(self) -> None:
        """Forget ``RDATA ... batch`` rows still waiting for their token (the
        line carrying it was lost with a connection); queued work stays."""
        self._batches.clear()

    def catch_up(self, stream_name: str, writer: str, token: int) -> None:
        """Fetch and apply ``writer``'s rows of ``stream_name`` up to ``token``
        from the database, in order with the stream's other work; nothing
        when this follower is there already (it never moves back)."""
        stream = self._stream(stream_name)
        if stream is None or self._stopped:
            return

        async def work() -> None:
            position = self._positions.get(stream_name, writer)
            if position is None or position >= token:
                return
            await self._fetch_missing(stream, writer, position, token)
            self._positions.set(stream_name, writer, token)
            await _maybe_await(self._handler.on_position(stream_name, writer, position, token))

        self._enqueue(stream_name, work)

    # -- commands in -------------------------------------------------------------

    def on_rdata(self, cmd: RdataCommand) -> None:
        self.on_rdata_fields((cmd.stream_name, cmd.instance_name, cmd.token, cmd.row))

    def on_rdata_fields(self, fields: tuple) -> None:
        """``on_rdata`` for an RDATA line's ``(stream_name, instance_name,
        token or None, row)`` (``parse_rdata_fields``): no command object."""
        stream_name, instance_name, token, row = fields
        if self._stopped or (stream_name not in self._handler.streams and self._stream(stream_name) is None):
            return
        if type(row) is list:
            row = tuple(row)
        if token is None:
            key = (stream_name, instance_name)
            batch = self._batches.setdefault(key, [])
            if len(batch) >= self._max_batch_rows:
                raise CloseConnection(f"batch for {stream_name} longer than {self._max_batch_rows} rows")
            batch.append(row)
            return
        rows = self._batches.pop((stream_name, instance_name), None) if self._batches else None
        if rows is None:
            rows = [row]
        else:
            rows.append(row)
        if stream_name in self._draining:
            self._enqueue(stream_name, partial(self._apply_rows, stream_name, instance_name, token, rows))
        else:
            self._apply_rows_now(stream_name, instance_name, token, rows)

    def on_rdata_run(self, run: tuple) -> None:
        """``on_rdata_fields`` for a run of RDATA lines at once, given as
        ``parse_rdata_lines`` gives them (stream names, instance names,
        tokens, rows): the same rows applied in the same order, each token's
        whole, but a handler with ``on_rdata_batch`` is handed every token of
        the run in one call and the position moves once."""
        streams, instances, tokens, rows = run
        if self._stopped:
            return
        if streams.count(streams[0]) != len(streams) or instances.count(instances[0]) != len(instances):
            # Several streams or writers in one read: each part alone, in order.
            start = 0
            for end in range(1, len(streams) + 1):
                if end == len(streams) or (streams[end], instances[end]) != (streams[start], instances[start]):
                    self._rdata_part(streams[start], instances[start], tokens[start:end], rows[start:end])
                    start = end
            return
        self._rdata_part(streams[0], instances[0], tokens, rows)

    def on_rdata_rows(self, run: tuple) -> None:
        """A read's RDATA lines of one stream and writer, ``(stream_name,
        instance_name, tokens, rows)`` as ``parse_rdata_run`` gives them (a
        token None for ``batch``; rows as decoded): to a handler with
        ``on_rdata_rows`` in one call, rows and tokens as they came, when
        they are the usual page (whole tokens in increasing order after the
        position, nothing buffered or queued for the stream, no batch longer
        than allowed); anything else as ``on_rdata_run`` takes it."""
        stream_name, instance_name, tokens, rows = run
        if self._stopped:
            return
        apply_rows = None if self._rows_handler is None else self._rows_handler.on_rdata_rows
        if (
            apply_rows is None
            or stream_name in self._draining
            or tokens[-1] is None
            or (self._batches and (stream_name, instance_name) in self._batches)
            or (stream_name not in self._handler.streams)
        ):
            self._rdata_part(stream_name, instance_name, tokens, rows)
            return
        numbers = [token for token in tokens if token is not None] if None in tokens else tokens
        position = self._positions.get(stream_name, instance_name)
        if (
            sorted(set(numbers)) != numbers
            or (position is not None and numbers[0] <= position)
            or len(tokens) - len(numbers) > self._max_batch_rows
        ):
            self._rdata_part(stream_name, instance_name, tokens, rows)
            return
        try:
            apply_rows(stream_name, instance_name, tokens, rows)
        except Exception:
            # Token by token instead, as a failed on_rdata_batch.
            self._deliver_tokens(stream_name, instance_name, tokens, rows)
            return
        self._positions.set(stream_name, instance_name, numbers[-1])

    def _deliver_tokens(self, stream_name: str, instance_name: str, tokens: list, rows: list) -> None:
        """Each token's rows (as tuples) through ``on_rdata``, in order (the
        ones after a handler's awaitable queued behind it)."""
        held: list = []
        for token, row in zip(tokens, rows, strict=True):
            held.append(tuple(row) if type(row) is list else row)
            if token is None:
                continue
            if stream_name in self._draining:
                self._enqueue(stream_name, partial(self._apply_rows, stream_name, instance_name, token, held))
            else:
                self._apply_rows_now(stream_name, instance_name, token, held)
            held = []

    def _rdata_part(self, stream_name: str, instance_name: str, tokens: list, rows: list) -> None:
        if self._stopped or (stream_name not in self._handler.streams and self._stream(stream_name) is None):
            return
        rows = [tuple(row) if type(row) is list else row for row in rows]
        key = (stream_name, instance_name)
        held = self._batches.pop(key, None) if self._batches else None
        if held is None and None not in tokens:
            updates = [(token, [row]) for token, row in zip(tokens, rows, strict=True)]
        else:
            # Rows of a token before its line (``batch``): a token's rows are
            # those since the line of the token before (the first ones may
            # have come in an earlier read); rows after the last token's
            # line wait for theirs.
            ends = [index for index, token in enumerate(tokens) if token is not None]
            updates = [(tokens[end], rows[start + 1 : end + 1]) for start, end in pairwise([-1, *ends])]
            if ends:
                if held:
                    updates[0] = (updates[0][0], held + updates[0][1])
                waiting = rows[ends[-1] + 1 :]
            else:
                waiting = held + rows if held else rows
            most = self._max_batch_rows
            too_long = [index for index, (_, batch) in enumerate(updates) if len(batch) > most + 1]
            if too_long or len(waiting) > most:
                # As line by line: what came before the row too many is applied.
                self._deliver(stream_name, instance_name, updates[: too_long[0]] if too_long else updates)
                raise CloseConnection(f"batch for {stream_name} longer than {most} rows")
            if waiting:
                self._batches[key] = waiting
        self._deliver(stream_name, instance_name, updates)

    def _deliver(self, stream_name: str, instance_name: str, updates: list[tuple[int, list]]) -> None:
        """Apply ``updates`` (``(token, rows)``) now, in one call where the
        handler takes batches, or queue them behind the stream's work."""
        if not updates:
            return
        if stream_name in self._draining:
            for token, rows in updates:
                self._enqueue(stream_name, partial(self._apply_rows, stream_name, instance_name, token, rows))
            return
        apply_batch = None if self._batch_handler is None else self._batch_handler.on_rdata_batch
        tokens = [token for token, _ in updates]
        if apply_batch is None or (len(tokens) > 1 and sorted(set(tokens)) != tokens):
            for token, rows in updates:
                if stream_name in self._draining:
                    # A handler's awaitable made the stream's work wait.
                    self._enqueue(stream_name, partial(self._apply_rows, stream_name, instance_name, token, rows))
                else:
                    self._apply_rows_now(stream_name, instance_name, token, rows)
            return
        position = self._positions.get(stream_name, instance_name)
        if position is not None and tokens[0] <= position:
            updates = [update for update in updates if update[0] > position]  # replayed after a reconnect
            if not updates:
                return
        try:
            apply_batch(stream_name, instance_name, updates)
        except Exception:
            # Token by token instead (applying is idempotent), so that one
            # bad row costs only its token, as it would have alone.
            for token, rows in updates:
                self._apply_rows_now(stream_name, instance_name, token, rows)
            return
        self._positions.set(stream_name, instance_name, updates[-1][0])

    def on_position(self, cmd: PositionCommand) -> None:
        if self._stopped:
            return
        stream = self._stream(cmd.stream_name)
        if stream is None:
            return
        self._enqueue(cmd.stream_name, partial(self._apply_position, stream, cmd))

    def _stream(self, name: str) -> Stream | None:
        try:
            return self._handler.streams.get(name)
        except UnknownStreamError:
            if name not in self._warned_unknown and len(self._warned_unknown) < _MAX_UNKNOWN_STREAMS_WARNED:
                self._warned_unknown.add(name)
                self.log.warn("ignoring updates for unknown stream {stream}", stream=describe(name))
            return None

    # -- ordered work per stream ----------------------------------------------

    def _enqueue(self, stream_name: str, work: Callable[[], Awaitable[None]]) -> None:
        queue = self._queues.setdefault(stream_name, deque())
        if len(queue) >= self._max_queued:
            raise CloseConnection(f"too far behind on {stream_name}")
        queue.append(work)
        if stream_name not in self._draining:
            self._draining.add(stream_name)
            defer.ensureDeferred(self._drain(stream_name)).addErrback(self._log_failure, stream_name)

    async def _drain(self, stream_name: str) -> None:
        queue = self._queues[stream_name]
        try:
            while queue and not self._stopped:
                work = queue.popleft()
                try:
                    await work()
                except Exception:
                    # Keep going: one bad row must not wedge the stream.
                    self.log.failure("applying an update to {stream} failed", stream=stream_name)
        finally:
            self._draining.discard(stream_name)
            if not queue:
                self._queues.pop(stream_name, None)

    def _log_failure(self, failure: Failure, stream_name: str) -> None:
        self.log.failure("stream {stream} follower crashed", failure=failure, stream=stream_name)

    def _apply_rows_now(self, stream_name: str, instance_name: str, token: int, rows: list[StreamRow]) -> None:
        """``_apply_rows`` without the queue, for a stream with nothing queued
        or running (the usual case: handlers apply rows synchronously). Only
        a handler that returns an awaitable makes later work for the stream
        wait in the queue, as ``_apply_rows`` would."""
        position = self._positions.get(stream_name, instance_name)
        if position is not None and token <= position:
            return
        try:
            result = self._handler.on_rdata(stream_name, instance_name, token, rows)
        except Exception:
            self.log.failure("applying an update to {stream} failed", stream=stream_name)
            return
        if result is not None and inspect.isawaitable(result):
            self._enqueue(stream_name, partial(self._finish_rows, result, stream_name, instance_name, token))
            return
        self._positions.set(stream_name, instance_name, token)

    async def _finish_rows(self, result: Awaitable[None], stream_name: str, instance_name: str, token: int) -> None:
        await result
        self._positions.set(stream_name, instance_name, token)

    async def _apply_rows(self, stream_name: str, instance_name: str, token: int, rows: list[StreamRow]) -> None:
        position = self._positions.get(stream_name, instance_name)
        if position is not None and token <= position:
            return  # replayed after a reconnect; already applied
        await _maybe_await(self._handler.on_rdata(stream_name, instance_name, token, rows))
        self._positions.set(stream_name, instance_name, token)

    async def _apply_position(self, stream: Stream, cmd: PositionCommand) -> None:
        name, writer = cmd.stream_name, cmd.instance_name
        position = self._positions.get(name, writer)
        if position is not None and position < cmd.prev_token:
            await self._fetch_missing(stream, writer, position, cmd.new_token)
        elif position is not None and position > cmd.new_token:
            if not self._follow_moves_back:
                self.log.info(
                    "{stream}/{writer}: POSITION {theirs} is behind what was applied ({ours}); kept",
                    stream=name,
                    writer=writer,
                    ours=position,
                    theirs=cmd.new_token,
                )
                return
            # The server is behind us (restored from a backup?). It is the
            # source of truth: follow it, and say so.
            self.log.warn(
                "server moved {stream}/{writer} back from {ours} to {theirs}",
                stream=name,
                writer=writer,
                ours=position,
                theirs=cmd.new_token,
            )
        self._positions.set(name, writer, cmd.new_token)
        await _maybe_await(self._handler.on_position(name, writer, cmd.prev_token, cmd.new_token))

    async def _fetch_missing(self, stream: Stream, writer: str, from_token: int, to_token: int) -> None:
        """Fetch and apply rows in ``(from_token, to_token]`` page by page,
        up to ``read_ahead`` pages read while one is applied (as the TCP
        server's feed reads ahead): a catch-up from the database over Redis,
        or a gap a POSITION showed. After the first page, pages are token
        ranges about a page wide (as dense as the page before); one that
        comes back cut short is followed by the rest of its range."""
        if from_token >= to_token:
            return
        page_size = self._page_size
        reads: deque[tuple[int, int, defer.Deferred]] = deque()

        def read(start: int, end: int) -> tuple[int, int, defer.Deferred]:
            return start, end, defer.ensureDeferred(stream.get_updates(writer, start, end, page_size))

        reads.append(read(from_token, to_token))
        span: int | None = None
        try:
            while reads:
                start, end, result = reads.popleft()
                updates, upto, limited = await result
                if upto <= start:
                    self.log.error(
                        "{stream}/{writer}: get_updates from {start} made no progress",
                        stream=stream.name,
                        writer=writer,
                        start=start,
                    )
                    return
                if updates:
                    span = max(1, int((upto - start) * page_size * _FILL / len(updates)))
                if upto < end:
                    # Cut short: the rest of its range comes next (a page's
                    # worth of it when nothing was read after it).
                    reads.appendleft(read(upto, end if reads or span is None else min(end, upto + span)))
                last = reads[-1][1] if reads else upto
                while span is not None and len(reads) < self._read_ahead and last < to_token:
                    reads.append(read(last, min(to_token, last + span)))
                    last = reads[-1][1]
                apply_rows = None if self._rows_handler is None else self._rows_handler.on_rdata_rows
                if apply_rows is not None and updates:
                    # A page's rows in one call, each with its token (in
                    # order: get_updates' contract), freed once applied.
                    with collector_paused():
                        last = updates[-1][0]
                        apply_rows(stream.name, writer, [token for token, _ in updates], [row for _, row in updates])
                        del updates
                    self._positions.set(stream.name, writer, last)
                    continue
                apply_batch = None if self._batch_handler is None else self._batch_handler.on_rdata_batch
                if apply_batch is not None and updates:
                    # A page's tokens in one call (in order: get_updates'
                    # contract), its rows freed once applied (no cyclic
                    # collection for them: ``storage.collector``).
                    with collector_paused():
                        grouped = _by_token(updates)
                        apply_batch(stream.name, writer, grouped)
                        last = grouped[-1][0]
                        del grouped, updates  # freed before the collector is back
                    self._positions.set(stream.name, writer, last)
                    continue
                grouped = _by_token(updates)
                for token, rows in grouped:
                    await _maybe_await(self._handler.on_rdata(stream.name, writer, token, rows))
                    self._positions.set(stream.name, writer, token)
        finally:
            for _, _, result in reads:
                result.addErrback(lambda f: None)  # not used: its failure is nobody's
