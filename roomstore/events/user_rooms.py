"""A user's rooms by membership: what a client-server front lists as the
invite, join, leave (and knock) sections of a sync, or ``/joined_rooms``.

A user's membership of a room is the one in the room's current state
(``current_memberships``, as ``RoomStore.get_rooms_for_user`` reads joins),
except where the user's newest membership event of the room is an outlier
newer than that: an invite (or knock, or its rejection) from a room this
server is not in arrives as an outlier, with no place in the room's state,
and is the user's membership there until the room's state says otherwise.
``room_memberships`` holds every accepted membership event, outliers
included, so both come from the tables in one transaction of two reads.

Who calls it: ``RoomStore.get_rooms_for_user_by_membership``.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from roomstore.events.tables.events.timeline_reads import outlier_memberships_sql
from roomstore.events.tables.room_state import memberships_of_user_txn
from roomstore.storage.database import Transaction
from roomstore.storage.interning import Interners
from roomstore.visibility.codes import MEMBERSHIP_BY_CODE, MEMBERSHIP_CODES
from roomstore.visibility.memberships import newest_memberships_sql

__all__ = ["RoomMembership", "rooms_by_membership_txn"]


@attrs.frozen
class RoomMembership:
    """A user's current membership of a room: the membership, the event that
    made it and that event's stream ordering."""

    room_id: str
    membership: str
    event_id: str
    stream_ordering: int


def check_memberships(memberships: Collection[str]) -> frozenset[str]:
    """The memberships asked for, each one the spec defines (``ValueError`` otherwise)."""
    if isinstance(memberships, str):
        raise ValueError(f"memberships must be a collection of memberships, not the string {memberships!r}")
    asked = frozenset(memberships)
    unknown = sorted(m for m in asked if m not in MEMBERSHIP_CODES)
    if unknown:
        raise ValueError(f"unknown membership {unknown[0]!r}: one of {', '.join(sorted(MEMBERSHIP_CODES))}")
    return asked


def rooms_by_membership_txn(
    txn: Transaction, interners: Interners, user_id: str, memberships: frozenset[str]
) -> list[RoomMembership]:
    """The user's rooms whose membership is one of ``memberships``, oldest
    membership event first (see the module docstring)."""
    user_nid = interners.users.lookup(txn, [user_id]).get(user_id)
    if user_nid is None or not memberships:
        return []
    current = {
        room_id: (code, event_id, stream) for room_id, code, event_id, stream in memberships_of_user_txn(txn, user_nid)
    }
    outliers = txn.execute(outlier_memberships_sql(newest_memberships_sql()), (user_nid, True)).fetchall()
    for room_id, code, event_id, stream in outliers:
        if room_id not in current or current[room_id][2] < stream:
            current[room_id] = (code, event_id, stream)
    found = [
        RoomMembership(room_id, MEMBERSHIP_BY_CODE[code], event_id, stream)
        for room_id, (code, event_id, stream) in current.items()
        if MEMBERSHIP_BY_CODE.get(code) in memberships
    ]
    return sorted(found, key=lambda m: (m.stream_ordering, m.room_id))
