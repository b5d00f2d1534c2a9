-- Schema version 7: a redaction is applied only where it has the authority
-- to (issue 39; docs/api.md "Redactions"): its sender had the room's
-- `redact` power level in the state before it, or (room versions 1 and 2)
-- its event ID's server is the target ID's server. That much is known when
-- the redaction is stored, and kept here; the rest, a redaction of one's own
-- event, is decided where both events are joined (same_room_redactions).
-- Rows stored before this version were applied without the check and stay so.
ALTER TABLE redactions ADD COLUMN authorised BOOLEAN NOT NULL DEFAULT TRUE;
