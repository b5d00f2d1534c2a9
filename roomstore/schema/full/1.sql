-- roomstore schema, version 1: the full schema for a fresh database.
--
-- Written once for both engines in PostgreSQL's type names; the SQLite engine
-- rewrites BIGSERIAL PRIMARY KEY and BYTEA (see roomstore/storage/engines.py).
-- Statements that only one engine can take live in 1.postgres.sql and
-- 1.sqlite.sql beside this file. Every table is described in docs/schema.md.
--
-- Convention: *_nid columns are integer ids interned inside the store; string
-- ids (event IDs, room IDs, user IDs, state keys) appear only in the interning
-- tables and at the store's edge.

-- ---------------------------------------------------------------- interning

CREATE TABLE rooms (
    room_nid BIGSERIAL PRIMARY KEY,
    room_id TEXT NOT NULL UNIQUE,
    room_version TEXT,
    current_state_group BIGINT                   -- the state group current_state mirrors
);

-- Every event ID the store has heard of, including prev events it has not got.
CREATE TABLE event_ids (
    event_nid BIGSERIAL PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE
);

CREATE TABLE users (
    user_nid BIGSERIAL PRIMARY KEY,
    user_id TEXT NOT NULL UNIQUE
);

-- (type, state_key) pairs of state events.
CREATE TABLE state_keys (
    type_key_nid BIGSERIAL PRIMARY KEY,
    type TEXT NOT NULL,
    state_key TEXT NOT NULL,
    UNIQUE (type, state_key)
);

-- ---------------------------------------------------------------- events

CREATE TABLE events (
    event_nid BIGINT NOT NULL PRIMARY KEY,       -- event_ids.event_nid
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
    visibility_after BIGINT                      -- set for membership and history_visibility events
);
CREATE INDEX events_room_topo ON events (room_nid, topological_ordering, stream_ordering);
CREATE INDEX events_room_stream ON events (room_nid, stream_ordering);

