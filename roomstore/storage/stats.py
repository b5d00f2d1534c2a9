"""Rows and bytes of every table of the schema (``roomstore stats``).

``table_stats_txn`` counts each table's rows and asks the engine its size;
the statement names no table in its text (the name is one of
``STATS_TABLES``, never input), so each table's own SQL stays in its owner.
"""

from __future__ import annotations

from typing import Any

from roomstore.storage.database import Transaction
from roomstore.storage.schema import SCHEMA_TABLES

__all__ = ["STATS_TABLES", "table_stats_txn"]

#: The tables ``roomstore stats`` reports, in this order: every table of the schema.
STATS_TABLES = SCHEMA_TABLES


def table_stats_txn(txn: Transaction, tables: tuple[str, ...] = STATS_TABLES) -> list[dict[str, Any]]:
    """``{"table", "rows", "bytes"}`` for each of ``tables``, in order."""
    rows = []
    for table in tables:
        count = txn.select_one_value(f"SELECT COUNT(*) FROM {table}")
        rows.append({"table": table, "rows": count, "bytes": txn.engine.table_bytes(txn, table)})
    return rows
