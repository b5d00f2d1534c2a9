"""A Synapse database, read only: every statement against Synapse's tables.

Synapse's schema is not ours, so its SQL lives here and nowhere else (its
``events`` table is not roomstore's). The connection never writes: SQLite is
opened with ``mode=ro``, PostgreSQL sessions are ``default_transaction_read_only``.
Every read is a short statement of its own (pages by stream ordering, groups
by id), so a live Synapse is never held up by a long transaction of ours,
and memory stays bounded by a page whatever the database's size.

Synapse's layout, as read here:
* ``events`` (``stream_ordering``, ``event_id``, ``room_id``, ``outlier``,
  ``type``, ``state_key``), ``event_json`` (``json``: the event as Synapse
  stored it) and ``event_edges`` (its prev events, counted);
* ``rooms.room_version``; ``rejections`` (``event_id``, ``reason``);
  ``redactions`` (``event_id`` redacts ``redacts``);
* state: ``event_to_state_groups`` gives the group of the state *after* an
  event; a group's ``state_groups_state`` rows are a delta on the group its
  ``state_group_edges`` row names, or the whole state when it has none;
* ``current_state_delta_stream``: each change of a room's current state, at
  the stream position of the event that made it.

Those tables and columns are as they are in every schema Synapse 1.163
accepts (``SUPPORTED_SCHEMA``: its ``SCHEMA_COMPAT_VERSION`` 84 up to its
``SCHEMA_VERSION`` 94); another schema version is refused.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from roomstore.storage.db_urls import masked_url, normalized_postgres_url
from roomstore.storage.errors import DatabaseConfigError

__all__ = [
    "SUPPORTED_SCHEMA",
    "SynapseDatabaseError",
    "SynapseEvent",
    "SynapseSource",
]

#: The Synapse schema versions whose tables this module reads, inclusive.
SUPPORTED_SCHEMA = (84, 94)

#: Ids per ``IN (...)`` list: below SQLite's default limit of bound parameters.
_CHUNK = 500
#: Longest state group chain followed; Synapse keeps its chains under 100.
_MAX_HOPS = 10_000

StateMap = dict[tuple[str, str], str]


class SynapseDatabaseError(Exception):
    """The Synapse database cannot be read as one: the message says why and what to do."""


@attrs.frozen
class SynapseEvent:
    """One row of Synapse's ``events`` with its JSON, in Synapse's stream order."""

    stream_ordering: int
    event_id: str
    room_id: str
    room_version: str
    #: ``event_json.json`` exactly as Synapse stored it.
    json: bytes
    outlier: bool
    rejected_reason: str | None
    event_type: str
    #: None for an event that is not a state event.
    state_key: str | None
    #: How many prev events it names (``event_edges``).
    prev_count: int


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


class SynapseSource:
    """A read-only connection to a Synapse database (a SQLite file or
    PostgreSQL). Its methods block: call them from one thread (``SynapseReader``
    runs them on a thread of its own)."""

    def __init__(self, url: str):
        self.url = url
        self._conn: Any = None
        self._engine = ""

    # ---------------------------------------------------------- connection

    def connect(self) -> None:
        """Open the database read only and check its schema version."""
        url = self.url
        conn: Any  # a psycopg2 or sqlite3 connection
        if url.startswith(("postgresql://", "postgres://")):
            import psycopg2

            try:
                conn = psycopg2.connect(
                    normalized_postgres_url(url).geturl(),
                    options="-c default_transaction_read_only=on",
                    application_name="roomstore-import-synapse",
                )
            except DatabaseConfigError as exc:
                raise SynapseDatabaseError(str(exc)) from None
            except psycopg2.Error as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise SynapseDatabaseError(
                    f"cannot connect to the Synapse database {masked_url(url)}: {first}"
                ) from None
            conn.autocommit = True  # each statement its own short read-only transaction
            self._engine = "postgresql"
        else:
            path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else url
            if url.startswith("sqlite:") and not url.startswith("sqlite:///"):
                raise SynapseDatabaseError(f"{url!r}: write sqlite:///path/to/homeserver.db or a plain path")
            import os

            if not os.path.isfile(path):
                raise SynapseDatabaseError(f"no Synapse database at {path}: give the path of its homeserver.db")
            quoted = urllib.parse.quote(os.path.abspath(path))
            lite = sqlite3.connect(f"file:{quoted}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
            lite.execute("PRAGMA busy_timeout = 10000")  # a live Synapse's write may hold the file briefly
            self._engine = "sqlite"
            conn = lite
        self._conn = conn
        self.check_schema()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        if self._engine == "postgresql":
            sql = sql.replace("?", "%s")
        cur = self._conn.cursor()
        try:
            cur.execute(sql, tuple(args))
            return cur.fetchall()
        except (sqlite3.Error, Exception) as exc:
            if type(exc).__module__.startswith(("psycopg2", "sqlite3")):
                raise SynapseDatabaseError(f"reading the Synapse database failed: {str(exc).strip()}") from exc
            raise
        finally:
            cur.close()

    def check_schema(self) -> int:
        """Synapse's schema version; refuse one outside ``SUPPORTED_SCHEMA``."""
        low, high = SUPPORTED_SCHEMA
        try:
            rows = self._rows("SELECT version FROM schema_version")
        except SynapseDatabaseError:
            rows = []
        if not rows:
            raise SynapseDatabaseError(
                f"{masked_url(self.url)} is not a Synapse database (no schema_version table):"
                " give Synapse's own database"
            )
        version = int(rows[0][0])
        if not low <= version <= high:
            raise SynapseDatabaseError(
                f"Synapse schema version {version} is not supported: import-synapse reads schema versions"
                f" {low} to {high} (Synapse 1.163's range); upgrade or use a matching roomstore"
            )
        return version

    # -------------------------------------------------------------- events

    def room_ids(self, wanted: Sequence[str] | None = None) -> list[str]:
        """Rooms with events (those of ``wanted`` only, when given), sorted."""
        rooms = [r for (r,) in self._rows("SELECT room_id FROM rooms ORDER BY room_id")]
        if wanted is None:
            return rooms
        known = set(rooms)
        return sorted(r for r in set(wanted) if r in known)

    def count_events(self, rooms: Sequence[str] | None) -> int:
        if rooms is None:
            return int(self._rows("SELECT COUNT(*) FROM events")[0][0])
        return sum(
            int(self._rows(f"SELECT COUNT(*) FROM events WHERE room_id IN ({_marks(part)})", part)[0][0])
            for part in _chunks(list(rooms))
        )

    def events_page(self, after: int | None, limit: int, rooms: Sequence[str] | None) -> list[SynapseEvent]:
        """Up to ``limit`` events after stream ordering ``after`` (None: from
        the first), in stream order, with their JSON, room version and
        rejection. Backfilled events (negative orderings) come first."""
        where = ["1 = 1"]
        args: list[Any] = []
        if after is not None:
            where.append("e.stream_ordering > ?")
            args.append(after)
        if rooms is not None:
            where.append(f"e.room_id IN ({_marks(rooms)})")
            args.extend(rooms)
        rows = self._rows(
            "SELECT e.stream_ordering, e.event_id, e.room_id, r.room_version, j.json, e.outlier, rj.reason,"
            " e.type, e.state_key, (SELECT COUNT(*) FROM event_edges AS ed WHERE ed.event_id = e.event_id)"
            " FROM events AS e"
            " JOIN event_json AS j ON j.event_id = e.event_id"
            " LEFT JOIN rooms AS r ON r.room_id = e.room_id"
            " LEFT JOIN rejections AS rj ON rj.event_id = e.event_id"
            f" WHERE {' AND '.join(where)} ORDER BY e.stream_ordering LIMIT ?",
            [*args, limit],
        )
        return [
            SynapseEvent(
                stream_ordering=int(so),
                event_id=event_id,
                room_id=room_id,
                room_version=version or "1",
                json=raw.encode("utf-8") if isinstance(raw, str) else bytes(raw),
                outlier=bool(outlier),
                rejected_reason=reason,
                event_type=event_type,
                state_key=state_key,
                prev_count=int(prevs),
            )
            for so, event_id, room_id, version, raw, outlier, reason, event_type, state_key, prevs in rows
        ]

    def redacted_events(self, event_ids: Sequence[str]) -> set[str]:
        """Those of ``event_ids`` Synapse serves redacted: the target of a
        redaction event stored in the same room and not rejected."""
        found: set[str] = set()
        for part in _chunks(list(event_ids)):
            found.update(
                r
                for (r,) in self._rows(
                    "SELECT DISTINCT t.event_id FROM redactions AS rd"
                    " JOIN events AS red ON red.event_id = rd.event_id"
                    " JOIN events AS t ON t.event_id = rd.redacts AND t.room_id = red.room_id"
                    " LEFT JOIN rejections AS rj ON rj.event_id = rd.event_id"
                    f" WHERE rj.event_id IS NULL AND rd.redacts IN ({_marks(part)})",
                    part,
                )
            )
        return found

    # --------------------------------------------------------------- state

    def state_groups_of(self, event_ids: Sequence[str]) -> dict[str, int]:
        """The state group after each event (outliers have none)."""
        groups: dict[str, int] = {}
        for part in _chunks(list(event_ids)):
            groups.update(
                (e, int(g))
                for e, g in self._rows(
                    f"SELECT event_id, state_group FROM event_to_state_groups WHERE event_id IN ({_marks(part)})", part
                )
            )
        return groups

    def group_delta(self, group: int) -> tuple[int | None, StateMap]:
        """A group's predecessor (None: its rows are the whole state) and rows."""
        prev = self._rows("SELECT prev_state_group FROM state_group_edges WHERE state_group = ?", (group,))
        rows = self._rows("SELECT type, state_key, event_id FROM state_groups_state WHERE state_group = ?", (group,))
        return (int(prev[0][0]) if prev else None), {(t, k): e for t, k, e in rows}

    def group_state(self, group: int) -> StateMap:
        """The full state of a group: its chain's rows, the nearest group's
        row winning for each key (Synapse's own reading of its layout). Two
        statements: the chain (a recursive walk of ``state_group_edges``),
        then every row of its groups."""
        chain = [
            int(g)
            for g, _ in self._rows(
                "WITH RECURSIVE chain(state_group, hops) AS ("
                " SELECT CAST(? AS BIGINT), 0"
                " UNION ALL SELECT e.prev_state_group, c.hops + 1 FROM state_group_edges AS e"
                " JOIN chain AS c ON e.state_group = c.state_group WHERE c.hops < ?"
                ") SELECT state_group, hops FROM chain ORDER BY hops",
                (group, _MAX_HOPS),
            )
        ]
        if len(chain) > _MAX_HOPS:
            raise SynapseDatabaseError(f"state group {group}'s chain is over {_MAX_HOPS} groups long (a loop?)")
        nearest = {g: hops for hops, g in enumerate(chain)}
        best: dict[tuple[str, str], tuple[int, str]] = {}
        for part in _chunks(chain):
            for g, event_type, state_key, event_id in self._rows(
                "SELECT state_group, type, state_key, event_id FROM state_groups_state"
                f" WHERE state_group IN ({_marks(part)})",
                part,
            ):
                hops = nearest[int(g)]
                key = (event_type, state_key)
                if key not in best or hops < best[key][0]:
                    best[key] = (hops, event_id)
        return {key: event_id for key, (_, event_id) in best.items()}

    def current_state_at(self, room_id: str, stream_ordering: int) -> StateMap:
        """A room's current state as Synapse had it once the event at
        ``stream_ordering`` was persisted (``current_state_delta_stream``)."""
        rows = self._rows(
            "SELECT type, state_key, event_id, stream_id FROM current_state_delta_stream"
            " WHERE room_id = ? AND stream_id <= ? ORDER BY stream_id",
            (room_id, stream_ordering),
        )
        state: StateMap = {}
        for event_type, state_key, event_id, _ in rows:
            if event_id is None:
                state.pop((event_type, state_key), None)
            else:
                state[(event_type, state_key)] = event_id
        return state


def _marks(items: Sequence[Any]) -> str:
    return ", ".join("?" for _ in items)
