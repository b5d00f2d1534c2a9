-- The server's ed25519 signing key, made at first start: every event it builds is signed with it.
CREATE TABLE hs_signing_keys (
    server_name TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    key_base64 TEXT NOT NULL
);
