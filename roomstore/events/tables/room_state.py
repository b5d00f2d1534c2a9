"""A room's ends and its current state: ``forward_extremities``,
``backward_extremities``, ``current_state``, ``current_state_deltas`` and
``current_memberships``; every statement that names them.

Written by the persister's batch (``roomstore.events.current_state`` decides
what changes), read by the event reader, precheck, sync and recent (which
embed ``joined_room_nids_sql`` / ``current_memberships_as``) and by the
replication rows of the current-state stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from roomstore.events.tables.events.fragments import join_events
from roomstore.storage.database import Transaction
from roomstore.storage.interning import (
    chunks,
    event_id_sql,
    join_rooms,
    join_state_keys,
    join_users,
    rooms_as,
)

EXTREMITY_TABLES = {"forward": "forward_extremities", "backward": "backward_extremities"}


def _delete_pairs(txn: Transaction, table: str, columns: tuple[str, str], pairs, queue: bool = False) -> None:
    """DELETE rows matching any of ``pairs`` in one statement per chunk
    (row-value IN lists work on PostgreSQL and SQLite 3.15+); ``queue``: see
    ``Transaction.queue``."""
    pairs = sorted(set(pairs))
    for part in chunks(pairs):
        values = ", ".join("(?, ?)" for _ in part)
        (txn.queue if queue else txn.execute)(
            f"DELETE FROM {table} WHERE ({columns[0]}, {columns[1]}) IN (VALUES {values})",
            [v for pair in part for v in pair],
        )


# ---------------------------------------------------------------------- fragments


def current_memberships_as(alias: str) -> str:
    """``current_memberships AS alias``: the FROM item of a composed read."""
    return f"current_memberships AS {alias}"


def joined_room_nids_sql(alias: str = "cm") -> str:
    """A subquery: the nids of the rooms a user is in with a membership
    (binds the user nid and the membership code)."""
    return (
        f"SELECT {alias}.room_nid FROM current_memberships AS {alias}"
        f" WHERE {alias}.user_nid = ? AND {alias}.membership = ?"
    )


# ---------------------------------------------------------------------- extremities


def queue_extremity_changes(
    txn: Transaction,
    forward_gone: Sequence[tuple],
    forward_new: Sequence[tuple],
    backward_new: Sequence[tuple],
    backward_gone: Sequence[tuple],
) -> None:
    """Queue the batch's changes of ``(room_nid, event_nid)`` extremity rows."""
    _delete_pairs(txn, "forward_extremities", ("room_nid", "event_nid"), forward_gone, queue=True)
    txn.insert_many("forward_extremities", ("room_nid", "event_nid"), forward_new, queue=True)
    txn.insert_many(
        "backward_extremities",
        ("room_nid", "event_nid"),
        backward_new,
        on_conflict="ON CONFLICT DO NOTHING",
        queue=True,
    )
    _delete_pairs(txn, "backward_extremities", ("room_nid", "event_nid"), backward_gone, queue=True)


def extremity_nids_txn(txn: Transaction, room_nid: int, which: str) -> list[int]:
    """The event nids of the room's ``which`` (forward or backward) extremities."""
    table = EXTREMITY_TABLES[which]
    return [r[0] for r in txn.execute(f"SELECT event_nid FROM {table} WHERE room_nid = ?", (room_nid,)).fetchall()]


def forward_groups_txn(txn: Transaction, room_nid: int) -> list[tuple[int, int | None]]:
    """``(event_nid, state_group)`` of the room's forward extremities."""
    return txn.execute(
        "SELECT f.event_nid, e.state_group FROM forward_extremities AS f"
        f" {join_events('e', 'e.event_nid = f.event_nid')} WHERE f.room_nid = ?",
        (room_nid,),
    ).fetchall()


