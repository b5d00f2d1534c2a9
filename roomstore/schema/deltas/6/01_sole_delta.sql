-- Schema version 6: a state group whose delta is exactly one row carries a
-- copy of that row in its state_groups row (sole_type_key_nid, sole_event_nid;
-- a NULL sole_event_nid with a sole_type_key_nid is a removal). Most groups
-- are one state event on top of their predecessor, so the full-state walk on
-- PostgreSQL reads them from the primary key's index alone (02, INCLUDE) and
-- probes state_group_deltas only for the rest: snapshots and larger deltas.
-- state_group_deltas stays complete (compaction and the filtered reads use
-- it); a writer that changes a group's rows sets the copy in the same
-- transaction (roomstore.state.groups.sole_delta / sole_deltas_sql). NULL in both
-- columns means "read the rows", which is always correct.
ALTER TABLE state_groups ADD COLUMN sole_type_key_nid INTEGER;
ALTER TABLE state_groups ADD COLUMN sole_event_nid BIGINT;
UPDATE state_groups SET
    sole_type_key_nid = (SELECT CASE WHEN COUNT(*) = 1 THEN MAX(d.type_key_nid) END
                         FROM state_group_deltas AS d WHERE d.state_group = state_groups.state_group),
    sole_event_nid = (SELECT CASE WHEN COUNT(*) = 1 THEN MAX(d.event_nid) END
                      FROM state_group_deltas AS d WHERE d.state_group = state_groups.state_group);
