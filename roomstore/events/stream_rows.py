"""The rows the events and backfill streams carry, read from the event tables.

Replication (``roomstore.replication.store_streams``) pages through them; the
statements are their tables' owners' (``roomstore.events.tables.events``'s
``event_stream_rows_sql`` and ``event_json_stream_rows_sql``,
``roomstore.events.tables.room_state``'s ``STATE_STREAM_ROWS`` and
``state_json_stream_rows_sql``: on PostgreSQL one statement a page, a round
trip); this module pages and names the rows, in the layout replication
sends (Synapse's, ``store_streams`` describes it): the events stream's
``("ev", (event_id, room_id, type, state_key, redacts, None, membership,
rejected, outlier))`` per event and ``("state", (room_id, type, state_key,
event_id or None))`` per current-state change, the backfill stream's
``(event_id, room_id, type, state_key, redacts, None)``.

``encoded=True`` gives each row as its JSON text instead, written as
replication's ``encode_row`` writes it (compact, ASCII escapes): what a
server sends a page as. Where the database runs in this process
(``Engine.in_process``: SQLite, whose work runs without the GIL) it writes
each row's text, and the few rows holding characters it leaves as they are
(non-ASCII, DEL) are written again here; elsewhere (PostgreSQL, whose server
would spend twice what Python does) the text is put together here from the
fields, with no Python object per row but the text. Room IDs and state
keys come from the interners (small tables, cached), or, in the database's
JSON, from the statement; on PostgreSQL so do a server's (encoded) pages'
event IDs (the statement gives nids: a writer's cache holds its recent
events' IDs, the rest are read in one statement, a range where the page's
nids are dense, and not cached), where a lookup a row cost its server
more than the rest of the page. ``redacts`` is what a redaction event says it
redacts (as Synapse's rows carry it), not the same-room rule the readers
apply (``roomstore.events.tables.events``).
"""

from __future__ import annotations

import bisect
import itertools
import json
import json.encoder
import operator

from roomstore.events.tables.events import (
    BACKFILL_EVENT_NID_STREAM_ROWS,
    BACKFILL_EVENT_STREAM_ROWS,
    LIVE_EVENT_NID_STREAM_ROWS,
    LIVE_EVENT_STREAM_ROWS,
    event_json_stream_rows_sql,
    event_page_bound_sql,
    event_stream_rows_sql,
)
from roomstore.events.tables.room_state import STATE_NID_STREAM_ROWS, STATE_STREAM_ROWS, state_json_stream_rows_sql
from roomstore.storage.collector import collector_paused
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners
from roomstore.visibility.codes import MEMBERSHIP_BY_CODE

__all__ = ["stream_page_txn", "stream_text_txn"]

#: First window of a page, in rows per requested row; doubled while short.
_WINDOW = 2

_token = operator.itemgetter(0)

#: A JSON string as ``json.dumps(ensure_ascii=True)`` writes it (C).
_quote = json.encoder.c_encode_basestring_ascii or json.encoder.py_encode_basestring_ascii  # type: ignore[attr-defined]  # CPython private

#: A membership code's JSON (an unknown code: null).
_MEMBERSHIP_JSON = {code: _quote(name) for code, name in MEMBERSHIP_BY_CODE.items()}

#: Rows with other characters than these the database writes as they are
#: (non-ASCII, DEL): written again, as Python's ``json`` writes them.
_ascii_json = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode

_STATEMENTS: dict[tuple, tuple[str, ...]] = {}


def _statements(engine, live: bool, encoded: bool) -> tuple[str, ...]:
    """The statements reading a window of a page: the events', then (live)
    the state changes' with the same range. Where a statement costs a round
    trip (PostgreSQL) they are one (a UNION ALL); in-process (SQLite) they
    run apart, and with ``encoded`` the database writes each row's JSON."""
    key = (engine.name, live, encoded)
    statements = _STATEMENTS.get(key)
    if statements is None:
        if engine.in_process and encoded:
            statements = (event_json_stream_rows_sql(engine, live), *([state_json_stream_rows_sql(engine)] * live))
        elif engine.in_process:
            statements = (event_stream_rows_sql(live, join_ids=True), *([STATE_STREAM_ROWS] * live))
        elif live and encoded:
            statements = (
                f"SELECT * FROM ({LIVE_EVENT_NID_STREAM_ROWS}) AS page_events UNION ALL {STATE_NID_STREAM_ROWS}",
            )
        elif encoded:
            statements = (BACKFILL_EVENT_NID_STREAM_ROWS,)
        elif live:
            statements = (f"SELECT * FROM ({LIVE_EVENT_STREAM_ROWS}) AS page_events UNION ALL {STATE_STREAM_ROWS}",)
        else:
            statements = (BACKFILL_EVENT_STREAM_ROWS,)
        statements = _STATEMENTS[key] = statements
    return statements


