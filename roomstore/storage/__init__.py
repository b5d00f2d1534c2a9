"""Storage engine: database URLs, the connection pool and schema migrations.

Public face:

- ``open_database(url, reactor=None)``: a prepared ``Database``.
- ``Database.run_interaction(description, fn, *args)``: ``fn(txn, *args)`` in one
  transaction on a pool thread; ``txn.execute(sql, args)`` with ``?`` placeholders.
- ``engine_from_url(url)``, ``DatabaseConfigError``, ``SchemaError``,
  ``SchemaTooNewError``, ``StorageFullError`` (out of space), ``SCHEMA_VERSION``.
- ``NotFoundError`` (a ``KeyError``): an ID the store does not hold.
"""

from roomstore.storage.database import Database, RetryTransaction, Transaction, open_database
from roomstore.storage.engines import Engine, engine_from_url
from roomstore.storage.errors import DatabaseConfigError, DatabaseUnavailableError, NotFoundError, StorageFullError
from roomstore.storage.schema import SCHEMA_VERSION, SchemaError, SchemaTooNewError

__all__ = [
    "Database",
    "DatabaseConfigError",
    "DatabaseUnavailableError",
    "Engine",
    "NotFoundError",
    "SCHEMA_VERSION",
    "RetryTransaction",
    "SchemaError",
    "SchemaTooNewError",
    "StorageFullError",
    "Transaction",
    "engine_from_url",
    "open_database",
]
