"""String IDs to integer ids (``*_nid``) and back, with bounded caches.

Event IDs, room IDs, user IDs and ``(type, state_key)`` pairs are stored once
in an interning table; every other table holds the integer. The caches only
learn ids whose rows are committed (``txn.call_after``): a rolled-back insert
could leave an id that a later transaction reuses on SQLite. An interned id
never changes meaning, so a cached entry is never stale: the caches
(:class:`InternCache`) only need a bound, and bulk hits at C speed (a
10,000-entry state resolves 20,000 ids).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Generic, TypeVar, cast

from roomstore.storage.transaction import RetryTransaction, Transaction

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")
#: An interned key: a string ID, or a ``(type, state_key)`` pair.
IK = TypeVar("IK", str, tuple[str, str])

# SQLite's default limit on bound parameters per statement is 32766; PostgreSQL
# allows 65535. Chunks well under both keep statements quick to plan.
CHUNK = 500


class LruCache(Generic[K, V]):
    """A bounded mapping that forgets the least recently used entries."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._data: OrderedDict[K, V] = OrderedDict()

    # get and set tolerate another thread's pop or clear between their
    # steps: a writer's caches are filled after commit on the reactor thread
    # (``call_after``) while its database thread reads them.

    def get(self, key: K, default: V | None = None) -> V | None:
        try:
            value = self._data[key]
            self._data.move_to_end(key)
        except KeyError:
            return default
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def set(self, key: K, value: V) -> None:
        try:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_size:
                self._data.popitem(last=False)
        except KeyError:
            pass  # emptied meanwhile: nothing left to trim

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._data.pop(key, default)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def split(self, wanted: Iterable[K]) -> tuple[dict[K, V], list[K]]:
        """(what this cache knows of ``wanted``, the rest), deduplicated in
        order; the known ones become the most recently used."""
        known: dict[K, V] = {}
        missing: list[K] = []
        data = self._data
        touch = data.move_to_end
        for item in dict.fromkeys(wanted):
            value = data.get(item)
            if value is None:
                missing.append(item)
            else:
                known[item] = value
                touch(item)
        return known, missing