def _page_rows_txn(
    txn: Transaction, live: bool, instance: str, from_token: int, upto: int, limit: int, encoded: bool
) -> tuple[list[tuple], bool]:
    """The page's raw rows (the statements' columns), sorted and cut, and
    ``more``; read window by window until ``limit + 1`` events are seen."""
    statements = _statements(txn.engine, live, encoded)
    rows: list[tuple] = []
    events = 0
    lo = from_token
    span = max(limit * _WINDOW, 64)
    while events <= limit and lo < upto:
        hi = min(upto, lo + span)
        page_args = (instance, lo, hi, limit + 1 - events)
        if len(statements) == 1:
            got = txn.execute(statements[0], page_args + ((instance, lo, hi) if live else ()), prepare=True).fetchall()
            events += [row[1] for row in got].count(0)
        else:
            got = txn.execute(statements[0], page_args, prepare=True).fetchall()
            events += len(got)
            got += txn.execute(statements[1], (instance, lo, hi), prepare=True).fetchall()
        rows += got
        lo, span = hi, span * 2
    # Token, then an event before its state changes, those by type and
    # state key: only state rows share a token and a kind.
    rows.sort()
    more = events > limit
    if more:
        # One event per token: the page ends with the `limit`th event's token.
        bound = [row[0] for row in rows if row[1] == 0][limit - 1]
        del rows[bisect.bisect_right(rows, bound, key=_token) :]
    return rows, more


def stream_page_txn(
    txn: Transaction,
    interners: Interners,
    *,
    live: bool,
    instance: str,
    from_token: int,
    upto: int,
    limit: int,
    encoded: bool = False,
) -> tuple[list[tuple], bool]:
    """``(rows, more)``: ``(token, row)`` of ``instance``'s live events and
    the current-state changes they made (or, with ``live=False``, its
    backfilled events) with ``from_token < token <= upto``, in token order (a
    token's event first, then its state changes by type and state key): at
    most ``limit`` events; ``more``: events after them were left out, and
    then the state changes stop at the last event's token. Rows are in the
    layout the module docstring gives, as JSON text with ``encoded``.

    The page's thousands of short-lived tuples are made with the cyclic
    garbage collector paused (``storage.collector``): they are freed by
    reference counting once sent or applied."""
    with collector_paused():
        return _stream_page(txn, interners, live, instance, from_token, upto, limit, encoded)


def _stream_page(
    txn: Transaction,
    interners: Interners,
    live: bool,
    instance: str,
    from_token: int,
    upto: int,
    limit: int,
    encoded: bool,
    prefix: str | None = None,
) -> tuple[list[tuple] | tuple, bool]:
    """``stream_page_txn``'s page; with ``prefix`` (not in process), as
    ``stream_text_txn``'s lines instead of rows (``(text, count, first,
    last, longest)``; rows with no page: ``[]``)."""
    if encoded and txn.engine.in_process:
        return _database_json_page(txn, live, instance, from_token, upto, limit)
    rows, more = _page_rows_txn(txn, live, instance, from_token, upto, limit, encoded)
    if not rows:
        return [], more
    rooms = interners.rooms.resolve(txn, {row[5] for row in rows})
    keys = interners.state_keys.resolve(txn, {row[7] for row in rows if row[7] is not None})
    ids = _event_ids(txn, interners, rows, encoded)
    if not encoded:
        return _row_values(rows, ids, rooms, keys, live), more
    texts = _row_texts(rows, ids, rooms, keys, live)
    tokens = [row[0] for row in rows]
    if prefix is None:
        return list(zip(tokens, texts, strict=True)), more
    return _page_lines(tokens, texts, prefix), more


def _database_json_page(
    txn: Transaction, live: bool, instance: str, from_token: int, upto: int, limit: int
) -> tuple[list[tuple], bool]:
    """An encoded page whose rows' JSON the database wrote (in process); the
    rows with characters it leaves as they are (non-ASCII, DEL) written again."""
    rows, more = _page_rows_txn(txn, live, instance, from_token, upto, limit, True)
    page = [(row[0], row[4]) for row in rows]
    text = "".join([row for _, row in page])
    if not text.isascii() or "\x7f" in text:
        page = [
            (token, row if row.isascii() and "\x7f" not in row else _ascii_json(json.loads(row))) for token, row in page
        ]
    return page, more


