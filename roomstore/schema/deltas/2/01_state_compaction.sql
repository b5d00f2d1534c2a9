-- Schema version 2: offline state-group compaction (roomstore/compaction,
-- docs/compaction.md). Both engines; the staging tables differ per engine and
-- live in 01_state_compaction.postgres.sql / .sqlite.sql beside this file.

-- The compaction job refreshes heartbeat_ts while it holds its lock; a lock
-- whose heartbeat is older than the reader's timeout is stale (the job died)
-- and is ignored with a warning. NULL: the holder never beat; use acquired_ts.
ALTER TABLE maintenance_locks ADD COLUMN heartbeat_ts BIGINT;

-- One row per compaction run. snapshot_max is MAX(state_group) when the run
-- started: the run never touches a group above it, so groups persisted while
-- it runs are left exactly as written. finished_ts NULL: the run was
-- interrupted, and the next invocation resumes it with the same snapshot_max.
CREATE TABLE state_compaction_runs (
    run_id BIGSERIAL PRIMARY KEY,
    snapshot_max BIGINT NOT NULL,
    holder TEXT NOT NULL,                        -- lock holder that started it
    options TEXT NOT NULL,                       -- JSON of the options it was started with
    started_ts BIGINT NOT NULL,
    finished_ts BIGINT
);

-- One row per room a run has finished with, whatever the outcome (status:
-- written, unchanged, below_min_saving, mismatch, error, changed_underneath).
-- Written in the same transaction as the room's last swap, so a room with a
-- row here is never redone by a resumed run.
CREATE TABLE state_compaction_rooms (
    run_id BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    status TEXT NOT NULL,
    state_groups BIGINT NOT NULL,
    rows_before BIGINT NOT NULL,
    rows_after BIGINT NOT NULL,
    groups_rewritten BIGINT NOT NULL,
    detail TEXT,
    updated_ts BIGINT NOT NULL,
    PRIMARY KEY (run_id, room_nid)
);

-- One row per chunk (a run of consecutive groups of one room) swapped in,
-- written by the chunk's swap transaction: a resumed run skips these chunks.
CREATE TABLE state_compaction_chunks (
    run_id BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    first_group BIGINT NOT NULL,
    last_group BIGINT NOT NULL,
    rows_before BIGINT NOT NULL,
    rows_after BIGINT NOT NULL,
    groups_rewritten BIGINT NOT NULL,
    updated_ts BIGINT NOT NULL,
    PRIMARY KEY (run_id, room_nid, first_group)
);
