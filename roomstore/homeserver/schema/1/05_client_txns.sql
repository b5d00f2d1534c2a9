-- Client transaction IDs (PUT /send/{type}/{txnId}): the event each made, so a retry returns it.
CREATE TABLE hs_client_txns (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    txn_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (user_id, device_id, txn_id)
);
