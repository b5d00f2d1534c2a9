"""What one server connection has been sent from each stream.

A :class:`ConnectionFeed` belongs to one server-side connection. For every
``(stream, writer)`` the client has asked about it keeps a cursor: the token up
to which rows have been sent. Everything the connection is sent from a stream
goes through one *catch-up loop* per cursor, which reads
``get_updates(writer, cursor, current_token, page_size)`` page by page and
writes RDATA for every row, until the cursor reaches the writer's current
token. That single path gives the guarantees the protocol needs:

- **No gaps, no duplicates.** The cursor only moves over rows that were just
  sent, in token order, one loop at a time.
- **Live rows during a replay are held, not lost.** ``on_stream_advanced``
  while a loop runs does nothing: the loop re-reads ``current_token`` before
  it stops, so rows written meanwhile are sent after the replay, in order.
  They wait in the stream (the database), not in memory.
- **Bounded pages and bounded memory.** A far-behind connection is caught up
  ``page_size`` rows at a time. While a page is encoded and written, up to
  ``read_ahead`` more are being read (the database works meanwhile, on
  several connections where it has them), and a loop writes nothing while
  the connection is paused (congested), so a slow client costs no more than
  ``read_ahead + 1`` pages per cursor.

Rows sharing a token go out as ``RDATA ... batch`` lines followed by one
line carrying the token.

No line passes ``max_line_length`` (Synapse closes the connection on a line
over 16 KiB): a row whose line would is split by its stream
(``Stream.split_row``, e.g. a cache invalidation of many keys becomes several
rows at the same token). A token with a row that cannot be split is not sent
as RDATA: the client is sent ``POSITION <stream> <writer> <token> <token>``,
whose ``prev_token`` ahead of its position tells it (ours and Synapse's
alike) to fetch the rows up to that token itself, and the error is logged.
When a loop ends it sends ``POSITION`` if it was asked to (a REPLICATE) or if
the cursor moved past the last RDATA token
(tokens with no rows), so the client's position is exact.

If ``get_updates`` fails, the error is logged and the loop stops with the
cursor where it was; it is retried from there on the next
``on_stream_advanced`` or, if none comes, after a delay on the connection's
clock (1 s, doubling to 60 s while it keeps failing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from roomstore.replication.commands import (
    MAX_LINE_LENGTH,
    Command,
    PositionCommand,
    ReplicateCommand,
    decode_row,
    describe,
    encode_row,
)
from roomstore.replication.stream_interface import RdataText, Stream, StreamRegistry
from roomstore.storage.collector import collector_paused

__all__ = ["ConnectionFeed", "FeedConnection", "StreamContractError"]

#: The legacy stream name that means "every stream".
ALL_STREAMS = "ALL"


class FeedConnection(Protocol):
    """What a feed needs from its connection (a ServerReplicationProtocol)."""

    conn_id: str

    @property
    def is_open(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def send_command(self, cmd: Command) -> None: ...

    def send_rows(self, stream_name: str, instance_name: str, items: Sequence) -> None: ...

    def when_writable(self) -> defer.Deferred[None]: ...

    def send_rdata_text(self, text: str, count: int) -> bool: ...

    @property
    def clock(self) -> IReactorTime: ...


class StreamContractError(Exception):
    """A stream's ``get_updates`` broke the contract documented on
    :class:`~roomstore.replication.stream_interface.Stream`."""


RETRY_FIRST_DELAY = 1.0
RETRY_MAX_DELAY = 60.0


@attrs.define
class _Cursor:
    """Per (stream, writer) state of one connection."""

    #: Every row with a token at or below this has been sent (or the client
    #: was told, by POSITION, that it may skip them).
    last_sent: int
    #: The last token the client was told about (RDATA token line or
    #: POSITION); the ``prev_token`` of the next POSITION.
    last_told: int
    #: A catch-up loop is running for this cursor.
    running: bool = False
    #: Send POSITION when the running loop catches up.
    want_position: bool = False
    #: Bumped when a legacy REPLICATE moves the cursor, so a loop that was
    #: waiting on get_updates throws that page away.
    generation: int = 0
    #: After a failure: the pending retry (an IDelayedCall) and the next delay.
    retry_call: object = None
    retry_delay: float = RETRY_FIRST_DELAY


@attrs.frozen
class _Read:
    """A page being read: ``get_updates(writer, start, end, page_size)``."""

    start: int
    end: int
    generation: int
    #: A range guessed from an earlier page's density (not "up to the
    #: current token", nor the rest of a short page's range).
    guessed: bool
    result: defer.Deferred


def _drop_all(reads: deque[_Read]) -> None:
    """Forget pages read ahead that will not be sent (their failures, if
    any, are not errors: the loop that needs those rows reads them again)."""
    while reads:
        reads.popleft().result.addErrback(lambda _failure: None)


def _cancel_retry(cursor: _Cursor) -> None:
    if cursor.retry_call is not None and cursor.retry_call.active():
        cursor.retry_call.cancel()
    cursor.retry_call = None


#: The most of page_size a range guessed from the page before aims at once
#: a page came back short (rows per token vary in that stream): a little
#: under it, as a short page (cut at page_size before the end of its range)
#: costs one more read, on the way of the pages read after it.
_FILL_MOST = 0.9375

#: Characters of the longest token (a bigint).
_MAX_TOKEN_DIGITS = 20


@attrs.define
class _Pacing:
    """How wide a catch-up loop's next read ranges are. Rows per token vary
    (the events stream has state rows in bursts), so a range is as wide as
    held ``page_size`` rows in the page before, aiming lower for a while
    after a page came back short (cut at ``page_size`` rows before the end
    of its range)."""

    #: The width of the next ranges, once known.
    span: int | None = None
    #: The share of page_size the next ranges aim at ...
    fill: float = 1.0
    #: ... at most: _FILL_MOST once a page came back short.
    most: float = 1.0

    def learn(
        self, guessed: bool, read_end: int, start: int, upto: int, count: int, limited: bool, page_size: int
    ) -> None:
        """Take in a page of ``count`` rows from ``start`` to ``upto``, read
        as a range up to ``read_end`` (``guessed`` from an earlier page)."""
        if guessed:
            if upto < read_end:
                self.fill *= 0.75  # short: aim lower (a short page costs one more read)
                self.most = _FILL_MOST
            else:
                self.fill = min(self.most, self.fill + 0.0625)
        if count:
            self.span = max(1, int((upto - start) * page_size * self.fill / count))
        elif not limited:
            self.span = 2 * (self.span or page_size)


def _line_tokens(updates: list[tuple[int, str]], start: int, upto: int) -> list | None:
    """The token each row's RDATA line carries, None for "batch" (the next row
    has the same token: only a token's last row carries it), if the tokens are
    in order within ``(start, upto]`` (every page, as a rule); else None."""
    tokens = [token for token, _ in updates]
    if not tokens or tokens[0] <= start or tokens[-1] > upto or tokens != sorted(tokens):
        return None
    following = tokens[1:]
    following.append(None)
    return [None if token == after else token for token, after in zip(tokens, following, strict=True)]


def _plain_page(updates: list[tuple[int, str]], start: int, upto: int, room: int) -> list | None:
    """The items of a page of ``(token, row_json)`` whose rows all fit in
    ``room`` characters and whose tokens are in order within ``(start,
    upto]`` (every page, as a rule), built without a step per row in Python
    beyond list comprehensions; None for any other page, which the full loop
    of ``_page_commands`` handles (and reports)."""
    if not updates:
        return []
    encoded = [row_json for _, row_json in updates]
    if max(map(len, encoded)) > room:
        return None
    line_tokens = _line_tokens(updates, start, upto)
    if line_tokens is None:
        return None
    # The row itself is not needed to write the line (None: decoded only
    # where it is, see send_rows).
    return [(token, None, row_json) for token, row_json in zip(line_tokens, encoded, strict=True)]


def _page_text(updates: list[tuple[int, str]], start: int, upto: int, prefix: str, limit: int) -> str | None:
    """A plain page of ``(token, row_json)`` as the text of its RDATA lines
    (``prefix`` being ``"RDATA <stream> <writer> "``), each ending in a
    newline: every line ASCII and at most ``limit`` long, the tokens in
    order within ``(start, upto]``; None for any other page, which goes
    through ``_page_commands``. List comprehensions in Python, the checks in
    C: what the server's reactor does per line."""
    line_tokens = _line_tokens(updates, start, upto)
    if line_tokens is None:
        return None
    lines = [
        f"{prefix}{'batch' if token is None else token} {row_json}"
        for token, (_, row_json) in zip(line_tokens, updates, strict=True)
    ]
    if max(map(len, lines)) > limit:
        return None
    lines.append("")
    text = "\n".join(lines)
    return text if text.isascii() else None


