-- PostgreSQL part of schema delta 2 (see 01_state_compaction.sql).
--
-- Staging: the compaction job copies a room's new representation here, then
-- swaps it in chunk by chunk in short transactions. UNLOGGED: the rows are
-- scratch data recomputed by a rerun, so they need no WAL (and are emptied
-- after a server crash, which is fine).

-- Every group of a staged chunk: the representation the job read (old_*,
-- re-checked by the swap), the new one, and whether its rows are replaced.
-- is_ref = 1 rows are groups outside the chunk the new representation
-- builds on: the swap only checks that they still exist.
CREATE UNLOGGED TABLE state_compaction_staged_groups (
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

-- The new delta rows of the rewritten groups of a staged chunk.
CREATE UNLOGGED TABLE state_compaction_staged_deltas (
    run_id BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    first_group BIGINT NOT NULL,
    state_group BIGINT NOT NULL,
    type_key_nid INTEGER NOT NULL,
    event_nid BIGINT
);
CREATE INDEX state_compaction_staged_deltas_chunk
    ON state_compaction_staged_deltas (run_id, room_nid, first_group);
