"""``hs_profiles``: each user's display name and avatar URL."""

from __future__ import annotations

from roomstore.storage import Transaction

__all__ = ["get_profile_txn", "set_profile_field_txn"]

#: The profile fields a client may set, each a column of ``hs_profiles``.
FIELDS = ("displayname", "avatar_url")


def get_profile_txn(txn: Transaction, user_id: str) -> dict | None:
    """``{"displayname", "avatar_url"}`` (None values left out), or None: no row."""
    row = txn.execute("SELECT displayname, avatar_url FROM hs_profiles WHERE user_id = ?", (user_id,)).fetchone()
    if row is None:
        return None
    return {name: value for name, value in zip(FIELDS, row, strict=True) if value is not None}


def set_profile_field_txn(txn: Transaction, user_id: str, field: str, value: str | None) -> None:
    if field not in FIELDS:
        raise ValueError(f"no profile field {field!r}")
    if txn.execute("SELECT 1 FROM hs_profiles WHERE user_id = ?", (user_id,)).fetchone() is None:
        txn.execute("INSERT INTO hs_profiles (user_id) VALUES (?)", (user_id,))
    # The column name is one of FIELDS, never the client's text.
    txn.execute(f"UPDATE hs_profiles SET {field} = ? WHERE user_id = ?", (value, user_id))
