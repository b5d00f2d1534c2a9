-- Schema version 9: the version of each embedder schema (issue 41 item 2;
-- roomstore/storage/embedder_schema.py). A homeserver embedding the store
-- registers its own numbered deltas under a name; their version lives here,
-- one row per name, written in the transaction that applies them.
CREATE TABLE embedder_schema_versions (
    name TEXT NOT NULL PRIMARY KEY,
    version INTEGER NOT NULL
);