def _event_ids(txn: Transaction, interners: Interners, rows: list[tuple], encoded: bool) -> list:
    """The rows' event IDs: as the statement gave them, or (``encoded``) from
    the nids it gave."""
    ids = [row[4] for row in rows]
    if not encoded:
        return ids
    # The server's page (PostgreSQL): the statement gave event nids, their
    # IDs come from the interner's cache (a writer holds its recent
    # events'), the rest from one statement (a range, where the page's
    # nids are dense), not cached (old history read once must not push
    # out what the writer uses). A worker's rows (not encoded) keep the
    # lookup in the statement: its cache holds none of them, and its
    # own process is what a fill waits on.
    if None in ids:  # a state change that removed its key
        present = [nid for nid in ids if nid is not None]
        resolved = iter(interners.events.resolve_list(txn, present, remember=False))
        return [None if nid is None else next(resolved) for nid in ids]
    return interners.events.resolve_list(txn, ids, remember=False)


def _row_values(rows: list[tuple], ids: list, rooms: dict, keys: dict, live: bool) -> list[tuple]:
    """``(token, row)`` of each raw row, the row in replication's layout."""
    if not live:
        return [
            (token, (event_id, rooms[room], event_type, None if key is None else keys[key][1], redacts, None))
            for (token, _, _, _, _, room, event_type, key, redacts, *_), event_id in zip(rows, ids, strict=True)
        ]
    membership = MEMBERSHIP_BY_CODE.get
    return [
        (
            token,
            (
                "ev",
                (
                    event_id,
                    rooms[room],
                    event_type,
                    None if key is None else keys[key][1],
                    redacts,
                    None,
                    membership(code),
                    bool(rejected),
                    bool(outlier),
                ),
            ),
        )
        if kind == 0
        else (token, ("state", (rooms[room], state_type, state_key, event_id)))
        for (
            token,
            kind,
            state_type,
            state_key,
            _,
            room,
            event_type,
            key,
            redacts,
            code,
            rejected,
            outlier,
        ), event_id in zip(rows, ids, strict=True)
    ]


def _row_texts(rows: list[tuple], ids: list, rooms: dict, keys: dict, live: bool) -> list[str]:
    """The JSON text of each raw row, from its fields: a room's, a state
    key's, an event type's and a membership's text once a page."""
    quote = _quote
    room_json = {nid: quote(room_id) for nid, room_id in rooms.items()}
    key_json = {nid: quote(key[1]) for nid, key in keys.items()}
    type_json = {event_type: quote(event_type) for event_type in {row[6] for row in rows if row[1] == 0}}
    if not live:
        return [
            f"[{quote(event_id)},{room_json[room]},{type_json[event_type]},"
            f"{'null' if key is None else key_json[key]},{'null' if redacts is None else quote(redacts)},null]"
            for (token, _, _, _, _, room, event_type, key, redacts, *_), event_id in zip(rows, ids, strict=True)
        ]
    membership_json = _MEMBERSHIP_JSON.get
    return [
        f'["ev",[{quote(event_id)},{room_json[room]},{type_json[event_type]},'
        f"{'null' if key is None else key_json[key]},{'null' if redacts is None else quote(redacts)},null,"
        f"{membership_json(code, 'null')},{'true' if rejected else 'false'},"
        f"{'true' if outlier else 'false'}]]"
        if kind == 0
        else f'["state",[{room_json[room]},{quote(state_type)},{quote(state_key)},'
        f"{'null' if event_id is None else quote(event_id)}]]"
        for (
            token,
            kind,
            state_type,
            state_key,
            _,
            room,
            event_type,
            key,
            redacts,
            code,
            rejected,
            outlier,
        ), event_id in zip(rows, ids, strict=True)
    ]


def _page_lines(tokens: list[int], texts: list[str], prefix: str) -> tuple:
    """``(text, count, first, last, longest)`` of the page's lines: a token's
    last row carries it, the others "batch"."""
    following: list[int | None] = [*tokens[1:], None]
    heads = [
        f"{prefix}batch " if token == after else f"{prefix}{token} "
        for token, after in zip(tokens, following, strict=True)
    ]
    lines = list(map(str.__add__, heads, texts))
    lines.append("")
    return ("\n".join(lines), len(texts), tokens[0], tokens[-1], max(map(len, lines)))


_TEXT_STATEMENTS: dict[tuple, tuple] = {}


