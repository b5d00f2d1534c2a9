"""``hs_filters``: the filters clients upload, numbered per user."""

from __future__ import annotations

from roomstore.storage import Transaction

__all__ = ["add_filter_txn", "get_filter_txn"]


def add_filter_txn(txn: Transaction, user_id: str, filter_json: str) -> int:
    """Store a filter; returns its ID, the user's next number (from 0)."""
    row = txn.execute("SELECT MAX(filter_id) FROM hs_filters WHERE user_id = ?", (user_id,)).fetchone()
    filter_id = 0 if row is None or row[0] is None else row[0] + 1
    txn.execute(
        "INSERT INTO hs_filters (user_id, filter_id, filter_json) VALUES (?, ?, ?)", (user_id, filter_id, filter_json)
    )
    return filter_id


def get_filter_txn(txn: Transaction, user_id: str, filter_id: int) -> str | None:
    row = txn.execute(
        "SELECT filter_json FROM hs_filters WHERE user_id = ? AND filter_id = ?", (user_id, filter_id)
    ).fetchone()
    return None if row is None else row[0]
