"""Writing the events tables: new events' rows and bytes (bulk-loaded), redactions, the redacted flag and
censoring's rewrites."""

from __future__ import annotations

from collections.abc import Sequence

from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    chunks,
)

EVENT_COLUMNS = (
    "event_nid",
    "room_nid",
    "type",
    "type_key_nid",
    "sender_nid",
    "depth",
    "topological_ordering",
    "stream_ordering",
    "instance_name",
    "origin_server_ts",
    "received_ts",
    "outlier",
    "rejected_reason",
    "backfilled",
    "redacted",
    "state_group_before",
    "state_group",
    "visibility_before",
    "visibility_after",
    "soft_failed",
)


# ---------------------------------------------------------------------- writes


# The rows of new events are bulk-loaded (``copy_rows``: COPY on PostgreSQL,
# whose text costs a third of binding a multi-row INSERT in Python, and less
# for the server to take in); every row is new (a fresh event nid), so no
# conflict clause is needed: a second writer of the same event fails on the
# primary key, as it did with INSERT.


def insert_events(txn: Transaction, rows: Sequence[tuple]) -> None:
    """Write ``events`` rows of ``EVENT_COLUMNS`` (new events only)."""
    txn.copy_rows("events", EVENT_COLUMNS, rows)


def insert_event_json(txn: Transaction, rows: Sequence[tuple]) -> None:
    """Write ``(event_nid, room_version, json, censored)`` rows (new events
    only); censored: the bytes are the redacted form (a content hash
    mismatch, pdu/content_hash.py)."""
    txn.copy_rows("event_json", ("event_nid", "room_version", "json", "censored"), rows)


def insert_redactions(txn: Transaction, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """Queue ``(redaction_event_nid, redacts_event_nid, received_ts,
    authorised)`` rows (``authorised``: ``same_room_redactions``)."""
    txn.insert_many(
        "redactions", ("redaction_event_nid", "redacts_event_nid", "received_ts", "authorised"), rows, queue=True
    )


def queue_flag_redacted(txn: Transaction, nids: Sequence[int]) -> None:
    """Queue: ``events.redacted`` set on ``nids``."""
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        txn.queue(f"UPDATE events SET redacted = ? WHERE event_nid IN ({marks})", (True, *part))


def replace_json_txn(txn: Transaction, nid: int, raw: bytes, censored: bool) -> None:
    """The stored bytes of an event replaced (censoring)."""
    txn.execute("UPDATE event_json SET json = ?, censored = ? WHERE event_nid = ?", (raw, censored, nid))


def mark_censored_txn(txn: Transaction, redaction_nid: int) -> None:
    """Record that censoring has dealt with a redaction."""
    txn.execute("UPDATE redactions SET have_censored = ? WHERE redaction_event_nid = ?", (True, redaction_nid))
