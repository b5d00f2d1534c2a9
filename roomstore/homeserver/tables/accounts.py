"""``hs_users``, ``hs_devices`` and ``hs_access_tokens``: who may log in, with
which devices, and which token belongs to which device; and who is a server
admin (``hs_users.admin``, schema version 2)."""

from __future__ import annotations

from roomstore.storage import Transaction

__all__ = [
    "add_device_txn",
    "add_token_txn",
    "add_user_txn",
    "delete_device_tokens_txn",
    "delete_token_txn",
    "delete_user_tokens_txn",
    "is_admin_txn",
    "password_hash_txn",
    "set_admin_txn",
    "user_exists_txn",
    "user_for_token_txn",
]


def user_exists_txn(txn: Transaction, user_id: str) -> bool:
    return txn.execute("SELECT 1 FROM hs_users WHERE user_id = ?", (user_id,)).fetchone() is not None


def add_user_txn(txn: Transaction, user_id: str, password_hash: str, now_ms: int) -> bool:
    """Register ``user_id``; False when it is taken (nothing written)."""
    if user_exists_txn(txn, user_id):
        return False
    txn.execute(
        "INSERT INTO hs_users (user_id, password_hash, created_ts) VALUES (?, ?, ?)", (user_id, password_hash, now_ms)
    )
    return True


def password_hash_txn(txn: Transaction, user_id: str) -> str | None:
    row = txn.execute("SELECT password_hash FROM hs_users WHERE user_id = ?", (user_id,)).fetchone()
    return None if row is None else row[0]


def is_admin_txn(txn: Transaction, user_id: str) -> bool:
    row = txn.execute("SELECT admin FROM hs_users WHERE user_id = ?", (user_id,)).fetchone()
    return row is not None and bool(row[0])


def set_admin_txn(txn: Transaction, user_id: str, admin: bool) -> bool:
    """Make ``user_id`` a server admin (or not); False when there is no such user."""
    if not user_exists_txn(txn, user_id):
        return False
    txn.execute("UPDATE hs_users SET admin = ? WHERE user_id = ?", (admin, user_id))
    return True


def add_device_txn(txn: Transaction, user_id: str, device_id: str, display_name: str | None, now_ms: int) -> None:
    """Add the device, or keep the one of that ID (a login naming its device again)."""
    row = txn.execute("SELECT 1 FROM hs_devices WHERE user_id = ? AND device_id = ?", (user_id, device_id)).fetchone()
    if row is None:
        txn.execute(
            "INSERT INTO hs_devices (user_id, device_id, display_name, created_ts) VALUES (?, ?, ?, ?)",
            (user_id, device_id, display_name, now_ms),
        )


def add_token_txn(txn: Transaction, token: str, user_id: str, device_id: str, now_ms: int) -> None:
    txn.execute(
        "INSERT INTO hs_access_tokens (token, user_id, device_id, created_ts) VALUES (?, ?, ?, ?)",
        (token, user_id, device_id, now_ms),
    )


def user_for_token_txn(txn: Transaction, token: str) -> tuple[str, str] | None:
    """``(user_id, device_id)`` of an access token, None for an unknown one."""
    row = txn.execute("SELECT user_id, device_id FROM hs_access_tokens WHERE token = ?", (token,)).fetchone()
    return None if row is None else (row[0], row[1])


def delete_token_txn(txn: Transaction, token: str) -> None:
    txn.execute("DELETE FROM hs_access_tokens WHERE token = ?", (token,))


def delete_device_tokens_txn(txn: Transaction, user_id: str, device_id: str) -> None:
    """A logout: the device's tokens and the device go."""
    txn.execute("DELETE FROM hs_access_tokens WHERE user_id = ? AND device_id = ?", (user_id, device_id))
    txn.execute("DELETE FROM hs_devices WHERE user_id = ? AND device_id = ?", (user_id, device_id))


def delete_user_tokens_txn(txn: Transaction, user_id: str) -> None:
    """``/logout/all``: every token and device of the user."""
    txn.execute("DELETE FROM hs_access_tokens WHERE user_id = ?", (user_id,))
    txn.execute("DELETE FROM hs_devices WHERE user_id = ?", (user_id,))
