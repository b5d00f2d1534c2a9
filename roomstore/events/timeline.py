"""Timeline reads: sync, recent, pagination, visibility checks, federation walks.

``TimelineReader`` serves the reads a client or a remote server makes of a
room's timeline. Every read is one ``run_interaction``; the SQL uses ``?``
placeholders and bound parameters only. Events come back as dicts, exactly as
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
  generator's per-writer positions, so an event whose stream ID is reserved
  but not yet complete is never served.
* *topological order* is ``(topological_ordering, stream_ordering)``;
  pagination uses it. A token ``t<topo>-<stream>`` is the position just after
  the event key ``(topo, stream)``: going backwards from it yields keys at or
  below it, going forwards keys above it. Keys are integers and unique
  (stream orderings are), so ``(topo, stream - 1)`` is the position just
  before ``(topo, stream)``: pages neither repeat nor skip events.

Federation reads (``backfill``, ``get_missing_events``) are server to server:
no user visibility filter. They walk the prev-event graph of stored,
non-outlier events of the room only (an outlier's prev events are not part
of the room graph we hold); rejected events are walked through, so their
ancestors are reached, but never returned (as Synapse does for backfill).

Who calls it: ``RoomStore``'s thin wrappers (``sync``, ``recent``,
``paginate``, ``is_visible``, ``backfill``, ``get_missing_events``).
"""

from __future__ import annotations

import heapq
import json
import re
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import attrs
from twisted.internet import defer

from roomstore.events.redaction import redacted_copy
from roomstore.events.room_versions import get_room_version
from roomstore.events.tokens import InvalidToken, StreamToken, TopologicalToken
from roomstore.storage.database import Transaction
from roomstore.storage.interning import chunks
from roomstore.visibility.rules import MEMBERSHIP_CODES
from roomstore.visibility.snapshots import visible_params, visible_sql

if TYPE_CHECKING:
    from roomstore.store import RoomStore

__all__ = ["InvalidToken", "PaginationResult", "RecentResult", "SyncResult", "TimelineReader"]

JOIN = MEMBERSHIP_CODES["join"]
INVITE = MEMBERSHIP_CODES["invite"]
LEAVE = MEMBERSHIP_CODES["leave"]
BAN = MEMBERSHIP_CODES["ban"]
MEMBER = "m.room.member"

#: Sync passes the changed rooms by ID in the statement up to this many;
#: beyond it (or when the change cache cannot tell) it selects the user's
#: joined rooms in SQL instead, so the statement stays small.
MAX_ROOMS_IN_STATEMENT = 1000


# ---------------------------------------------------------------------- results


@attrs.frozen
class SyncResult:
    """What changed for a user between two stream positions.

    ``next_token``: the stream token to pass as ``since`` next time (never
    behind the ``since`` given). ``rooms``: room ID -> visible events in
    stream order, for the rooms the user is joined to that have new events,
    and for rooms the user left, was kicked or banned from in the window (up
    to and including that membership event); on an initial sync (``since``
    None) every joined room with its newest visible events, oldest first
    (an empty list when the user may see none). ``membership_events``: every
    one of the user's own membership events in the window, in any room and
    in stream order, whatever the history visibility (invites to rooms they
    never joined, kicks, bans, leaves, joins); outliers included, since an
    invite from another server arrives as one. ``joined``: the rooms the user
    is joined to now.
    """

    next_token: str
    rooms: dict[str, list[dict]]
    membership_events: list[dict]
    joined: frozenset[str]

    @property
    def invited(self) -> dict[str, dict]:
        """Room ID -> invite, for rooms whose newest membership here is an invite."""
        return self._newest_with({"invite"})

    @property
    def left(self) -> dict[str, dict]:
        """Room ID -> leave or ban, for rooms whose newest membership here is one."""
        return self._newest_with({"leave", "ban"})

    def _newest_with(self, memberships: set[str]) -> dict[str, dict]:
        newest: dict[str, dict] = {}
        for event in self.membership_events:
            newest[event["room_id"]] = event
        return {
            room_id: event for room_id, event in newest.items()
            if (event.get("content") or {}).get("membership") in memberships
        }


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


@attrs.frozen
class PaginationResult:
    """A page of a room's timeline in the direction asked.

    ``events`` in that direction's order (newest first for ``"b"``).
    ``next_token`` continues in the same direction; None when the page is
    empty (nothing visible lies that way now), as the client-server API omits
    ``end`` then.
    """

    events: list[dict]
    next_token: str | None


# ---------------------------------------------------------------------- SQL pieces


