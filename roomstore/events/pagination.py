"""Pagination: a page of a room's timeline, backwards or forwards.

``Paginator.paginate`` serves ``/messages``: the events of a room a viewer
may see, in topological order ``(topological_ordering, stream_ordering)``,
from a token. A token ``t<topo>-<stream>`` is the position just after the
event key ``(topo, stream)``: going backwards from it yields keys at or
below it, going forwards keys above it. Keys are integers and unique
(stream orderings are), so ``(topo, stream - 1)`` is the position just
before ``(topo, stream)``: pages neither repeat nor skip events. A page is
one ``run_interaction`` and one statement (``page_sql``, which the events
tables' owner holds; this module binds its parameters), which also fetches
the events' bytes; events come back as ``TimelineReader``'s reads return them, through
the same visibility rules (see ``roomstore.events.timeline``).

Who calls it: ``RoomStore.paginate``. What it may call: the
``TimelineReader`` it is handed, for the database, the interners, the read
positions and the viewer's nids.
"""

from __future__ import annotations

import attrs

from roomstore.events.tables.events.timeline_reads import newest_key_sql, page_sql
from roomstore.events.timeline import (
    TimelineReader,
    Viewer,
    event_from_row,
    stream_bound_sql,
)
from roomstore.events.tokens import StreamToken, TopologicalToken
from roomstore.storage.database import Transaction

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
        """The page's rows (``SERVED_COLUMNS``): the room and the viewer's
        nids, the key to start from, then one statement (``page_sql``, the
        events owner's: ``roomstore.events.tables.events.timeline_reads``)."""
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
    return txn.execute(newest_key_sql(at_sql), [room_nid, False, *at_params]).fetchone()
