"""Stream sources: what a stream is to the replication protocol.

A *stream* is an append-only log of rows, written by one or more *writer*
instances. Each row has an integer token; tokens of one writer never go down,
and several rows may share a token (one fact written as several rows). The
protocol layer knows streams only through the small :class:`Stream`
interface below; database-backed streams (events, backfill, caches) implement
it elsewhere, and :class:`InMemoryStream` implements it for tests and for
homeserver code that keeps rows in memory.

Who calls what:

- the server side calls ``writers()``, ``current_token()`` and
  ``get_updates()`` to answer ``REPLICATE`` and to send ``RDATA``;
- the client side calls ``get_updates()`` to fetch rows it missed
  (a ``POSITION`` whose ``prev_token`` is ahead of it);
- homeserver code registers streams in a :class:`StreamRegistry` and tells the
  server factory when a stream advanced.
"""

from __future__ import annotations

import abc
import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import attrs

from roomstore.replication.wire import encode_fast, encode_row

__all__ = [
    "InMemoryStream",
    "RdataText",
    "Stream",
    "StreamRegistry",
    "StreamRow",
    "StreamUpdates",
    "UnknownStreamError",
]

#: One row of a stream: a tuple of JSON-serialisable values.
StreamRow = tuple


class StreamUpdates(NamedTuple):
    """What :meth:`Stream.get_updates` returns (a plain 3-tuple works too).

    - ``updates``: ``(token, row)`` pairs in token order.
    - ``upto_token``: the caller has now seen everything up to and including
      this token; pass it as the next ``from_token``.
    - ``limited``: ``True`` if rows were left out; call again from
      ``upto_token`` to get more.
    """

    updates: list[tuple[int, StreamRow]]
    upto_token: int
    limited: bool


class RdataText(NamedTuple):
    """A page as the text of its RDATA lines, made by the stream
    (:meth:`Stream.get_rdata_page`): ``text`` the lines, each ending in a
    newline, ``count`` of them; ``first`` and ``last`` the tokens of the
    first and last row; ``longest`` the longest line's length in
    characters. The sender checks what it relies on (ASCII, the line limit,
    the tokens within the range) and reads the page as rows otherwise."""

    text: str
    count: int
    first: int
    last: int
    longest: int


class UnknownStreamError(KeyError):
    """No stream of that name is registered."""

    def __init__(self, stream_name: str) -> None:
        super().__init__(stream_name)
        self.stream_name = stream_name


