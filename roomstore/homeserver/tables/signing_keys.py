"""``hs_signing_keys``: the server's signing key, kept in the database so a
restart signs with the same key."""

from __future__ import annotations

from roomstore.storage import Transaction

__all__ = ["get_or_add_signing_key_txn"]


def get_or_add_signing_key_txn(txn: Transaction, server_name: str, key_id: str, key_base64: str) -> tuple[str, str]:
    """``(key_id, key_base64)`` stored for ``server_name``; the one given is
    stored first when there is none."""
    row = txn.execute("SELECT key_id, key_base64 FROM hs_signing_keys WHERE server_name = ?", (server_name,)).fetchone()
    if row is not None:
        return row[0], row[1]
    txn.execute(
        "INSERT INTO hs_signing_keys (server_name, key_id, key_base64) VALUES (?, ?, ?)",
        (server_name, key_id, key_base64),
    )
    return key_id, key_base64
