-- A user's global profile (displayname, avatar_url), copied into their member events.
CREATE TABLE hs_profiles (
    user_id TEXT PRIMARY KEY,
    displayname TEXT,
    avatar_url TEXT
);