class Stream(abc.ABC):
    """The interface the replication protocol is handed for one stream.

    Implementations must be usable from the reactor thread: ``writers`` and
    ``current_token`` are cheap and synchronous, ``get_updates`` may wait
    (e.g. on a database) and is a coroutine.
    """

    #: The stream's name on the wire (no whitespace), e.g. ``"events"``.
    name: str

    @abc.abstractmethod
    def writers(self) -> Sequence[str]:
        """Names of the instances that write to this stream, in a stable order."""

    @abc.abstractmethod
    def current_token(self, instance_name: str) -> int:
        """The newest token up to which ``instance_name``'s rows are complete
        (every row at or below it exists and no new one will appear there).
        Never decreases. A writer that has written nothing returns 0."""

    @abc.abstractmethod
    async def get_updates(
        self, instance_name: str, from_token: int, upto_token: int, limit: int
    ) -> StreamUpdates | tuple[list[tuple[int, StreamRow]], int, bool]:
        """Rows of ``instance_name`` with ``from_token < token <= upto_token``.

        Returns ``(updates, upto_token, limited)`` as described on
        :class:`StreamUpdates`. The contract callers rely on:

        - ``updates`` is in token order;
        - if ``limited`` is false, every row in the range was returned and the
          returned ``upto_token`` equals the one asked for;
        - if ``limited`` is true, the returned ``upto_token`` is the token of
          the last row returned, is greater than ``from_token``, and *every*
          row at that token was returned: rows sharing a token are never split
          across pages. A page therefore holds at most ``limit`` rows, unless
          more than ``limit`` rows share one token;
        - ``limit`` is at least 1; if ``from_token >= upto_token`` the answer
          is ``([], upto_token, False)``.
        """

    async def get_encoded_updates(
        self, instance_name: str, from_token: int, upto_token: int, limit: int
    ) -> StreamUpdates:
        """``get_updates`` with every row as its line's JSON text: updates
        are ``(token, row_json)``, ``row_json`` being ``encode_row(row)``
        (compact, sorted keys, ASCII escapes); the same contract otherwise.

        What the server sends pages from. This default encodes the rows of
        ``get_updates`` (``ValueError`` for a row that cannot be encoded); a
        stream that can read its rows already encoded (the store's events
        and backfill, whose database writes the JSON) overrides it.
        """
        updates, upto, limited = await self.get_updates(instance_name, from_token, upto_token, limit)
        try:
            encoded = [(token, encode_fast(row)) for token, row in updates]
        except (TypeError, ValueError, RecursionError):
            for token, row in updates:
                try:
                    encode_row(row)
                except ValueError as e:
                    raise ValueError(f"{self.name}/{instance_name}: row at {token} cannot be sent: {e}") from None
            raise
        return StreamUpdates(encoded, upto, limited)  # type: ignore[arg-type]  # rows as their JSON text

    async def get_rdata_page(
        self, instance_name: str, from_token: int, upto_token: int, limit: int, prefix: str
    ) -> StreamUpdates:
        """``get_encoded_updates``, or, from a stream that can make them
        (the store's events and backfill, on SQLite), the page's RDATA lines
        as one :class:`RdataText` in place of the updates (``prefix``:
        ``"RDATA <stream> <writer> "``); such a page holds at most ``limit``
        of the stream's own rows and the rows that share their tokens (the
        events stream's state changes). What a server sends pages from;
        this default reads ``get_encoded_updates``."""
        return await self.get_encoded_updates(instance_name, from_token, upto_token, limit)

    def split_row(self, row: StreamRow, fits: Callable[[StreamRow], bool]) -> list[StreamRow] | None:
        """Rows that together mean what ``row`` means, each accepted by
        ``fits``, or None if ``row`` cannot be split that way (the default).

        Called by the server when ``row`` would make a line longer than the
        line limit; the parts are sent at ``row``'s token, in order.
        """
        return None


def _check_stream_name(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"stream and instance names must be non-empty words: {value!r}")


@attrs.define
class _WriterLog:
    """The rows of one writer: parallel lists so ``bisect`` can search tokens."""

    tokens: list[int] = attrs.Factory(list)
    rows: list[StreamRow] = attrs.Factory(list)
    current: int = 0


