"""Rows and bytes of every table of the schema (``roomstore stats``).

``table_stats_txn`` counts each table's rows and asks the engine its size;
the statement names no table in its text (the name is one of
``STATS_TABLES``, never input), so each table's own SQL stays in its owner.
"""

from __future__ import annotations

from typing import Any

from roomstore.storage.database import Transaction

__all__ = ["STATS_TABLES", "table_stats_txn"]

#: The tables ``roomstore stats`` reports, in this order.
STATS_TABLES = (
    "rooms",
    "event_ids",
    "users",
    "state_keys",
    "events",
    "event_json",
    "event_edges",
    "event_auth_edges",
    "forward_extremities",
    "backward_extremities",
    "state_groups",
    "state_group_deltas",
    "current_state",
    "current_state_deltas",
    "room_memberships",
    "current_memberships",
    "redactions",
    "visibility_snapshots",
    "visibility_branches",
    "visibility_branch_ancestors",
    "visibility_memberships",
    "stream_positions",
    "cache_invalidations",
    "instances",
    "maintenance_locks",
    "state_compaction_runs",
    "state_compaction_rooms",
    "state_compaction_chunks",
    "state_compaction_staged_groups",
    "state_compaction_staged_deltas",
    "embedder_schema_versions",
    "client_txn_ids",
)


def table_stats_txn(txn: Transaction, tables: tuple[str, ...] = STATS_TABLES) -> list[dict[str, Any]]:
    """``{"table", "rows", "bytes"}`` for each of ``tables``, in order."""
    rows = []
    for table in tables:
        count = txn.select_one_value(f"SELECT COUNT(*) FROM {table}")
        rows.append({"table": table, "rows": count, "bytes": txn.engine.table_bytes(txn, table)})
    return rows
