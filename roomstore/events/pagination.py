"""Pagination: a page of a room's timeline, backwards or forwards.

``Paginator.paginate`` serves ``/messages``: the events of a room a viewer
may see, in topological order ``(topological_ordering, stream_ordering)``,
from a token. A token ``t<topo>-<stream>`` is the position just after the
event key ``(topo, stream)``: going backwards from it yields keys at or
below it, going forwards keys above it. Keys are integers and unique
(stream orderings are), so ``(topo, stream - 1)`` is the position just
before ``(topo, stream)``: pages neither repeat nor skip events. A page is
one ``run_interaction`` and one statement, which also fetches the events'
bytes; events come back as ``TimelineReader``'s reads return them, through
the same visibility rules (see ``roomstore.events.timeline``).

Who calls it: ``RoomStore.paginate``. What it may call: the
``TimelineReader`` it is handed, for the database, the interners, the read
positions and the viewer's nids.
"""

from __future__ import annotations

import attrs

from roomstore.events.tables.events import events_as, join_events
from roomstore.events.timeline import (
    EVENT_COLUMNS,
    EVENT_JOINS,
    TimelineReader,
    Viewer,
    event_from_row,
    stream_bound_sql,
)
from roomstore.events.tokens import StreamToken, TopologicalToken
from roomstore.storage.database import Transaction
from roomstore.visibility.snapshots import snapshot_upto_sql, visible_sql

__all__ = ["PaginationResult", "Paginator"]


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


@attrs.frozen
class Paginator:
    """Pages of rooms' timelines; see the module docstring.

    ``timeline``: the reader whose collaborators (database, interners, read
    positions) and viewer lookups a page uses.
    """

    timeline: TimelineReader
    #: A page tests events one by one up to ``limit`` + this many from its
    #: key, and only beyond them goes by snapshots (see ``_paginate_txn``);
    #: tests set it to 0 (``attrs.evolve``) to take that path on most pages.
    pagination_slack: int = 40

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
        positions = self.timeline.positions
        start: TopologicalToken | StreamToken | None = None
        if from_token is not None:
            if isinstance(from_token, str) and from_token.startswith("t"):
                start = TopologicalToken.parse(from_token)
            else:
                start = positions.parse_stream_token(from_token)
        await positions.ensure_instances(start if isinstance(start, StreamToken) else None)
        if start is not None:
            await positions.reach(start)
        now = positions.per_writer(positions.now())
        stream_start = positions.per_writer(start) if isinstance(start, StreamToken) else None
        rows = await self.timeline.db.run_interaction(
            "paginate",
            self._paginate_txn,
            room_id,
            self.timeline.cached_viewer(user_id),
            start if isinstance(start, TopologicalToken) else None,
            stream_start,
            direction,
            limit,
            now,
        )
        events = [event_from_row(row) for row in rows]
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
        viewer: Viewer,
        start: TopologicalToken | None,
        stream_start: tuple[int, dict[str, int]] | None,
        direction: str,
        limit: int,
        upper: tuple[int, dict[str, int]],
    ) -> list[tuple]:
        """The page's rows (``EVENT_COLUMNS``): the room and the viewer's
        nids, the key to start from, then one statement (``page_sql``)."""
        room_nid = self.timeline.interners.rooms.lookup(txn, [room_id]).get(room_id)
        if room_nid is None:
            return []
        viewer = self.timeline.viewer_txn(txn, viewer)
        key = self._start_key(txn, room_nid, start, stream_start, direction)
        if key is None:
            return []
        high_sql, high_params = stream_bound_sql("e", "<=", upper[0], upper[1])
        sql = page_sql(direction, high_sql, txn.engine.lateral_joins)
        window = limit + self.pagination_slack
        user_nid = viewer.user_nid if viewer.user_nid is not None else -1
        own_key = viewer.member_key_nid if viewer.member_key_nid is not None else -1
        search_params = [False, *high_params, limit]
        params = [
            room_nid,
            *key,
            window - 1,  # edge
            room_nid,
            False,
            *high_params,
            *key,
            *viewer.params(),
            limit,  # hit
            room_nid,
            user_nid,
            user_nid,
            room_nid,
            limit,  # seen
            *search_params,  # more, by visibility_before
            own_key,
            *search_params,  # more, by visibility_after
            limit,  # page: more
            limit,
        ]
        return txn.execute(sql, params, prepare=True).fetchall()

    def _start_key(
        self,
        txn: Transaction,
        room_nid: int,
        start: TopologicalToken | None,
        stream_start: tuple[int, dict[str, int]] | None,
        direction: str,
    ) -> tuple[int, int] | None:
        """The event key the page starts from; None: the page is empty."""
        key: tuple[int, int] | None = None if start is None else start.as_tuple()
        if stream_start is not None:
            row = newest_key_at_txn(txn, room_nid, stream_start)
            if row is None:
                if direction == "b":
                    return None  # nothing at or before it
                key = None  # forwards from before the first event
            else:
                key = (row[0], row[1])
        if key is None:
            # From the end (or start) of the room: still a bound on the key, so
            # that PostgreSQL, before it has statistics of the room, walks the
            # (room, topological) index in order rather than reading the whole
            # room through the (room, stream) index to sort it.
            key = (2**63 - 1, 2**63 - 1) if direction == "b" else (-(2**63), -(2**63))
        return key


