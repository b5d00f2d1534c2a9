"""The ``redactions`` table: every statement against it, and the same-room join.

A row says that the event ``redaction_event_nid`` (an ``m.room.redaction``)
redacts ``redacts_event_nid``, when it was received, and whether censoring
has dealt with it. A redaction only counts when its target is stored in the
*same room*: ``same_room_redactions`` is that join, written once, and every
reader of redactions goes through it (the persister flagging targets, the
event reader and the timeline pruning what they serve, the censor job). The
redaction algorithm itself (what pruning keeps) is ``roomstore.pdu.redaction_algorithm``.
"""

from __future__ import annotations

from typing import Sequence

from roomstore.storage.database import Transaction
from roomstore.storage.interning import chunks

__all__ = [
    "due_for_censoring_txn",
    "first_redaction_sql",
    "insert_redactions",
    "mark_censored_txn",
    "redactions_of_txn",
    "same_room_redactions",
    "unflagged_targets_txn",
]


def same_room_redactions(r: str = "r", red: str = "red", target: str = "target", outer_target: bool = False) -> str:
    """FROM-clause text: the rows ``r`` of ``redactions`` joined to their
    redaction event ``red`` and their target ``target`` (both ``events``),
    where the two are in the same room. The aliases are the caller's.

    ``outer_target``: ``target`` is already in scope (the row of an outer
    query a correlated subquery is about), so it is not joined again.

    The room test is written ``+red.room_nid`` (a numeric no-op on both
    engines) so that no index on ``events.room_nid`` serves it: a redaction
    is found from its target (``redactions_redacts``), then checked to be in
    the room. Given the room as a constant (a correlated subquery), both
    engines otherwise walked the room's events in stream order looking for
    the first redaction of the target: a walk of the room per redacted event
    served (bench/redacted_reads.py)."""
    join = f"redactions AS {r} JOIN events AS {red} ON {red}.event_nid = {r}.redaction_event_nid"
    same_room = f"{target}.event_nid = {r}.redacts_event_nid AND {target}.room_nid = +{red}.room_nid"
    if outer_target:
        return f"{join} AND {same_room}"
    return f"{join} JOIN events AS {target} ON {same_room}"


def first_redaction_sql(column: str, of: str = "e") -> str:
    """A scalar SQL expression: ``column`` (of ``rj``, the redaction's
    ``event_json``, or ``ri``, its ``event_ids``) of the first stored
    redaction of the redacted event ``of`` in its room, by stream order (the
    one ``EventReader`` reports); NULL unless ``of.redacted``."""
    return f"""CASE WHEN {of}.redacted THEN (
        SELECT {column} FROM {same_room_redactions("rd", "red", of, outer_target=True)}
        JOIN event_json AS rj ON rj.event_nid = rd.redaction_event_nid
        JOIN event_ids AS ri ON ri.event_nid = rd.redaction_event_nid
        ORDER BY red.stream_ordering LIMIT 1) END"""


def insert_redactions(txn: Transaction, rows: Sequence[tuple[int, int, int]]) -> None:
    """Queue ``(redaction_event_nid, redacts_event_nid, received_ts)`` rows."""
    txn.insert_many("redactions", ("redaction_event_nid", "redacts_event_nid", "received_ts"), rows, queue=True)


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
            " JOIN event_ids AS i ON i.event_nid = r.redaction_event_nid"
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


def mark_censored_txn(txn: Transaction, redaction_nid: int) -> None:
    """Record that censoring has dealt with a redaction."""
    txn.execute("UPDATE redactions SET have_censored = ? WHERE redaction_event_nid = ?", (True, redaction_nid))
