-- PostgreSQL-only part of schema version 1.

-- One row per state entry, three fixed-width integers ordered for alignment;
-- the index on state_group alone is deduplicated by PostgreSQL (13+), so a
-- group's entries share one posting list instead of one index tuple each.
CREATE TABLE state_group_deltas (
    state_group BIGINT NOT NULL,
    event_nid BIGINT,
    type_key_nid INTEGER NOT NULL
);
CREATE INDEX state_group_deltas_group ON state_group_deltas (state_group);

-- Stream ID sequences: every writer process takes IDs from these (nextval).
CREATE SEQUENCE events_stream_seq;
CREATE SEQUENCE backfill_stream_seq;
CREATE SEQUENCE caches_stream_seq;
