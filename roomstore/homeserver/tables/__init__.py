"""The homeserver's own tables, one module per concern, each the only one whose
SQL names its tables (as ``roomstore/events/tables/`` does for the store's).

Every function takes a ``Transaction`` (``store.db.run_interaction``), uses
bound parameters and runs on SQLite and PostgreSQL alike. The tables are
created by the embedder schema in ``roomstore/homeserver/schema/``.
"""
