-- Schema version 3: rooms.activity, the stream ordering of the room's newest
-- event in its timeline (not an outlier, not rejected), kept by the event
-- persister in the batch's transaction. recent() orders a user's joined rooms
-- by it: one primary-key read per joined room instead of a walk of the events
-- index per joined room. NULL: the room has no such event yet.
ALTER TABLE rooms ADD COLUMN activity BIGINT;

UPDATE rooms SET activity = (
    SELECT MAX(e.stream_ordering) FROM events AS e
    WHERE e.room_nid = rooms.room_nid AND NOT e.outlier AND e.rejected_reason IS NULL
);
