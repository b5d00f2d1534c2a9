"""Timeline reads: recent, visibility checks, and the pieces sync
(``roomstore.events.read.sync``) and pagination (``roomstore.events.read.pagination``)
compose.

``TimelineReader`` serves the reads a client makes of a room's timeline
(the federation walks are ``roomstore.events.read.federation``). Every read is
one ``run_interaction``; the SQL uses ``?`` placeholders and bound
parameters only. Events come back as dicts, exactly as
``EventReader.events_txn`` returns them: parsed from the stored bytes,
``event_id`` added where the room version's PDUs lack it, and pruned (with
``unsigned.redacted_because``) when a redaction of them in the same room is
stored. The client-facing reads fetch the bytes in the same statement that
selects the events.

Visibility (client reads): every timeline row passes ``visible_sql`` of
``roomstore.visibility.snapshots``, computed at persist time into snapshots;
no state is looked up at read time. Outliers (no place in the graph, no
state) and rejected events never appear in a timeline.

Orders and tokens (see ``roomstore.events.tokens``):

* *stream order* (``events.stream_ordering``) is arrival order; sync and
  recent use it. A stream token ``s<n>`` / ``m<min>~<id>.<pos>...`` is a
  position in it, per writer instance; "now" is the events stream
  generator's per-writer positions (``roomstore.events.read_positions``), so
  an event whose stream ID is reserved but not yet complete is never served.
* *topological order* is ``(topological_ordering, stream_ordering)``;
  pagination (``roomstore.events.read.pagination``) uses it. A token ``t<topo>-<stream>`` is the position just after
  the event key ``(topo, stream)``: going backwards from it yields keys at or
  below it, going forwards keys above it. Keys are integers and unique
  (stream orderings are), so ``(topo, stream - 1)`` is the position just
  before ``(topo, stream)``: pages neither repeat nor skip events.

Who calls it: ``RoomStore``'s thin wrappers (``recent``, ``is_visible``),
``SyncReader`` and ``Paginator``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import attrs

from roomstore.events.read.event_reader import EventReader
from roomstore.events.read_positions import ReadPositions
from roomstore.events.tables.events import (
    SERVED_COLUMN_COUNT,
    visible_flag_txn,
)
from roomstore.events.tables.events.timeline_reads import recent_sql
from roomstore.events.tokens import InvalidToken
from roomstore.pdu.hashing import add_derived_ids
from roomstore.pdu.redaction_algorithm import redacted_copy
from roomstore.pdu.room_versions import KNOWN_ROOM_VERSIONS, get_room_version
from roomstore.storage.database import Database, Transaction
from roomstore.storage.interning import Interners
from roomstore.streams.change_cache import StreamChangeCache
from roomstore.visibility.codes import MEMBERSHIP_CODES
from roomstore.visibility.snapshots import visible_params, visible_sql

__all__ = ["InvalidToken", "RecentResult", "TimelineReader"]

JOIN = MEMBERSHIP_CODES["join"]
MEMBER = "m.room.member"

#: Below every stream ordering (backfilled events have negative ones).
LOWEST_STREAM = -(2**63)


# ---------------------------------------------------------------------- results


@attrs.frozen
class RecentResult:
    """The newest visible events of a page of a user's most active rooms.

    ``rooms``: ``(room_id, events)`` pairs, most recently active room first,
    each room's events oldest first (stream order). ``next_cursor``: pass as
    ``from_cursor`` for the next rooms, None when there are none. ``token``:
    the stream position every page of this walk is pinned to; sync from it to
    catch up with what happened since.
    """

    rooms: list[tuple[str, list[dict]]]
    next_cursor: str | None
    token: str


# ---------------------------------------------------------------------- SQL pieces


#: How many leading columns of a row are ``SERVED_COLUMNS``, the columns ``event_from_row`` takes (their owner's:
#: ``roomstore.events.tables.events``, whose statements select them).
EVENT_COLUMN_COUNT = SERVED_COLUMN_COUNT


def _parse(raw) -> dict:
    return json.loads(bytes(raw).decode("utf-8"))


def event_from_row(row: Sequence) -> dict:
    """The served dict of a ``SERVED_COLUMNS`` row (as ``events_txn`` makes it)."""
    return _served_event(row[1], *row[5:EVENT_COLUMN_COUNT])


def _served_event(event_id: str, version: str, raw, redacted, redaction_raw, redaction_id) -> dict:
    """The served dict of an event's stored bytes and its first redaction's."""
    room_version = KNOWN_ROOM_VERSIONS.get(version)
    event = add_derived_ids(_parse(raw), event_id, room_version)
    if redacted and redaction_raw is not None:
        redaction = _parse(redaction_raw)
        redaction.setdefault("event_id", redaction_id)
        event = redacted_copy(event, get_room_version(version), redaction)
        add_derived_ids(event, event_id, room_version)
    return event


def _is_pruned(event: dict) -> bool:
    """Whether a served event is the pruned copy of a redacted one."""
    unsigned = event.get("unsigned")
    return isinstance(unsigned, dict) and "redacted_because" in unsigned


def stream_bound_sql(alias: str, op: str, default: int, per_writer: Mapping[str, int]) -> tuple[str, list]:
    """``alias.stream_ordering op <bound>`` where the bound is per writer.

    ``per_writer`` maps instance names to their positions; every other
    instance is at ``default``. The plain comparison against the widest
    bound comes first so the (room, stream) index can be used.
    """
    extra = {name: pos for name, pos in per_writer.items() if pos != default}
    if not extra:
        return f"{alias}.stream_ordering {op} ?", [default]
    widest = max(default, *extra.values()) if op in ("<=", "<") else min(default, *extra.values())
    cases = " ".join("WHEN ? THEN ?" for _ in extra)
    params: list = [widest]
    for name in sorted(extra):
        params.extend((name, extra[name]))
    params.append(default)
    return (
        f"({alias}.stream_ordering {op} ? AND {alias}.stream_ordering {op}"
        f" CASE {alias}.instance_name {cases} ELSE ? END)",
        params,
    )


_CURSOR = re.compile(r"(-?[0-9]{1,19})_([0-9]{1,19})_([sm][0-9~.]+)", re.ASCII)


@attrs.frozen
class Viewer:
    """A user as the visibility SQL needs them: nids, -1 when unknown."""

    user_id: str
    user_nid: int | None
    member_key_nid: int | None

    def params(self) -> list:
        return visible_params(
            self.user_nid if self.user_nid is not None else -1,
            self.member_key_nid if self.member_key_nid is not None else -1,
        )


# ---------------------------------------------------------------------- the reader


@attrs.frozen
class TimelineReader:
    """Timeline reads; see the module docstring.

    Its fields are its collaborators: the database, the interners (the
    viewer's nids), the read positions (tokens of now, the check of a
    client's token), the event reader (the user's joined rooms) and the
    change caches of rooms and of users' memberships (sync's "nothing
    changed" answer).
    """

    db: Database
    interners: Interners
    positions: ReadPositions
    events: EventReader
    room_changes: StreamChangeCache
    membership_changes: StreamChangeCache

    # ------------------------------------------------------------------ users

    def cached_viewer(self, user_id: str) -> Viewer:
        """The viewer's nids from the interner caches only (None when not cached)."""
        return Viewer(
            user_id,
            self.interners.users.cached_nid(user_id),
            self.interners.state_keys.cached_nid((MEMBER, user_id)),
        )

    def viewer_txn(self, txn: Transaction, viewer: Viewer) -> Viewer:
        """Fill in nids the caches lacked (one lookup each, only then)."""
        user_nid, key_nid = viewer.user_nid, viewer.member_key_nid
        if user_nid is None:
            user_nid = self.interners.users.lookup(txn, [viewer.user_id]).get(viewer.user_id)
        if key_nid is None and user_nid is not None:
            key = (MEMBER, viewer.user_id)
            key_nid = self.interners.state_keys.lookup(txn, [key]).get(key)
        return Viewer(viewer.user_id, user_nid, key_nid)

    # ------------------------------------------------------------------ recent

    async def recent(self, user_id: str, rooms: int, events: int, from_cursor: str | None = None) -> RecentResult:
        """The ``events`` newest visible events in each of the user's ``rooms``
        most recently active joined rooms; see ``RecentResult``.

        A room's activity is the newest stream ordering of its (non-outlier,
        non-rejected) events, whoever may see them. The first call pins the
        walk to the current position (carried in the cursor): activities are
        measured there, so the walk over rooms neither repeats nor skips a
        room that stays joined, however busy the rooms are meanwhile. One
        statement; its cost grows with the user's joined rooms by one index
        entry and one row each, and with the page by ``events`` a room
        (however long the rooms). Served events come from the event cache
        when it holds them (not parsed again), and fill it.

        Raises ``InvalidToken`` for a malformed cursor, ``ValueError`` for
        ``rooms`` < 1 or ``events`` < 0.
        """
        if rooms < 1 or events < 0:
            raise ValueError(f"recent needs rooms >= 1 and events >= 0, got rooms={rooms}, events={events}")
        after: tuple[int, int] | None = None
        if from_cursor is None:
            await self.positions.ensure_instances()
            pinned = self.positions.now()
        else:
            match = _CURSOR.fullmatch(from_cursor) if isinstance(from_cursor, str) else None
            if match is None:
                raise InvalidToken(f"{from_cursor!r} is not a cursor returned by recent()")
            pinned = self.positions.parse_stream_token(match.group(3))
            await self.positions.ensure_instances(pinned)
            after = (int(match.group(1)), int(match.group(2)))
        generation = self.events.events_generation
        rows = await self.db.run_interaction(
            "recent",
            self._recent_txn,
            self.cached_viewer(user_id),
            rooms,
            events,
            after,
            self.positions.per_writer(pinned),
        )
        pages: list[tuple[str, list[dict]]] = []
        last: tuple[int, int] | None = None
        next_cursor = None
        cached = self.events.cached_event
        parsed: dict[str, dict] = {}
        for room_nid, activity, room_id, event_id, *stored in rows:
            if last != (activity, room_nid):
                if last is not None and len(pages) == rooms:
                    # The statement's one room more: another page follows.
                    next_cursor = f"{last[0]}_{last[1]}_{pinned.to_string()}"
                    break
                pages.append((room_id, []))
                last = (activity, room_nid)
            if event_id is None:
                continue
            # The event cache's served dict spares parsing the bytes again,
            # unless it disagrees with the row on whether it is redacted.
            event = cached(event_id)
            if event is None or _is_pruned(event) != (bool(stored[2]) and stored[3] is not None):
                event = parsed[event_id] = _served_event(event_id, *stored)
            pages[-1][1].append(event)
        self.events.cache_events(generation, parsed)
        return RecentResult(pages, next_cursor, pinned.to_string())

    def _recent_txn(
        self,
        txn: Transaction,
        viewer: Viewer,
        rooms: int,
        events: int,
        after: tuple[int, int] | None,
        upper: tuple[int, dict[str, int]],
    ) -> list[tuple]:
        """One statement: rows ``(room_nid, activity, room_id, event_id,
        room_version, json, redacted, redaction_json, redaction_id)``, the page's rooms most
        recently active first and each room's events oldest first; a room with
        no visible event has one row of NULL event columns. The page holds
        ``rooms + 1`` rooms, the last without events: whether it exists says
        whether another page follows (no count of the user's rooms)."""
        viewer = self.viewer_txn(txn, viewer)
        if viewer.user_nid is None:
            return []
        high_sql, high_params = stream_bound_sql("e", "<=", upper[0], upper[1])
        if after is None:
            cursor_sql, cursor_params = "1 = 1", []
        else:
            # Keyset over (activity, room_nid), both descending.
            cursor_sql = "(a.activity < ? OR (a.activity = ? AND a.room_nid < ?))"
            cursor_params = [after[0], after[0], after[1]]
        sql = recent_sql(high_sql, cursor_sql)
        offset = max(events - 1, 0)
        params = [
            min([upper[0], *upper[1].values()]),
            False,
            *high_params,
            viewer.user_nid,
            JOIN,
            *cursor_params,
            rooms + 1,
            offset,
            False,
            *high_params,
            *viewer.params(),
            offset,
            rooms if events else 0,
            LOWEST_STREAM,
            False,
            *high_params,
            *viewer.params(),
        ]
        return txn.execute(sql, params, prepare=True).fetchall()

    # ------------------------------------------------------------------ one event

    async def is_visible(self, user_id: str, event_id: str) -> bool:
        """May ``user_id`` see ``event_id``, by the same SQL predicate the
        timelines use? False for unknown, outlier and rejected events."""
        return await self.db.run_interaction("is_visible", self._is_visible_txn, self.cached_viewer(user_id), event_id)

    def _is_visible_txn(self, txn: Transaction, viewer: Viewer, event_id: str) -> bool:
        viewer = self.viewer_txn(txn, viewer)
        vis, _ = visible_sql("e")
        row = visible_flag_txn(txn, vis, [*viewer.params(), event_id, False])
        return bool(row and row[0])