def current_and_forward_groups_txn(txn: Transaction, room_nid: int) -> list[tuple]:
    """``(rooms.current_state_group, extremity state group)`` per forward
    extremity of the room (one row with NULL when it has none)."""
    return txn.execute(
        f"SELECT r.current_state_group, e.state_group FROM {rooms_as('r')}"
        " LEFT JOIN forward_extremities AS f ON f.room_nid = r.room_nid"
        f" {join_events('e', 'e.event_nid = f.event_nid', 'LEFT JOIN')}"
        " WHERE r.room_nid = ?",
        (room_nid,),
    ).fetchall()


# ---------------------------------------------------------------------- current state


def queue_current_state_changes(
    txn: Transaction, removed: Sequence[tuple], upserts: Sequence[tuple], deltas: Sequence[tuple]
) -> None:
    """Queue the room's current state rows removed and upserted, and the deltas the stream carries."""
    _delete_pairs(txn, "current_state", ("room_nid", "type_key_nid"), removed, queue=True)
    txn.insert_many(
        "current_state",
        ("room_nid", "type_key_nid", "event_nid"),
        upserts,
        on_conflict="ON CONFLICT (room_nid, type_key_nid) DO UPDATE SET event_nid = excluded.event_nid",
        queue=True,
    )
    txn.insert_many(
        "current_state_deltas",
        ("stream_ordering", "instance_name", "room_nid", "type_key_nid", "event_nid", "prev_event_nid"),
        deltas,
        queue=True,
    )


def current_state_txn(txn: Transaction, room_nid: int, keys: Sequence[int] | None) -> dict[int, int]:
    """key nid -> event nid of the room's current state (only ``keys`` when given)."""
    sql = "SELECT type_key_nid, event_nid FROM current_state WHERE room_nid = ?"
    if keys is None:
        return dict(txn.execute(sql, (room_nid,)).fetchall())
    state: dict[int, int] = {}
    for part in chunks(keys):
        marks = ", ".join("?" for _ in part)
        state.update(txn.execute(f"{sql} AND type_key_nid IN ({marks})", (room_nid, *part)).fetchall())
    return state


#: An instance's current-state changes in a range of tokens (binds the
#: instance and the range's two ends), as ``(token, 1, type, state_key,
#: event_id or None, room_nid)`` and NULLs: the UNION partner of
#: ``events.LIVE_EVENT_STREAM_ROWS`` (same columns).
STATE_STREAM_ROWS = (
    f"SELECT d.stream_ordering, 1, k.type, k.state_key, {event_id_sql('d.event_nid')}, d.room_nid,"
    " NULL, NULL, NULL, NULL, NULL, NULL"
    f" FROM current_state_deltas AS d {join_state_keys('k', 'd.type_key_nid')}"
    " WHERE d.instance_name = ? AND d.stream_ordering > ? AND d.stream_ordering <= ?"
)
#: ``STATE_STREAM_ROWS`` with the event nid (or NULL) where the event ID
#: was: the UNION partner of ``events.LIVE_EVENT_NID_STREAM_ROWS``.
STATE_NID_STREAM_ROWS = STATE_STREAM_ROWS.replace(event_id_sql("d.event_nid"), "d.event_nid")


def state_json_stream_rows_sql(engine) -> str:
    """``STATE_STREAM_ROWS`` with each row written as its JSON text by the
    database (where ``engine.in_process``), ``["state", [room_id, type,
    state_key, event_id or null]]``: columns ``(token, 1, type, state_key,
    row JSON)``, the UNION partner of ``events.event_json_stream_rows_sql``.
    The same bindings."""
    row = engine.json_array_sql(
        [
            ("text", "'state'"),
            (
                "array",
                engine.json_array_sql(
                    [
                        ("text", "r.room_id"),
                        ("text", "k.type"),
                        ("text", "k.state_key"),
                        ("text", event_id_sql("d.event_nid")),
                    ]
                ),
            ),
        ]
    )
    return (
        f"SELECT d.stream_ordering, 1, k.type, k.state_key, {row}"
        f" FROM current_state_deltas AS d {join_rooms('r', 'd.room_nid')} {join_state_keys('k', 'd.type_key_nid')}"
        " WHERE d.instance_name = ? AND d.stream_ordering > ? AND d.stream_ordering <= ?"
    )


