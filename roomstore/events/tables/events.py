"""The tables of the events themselves: ``events`` (one row per event: room,
type, orderings, flags, state groups, visibility snapshots), ``event_json``
(the exact bytes) and ``redactions``; every statement that names them. The
edges between events (prev and auth events) are ``event_graph``'s.

Reads composed elsewhere (the timeline, pagination) embed the fragments
``events_as``, ``join_events``, ``SERVED_COLUMNS`` / ``served_joins`` and
``first_redaction_sql``; the aliases are the caller's.

A redaction only counts when its target is stored in the *same room*:
``same_room_redactions`` is that join, written once, and every reader of
redactions goes through it. The redaction algorithm itself (what pruning
keeps) is ``roomstore.pdu.redaction_algorithm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    chunks,
    event_id_sql,
    event_nid_sql,
    join_event_ids,
    join_rooms,
    state_key_sql,
)
from roomstore.visibility.codes import MEMBERSHIP_BY_CODE
from roomstore.visibility.memberships import membership_of_sql
from roomstore.visibility.snapshots import visible_sql

EVENT_COLUMNS = (
    "event_nid",
    "room_nid",
    "type",
    "type_key_nid",
    "sender_nid",
    "depth",
    "topological_ordering",
    "stream_ordering",
    "instance_name",
    "origin_server_ts",
    "received_ts",
    "outlier",
    "rejected_reason",
    "backfilled",
    "redacted",
    "state_group_before",
    "state_group",
    "visibility_before",
    "visibility_after",
    "soft_failed",
)


# ---------------------------------------------------------------------- fragments


#: The newest IDs per writer of the events stream (positive ``stream_ordering``) and of the backfill stream
#: (negative, counted as positive IDs), read at start-up by their ID generators.
NEWEST_LIVE_STREAM_IDS = (
    "SELECT instance_name, MAX(stream_ordering) FROM events WHERE stream_ordering > 0 GROUP BY instance_name"
)
NEWEST_BACKFILL_STREAM_IDS = (
    "SELECT instance_name, MAX(-stream_ordering) FROM events WHERE -stream_ordering > 0 GROUP BY instance_name"
)


def events_as(alias: str) -> str:
    """``events AS alias``: the FROM item of a composed read of events."""
    return f"events AS {alias}"


def join_events(alias: str, on: str, kind: str = "JOIN") -> str:
    """``JOIN events AS alias ON <on>`` (``on`` names ``alias``)."""
    return f"{kind} events AS {alias} ON {on}"


def same_room_redactions(r: str = "r", red: str = "red", target: str = "target", outer_target: bool = False) -> str:
    """FROM-clause text: the rows ``r`` of ``redactions`` joined to their
    redaction event ``red`` and their target ``target`` (both ``events``),
    where the redaction applies: the two are in the same room, and the
    redaction has the authority (``r.authorised``: its sender had the
    ``redact`` power level, or in room versions 1 and 2 the IDs' servers
    match; or it redacts its own sender's event). The aliases are the caller's.

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
    same_room = (
        f"{target}.event_nid = {r}.redacts_event_nid AND {target}.room_nid = +{red}.room_nid"
        f" AND ({r}.authorised OR {target}.sender_nid = {red}.sender_nid)"
    )
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
        {join_event_ids("ri", "rd.redaction_event_nid")}
        ORDER BY red.stream_ordering LIMIT 1) END"""


#: The columns ``timeline.event_from_row`` takes, over ``e`` joined by ``served_joins()``.
SERVED_COLUMNS = f"""e.event_nid AS event_nid, i.event_id AS event_id, r.room_id AS room_id,
    e.topological_ordering AS topo, e.stream_ordering AS stream, j.room_version AS room_version,
    j.json AS json, e.redacted AS redacted,
    {first_redaction_sql("rj.json")} AS redaction_json, {first_redaction_sql("ri.event_id")} AS redaction_id"""
SERVED_COLUMN_COUNT = 10


def served_joins() -> str:
    """The joins ``SERVED_COLUMNS`` needs beside ``e``: its bytes, ID and room ID."""
    return f"""JOIN event_json AS j ON j.event_nid = e.event_nid
    {join_event_ids("i", "e.event_nid")}
    {join_rooms("r", "e.room_nid")}"""


def join_event_json(alias: str, nid_expr: str) -> str:
    """``JOIN event_json AS alias`` on the event nid ``nid_expr``."""
    return f"JOIN event_json AS {alias} ON {alias}.event_nid = {nid_expr}"


# ---------------------------------------------------------------------- writes


# The rows of new events are bulk-loaded (``copy_rows``: COPY on PostgreSQL,
# whose text costs a third of binding a multi-row INSERT in Python, and less
# for the server to take in); every row is new (a fresh event nid), so no
# conflict clause is needed: a second writer of the same event fails on the
# primary key, as it did with INSERT.


def insert_events(txn: Transaction, rows: Sequence[tuple]) -> None:
    """Write ``events`` rows of ``EVENT_COLUMNS`` (new events only)."""
    txn.copy_rows("events", EVENT_COLUMNS, rows)


def insert_event_json(txn: Transaction, rows: Sequence[tuple]) -> None:
    """Write ``(event_nid, room_version, json, censored)`` rows (new events
    only); censored: the bytes are the redacted form (a content hash
    mismatch, pdu/content_hash.py)."""
    txn.copy_rows("event_json", ("event_nid", "room_version", "json", "censored"), rows)


def insert_redactions(txn: Transaction, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """Queue ``(redaction_event_nid, redacts_event_nid, received_ts,
    authorised)`` rows (``authorised``: ``same_room_redactions``)."""
    txn.insert_many(
        "redactions", ("redaction_event_nid", "redacts_event_nid", "received_ts", "authorised"), rows, queue=True
    )


def queue_flag_redacted(txn: Transaction, nids: Sequence[int]) -> None:
    """Queue: ``events.redacted`` set on ``nids``."""
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        txn.queue(f"UPDATE events SET redacted = ? WHERE event_nid IN ({marks})", (True, *part))


def replace_json_txn(txn: Transaction, nid: int, raw: bytes, censored: bool) -> None:
    """The stored bytes of an event replaced (censoring)."""
    txn.execute("UPDATE event_json SET json = ?, censored = ? WHERE event_nid = ?", (raw, censored, nid))


def mark_censored_txn(txn: Transaction, redaction_nid: int) -> None:
    """Record that censoring has dealt with a redaction."""
    txn.execute("UPDATE redactions SET have_censored = ? WHERE redaction_event_nid = ?", (True, redaction_nid))


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


# ---------------------------------------------------------------------- the events and backfill streams

# The page of events is an index range scan on events alone that stops
# after LIMIT rows. The event ID is a correlated scalar subquery, which both
# engines run per row as a primary-key lookup; membership and redaction
# lookups run only for member and redaction events (CASE); room IDs and
# state keys come from the store's interners (small tables, cached). With
# joins instead, PostgreSQL may hash-join a whole table (a sequential scan
# of event_ids) into every page, so each page costs as much as the whole
# history and a catch-up is quadratic. The range is a window of stream
# orderings a few pages wide, widened while the page is short
# (``stream_rows.stream_page_txn``): PostgreSQL without fresh statistics
# estimates a handful of rows for any range and reads and sorts all of it, so
# an open range would cost the whole rest of the stream for every page.
#
# Columns: ``(token, kind, state type, state key, event_id, room_nid, type,
# type_key_nid, redacts, membership code, rejected, outlier)``, kind 0 for
# an event (state type and key NULL: sorting needs them for state rows
# only), so that ``room_state.STATE_STREAM_ROWS`` can be its UNION partner.
_REDACTS = (
    f"(SELECT ri.event_id FROM redactions AS red {join_event_ids('ri', 'red.redacts_event_nid')}"
    " WHERE red.redaction_event_nid = e.event_nid)"
)

#: (token, ORDER BY, range) of live events, whose tokens are stream
#: orderings, and of backfilled events, whose tokens are minus their
#: (negative) stream orderings; the range is written on the column itself so
#: the index serves it.
_PAGE_RANGES = {
    True: ("e.stream_ordering", "e.stream_ordering", "e.stream_ordering > ? AND e.stream_ordering <= ?"),
    False: (
        "-e.stream_ordering",
        "e.stream_ordering DESC",
        "e.stream_ordering < 0 - CAST(? AS BIGINT) AND e.stream_ordering >= 0 - CAST(? AS BIGINT)",
    ),
}


def event_stream_rows_sql(live: bool, join_ids: bool = False, nids: bool = False) -> str:
    """``LIVE_EVENT_STREAM_ROWS`` (``live``) or ``BACKFILL_EVENT_STREAM_ROWS``;
    ``join_ids``: the event IDs joined rather than looked up in a scalar
    subquery (where a lookup by key costs next to nothing and no planner can
    turn the join into a scan of event_ids: SQLite); ``nids``: the event's
    nid in the event ID's column, for the caller to resolve (PostgreSQL
    spent 1.4 us a row on the lookup, more than the rest of the page)."""
    token, order, where = _PAGE_RANGES[live]
    event_id, joins = (
        ("i.event_id", join_event_ids("i", "e.event_nid"))
        if join_ids
        else (("e.event_nid", "") if nids else (event_id_sql("e.event_nid"), ""))
    )
    return f"""