def newest_key_at_txn(txn: Transaction, room_nid: int, stream_start: tuple[int, dict[str, int]]) -> tuple | None:
    """The newest key ``(topo, stream)``, in topological order, of the room's
    graph events at or before the stream position ``(stream, per writer)``:
    where a stream token stands in the room's topological order (None: no
    event at or before it)."""
    at_sql, at_params = stream_bound_sql("e", "<=", stream_start[0], stream_start[1])
    return txn.execute(
        f"SELECT e.topological_ordering, e.stream_ordering FROM {events_as('e')}"
        f" WHERE e.room_nid = ? AND e.outlier = ? AND {at_sql}"
        " ORDER BY e.topological_ordering DESC, e.stream_ordering DESC LIMIT 1",
        [room_nid, False, *at_params],
    ).fetchone()


def page_sql(direction: str, high_sql: str, lateral_joins: bool) -> str:
    """The statement of a page (see ``_paginate_txn`` for its parameters).

    One statement, two parts.
    (1) ``edge``: the key of the ``window``-th event from the key (any
    event; the walk reads the (room, topological) index alone), absent
    when fewer lie that way. ``hit``: each event from the key tested by
    ``visible_sql`` in index order until ``limit`` are found, but not
    past the edge. A page of events the viewer may see is this part
    alone, at the cost of a plain walk.
    (2) Only when that leaves the page short and the edge exists (more
    events lie beyond it): ``more``, the visible events beyond the
    edge, found through the room's snapshots at which the viewer may
    see some event (``seen``, with the stream ordering ``upto`` below
    which they may: ``snapshot_upto_sql``), each searched on the
    (visibility_before|visibility_after, topological) indexes for its
    first ``limit`` events beyond the edge (``_per_snapshot``). A long run
    of events the viewer may not see then costs nothing per event. Both
    parts apply the same rule; the snapshots are searched one by one, not
    as runs, so forks that interleave snapshots cannot hide a visible event.
    """
    if direction == "b":
        # Row values: both engines start the index walk at the key itself
        # (the equivalent OR of comparisons made SQLite walk from the end
        # of the room every page).
        bound_sql = "(e.topological_ordering, e.stream_ordering) <= (?, ?)"
    else:
        bound_sql = "(e.topological_ordering, e.stream_ordering) > (?, ?)"
    order = "DESC" if direction == "b" else "ASC"
    within = ">=" if direction == "b" else "<="
    far = -(2**63) if direction == "b" else 2**63 - 1
    # The stream bound must not pick the (room, stream) index: walking the
    # (room, topological) index in ORDER BY order stops after the page or
    # at the window's edge, where the stream index made the database test
    # the visibility of every event of the room, then sort them
    # (bench/timeline_reads.py). Unary plus: a numeric no-op on both
    # engines that no index matches.
    high_sql = high_sql.replace("e.stream_ordering", "+e.stream_ordering")
    vis, _ = visible_sql("e")
    gate = "(SELECT COUNT(*) FROM hit) < ? AND EXISTS (SELECT 1 FROM edge)"
    edge_sql = f"""(COALESCE((SELECT g.topo FROM edge AS g), {far}),
                        COALESCE((SELECT g.stream FROM edge AS g), {far}))"""
    own = "(e.type = 'm.room.history_visibility' OR e.type_key_nid = ?)"
    # An event found by its snapshot before is not searched for again
    # by its snapshot after (UNION ALL: SQLite's UNION cost 0.3 ms a
    # page even when both halves are empty).
    after_only = f"""AND e.visibility_before IS NOT NULL AND {own}
                  AND NOT EXISTS (SELECT 1 FROM seen AS sb WHERE sb.snapshot_nid = e.visibility_before
                      AND e.stream_ordering < sb.upto)"""
    before_search = _per_snapshot("visibility_before", "", direction, high_sql, lateral_joins)
    after_search = _per_snapshot("visibility_after", after_only, direction, high_sql, lateral_joins)
    # ``page``: every event of ``more`` lies beyond every event of
    # ``hit``. Unary plus in the ORDER BYs over it: SQLite otherwise
    # pushes the order into the arms of the compound and plans them anew,
    # which cost 0.35 ms a page even with ``more`` empty.
    return f"""
            WITH edge AS (
                SELECT e.topological_ordering AS topo, e.stream_ordering AS stream
                FROM {events_as("e")}
                WHERE e.room_nid = ? AND {bound_sql}
                ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
                LIMIT 1 OFFSET ?
            ), hit AS (
                SELECT e.event_nid AS event_nid, e.topological_ordering AS topo, e.stream_ordering AS stream
                FROM {events_as("e")}
                WHERE e.room_nid = ? AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed
                  AND {high_sql} AND {bound_sql}
                  AND (e.topological_ordering, e.stream_ordering) {within} {edge_sql}
                  AND {vis}
                ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
                LIMIT ?
            ), seen AS (
                {snapshot_upto_sql(f"cs.room_nid = ? AND {gate}")}
            ), more AS (
                {before_search}
                UNION ALL
                {after_search}
            ), page AS (
                SELECT h.event_nid AS event_nid, h.topo AS topo, h.stream AS stream FROM hit AS h
                UNION ALL
                SELECT m.event_nid AS event_nid, m.topo AS topo, m.stream AS stream FROM (
                    SELECT mm.event_nid AS event_nid, mm.topo AS topo, mm.stream AS stream FROM more AS mm
                    ORDER BY +mm.topo {order}, +mm.stream {order}
                    LIMIT ?) AS m
            )
            SELECT {EVENT_COLUMNS}
            FROM page AS p {join_events("e", "e.event_nid = p.event_nid")} {EVENT_JOINS}
            ORDER BY +p.topo {order}, +p.stream {order}
            LIMIT ?"""