def _redaction_sql(column: str) -> str:
    """A scalar subquery: ``column`` of the first stored redaction of ``e`` in
    its room (by stream order), the one ``EventReader`` reports."""
    return f"""CASE WHEN e.redacted THEN (
        SELECT {column} FROM redactions AS rd
        JOIN events AS red ON red.event_nid = rd.redaction_event_nid AND red.room_nid = e.room_nid
        JOIN event_json AS rj ON rj.event_nid = rd.redaction_event_nid
        JOIN event_ids AS ri ON ri.event_nid = rd.redaction_event_nid
        WHERE rd.redacts_event_nid = e.event_nid
        ORDER BY red.stream_ordering LIMIT 1) END"""


#: The columns ``_event_from_row`` takes, over ``e`` joined by ``EVENT_JOINS``.
EVENT_COLUMNS = f"""e.event_nid AS event_nid, i.event_id AS event_id, r.room_id AS room_id,
    e.topological_ordering AS topo, e.stream_ordering AS stream, j.room_version AS room_version,
    j.json AS json, e.redacted AS redacted,
    {_redaction_sql("rj.json")} AS redaction_json, {_redaction_sql("ri.event_id")} AS redaction_id"""
EVENT_COLUMN_COUNT = 10
EVENT_JOINS = """JOIN event_json AS j ON j.event_nid = e.event_nid
    JOIN event_ids AS i ON i.event_nid = e.event_nid
    JOIN rooms AS r ON r.room_nid = e.room_nid"""


def _parse(raw) -> dict:
    return json.loads(bytes(raw).decode("utf-8"))


def _event_from_row(row: Sequence) -> dict:
    """The served dict of an ``EVENT_COLUMNS`` row (as ``events_txn`` makes it)."""
    event_id, version, raw, redacted, redaction_raw, redaction_id = (row[1], *row[5:EVENT_COLUMN_COUNT])
    event = _parse(raw)
    event.setdefault("event_id", event_id)
    if redacted and redaction_raw is not None:
        redaction = _parse(redaction_raw)
        redaction.setdefault("event_id", redaction_id)
        event = redacted_copy(event, get_room_version(version), redaction)
        event.setdefault("event_id", event_id)
    return event


def _bound_sql(alias: str, op: str, default: int, per_writer: Mapping[str, int]) -> tuple[str, list]:
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
class _Viewer:
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


