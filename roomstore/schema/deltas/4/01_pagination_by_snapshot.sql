-- Schema version 4, part 01: back-pagination across a long run of events the
-- viewer may not see (roomstore/events/pagination.py, _paginate_txn). When a
-- page's window of events ahead yields too few visible ones, the page goes on
-- through the room's snapshots the viewer may see (visibility_snapshots by
-- room) and, for each, the events at it in topological order: events by
-- visibility_before, and the membership and history visibility events (the
-- only ones that carry one) by visibility_after. A snapshot belongs to one
-- room, so these indexes do not start with room_nid: a query of a room's
-- events by room_nid never mistakes them for the (room, topological) index.
CREATE INDEX visibility_snapshots_room ON visibility_snapshots (room_nid, snapshot_nid);
CREATE INDEX events_vis_before ON events (visibility_before, topological_ordering, stream_ordering);
CREATE INDEX events_vis_after ON events (visibility_after, topological_ordering, stream_ordering)
    WHERE visibility_after IS NOT NULL;
