-- The homeserver's accounts: one row per registered user, its password as
-- "scrypt$n$r$p$salt$hash" (roomstore/homeserver/passwords.py).
CREATE TABLE hs_users (
    user_id TEXT PRIMARY KEY,
    password_hash TEXT NOT NULL,
    created_ts BIGINT NOT NULL
);

-- A user's devices: each login makes one.
CREATE TABLE hs_devices (
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    display_name TEXT,
    created_ts BIGINT NOT NULL,
    PRIMARY KEY (user_id, device_id)
);

-- Access tokens, each of one device; logout deletes its token.
CREATE TABLE hs_access_tokens (
    token TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    created_ts BIGINT NOT NULL
);
CREATE INDEX hs_access_tokens_device ON hs_access_tokens (user_id, device_id);
