"""The membership and history visibility values, and the codes the store
keeps them by in its SMALLINT columns (``room_memberships``,
``visibility_snapshots``, ...). The codes are persisted: never renumber,
only append. The spec's rules over these values are applied by
``snapshots`` and ``memberships``; ``rules`` is the independent oracle the
tests check them against, and imports nothing of this module."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "HistoryVisibility",
    "MEMBERSHIP_BY_CODE",
    "MEMBERSHIP_CODES",
    "Membership",
    "NO_MEMBERSHIP_CODE",
    "VISIBILITY_BY_CODE",
    "VISIBILITY_CODES",
    "membership_code",
    "visibility_code",
]


class Membership:
    """``content.membership`` values of ``m.room.member``."""

    JOIN = "join"
    INVITE = "invite"
    LEAVE = "leave"
    BAN = "ban"
    KNOCK = "knock"


class HistoryVisibility:
    """``content.history_visibility`` values of ``m.room.history_visibility``."""

    WORLD_READABLE = "world_readable"
    SHARED = "shared"
    INVITED = "invited"
    JOINED = "joined"


# Codes for SMALLINT columns.  They are persisted: never renumber, only append.
#: Membership -> code.  0 is :data:`NO_MEMBERSHIP_CODE`.
MEMBERSHIP_CODES: Mapping[str, int] = {
    Membership.JOIN: 1,
    Membership.INVITE: 2,
    Membership.LEAVE: 3,
    Membership.BAN: 4,
    Membership.KNOCK: 5,
}
#: The user has no membership event at that point, or it holds a value the
#: spec does not define; the rules treat both exactly like ``leave``/``ban``
#: (neither ``join`` nor ``invite``).
NO_MEMBERSHIP_CODE = 0
MEMBERSHIP_BY_CODE: Mapping[int, str] = {c: m for m, c in MEMBERSHIP_CODES.items()}

#: History visibility -> code; higher is more restrictive.  0 is never used,
#: so a zero in a column means "not computed" rather than a valid value.
VISIBILITY_CODES: Mapping[str, int] = {
    HistoryVisibility.WORLD_READABLE: 1,
    HistoryVisibility.SHARED: 2,
    HistoryVisibility.INVITED: 3,
    HistoryVisibility.JOINED: 4,
}
VISIBILITY_BY_CODE: Mapping[int, str] = {c: v for v, c in VISIBILITY_CODES.items()}


def membership_code(membership: str | None) -> int:
    """SMALLINT code for ``membership``; :data:`NO_MEMBERSHIP_CODE` if None/unknown."""
    return MEMBERSHIP_CODES.get(membership, NO_MEMBERSHIP_CODE) if isinstance(membership, str) else NO_MEMBERSHIP_CODE


def visibility_code(visibility: object) -> int:
    """SMALLINT code for ``visibility``; unknown values count as ``shared`` (spec)."""
    if isinstance(visibility, str) and visibility in VISIBILITY_CODES:
        return VISIBILITY_CODES[visibility]
    return VISIBILITY_CODES[HistoryVisibility.SHARED]
