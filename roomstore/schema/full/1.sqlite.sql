-- SQLite-only part of schema version 1.

-- Clustered on (state_group, type_key_nid): no rowid and no second index, and
-- SQLite's variable-length integers keep a row to a dozen bytes or so.
CREATE TABLE state_group_deltas (
    state_group INTEGER NOT NULL,
    type_key_nid INTEGER NOT NULL,
    event_nid INTEGER,
    PRIMARY KEY (state_group, type_key_nid)
) WITHOUT ROWID;
