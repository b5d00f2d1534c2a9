"""A page of each built-in stream, as ``RoomStore`` hands it to replication.

Each function runs in one transaction (one snapshot) the reads of
``stream_rows.py`` (events, backfill) or ``caches.py`` (cache
invalidations) for the rows one writer wrote between two positions, at most
about ``limit`` of them; ``more`` says whether rows in the range were left
out. ``stream_rows.stream_page_txn`` gives the events and backfill streams'
pages as replication sends them (``RoomStore.read_events_stream_rows``);
the functions here give the same pages as fields. Nothing here holds SQL.
"""

from __future__ import annotations

import json

from roomstore.events.caches import invalidation_rows_txn
from roomstore.events.stream_rows.rows import stream_page_txn, stream_text_txn
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners

__all__ = ["backfill_page_txn", "events_page_txn", "invalidations_page_txn", "stream_page_txn", "stream_text_txn"]


def events_page_txn(
    txn: Transaction, interners: Interners, instance: str, from_token: int, upto: int, limit: int
) -> tuple[list[tuple], list[tuple], bool]:
    """``(events, state, more)``: the live events of ``instance`` with
    ``from_token < stream ID <= upto``, at most ``limit``, as ``(token,
    event_id, room_id, type, state_key, redacts, membership, rejected,
    outlier)`` in token order; ``more``: events after them were left out;
    ``state``: the current-state changes ``(token, room_id, type, state_key,
    event_id or None)`` up to the last event's token if ``more``, else up to
    ``upto``."""
    page, more = stream_page_txn(
        txn, interners, live=True, instance=instance, from_token=from_token, upto=upto, limit=limit
    )
    events = [(token, *fields[:5], *fields[6:]) for token, (kind, fields) in page if kind == "ev"]
    state = [(token, *fields) for token, (kind, fields) in page if kind == "state"]
    return events, state, more


def backfill_page_txn(
    txn: Transaction, interners: Interners, instance: str, from_token: int, upto: int, limit: int
) -> tuple[list[tuple], bool]:
    """``(events, more)``: ``(token, event_id, room_id, type, state_key,
    redacts)`` of backfilled events (tokens are the positive form of their
    stream orderings), in token order, at most ``limit``."""
    page, more = stream_page_txn(
        txn, interners, live=False, instance=instance, from_token=from_token, upto=upto, limit=limit
    )
    return [(token, *fields[:5]) for token, fields in page], more


def invalidations_page_txn(
    txn: Transaction, instance: str, from_token: int, upto: int, limit: int
) -> tuple[list[tuple], bool]:
    """``(rows, more)``: the cache invalidations ``(stream_id, cache_name,
    keys or None, invalidation_ts)`` of ``instance`` with ``from_token <
    stream_id <= upto``, at most ``limit`` rows without splitting a stream ID
    (a first ID holding more is returned whole); ``more``: rows were left out."""
    rows = invalidation_rows_txn(txn, instance, from_token, upto, limit + 1)
    more = len(rows) > limit
    if more:
        # The row after the page names the first token that may be cut;
        # every row of the tokens before it was fetched.
        first_cut = rows[limit][0]
        rows = [r for r in rows if r[0] < first_cut]
        if not rows:
            # The first token alone holds more than `limit` rows: all of it.
            rows = invalidation_rows_txn(txn, instance, from_token, first_cut)
            more = bool(invalidation_rows_txn(txn, instance, first_cut, upto, 1))
    return [(sid, name, None if keys is None else json.loads(keys), ts) for sid, name, keys, ts in rows], more
