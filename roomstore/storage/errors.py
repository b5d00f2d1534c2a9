"""The storage errors a person fixes, each one line (``roomstore.storage``
re-exports them; ``engines.py`` and ``sqlite_connection.py`` raise them)."""

from __future__ import annotations

__all__ = ["DatabaseConfigError", "DatabaseUnavailableError", "NotFoundError", "StorageFullError"]


class DatabaseConfigError(ValueError):
    """The database URL or its options are not usable."""


class DatabaseUnavailableError(ConnectionError):
    """The database server cannot be reached (or refuses us): the message says
    which server and why, in one line."""


class StorageFullError(OSError):
    """The database ran out of space (a full disk, a full PostgreSQL
    tablespace). The transaction was rolled back whole; the message says
    where, in one line. Free space and run it again."""


class NotFoundError(KeyError):
    """An ID the store does not hold (an event, a room), or does not hold in
    the form asked for (an outlier has no timeline position). A ``KeyError``,
    so ``except KeyError`` catches it; ``str()`` is its one-line message."""

    def __str__(self) -> str:
        # KeyError's own quotes its argument as a key: a message reads better plain.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()
