"""Realistic state groups for the compaction benchmark and tests.

Rooms are simulated the way a homeserver persists state: every state event
makes a new group stored as a delta against the group before it, and a full
snapshot once the chain would pass ``max_chain_length`` hops (100, Synapse's
limit). Many small rooms and a few large ones with heavy membership churn
(users joining and leaving, some "hot" users - bridges, bots - over and over),
occasional other state (topic, power levels...), and forks: two concurrent
branches whose groups interleave in id order until a merge group resolves
them. Rooms are active at the same time, so their group ids interleave as in
a real database. State keys are never removed (Matrix state only grows), so
the same data fits Synapse's tables, which cannot express a removal.

The data is written straight into roomstore's tables (``rooms``,
``state_keys``, ``event_ids``, ``state_groups``, ``state_group_deltas``) and,
optionally, into Synapse-shaped tables (``state_groups``,
``state_group_edges``, ``state_groups_state``) in another PostgreSQL database:
the same logical groups with the same ids, keys and event IDs.

Everything is deterministic for a seed, and one room can be regenerated on
its own (:func:`room_entries`) to verify a database after compaction.

    info = load_dataset("small", roomstore_url=URL, synapse_url=URL2)
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from roomstore.compaction.model import StateGroupEntry
from roomstore.compaction.roomstore_sql import ANY_GROUP, ROOM_DELTAS, ROOM_GROUPS
from roomstore.state.group_tables import (
    MAX_STATE_GROUP,
    bulk_insert_groups,
    group_rows,
    move_group_ids_past,
)
from roomstore.storage.database import Transaction
from roomstore.storage.engines import Engine, engine_from_url
from roomstore.storage.schema import prepare_database

Key = tuple[str, str]  # (type, state_key)

#: Synapse's MAX_STATE_DELTA_HOPS, and the store's default.
PERSIST_MAX_CHAIN = 100
#: Event ids per group position: a room's first group sets several keys.
EVENTS_PER_GROUP = 8

_OTHER_KEYS: Sequence[Key] = (
    ("m.room.power_levels", ""),
    ("m.room.topic", ""),
    ("m.room.name", ""),
    ("m.room.avatar", ""),
    ("m.room.join_rules", ""),
    ("m.room.history_visibility", ""),
    ("m.room.guest_access", ""),
    ("m.room.canonical_alias", ""),
    ("m.room.pinned_events", ""),
    ("im.vector.modular.widgets", "jitsi"),
    ("m.space.parent", "!space:example.org"),
)


@attrs.frozen
class RoomShape:
    """A kind of room and how many of it a dataset has."""

    name: str
    count: int
    groups: int  # state groups per room
    users: int  # distinct users who ever take part
    hot_users: int  # users who join and leave over and over (bridges, bots)
    hot_share: float  # share of membership events by hot users
    other_share: float  # share of non-membership state events
    fork_rate: float  # chance a step opens two concurrent branches


SIZES: dict[str, tuple[RoomShape, ...]] = {
    # Tests: a few seconds to load, still with forks and snapshots.
    "tiny": (
        RoomShape("dm", 6, 30, 6, 2, 0.3, 0.15, 0.05),
        RoomShape("busy", 2, 500, 150, 12, 0.35, 0.05, 0.03),
    ),
    "small": (
        RoomShape("chat", 400, 60, 30, 4, 0.3, 0.10, 0.03),
        RoomShape("bridged", 2, 8_000, 3_000, 60, 0.35, 0.02, 0.01),
        RoomShape("federated", 1, 6_000, 2_000, 40, 0.20, 0.05, 0.05),
    ),
    # More than five million state rows.
    "large": (
        RoomShape("chat", 4_000, 80, 30, 4, 0.3, 0.10, 0.03),
        RoomShape("bridged", 3, 30_000, 6_000, 150, 0.35, 0.02, 0.01),
        RoomShape("federated", 1, 25_000, 5_000, 100, 0.20, 0.05, 0.05),
        RoomShape("community", 2, 15_000, 4_000, 60, 0.10, 0.10, 0.02),
    ),
}


def event_id_for(event_nid: int) -> str:
    """A 44-character event ID that encodes ``event_nid`` (see :func:`event_nid_of`)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(str(event_nid).encode()).digest()).decode()
    return f"${event_nid:012d}{digest[:31]}"


def event_nid_of(event_id: str) -> int:
    return int(event_id[1:13])


