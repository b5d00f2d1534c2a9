-- SQLite keeps a table's rows in a b-tree by rowid, and a declared primary
-- key that is not "INTEGER PRIMARY KEY" in a second b-tree beside it: every
-- row written twice. The four tables written for every event take their key
-- as the rowid (events, event_json) or are kept by their key alone (the
-- edges, WITHOUT ROWID), so each row is written once. Same columns, same
-- indexes, same rows; PostgreSQL's tables are unchanged.

CREATE TABLE events_by_nid (
    event_nid INTEGER PRIMARY KEY,               -- event_ids.event_nid
    room_nid BIGINT NOT NULL,
    type TEXT NOT NULL,
    type_key_nid BIGINT,                         -- state events only
    sender_nid BIGINT NOT NULL,                  -- users.user_nid
    depth BIGINT NOT NULL,
    topological_ordering BIGINT NOT NULL,        -- depth, for pagination
    stream_ordering BIGINT NOT NULL UNIQUE,      -- negative for backfilled events
    instance_name TEXT NOT NULL,                 -- the writer that persisted it
    origin_server_ts BIGINT NOT NULL,
    received_ts BIGINT NOT NULL,
    outlier BOOLEAN NOT NULL,
    rejected_reason TEXT,
    backfilled BOOLEAN NOT NULL,
    redacted BOOLEAN NOT NULL DEFAULT FALSE,     -- a redaction of it is stored
    state_group_before BIGINT,                   -- state before the event
    state_group BIGINT,                          -- state after the event
    visibility_before BIGINT,                    -- visibility_snapshots row at the event
    visibility_after BIGINT,                     -- set for membership and history_visibility events
    soft_failed BOOLEAN NOT NULL DEFAULT FALSE
);
INSERT INTO events_by_nid (
    event_nid, room_nid, type, type_key_nid, sender_nid, depth, topological_ordering, stream_ordering,
    instance_name, origin_server_ts, received_ts, outlier, rejected_reason, backfilled, redacted,
    state_group_before, state_group, visibility_before, visibility_after, soft_failed
)
SELECT
    event_nid, room_nid, type, type_key_nid, sender_nid, depth, topological_ordering, stream_ordering,
    instance_name, origin_server_ts, received_ts, outlier, rejected_reason, backfilled, redacted,
    state_group_before, state_group, visibility_before, visibility_after, soft_failed
FROM events ORDER BY event_nid;
DROP TABLE events;
ALTER TABLE events_by_nid RENAME TO events;
CREATE INDEX events_room_topo ON events (room_nid, topological_ordering, stream_ordering);
CREATE INDEX events_room_stream ON events (room_nid, stream_ordering);
CREATE INDEX events_vis_before ON events (visibility_before, topological_ordering, stream_ordering);
CREATE INDEX events_vis_after ON events (visibility_after, topological_ordering, stream_ordering)
    WHERE visibility_after IS NOT NULL;

CREATE TABLE event_json_by_nid (
    event_nid INTEGER PRIMARY KEY,
    room_version TEXT NOT NULL,
    json BLOB NOT NULL,
    censored BOOLEAN NOT NULL DEFAULT FALSE
);
INSERT INTO event_json_by_nid (event_nid, room_version, json, censored)
SELECT event_nid, room_version, json, censored FROM event_json ORDER BY event_nid;
DROP TABLE event_json;
ALTER TABLE event_json_by_nid RENAME TO event_json;

CREATE TABLE event_edges_by_key (
    event_nid BIGINT NOT NULL,
    prev_event_nid BIGINT NOT NULL,
    PRIMARY KEY (event_nid, prev_event_nid)
) WITHOUT ROWID;
INSERT INTO event_edges_by_key (event_nid, prev_event_nid) SELECT event_nid, prev_event_nid FROM event_edges;
DROP TABLE event_edges;
ALTER TABLE event_edges_by_key RENAME TO event_edges;
CREATE INDEX event_edges_prev ON event_edges (prev_event_nid);

CREATE TABLE event_auth_edges_by_key (
    event_nid BIGINT NOT NULL,
    auth_event_nid BIGINT NOT NULL,
    PRIMARY KEY (event_nid, auth_event_nid)
) WITHOUT ROWID;
INSERT INTO event_auth_edges_by_key (event_nid, auth_event_nid)
SELECT event_nid, auth_event_nid FROM event_auth_edges;
DROP TABLE event_auth_edges;
ALTER TABLE event_auth_edges_by_key RENAME TO event_auth_edges;
