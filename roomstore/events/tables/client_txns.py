"""The ``client_txn_ids`` table: which event a client's transaction ID made,
and every statement that names it.

One row per ``(user_nid, device_id, txn_id)``: the event persisted with that
``EventToPersist.client_txn`` (schema version 10), its room (a purge deletes
a room's rows by it) and when it was recorded. Written by the persister's
batch (``roomstore.events.write.client_txns`` decides what), read by
``RoomStore.get_event_id_for_txn`` and, the other way (event to txn ID, for
the client format's ``unsigned.transaction_id``), by
``roomstore.events.read.client_format``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from roomstore.storage.database import Transaction
from roomstore.storage.interning import chunks, join_event_ids, join_users

#: A client transaction as the table keys it: (user nid, device ID, txn ID).
TxnKey = tuple[int, str, str]

__all__ = [
    "TxnKey",
    "delete_event_txns_txn",
    "delete_room_txns_txn",
    "event_id_for_txn_txn",
    "event_nids_of_txns_txn",
    "queue_txns",
    "txn_records_of_events_txn",
]


def event_nids_of_txns_txn(txn: Transaction, keys: Iterable[TxnKey]) -> dict[TxnKey, int]:
    """The event nid recorded for each of ``keys`` that has one."""
    found: dict[TxnKey, int] = {}
    for part in chunks(sorted(set(keys))):
        values = ", ".join("(?, ?, ?)" for _ in part)
        rows = txn.execute(
            "SELECT user_nid, device_id, txn_id, event_nid FROM client_txn_ids"
            f" WHERE (user_nid, device_id, txn_id) IN (VALUES {values})",
            [value for key in part for value in key],
        ).fetchall()
        found.update(((user_nid, device_id, txn_id), nid) for user_nid, device_id, txn_id, nid in rows)
    return found


def queue_txns(txn: Transaction, rows: Sequence[tuple]) -> None:
    """Queue ``(user_nid, device_id, txn_id, event_nid, room_nid,
    inserted_ts)`` rows; a key recorded meanwhile (another writer) is kept."""
    txn.insert_many(
        "client_txn_ids",
        ("user_nid", "device_id", "txn_id", "event_nid", "room_nid", "inserted_ts"),
        rows,
        on_conflict="ON CONFLICT DO NOTHING",
        queue=True,
    )


def event_id_for_txn_txn(txn: Transaction, user_id: str, device_id: str, txn_id: str) -> str | None:
    """The event ID recorded for the transaction, None when there is none."""
    row = txn.execute(
        f"SELECT i.event_id FROM client_txn_ids AS c {join_users('u', 'c.user_nid')}"
        f" {join_event_ids('i', 'c.event_nid')}"
        " WHERE u.user_id = ? AND c.device_id = ? AND c.txn_id = ?",
        (user_id, device_id, txn_id),
    ).fetchone()
    return None if row is None else row[0]


def txn_records_of_events_txn(txn: Transaction, event_ids: Iterable[str]) -> dict[str, list[tuple[str, str, str]]]:
    """Event ID -> the ``(user_id, device_id, txn_id)`` it was recorded
    with, for those of ``event_ids`` that were (one each, as
    ``roomstore.events.write.client_txns`` records: a list all the same)."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for part in chunks(sorted(set(event_ids))):
        marks = ", ".join("?" for _ in part)
        rows = txn.execute(
            f"SELECT i.event_id, u.user_id, c.device_id, c.txn_id FROM client_txn_ids AS c"
            f" {join_users('u', 'c.user_nid')} {join_event_ids('i', 'c.event_nid')}"
            f" WHERE i.event_id IN ({marks})",
            list(part),
        ).fetchall()
        for event_id, user_id, device_id, txn_id in rows:
            found.setdefault(event_id, []).append((user_id, device_id, txn_id))
    return found


def delete_room_txns_txn(txn: Transaction, room_nids: Sequence[int]) -> int:
    """Delete the rows of the rooms ``room_nids`` (a purge); returns how many went."""
    deleted = 0
    for part in chunks(sorted(set(room_nids))):
        marks = ", ".join("?" for _ in part)
        deleted += txn.execute(f"DELETE FROM client_txn_ids WHERE room_nid IN ({marks})", list(part)).rowcount
    return deleted


def delete_event_txns_txn(txn: Transaction, event_nids: Sequence[int]) -> int:
    """Delete the rows naming the events ``event_nids`` (purged history);
    returns how many went."""
    deleted = 0
    for part in chunks(sorted(set(event_nids))):
        marks = ", ".join("?" for _ in part)
        deleted += txn.execute(f"DELETE FROM client_txn_ids WHERE event_nid IN ({marks})", list(part)).rowcount
    return deleted