SELECT {token}, 0, NULL, NULL,
    {event_id},
    e.room_nid,
    e.type,
    e.type_key_nid,
    CASE WHEN e.type = 'm.room.redaction' THEN {_REDACTS} END,
    CASE WHEN e.type = 'm.room.member' THEN {membership_of_sql("e.event_nid")} END,
    e.rejected_reason IS NOT NULL,
    e.outlier
FROM events AS e {joins}
WHERE e.instance_name = ? AND {where}
ORDER BY {order}
LIMIT ?
"""


#: Live events (binds the instance, the range's two ends and the LIMIT).
LIVE_EVENT_STREAM_ROWS = event_stream_rows_sql(True)
#: Backfilled events (the same bindings).
BACKFILL_EVENT_STREAM_ROWS = event_stream_rows_sql(False)
#: ``LIVE_EVENT_STREAM_ROWS`` and ``BACKFILL_EVENT_STREAM_ROWS`` with the
#: event nid where the event ID was.
LIVE_EVENT_NID_STREAM_ROWS = event_stream_rows_sql(True, nids=True)
BACKFILL_EVENT_NID_STREAM_ROWS = event_stream_rows_sql(False, nids=True)


def event_json_stream_rows_sql(engine, live: bool, lines: bool = False) -> str:
    """``LIVE_EVENT_STREAM_ROWS`` (``live``) or ``BACKFILL_EVENT_STREAM_ROWS``
    with each row written as its JSON text by the database (where
    ``engine.in_process``): columns ``(token, 0, NULL, NULL, row JSON)``,
    the row in replication's layout (``roomstore.events.stream_rows``), so
    that ``room_state.state_json_stream_rows_sql`` can be its UNION partner.
    The same bindings. ``lines``: one row, ``(text, count, first, last,
    longest)``, the page's lines (a line prefix bound first, then its token,
    a space, the row; joined by newlines), how many, the first and last
    tokens and the longest line's length, every event of the range (no
    ``LIMIT`` bound). Room IDs and state keys are looked up here, per row
    (an in-process lookup by key costs next to nothing)."""
    token, order, where = _PAGE_RANGES[live]
    membership = " ".join(f"WHEN {int(code)} THEN '{name}'" for code, name in sorted(MEMBERSHIP_BY_CODE.items()))
    fields = [
        ("text", "i.event_id"),
        ("text", "r.room_id"),
        ("text", "e.type"),
        ("text", f"CASE WHEN e.type_key_nid IS NOT NULL THEN {state_key_sql('e.type_key_nid')} END"),
        ("text", f"CASE WHEN e.type = 'm.room.redaction' THEN {_REDACTS} END"),
        ("text", "NULL"),
    ]
    if live:
        fields += [
            (
                "text",
                f"CASE WHEN e.type = 'm.room.member' THEN CASE {membership_of_sql('e.event_nid')} {membership} END END",
            ),
            ("bool", "e.rejected_reason IS NOT NULL"),
            ("bool", "e.outlier"),
        ]
        row = engine.json_array_sql([("text", "'ev'"), ("array", engine.json_array_sql(fields))])
    else:
        row = engine.json_array_sql(fields)
    if lines:
        # One text for the page: each event's line, in token order (a
        # subquery's ORDER BY is the order an aggregate over it reads).
        return f"""
