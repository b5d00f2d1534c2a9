"""Reads of the events tables by event nid: the stored facts of events, their bytes, their rooms and types,
one event's visibility flag, graph facts and the same-room redactions of events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from roomstore.events.tables.events.fragments import same_room_redactions
from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    chunks,
    event_nid_sql,
    join_event_ids,
    join_rooms,
)

# ---------------------------------------------------------------------- reads by nid


def served_rows_txn(txn: Transaction, nids: Sequence[int]) -> list[tuple]:
    """``(nid, room_version, json, redacted, outlier, rejected_reason,
    stream_ordering)`` of the stored events among ``nids`` (one chunk)."""
    marks = ", ".join("?" for _ in nids)
    return txn.execute(
        "SELECT e.event_nid, j.room_version, j.json, e.redacted, e.outlier, e.rejected_reason,"
        " e.stream_ordering FROM events AS e JOIN event_json AS j ON j.event_nid = e.event_nid"
        f" WHERE e.event_nid IN ({marks})",
        list(nids),
    ).fetchall()


class StoredEvent(NamedTuple):
    """What ``events`` holds of a stored event beside its JSON."""

    stream_ordering: int
    topological_ordering: int
    state_group_before: int | None
    state_group: int | None
    outlier: bool
    rejected_reason: str | None
    redacted: bool
    room_nid: int
    soft_failed: bool = False


def stored_events_txn(txn: Transaction, nids: Iterable[int]) -> dict[int, StoredEvent]:
    """nid -> ``StoredEvent`` of the stored events among ``nids``, read in
    chunks by primary key: what the event reader's flags, precheck's
    already-persisted results and the persister's prev-event facts need."""
    found: dict[int, StoredEvent] = {}
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        for nid, stream, topo, before, after, outlier, rejected, redacted, room_nid, soft_failed in txn.execute(
            "SELECT event_nid, stream_ordering, topological_ordering, state_group_before, state_group, outlier,"
            f" rejected_reason, redacted, room_nid, soft_failed FROM events WHERE event_nid IN ({marks})",
            list(part),
        ).fetchall():
            found[nid] = StoredEvent(
                stream, topo, before, after, bool(outlier), rejected, bool(redacted), room_nid, bool(soft_failed)
            )
    return found


def json_txn(txn: Transaction, nid: int):
    """The stored bytes of one event (None when absent)."""
    return txn.select_one_value("SELECT json FROM event_json WHERE event_nid = ?", (nid,))


def state_groups_row_txn(txn: Transaction, nid: int) -> tuple | None:
    """``(state_group_before, state_group, outlier, room_nid)`` of one event."""
    return txn.execute(
        "SELECT state_group_before, state_group, outlier, room_nid FROM events WHERE event_nid = ?", (nid,)
    ).fetchone()


def history_visibility_json_txn(txn: Transaction, nids: Sequence[int]) -> list[tuple]:
    """``(nid, json)`` of the history visibility events among ``nids`` (one chunk)."""
    marks = ", ".join("?" for _ in nids)
    return txn.execute(
        f"SELECT e.event_nid, j.json FROM events AS e JOIN event_json AS j ON j.event_nid = e.event_nid"
        f" WHERE e.event_nid IN ({marks}) AND e.type = 'm.room.history_visibility'",
        list(nids),
    ).fetchall()


def stored_before_txn(txn: Transaction, nids: Iterable[int]) -> dict[int, StoredEvent]:
    """``stored_events_txn`` for the steps of one write: what they asked
    before is answered from ``txn.memo`` (absent events too). Only for events
    stored before the write's own rows: it does not see those."""
    known = txn.memo.setdefault(stored_before_txn, {})
    unasked = [nid for nid in nids if nid not in known]
    if unasked:
        found = stored_events_txn(txn, unasked)
        known.update((nid, found.get(nid)) for nid in unasked)
    return {nid: facts for nid in nids if (facts := known[nid]) is not None}