def room_id_for(shape: RoomShape, index: int) -> str:
    return f"!{shape.name}{index}:example.org"


def member_key(user: int) -> Key:
    return ("m.room.member", f"@user{user}:hs{user % 7}.example.org")


@attrs.frozen
class DatasetSpec:
    """Which rooms, in what order their groups were created, and the id bases."""

    shapes: tuple[RoomShape, ...]
    seed: int
    max_chain_length: int
    first_group: int
    first_event: int

    def rooms(self) -> list[tuple[RoomShape, int]]:
        out = []
        for shape in self.shapes:
            out += [(shape, i) for i in range(shape.count)]
        return out

    def schedule(self) -> list[int]:
        """Room index of each group position (interleaved rooms)."""
        order: list[int] = []
        for index, (shape, _) in enumerate(self.rooms()):
            order += [index] * shape.groups
        random.Random(self.seed).shuffle(order)
        return order


class _RoomSim:
    """One room's state, persisted group by group like a homeserver does."""

    def __init__(self, shape: RoomShape, index: int, spec: DatasetSpec) -> None:
        self.shape = shape
        self.rng = random.Random(f"{spec.seed}/{shape.name}/{index}")
        self.max_chain = spec.max_chain_length
        # Users of this room come from a shared pool, so rooms share members.
        self.user_base = index * 7919 + len(shape.name) * 104729
        self.states: dict[int, dict[Key, int]] = {}  # live tips only
        self.depth: dict[int, int] = {}
        self.head: int | None = None
        self.fork: dict[str, Any] | None = None

    def _user(self) -> int:
        s, rng = self.shape, self.rng
        if rng.random() < s.hot_share:
            u = rng.randrange(max(1, s.hot_users))
        else:
            u = rng.randrange(max(1, s.users))
        return (self.user_base + u) % 1_000_003

    def _change(self, event: int) -> dict[Key, int]:
        if self.rng.random() < self.shape.other_share:
            return {self.rng.choice(_OTHER_KEYS): event}
        return {member_key(self._user()): event}

    def _store(self, group: int, parent: int | None, state: dict[Key, int], change: Mapping[Key, int]):
        if parent is None or self.depth[parent] + 1 > self.max_chain:
            self.depth[group] = 0
            return None, 0, dict(state)
        self.depth[group] = self.depth[parent] + 1
        return parent, self.depth[group], dict(change)

    def step(self, group: int, events: int) -> tuple[int | None, int, dict[Key, int]]:
        """Make group ``group`` (``events``: its first event nid); returns
        ``(prev_group, chain_length, delta)``."""
        rng = self.rng
        if self.head is None:
            state = {("m.room.create", ""): events}
            for j, key in enumerate(
                (
                    ("m.room.power_levels", ""),
                    ("m.room.join_rules", ""),
                    ("m.room.history_visibility", ""),
                    member_key(self.user_base % 1_000_003),
                ),
                1,
            ):
                state[key] = events + j
            prev, length, delta = self._store(group, None, state, state)
            self.states[group] = state
            self.head = group
            return prev, length, delta
        if self.fork is None and rng.random() < self.shape.fork_rate:
            self.fork = {"tips": [self.head, self.head], "left": rng.randint(2, 10)}
        if self.fork is not None:
            fork = self.fork
            if fork["left"] > 0:
                fork["left"] -= 1
                side = rng.randrange(2)
                tip = fork["tips"][side]
                shared = fork["tips"][0] == fork["tips"][1]
                state = dict(self.states[tip]) if shared else self.states.pop(tip)
                change = self._change(events)
                state.update(change)
                stored = self._store(group, tip, state, change)
                fork["tips"][side] = group
                self.states[group] = state
                return stored
            # The merge: state resolution keeps ours and takes their differing keys.
            ours_id, theirs_id = fork["tips"]
            ours = self.states.pop(ours_id)
            theirs = self.states.pop(theirs_id, ours)
            merged = dict(ours)
            change = {k: v for k, v in theirs.items() if ours.get(k) != v}
            merged.update(change)
            stored = self._store(group, ours_id, merged, change)
            self.states[group] = merged
            self.head = group
            self.fork = None
            return stored
        state = self.states.pop(self.head)
        change = self._change(events)
        state.update(change)
        stored = self._store(group, self.head, state, change)
        self.states[group] = state
        self.head = group
        return stored


@attrs.frozen
class GeneratedGroup:
    room_index: int
    state_group: int
    event_nid: int  # the event that made it
    events_used: int  # event nids event_nid.. it introduced (a room's first group sets several keys)
    prev_group: int | None
    chain_length: int
    delta: Mapping[Key, int]


