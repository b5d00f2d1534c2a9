"""Embedder schemas: the tables of the program that embeds the store, in the store's database.

A homeserver keeps its accounts, password hashes, devices, access tokens and
filters beside the events: it names its schema and a directory of numbered
deltas laid out as the store's own deltas are (``roomstore/schema/README.md``)::

    homeserver_schema/
        1/01_accounts.sql             both engines, PostgreSQL's type names
        1/02_devices.sql
        1/02_devices.sqlite.sql       only SQLite, after 02_devices.sql
        2/01_filters.sql

Version V's files take the embedder's tables from V-1 to V, in file-name
order; each engine takes the common files and its own (``NN.postgres.sql``,
``NN.sqlite.sql``), and SQLite rewrites ``BIGSERIAL PRIMARY KEY`` and
``BYTEA`` as it does for the store's. There is no full schema: a new
embedder starts at version 0 and runs every delta. The code's version is the
highest numbered folder (or ``EmbedderSchema.version``, to stop below it).

``RoomStore.open`` (``StoreConfig.embedder_schemas``) applies them in the
transaction that migrates the store's own schema, after the store's deltas,
under the same lock: a delta that fails leaves nothing of the migration (the
store's upgrade included) and raises ``SchemaError`` naming its file in one
line. Each embedder's version is a row of ``embedder_schema_versions`` (store
schema version 9), keyed by its name. A database whose embedder version is
newer than the code's is refused (``SchemaTooNewError``), as the store
refuses a newer schema; a read-only store never migrates, and refuses an
embedder schema that is not at the code's version.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from roomstore.storage.reconnect import one_line
from roomstore.storage.schema import (
    SchemaError,
    SchemaTooNewError,
    _apply_file,
    _files_for,
    check_schema_txn,
    prepare_database,
)
from roomstore.storage.transaction import RetryTransaction, Transaction

__all__ = ["EmbedderSchema", "check_embedders_txn", "distinct_names", "prepare_with_embedders_txn"]

_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}", re.ASCII)
_VERSION_FOLDER = re.compile(r"[1-9][0-9]*", re.ASCII)


def _check_name(_instance: object, _attribute: object, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"embedder schema name {name!r} must be lower-case letters, digits and _ (a letter first)")


def _check_version(_instance: object, _attribute: object, version: int | None) -> None:
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise ValueError(f"embedder schema version {version!r} must be an int >= 0")


@attrs.frozen
class EmbedderSchema:
    """An embedder's schema: its ``name`` (the key of its version row) and
    the ``directory`` of its numbered delta folders (module docstring).
    ``version``: the version this code runs at; None, the highest folder."""

    name: str = attrs.field(validator=_check_name)
    directory: Path = attrs.field(converter=Path)
    version: int | None = attrs.field(default=None, validator=_check_version)

    def folders(self) -> dict[int, Path]:
        """The delta folders, by version; other entries are ignored.
        ``SchemaError`` for a directory that is not one, or a folder of
        digits that is no version (``01``)."""
        if not self.directory.is_dir():
            raise SchemaError(f"embedder schema {self.name!r}: {self.directory} is not a directory")
        folders = {}
        for path in self.directory.iterdir():
            if path.is_dir() and path.name.isdigit():
                if not _VERSION_FOLDER.fullmatch(path.name):
                    raise SchemaError(f"embedder schema {self.name!r}: {path} is no version (1, 2, ...; no leading 0)")
                folders[int(path.name)] = path
        return folders

    def code_version(self) -> int:
        """The version this code brings the embedder's tables to."""
        if self.version is not None:
            return self.version
        return max(self.folders(), default=0)


