"""The composed timeline reads whose statements are about ``events``: sync's, recent's and a page's
(``roomstore.events.sync``, ``timeline``, ``pagination`` keep their parameters and row handling)."""

from __future__ import annotations

from roomstore.events.tables.events.fragments import (
    SERVED_COLUMNS,
    first_redaction_sql,
    join_event_json,
    join_events,
    served_joins,
)
from roomstore.events.tables.room_state import current_memberships_as
from roomstore.storage.interning import (
    event_id_sql,
    join_event_ids,
    join_rooms,
)
from roomstore.visibility.snapshots import snapshot_upto_sql, visible_sql


def sync_candidates_sql(where: str) -> str:
    """One of sync's candidate SELECTs: rows ``(event_nid, tl, own)`` of the timeline events ``e`` meeting
    ``where`` (its parameters the caller's)."""
    return f"SELECT e.event_nid AS event_nid, 1 AS tl, 0 AS own FROM events AS e WHERE {where}"


def sync_sql(candidates: list[str], low_sql: str, high_sql: str) -> str:
    """Sync's statement over the candidates (``sync_candidates_sql`` and the user's own membership events, to
    UNION), between the per-writer bounds ``low_sql`` and ``high_sql`` on ``e`` (see ``SyncReader._sync_txn``):
    the served columns, then ``in_page`` and ``is_own``, in stream order."""
    vis, _ = visible_sql("e")
    # ``flagged``: each candidate's flags (in the timeline: visible, not an
    # outlier); ``ranked``: the timeline rows numbered newest first per
    # room, so only the newest ``limit`` + 1 (one more says "limited") are
    # joined to their bytes; the user's own membership events all are.
    return f"""
        WITH flagged AS (
            SELECT e.event_nid AS event_nid, e.room_nid AS room_nid, e.stream_ordering AS stream,
                CASE WHEN f.tl = 1 AND e.outlier = ? AND {vis} THEN 1 ELSE 0 END AS in_timeline,
                f.own AS is_own
            FROM (
                SELECT u.event_nid AS event_nid, MAX(u.tl) AS tl, MAX(u.own) AS own
                FROM ({" UNION ALL ".join(candidates)}) AS u
                GROUP BY u.event_nid
            ) AS f
            {join_events("e", "e.event_nid = f.event_nid")}
            WHERE e.rejected_reason IS NULL AND NOT e.soft_failed AND {low_sql} AND {high_sql}
        ), ranked AS (
            SELECT fl.event_nid AS event_nid, fl.in_timeline AS in_timeline, fl.is_own AS is_own,
                ROW_NUMBER() OVER (PARTITION BY fl.room_nid, fl.in_timeline ORDER BY fl.stream DESC) AS newness
            FROM flagged AS fl
            WHERE fl.in_timeline = 1 OR fl.is_own = 1
        )
        SELECT {SERVED_COLUMNS},
            CASE WHEN k.in_timeline = 1 AND k.newness <= ? THEN 1 ELSE 0 END AS in_page, k.is_own AS is_own
        FROM ranked AS k
        {join_events("e", "e.event_nid = k.event_nid")}
        {served_joins()}
        WHERE (k.in_timeline = 1 AND k.newness <= ?) OR k.is_own = 1
        ORDER BY e.stream_ordering"""


def newest_timeline_event_sql(at_sql: str) -> str:
    """The event ID of a room's newest timeline event (no outlier, not rejected, not soft-failed) within
    ``at_sql``, a stream bound on ``e``. Parameters: the room's nid, False (the outlier flag), ``at_sql``'s."""
    return (
        f"SELECT {event_id_sql('e.event_nid')} FROM events AS e"
        " WHERE e.room_nid = ? AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed"
        f" AND {at_sql} ORDER BY e.stream_ordering DESC LIMIT 1"
    )


def outlier_memberships_sql(newest_memberships: str) -> str:
    """``(room_id, membership code, event_id, stream_ordering)`` of those of a user's newest membership events
    (``newest_memberships``, the membership log's subquery, with its parameters) that are outliers (invites from
    rooms this server is not in). Parameters: the subquery's, then True (the outlier flag)."""
    return (
        f"SELECT r.room_id, m.membership, i.event_id, m.stream_ordering FROM ({newest_memberships}) AS m"
        f" {join_events('e', 'e.event_nid = m.event_nid')} {join_rooms('r', 'm.room_nid')}"
        f" {join_event_ids('i', 'm.event_nid')} WHERE e.outlier = ?"
    )