def _per_snapshot(column: str, extra: str, direction: str, high_sql: str, lateral_joins: bool) -> str:
    """The first ``limit`` visible events beyond the edge ``g`` whose
    ``column`` is the seen snapshot ``s``."""
    order = "DESC" if direction == "b" else "ASC"
    beyond = "<" if direction == "b" else ">"
    search = f"""FROM {events_as("e")}
                WHERE e.{column} = s.snapshot_nid {extra}
                  AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed AND {high_sql}
                  AND (e.topological_ordering, e.stream_ordering) {beyond} (g.topo, g.stream)
                  AND e.stream_ordering < s.upto
                ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
                LIMIT ?"""
    if lateral_joins:
        return (
            "SELECT x.event_nid AS event_nid, x.topo AS topo, x.stream AS stream"
            " FROM seen AS s CROSS JOIN edge AS g CROSS JOIN LATERAL (SELECT e.event_nid AS event_nid,"
            f" e.topological_ordering AS topo, e.stream_ordering AS stream {search}) AS x"
        )
    # Without LATERAL: the same search as a correlated IN, run once
    # per seen snapshot.
    return (
        "SELECT y.event_nid AS event_nid, y.topological_ordering AS topo, y.stream_ordering AS stream"
        f" FROM seen AS s CROSS JOIN edge AS g CROSS JOIN {events_as('y')}"
        f" WHERE y.event_nid IN (SELECT e.event_nid {search})"
    )