SELECT group_concat(line, char(10)), count(*), min(token), max(token), max(length(line)) FROM (
SELECT {token} AS token, ? || {token} || ' ' || {row} AS line
FROM events AS e {join_event_ids("i", "e.event_nid")} {join_rooms("r", "e.room_nid")}
WHERE e.instance_name = ? AND {where}
ORDER BY {order})
"""
    return f"""
SELECT {token}, 0, NULL, NULL, {row}
FROM events AS e {join_event_ids("i", "e.event_nid")} {join_rooms("r", "e.room_nid")}
WHERE e.instance_name = ? AND {where}
ORDER BY {order}
LIMIT ?
"""


def event_page_bound_sql(live: bool) -> str:
    """The tokens of an instance's ``OFFSET``-th and next event in a range of
    the live (``live``) or backfill stream, in token order (binds the
    instance, the range's two ends and the offset): none or one when the
    range holds no more events than that."""
    token, order, where = _PAGE_RANGES[live]
    return f"SELECT {token} FROM events AS e WHERE e.instance_name = ? AND {where} ORDER BY {order} LIMIT 2 OFFSET ?"


def sync_candidates_sql(where: str) -> str:
    """One of sync's candidate SELECTs: rows ``(event_nid, tl, own)`` of the timeline events ``e`` meeting
    ``where`` (its parameters the caller's)."""
    return f"SELECT e.event_nid AS event_nid, 1 AS tl, 0 AS own FROM events AS e WHERE {where}"


def sync_sql(candidates: list[str], low_sql: str, high_sql: str) -> str:
    """Sync's statement over the candidates (``sync_candidates_sql`` and the user's own membership events, to
    UNION), between the per-writer bounds ``low_sql`` and ``high_sql`` on ``e`` (see ``SyncReader._sync_txn``):
    the served columns, then ``in_page`` and ``is_own``, in stream order."""
    vis, _ = visible_sql("e")
    # ``flagged``: each candidate's flags (in the timeline: visible, not an
    # outlier); ``ranked``: the timeline rows numbered newest first per
    # room, so only the newest ``limit`` + 1 (one more says "limited") are
    # joined to their bytes; the user's own membership events all are.
    return f"""
        WITH flagged AS (
            SELECT e.event_nid AS event_nid, e.room_nid AS room_nid, e.stream_ordering AS stream,
                CASE WHEN f.tl = 1 AND e.outlier = ? AND {vis} THEN 1 ELSE 0 END AS in_timeline,
                f.own AS is_own
            FROM (
                SELECT u.event_nid AS event_nid, MAX(u.tl) AS tl, MAX(u.own) AS own
                FROM ({" UNION ALL ".join(candidates)}) AS u
                GROUP BY u.event_nid
            ) AS f
            {join_events("e", "e.event_nid = f.event_nid")}
            WHERE e.rejected_reason IS NULL AND NOT e.soft_failed AND {low_sql} AND {high_sql}
        ), ranked AS (
            SELECT fl.event_nid AS event_nid, fl.in_timeline AS in_timeline, fl.is_own AS is_own,
                ROW_NUMBER() OVER (PARTITION BY fl.room_nid, fl.in_timeline ORDER BY fl.stream DESC) AS newness
            FROM flagged AS fl
            WHERE fl.in_timeline = 1 OR fl.is_own = 1
        )
        SELECT {SERVED_COLUMNS},
            CASE WHEN k.in_timeline = 1 AND k.newness <= ? THEN 1 ELSE 0 END AS in_page, k.is_own AS is_own
        FROM ranked AS k
        {join_events("e", "e.event_nid = k.event_nid")}
        {served_joins()}
        WHERE (k.in_timeline = 1 AND k.newness <= ?) OR k.is_own = 1
        ORDER BY e.stream_ordering"""


def newest_timeline_event_sql(at_sql: str) -> str:
    """The event ID of a room's newest timeline event (no outlier, not rejected, not soft-failed) within
    ``at_sql``, a stream bound on ``e``. Parameters: the room's nid, False (the outlier flag), ``at_sql``'s."""
    return (
        f"SELECT {event_id_sql('e.event_nid')} FROM events AS e"
        " WHERE e.room_nid = ? AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed"
        f" AND {at_sql} ORDER BY e.stream_ordering DESC LIMIT 1"
    )


def outlier_memberships_sql(newest_memberships: str) -> str:
    """``(room_id, membership code, event_id, stream_ordering)`` of those of a user's newest membership events
    (``newest_memberships``, the membership log's subquery, with its parameters) that are outliers (invites from
    rooms this server is not in). Parameters: the subquery's, then True (the outlier flag)."""
    return (
        f"SELECT r.room_id, m.membership, i.event_id, m.stream_ordering FROM ({newest_memberships}) AS m"
        f" {join_events('e', 'e.event_nid = m.event_nid')} {join_rooms('r', 'm.room_nid')}"
        f" {join_event_ids('i', 'm.event_nid')} WHERE e.outlier = ?"
    )