def rooms_and_types_txn(txn: Transaction, nids: Sequence[int]) -> list[tuple]:
    """``(nid, room_id, type)`` of the stored events among ``nids`` (one chunk)."""
    marks = ", ".join("?" for _ in nids)
    return txn.execute(
        f"SELECT e.event_nid, r.room_id, e.type FROM events AS e {join_rooms('r', 'e.room_nid')}"
        f" WHERE e.event_nid IN ({marks})",
        list(nids),
    ).fetchall()


def visible_flag_txn(txn: Transaction, vis: str, params: Sequence) -> tuple | None:
    """``(1 or 0,)`` whether the graph event whose ID is bound after
    ``params`` passes ``vis`` (None when no such event)."""
    return txn.execute(
        f"SELECT CASE WHEN {vis} THEN 1 ELSE 0 END FROM events AS e"
        f" WHERE e.event_nid = {event_nid_sql('ei')}"
        " AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed",
        list(params),
    ).fetchone()


# ---------------------------------------------------------------------- the graph


def graph_facts_txn(txn: Transaction, nids: Sequence[int], room_nid: int) -> list[tuple]:
    """``(nid, topo, stream, rejected_reason)`` of the non-outliers of the
    room among ``nids`` (one chunk)."""
    marks = ", ".join("?" for _ in nids)
    return txn.execute(
        "SELECT e.event_nid, e.topological_ordering, e.stream_ordering, e.rejected_reason"
        f" FROM events AS e WHERE e.event_nid IN ({marks}) AND e.room_nid = ? AND e.outlier = ?",
        [*nids, room_nid, False],
    ).fetchall()


# ---------------------------------------------------------------------- redactions


def unflagged_targets_txn(txn: Transaction, column: str, nids: Sequence[int]) -> set[int]:
    """Targets not yet flagged ``events.redacted`` of same-room redactions
    whose ``column`` (``"redacts_event_nid"`` or ``"redaction_event_nid"``)
    is one of ``nids``."""
    if column not in ("redacts_event_nid", "redaction_event_nid"):
        raise ValueError(f"not a redactions column: {column!r}")
    targets: set[int] = set()
    for part in chunks(list(nids)):
        marks = ", ".join("?" for _ in part)
        rows = txn.execute(
            f"SELECT r.redacts_event_nid FROM {same_room_redactions()}"
            f" WHERE r.{column} IN ({marks}) AND target.redacted = ?",
            (*part, False),
        ).fetchall()
        targets.update(row[0] for row in rows)
    return targets


def redactions_of_txn(txn: Transaction, target_nids: Sequence[int]) -> list[tuple[int, bytes, str]]:
    """``(target nid, redaction json, redaction event_id)`` of every
    same-room redaction of the targets, in stream order of the redactions."""
    result: list[tuple[int, bytes, str]] = []
    for part in chunks(sorted(target_nids)):
        marks = ", ".join("?" for _ in part)
        result += txn.execute(
            f"SELECT r.redacts_event_nid, j.json, i.event_id FROM {same_room_redactions()}"
            " JOIN event_json AS j ON j.event_nid = r.redaction_event_nid"
            f" {join_event_ids('i', 'r.redaction_event_nid')}"
            f" WHERE r.redacts_event_nid IN ({marks}) ORDER BY red.stream_ordering",
            list(part),
        ).fetchall()
    return result


def due_for_censoring_txn(txn: Transaction, cutoff_ts: int, limit: int) -> list[tuple]:
    """Up to ``limit`` uncensored same-room redactions received before
    ``cutoff_ts`` whose target is flagged redacted, oldest first:
    ``(redaction nid, target nid, target room version, target json, target censored)``.
    Redactions whose target is missing or elsewhere are never selected, so
    they never hold back due rows behind them."""
    return txn.execute(
        "SELECT r.redaction_event_nid, r.redacts_event_nid, j.room_version, j.json, j.censored"
        f" FROM {same_room_redactions()}"
        " JOIN event_json AS j ON j.event_nid = r.redacts_event_nid"
        " WHERE r.have_censored = ? AND r.received_ts < ? AND target.redacted = ?"
        " ORDER BY r.received_ts, r.redaction_event_nid LIMIT ?",
        (False, cutoff_ts, True, limit),
    ).fetchall()
