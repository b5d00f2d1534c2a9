"""The events tables' statements of purging (``roomstore.events.purge``): what a purge finds, what it
turns into outliers, and the rows it deletes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    chunks,
)

# ---------------------------------------------------------------------- purging (roomstore.events.purge)


class PurgeCandidate(NamedTuple):
    """An event of a room at or before a purge's position."""

    event_nid: int
    is_state: bool
    sender_nid: int
    outlier: bool


def events_upto_txn(txn: Transaction, room_nid: int, key: tuple[int, int]) -> list[PurgeCandidate]:
    """The room's events, outliers too, at or before the topological key
    ``(topological_ordering, stream_ordering)``."""
    return [
        PurgeCandidate(nid, is_state, sender, bool(outlier))
        for nid, is_state, sender, outlier in txn.execute(
            "SELECT event_nid, type_key_nid IS NOT NULL, sender_nid, outlier FROM events"
            " WHERE room_nid = ? AND (topological_ordering, stream_ordering) <= (?, ?)",
            (room_nid, *key),
        ).fetchall()
    ]


def room_event_nids_txn(txn: Transaction, room_nid: int) -> list[int]:
    """Every stored event of the room, outliers and rejected ones too."""
    return [r[0] for r in txn.execute("SELECT event_nid FROM events WHERE room_nid = ?", (room_nid,)).fetchall()]


def redaction_targets_txn(txn: Transaction, nids: Iterable[int]) -> dict[int, int]:
    """redaction nid -> target nid of the redaction events among ``nids``."""
    found: dict[int, int] = {}
    for part in chunks(sorted(set(nids))):
        marks = ", ".join("?" for _ in part)
        found.update(
            txn.execute(
                f"SELECT redaction_event_nid, redacts_event_nid FROM redactions WHERE redaction_event_nid IN ({marks})",
                list(part),
            ).fetchall()
        )
    return found


def graph_nids_txn(txn: Transaction, room_nid: int) -> set[int]:
    """The room's graph events (not outliers): with the prev events they
    name (``event_graph.room_prevs_txn``), what its backward extremities are
    made of."""
    return {
        r[0]
        for r in txn.execute(
            "SELECT event_nid FROM events WHERE room_nid = ? AND outlier = ?", (room_nid, False)
        ).fetchall()
    }


def groups_in_use_txn(txn: Transaction, room_nid: int) -> set[int]:
    """The state groups the room's stored events are before or after."""
    return {
        r[0]
        for r in txn.execute(
            "SELECT state_group_before FROM events WHERE room_nid = ? AND state_group_before IS NOT NULL"
            " UNION SELECT state_group FROM events WHERE room_nid = ? AND state_group IS NOT NULL",
            (room_nid, room_nid),
        ).fetchall()
    }


def make_outliers_txn(txn: Transaction, nids: Sequence[int]) -> int:
    """The events ``nids`` become outliers: out of the timelines and the
    graph, with no state of their own (their state groups let go)."""
    changed = 0
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        txn.execute(
            "UPDATE events SET outlier = ?, state_group_before = NULL, state_group = NULL"
            f" WHERE event_nid IN ({marks})",
            (True, *part),
        )
        changed += txn.rowcount
    return changed


def referenced_nids_txn(txn: Transaction, nids: Iterable[int]) -> set[int]:
    """Those of ``nids`` that a stored row of these tables names: an event,
    a redaction's target (``event_graph.referenced_nids_txn``: a prev or
    auth event)."""
    found: set[int] = set()
    for part in chunks(sorted(set(nids))):
        marks = ", ".join("?" for _ in part)
        found.update(
            r[0]
            for r in txn.execute(
                f"SELECT event_nid FROM events WHERE event_nid IN ({marks})"
                f" UNION SELECT redacts_event_nid FROM redactions WHERE redacts_event_nid IN ({marks})",
                list(part) * 2,
            ).fetchall()
        )
    return found


#: What deleting events removes here, by table, and the column naming the event.
_EVENT_ROWS = (
    ("events", "event_nid"),
    ("event_json", "event_nid"),
    ("redactions", "redaction_event_nid"),
)


def delete_events_txn(txn: Transaction, nids: Sequence[int], counts: dict[str, int]) -> None:
    """Delete the events ``nids``: their rows, bytes and redaction rows (their
    edges: ``event_graph.delete_edges_txn``); ``counts`` gains the rows
    deleted per table."""
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        for table, column in _EVENT_ROWS:
            txn.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", list(part))
            counts[table] = counts.get(table, 0) + max(txn.rowcount, 0)
