"""The rows the events and backfill streams carry, read from the event tables.

Replication (``roomstore.replication.store_sources``) pages through them; the
statements are their tables' owners' (``roomstore.events.tables.events``'s
``LIVE_EVENT_ROWS`` / ``BACKFILL_EVENT_ROWS``, ``roomstore.events.tables.room_state``'s
``state_rows_txn``); this module pages and names the rows.
Rows are raw until ``event_fields_txn`` names their rooms, state keys and
memberships. ``redacts`` is what a redaction event says it redacts (as
Synapse's rows carry it), not the same-room rule the readers apply
(``roomstore.events.tables.events``).
"""

from __future__ import annotations

from roomstore.events.tables.events import BACKFILL_EVENT_ROWS, LIVE_EVENT_ROWS
from roomstore.events.tables.room_state import state_rows_txn
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners
from roomstore.visibility.rules import MEMBERSHIP_BY_CODE

__all__ = ["event_fields_txn", "event_rows_page_txn", "state_rows_txn"]

_CASE_TYPES = ("m.room.redaction", "m.room.member")

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
    name, rejected, outlier)`` for rows of ``EVENT_ROW_SQL`` (``roomstore.events.tables.events``) (SQLite gives
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