def make_spec(
    size: str = "small",
    seed: int = 1,
    *,
    max_chain_length: int = PERSIST_MAX_CHAIN,
    first_group: int = 1,
    first_event: int = 1,
    shapes: Sequence[RoomShape] | None = None,
) -> DatasetSpec:
    return DatasetSpec(tuple(shapes or SIZES[size]), seed, max_chain_length, first_group, first_event)


def room_positions(spec: DatasetSpec) -> list[list[int]]:
    """For each room, the schedule positions of its groups (compute once,
    then regenerate rooms one by one with :func:`room_entries`)."""
    positions: list[list[int]] = [[] for _ in spec.rooms()]
    for position, room_index in enumerate(spec.schedule()):
        positions[room_index].append(position)
    return positions


def generate(
    spec: DatasetSpec, only_room: int | None = None, positions: Sequence[int] | None = None
) -> Iterator[GeneratedGroup]:
    """The dataset's groups in id order (or only those of room ``only_room``,
    whose schedule positions may be given to save replaying the schedule)."""
    rooms = spec.rooms()
    sims: dict[int, _RoomSim] = {}
    if only_room is not None:
        if positions is None:
            positions = [p for p, r in enumerate(spec.schedule()) if r == only_room]
        schedule: Iterator[tuple[int, int]] = ((p, only_room) for p in positions)
    else:
        schedule = enumerate(spec.schedule())
    for position, room_index in schedule:
        sim = sims.get(room_index)
        if sim is None:
            shape, i = rooms[room_index]
            sim = sims[room_index] = _RoomSim(shape, i, spec)
        group = spec.first_group + position
        events = spec.first_event + position * EVENTS_PER_GROUP
        first = sim.head is None
        prev, length, delta = sim.step(group, events)
        yield GeneratedGroup(room_index, group, events, 5 if first else 1, prev, length, delta)


def room_entries(
    spec: DatasetSpec, room_index: int, key_ids: Mapping[Key, int], positions: Sequence[int] | None = None
) -> list[StateGroupEntry]:
    """Room ``room_index``'s groups as generated, with interned key ids (for
    :func:`roomstore.compaction.verify`); ``positions`` from :func:`room_positions`."""
    return [
        StateGroupEntry(g.state_group, g.prev_group, {key_ids[k]: e for k, e in g.delta.items()})
        for g in generate(spec, room_index, positions)
    ]


# ---------------------------------------------------------------------------
# loading


def prepare_roomstore_schema(url: str) -> None:
    """Create (or upgrade) roomstore's schema without a reactor."""

    class _Quiet:
        def _count_query(self) -> None:
            pass

    engine = engine_from_url(url)
    conn = engine.connect()
    try:
        cur = conn.cursor()
        engine.begin(cur)
        prepare_database(Transaction(_Quiet(), engine, cur, "prepare"))
        conn.commit()
    finally:
        conn.close()


SYNAPSE_SCHEMA = """
CREATE TABLE IF NOT EXISTS state_groups (id BIGINT PRIMARY KEY, room_id TEXT NOT NULL, event_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS state_group_edges (state_group BIGINT NOT NULL, prev_state_group BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS state_groups_state (
    state_group BIGINT NOT NULL, room_id TEXT NOT NULL, type TEXT NOT NULL, state_key TEXT NOT NULL,
    event_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS state_group_edges_unique_idx ON state_group_edges (state_group, prev_state_group);
CREATE INDEX IF NOT EXISTS state_group_edges_prev_idx ON state_group_edges (prev_state_group);
CREATE INDEX IF NOT EXISTS state_groups_room_id_idx ON state_groups (room_id);
CREATE INDEX IF NOT EXISTS state_groups_state_type_idx ON state_groups_state (state_group, type, state_key);
"""


def prepare_synapse_schema(url: str) -> None:
    """The Synapse tables the compressor reads and writes (PostgreSQL), with Synapse's indexes."""
    conn = engine_from_url(url).connect()
    try:
        cur = conn.cursor()
        for statement in SYNAPSE_SCHEMA.split(";"):
            if statement.strip():
                cur.execute(statement)
        conn.commit()
    finally:
        conn.close()