class TimelineReader:
    """Timeline and federation reads; see the module docstring."""

    def __init__(self, store: "RoomStore"):
        self.store = store
        self.db = store.db
        self.interners = store.interners
        # instance_name <-> instance_id of the `instances` table, as stream
        # tokens carry ids. Rows are never changed or deleted, so the map
        # only grows; it is reloaded when a name or id is missing.
        self._instance_ids: dict[str, int] = {}
        self._instance_names: dict[int, str] = {}

    # ------------------------------------------------------------------ tokens

    async def _ensure_instances(self, token: StreamToken | None = None) -> None:
        """Load the instances map when a writer ahead of the linear position,
        or an instance named by ``token``, is not in it (no query otherwise).

        Raises ``InvalidToken`` for an instance id no instance has.
        """
        positions = self.store.events_stream.get_positions()
        linear = min(positions.values())
        wanted_names = [n for n, p in positions.items() if p > linear and n not in self._instance_ids]
        wanted_ids = [] if token is None else [
            i for i, _ in token.instance_positions if i not in self._instance_names
        ]
        if wanted_names or wanted_ids:
            rows = await self.db.run_interaction(
                "timeline_instances",
                lambda txn: txn.execute("SELECT instance_id, instance_name FROM instances").fetchall(),
            )
            for instance_id, name in rows:
                self._instance_ids[name] = instance_id
                self._instance_names[instance_id] = name
        unknown = [] if token is None else [i for i, _ in token.instance_positions if i not in self._instance_names]
        if unknown:
            raise InvalidToken(f"token {token.to_string()!r} names unknown writer instance id(s) {unknown}")

    def _now(self) -> StreamToken:
        """The position reads stop at: every writer's completed position.

        A writer without an instance id (it never registered, which a writer
        ahead of the others cannot be after ``_ensure_instances``) is
        represented at the minimum: the token then promises no more of it.
        """
        positions = self.store.events_stream.get_positions()
        linear = min(positions.values())
        ahead = {
            self._instance_ids[name]: pos for name, pos in positions.items()
            if pos > linear and name in self._instance_ids
        }
        return StreamToken.create(linear, ahead)

    def _per_writer(self, token: StreamToken) -> tuple[int, dict[str, int]]:
        """(default position, instance name -> position) of a token."""
        return token.stream, {self._instance_names[i]: p for i, p in token.instance_positions}

    async def _reached(self, token: StreamToken | TopologicalToken) -> None:
        """Return once this process's positions reach ``token``'s.

        A token ahead of them was not handed out by this stream, unless this
        process is a worker (or one writer of several) still behind another
        writer: then wait for the writers' positions, at most
        ``StoreConfig.token_wait_ms``. ``InvalidToken`` if it stays ahead: a
        client syncing or paginating from it would miss every event up to it.
        A topological token's stream part is an event's position: some
        writer reached it.
        """
        if isinstance(token, TopologicalToken):
            def reached(now: StreamToken) -> bool:
                return token.stream <= now.get_max_stream_pos()
        else:
            def reached(now: StreamToken) -> bool:
                return token.is_before_or_eq(now)
        now = self._now()
        if reached(now):
            return
        generator = self.store.events_stream
        if generator.writers != (self.store.instance_name,):
            if isinstance(token, TopologicalToken):
                targets = [(token.stream, name) for name in generator.writers]
            else:
                default, per_writer = self._per_writer(token)
                targets = [(per_writer.get(name, default), name) for name in generator.writers]
            waits = [generator.wait_for_position(position, name) for position, name in targets]
            waiting = defer.DeferredList(
                waits, fireOnOneCallback=isinstance(token, TopologicalToken), consumeErrors=True
            )
            waiting.addTimeout(self.store.config.token_wait_ms / 1000, self.store.clock)
            try:
                await waiting
            except defer.TimeoutError:
                pass
            finally:
                for d in waits:
                    if not d.called:
                        d.cancel()
            now = self._now()
            if reached(now):
                return
        raise InvalidToken(
            f"token {token.to_string()!r} is ahead of the events stream (now at {now.to_string()!r}):"
            " it was not issued here; sync without a token (an initial sync) for a current one"
        )

    @staticmethod
    def parse_stream_token(token: str) -> StreamToken:
        """An ``s``/``m`` token; ``InvalidToken`` for anything else."""
        if not isinstance(token, str) or token[:1] not in ("s", "m"):
            raise InvalidToken(f"{token!r} is not a stream token ('s<n>' or 'm<n>~<instance>.<pos>...')")
        return StreamToken.parse(token)

    # ------------------------------------------------------------------ users

    def _cached_viewer(self, user_id: str) -> _Viewer:
        """The viewer's nids from the interner caches only (None when not cached)."""
        return _Viewer(
            user_id,
            self.interners.users.cached_nid(user_id),
            self.interners.state_keys.cached_nid((MEMBER, user_id)),
        )

    def _viewer_txn(self, txn: Transaction, viewer: _Viewer) -> _Viewer:
        """Fill in nids the caches lacked (one lookup each, only then)."""
        user_nid, key_nid = viewer.user_nid, viewer.member_key_nid
        if user_nid is None:
            user_nid = self.interners.users.lookup(txn, [viewer.user_id]).get(viewer.user_id)
        if key_nid is None and user_nid is not None:
            key = (MEMBER, viewer.user_id)
            key_nid = self.interners.state_keys.lookup(txn, [key]).get(key)
        return _Viewer(viewer.user_id, user_nid, key_nid)

    # ------------------------------------------------------------------ sync

    async def sync(self, user_id: str, since: str | None, initial_limit: int = 10) -> SyncResult:
        """New events for ``user_id`` after ``since`` up to now; see ``SyncResult``.
        ``since`` None: an initial sync, the newest ``initial_limit`` visible
        events of each joined room (``recent``'s one statement).

        Database cost: none when the change caches show that neither the
        user's joined rooms (the cached rooms-for-user) nor the user's
        memberships changed after ``since``; otherwise exactly one statement,
        however many rooms changed. (Cold caches cost their own lookups: the
        rooms-for-user, the viewer's nids, the instances map.)

        Raises ``InvalidToken`` for a malformed token, a topological token,
        one naming an unknown writer instance, or one ahead of the stream
        (after a bounded wait on a worker: see ``_reached``).
        """
        since_token = None if since is None else self.parse_stream_token(since)
        await self._ensure_instances(since_token)
        if since_token is not None:
            await self._reached(since_token)
        now = self._now()
        joined = await self.store.get_rooms_for_user(user_id)
        if since_token is None:
            # Initial sync: the newest events of every joined room, and the
            # position they were read at to sync on from.
            newest = await self.recent(user_id, max(len(joined), 1), initial_limit)
            rooms = {room_id: [] for room_id in sorted(joined)}
            rooms.update((room_id, events) for room_id, events in newest.rooms if room_id in rooms)
            return SyncResult(newest.token, rooms, [], joined)
        next_token = since_token.copy_and_advance(now)
        since_pos = since_token.stream  # the change caches are linear: the minimum is conservative
        changed = self.store.room_changes.get_entities_changed(joined, since_pos)
        memberships_changed = self.store.membership_changes.has_entity_changed(user_id, since_pos)
        if changed is not None and not changed and not memberships_changed:
            return SyncResult(next_token.to_string(), {}, [], joined)
        if changed is None or len(changed) > MAX_ROOMS_IN_STATEMENT:
            rooms = None  # all joined rooms, selected in SQL
        else:
            rooms = sorted(changed)
        rows = await self.db.run_interaction(
            "sync", self._sync_txn, self._cached_viewer(user_id), rooms, memberships_changed,
            self._per_writer(since_token), self._per_writer(now),
        )
        timelines: dict[str, list[dict]] = {}
        membership_events: list[dict] = []
        for row in rows:
            event = _event_from_row(row)
            in_timeline, is_own = row[EVENT_COLUMN_COUNT], row[EVENT_COLUMN_COUNT + 1]
            if in_timeline:
                timelines.setdefault(row[2], []).append(event)
            if is_own:
                membership_events.append(event)
        return SyncResult(next_token.to_string(), timelines, membership_events, joined)

    def _sync_txn(
        self,
        txn: Transaction,
        viewer: _Viewer,
        rooms: list[str] | None,
        memberships: bool,
        lower: tuple[int, dict[str, int]],
        upper: tuple[int, dict[str, int]],
    ) -> list[tuple]:
        viewer = self._viewer_txn(txn, viewer)
        if viewer.user_nid is None:
            return []  # never a member of anything, never sent anything
        user_nid = viewer.user_nid
        low_sql, low_params = _bound_sql("e", ">", lower[0], lower[1])
        high_sql, high_params = _bound_sql("e", "<=", upper[0], upper[1])
        # The membership tables carry no instance name: bound them by the
        # widest window; the exact per-writer window applies to `e` below.
        low_any = min([lower[0], *lower[1].values()])
        high_any = max([upper[0], *upper[1].values()])

        candidates: list[str] = []
        params: list = []
        if rooms is None:
            room_sql = (
                "e.room_nid IN (SELECT cm.room_nid FROM current_memberships AS cm"
                " WHERE cm.user_nid = ? AND cm.membership = ?)"
            )
            room_params: list = [user_nid, JOIN]
        elif rooms:
            marks = ", ".join("?" for _ in rooms)
            room_sql = f"e.room_nid IN (SELECT rr.room_nid FROM rooms AS rr WHERE rr.room_id IN ({marks}))"
            room_params = list(rooms)
        else:
            room_sql, room_params = "", []
        if room_sql:
            candidates.append(
                "SELECT e.event_nid AS event_nid, 1 AS tl, 0 AS own FROM events AS e"
                f" WHERE {room_sql} AND {low_sql} AND {high_sql}"
            )
            params += room_params + low_params + high_params
        if memberships:
            # Rooms the user left (or was kicked or banned from) in the
            # window: their timeline up to that event, like Synapse's "leave"
            # section; the visibility filter does the rest.
            candidates.append(
                "SELECT e.event_nid AS event_nid, 1 AS tl, 0 AS own FROM events AS e"
                " WHERE e.room_nid IN (SELECT lm.room_nid FROM room_memberships AS lm"
                "   WHERE lm.user_nid = ? AND lm.membership IN (?, ?)"
                "   AND lm.stream_ordering > ? AND lm.stream_ordering <= ?)"
                " AND e.stream_ordering <= (SELECT MAX(lm2.stream_ordering) FROM room_memberships AS lm2"
                "   WHERE lm2.room_nid = e.room_nid AND lm2.user_nid = ? AND lm2.membership IN (?, ?)"
                "   AND lm2.stream_ordering > ? AND lm2.stream_ordering <= ?)"
                f" AND {low_sql} AND {high_sql}"
            )
            params += [user_nid, LEAVE, BAN, low_any, high_any, user_nid, LEAVE, BAN, low_any, high_any]
            params += low_params + high_params
            # The user's own membership events anywhere, always delivered.
            candidates.append(
                "SELECT om.event_nid AS event_nid, 0 AS tl, 1 AS own FROM room_memberships AS om"
                " WHERE om.user_nid = ? AND om.stream_ordering > ? AND om.stream_ordering <= ?"
            )
            params += [user_nid, low_any, high_any]
        if not candidates:
            return []
        vis, _ = visible_sql("e")
        sql = f"""
            SELECT * FROM (
                SELECT {EVENT_COLUMNS},
                    CASE WHEN f.tl = 1 AND e.outlier = ? AND {vis} THEN 1 ELSE 0 END AS in_timeline,
                    f.own AS is_own
                FROM (
                    SELECT u.event_nid AS event_nid, MAX(u.tl) AS tl, MAX(u.own) AS own
                    FROM ({" UNION ALL ".join(candidates)}) AS u
                    GROUP BY u.event_nid
                ) AS f
                JOIN events AS e ON e.event_nid = f.event_nid
                {EVENT_JOINS}
                WHERE e.rejected_reason IS NULL AND {low_sql} AND {high_sql}
            ) AS x
            WHERE x.in_timeline = 1 OR x.is_own = 1
            ORDER BY x.stream"""
        all_params = [False, *viewer.params(), *params, *low_params, *high_params]
        return txn.execute(sql, all_params).fetchall()

    # ------------------------------------------------------------------ recent

    async def recent(self, user_id: str, rooms: int, events: int, from_cursor: str | None = None) -> RecentResult:
        """The ``events`` newest visible events in each of the user's ``rooms``
        most recently active joined rooms; see ``RecentResult``.

        A room's activity is the newest stream ordering of its (non-outlier,
        non-rejected) events, whoever may see them. The first call pins the
        walk to the current position (carried in the cursor): activities are
        measured there, so the walk over rooms neither repeats nor skips a
        room that stays joined, however busy the rooms are meanwhile. One
        statement (a window function ranks each room's visible events).

        Raises ``InvalidToken`` for a malformed cursor, ``ValueError`` for
        ``rooms`` < 1 or ``events`` < 0.
        """
        if rooms < 1 or events < 0:
            raise ValueError(f"recent needs rooms >= 1 and events >= 0, got rooms={rooms}, events={events}")
        after: tuple[int, int] | None = None
        if from_cursor is None:
            await self._ensure_instances()
            pinned = self._now()
        else:
            match = _CURSOR.fullmatch(from_cursor) if isinstance(from_cursor, str) else None
            if match is None:
                raise InvalidToken(f"{from_cursor!r} is not a cursor returned by recent()")
            pinned = self.parse_stream_token(match.group(3))
            await self._ensure_instances(pinned)
            after = (int(match.group(1)), int(match.group(2)))
        rows = await self.db.run_interaction(
            "recent", self._recent_txn, self._cached_viewer(user_id), rooms, events, after, self._per_writer(pinned)
        )
        pages: list[tuple[str, list[dict]]] = []
        last: tuple[int, int] | None = None
        remaining = 0
        for row in rows:
            room_nid, activity, room_id, remaining = row[:4]
            if last != (activity, room_nid):
                pages.append((room_id, []))
                last = (activity, room_nid)
            if row[4] is not None:
                pages[-1][1].append(_event_from_row(row[4:]))
        next_cursor = None
        if last is not None and remaining > rooms:
            next_cursor = f"{last[0]}_{last[1]}_{pinned.to_string()}"
        return RecentResult(pages, next_cursor, pinned.to_string())

    def _recent_txn(
        self,
        txn: Transaction,
        viewer: _Viewer,
        rooms: int,
        events: int,
        after: tuple[int, int] | None,
        upper: tuple[int, dict[str, int]],
    ) -> list[tuple]:
        viewer = self._viewer_txn(txn, viewer)
        if viewer.user_nid is None:
            return []
        high_sql, high_params = _bound_sql("e", "<=", upper[0], upper[1])
        if after is None:
            cursor_sql, cursor_params = "1 = 1", []
            cursor2_sql = "1 = 1"
        else:
            # Keyset over (activity, room_nid), both descending.
            cursor_sql = "(a.activity < ? OR (a.activity = ? AND a.room_nid < ?))"
            cursor2_sql = "(a2.activity < ? OR (a2.activity = ? AND a2.room_nid < ?))"
            cursor_params = [after[0], after[0], after[1]]
        vis, _ = visible_sql("e")
        sql = f"""
            WITH joined AS (
                -- Newest event of each joined room: a backwards walk of the
                -- (room, stream) index that stops at the first match.
                SELECT cm.room_nid AS room_nid, (
                    SELECT e.stream_ordering FROM events AS e
                    WHERE e.room_nid = cm.room_nid AND e.outlier = ? AND e.rejected_reason IS NULL AND {high_sql}
                    ORDER BY e.stream_ordering DESC LIMIT 1) AS activity
                FROM current_memberships AS cm
                WHERE cm.user_nid = ? AND cm.membership = ?
            ), active AS (
                SELECT room_nid, activity FROM joined WHERE activity IS NOT NULL
            ), page AS (
                SELECT a.room_nid AS room_nid, a.activity AS activity FROM active AS a
                WHERE {cursor_sql}
                ORDER BY a.activity DESC, a.room_nid DESC
                LIMIT ?
            ), ranked AS (
                SELECT e.event_nid AS event_nid, e.room_nid AS room_nid,
                       ROW_NUMBER() OVER (PARTITION BY e.room_nid ORDER BY e.stream_ordering DESC) AS rn
                FROM events AS e
                WHERE e.room_nid IN (SELECT pg.room_nid FROM page AS pg)
                  AND e.outlier = ? AND e.rejected_reason IS NULL AND {high_sql} AND {vis}
            )
            SELECT p.room_nid, p.activity, pr.room_id,
                   (SELECT COUNT(*) FROM active AS a2 WHERE {cursor2_sql}) AS remaining,
                   {EVENT_COLUMNS}
            FROM page AS p
            JOIN rooms AS pr ON pr.room_nid = p.room_nid
            LEFT JOIN ranked AS k ON k.room_nid = p.room_nid AND k.rn <= ?
            LEFT JOIN events AS e ON e.event_nid = k.event_nid
            LEFT JOIN event_json AS j ON j.event_nid = e.event_nid
            LEFT JOIN event_ids AS i ON i.event_nid = e.event_nid
            LEFT JOIN rooms AS r ON r.room_nid = e.room_nid
            ORDER BY p.activity DESC, p.room_nid DESC, e.stream_ordering ASC"""
        params = [
            False, *high_params, viewer.user_nid, JOIN,
            *cursor_params, rooms,
            False, *high_params, *viewer.params(),
            *cursor_params,
            events,
        ]
        return txn.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ pagination

    async def paginate(
        self, room_id: str, user_id: str, from_token: str | None, direction: str, limit: int
    ) -> PaginationResult:
        """A page of ``room_id`` as ``user_id`` may see it, in topological order.

        ``direction`` ``"b"`` walks back (newest first), ``"f"`` forwards.
        ``from_token``: a ``t<topo>-<stream>`` token (a position between
        events), a stream token (converted to the topological position just
        after the last event, in topological order, of those at or before it:
        forwards from it come only events after it in stream order), or None
        (the end for ``"b"``, the start for ``"f"``). Events not yet complete
        in the events stream are never served. ``next_token`` continues from
        just past the last event returned.

        Raises ``InvalidToken`` for a bad token or one ahead of the stream
        (after a bounded wait on a worker), ``ValueError`` for a bad
        direction or ``limit`` < 1.
        """
        if direction not in ("b", "f"):
            raise ValueError(f"direction must be 'b' or 'f', not {direction!r}")
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, not {limit!r}")
        start: TopologicalToken | StreamToken | None = None
        if from_token is not None:
            if isinstance(from_token, str) and from_token.startswith("t"):
                start = TopologicalToken.parse(from_token)
            else:
                start = self.parse_stream_token(from_token)
        await self._ensure_instances(start if isinstance(start, StreamToken) else None)
        if start is not None:
            await self._reached(start)
        now = self._per_writer(self._now())
        stream_start = self._per_writer(start) if isinstance(start, StreamToken) else None
        rows = await self.db.run_interaction(
            "paginate", self._paginate_txn, room_id, self._cached_viewer(user_id),
            start if isinstance(start, TopologicalToken) else None, stream_start, direction, limit, now,
        )
        events = [_event_from_row(row) for row in rows]
        if not rows:
            return PaginationResult([], None)
        topo, stream = rows[-1][3], rows[-1][4]
        # Backwards, the next page starts just before the last event's key.
        next_token = TopologicalToken(topo, stream - 1 if direction == "b" else stream)
        return PaginationResult(events, next_token.to_string())

    def _paginate_txn(
        self,
        txn: Transaction,
        room_id: str,
        viewer: _Viewer,
        start: TopologicalToken | None,
        stream_start: tuple[int, dict[str, int]] | None,
        direction: str,
        limit: int,
        upper: tuple[int, dict[str, int]],
    ) -> list[tuple]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        viewer = self._viewer_txn(txn, viewer)
        high_sql, high_params = _bound_sql("e", "<=", upper[0], upper[1])
        key: tuple[int, int] | None = None if start is None else start.as_tuple()
        if stream_start is not None:
            # The newest key, in topological order, of the events at or
            # before the stream position.
            at_sql, at_params = _bound_sql("e", "<=", stream_start[0], stream_start[1])
            row = txn.execute(
                "SELECT e.topological_ordering, e.stream_ordering FROM events AS e"
                f" WHERE e.room_nid = ? AND e.outlier = ? AND {at_sql}"
                " ORDER BY e.topological_ordering DESC, e.stream_ordering DESC LIMIT 1",
                [room_nid, False, *at_params],
            ).fetchone()
            if row is None:
                if direction == "b":
                    return []  # nothing at or before it
                key = None  # forwards from before the first event
            else:
                key = (row[0], row[1])
        if key is None:
            bound_sql, bound_params = "1 = 1", []
        elif direction == "b":
            # Row values: both engines start the index walk at the key itself
            # (the equivalent OR of comparisons made SQLite walk from the end
            # of the room every page).
            bound_sql = "(e.topological_ordering, e.stream_ordering) <= (?, ?)"
            bound_params = [key[0], key[1]]
        else:
            bound_sql = "(e.topological_ordering, e.stream_ordering) > (?, ?)"
            bound_params = [key[0], key[1]]
        order = "DESC" if direction == "b" else "ASC"
        # The stream bound must not pick the (room, stream) index: walking the
        # (room, topological) index in ORDER BY order stops after ``limit``
        # visible events, where the stream index made the database test the
        # visibility of every event of the room, then sort them
        # (bench/timeline_reads.py). Unary plus: a numeric no-op on both
        # engines that no index matches.
        high_sql = high_sql.replace("e.stream_ordering", "+e.stream_ordering")
        vis, _ = visible_sql("e")
        sql = f"""
            SELECT {EVENT_COLUMNS}
            FROM events AS e {EVENT_JOINS}
            WHERE e.room_nid = ? AND e.outlier = ? AND e.rejected_reason IS NULL
              AND {high_sql} AND {bound_sql} AND {vis}
            ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
            LIMIT ?"""
        params = [room_nid, False, *high_params, *bound_params, *viewer.params(), limit]
        return txn.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ one event

    async def is_visible(self, user_id: str, event_id: str) -> bool:
        """May ``user_id`` see ``event_id``, by the same SQL predicate the
        timelines use? False for unknown, outlier and rejected events."""
        return await self.db.run_interaction(
            "is_visible", self._is_visible_txn, self._cached_viewer(user_id), event_id
        )

    def _is_visible_txn(self, txn: Transaction, viewer: _Viewer, event_id: str) -> bool:
        viewer = self._viewer_txn(txn, viewer)
        vis, _ = visible_sql("e")
        row = txn.execute(
            f"SELECT CASE WHEN {vis} THEN 1 ELSE 0 END FROM events AS e"
            " WHERE e.event_nid = (SELECT ei.event_nid FROM event_ids AS ei WHERE ei.event_id = ?)"
            " AND e.outlier = ? AND e.rejected_reason IS NULL",
            [*viewer.params(), event_id, False],
        ).fetchone()
        return bool(row and row[0])

    # ------------------------------------------------------------------ federation

    async def backfill(self, room_id: str, event_ids: Sequence[str], limit: int) -> list[dict]:
        """Up to ``limit`` events of ``room_id`` from ``event_ids`` (inclusive)
        backwards, in topological order (oldest first).

        Breadth first over prev events with a priority queue on depth, the
        deepest first (Synapse's ``get_backfill_events``): since an event is
        deeper than its prev events, these are the ``limit`` deepest events
        at or before the given ones. Given events not in the room, unknown or
        outliers are ignored; rejected events are walked through but not
        returned (and do not count towards ``limit``).
        """
        if limit <= 0 or not event_ids:
            return []
        return await self.db.run_interaction("backfill", self._backfill_txn, room_id, list(event_ids), limit)

    def _backfill_txn(self, txn: Transaction, room_id: str, event_ids: list[str], limit: int) -> list[dict]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        walk = _GraphWalk(txn, room_nid)
        for nid, facts in walk.graph_events(self.interners.events.lookup(txn, event_ids).values()).items():
            walk.push(nid, facts)
        result: list[int] = []
        while walk.heap and len(result) < limit:
            nid = walk.pop()
            if not walk.facts[nid].rejected:
                result.append(nid)
            for prev in walk.prevs_of(nid):
                if prev not in walk.facts_seen:
                    walk.push(prev, walk.facts[prev])
        return self._events_in_order(txn, walk, result)

    async def get_missing_events(
        self, room_id: str, earliest_events: Sequence[str], latest_events: Sequence[str], limit: int
    ) -> list[dict]:
        """Events a server lacks between what it has and what it got, in
        topological order (oldest first), at most ``limit`` of them.

        These are the ancestors of ``latest_events`` (the events themselves
        excluded: the asking server has them) that are neither one of
        ``earliest_events`` nor an ancestor of one (the asking server has
        those too). Walked from the latest events deepest first, so with
        ``limit`` the ones nearest ``latest_events`` come back (Synapse's
        walk, which stops at the earliest events; this one also never strays
        into their history through another branch). Relies on events being
        deeper than their prev events, as depth is defined. Unknown events,
        outliers and events of other rooms are ignored; rejected events are
        walked through but not returned.
        """
        if limit <= 0 or not latest_events:
            return []
        return await self.db.run_interaction(
            "get_missing_events", self._missing_txn, room_id, list(earliest_events), list(latest_events), limit
        )

    def _missing_txn(
        self, txn: Transaction, room_id: str, earliest: list[str], latest: list[str], limit: int
    ) -> list[dict]:
        room_nid = self.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        nids = self.interners.events.lookup(txn, [*earliest, *latest])
        earliest_nids = {nids[e] for e in earliest if e in nids}
        latest_nids = {nids[e] for e in latest if e in nids}
        walk = _GraphWalk(txn, room_nid)
        # excluded[n]: n is an earliest event or an ancestor of one. Set from
        # children as they are popped: deepest first, every child of n is
        # popped before n, so it is final when n is popped.
        excluded: dict[int, bool] = {}
        candidates = 0  # queued nodes not (yet) known to be excluded
        for nid, facts in walk.graph_events(earliest_nids | latest_nids).items():
            excluded[nid] = nid in earliest_nids
            candidates += not excluded[nid]
            walk.push(nid, facts)
        result: list[int] = []
        while walk.heap and candidates and len(result) < limit:
            nid = walk.pop()
            if not excluded[nid]:
                candidates -= 1
                if nid not in latest_nids and not walk.facts[nid].rejected:
                    result.append(nid)
            for prev in walk.prevs_of(nid):
                if prev not in walk.facts_seen:
                    excluded[prev] = excluded[nid]
                    candidates += not excluded[prev]
                    walk.push(prev, walk.facts[prev])
                elif excluded[nid] and not excluded[prev] and not walk.popped(prev):
                    excluded[prev] = True
                    candidates -= 1
        return self._events_in_order(txn, walk, result)

    def _events_in_order(self, txn: Transaction, walk: "_GraphWalk", nids: list[int]) -> list[dict]:
        if not nids:
            return []
        ids = self.interners.events.resolve(txn, nids)
        events = self.store.reader.events_txn(txn, [ids[n] for n in nids])
        ordered = sorted(nids, key=lambda n: (walk.facts[n].topo, walk.facts[n].stream))
        return [events[ids[n]] for n in ordered if ids[n] in events]


