-- Schema version 6 (PostgreSQL only): the primary key's index also carries
-- the sole delta row (01), so a hop of the walk over a one-row group is an
-- index-only scan that yields the row too (version 5 INCLUDEd only
-- prev_state_group). 12 bytes more per group in the index, against a probe
-- of state_group_deltas (index and table page) per hop saved.
ALTER TABLE state_groups DROP CONSTRAINT state_groups_pkey;
ALTER TABLE state_groups ADD CONSTRAINT state_groups_pkey PRIMARY KEY (state_group)
    INCLUDE (prev_state_group, sole_type_key_nid, sole_event_nid);