class _Sink:
    """Buffered bulk writes into one database (the engine's bulk insert);
    state groups through their owner (:func:`roomstore.state.groups.bulk_insert_groups`)."""

    def __init__(self, engine: Engine, flush_rows: int = 200_000) -> None:
        self.engine = engine
        self.conn = engine.connect()
        self.flush_rows = flush_rows
        self.buffers: dict[tuple[str, str], list[tuple]] = {}
        self.groups: list[tuple] = []
        self.deltas: list[tuple] = []
        self.pending = 0

    def add(self, table: str, columns: str, row: tuple) -> None:
        self.buffers.setdefault((table, columns), []).append(row)
        self._added(1)

    def add_group(self, row: tuple, deltas: list[tuple]) -> None:
        """One roomstore state group: :func:`roomstore.state.groups.group_rows`' rows."""
        self.groups.append(row)
        self.deltas.extend(deltas)
        self._added(1 + len(deltas))

    def _added(self, rows: int) -> None:
        self.pending += rows
        if self.pending >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        cur = self.conn.cursor()
        self.engine.begin(cur)
        for (table, columns), rows in self.buffers.items():
            self.engine.bulk_insert(cur, table, columns, rows, _copy_text)
        if self.groups:
            bulk_insert_groups(self.engine, cur, self.groups, self.deltas, _copy_text)
        self.conn.commit()
        cur.close()
        self.buffers = {}
        self.groups, self.deltas = [], []
        self.pending = 0


def _copy_text(value: Any) -> str:
    if isinstance(value, str):
        return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
    return str(value)


@attrs.define
class DatasetInfo:
    """What :func:`load_dataset` wrote."""

    spec: DatasetSpec
    rooms: list[tuple[str, int]]  # (room_id, room_nid) by room index
    key_ids: dict[Key, int]
    state_groups: int = 0
    rows: int = 0
    first_group: int = 0
    last_group: int = 0

    def room_index(self, room_id: str) -> int:
        return [r for r, _ in self.rooms].index(room_id)


#: The interned tables the loader continues (table, id column); state groups through their owner.
_INTERNED = (("event_ids", "event_nid"), ("state_keys", "type_key_nid"), ("rooms", "room_nid"))


@attrs.define
class _Next:
    """The next free ids of a roomstore database, and its interned keys."""

    group: int = 1
    event: int = 1
    key: int = 1
    room: int = 1
    key_ids: dict[Key, int] = attrs.Factory(dict)


def _next_ids(ours: _Sink) -> _Next:
    """What the roomstore database holds already: new ids continue after it."""
    cur = ours.conn.cursor()
    q = ours.engine.convert_sql
    cur.execute(q(MAX_STATE_GROUP))
    tops = [cur.fetchone()[0]]
    for table, column in _INTERNED:
        cur.execute(q(f"SELECT COALESCE(MAX({column}), 0) FROM {table}"))
        tops.append(cur.fetchone()[0])
    cur.execute("SELECT type, state_key, type_key_nid FROM state_keys")
    key_ids = {(t, s): n for t, s, n in cur.fetchall()}
    ours.conn.commit()
    return _Next(*(top + 1 for top in tops), key_ids=key_ids)


def _add_roomstore_group(ours: _Sink, ids: _Next, g: GeneratedGroup, room_nid: int) -> None:
    """One generated group into roomstore's tables: its new keys, its event
    ids, and the group through the state tables' owner."""
    key_ids = ids.key_ids
    delta = {}
    for key, ev in g.delta.items():
        nid = key_ids.get(key)
        if nid is None:
            nid = key_ids[key] = ids.key
            ours.add("state_keys", "type_key_nid, type, state_key", (nid, key[0], key[1]))
            ids.key += 1
        delta[nid] = ev
    for ev in range(g.event_nid, g.event_nid + g.events_used):
        ours.add("event_ids", "event_nid, event_id", (ev, event_id_for(ev)))
    ours.add_group(*group_rows(g.state_group, room_nid, g.event_nid, g.prev_group, g.chain_length, delta))


def _add_synapse_group(theirs: _Sink, g: GeneratedGroup, room_id: str) -> None:
    """One generated group into Synapse-shaped tables."""
    theirs.add("state_groups", "id, room_id, event_id", (g.state_group, room_id, event_id_for(g.event_nid)))
    if g.prev_group is not None:
        theirs.add("state_group_edges", "state_group, prev_state_group", (g.state_group, g.prev_group))
    for (etype, skey), ev in g.delta.items():
        theirs.add(
            "state_groups_state",
            "state_group, room_id, type, state_key, event_id",
            (g.state_group, room_id, etype, skey, event_id_for(ev)),
        )


