"""``hs_client_txns``: client transaction IDs and the event each made."""

from __future__ import annotations

from roomstore.storage import Transaction

__all__ = ["add_client_txn_txn", "get_client_txn_txn"]


def get_client_txn_txn(txn: Transaction, user_id: str, device_id: str, txn_id: str) -> str | None:
    row = txn.execute("SELECT event_id FROM hs_client_txns WHERE user_id = ? AND device_id = ? AND txn_id = ?",
                      (user_id, device_id, txn_id)).fetchone()
    return None if row is None else row[0]


def add_client_txn_txn(txn: Transaction, user_id: str, device_id: str, txn_id: str, event_id: str) -> None:
    txn.execute("INSERT INTO hs_client_txns (user_id, device_id, txn_id, event_id) VALUES (?, ?, ?, ?)",
                (user_id, device_id, txn_id, event_id))