@attrs.frozen
class _Facts:
    topo: int
    stream: int
    rejected: bool


class _GraphWalk:
    """A deepest-first walk over one room's stored, non-outlier events.

    Prev edges are loaded in batches: whenever a popped event's prev events
    are needed, those of every queued event not loaded yet come with them,
    so a walk costs a statement per layer of the graph, not per event.
    """

    def __init__(self, txn: Transaction, room_nid: int):
        self.txn = txn
        self.room_nid = room_nid
        self.heap: list[tuple[int, int, int]] = []
        self.facts: dict[int, _Facts] = {}
        self.facts_seen: set[int] = set()  # pushed at some point
        self._popped: set[int] = set()
        self._prevs: dict[int, list[int]] = {}

    def graph_events(self, nids: Iterable[int]) -> dict[int, _Facts]:
        """Facts of those ``nids`` that are stored non-outlier events of the room."""
        found: dict[int, _Facts] = {}
        for part in chunks(sorted(set(nids))):
            marks = ", ".join("?" for _ in part)
            for nid, topo, stream, rejected in self.txn.execute(
                "SELECT e.event_nid, e.topological_ordering, e.stream_ordering, e.rejected_reason"
                f" FROM events AS e WHERE e.event_nid IN ({marks}) AND e.room_nid = ? AND e.outlier = ?",
                [*part, self.room_nid, False],
            ).fetchall():
                found[nid] = _Facts(topo, stream, rejected is not None)
        self.facts.update(found)
        return found

    def push(self, nid: int, facts: _Facts) -> None:
        self.facts_seen.add(nid)
        heapq.heappush(self.heap, (-facts.topo, -facts.stream, nid))

    def pop(self) -> int:
        nid = heapq.heappop(self.heap)[2]
        self._popped.add(nid)
        return nid

    def popped(self, nid: int) -> bool:
        return nid in self._popped

    def prevs_of(self, nid: int) -> list[int]:
        """``nid``'s prev events that are stored non-outlier events of the room."""
        if nid not in self._prevs:
            batch = [nid] + [n for _, _, n in self.heap if n not in self._prevs and n != nid]
            self._load_prevs(batch[:500])
        return self._prevs[nid]

    def _load_prevs(self, nids: list[int]) -> None:
        for nid in nids:
            self._prevs[nid] = []
        marks = ", ".join("?" for _ in nids)
        for child, prev, topo, stream, rejected in self.txn.execute(
            "SELECT ed.event_nid, p.event_nid, p.topological_ordering, p.stream_ordering, p.rejected_reason"
            " FROM event_edges AS ed JOIN events AS p ON p.event_nid = ed.prev_event_nid"
            f" WHERE ed.event_nid IN ({marks}) AND p.room_nid = ? AND p.outlier = ?"
            " ORDER BY ed.event_nid, p.event_nid",
            [*nids, self.room_nid, False],
        ).fetchall():
            self._prevs[child].append(prev)
            self.facts.setdefault(prev, _Facts(topo, stream, rejected is not None))
