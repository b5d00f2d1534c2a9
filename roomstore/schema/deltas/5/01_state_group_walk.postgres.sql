-- Schema version 5 (PostgreSQL only): the walk up a chain of state groups
-- reads each group's predecessor from the primary key's index alone. With
-- prev_state_group INCLUDEd in the key's index, a hop is an index-only scan
-- once (auto)vacuum has marked the table's pages all-visible, not an index
-- probe and then a heap page. The same index, one more column: nothing new to
-- keep. (SQLite's state_groups is a rowid table: finding the key is finding
-- the row.) A covering index on state_group_deltas as well would save about
-- as much again, but could not be deduplicated: ~30 bytes more per state
-- entry on the largest table, which compaction exists to shrink.
ALTER TABLE state_groups DROP CONSTRAINT state_groups_pkey;
ALTER TABLE state_groups ADD CONSTRAINT state_groups_pkey PRIMARY KEY (state_group) INCLUDE (prev_state_group);
