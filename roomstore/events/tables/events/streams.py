"""The events and backfill streams' statements over ``events``: the newest IDs per writer (read at start-up)
and a page of each stream, as rows or as JSON text (``roomstore.events.stream_rows``)."""

from __future__ import annotations

from roomstore.storage.interning import (
    event_id_sql,
    join_event_ids,
    join_rooms,
    state_key_sql,
)
from roomstore.visibility.codes import MEMBERSHIP_BY_CODE
from roomstore.visibility.memberships import membership_of_sql

#: The newest IDs per writer of the events stream (positive ``stream_ordering``) and of the backfill stream
#: (negative, counted as positive IDs), read at start-up by their ID generators.
NEWEST_LIVE_STREAM_IDS = (
    "SELECT instance_name, MAX(stream_ordering) FROM events WHERE stream_ordering > 0 GROUP BY instance_name"
)
NEWEST_BACKFILL_STREAM_IDS = (
    "SELECT instance_name, MAX(-stream_ordering) FROM events WHERE -stream_ordering > 0 GROUP BY instance_name"
)


# ---------------------------------------------------------------------- the events and backfill streams

# The page of events is an index range scan on events alone that stops
# after LIMIT rows. The event ID is a correlated scalar subquery, which both
# engines run per row as a primary-key lookup; membership and redaction
# lookups run only for member and redaction events (CASE); room IDs and
# state keys come from the store's interners (small tables, cached). With
# joins instead, PostgreSQL may hash-join a whole table (a sequential scan
# of event_ids) into every page, so each page costs as much as the whole
# history and a catch-up is quadratic. The range is a window of stream
# orderings a few pages wide, widened while the page is short
# (``stream_rows.stream_page_txn``): PostgreSQL without fresh statistics
# estimates a handful of rows for any range and reads and sorts all of it, so
# an open range would cost the whole rest of the stream for every page.
#
# Columns: ``(token, kind, state type, state key, event_id, room_nid, type,
# type_key_nid, redacts, membership code, rejected, outlier)``, kind 0 for
# an event (state type and key NULL: sorting needs them for state rows
# only), so that ``room_state.STATE_STREAM_ROWS`` can be its UNION partner.
_REDACTS = (
    f"(SELECT ri.event_id FROM redactions AS red {join_event_ids('ri', 'red.redacts_event_nid')}"
    " WHERE red.redaction_event_nid = e.event_nid)"
)

#: (token, ORDER BY, range) of live events, whose tokens are stream
#: orderings, and of backfilled events, whose tokens are minus their
#: (negative) stream orderings; the range is written on the column itself so
#: the index serves it.
_PAGE_RANGES = {
    True: ("e.stream_ordering", "e.stream_ordering", "e.stream_ordering > ? AND e.stream_ordering <= ?"),
    False: (
        "-e.stream_ordering",
        "e.stream_ordering DESC",
        "e.stream_ordering < 0 - CAST(? AS BIGINT) AND e.stream_ordering >= 0 - CAST(? AS BIGINT)",
    ),
}


def event_stream_rows_sql(live: bool, join_ids: bool = False, nids: bool = False) -> str:
    """``LIVE_EVENT_STREAM_ROWS`` (``live``) or ``BACKFILL_EVENT_STREAM_ROWS``;
    ``join_ids``: the event IDs joined rather than looked up in a scalar
    subquery (where a lookup by key costs next to nothing and no planner can
    turn the join into a scan of event_ids: SQLite); ``nids``: the event's
    nid in the event ID's column, for the caller to resolve (PostgreSQL
    spent 1.4 us a row on the lookup, more than the rest of the page)."""
    token, order, where = _PAGE_RANGES[live]
    event_id, joins = (
        ("i.event_id", join_event_ids("i", "e.event_nid"))
        if join_ids
        else (("e.event_nid", "") if nids else (event_id_sql("e.event_nid"), ""))
    )
    return f"""
SELECT {token}, 0, NULL, NULL,
    {event_id},
    e.room_nid,
    e.type,
    e.type_key_nid,
    CASE WHEN e.type = 'm.room.redaction' THEN {_REDACTS} END,
    CASE WHEN e.type = 'm.room.member' THEN {membership_of_sql("e.event_nid")} END,
    e.rejected_reason IS NOT NULL,
    e.outlier
FROM events AS e {joins}
WHERE e.instance_name = ? AND {where}
ORDER BY {order}
LIMIT ?
"""


