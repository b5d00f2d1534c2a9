"""The ``room_memberships`` table: every membership event of every room, in
stream order (the history visibility is judged by), and all its SQL.

The event persister inserts a row per member event; the visibility rules,
sync and the events stream's rows embed the fragments below (aliases are the
caller's); ``membership_codes_txn`` reads the codes of stored events.
"""

from __future__ import annotations

from collections.abc import Sequence

from roomstore.storage.database import Transaction
from roomstore.storage.engines import Row
from roomstore.visibility.codes import MEMBERSHIP_CODES

JOIN = MEMBERSHIP_CODES["join"]

__all__ = [
    "delete_room_memberships_txn",
    "insert_memberships",
    "joined_after_sql",
    "last_join_sql",
    "left_rooms_sql",
    "left_upto_sql",
    "membership_codes_txn",
    "membership_of_sql",
    "newest_memberships_sql",
    "own_membership_events_sql",
]


def insert_memberships(txn: Transaction, rows: Sequence[Row]) -> None:
    """Queue ``(event_nid, room_nid, user_nid, sender_nid, membership, stream_ordering)`` rows."""
    txn.insert_many(
        "room_memberships",
        ("event_nid", "room_nid", "user_nid", "sender_nid", "membership", "stream_ordering"),
        rows,
        queue=True,
    )


def membership_codes_txn(txn: Transaction, event_nids: Sequence[int]) -> list[tuple[int, int]]:
    """``(event_nid, membership code)`` of those of ``event_nids`` (at most a
    chunk) that are membership events."""
    marks = ", ".join("?" for _ in event_nids)
    return txn.execute(
        f"SELECT event_nid, membership FROM room_memberships WHERE event_nid IN ({marks})", list(event_nids)
    ).fetchall()


def joined_after_sql(event_alias: str) -> str:
    """True when the viewer (one ``?``: their user nid) joined the room of
    ``event_alias`` after it, in stream order."""
    return f"""EXISTS (
        SELECT 1 FROM room_memberships AS later
        WHERE later.room_nid = {event_alias}.room_nid AND later.user_nid = ?
          AND later.membership = {JOIN} AND later.stream_ordering > {event_alias}.stream_ordering)"""


def last_join_sql() -> str:
    """The stream ordering of the viewer's last join of a room (binds the
    room nid, then the user nid); NULL when they never joined."""
    return f"""(SELECT MAX(lj.stream_ordering) FROM room_memberships AS lj
        WHERE lj.room_nid = ? AND lj.user_nid = ? AND lj.membership = {JOIN})"""


def membership_of_sql(nid_expr: str) -> str:
    """A scalar subquery: the membership code of the event nid ``nid_expr``."""
    return f"(SELECT membership FROM room_memberships WHERE event_nid = {nid_expr})"


def left_rooms_sql(event_alias: str) -> str:
    """``event_alias`` is in a room the user left, was kicked or banned from
    in a stream window (binds user nid, two membership codes, the window's
    bounds)."""
    return (
        f"{event_alias}.room_nid IN (SELECT lm.room_nid FROM room_memberships AS lm"
        "   WHERE lm.user_nid = ? AND lm.membership IN (?, ?)"
        "   AND lm.stream_ordering > ? AND lm.stream_ordering <= ?)"
    )


def left_upto_sql(event_alias: str) -> str:
    """``event_alias`` comes no later than the user's last leave (or ban) of
    its room in the window (binds as ``left_rooms_sql``)."""
    return (
        f"{event_alias}.stream_ordering <= (SELECT MAX(lm2.stream_ordering) FROM room_memberships AS lm2"
        f"   WHERE lm2.room_nid = {event_alias}.room_nid AND lm2.user_nid = ? AND lm2.membership IN (?, ?)"
        "   AND lm2.stream_ordering > ? AND lm2.stream_ordering <= ?)"
    )


def own_membership_events_sql() -> str:
    """Sync's candidate rows ``(event_nid, tl 0, own 1)``: the user's own
    membership events in a stream window (binds user nid, the bounds)."""
    return (
        "SELECT om.event_nid AS event_nid, 0 AS tl, 1 AS own FROM room_memberships AS om"
        " WHERE om.user_nid = ? AND om.stream_ordering > ? AND om.stream_ordering <= ?"
    )


def delete_room_memberships_txn(txn: Transaction, room_nid: int) -> int:
    """Delete the room's membership rows (a purged room); how many there were."""
    txn.execute("DELETE FROM room_memberships WHERE room_nid = ?", (room_nid,))
    return max(txn.rowcount, 0)


def newest_memberships_sql() -> str:
    """A subquery: per room, the user's newest membership event there
    (binds the user nid), as ``(room_nid, membership, event_nid,
    stream_ordering)``; outliers (invites from rooms this server is not in)
    included, as ``room_memberships`` holds them."""
    return (
        "SELECT nm.room_nid AS room_nid, nm.membership AS membership, nm.event_nid AS event_nid,"
        " nm.stream_ordering AS stream_ordering FROM room_memberships AS nm"
        " WHERE nm.user_nid = ? AND nm.stream_ordering = (SELECT MAX(nx.stream_ordering) FROM room_memberships AS nx"
        "   WHERE nx.room_nid = nm.room_nid AND nx.user_nid = nm.user_nid)"
    )