# ---------------------------------------------------------------------- current memberships


def queue_membership_changes(txn: Transaction, gone: Sequence[tuple], rows: Sequence[tuple]) -> None:
    """Queue ``(room_nid, user_nid)`` rows gone and ``(room_nid, user_nid,
    membership, event_nid, stream_ordering)`` rows upserted."""
    _delete_pairs(txn, "current_memberships", ("room_nid", "user_nid"), gone, queue=True)
    txn.insert_many(
        "current_memberships",
        ("room_nid", "user_nid", "membership", "event_nid", "stream_ordering"),
        rows,
        on_conflict="ON CONFLICT (room_nid, user_nid) DO UPDATE SET membership = excluded.membership,"
        " event_nid = excluded.event_nid, stream_ordering = excluded.stream_ordering",
        queue=True,
    )


def member_nids_txn(txn: Transaction, room_nid: int, membership: int) -> list[int]:
    """The user nids with ``membership`` in the room now."""
    return [
        r[0]
        for r in txn.execute(
            "SELECT user_nid FROM current_memberships WHERE room_nid = ? AND membership = ?", (room_nid, membership)
        ).fetchall()
    ]


def memberships_of_user_txn(txn: Transaction, user_nid: int) -> list[tuple[str, int, str, int]]:
    """``(room_id, membership code, event_id, stream_ordering)`` of every
    room where the user has a membership in the current state."""
    return txn.execute(
        f"SELECT r.room_id, m.membership, {event_id_sql('m.event_nid')}, m.stream_ordering"
        f" FROM current_memberships AS m {join_rooms('r', 'm.room_nid')} WHERE m.user_nid = ?",
        (user_nid,),
    ).fetchall()


def rooms_of_user_txn(txn: Transaction, user_id: str, membership: int) -> list[str]:
    """The room IDs where ``user_id`` has ``membership`` now."""
    return [
        r[0]
        for r in txn.execute(
            f"SELECT r.room_id FROM current_memberships AS m {join_users('u', 'm.user_nid')}"
            f" {join_rooms('r', 'm.room_nid')} WHERE u.user_id = ? AND m.membership = ?",
            (user_id, membership),
        ).fetchall()
    ]


# ---------------------------------------------------------------------- purging (roomstore.events.purge)


def replace_backward_extremities_txn(txn: Transaction, room_nid: int, nids: set[int]) -> int:
    """The room's backward extremities become ``nids``; returns how many rows were deleted."""
    old = set(extremity_nids_txn(txn, room_nid, "backward"))
    gone = sorted(old - nids)
    _delete_pairs(txn, "backward_extremities", ("room_nid", "event_nid"), [(room_nid, n) for n in gone])
    txn.insert_many(
        "backward_extremities",
        ("room_nid", "event_nid"),
        [(room_nid, n) for n in sorted(nids - old)],
        on_conflict="ON CONFLICT DO NOTHING",
    )
    return len(gone)


#: A room's rows in the tables of this module, by the column naming the room.
_ROOM_TABLES = (
    "forward_extremities",
    "backward_extremities",
    "current_state",
    "current_state_deltas",
    "current_memberships",
)


def delete_room_txn(txn: Transaction, room_nid: int, counts: dict[str, int]) -> None:
    """Delete every row of the room in this module's tables; ``counts``
    gains the rows deleted per table."""
    for table in _ROOM_TABLES:
        txn.execute(f"DELETE FROM {table} WHERE room_nid = ?", (room_nid,))
        counts[table] = counts.get(table, 0) + max(txn.rowcount, 0)
