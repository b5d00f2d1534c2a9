"""The compaction job's planning reads, written once for both layouts.

Each statement reads a relation of groups with the columns ``state_group``,
``room_nid`` (and, for the chunk layout, ``prev_state_group``), given as SQL
text: roomstore's ``state_groups`` (:mod:`roomstore.compaction.roomstore_sql`) or a
subquery over Synapse's tables (:mod:`roomstore.compaction.synapse_sql`).
``where`` is a condition on that relation (integers only); ``?`` parameters
are noted per statement. Each layout's module puts them in its record of
statements (:class:`roomstore.compaction.tables.JobStatements`), which the
writer runs.
"""

from __future__ import annotations


def _and(where: str) -> str:
    return f" AND {where}" if where else ""


def group_bounds(groups: str, where: str = "") -> str:
    """MIN, MAX, COUNT of the groups up to ``?`` (the run's snapshot_max)."""
    return f"SELECT MIN(state_group), MAX(state_group), COUNT(*) FROM {groups} WHERE state_group <= ?{_and(where)}"


def count_rooms(groups: str, where: str = "") -> str:
    """How many rooms have groups up to ``?``."""
    return f"SELECT COUNT(DISTINCT room_nid) FROM {groups} WHERE state_group <= ?{_and(where)}"


def largest_rooms(groups: str) -> str:
    """``(room_nid, groups)`` of the ``?`` rooms with most groups up to ``?``."""
    return (
        f"SELECT room_nid, COUNT(*) AS n FROM {groups} WHERE state_group <= ?"
        " GROUP BY room_nid ORDER BY n DESC, room_nid LIMIT ?"
    )


def _numbered(groups: str, linked: str, where: str) -> str:
    # Rooms with more than ? groups up to ? (snapshot_max), their groups
    # (``linked``: with prev_state_group) numbered in id order (a window over
    # the (room_nid, state_group) index). Parameters: snapshot_max, chunk
    # size, snapshot_max.
    extra = _and(where)
    return (
        f"WITH big AS (SELECT room_nid FROM {groups} WHERE state_group <= ?{extra}"
        " GROUP BY room_nid HAVING COUNT(*) > ?),"
        " numbered AS (SELECT state_group, room_nid, prev_state_group,"
        "  (ROW_NUMBER() OVER (PARTITION BY room_nid ORDER BY state_group) - 1) AS pos"
        f"  FROM {linked} WHERE state_group <= ?{extra} AND room_nid IN (SELECT room_nid FROM big))"
    )


def chunk_starts(groups: str, linked: str, where: str, chunk_groups: int) -> str:
    """``(room_nid, state_group)``: the first group of each chunk after a room's first."""
    n = int(chunk_groups)
    return (
        _numbered(groups, linked, where)
        + f" SELECT room_nid, state_group FROM numbered WHERE pos > 0 AND pos % {n} = 0"
        " ORDER BY room_nid, state_group"
    )


def chunk_links(groups: str, linked: str, where: str, chunk_groups: int) -> str:
    """``(room_nid, chunk, prev_state_group)`` of every predecessor link that
    crosses from a chunk into an earlier one."""
    n = int(chunk_groups)
    return (
        _numbered(groups, linked, where) + f" SELECT g.room_nid, g.pos / {n}, g.prev_state_group FROM numbered g"
        " JOIN numbered p ON p.state_group = g.prev_state_group AND p.room_nid = g.room_nid"
        f" WHERE g.pos / {n} <> p.pos / {n}"
    )
