-- SQLite part of schema delta 2 (see 01_state_compaction.sql and the
-- PostgreSQL variant, which documents the columns). Plain tables: SQLite has
-- no unlogged tables.
CREATE TABLE state_compaction_staged_groups (
    run_id BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    first_group BIGINT NOT NULL,
    state_group BIGINT NOT NULL,
    is_ref SMALLINT NOT NULL,
    old_prev BIGINT,
    old_rows BIGINT NOT NULL,
    old_checksum BIGINT NOT NULL,
    new_prev BIGINT,
    new_chain_length INTEGER NOT NULL,
    rewrite SMALLINT NOT NULL
);
CREATE INDEX state_compaction_staged_groups_chunk
    ON state_compaction_staged_groups (run_id, room_nid, first_group);

CREATE TABLE state_compaction_staged_deltas (
    run_id BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    first_group BIGINT NOT NULL,
    state_group BIGINT NOT NULL,
    type_key_nid INTEGER NOT NULL,
    event_nid BIGINT
);
CREATE INDEX state_compaction_staged_deltas_chunk
    ON state_compaction_staged_deltas (run_id, room_nid, first_group);
