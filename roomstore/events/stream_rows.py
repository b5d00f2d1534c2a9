"""The rows the events and backfill streams carry, read from the event tables.

Replication (``roomstore.replication.store_sources``) pages through them; the
SQL over ``events``, ``event_ids``, ``redactions``, ``room_memberships`` and
``current_state_deltas`` for it lives here, beside the other event-table SQL.
Rows are raw until ``event_fields_txn`` names their rooms, state keys and
memberships. ``redacts`` is what a redaction event says it redacts (as
Synapse's rows carry it), not the same-room rule the readers apply
(``roomstore.events.redactions``).
"""

from __future__ import annotations

from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners
from roomstore.visibility.rules import MEMBERSHIP_BY_CODE

__all__ = ["event_fields_txn", "event_rows_page_txn", "state_rows_txn"]

# The page of events is an index range scan on events alone that stops
# after LIMIT rows. The event ID is a correlated scalar subquery, which both
# engines run per row as a primary-key lookup; membership and redaction
# lookups run only for member and redaction events (CASE); room IDs and
# state keys come from the store's interners (small tables, cached). With
# joins instead, PostgreSQL may hash-join a whole table (a sequential scan
# of event_ids) into every page, so each page costs as much as the whole
# history and a catch-up is quadratic. The range is a window of stream
# orderings a few pages wide, widened while the page is short (_event_page):
# PostgreSQL without fresh statistics estimates a handful of rows for any
# range and reads and sorts all of it, so an open range would cost the whole
# rest of the stream for every page.
EVENT_ROW_SQL = """
SELECT {token},
    (SELECT event_id FROM event_ids WHERE event_nid = e.event_nid),
    e.room_nid,
    e.type,
    e.type_key_nid,
    CASE WHEN e.type = ? THEN
        (SELECT i.event_id FROM redactions AS red JOIN event_ids AS i ON i.event_nid = red.redacts_event_nid
         WHERE red.redaction_event_nid = e.event_nid)
    END,
    CASE WHEN e.type = ? THEN (SELECT membership FROM room_memberships WHERE event_nid = e.event_nid) END,
    e.rejected_reason IS NOT NULL,
    e.outlier
FROM events AS e
WHERE e.instance_name = ? AND {range}
ORDER BY {order}
LIMIT ?
"""
_CASE_TYPES = ("m.room.redaction", "m.room.member")

# Live events: tokens are stream orderings.
LIVE_EVENT_ROWS = EVENT_ROW_SQL.format(
    token="e.stream_ordering", order="e.stream_ordering", range="e.stream_ordering > ? AND e.stream_ordering <= ?"
)
# Backfilled events: tokens are minus their (negative) stream orderings;
# the range is written on the column itself so the index serves it.
BACKFILL_EVENT_ROWS = EVENT_ROW_SQL.format(
    token="-e.stream_ordering",
    order="e.stream_ordering DESC",
    range="e.stream_ordering < 0 - ? AND e.stream_ordering >= 0 - ?",
)

STATE_ROW_SQL = (
    "SELECT d.stream_ordering, r.room_id, k.type, k.state_key,"
    " (SELECT event_id FROM event_ids WHERE event_nid = d.event_nid)"
    " FROM current_state_deltas AS d JOIN rooms AS r ON r.room_nid = d.room_nid"
    " JOIN state_keys AS k ON k.type_key_nid = d.type_key_nid"
    " WHERE d.instance_name = ? AND d.stream_ordering > ? AND d.stream_ordering <= ?"
    " ORDER BY d.stream_ordering, k.type, k.state_key"
)



#: First window of a page, in rows per requested row; doubled while short.
_WINDOW = 2


def event_rows_page_txn(
    txn: Transaction, *, live: bool, instance: str, from_token: int, upto: int, limit: int
) -> list[tuple]:
    """Up to ``limit + 1`` raw rows of ``instance``'s live (or, with
    ``live=False``, backfilled) events with ``from_token < token <= upto``,
    in token order, read window by window; ``event_fields_txn`` names them."""
    sql = LIVE_EVENT_ROWS if live else BACKFILL_EVENT_ROWS
    rows: list[tuple] = []
    lo = from_token
    span = max(limit * _WINDOW, 64)
    while len(rows) <= limit and lo < upto:
        hi = min(upto, lo + span)
        rows.extend(txn.execute(sql, (*_CASE_TYPES, instance, lo, hi, limit + 1 - len(rows))).fetchall())
        lo, span = hi, span * 2
    return rows


def event_fields_txn(txn: Transaction, interners: Interners, rows: list[tuple]) -> list[tuple]:
    """``(token, event_id, room_id, type, state_key, redacts, membership
    name, rejected, outlier)`` for rows of ``EVENT_ROW_SQL`` (SQLite gives
    booleans as 0/1)."""
    if not rows:
        return []
    rooms = interners.rooms.resolve(txn, [r[2] for r in rows])
    keys = interners.state_keys.resolve(txn, [r[4] for r in rows if r[4] is not None])
    membership_name = MEMBERSHIP_BY_CODE.get
    return [
        (token, event_id, rooms[room_nid], event_type, None if key_nid is None else keys[key_nid][1], redacts,
         None if membership is None else membership_name(membership), bool(rejected), bool(outlier))
        for token, event_id, room_nid, event_type, key_nid, redacts, membership, rejected, outlier in rows
    ]


def state_rows_txn(txn: Transaction, instance: str, from_token: int, upto: int) -> list[tuple]:
    """``(token, room_id, type, state_key, event_id or None)`` of ``instance``'s
    current-state changes with ``from_token < token <= upto``, in token order."""
    return txn.execute(STATE_ROW_SQL, (instance, from_token, upto)).fetchall()