def newest_key_sql(at_sql: str) -> str:
    """The newest key ``(topo, stream)``, in topological order, of a room's graph events within ``at_sql``, a
    stream bound on ``e`` (where a stream token stands in the room's topological order; pagination and purging).
    Parameters: the room's nid, False (the outlier flag), ``at_sql``'s."""
    return (
        "SELECT e.topological_ordering, e.stream_ordering FROM events AS e"
        f" WHERE e.room_nid = ? AND e.outlier = ? AND {at_sql}"
        " ORDER BY e.topological_ordering DESC, e.stream_ordering DESC LIMIT 1"
    )


def recent_sql(high_sql: str, cursor_sql: str) -> str:
    """Recent's statement (see ``TimelineReader._recent_txn`` for its rows and parameters), under the per-writer
    stream bound ``high_sql`` on ``e`` and the keyset condition ``cursor_sql`` on ``a``."""
    vis, _ = visible_sql("e")
    # What grows with the user's joined rooms is one index entry and one
    # rooms row a room, sorted once (no materialized list of them, no
    # second pass to count them); what grows with the page is bounded by
    # ``events`` a room, not by the rooms' length: each room's newest
    # events are tested only until enough are visible (``bounds``), then
    # read from there up (``newest``, which carries what the output needs
    # of each ``events`` row).
    return f"""
        WITH page AS (
            SELECT a.room_nid AS room_nid, a.activity AS activity, a.room_id AS room_id FROM (
                -- Newest event of each joined room. rooms.activity is exact
                -- when every writer has passed it (<= the minimum position of
                -- the token); only rooms active since then walk the
                -- (room, stream) index back to the first event under the token.
                SELECT cm.room_nid AS room_nid, ro.room_id AS room_id,
                CASE WHEN ro.activity <= ? THEN ro.activity ELSE (
                    SELECT e.stream_ordering FROM events AS e
                    WHERE e.room_nid = cm.room_nid AND e.outlier = ? AND e.rejected_reason IS NULL
                    AND NOT e.soft_failed AND {high_sql}
                    ORDER BY e.stream_ordering DESC LIMIT 1) END AS activity
                FROM {current_memberships_as("cm")}
                {join_rooms("ro", "cm.room_nid")}
                WHERE cm.user_nid = ? AND cm.membership = ?
            ) AS a
            WHERE a.activity IS NOT NULL AND {cursor_sql}
            ORDER BY a.activity DESC, a.room_nid DESC
            LIMIT ?
        ), bounds AS (
            -- Per page room, the stream ordering of its events-th newest
            -- visible event: the newest events walked (index order) and
            -- tested only until that many are visible. NULL (take the
            -- whole room) when the room has fewer; rooms holding fewer
            -- events than that skip the walk (an index-only count).
            SELECT pg.room_nid AS room_nid, CASE WHEN (
                SELECT c.stream_ordering FROM events AS c WHERE c.room_nid = pg.room_nid
                ORDER BY c.stream_ordering DESC LIMIT 1 OFFSET ?) IS NULL THEN NULL ELSE (
                SELECT e.stream_ordering FROM events AS e
                WHERE e.room_nid = pg.room_nid AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed
                  AND {high_sql} AND {vis}
                ORDER BY e.stream_ordering DESC LIMIT 1 OFFSET ?) END AS floor
            FROM page AS pg
            ORDER BY pg.activity DESC, pg.room_nid DESC
            LIMIT ?
        ), newest AS MATERIALIZED (
            -- At most ``events`` visible events a room: those from its
            -- floor up, with what the output needs of each. Materialized
            -- (both engines know the word): computed once, not once per
            -- page room where PostgreSQL expects a single page room.
            SELECT e.room_nid AS room_nid, e.stream_ordering AS stream_ordering,
                   {event_id_sql("e.event_nid", "i")} AS event_id,
                   j.room_version AS room_version, j.json AS json, e.redacted AS redacted,
                   {first_redaction_sql("rj.json")} AS redaction_json,
                   {first_redaction_sql("ri.event_id")} AS redaction_id
            FROM bounds AS b
            {join_events("e", "e.room_nid = b.room_nid AND e.stream_ordering >= COALESCE(b.floor, ?)")}
            {join_event_json("j", "e.event_nid")}
            WHERE e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed AND {high_sql} AND {vis}
        )
        SELECT p.room_nid, p.activity, p.room_id,
               k.event_id, k.room_version, k.json, k.redacted, k.redaction_json, k.redaction_id
        FROM page AS p
        LEFT JOIN newest AS k ON k.room_nid = p.room_nid
        ORDER BY p.activity DESC, p.room_nid DESC, k.stream_ordering ASC"""