def distinct_names(_instance: object, _attribute: object, schemas: Sequence[EmbedderSchema]) -> None:
    """attrs validator: embedder schemas, each an ``EmbedderSchema``, no name twice."""
    seen: set[str] = set()
    for schema in schemas:
        if not isinstance(schema, EmbedderSchema):
            raise TypeError(f"embedder schemas must be EmbedderSchema values, not {type(schema).__name__}")
        if schema.name in seen:
            raise ValueError(f"embedder schema {schema.name!r} given twice")
        seen.add(schema.name)


# ---------------------------------------------------------------- the version rows


def _stored_versions(txn: Transaction) -> dict[str, int]:
    return dict(txn.execute("SELECT name, version FROM embedder_schema_versions").fetchall())


def _set_version(txn: Transaction, name: str, version: int, known: bool) -> None:
    if known:
        txn.execute("UPDATE embedder_schema_versions SET version = ? WHERE name = ?", (version, name))
    else:
        txn.execute("INSERT INTO embedder_schema_versions (name, version) VALUES (?, ?)", (name, version))


def _refuse_newer(schema: EmbedderSchema, stored: int, target: int, remedy: str) -> None:
    if stored > target:
        raise SchemaTooNewError(
            f"embedder schema {schema.name!r} is version {stored} in the database, newer than this code's"
            f" {target}: {remedy}"
        )


# ---------------------------------------------------------------- migrating


def _apply_delta(txn: Transaction, schema: EmbedderSchema, version: int, path: Path) -> None:
    """One delta file; a failure the pool does not handle itself (a lost
    connection, a conflict to retry, a full disk) becomes a one-line
    ``SchemaError`` naming the file. The caller's transaction rolls back."""
    try:
        _apply_file(txn, path)
    except Exception as exc:
        engine = txn.engine
        connection = getattr(txn._cursor, "connection", None)
        if (
            isinstance(exc, RetryTransaction)
            or engine.is_retryable(exc)
            or engine.is_storage_full(exc)
            or engine.is_connection_lost(exc, connection)
        ):
            raise
        raise SchemaError(f"embedder schema {schema.name!r} version {version}: {path} failed: {one_line(exc)}") from exc


def _migrate(txn: Transaction, schema: EmbedderSchema, stored: int | None) -> int:
    target = schema.code_version()
    start = 0 if stored is None else stored
    _refuse_newer(schema, start, target, "upgrade the embedding program, or restore a backup taken before the upgrade")
    folders = schema.folders()
    for version in range(start + 1, target + 1):
        folder = folders.get(version)
        for path in [] if folder is None else _files_for(folder, lambda name: True, txn.engine.name):
            _apply_delta(txn, schema, version, path)
    if stored != target:
        _set_version(txn, schema.name, target, stored is not None)
    return target


def prepare_with_embedders_txn(
    txn: Transaction, override_dir: str | os.PathLike[str] | None = None, embedders: Iterable[EmbedderSchema] = ()
) -> int:
    """The store's ``prepare_database`` (its lock, its deltas), then each
    embedder's deltas after its stored version, in the order given, all in
    ``txn``. Returns the store's schema version."""
    version = prepare_database(txn, override_dir)
    embedders = list(embedders)
    if embedders:
        stored = _stored_versions(txn)
        for schema in embedders:
            _migrate(txn, schema, stored.get(schema.name))
    return version


def check_embedders_txn(txn: Transaction, embedders: Iterable[EmbedderSchema] = ()) -> int:
    """For a read-only store: ``check_schema_txn``, then each embedder's
    stored version must be the code's; nothing is written. Returns the
    store's schema version."""
    version = check_schema_txn(txn)
    embedders = list(embedders)
    if embedders:
        stored = _stored_versions(txn)
        for schema in embedders:
            target = schema.code_version()
            at = stored.get(schema.name, 0)
            _refuse_newer(schema, at, target, "upgrade the embedding program")
            if at < target:
                raise SchemaError(
                    f"embedder schema {schema.name!r} is version {at} in the database, older than this code's"
                    f" {target}: open the store once writable to migrate it (a read-only store writes nothing)"
                )
    return version