-- The PDU exactly as received, so signatures and hashes stay valid.
CREATE TABLE event_json (
    event_nid BIGINT NOT NULL PRIMARY KEY,
    room_version TEXT NOT NULL,
    json BYTEA NOT NULL,
    censored BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE TABLE event_edges (
    event_nid BIGINT NOT NULL,
    prev_event_nid BIGINT NOT NULL,
    PRIMARY KEY (event_nid, prev_event_nid)
);
CREATE INDEX event_edges_prev ON event_edges (prev_event_nid);

CREATE TABLE event_auth_edges (
    event_nid BIGINT NOT NULL,
    auth_event_nid BIGINT NOT NULL,
    PRIMARY KEY (event_nid, auth_event_nid)
);

-- Events with no known successor: the room's leaves.
CREATE TABLE forward_extremities (
    room_nid BIGINT NOT NULL,
    event_nid BIGINT NOT NULL,
    PRIMARY KEY (room_nid, event_nid)
);

-- prev events we have not got: where backfill continues.
CREATE TABLE backward_extremities (
    room_nid BIGINT NOT NULL,
    event_nid BIGINT NOT NULL,
    PRIMARY KEY (room_nid, event_nid)
);

-- ---------------------------------------------------------------- state

-- A state group is the state of a room at some point, stored as a delta
-- against prev_state_group (NULL: a full snapshot). chain_length is the number
-- of hops to a snapshot, bounded at write time.
CREATE TABLE state_groups (
    state_group BIGSERIAL PRIMARY KEY,
    room_nid BIGINT NOT NULL,
    event_nid BIGINT,
    prev_state_group BIGINT,
    chain_length INTEGER NOT NULL,
    visibility_snapshot BIGINT                   -- visibility_snapshots row of this state
);
CREATE INDEX state_groups_room ON state_groups (room_nid, state_group);
CREATE INDEX state_groups_prev ON state_groups (prev_state_group);

-- state_group_deltas: (state_group, type_key_nid) -> event_nid, NULL event_nid
-- removing the key relative to the predecessor. Engine-specific (see
-- 1.postgres.sql / 1.sqlite.sql) for the tightest on-disk layout.

CREATE TABLE current_state (
    room_nid BIGINT NOT NULL,
    type_key_nid BIGINT NOT NULL,
    event_nid BIGINT NOT NULL,
    PRIMARY KEY (room_nid, type_key_nid)
);

-- Changes to current_state, by the stream position of the event that caused
-- them; backs the current-state rows of the events replication stream.
CREATE TABLE current_state_deltas (
    stream_ordering BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    room_nid BIGINT NOT NULL,
    type_key_nid BIGINT NOT NULL,
    event_nid BIGINT,                            -- NULL: key left the state
    prev_event_nid BIGINT
);
CREATE INDEX current_state_deltas_stream ON current_state_deltas (stream_ordering);

-- ---------------------------------------------------------------- membership

-- Every membership event.
CREATE TABLE room_memberships (
    event_nid BIGINT NOT NULL PRIMARY KEY,
    room_nid BIGINT NOT NULL,
    user_nid BIGINT NOT NULL,
    sender_nid BIGINT NOT NULL,
    membership SMALLINT NOT NULL,
    stream_ordering BIGINT NOT NULL
);
CREATE INDEX room_memberships_user ON room_memberships (user_nid, stream_ordering);
CREATE INDEX room_memberships_room_user ON room_memberships (room_nid, user_nid, stream_ordering);

-- Membership in the current state of each room.
CREATE TABLE current_memberships (
    room_nid BIGINT NOT NULL,
    user_nid BIGINT NOT NULL,
    membership SMALLINT NOT NULL,
    event_nid BIGINT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    PRIMARY KEY (room_nid, user_nid)
);
CREATE INDEX current_memberships_user ON current_memberships (user_nid, membership);

-- ---------------------------------------------------------------- redactions

CREATE TABLE redactions (
    redaction_event_nid BIGINT NOT NULL PRIMARY KEY,
    redacts_event_nid BIGINT NOT NULL,
    received_ts BIGINT NOT NULL,
    have_censored BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX redactions_redacts ON redactions (redacts_event_nid);
CREATE INDEX redactions_uncensored ON redactions (have_censored, received_ts);

-- ---------------------------------------------------------------- visibility
--
-- Who may see an event is decided by the history visibility and the viewer's
-- membership in the state at the event. Events between two membership or
-- visibility changes share one snapshot, so a plain message adds no rows here.
-- A snapshot extends its parent's branch when the parent is that branch's tip
-- (the linear case) and starts a new branch otherwise (a fork); a viewer's
-- membership in a snapshot is the newest membership row on its branch at or
-- before the snapshot's seq, else in the branch's base.

CREATE TABLE visibility_branches (
    branch_nid BIGSERIAL PRIMARY KEY,
    room_nid BIGINT NOT NULL,
    base_snapshot_nid BIGINT,                    -- NULL for a room's first branch
    tip_seq BIGINT NOT NULL
);

CREATE TABLE visibility_snapshots (
    snapshot_nid BIGSERIAL PRIMARY KEY,
    room_nid BIGINT NOT NULL,
    branch_nid BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    history_visibility SMALLINT NOT NULL
);

-- For each branch, itself (depth 0) and every branch it descends from, with
-- the seq up to which that ancestor's rows apply: a membership lookup is one
-- join, newest depth-0 row first.
CREATE TABLE visibility_branch_ancestors (
    branch_nid BIGINT NOT NULL,
    ancestor_branch_nid BIGINT NOT NULL,
    upto_seq BIGINT NOT NULL,
    depth INTEGER NOT NULL,
    PRIMARY KEY (branch_nid, depth)
);

CREATE TABLE visibility_memberships (
    branch_nid BIGINT NOT NULL,
    user_nid BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    membership SMALLINT NOT NULL,
    PRIMARY KEY (branch_nid, user_nid, seq)
);

-- ---------------------------------------------------------------- streams

-- Small integer ids for writer instance names, as multi-writer stream tokens
-- (m<min>~<instance_id>.<pos>) carry them.
CREATE TABLE instances (
    instance_id BIGSERIAL PRIMARY KEY,
    instance_name TEXT NOT NULL UNIQUE
);

-- Persisted per-writer positions of every stream, recovered at start-up.
CREATE TABLE stream_positions (
    stream_name TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (stream_name, instance_name)
);

-- Backs the caches replication stream.
CREATE TABLE cache_invalidations (
    stream_id BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    cache_name TEXT NOT NULL,
    keys TEXT,                                   -- JSON list; NULL: the whole cache
    invalidation_ts BIGINT NOT NULL
);
CREATE INDEX cache_invalidations_stream ON cache_invalidations (stream_id);

-- ---------------------------------------------------------------- locks

-- Named locks between the store and offline jobs (e.g. state compaction).
CREATE TABLE maintenance_locks (
    lock_name TEXT NOT NULL PRIMARY KEY,
    holder TEXT NOT NULL,
    acquired_ts BIGINT NOT NULL
);