class InternCache(Generic[K, V]):
    """A bounded mapping for entries that never change, with bulk hits at C speed.

    Two generations of plain dicts, at most ``max_size // 2`` entries each:
    new entries and hits go to the young one; a hit in the old one is copied
    into the young one (promoted); when the young one is full it becomes the
    old one and the previous old one is dropped. So at most ``max_size``
    entries are held (an entry may sit in both), and an entry used since the
    last two turnovers stays. No reordering per hit, unlike :class:`LruCache`:
    a bulk read of keys all in the young dict is one ``itemgetter`` call.
    Values must not be None (None means "not cached").
    """

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._generation_size = max(1, max_size // 2)
        self._young: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def _add(self, key: K, value: V) -> None:
        young = self._young
        young[key] = value
        if len(young) >= self._generation_size:
            self._old, self._young = young, {}

    def get(self, key: K, default: V | None = None) -> V | None:
        value = self._young.get(key)
        if value is None:
            value = self._old.get(key)
            if value is None:
                return default
            self._add(key, value)
        return value

    set = _add

    def update(self, mapping: Mapping[K, V]) -> None:
        """``set`` for each item (a batch's new keys): one C-level step,
        unless the young generation fills on the way."""
        young = self._young
        if len(young) + len(mapping) < self._generation_size:
            young.update(mapping)
            return
        for key, value in mapping.items():
            self._add(key, value)

    def __contains__(self, key: object) -> bool:
        return key in self._young or key in self._old

    def pop(self, key: K, default: V | None = None) -> V | None:
        old = self._old.pop(key, default)
        return self._young.pop(key, old)

    def clear(self) -> None:
        self._young, self._old = {}, {}

    def __len__(self) -> int:
        """Distinct keys held (an entry in both generations counts once)."""
        young = self._young
        return len(young) + sum(1 for key in self._old if key not in young)

    def values_of(self, keys: Sequence[K]) -> tuple[list[V | None], list[int]]:
        """The cached values of ``keys`` in order (None for those not cached)
        and the indexes of the keys not cached."""
        young = self._young
        if len(keys) > 1:
            try:
                return list(itemgetter(*keys)(young)), []
            except KeyError:
                pass
        values: list[V | None] = list(map(young.get, keys))
        if None not in values:
            return values, []
        olds = list(map(self._old.get, keys))
        if values.count(None) == len(values) and olds.count(None) == len(values):
            return values, list(range(len(values)))  # none cached (a cold cache): no step per key
        missing: list[int] = []
        add = self._add
        for index, value in enumerate(values):
            if value is None:
                value = olds[index]
                if value is None:
                    missing.append(index)
                else:  # as get(): a hit in the old generation moves to the young
                    values[index] = value
                    add(keys[index], value)
        return values, missing

    def split(self, wanted: Iterable[K]) -> tuple[dict[K, V], list[K]]:
        """(what this cache knows of ``wanted``, the rest), deduplicated in order."""
        keys = list(dict.fromkeys(wanted))
        values, missing = self.values_of(keys)
        if not missing:  # all cached: no value is None
            return dict(zip(keys, cast("list[V]", values), strict=True)), []
        known = {key: value for key, value in zip(keys, values, strict=True) if value is not None}
        return known, [keys[index] for index in missing]


def chunks(values: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def room_ids_and_nids_sql(count: int) -> str:
    """``(room_id, room_nid)`` of ``count`` room ids given as parameters."""
    return f"SELECT room_id, room_nid FROM rooms WHERE room_id IN ({', '.join('?' for _ in range(count))})"


def room_ids_of_sql(nids_sql: str) -> str:
    """``(room_nid, room_id)`` of the rooms whose nids ``nids_sql`` (a subquery) lists."""
    return f"SELECT r.room_nid, r.room_id FROM rooms r WHERE r.room_nid IN ({nids_sql})"


#: A key this transaction has not asked about (``Interner._recall``).
_UNASKED = object()


class Interner(Generic[IK]):
    """Interns one kind of string id (or tuple of strings) into a table.

    ``key_columns`` are the string columns (one for IDs, two for
    ``(type, state_key)``); keys (``IK``) are strings, or tuples for several columns.
    """

    def __init__(self, table: str, nid_column: str, key_columns: Sequence[str], cache_size: int = 100_000):
        self.table = table
        self.nid_column = nid_column
        self.key_columns = tuple(key_columns)
        self._to_nid: InternCache[IK, int] = InternCache(cache_size)
        self._to_key: InternCache[int, IK] = InternCache(cache_size)

    def _remember(self, mapping: Mapping[IK, int]) -> None:
        self._to_nid.update(mapping)
        self._to_key.update({nid: key for key, nid in mapping.items()})

    def _key(self, values: Sequence[Any]) -> IK:
        """The key a row's key columns hold (as the database returns them)."""
        return cast(IK, values[0] if len(values) == 1 else tuple(values))

    def _as_row(self, key: IK) -> tuple[Any, ...]:
        return key if isinstance(key, tuple) else (key,)

    def _select(self, txn: Transaction, keys: Sequence[IK]) -> dict[IK, int]:
        found: dict[IK, int] = {}
        cols = ", ".join(self.key_columns)
        for part in chunks(list(keys)):
            if len(self.key_columns) == 1:
                marks = ", ".join("?" for _ in part)
                sql = f"SELECT {cols}, {self.nid_column} FROM {self.table} WHERE {cols} IN ({marks})"
                args: list[Any] = list(part)
            else:
                one = "(" + ", ".join("?" for _ in self.key_columns) + ")"
                sql = (
                    f"SELECT {cols}, {self.nid_column} FROM {self.table}"
                    f" WHERE ({cols}) IN (VALUES {', '.join(one for _ in part)})"
                )
                args = [v for key in part for v in key]
            for row in txn.execute(sql, args).fetchall():
                key = row[0] if len(self.key_columns) == 1 else self._key(row[:-1])
                found[key] = row[-1]
        return found

    def lookup(self, txn: Transaction, keys: Iterable[IK]) -> dict[IK, int]:
        """The nids of those ``keys`` that are interned already (no writes)."""
        result, missing = self._to_nid.split(keys)
        if missing:
            missing = self._recall(txn, missing, result)
        if missing:
            found = self._select(txn, missing)
            result.update(found)
            txn.call_after(self._remember, found)
            memo = txn.memo.setdefault(self, {})
            memo.update((key, (nid, False)) for key, nid in found.items())
            if txn.engine.single_writer:
                # The only writer: what is not there now is not there until this transaction inserts it.
                memo.update((key, None) for key in missing if key not in found)
        return result

    def _recall(
        self, txn: Transaction, keys: list[IK], result: dict[IK, int], created: set[IK] | None = None
    ) -> list[IK]:
        """What this transaction learned of ``keys`` before (``txn.memo``)
        put in ``result`` (and the keys it inserted in ``created``); returns
        the keys it has not asked about."""
        memo = txn.memo.get(self)
        if not memo:
            return keys
        rest: list[IK] = []
        for key in keys:
            known = memo.get(key, _UNASKED)
            if known is _UNASKED:
                rest.append(key)
            elif known is not None:
                result[key] = known[0]
                if known[1] and created is not None:
                    created.add(key)
        return rest

    def intern(self, txn: Transaction, keys: Iterable[IK], created: set[IK] | None = None) -> dict[IK, int]:
        """The nids of ``keys``, inserting those not interned yet.

        ``created``, if given, receives the keys this transaction inserted
        (in this call or an earlier one of it): nothing stored before the
        transaction can refer to their nids.
        """
        found: dict[IK, int]
        missing: list[IK]
        if not txn.engine.single_writer:
            # Insert what the cache does not know straight away: keys stored
            # already (or by another writer meanwhile) conflict and come back
            # from the SELECT after (or not at all, if their commit is newer
            # than our snapshot: then start again). One statement fewer than
            # looking first, when the keys are new as they mostly are.
            result, missing = self._to_nid.split(keys)
            if missing:
                missing = self._recall(txn, missing, result, created)
            missing.sort()
            if not missing:
                return result
            inserted = txn.insert_many(
                self.table,
                self.key_columns,
                [self._as_row(k) for k in missing],
                on_conflict="ON CONFLICT DO NOTHING",
                returning=f"{', '.join(self.key_columns)}, {self.nid_column}",
            )
            single = len(self.key_columns) == 1
            found = {(r[0] if single else self._key(r[:-1])): r[-1] for r in inserted or ()}
            ours = set(found)
            others = [k for k in missing if k not in found]
            if others:
                found.update(self._select(txn, others))
        else:
            # The only writer (SQLite's BEGIN IMMEDIATE), and lookup() ran in
            # this transaction: every missing key is ours to insert, with nids
            # chosen here so no SELECT is needed to learn them.
            wanted = list(dict.fromkeys(keys))
            result = self.lookup(txn, wanted)
            if created is not None:
                self._recall(txn, [k for k in wanted if k in result], {}, created)
            missing = sorted(k for k in wanted if k not in result)
            if not missing:
                return result
            nids = txn.allocate_ids(self.table, self.nid_column, len(missing))
            found = dict(zip(missing, nids, strict=True))
            # mypy loses the constrained type variable in this comprehension (its "Cannot determine type").
            rows = [(nid, *self._as_row(key)) for key, nid in found.items()]  # type: ignore[has-type]
            txn.insert_many(self.table, (self.nid_column, *self.key_columns), rows)
            ours = set(found)
        if len(found) != len(missing):
            raise RetryTransaction(f"{self.table}: concurrent insert of {len(missing) - len(found)} keys")
        if created is not None:
            created.update(ours)
        result.update(found)
        txn.memo.setdefault(self, {}).update((key, (nid, key in ours)) for key, nid in found.items())
        # The cache learns them at commit; until then ``resolve`` finds them here.
        txn.memo.setdefault((self, "keys"), {}).update((nid, key) for key, nid in found.items())
        txn.call_after(self._remember, found)
        return result

    def _recall_keys(self, txn: Transaction, nids: list[int], result: dict[int, IK]) -> list[int]:
        """The keys of ``nids`` this transaction interned (not cached before
        its commit) put in ``result``; returns the other nids."""
        inserted = txn.memo.get((self, "keys"))
        if not inserted:
            return nids
        rest = []
        for nid in nids:
            key = inserted.get(nid)
            if key is None:
                rest.append(nid)
            else:
                result[nid] = key
        return rest

    def _fetch_keys(
        self, txn: Transaction, nids: Sequence[int], remember: bool = True, exact: bool = True
    ) -> dict[int, IK]:
        """The keys of ``nids`` from the table (learned by the cache after
        commit, with ``remember``). Nids close together (at least half of
        the range between the least and the greatest, as a page of a stream
        written in order has them) are read as that range, one index range
        scan, rather than looked up one by one; ``exact=False``: the answer
        may also hold other nids of that range (for a caller that looks up
        only its own)."""
        cols = ", ".join(self.key_columns)
        fetched: dict[int, IK] = {}
        low, high = min(nids), max(nids)
        if len(nids) > 8 and high - low < 2 * len(nids):
            rows = txn.execute(
                f"SELECT {self.nid_column}, {cols} FROM {self.table}"
                f" WHERE {self.nid_column} >= ? AND {self.nid_column} <= ?",
                (low, high),
            ).fetchall()
            fetched = dict(rows) if len(self.key_columns) == 1 else {row[0]: self._key(row[1:]) for row in rows}
            if exact or remember:
                fetched = {nid: fetched[nid] for nid in nids if nid in fetched}
        else:
            for part in chunks(nids):
                marks = ", ".join("?" for _ in part)
                rows = txn.execute(
                    f"SELECT {self.nid_column}, {cols} FROM {self.table} WHERE {self.nid_column} IN ({marks})",
                    list(part),
                ).fetchall()
                for row in rows:
                    fetched[row[0]] = row[1] if len(self.key_columns) == 1 else self._key(row[1:])
        if remember:
            txn.call_after(self._remember, {k: n for n, k in fetched.items()})
        return fetched

    def resolve(self, txn: Transaction, nids: Iterable[int]) -> dict[int, IK]:
        """The keys of interned ``nids`` (those not interned are left out)."""
        result, missing = self._to_key.split(nids)
        if missing:
            missing = self._recall_keys(txn, missing, result)
        if missing:
            result.update(self._fetch_keys(txn, missing))
        return result

    def resolve_list(self, txn: Transaction, nids: Sequence[int], remember: bool = True) -> list[IK]:
        """The keys of ``nids``, in the same order (duplicates allowed).

        Raises ``KeyError`` for an nid that is not interned. When the cache
        holds them all (as in a running server) this is one bulk lookup.
        ``remember=False``: keys read from the table are not cached (a
        replication catch-up through old history would otherwise push out
        what the writer uses).
        """
        keys, missing = self._to_key.values_of(nids)
        if missing:
            fetched = self._fetch_keys(txn, sorted({nids[index] for index in missing}), remember, exact=False)
            if len(missing) == len(nids):  # none cached: in one C call
                return list(map(fetched.__getitem__, nids))
            for index in missing:
                keys[index] = fetched[nids[index]]
        return cast("list[IK]", keys)  # every None filled in from fetched

    def cached_nid(self, key: IK) -> int | None:
        """The nid if it is in the cache; never touches the database."""
        return self._to_nid.get(key)

    def forget_all(self) -> None:
        """Drop both caches: a purge deleted rows of this table, whose nids
        SQLite may give out again."""
        self._to_nid.clear()
        self._to_key.clear()


class Interners:
    """The store's interning tables, one ``Interner`` each."""

    def __init__(self, cache_size: int = 100_000):
        self.rooms: Interner[str] = Interner("rooms", "room_nid", ["room_id"], cache_size)
        self.events: Interner[str] = Interner("event_ids", "event_nid", ["event_id"], cache_size)
        self.users: Interner[str] = Interner("users", "user_nid", ["user_id"], cache_size)
        self.state_keys: Interner[tuple[str, str]] = Interner(
            "state_keys", "type_key_nid", ["type", "state_key"], cache_size
        )


# ---------------------------------------------------------------------- the interning tables in others' SQL
#
# This module owns ``rooms``, ``event_ids``, ``users`` and ``state_keys``:
# every statement naming them is here. A statement of another owner that
# joins one of them embeds the fragment below (aliases are the caller's).
# ``rooms`` also carries three columns the event store keeps (the room
# version, the newest timeline position ``activity``, the current state
# group): read and written only through the functions below.


def join_event_ids(alias: str, nid_expr: str, kind: str = "JOIN") -> str:
    """``JOIN event_ids AS alias`` on the event nid ``nid_expr``."""
    return f"{kind} event_ids AS {alias} ON {alias}.event_nid = {nid_expr}"


def join_rooms(alias: str, nid_expr: str, kind: str = "JOIN") -> str:
    """``JOIN rooms AS alias`` on the room nid ``nid_expr``."""
    return f"{kind} rooms AS {alias} ON {alias}.room_nid = {nid_expr}"


def join_users(alias: str, nid_expr: str) -> str:
    """``JOIN users AS alias`` on the user nid ``nid_expr``."""
    return f"JOIN users AS {alias} ON {alias}.user_nid = {nid_expr}"


def join_state_keys(alias: str, nid_expr: str) -> str:
    """``JOIN state_keys AS alias`` on the key nid ``nid_expr``."""
    return f"JOIN state_keys AS {alias} ON {alias}.type_key_nid = {nid_expr}"


def rooms_as(alias: str) -> str:
    """``rooms AS alias``: the FROM item of a statement about rooms rows."""
    return f"rooms AS {alias}"


def event_id_sql(nid_expr: str, alias: str = "") -> str:
    """A scalar subquery: the event ID of the event nid ``nid_expr``."""
    if not alias:
        return f"(SELECT event_id FROM event_ids WHERE event_nid = {nid_expr})"
    return f"(SELECT {alias}.event_id FROM event_ids AS {alias} WHERE {alias}.event_nid = {nid_expr})"


def state_key_sql(nid_expr: str) -> str:
    """A scalar subquery: the state key of the (type, state key) nid ``nid_expr``."""
    return f"(SELECT state_key FROM state_keys WHERE type_key_nid = {nid_expr})"


def event_nid_sql(alias: str) -> str:
    """A scalar subquery: the nid of the event ID bound to its ``?``."""
    return f"(SELECT {alias}.event_nid FROM event_ids AS {alias} WHERE {alias}.event_id = ?)"


def room_nids_sql(alias: str, count: int) -> str:
    """A subquery: the nids of ``count`` room IDs bound to its ``?``s."""
    marks = ", ".join("?" for _ in range(count))
    return f"SELECT {alias}.room_nid FROM rooms AS {alias} WHERE {alias}.room_id IN ({marks})"


def key_nids_of_types_txn(txn: Transaction, types: Sequence[str]) -> list[int]:
    """The interned key nids of every state key of ``types``."""
    nids: list[int] = []
    for part in chunks(list(types)):
        marks = ", ".join("?" for _ in part)
        nids += [
            r[0]
            for r in txn.execute(f"SELECT type_key_nid FROM state_keys WHERE type IN ({marks})", list(part)).fetchall()
        ]
    return nids


def room_ids_txn(txn: Transaction) -> list[str]:
    """Every interned room ID, in the order the rooms were first seen."""
    return [r[0] for r in txn.execute("SELECT room_id FROM rooms ORDER BY room_nid").fetchall()]


def room_versions_txn(txn: Transaction, room_ids: Sequence[str]) -> dict[str, str]:
    """room_id -> version of the rooms among ``room_ids`` with a stored create event."""
    result = {}
    for part in chunks(list(room_ids)):
        marks = ", ".join("?" for _ in part)
        for room_id, version in txn.execute(
            f"SELECT room_id, room_version FROM rooms WHERE room_id IN ({marks}) AND room_version IS NOT NULL",
            list(part),
        ).fetchall():
            result[room_id] = version
    return result


def rooms_and_versions_txn(txn: Transaction, room_ids: Collection[str]) -> dict[str, tuple[int, str | None]]:
    """room_id -> (room_nid, room version or None) of the interned ``room_ids``."""
    rooms: dict[str, tuple[int, str | None]] = {}
    for part in chunks(sorted(room_ids)):
        marks = ", ".join("?" for _ in part)
        for room_id, room_nid, version in txn.execute(
            f"SELECT room_id, room_nid, room_version FROM rooms WHERE room_id IN ({marks})", list(part)
        ).fetchall():
            rooms[room_id] = (room_nid, version)
    return rooms


def queue_room_version(txn: Transaction, room_nid: int, version: str) -> None:
    """Queue: the room's version, learned from its create event."""
    txn.queue("UPDATE rooms SET room_version = ? WHERE room_nid = ?", (version, room_nid))


def queue_current_state_group(txn: Transaction, room_nid: int, group: int) -> None:
    """Queue: the state group of the room's current state."""
    txn.queue("UPDATE rooms SET current_state_group = ? WHERE room_nid = ?", (group, room_nid))


def queue_activity(txn: Transaction, room_nid: int, stream: int) -> None:
    """Queue: ``rooms.activity`` up to ``stream`` (it only grows)."""
    txn.queue(
        "UPDATE rooms SET activity = ? WHERE room_nid = ? AND (activity IS NULL OR activity < ?)",
        (stream, room_nid, stream),
    )


def lock_room_txn(txn: Transaction, room_nid: int) -> bool:
    """Take the room's row for the rest of the transaction (a purge): on
    PostgreSQL a batch writing to the room (which moves ``activity``) then
    waits for it, and one that committed since the transaction began makes
    it fail and be retried. False when the room has no row."""
    txn.execute("UPDATE rooms SET activity = activity WHERE room_nid = ?", (room_nid,))
    return txn.rowcount > 0


def delete_room_txn(txn: Transaction, room_nid: int) -> int:
    """Delete the room's row (a purged room: nothing names its nid any more)."""
    txn.execute("DELETE FROM rooms WHERE room_nid = ?", (room_nid,))
    return max(txn.rowcount, 0)


def current_state_group_txn(txn: Transaction, room_nid: int) -> int | None:
    """The state group the room's current state mirrors (None: none yet)."""
    group: int | None = txn.select_one_value("SELECT current_state_group FROM rooms WHERE room_nid = ?", (room_nid,))
    return group


def delete_event_ids_txn(txn: Transaction, nids: Sequence[int]) -> int:
    """Delete the event IDs ``nids`` (a purged room's, that no row names any more)."""
    deleted = 0
    for part in chunks(sorted(nids)):
        marks = ", ".join("?" for _ in part)
        txn.execute(f"DELETE FROM event_ids WHERE event_nid IN ({marks})", list(part))
        deleted += max(txn.rowcount, 0)
    return deleted