def stream_text_txn(
    txn: Transaction,
    interners: Interners,
    *,
    live: bool,
    instance: str,
    from_token: int,
    upto: int,
    limit: int,
    prefix: str,
) -> tuple[tuple, int, bool] | None:
    """A page of ``instance``'s live events and their current-state changes
    (or, with ``live=False``, its backfilled events) as the text of the
    RDATA lines replication sends: ``((text, count, first, last, longest),
    upto, limited)``, written by the database where it runs in process
    (SQLite), else from the fields as ``stream_page_txn`` writes the rows'
    text (PostgreSQL), in the same pass. The page: the first ``limit`` events after ``from_token``
    (up to ``upto``) and the state changes at their tokens; ``limited``:
    events after them were left out, and ``upto`` is then the last event's
    token. Each line is ``prefix``, the token (``batch`` on every row of a
    token but its last), a space and the row's JSON text (the rows and their
    order of ``stream_page_txn(encoded=True)``), and ends in a newline;
    ``count`` lines, tokens ``first`` to ``last``, the longest ``longest``
    characters. None where the database wrote characters it leaves as they
    are (non-ASCII, DEL): the caller reads the page as rows instead.

    The events' lines come as one text (no Python object per row); the few
    state changes are put in after their events' lines. None too for a
    state change at a token with no event of the page (the writer never
    makes one): the rows' path orders any page."""
    engine = txn.engine
    if not engine.in_process:
        with collector_paused():
            page, more = _stream_page(txn, interners, live, instance, from_token, upto, limit, True, prefix)
        if not page:
            return ("", 0, None, None, 0), upto, False
        return page, page[3] if more else upto, more
    bound_sql, lines_sql, state_sql = _text_statements(engine, live)
    with collector_paused():
        bound = txn.execute(bound_sql, (instance, from_token, upto, limit - 1), prepare=True).fetchall()
        limited = len(bound) == 2
        end = bound[0][0] if limited else upto
        text, count, first, last, longest = txn.execute(
            lines_sql, (prefix, instance, from_token, end), prepare=True
        ).fetchone()
        state = txn.execute(state_sql, (instance, from_token, end), prepare=True).fetchall() if live else ()
        if state:
            if text is None:
                return None  # state changes with no event: never written so
            merged = _with_state_lines(text, state, prefix, count, first, last, longest)
            if merged is None:
                return None  # a state change at a token with no event: never written so
            text, count, first, last, longest = merged
        if text is None:
            return ("", 0, None, None, 0), end, limited
        if not text.isascii() or "\x7f" in text:
            return None
        return (text + "\n", count, first, last, longest), end, limited


def _text_statements(engine, live: bool) -> tuple:
    """``stream_text_txn``'s statements: the page's bound, its events' lines
    and (live) its state changes' rows."""
    statements = _TEXT_STATEMENTS.get((engine.name, live))
    if statements is None:
        statements = _TEXT_STATEMENTS[(engine.name, live)] = (
            event_page_bound_sql(live),
            event_json_stream_rows_sql(engine, live, lines=True),
            state_json_stream_rows_sql(engine) if live else None,
        )
    return statements


def _with_state_lines(
    text: str, state: list[tuple], prefix: str, count: int, first: int, last: int, longest: int
) -> tuple[str, int, int, int, int] | None:
    """The events' lines ``text`` with the state changes' lines put in:
    ``(text, count, first, last, longest)`` of them all; None for a state
    change at a token with no event of the page."""
    # Each token's state rows after its event's line (then "batch"),
    # by type and state key, as stream_page_txn sorts them; the
    # events' lines found in one pass over the text.
    state.sort()
    pieces: list[str] = []
    done = 0
    for token, rows in itertools.groupby(state, key=_token):
        json_rows = [row[4] for row in rows]
        line = f"{prefix}{token} "
        if done == 0 and text.startswith(line):
            at = 0
        else:
            at = text.find("\n" + line, done) + 1
            if at == 0:
                return None
        line_end = text.find("\n", at)
        line_end = len(text) if line_end < 0 else line_end
        batch_line = f"{prefix}batch{text[at + len(line) - 1 : line_end]}"
        state_lines = [f"{prefix}batch {row}" for row in json_rows]
        state_lines[-1] = f"{prefix}{token} {json_rows[-1]}"
        longest = max(longest, len(batch_line), *map(len, state_lines))
        pieces += (text[done:at], batch_line, "\n", "\n".join(state_lines))
        done = line_end
        count += len(json_rows)
    pieces.append(text[done:])
    return "".join(pieces), count, min(first, state[0][0]), max(last, state[-1][0]), longest