#: Live events (binds the instance, the range's two ends and the LIMIT).
LIVE_EVENT_STREAM_ROWS = event_stream_rows_sql(True)
#: Backfilled events (the same bindings).
BACKFILL_EVENT_STREAM_ROWS = event_stream_rows_sql(False)
#: ``LIVE_EVENT_STREAM_ROWS`` and ``BACKFILL_EVENT_STREAM_ROWS`` with the
#: event nid where the event ID was.
LIVE_EVENT_NID_STREAM_ROWS = event_stream_rows_sql(True, nids=True)
BACKFILL_EVENT_NID_STREAM_ROWS = event_stream_rows_sql(False, nids=True)


def event_json_stream_rows_sql(engine, live: bool, lines: bool = False) -> str:
    """``LIVE_EVENT_STREAM_ROWS`` (``live``) or ``BACKFILL_EVENT_STREAM_ROWS``
    with each row written as its JSON text by the database (where
    ``engine.in_process``): columns ``(token, 0, NULL, NULL, row JSON)``,
    the row in replication's layout (``roomstore.events.stream_rows``), so
    that ``room_state.state_json_stream_rows_sql`` can be its UNION partner.
    The same bindings. ``lines``: one row, ``(text, count, first, last,
    longest)``, the page's lines (a line prefix bound first, then its token,
    a space, the row; joined by newlines), how many, the first and last
    tokens and the longest line's length, every event of the range (no
    ``LIMIT`` bound). Room IDs and state keys are looked up here, per row
    (an in-process lookup by key costs next to nothing)."""
    token, order, where = _PAGE_RANGES[live]
    membership = " ".join(f"WHEN {int(code)} THEN '{name}'" for code, name in sorted(MEMBERSHIP_BY_CODE.items()))
    fields = [
        ("text", "i.event_id"),
        ("text", "r.room_id"),
        ("text", "e.type"),
        ("text", f"CASE WHEN e.type_key_nid IS NOT NULL THEN {state_key_sql('e.type_key_nid')} END"),
        ("text", f"CASE WHEN e.type = 'm.room.redaction' THEN {_REDACTS} END"),
        ("text", "NULL"),
    ]
    if live:
        fields += [
            (
                "text",
                f"CASE WHEN e.type = 'm.room.member' THEN CASE {membership_of_sql('e.event_nid')} {membership} END END",
            ),
            ("bool", "e.rejected_reason IS NOT NULL"),
            ("bool", "e.outlier"),
        ]
        row = engine.json_array_sql([("text", "'ev'"), ("array", engine.json_array_sql(fields))])
    else:
        row = engine.json_array_sql(fields)
    if lines:
        # One text for the page: each event's line, in token order (a
        # subquery's ORDER BY is the order an aggregate over it reads).
        return f"""
SELECT group_concat(line, char(10)), count(*), min(token), max(token), max(length(line)) FROM (
SELECT {token} AS token, ? || {token} || ' ' || {row} AS line
FROM events AS e {join_event_ids("i", "e.event_nid")} {join_rooms("r", "e.room_nid")}
WHERE e.instance_name = ? AND {where}
ORDER BY {order})
"""
    return f"""
SELECT {token}, 0, NULL, NULL, {row}
FROM events AS e {join_event_ids("i", "e.event_nid")} {join_rooms("r", "e.room_nid")}
WHERE e.instance_name = ? AND {where}
ORDER BY {order}
LIMIT ?
"""


def event_page_bound_sql(live: bool) -> str:
    """The tokens of an instance's ``OFFSET``-th and next event in a range of
    the live (``live``) or backfill stream, in token order (binds the
    instance, the range's two ends and the offset): none or one when the
    range holds no more events than that."""
    token, order, where = _PAGE_RANGES[live]
    return f"SELECT {token} FROM events AS e WHERE e.instance_name = ? AND {where} ORDER BY {order} LIMIT 2 OFFSET ?"