def _text_rows(page: RdataText, prefix: str) -> list[tuple[int, str]]:
    """A page given as its lines (``get_rdata_page``) as ``(token, row_json)``
    again, for the paths that take a page row by row (a paused connection,
    a check that failed)."""
    cut = len(prefix)
    pairs = [line[cut:].split(" ", 1) for line in page.text.split("\n")[:-1]]
    rows: list[tuple[int, str]] = []
    token = page.last
    for word, row_json in reversed(pairs):
        if word != "batch":
            token = int(word)
        rows.append((token, row_json))
    rows.reverse()
    return rows


class ConnectionFeed:
    """Sends stream rows to one connection. See the module docstring.

    Called by the server session (``replicate``) and by the factory
    (``on_stream_advanced``), always from the reactor thread.
    """

    log = Logger()

    def __init__(
        self,
        conn: FeedConnection,
        streams: StreamRegistry,
        page_size: int = 100,
        max_line_length: int = MAX_LINE_LENGTH,
        read_ahead: int = 2,
    ) -> None:
        self._conn = conn
        self._streams = streams
        self._page_size = page_size
        self._max_line_length = max_line_length
        self._read_ahead = max(1, read_ahead)
        self._cursors: dict[tuple[str, str], _Cursor] = {}
        self._subscribed: set[str] = set()
        self._loops: dict[tuple[str, str], defer.Deferred[None]] = {}

    def position(self, stream_name: str, instance_name: str) -> int | None:
        """The token up to which this connection has been sent rows (tests, metrics)."""
        cursor = self._cursors.get((stream_name, instance_name))
        return None if cursor is None else cursor.last_sent

    def is_idle(self) -> bool:
        """True if no catch-up loop is running."""
        return not self._loops

    # -- REPLICATE -------------------------------------------------------------

    def replicate(self, cmd: ReplicateCommand) -> None:
        """Answer a REPLICATE command.

        - bare ``REPLICATE``: POSITION for every stream and writer, and from
          now on send new rows;
        - ``REPLICATE <stream> NOW``: the same for one stream;
        - ``REPLICATE <stream> <token>``: replay that stream's rows after
          ``token`` (for every writer), then POSITION, then new rows.

        ``ALL`` names every stream. Raises UnknownStreamError for a stream
        that does not exist, before changing anything.
        """
        if cmd.stream_name is None or (cmd.stream_name == ALL_STREAMS and ALL_STREAMS not in self._streams):
            streams = list(self._streams)
        else:
            streams = [self._streams.get(cmd.stream_name)]

        for stream in streams:
            self._subscribed.add(stream.name)
            for writer in stream.writers():
                if cmd.token is None:
                    self._replicate_now(stream, writer)
                else:
                    self._replicate_from(stream, writer, cmd.token)

    def _replicate_now(self, stream: Stream, writer: str) -> None:
        cursor = self._cursors.get((stream.name, writer))
        if cursor is None:
            current = stream.current_token(writer)
            self._cursors[(stream.name, writer)] = _Cursor(last_sent=current, last_told=current)
            self._conn.send_command(PositionCommand(stream.name, writer, current, current))
        else:
            # Already streaming: finish sending what is due, then say where we are.
            cursor.want_position = True
            self._kick(stream, writer, cursor)

    def _replicate_from(self, stream: Stream, writer: str, token: int) -> None:
        current = stream.current_token(writer)
        if token > current:
            self.log.warn(
                "[{conn_id}] client asked for {stream}/{writer} from {token}, ahead of {current}",
                conn_id=self._conn.conn_id,
                stream=stream.name,
                writer=writer,
                token=token,
                current=current,
            )
            token = current
        cursor = self._cursors.get((stream.name, writer))
        if cursor is None:
            cursor = self._cursors[(stream.name, writer)] = _Cursor(last_sent=token, last_told=token)
        else:
            cursor.last_sent = cursor.last_told = token
            cursor.generation += 1
        cursor.want_position = True
        self._kick(stream, writer, cursor)

    # -- new rows ----------------------------------------------------------------

    def on_stream_advanced(self, stream_name: str) -> None:
        """``stream_name`` has new rows or a new position; send them if this
        connection asked for that stream. Cheap if it did not."""
        if stream_name not in self._subscribed:
            return
        stream = self._streams.get(stream_name)
        for writer in stream.writers():
            cursor = self._cursors.get((stream_name, writer))
            if cursor is None:
                # A writer that appeared after the REPLICATE: all of its rows
                # are new to this client.
                cursor = self._cursors[(stream_name, writer)] = _Cursor(last_sent=0, last_told=0)
            self._kick(stream, writer, cursor)

    def stop(self) -> None:
        """The connection is gone: no new loops; running ones end at their
        next step (they check the connection)."""
        self._subscribed.clear()
        for cursor in self._cursors.values():
            _cancel_retry(cursor)

    # -- the catch-up loop ----------------------------------------------------

    def _kick(self, stream: Stream, writer: str, cursor: _Cursor) -> None:
        if cursor.running or not self._conn.is_open:
            return  # the running loop re-reads current_token before it stops
        cursor.running = True
        key = (stream.name, writer)
        d = defer.ensureDeferred(self._catch_up(stream, writer, cursor))
        if cursor.running:  # still waiting on something: remember it
            self._loops[key] = d

        def done(result: object) -> None:
            self._loops.pop(key, None)
            if not isinstance(result, Failure):
                cursor.retry_delay = RETRY_FIRST_DELAY
                _cancel_retry(cursor)  # a notification got there first
                return
            delay = cursor.retry_delay
            self.log.failure(
                "[{conn_id}] sending {stream}/{writer} failed; will retry on the next update or in {delay} s",
                failure=result,
                conn_id=self._conn.conn_id,
                stream=stream.name,
                writer=writer,
                delay=delay,
            )
            cursor.retry_delay = min(delay * 2, RETRY_MAX_DELAY)
            if self._conn.is_open and (cursor.retry_call is None or not cursor.retry_call.active()):
                cursor.retry_call = self._conn.clock.callLater(delay, self._retry, stream, writer, cursor)

        d.addBoth(done)

    def _retry(self, stream: Stream, writer: str, cursor: _Cursor) -> None:
        cursor.retry_call = None
        if stream.name in self._subscribed:
            self._kick(stream, writer, cursor)

    async def _catch_up(self, stream: Stream, writer: str, cursor: _Cursor) -> None:
        # Pages are read ahead while earlier ones are encoded and written:
        # up to `read_ahead` reads in flight, the next ones asked for as soon
        # as a page arrives, before it is encoded (the database works in its own
        # threads or processes meanwhile, PostgreSQL's on several
        # connections at once), paused or not. `reads` covers one contiguous
        # token range from the cursor on. The first read asks for everything
        # up to the current token and is cut at page_size rows; the pages
        # after it are token ranges as wide as held page_size rows in the
        # page before (`_Pacing`).
        reads: deque[_Read] = deque()
        pacing = _Pacing()
        try:
            while self._conn.is_open:
                generation = cursor.generation
                start = cursor.last_sent
                if reads and (reads[0].start != start or reads[0].generation != generation):
                    _drop_all(reads)  # a legacy REPLICATE moved the cursor
                target = stream.current_token(writer)
                if not reads:
                    if start >= target:
                        break
                    reads.append(self._read(stream, writer, start, target, generation, pacing.span))
                self._read_ahead_pages(stream, writer, reads, target, generation, pacing.span)
                if self._conn.paused:
                    await self._conn.when_writable()
                    continue
                read = reads[0]
                updates, upto, limited = await read.result
                if not self._conn.is_open:
                    return
                if reads and reads[0] is read:
                    reads.popleft()
                if generation != cursor.generation:
                    continue  # a legacy REPLICATE moved the cursor meanwhile
                read_end, guessed = read.end, read.guessed
                del read  # popped: the page is held by `updates` alone
                if upto > read_end:
                    raise StreamContractError(
                        f"{stream.name}/{writer}: get_updates up to {read_end} returned rows up to {upto}"
                    )
                count = updates.count if type(updates) is RdataText else len(updates)
                pacing.learn(guessed, read_end, start, upto, count, limited, self._page_size)
                self._read_next(stream, writer, reads, read_end, upto, generation, pacing.span)
                page = [updates]
                del updates  # _write_page frees the page as soon as it is written
                told, waiting = self._write_page(stream, writer, start, page, upto, limited, count)
                if waiting is not None:
                    # Paused while the page was read (another stream's page
                    # filled the transport): it waits here, whole, rather
                    # than line by line in the connection's pending queue.
                    await self._conn.when_writable()
                    if not self._conn.is_open:
                        return
                    if generation != cursor.generation:
                        continue  # a legacy REPLICATE moved the cursor meanwhile
                    told = self._send_page(stream, writer, waiting)
                    del waiting
                if told is not None:
                    cursor.last_told = told
                cursor.last_sent = upto
            self._tell_position(stream, writer, cursor)
        finally:
            cursor.running = False
            _drop_all(reads)

    def _read_ahead_pages(
        self, stream: Stream, writer: str, reads: deque[_Read], target: int, generation: int, span: int | None
    ) -> None:
        """Start reads after the last one, up to ``read_ahead`` in flight and
        ``target``, once the width of a range (``span``) is known."""
        if span is None:
            return
        end = reads[-1].end
        while len(reads) < self._read_ahead and end < target:
            reads.append(self._read(stream, writer, end, target, generation, span))
            end = reads[-1].end

    def _read_next(
        self,
        stream: Stream,
        writer: str,
        reads: deque[_Read],
        read_end: int,
        upto: int,
        generation: int,
        span: int | None,
    ) -> None:
        """Having a page up to ``upto`` of a read up to ``read_end``: read
        the rest of a short page's range first, then the next pages, all
        while this one is encoded and written (with one connection, as
        SQLite's, too)."""
        if upto < read_end:
            # The rest of its range comes next (in reads of `span` when
            # nothing was read after it).
            end = read_end if reads else min(read_end, upto + (span or read_end))
            reads.appendleft(_Read(upto, end, generation, False, self._get_page(stream, writer, upto, end)))
        if span is None:
            return
        target = stream.current_token(writer)
        end = reads[-1].end if reads else upto
        while len(reads) < self._read_ahead and end < target:
            reads.append(self._read(stream, writer, end, target, generation, span))
            end = reads[-1].end

    def _write_page(
        self, stream: Stream, writer: str, start: int, page: list, upto: int, limited: bool, count: int
    ) -> tuple[int | None, list | None]:
        """Write the page in ``page`` (a list of one, emptied here so the
        page is freed once written): ``(told, None)`` once written, ``told``
        the token it ends with; ``(None, items)`` if the connection is
        paused, ``items`` to send once it is writable.

        The page's items are made, written and freed with the cyclic
        collector held off (``storage.collector``)."""
        updates = page.pop()
        prefix = f"RDATA {stream.name} {writer} "
        with collector_paused():
            text = None
            if type(updates) is RdataText:
                # Lines the stream made: sent as they are if they keep what
                # the loop promises, else row by row.
                if (
                    start < updates.first
                    and updates.last <= upto
                    and updates.longest <= self._max_line_length
                    and updates.text.isascii()
                ):
                    text = updates.text
                else:
                    updates = _text_rows(updates, prefix)
            elif not self._conn.paused and upto > start:
                # The usual page: its lines made at once and written.
                text = _page_text(updates, start, upto, prefix, self._max_line_length)
            if text is not None and self._conn.send_rdata_text(text, count):
                return (updates.last if type(updates) is RdataText else updates[-1][0]), None
            if type(updates) is RdataText:  # paused: row by row, as any page
                updates = _text_rows(updates, prefix)
            items = self._page_commands(stream, writer, start, updates, upto, limited)
            del text, updates
            if self._conn.paused:
                return None, items
            return self._send_page(stream, writer, items), None

    def _tell_position(self, stream: Stream, writer: str, cursor: _Cursor) -> None:
        """Caught up: send POSITION if asked for, or if the last token sent
        is not the one the cursor stands at."""
        if self._conn.is_open and (cursor.want_position or cursor.last_told != cursor.last_sent):
            self._conn.send_command(PositionCommand(stream.name, writer, cursor.last_told, cursor.last_sent))
            cursor.last_told = cursor.last_sent
            cursor.want_position = False

    def _send_page(self, stream: Stream, writer: str, items: list) -> int | None:
        """Write a page's items; the token the page ends with (its last
        token's numeric RDATA or POSITION), None for an empty page."""
        self._conn.send_rows(stream.name, writer, items)
        if not items:
            return None
        last = items[-1]
        return last[0] if type(last) is tuple else last.new_token

    def _read(self, stream: Stream, writer: str, start: int, target: int, generation: int, span: int | None) -> _Read:
        """Start reading the page after ``start``, up to ``target`` or, once
        a ``span`` is known, the next ``span`` tokens."""
        end = target if span is None else min(target, start + span)
        return _Read(start, end, generation, span is not None, self._get_page(stream, writer, start, end))

    def _get_page(self, stream: Stream, writer: str, start: int, end: int) -> defer.Deferred:
        """Read the page after ``start``, up to ``end``: ``get_rdata_page``
        (its lines, where the stream makes them)."""
        return defer.ensureDeferred(
            stream.get_rdata_page(writer, start, end, self._page_size, f"RDATA {stream.name} {writer} ")
        )

    def _page_commands(
        self,
        stream: Stream,
        writer: str,
        start: int,
        updates: list[tuple[int, str]],
        upto: int,
        limited: bool,
    ) -> list:
        """Turn a page of ``(token, row_json)`` (``get_encoded_updates``)
        into what ``send_rows`` writes: ``(token or None, row or None,
        row_json)`` per RDATA line (``None``: ``batch``), and a POSITION for a
        token that cannot be sent as lines. The stream's contract is checked
        first so a bad page sends nothing (never half a batch)."""
        stream_name = stream.name
        if upto <= start or (limited and not updates):
            raise StreamContractError(
                f"{stream_name}/{writer}: get_updates from {start} made no progress (upto={upto})"
            )
        # Bytes of a line besides the row: "RDATA <stream> <writer> <token> ".
        # Rows are ASCII JSON, so their length in characters is in bytes.
        room = self._max_line_length - len(f"RDATA {stream_name} {writer} ".encode()) - 1
        items = _plain_page(updates, start, upto, room - _MAX_TOKEN_DIGITS)
        if items is not None:
            return items
        items = []
        previous = start
        index = 0
        count = len(updates)
        while index < count:
            token = updates[index][0]
            if token <= start or token < previous or token > upto:
                raise StreamContractError(
                    f"{stream_name}/{writer}: token {token} out of order or outside ({start}, {upto}]"
                )
            previous = token
            end = index + 1
            while end < count and updates[end][0] == token:
                end += 1
            row_room = room - max(len(str(token)), 5)  # 5: len("batch")
            rows: list | None = []
            for _, row_json in updates[index:end]:
                if type(row_json) is not str or not row_json.isascii():
                    raise StreamContractError(
                        f"{stream_name}/{writer}: row at {token} is not encoded: {describe(repr(row_json))}"
                    )
                if len(row_json) <= row_room:
                    rows.append((None, None, row_json))
                    continue
                row = decode_row(row_json)
                if type(row) is list:
                    row = tuple(row)  # as get_updates gives it
                parts = stream.split_row(row, lambda part, limit=row_room: len(encode_row(part)) <= limit)
                if parts is None:
                    self.log.error(
                        "[{conn_id}] {stream}/{writer}: a row at {token} is too long for one line "
                        "({length} bytes, limit {limit}) and cannot be split: the client is told to "
                        "fetch that token itself",
                        conn_id=self._conn.conn_id,
                        stream=stream_name,
                        writer=writer,
                        token=token,
                        length=len(row_json),
                        limit=self._max_line_length,
                    )
                    rows = None
                    break
                rows.extend((None, part, encode_row(part)) for part in parts)
            if rows is None:
                items.append(PositionCommand(stream_name, writer, token, token))
            else:
                _, row, row_json = rows[-1]
                rows[-1] = (token, row, row_json)
                items.extend(rows)
            index = end
        return items
