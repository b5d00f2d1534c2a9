"""The events tables' fragments for composed reads: ``events_as``, ``join_events``, ``join_event_json``,
the served columns (``SERVED_COLUMNS`` over ``served_joins()``) and the same-room redaction join
(``same_room_redactions``, ``first_redaction_sql``) that every reader of redactions goes through."""

from __future__ import annotations

from roomstore.storage.interning import (
    join_event_ids,
    join_rooms,
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