class InMemoryStream(Stream):
    """A :class:`Stream` whose rows live in a Python list per writer.

    Homeserver code (or a test) appends rows with :meth:`append` and moves a
    writer's position with no rows with :meth:`advance`; it then tells the
    server factory (``notify_new_rows``). Rows are kept until :meth:`prune`
    drops the ones nobody can still ask for; reading pruned rows is a bug the
    caller has to avoid (nothing here can detect it).
    """

    def __init__(self, name: str, writers: Sequence[str] = ("master",)) -> None:
        _check_stream_name(None, None, name)  # type: ignore[arg-type]
        self.name = name
        self._logs: dict[str, _WriterLog] = {}
        for writer in writers:
            self._log(writer)

    def _log(self, instance_name: str) -> _WriterLog:
        log = self._logs.get(instance_name)
        if log is None:
            _check_stream_name(None, None, instance_name)  # type: ignore[arg-type]
            log = self._logs[instance_name] = _WriterLog()
        return log

    def writers(self) -> Sequence[str]:
        return list(self._logs)

    def current_token(self, instance_name: str) -> int:
        log = self._logs.get(instance_name)
        return 0 if log is None else log.current

    def append(self, instance_name: str, token: int, *rows: StreamRow) -> None:
        """Record ``rows`` (at least one) at ``token`` and advance the writer to it.

        ``token`` must not be below the writer's current token; appending to
        the current token adds rows to it (a batch).
        """
        if not rows:
            raise ValueError("append needs at least one row")
        log = self._log(instance_name)
        if token < log.current:
            raise ValueError(f"token {token} is behind {instance_name}'s position {log.current}")
        for row in rows:
            log.tokens.append(token)
            log.rows.append(tuple(row))
        log.current = token

    def advance(self, instance_name: str, token: int) -> None:
        """Move the writer's position to ``token`` without rows (never backwards)."""
        log = self._log(instance_name)
        if token < log.current:
            raise ValueError(f"token {token} is behind {instance_name}'s position {log.current}")
        log.current = token

    def prune(self, instance_name: str, upto_token: int) -> None:
        """Forget ``instance_name``'s rows at or below ``upto_token``."""
        log = self._log(instance_name)
        cut = bisect.bisect_right(log.tokens, upto_token)
        del log.tokens[:cut], log.rows[:cut]

    def rows(self, instance_name: str) -> Iterator[tuple[int, StreamRow]]:
        """Every stored ``(token, row)`` of ``instance_name`` (for tests)."""
        log = self._logs.get(instance_name)
        return iter(()) if log is None else zip(list(log.tokens), list(log.rows), strict=True)

    async def get_updates(self, instance_name: str, from_token: int, upto_token: int, limit: int) -> StreamUpdates:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        log = self._logs.get(instance_name)
        if log is None or from_token >= upto_token:
            return StreamUpdates([], upto_token, False)
        start = bisect.bisect_right(log.tokens, from_token)
        end = bisect.bisect_right(log.tokens, upto_token)
        if end - start <= limit:
            return StreamUpdates(self._slice(log, start, end), upto_token, False)

        # Too many: cut after `limit` rows, but never inside a token. If the
        # cut would split a token, back off to the start of its rows; if that
        # leaves nothing (one token holds more than `limit` rows), take the
        # whole token instead.
        cut = start + limit
        last_token = log.tokens[cut - 1]
        if log.tokens[cut] == last_token:
            cut = bisect.bisect_left(log.tokens, last_token, start, end)
            if cut == start:
                cut = bisect.bisect_right(log.tokens, last_token, start, end)
        page = self._slice(log, start, cut)
        if cut == end:
            # The big token was the rest of the range: nothing was left out.
            return StreamUpdates(page, upto_token, False)
        return StreamUpdates(page, page[-1][0], True)

    @staticmethod
    def _slice(log: _WriterLog, start: int, end: int) -> list[tuple[int, StreamRow]]:
        return list(zip(log.tokens[start:end], log.rows[start:end], strict=True))


class StreamRegistry:
    """The streams a replication server serves, or a client can read from.

    Names are unique; :meth:`names` keeps registration order, which is the
    order the server answers ``REPLICATE`` in.
    """

    def __init__(self, streams: Sequence[Stream] = ()) -> None:
        self._streams: dict[str, Stream] = {}
        for stream in streams:
            self.register(stream)

    def register(self, stream: Stream) -> None:
        """Add ``stream``; raises ``ValueError`` if its name is taken."""
        if stream.name in self._streams:
            raise ValueError(f"stream {stream.name!r} is already registered")
        _check_stream_name(None, None, stream.name)  # type: ignore[arg-type]
        self._streams[stream.name] = stream

    def get(self, name: str) -> Stream:
        """The stream called ``name``; raises :class:`UnknownStreamError`."""
        try:
            return self._streams[name]
        except KeyError:
            raise UnknownStreamError(name) from None

    def names(self) -> list[str]:
        return list(self._streams)

    def __contains__(self, name: object) -> bool:
        return name in self._streams

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)
