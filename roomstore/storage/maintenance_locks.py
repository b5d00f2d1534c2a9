"""The ``maintenance_locks`` table: a named lock an offline maintenance job
holds while it rewrites tables under a running homeserver (one row per lock:
``lock_name``, ``holder``, ``acquired_ts``, ``heartbeat_ts``).

Every statement naming the table is here. The compaction job takes, beats and
releases its lock (:data:`COMPACTION_LOCK_NAME`) with these statements
(:mod:`roomstore.compaction.write_back`, through the roomstore layout's
record of statements, ``roomstore.compaction.roomstore_sql.STATEMENTS``); the store honours it before deleting state
groups (:func:`lock_row_txn`, from :mod:`roomstore.state.groups`). It lives in
``storage/`` because both stand on it: the store must never import the
compaction package, and the table is no part of the state tables (a lock
registry any maintenance job may use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roomstore.storage.engines import Row

if TYPE_CHECKING:  # the transaction module imports engines, as this one does: only the type is needed
    from roomstore.storage.transaction import Transaction

#: The row the offline state compaction job holds while it runs.
COMPACTION_LOCK_NAME = "state_compaction"

#: ``(holder, acquired_ts, heartbeat_ts)`` of a lock (its name); followed by
#: the engine's ``for_update`` where the caller takes it.
LOCK_SELECT = "SELECT holder, acquired_ts, heartbeat_ts FROM maintenance_locks WHERE lock_name = ?"
LOCK_INSERT = (
    "INSERT INTO maintenance_locks (lock_name, holder, acquired_ts, heartbeat_ts)"
    " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
LOCK_TAKE = (
    "UPDATE maintenance_locks SET holder = ?, acquired_ts = ?, heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
)
LOCK_HEARTBEAT = "UPDATE maintenance_locks SET heartbeat_ts = ? WHERE lock_name = ? AND holder = ?"
LOCK_RELEASE = "DELETE FROM maintenance_locks WHERE lock_name = ? AND holder = ?"
#: What an operator runs to drop a dead job's lock (printed, never executed).
LOCK_RELEASE_HINT = "DELETE FROM maintenance_locks WHERE lock_name = 'state_compaction'"


def lock_row_txn(txn: Transaction, lock_name: str) -> Row | None:
    """``(holder, acquired_ts, heartbeat_ts)`` of the lock ``lock_name``, or
    None when nobody holds it (``txn``: a :class:`~roomstore.storage.database.Transaction`)."""
    return txn.execute(LOCK_SELECT, (lock_name,)).fetchone()
