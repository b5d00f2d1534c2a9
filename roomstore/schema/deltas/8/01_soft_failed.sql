-- Schema version 8: soft-failed events (issue 39; docs/api.md "What the store
-- checks"). An event that passes the authorization rules against its auth
-- events and the state before it, but not against the room's current state
-- as it arrived, is stored soft-failed: kept, part of the state after it,
-- but never served in a timeline, never a forward extremity and no change of
-- membership, as the server-server spec's "Soft failure" says. Rows stored
-- before this version were never checked and stay not soft-failed.
ALTER TABLE events ADD COLUMN soft_failed BOOLEAN NOT NULL DEFAULT FALSE;
