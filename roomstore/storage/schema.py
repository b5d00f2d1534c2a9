"""Schema migrations: the full schema for a fresh database, numbered deltas after it.

The layout of ``roomstore/schema/`` is described in its ``README.md``. Everything runs
inside the transaction ``Database.prepare`` opens, so a failed migration leaves
the database as it was; on PostgreSQL an advisory lock taken first makes a
second process starting at the same time wait, then see the new version and do
nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from twisted.logger import Logger

from roomstore.storage.transaction import Transaction

log = Logger()

#: The schema version this code reads and writes.
SCHEMA_VERSION = 11

#: The schema files ship inside the package (package data), so an installed
#: roomstore finds them with no environment variable; ROOMSTORE_SCHEMA_DIR
#: (or an explicit directory) overrides it.
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"

#: Every table the schema creates (full schema and deltas; not the bookkeeping ``schema_version`` and
#: ``applied_schema_deltas``), in the order ``roomstore stats`` reports them. The one list: the stats, the tests
#: and the benchmarks read it, and ``tests/test_architecture.py`` checks it against the schema files.
SCHEMA_TABLES = (
    "rooms",
    "event_ids",
    "users",
    "state_keys",
    "events",
    "event_json",
    "event_edges",
    "event_auth_edges",
    "forward_extremities",
    "backward_extremities",
    "state_groups",
    "state_group_deltas",
    "current_state",
    "current_state_deltas",
    "room_memberships",
    "current_memberships",
    "redactions",
    "visibility_snapshots",
    "visibility_branches",
    "visibility_branch_ancestors",
    "visibility_memberships",
    "stream_positions",
    "cache_invalidations",
    "instances",
    "maintenance_locks",
    "state_compaction_runs",
    "state_compaction_rooms",
    "state_compaction_chunks",
    "state_compaction_staged_groups",
    "state_compaction_staged_deltas",
    "embedder_schema_versions",
    "client_txn_ids",
)


#: The one read of the store's schema version (``schema_version`` is this module's: it writes it too); the
#: compaction job runs it before it touches a database.
READ_SCHEMA_VERSION = "SELECT version FROM schema_version"


class SchemaError(RuntimeError):
    """The database's schema cannot be used by this code."""


class SchemaTooNewError(SchemaError):
    pass


def schema_dir(override: str | os.PathLike[str] | None = None) -> Path:
    path = Path(override or os.environ.get("ROOMSTORE_SCHEMA_DIR") or DEFAULT_SCHEMA_DIR)
    if not (path / "full").is_dir():
        raise SchemaError(f"schema directory {path} has no full/ folder")
    return path


def split_statements(sql: str) -> list[str]:
    """Split a schema file into statements: ``;`` ends one at the end of a line.

    Comment lines are dropped first; schema files keep string literals free of
    semicolons and comment markers.
    """
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    text = "\n".join(lines)
    parts = re.split(r";[ \t]*(?:--[^\n]*)?$", text, flags=re.M)
    return [p.strip() for p in parts if p.strip()]


def _files_for(directory: Path, stem_filter: Callable[[str], bool], engine_name: str) -> list[Path]:
    """The files of a directory that apply to an engine, in name order."""
    chosen = []
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql" or not stem_filter(path.name):
            continue
        parts = path.name.split(".")
        if len(parts) == 3 and parts[1] != engine_name:
            continue  # another engine's file
        chosen.append(path)
    # Common file before the engine-specific one of the same name.
    return sorted(chosen, key=lambda p: (p.name.split(".")[0], len(p.name.split("."))))


def _apply_file(txn: Transaction, path: Path) -> None:
    sql = txn.engine.translate_schema(path.read_text(encoding="utf-8"))
    for statement in split_statements(sql):
        txn.execute(statement)


def _full_versions(base: Path) -> list[int]:
    versions = set()
    for path in (base / "full").iterdir():
        head = path.name.split(".")[0]
        if path.suffix == ".sql" and head.isdigit():
            versions.add(int(head))
    return sorted(versions)


def _delta_files(base: Path, version: int, engine_name: str) -> list[Path]:
    directory = base / "deltas" / str(version)
    if not directory.is_dir():
        return []
    return _files_for(directory, lambda name: True, engine_name)


def _stored_version(txn: Transaction, target: int, remedy: str) -> int:
    """The version in ``schema_version``; raises ``SchemaError`` when the
    table is empty and ``SchemaTooNewError`` (ending with ``remedy``) when
    the version is newer than ``target``."""
    current: int | None = txn.select_one_value(READ_SCHEMA_VERSION)
    if current is None:
        raise SchemaError("schema_version table is empty: the database is damaged")
    if current > target:
        raise SchemaTooNewError(f"database schema is version {current}, newer than this code's {target}: {remedy}")
    return current


def prepare_database(
    txn: Transaction, override_dir: str | os.PathLike[str] | None = None, target: int | None = None
) -> int:
    """Create or upgrade the schema to ``target`` (default ``SCHEMA_VERSION``).

    Runs inside ``txn``. Returns the version the database is at afterwards.
    Raises ``SchemaTooNewError`` when the database was written by newer code.
    """
    base = schema_dir(override_dir)
    target = SCHEMA_VERSION if target is None else target
    engine = txn.engine
    engine.lock_schema(txn._cursor)

    if engine.table_exists(txn._cursor, "schema_version"):
        start = _stored_version(txn, target, "upgrade roomstore, or restore a backup taken before the upgrade")
    else:
        fulls = [v for v in _full_versions(base) if v <= target]
        if not fulls:
            raise SchemaError(f"no full schema at or below version {target} in {base / 'full'}")
        full = fulls[-1]
        for path in _files_for(base / "full", lambda name: name.split(".")[0] == str(full), engine.name):
            _apply_file(txn, path)
        txn.execute(
            "CREATE TABLE schema_version ("
            " lock CHAR(1) NOT NULL DEFAULT 'X' UNIQUE CHECK (lock = 'X'),"
            " version INTEGER NOT NULL)"
        )
        txn.execute("CREATE TABLE applied_schema_deltas (version INTEGER NOT NULL, file TEXT NOT NULL)")
        txn.execute("INSERT INTO schema_version (version) VALUES (?)", (full,))
        log.info("created schema version {v} on {db}", v=full, db=engine.describe())
        start = full

    for version in range(start + 1, target + 1):
        for path in _delta_files(base, version, engine.name):
            log.info("applying schema delta {v}/{name}", v=version, name=path.name)
            _apply_file(txn, path)
            txn.execute(
                "INSERT INTO applied_schema_deltas (version, file) VALUES (?, ?)",
                (version, path.name),
            )
        txn.execute("UPDATE schema_version SET version = ?", (version,))
    return target


def check_schema_txn(txn: Transaction, target: int | None = None) -> int:
    """For a process that must not write (the read commands): the schema
    version, which must be ``target`` (default ``SCHEMA_VERSION``); a database
    without the schema, or at another version, raises ``SchemaError`` saying
    what to run. Nothing is created or upgraded."""
    target = SCHEMA_VERSION if target is None else target
    engine = txn.engine
    where = engine.describe()
    if not engine.table_exists(txn._cursor, "schema_version"):
        raise SchemaError(
            f"{where} has no roomstore schema: create it with `roomstore init --db {where}`"
            " (read commands write nothing)"
        )
    current = _stored_version(txn, target, "upgrade roomstore")
    if current < target:
        raise SchemaError(
            f"database schema is version {current}, older than this roomstore's {target}: upgrade it"
            f" with `roomstore init --db {where}` (read commands write nothing)"
        )
    return current