def page_sql(direction: str, high_sql: str, lateral_joins: bool) -> str:
    """The statement of a page of pagination (``Paginator._paginate_txn`` binds its parameters) going
    ``direction`` under the per-writer stream bound ``high_sql`` on ``e``: rows of ``SERVED_COLUMNS``.

    One statement, two parts.
    (1) ``edge``: the key of the ``window``-th event from the key (any
    event; the walk reads the (room, topological) index alone), absent
    when fewer lie that way. ``hit``: each event from the key tested by
    ``visible_sql`` in index order until ``limit`` are found, but not
    past the edge. A page of events the viewer may see is this part
    alone, at the cost of a plain walk.
    (2) Only when that leaves the page short and the edge exists (more
    events lie beyond it): ``more`` (``_page_more_sql``), the visible
    events beyond the edge, found through the room's snapshots at which
    the viewer may see some event. A long run of events the viewer may not
    see then costs nothing per event. Both parts apply the same rule.
    """
    bound_sql, order, within, far = _page_direction(direction)
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
    # ``page``: every event of ``more`` lies beyond every event of
    # ``hit``. Unary plus in the ORDER BYs over it: SQLite otherwise
    # pushes the order into the arms of the compound and plans them anew,
    # which cost 0.35 ms a page even with ``more`` empty.
    return f"""
            WITH edge AS (
                SELECT e.topological_ordering AS topo, e.stream_ordering AS stream
                FROM events AS e
                WHERE e.room_nid = ? AND {bound_sql}
                ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
                LIMIT 1 OFFSET ?
            ), hit AS (
                SELECT e.event_nid AS event_nid, e.topological_ordering AS topo, e.stream_ordering AS stream
                FROM events AS e
                WHERE e.room_nid = ? AND e.outlier = ? AND e.rejected_reason IS NULL AND NOT e.soft_failed
                  AND {high_sql} AND {bound_sql}
                  AND (e.topological_ordering, e.stream_ordering) {within} {edge_sql}
                  AND {vis}
                ORDER BY e.topological_ordering {order}, e.stream_ordering {order}
                LIMIT ?
            ), seen AS (
                {snapshot_upto_sql(f"cs.room_nid = ? AND {gate}")}
            ), more AS (
                {_page_more_sql(direction, high_sql, lateral_joins)}
            ), page AS (
                SELECT h.event_nid AS event_nid, h.topo AS topo, h.stream AS stream FROM hit AS h
                UNION ALL
                SELECT m.event_nid AS event_nid, m.topo AS topo, m.stream AS stream FROM (
                    SELECT mm.event_nid AS event_nid, mm.topo AS topo, mm.stream AS stream FROM more AS mm
                    ORDER BY +mm.topo {order}, +mm.stream {order}
                    LIMIT ?) AS m
            )
            SELECT {SERVED_COLUMNS}
            FROM page AS p {join_events("e", "e.event_nid = p.event_nid")} {served_joins()}
            ORDER BY +p.topo {order}, +p.stream {order}
            LIMIT ?"""


def _page_direction(direction: str) -> tuple[str, str, str, int]:
    """A page's words for ``direction``: the bound on the key from the token, the order, the comparison that
    keeps ``hit`` within the edge, and the key beyond every event (no edge)."""
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
    return bound_sql, order, within, far


def _page_more_sql(direction: str, high_sql: str, lateral_joins: bool) -> str:
    """A page's ``more``: the visible events beyond the edge, through the room's snapshots at which the viewer may
    see some event (``seen``, with the stream ordering ``upto`` below which they may: ``snapshot_upto_sql``), each
    searched on the (visibility_before|visibility_after, topological) indexes for its first ``limit`` events beyond
    the edge (``_per_snapshot``). The snapshots are searched one by one, not as runs, so forks that interleave
    snapshots cannot hide a visible event."""
    own = "(e.type = 'm.room.history_visibility' OR e.type_key_nid = ?)"
    # An event found by its snapshot before is not searched for again
    # by its snapshot after (UNION ALL: SQLite's UNION cost 0.3 ms a
    # page even when both halves are empty).
    after_only = f"""AND e.visibility_before IS NOT NULL AND {own}
                  AND NOT EXISTS (SELECT 1 FROM seen AS sb WHERE sb.snapshot_nid = e.visibility_before
                      AND e.stream_ordering < sb.upto)"""
    before_search = _per_snapshot("visibility_before", "", direction, high_sql, lateral_joins)
    after_search = _per_snapshot("visibility_after", after_only, direction, high_sql, lateral_joins)
    return f"""{before_search}
                UNION ALL
                {after_search}"""


def _per_snapshot(column: str, extra: str, direction: str, high_sql: str, lateral_joins: bool) -> str:
    """The first ``limit`` visible events beyond the edge ``g`` whose
    ``column`` is the seen snapshot ``s``."""
    order = "DESC" if direction == "b" else "ASC"
    beyond = "<" if direction == "b" else ">"
    search = f"""FROM events AS e
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
        " FROM seen AS s CROSS JOIN edge AS g CROSS JOIN events AS y"
        f" WHERE y.event_nid IN (SELECT e.event_nid {search})"
    )
