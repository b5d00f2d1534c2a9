"""Sync: what changed for a user since a stream token, per room as a
client-server ``/sync`` serves it (timeline, ``limited``, ``prev_batch``,
state block), and the user's own membership events anywhere.

``SyncReader.sync`` reads the window's events in one statement (an initial
sync: ``TimelineReader.recent``'s one statement), the newest ``limit`` a
room; then, in one transaction, the pagination keys of the timelines and
the state groups of their state blocks (``roomstore.events.sync_state``),
whose events come through the event cache. Visibility, orders and tokens
are the timeline reads' (``roomstore.events.timeline``).

Who calls it: ``RoomStore.sync``. What it may call: the ``TimelineReader``
it is handed (database, interners, read positions, event reader, change
caches) and the SQL pieces of the tables' owners.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import attrs

from roomstore.events.sync_state import RoomTimeline, plan_state, room_timelines
from roomstore.events.tables.events.timeline_reads import sync_candidates_sql, sync_sql
from roomstore.events.tables.room_state import joined_room_nids_sql
from roomstore.events.timeline import (
    EVENT_COLUMN_COUNT,
    TimelineReader,
    Viewer,
    event_from_row,
    stream_bound_sql,
)
from roomstore.storage.database import Transaction
from roomstore.storage.interning import room_nids_sql
from roomstore.visibility.codes import MEMBERSHIP_CODES
from roomstore.visibility.memberships import left_rooms_sql, left_upto_sql, own_membership_events_sql

__all__ = ["RoomTimeline", "SyncReader", "SyncResult"]

JOIN = MEMBERSHIP_CODES["join"]
LEAVE = MEMBERSHIP_CODES["leave"]
BAN = MEMBERSHIP_CODES["ban"]

#: Sync passes the changed rooms by ID in the statement up to this many;
#: beyond it (or when the change cache cannot tell) it selects the user's
#: joined rooms in SQL instead, so the statement stays small.
MAX_ROOMS_IN_STATEMENT = 1000

#: A room's timeline rows when no limit is asked: more than any room holds.
NO_LIMIT = 2**62


@attrs.frozen
class SyncResult:
    """What changed for a user between two stream positions.

    ``next_token``: the stream token to pass as ``since`` next time (never
    behind the ``since`` given). ``rooms``: room ID -> visible events in
    stream order, for the rooms the user is joined to that have new events,
    and for rooms the user left, was kicked or banned from in the window (up
    to and including that membership event); on an initial sync (``since``
    None) every joined room with its newest visible events, oldest first
    (an empty list when the user may see none); with ``full_state`` every
    joined room too. Each room's list is its ``timelines`` entry's
    ``events``: the newest ``limit`` (initial: ``initial_limit``) of the
    window's. ``timelines``: room ID -> ``RoomTimeline``, for the same rooms.
    ``membership_events``: every one of the user's own membership events in
    the window, in any room and in stream order, whatever the history
    visibility and the limit (invites to rooms they never joined, kicks,
    bans, leaves, joins); outliers included, since an invite from another
    server arrives as one. ``joined``: the rooms the user is joined to now.
    """

    next_token: str
    rooms: dict[str, list[dict]]
    membership_events: list[dict]
    joined: frozenset[str]
    timelines: dict[str, RoomTimeline] = attrs.field(factory=dict)

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
            room_id: event
            for room_id, event in newest.items()
            if (event.get("content") or {}).get("membership") in memberships
        }


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be an int >= 0, not {value!r}")


def _sync_candidates(
    user_nid: int,
    rooms: list[str] | None,
    memberships: bool,
    lower: tuple[int, dict[str, int]],
    upper: tuple[int, dict[str, int]],
    window: tuple[str, list],
) -> tuple[list[str], list]:
    """Sync's candidate rows ``(event_nid, tl, own)`` as SELECTs to UNION,
    and their parameters: new events of the rooms (``rooms``, or the joined
    rooms in SQL when None), and with ``memberships`` the rooms left in the
    window and the user's own membership events. ``window``: the per-writer
    stream window on ``e`` (SQL, parameters)."""
    window_sql, window_params = window
    # The membership tables carry no instance name: bound them by the
    # widest window; the exact per-writer window applies to `e`.
    low_any = min([lower[0], *lower[1].values()])
    high_any = max([upper[0], *upper[1].values()])
    candidates: list[str] = []
    params: list = []
    if rooms is None:
        room_sql = f"e.room_nid IN ({joined_room_nids_sql('cm')})"
        room_params: list = [user_nid, JOIN]
    elif rooms:
        room_sql = f"e.room_nid IN ({room_nids_sql('rr', len(rooms))})"
        room_params = list(rooms)
    else:
        room_sql, room_params = "", []
    if room_sql:
        candidates.append(sync_candidates_sql(f"{room_sql} AND {window_sql}"))
        params += room_params + window_params
    if memberships:
        # Rooms the user left (or was kicked or banned from) in the
        # window: their timeline up to that event, like Synapse's "leave"
        # section; the visibility filter does the rest.
        candidates.append(sync_candidates_sql(f"{left_rooms_sql('e')} AND {left_upto_sql('e')} AND {window_sql}"))
        params += [user_nid, LEAVE, BAN, low_any, high_any, user_nid, LEAVE, BAN, low_any, high_any]
        params += window_params
        # The user's own membership events anywhere, always delivered.
        candidates.append(own_membership_events_sql())
        params += [user_nid, low_any, high_any]
    return candidates, params


def _window_of_rows(
    rows: list[tuple], empty_rooms: Iterable[str]
) -> tuple[dict[str, list[dict]], list[dict], dict[str, tuple[int, int]]]:
    """The sync statement's rows sorted out: each room's events in the window (``empty_rooms`` listed even with
    none), the user's own membership events, and each windowed event's ordering key by event ID."""
    window: dict[str, list[dict]] = {room_id: [] for room_id in empty_rooms}
    membership_events: list[dict] = []
    keys: dict[str, tuple[int, int]] = {}
    for row in rows:
        event = event_from_row(row)
        in_page, is_own = row[EVENT_COLUMN_COUNT], row[EVENT_COLUMN_COUNT + 1]
        if in_page:
            window.setdefault(row[2], []).append(event)
            keys[row[1]] = (row[3], row[4])
        if is_own:
            membership_events.append(event)
    return window, membership_events, keys


@attrs.frozen
class SyncReader:
    """Sync; see the module docstring. ``timeline``: the reader whose
    collaborators and statements it uses."""

    timeline: TimelineReader

    async def sync(
        self,
        user_id: str,
        since: str | None,
        initial_limit: int = 10,
        limit: int | None = None,
        full_state: bool = False,
    ) -> SyncResult:
        """New events for ``user_id`` after ``since`` up to now; see ``SyncResult``.
        ``since`` None: an initial sync, the newest ``initial_limit`` visible
        events of each joined room (``recent``'s one statement); otherwise the
        newest ``limit`` (None: all) of each room's window.

        Database cost: none when the change caches show that neither the
        user's joined rooms (the cached rooms-for-user) nor the user's
        memberships changed after ``since`` (and no ``full_state``);
        otherwise one statement, however many rooms changed, and one
        transaction for the timelines' keys and state blocks. (Cold caches
        cost their own lookups: the rooms-for-user, the viewer's nids, the
        instances map, the state events.)

        Raises ``InvalidToken`` for a malformed token, a topological token,
        one naming an unknown writer instance, or one ahead of the stream
        (after a bounded wait on a worker: see ``ReadPositions.reach``);
        ``ValueError`` for a limit that is not an int >= 0.
        """
        _check_limit("initial_limit", initial_limit)
        _check_limit("limit", limit)
        positions = self.timeline.positions
        since_token = None if since is None else positions.parse_stream_token(since)
        await positions.ensure_instances(since_token)
        if since_token is not None:
            await positions.reach(since_token)
        now = positions.now()
        joined = await self.timeline.events.get_rooms_for_user(user_id)
        if since_token is None:
            return await self._initial(user_id, joined, initial_limit)
        next_token = since_token.copy_and_advance(now)
        since_pos = since_token.stream  # the change caches are linear: the minimum is conservative
        changed = self.timeline.room_changes.get_entities_changed(joined, since_pos)
        memberships_changed = self.timeline.membership_changes.has_entity_changed(user_id, since_pos)
        if changed is not None and not changed and not memberships_changed and not full_state:
            return SyncResult(next_token.to_string(), {}, [], joined)
        if changed is None or len(changed) > MAX_ROOMS_IN_STATEMENT:
            rooms = None  # all joined rooms, selected in SQL
        else:
            rooms = sorted(cast("set[str]", changed))  # the cache's entities are room IDs
        rows = []
        if changed is None or changed or memberships_changed:
            rows = await self.timeline.db.run_interaction(
                "sync",
                self._sync_txn,
                self.timeline.cached_viewer(user_id),
                rooms,
                memberships_changed,
                positions.per_writer(since_token),
                positions.per_writer(now),
                NO_LIMIT if limit is None else limit + 1,
            )
        window, membership_events, keys = _window_of_rows(rows, sorted(joined) if full_state else ())
        newly_joined = {
            event["room_id"]
            for event in membership_events
            if event.get("state_key") == user_id and (event.get("content") or {}).get("membership") == "join"
        }
        plans = {
            room_id: plan_state(room_id, events, limit, full_state or room_id in newly_joined)
            for room_id, events in window.items()
        }
        timelines = await room_timelines(self.timeline, plans, next_token.to_string(), since_token, keys)
        rooms_out = {room_id: timeline.events for room_id, timeline in timelines.items()}
        return SyncResult(next_token.to_string(), rooms_out, membership_events, joined, timelines)

    async def _initial(self, user_id: str, joined: frozenset[str], initial_limit: int) -> SyncResult:
        """The newest events of every joined room (one more, which says
        whether the timeline is limited), with each room's full state."""
        newest = await self.timeline.recent(user_id, max(len(joined), 1), initial_limit + 1)
        window: dict[str, list[dict]] = {room_id: [] for room_id in sorted(joined)}
        window.update((room_id, events) for room_id, events in newest.rooms if room_id in window)
        plans = {room_id: plan_state(room_id, events, initial_limit, True) for room_id, events in window.items()}
        timelines = await room_timelines(self.timeline, plans, newest.token, None)
        rooms = {room_id: timeline.events for room_id, timeline in timelines.items()}
        return SyncResult(newest.token, rooms, [], joined, timelines)

    def _sync_txn(
        self,
        txn: Transaction,
        viewer: Viewer,
        rooms: list[str] | None,
        memberships: bool,
        lower: tuple[int, dict[str, int]],
        upper: tuple[int, dict[str, int]],
        per_room: int,
    ) -> list[tuple]:
        """Sync's one statement: the candidate events (``_sync_candidates``),
        then the served columns of each room's newest ``per_room`` visible
        ones and of the user's own membership events, with the flags
        ``in_page`` and ``is_own``, in stream order."""
        viewer = self.timeline.viewer_txn(txn, viewer)
        if viewer.user_nid is None:
            return []  # never a member of anything, never sent anything
        low_sql, low_params = stream_bound_sql("e", ">", lower[0], lower[1])
        high_sql, high_params = stream_bound_sql("e", "<=", upper[0], upper[1])
        window = f"{low_sql} AND {high_sql}", low_params + high_params
        candidates, params = _sync_candidates(viewer.user_nid, rooms, memberships, lower, upper, window)
        if not candidates:
            return []
        sql = sync_sql(candidates, low_sql, high_sql)
        all_params = [False, *viewer.params(), *params, *low_params, *high_params, per_room, per_room]
        return txn.execute(sql, all_params).fetchall()
