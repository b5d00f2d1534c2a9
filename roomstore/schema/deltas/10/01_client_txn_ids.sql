-- Schema version 10: client transaction IDs (issue 41 item 2). A homeserver's
-- PUT /send/{type}/{txnId} must be idempotent per (user, device, txnId): the
-- event persisted with EventToPersist.client_txn is recorded here, in the
-- transaction that stores it (roomstore/events/tables/client_txns.py). The
-- room and the event are kept so that a purge can delete a room's rows, or
-- those of the events it removes.
CREATE TABLE client_txn_ids (
    user_nid BIGINT NOT NULL,
    device_id TEXT NOT NULL,
    txn_id TEXT NOT NULL,
    event_nid BIGINT NOT NULL,
    room_nid BIGINT NOT NULL,
    inserted_ts BIGINT NOT NULL,
    PRIMARY KEY (user_nid, device_id, txn_id)
);
CREATE INDEX client_txn_ids_room ON client_txn_ids (room_nid);
CREATE INDEX client_txn_ids_event ON client_txn_ids (event_nid);