def _close_roomstore(ours: _Sink) -> None:
    """After the last flush: the database's generated ids continue after the loaded ones."""
    cur = ours.conn.cursor()
    move_group_ids_past(ours.engine, cur)
    for table, column in _INTERNED:
        ours.engine.move_sequence_past(cur, table, column)
    ours.conn.commit()
    ours.conn.close()


def load_dataset(
    size: str = "small",
    *,
    roomstore_url: str | None = None,
    synapse_url: str | None = None,
    seed: int = 1,
    max_chain_length: int = PERSIST_MAX_CHAIN,
    shapes: Sequence[RoomShape] | None = None,
) -> DatasetInfo:
    """Generate a dataset and write it into roomstore's tables and/or Synapse's.

    The roomstore database must have the roomstore schema (see
    :func:`prepare_roomstore_schema`); existing rows stay, new ids continue
    after the current maxima, and PostgreSQL sequences are moved past them.
    With both URLs the two databases hold the same groups under the same ids.
    """
    ours = _Sink(engine_from_url(roomstore_url)) if roomstore_url is not None else None
    ids = _next_ids(ours) if ours is not None else _Next()
    spec = make_spec(
        size, seed, max_chain_length=max_chain_length, first_group=ids.group, first_event=ids.event, shapes=shapes
    )
    rooms = [(room_id_for(shape, i), ids.room + n) for n, (shape, i) in enumerate(spec.rooms())]
    info = DatasetInfo(spec, rooms, ids.key_ids, first_group=ids.group)
    theirs = _Sink(engine_from_url(synapse_url)) if synapse_url is not None else None
    if ours is not None:
        for room_id, nid in rooms:
            ours.add("rooms", "room_nid, room_id, room_version", (nid, room_id, "10"))
    for g in generate(spec):
        room_id, room_nid = rooms[g.room_index]
        info.state_groups += 1
        info.rows += len(g.delta)
        info.last_group = g.state_group
        if ours is not None:
            _add_roomstore_group(ours, ids, g, room_nid)
        if theirs is not None:
            _add_synapse_group(theirs, g, room_id)
    for sink in (ours, theirs):
        if sink is not None:
            sink.flush()
    if ours is not None:
        _close_roomstore(ours)
    if theirs is not None:
        theirs.conn.close()
    return info


def read_roomstore_room(url: str, room_nid: int) -> list[StateGroupEntry]:
    """A room's groups as stored in roomstore's tables now."""
    engine = engine_from_url(url)
    conn = engine.connect()
    try:
        cur = conn.cursor()
        q = engine.convert_sql
        cur.execute(q(ROOM_GROUPS), (room_nid, ANY_GROUP))
        prevs = {g: p for g, p, _ in cur.fetchall()}
        cur.execute(q(ROOM_DELTAS), (room_nid, ANY_GROUP))
        deltas: dict[int, dict[int, int | None]] = {g: {} for g in prevs}
        for g, k, e in cur.fetchall():
            deltas[g][k] = e
        conn.commit()
    finally:
        conn.close()
    return [StateGroupEntry(g, prevs[g], deltas[g]) for g in sorted(prevs)]


def read_synapse_room(url: str, room_id: str, key_ids: Mapping[Key, int]) -> list[StateGroupEntry]:
    """A room's groups as stored in Synapse's tables now, in roomstore's key ids."""
    engine = engine_from_url(url)
    conn = engine.connect()
    try:
        cur = conn.cursor()
        cur.execute(
            engine.convert_sql(
                "SELECT g.id, e.prev_state_group FROM state_groups g"
                " LEFT JOIN state_group_edges e ON e.state_group = g.id WHERE g.room_id = ?"
            ),
            (room_id,),
        )
        prevs = dict(cur.fetchall())
        cur.execute(
            engine.convert_sql(
                "SELECT s.state_group, s.type, s.state_key, s.event_id FROM state_groups_state s"
                " JOIN state_groups g ON g.id = s.state_group WHERE g.room_id = ?"
            ),
            (room_id,),
        )
        deltas: dict[int, dict[int, int | None]] = {g: {} for g in prevs}
        for g, t, s, e in cur.fetchall():
            deltas.setdefault(g, {})[key_ids[(t, s)]] = event_nid_of(e)
        conn.commit()
    finally:
        conn.close()
    return [StateGroupEntry(g, prevs.get(g), deltas[g]) for g in sorted(deltas)]
