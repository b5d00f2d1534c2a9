"""Event store figures on SQLite and PostgreSQL, side by side.

usage: bench/with-postgres .venv/bin/python bench/event_store.py [--size small|large] [--runs R] [--sections abcdef]
       [--in-flight K] [--validation-processes N] [--writer-process] [--switch-interval-ms MS]

The writer in (a) and (f) is driven with K ``persist_events`` calls in flight
(default 1: each awaited before the next; more: a homeserver's writer with
several batches queued, the next validated while one is written) and the
store's ``validation_processes`` (default: the store's own default); the
first line printed says which, with the interpreter's switch interval and
the load average. Copied into an older checkout's bench/ (with _common.py)
and run there, the same file measures that code (K = 1 and the defaults
only): it puts its own checkout first on sys.path, so PYTHONPATH alone does
not.

(a) Persist throughput: events/s through ``persist_events`` in batches of 100
    (a linear room: 90% messages, 5% topic changes, 5% joins), against a raw
    batched INSERT of the very rows it wrote to ``events``, ``event_json`` and
    ``event_edges`` into plain copies of those tables (same columns, keys and
    indexes), one transaction per 100 events through the same pool. The raw
    figure is the floor of any design storing those rows; the ratio says how
    much the rest (validation and event IDs, interning, state groups,
    visibility, extremities, current state, stream IDs) costs. A second raw
    baseline re-inserts *every* row the timed batches wrote, in all tables,
    in as many transactions: it separates the cost of writing what the store
    keeps from the cost of working it out; it is run twice, with one INSERT
    statement per table and round trip, and with each batch's INSERTs sent
    in one round trip (``Transaction.queue``, as persist_events sends its
    writes; the same on SQLite, which has no round trips), and a third time
    the way each database bulk-loads fastest (``Transaction.copy_rows``:
    ``COPY ... FROM STDIN`` per table on PostgreSQL, one prepared
    ``executemany`` per table on SQLite), one transaction per batch; the
    fastest of the three is the baseline persist is held against. "validation alone" is
    ``prepare_events`` (parse, check, compute event IDs) in Python.
(b) Full-state lookup: ``get_state_ids`` of an event whose group holds 10,000
    entries at the end of a 100-hop delta chain (``max_state_chain_length=100``),
    with the state group cache cleared before each lookup; and, for scale, the
    same 10,000 entries one hop from their snapshot.
(c) Visibility: rows and bytes (tables + indexes) of the visibility tables for
    a room of 10,000 members after 10,000 messages; the messages must add
    no rows (on PostgreSQL autovacuum may add free-space/visibility map
    forks meanwhile: the table and index pages are shown apart).
(d) Bytes on disk per state entry (table + indexes: ``pg_total_relation_size``
    on PostgreSQL, the ``dbstat`` table on SQLite) of ``state_group_deltas``
    against a Synapse-shaped ``state_groups_state(state_group, room_id, type,
    state_key, event_id)`` with Synapse's ``(state_group, type, state_key)``
    index holding the same entries, written the same way (row by row as the
    groups are made) - the state of (c)'s room, realistic IDs.
(f) Reactor lateness during a sustained import: ``persist_events`` of a
    linear room (as in (a)) in batches of 100, back to back, while a probe
    on the same reactor asks to run every millisecond and records how late
    each call fires; p50, p99 and max lateness per engine (median over the
    runs), beside the probe alone on an idle reactor. Work done on the
    reactor thread shows up here, and so does Python another thread of the
    process runs meanwhile (validation, the transaction's own code): the
    reactor waits for the GIL up to the switch interval each time it needs
    it back. ``--size large`` imports 50,000 events. What the run made before
    the import (the store, the workload) is frozen out of the cyclic
    collector's generations first (``gc.freeze``), as ``roomstore serve``
    does once started; ``BENCH_FREEZE=0`` leaves it in (then full
    collections walking it stall the reactor tens of milliseconds).
(e) Sync cost: database statements issued by ``sync`` for a user in 20 rooms
    when nothing changed since the token, and when k of the rooms changed
    (k = 1, 5, 20), counted with ``Database.query_count``, with the time of
    each (median of R).

Timings are medians of R runs (fresh database each run for (a)); sizes are
measured once. ``--size small`` keeps the whole run to a few minutes.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import statistics
import string
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

from twisted.internet import defer, task

from bench._common import bench_databases, print_table
from roomstore.events.write.batch import prepare_events
from roomstore.storage.database import Database
from roomstore.storage.interning import chunks
from roomstore.storage.schema import SCHEMA_TABLES
from roomstore.store import RoomStore, StoreConfig
from tests.store.builder import RoomBuilder, fake_event_id

BATCH = 100
VISIBILITY_TABLES = tuple(t for t in SCHEMA_TABLES if t.startswith("visibility_"))
SIZES = {
    # (a) events per run, runs; (b) runs; (c) members, messages
    "small": {
        "persist_events": 2_000,
        "runs": 3,
        "lookup_runs": 5,
        "members": 10_000,
        "messages": 10_000,
        "lateness_events": 10_000,
    },
    "large": {
        "persist_events": 10_000,
        "runs": 5,
        "lookup_runs": 9,
        "members": 10_000,
        "messages": 10_000,
        "lateness_events": 50_000,
    },
}


#: How the writer is driven in (a) and (f) (``--in-flight``, ``--validation-processes``).
WRITER = {"in_flight": 1, "validation_processes": None, "writer_process": False}


async def open_writer(url: str) -> RoomStore:
    """A store for (a) and (f), with ``--validation-processes`` if given (an
    older checkout, without that setting, takes the default only)."""
    settings = (
        {} if WRITER["validation_processes"] is None else {"validation_processes": WRITER["validation_processes"]}
    )
    if WRITER["writer_process"]:
        settings["writer_process"] = True
    return await RoomStore.open(url, StoreConfig(**settings)) if settings else await RoomStore.open(url)


async def persist_all(store: RoomStore, events) -> None:
    """``events`` persisted in batches of ``BATCH``, ``--in-flight`` calls at
    a time (1: each awaited before the next, as any version allows; more:
    the next batches given while earlier ones are written, which the writer
    orders as it was called)."""
    parts = list(chunks(events, BATCH))
    if WRITER["in_flight"] <= 1:
        for part in parts:
            await store.persist_events(part)
        return
    pending: list = []
    for part in parts:
        pending.append(defer.ensureDeferred(store.persist_events(part)))
        if len(pending) >= WRITER["in_flight"]:
            await pending.pop(0)
    for waiting in pending:
        await waiting


def realistic_room_id(rng: random.Random) -> str:
    return "!" + "".join(rng.choice(string.ascii_letters) for _ in range(18)) + ":matrix.org"


def user(i: int) -> str:
    return f"@user{i}:example.org"


# ---------------------------------------------------------------------- sizes


def table_bytes_txn(txn, tables, main_forks: bool = False) -> int:
    """Bytes on disk of ``tables`` with their indexes.

    ``main_forks`` (PostgreSQL): leave out the free-space and visibility map
    forks, which autovacuum adds at its own moments whatever the rows.
    """
    if txn.engine.name == "postgres" and main_forks:
        return sum(
            txn.select_one_value(
                "SELECT pg_relation_size(?) + COALESCE((SELECT SUM(pg_relation_size(indexrelid)) FROM pg_index"
                " WHERE indrelid = CAST(? AS regclass)), 0)",
                (t, t),
            )
            for t in tables
        )
    if txn.engine.name == "postgres":
        return sum(txn.select_one_value("SELECT pg_total_relation_size(?)", (t,)) for t in tables)
    total = 0
    for table in tables:
        names = [
            r[0]
            for r in txn.execute(
                "SELECT name FROM sqlite_master WHERE tbl_name = ? AND type IN ('table', 'index')", (table,)
            ).fetchall()
        ]
        marks = ", ".join("?" for _ in names)
        total += txn.select_one_value(f"SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name IN ({marks})", names)
    return total


def count_txn(txn, table) -> int:
    return txn.select_one_value(f"SELECT COUNT(*) FROM {table}")


# ---------------------------------------------------------------------- (a)


def persist_workload(n: int, seed: int = 1):
    rng = random.Random(seed)
    room = RoomBuilder(room_id=realistic_room_id(rng))
    setup = [room.create(), room.join(room.creator)] + [room.join(user(i)) for i in range(20)]
    members = [room.creator] + [user(i) for i in range(20)]
    events = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.90:
            events.append(room.message(rng.choice(members), f"message {i} " + "x" * rng.randint(10, 200)))
        elif roll < 0.95:
            events.append(room.state("m.room.topic", "", {"topic": f"topic {i}"}))
        else:
            members.append(user(1000 + i))
            events.append(room.join(members[-1]))
    return room, [room.to_persist(e) for e in setup], [room.to_persist(e) for e in events]


def _copy_tables_txn(txn, tables) -> None:
    for table in tables:
        if txn.engine.name == "postgres":
            txn.execute(f"CREATE TABLE raw_{table} (LIKE {table} INCLUDING ALL)")
            continue
        rows = txn.execute(
            "SELECT type, sql FROM sqlite_master WHERE tbl_name = ? AND sql IS NOT NULL ORDER BY type DESC", (table,)
        ).fetchall()
        for kind, sql in rows:  # the table first, then its indexes
            if kind == "table":
                sql = re.sub(r"^CREATE TABLE (\w+)", r"CREATE TABLE raw_\1", sql)
            else:
                sql = re.sub(r"^CREATE (UNIQUE )?INDEX (\w+) ON (\w+)", r"CREATE \1INDEX raw_\2 ON raw_\3", sql)
            txn.execute(sql)


def _rows_by_batch_txn(txn, first_stream: int):
    """The rows persist_events wrote for the timed events, grouped as they were batched."""

    def grouped(sql):
        out: dict[int, list] = {}
        for row in txn.execute(sql, (first_stream,)).fetchall():
            out.setdefault((row[0] - first_stream) // BATCH, []).append(row[1:])
        return out

    events = grouped("SELECT stream_ordering, * FROM events WHERE stream_ordering >= ? ORDER BY stream_ordering")
    json_rows = grouped(
        "SELECT e.stream_ordering, j.event_nid, j.room_version, j.json, j.censored FROM event_json AS j"
        " JOIN events AS e ON e.event_nid = j.event_nid WHERE e.stream_ordering >= ? ORDER BY e.stream_ordering"
    )
    edges = grouped(
        "SELECT e.stream_ordering, d.event_nid, d.prev_event_nid FROM event_edges AS d"
        " JOIN events AS e ON e.event_nid = d.event_nid WHERE e.stream_ordering >= ? ORDER BY e.stream_ordering"
    )
    if txn.engine.name == "sqlite":
        event_columns = [r[1] for r in txn.execute("PRAGMA table_info(events)").fetchall()]
    else:
        event_columns = [
            r[0]
            for r in txn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_name = 'events' ORDER BY ordinal_position"
            ).fetchall()
        ]
    return event_columns, [(events[i], json_rows[i], edges.get(i, [])) for i in sorted(events)]


def _raw_insert_txn(txn, event_columns, batch) -> None:
    events, json_rows, edges = batch
    txn.insert_many("raw_events", event_columns, events)
    txn.insert_many("raw_event_json", ("event_nid", "room_version", "json", "censored"), json_rows)
    txn.insert_many("raw_event_edges", ("event_nid", "prev_event_nid"), edges)


#: The schema's tables a batch never writes to (stream positions, instances, locks, compaction's,
#: embedder versions, client transaction IDs: the batches here carry none).
NOT_WRITTEN_BY_A_BATCH = frozenset(
    {"stream_positions", "instances", "maintenance_locks", "embedder_schema_versions", "client_txn_ids"}
)
#: Every table a batch writes to (the second raw baseline re-inserts all of it).
WRITTEN_TABLES = tuple(
    t for t in SCHEMA_TABLES if t not in NOT_WRITTEN_BY_A_BATCH and not t.startswith("state_compaction_")
)


def _snapshot_tables_txn(txn) -> None:
    for table in WRITTEN_TABLES:
        txn.execute(f"CREATE TABLE pre_{table} AS SELECT * FROM {table}")


def _new_rows_txn(txn) -> dict[str, tuple[list[str], list[tuple]]]:
    """Per table: (columns, rows present now and not before the timed run)."""
    out = {}
    for table in WRITTEN_TABLES:
        cursor_rows = txn.execute(f"SELECT * FROM {table} EXCEPT SELECT * FROM pre_{table}").fetchall()
        if txn.engine.name == "sqlite":
            columns = [r[1] for r in txn.execute(f"PRAGMA table_info({table})").fetchall()]
        else:
            columns = [
                r[0]
                for r in txn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
                    (table,),
                ).fetchall()
            ]
        out[table] = (columns, [tuple(r) for r in cursor_rows])
    return out


def _raw_insert_all_txn(txn, rows_by_table, part: int, parts: int, queue: bool = False) -> None:
    for table, (columns, rows) in rows_by_table.items():
        share = rows[part * len(rows) // parts : (part + 1) * len(rows) // parts]
        txn.insert_many(f"raw_{table}", columns, share, queue=queue)


def _copy_all_txn(txn, rows_by_table, part: int, parts: int) -> None:
    """The database's fastest bulk path: COPY per table on PostgreSQL, one executemany per table on SQLite."""
    for table, (columns, rows) in rows_by_table.items():
        txn.copy_rows(f"raw_{table}", columns, rows[part * len(rows) // parts : (part + 1) * len(rows) // parts])


async def persist_run(url: str, setup, events) -> tuple[float, float, float, int, float]:
    """(persist_events events/s, raw INSERT events/s of events+json+edges, raw
    INSERT events/s of every row written, rows written, the same with each
    batch's INSERTs in one round trip) on a fresh database."""
    store = await open_writer(url)
    # The baselines' own tables, written here: with --writer-process this
    # process's store is read-only, so they get a connection of their own.
    db = Database.from_url(url) if WRITER["writer_process"] else store.db
    try:
        await store.persist_events(setup)
        await db.run_interaction("snapshot", _snapshot_tables_txn)
        first_stream = store.events_stream.get_current_token() + 1
        start = time.perf_counter()
        await persist_all(store, events)
        persist_rate = len(events) / (time.perf_counter() - start)
        if not WRITER["writer_process"]:  # (the writer process's own positions are its to write)
            for gen in store.generators.values():
                await gen.flush()

        await db.run_interaction("copy", _copy_tables_txn, ("events", "event_json", "event_edges"))
        event_columns, batches = await db.run_interaction("rows", _rows_by_batch_txn, first_stream)
        assert sum(len(b[0]) for b in batches) == len(events)
        start = time.perf_counter()
        for batch in batches:
            await db.run_interaction("raw_insert", _raw_insert_txn, event_columns, batch)
        raw_rate = len(events) / (time.perf_counter() - start)

        new_rows = await db.run_interaction("new_rows", _new_rows_txn)
        others = [t for t in WRITTEN_TABLES if t not in ("events", "event_json", "event_edges")]
        await db.run_interaction("copy_all", _copy_tables_txn, others)
        await db.run_interaction(
            "truncate_raw",
            lambda t: [t.execute(f"DELETE FROM raw_{n}") for n in ("events", "event_json", "event_edges")],
        )
        parts = len(batches)
        start = time.perf_counter()
        for part in range(parts):
            await db.run_interaction("raw_insert_all", _raw_insert_all_txn, new_rows, part, parts)
        raw_all_rate = len(events) / (time.perf_counter() - start)
        # Once more with every table's INSERT sent in one round trip, as
        # persist_events sends its writes (Transaction.queue; PostgreSQL only).
        await db.run_interaction(
            "truncate_raw_all", lambda t: [t.execute(f"DELETE FROM raw_{n}") for n in WRITTEN_TABLES]
        )
        start = time.perf_counter()
        for part in range(parts):
            await db.run_interaction("raw_insert_all", _raw_insert_all_txn, new_rows, part, parts, True)
        raw_queued_rate = len(events) / (time.perf_counter() - start)
        # And with the engine's bulk load (Transaction.copy_rows: COPY on PostgreSQL).
        await db.run_interaction(
            "truncate_raw_all", lambda t: [t.execute(f"DELETE FROM raw_{n}") for n in WRITTEN_TABLES]
        )
        start = time.perf_counter()
        for part in range(parts):
            await db.run_interaction("copy_all", _copy_all_txn, new_rows, part, parts)
        copy_rate = len(events) / (time.perf_counter() - start)
        written = sum(len(rows) for _, rows in new_rows.values())
    finally:
        await store.close()
        if db is not store.db:
            await db.close()
    return persist_rate, raw_rate, raw_all_rate, written, raw_queued_rate, copy_rate


def validation_rate(room: RoomBuilder, events) -> float:
    start = time.perf_counter()
    for part in chunks(events, BATCH):
        prepare_events(part, {room.room_id: room.version})
    return len(events) / (time.perf_counter() - start)


async def section_a(engines, size) -> None:
    n, runs = size["persist_events"], size["runs"]
    room, setup, events = persist_workload(n)
    results = {}
    for engine, new_url in engines:
        samples = [await persist_run(new_url(), setup, events) for _ in range(runs)]
        persist = statistics.median(s[0] for s in samples)
        raw = statistics.median(s[1] for s in samples)
        raw_all = statistics.median(s[2] for s in samples)
        raw_queued = statistics.median(s[4] for s in samples)
        copy = statistics.median(s[5] for s in samples)
        # The fastest of the ways to bulk-write the same rows, per run, then the median.
        fastest = statistics.median(max(s[2], s[4], s[5]) for s in samples)
        results[engine] = (
            persist,
            raw,
            persist / raw,
            raw_all,
            persist / raw_all,
            samples[0][3],
            raw_queued,
            copy,
            fastest,
        )
    validation = statistics.median(validation_rate(room, events) for _ in range(runs))
    names = [e for e, _ in engines]
    print(f"\n(a) persist throughput: {n:,} events in batches of {BATCH}, median of {runs} runs")
    print_table(
        ["events/s", *names],
        [
            ["persist_events", *[results[e][0] for e in names]],
            ["raw INSERT events+event_json+event_edges", *[results[e][1] for e in names]],
            ["ratio persist/raw (goal >= 0.5x)", *[f"{results[e][2]:.2f}x" for e in names]],
            ["raw INSERT of every row persist wrote", *[results[e][3] for e in names]],
            ["  (rows written per event)", *[f"{results[e][5] / n:.1f}" for e in names]],
            ["ratio persist/raw-all-rows", *[f"{results[e][4]:.2f}x" for e in names]],
            ["same, each batch's INSERTs in one round trip", *[results[e][6] for e in names]],
            ["ratio persist/raw-all-rows-one-round-trip", *[f"{results[e][0] / results[e][6]:.2f}x" for e in names]],
            ["bulk load of every row (COPY; SQLite: executemany)", *[results[e][7] for e in names]],
            ["fastest bulk path (best of the three, per run)", *[results[e][8] for e in names]],
            [
                "ratio persist/fastest bulk path (goal >= 0.5x)",
                *[f"{results[e][0] / results[e][8]:.2f}x" for e in names],
            ],
            ["validation alone (prepare_events, CPU)", *[validation for _ in names]],
        ],
    )


# ---------------------------------------------------------------------- (b)


async def build_long_chain(url: str, entries: int = 10_000, hops: int = 100):
    """A room whose last event's group has ``entries`` entries, ``hops`` deltas from a snapshot."""
    store = await RoomStore.open(url, StoreConfig(max_state_chain_length=hops))
    room = RoomBuilder(room_id=realistic_room_id(random.Random(2)))
    create = room.create()
    await store.persist_events([room.to_persist(create)])
    # One event whose state adds entries - 2 keys at hop 1 (then 99 topic
    # changes make hops 2..100; the topic is the last key).
    state = {("m.room.create", ""): create.event_id}
    state.update({("org.example.bench", f"key{i}"): fake_event_id(f"bench{i}") for i in range(entries - 2)})
    big = room.message(room.creator, "big state")
    await store.persist_events([room.to_persist(big, state_before=state)])
    topics = [room.state("m.room.topic", "", {"topic": f"t{i}"}) for i in range(hops - 1)]
    for part in chunks(topics, BATCH):
        await store.persist_events([room.to_persist(e) for e in part])
    last = topics[-1].event_id
    info = await store.db.run_interaction(
        "chain",
        lambda t: t.execute(
            "SELECT g.chain_length FROM events AS e JOIN event_ids AS i ON i.event_nid = e.event_nid"
            " JOIN state_groups AS g ON g.state_group = e.state_group WHERE i.event_id = ?",
            (last,),
        ).fetchone(),
    )
    assert info[0] == hops, info
    return store, big.event_id, last


async def timed_lookup(store: RoomStore, event_id: str, expected: int) -> float:
    store.state_groups._cache.clear()
    start = time.perf_counter()
    state = await store.get_state_ids(event_id)
    elapsed = time.perf_counter() - start
    assert len(state) == expected, len(state)
    return elapsed * 1000


async def section_b(engines, size) -> None:
    runs = size["lookup_runs"]
    rows = {"hops100": [], "hops1": []}
    names = []
    for engine, new_url in engines:
        names.append(engine)
        store, big, last = await build_long_chain(new_url())
        try:
            await timed_lookup(store, last, 10_000)  # warm the interners, as a running server's are
            rows["hops100"].append(statistics.median([await timed_lookup(store, last, 10_000) for _ in range(runs)]))
            rows["hops1"].append(statistics.median([await timed_lookup(store, big, 9_999) for _ in range(runs)]))
        finally:
            await store.close()
    print(f"\n(b) full-state lookup (get_state_ids, state group cache cleared), median of {runs} runs")
    print_table(
        ["ms", *names],
        [
            ["10,000 entries, end of a 100-hop chain", *rows["hops100"]],
            ["9,999 entries, 1 hop (for scale)", *rows["hops1"]],
        ],
    )


# ---------------------------------------------------------------------- (c), (d)


async def visibility_sizes(store: RoomStore) -> dict[str, tuple[int, int, int]]:
    """table -> (rows, bytes, bytes of the main forks)."""

    async def one(table):
        rows = await store.db.run_interaction("count", count_txn, table)
        size = await store.db.run_interaction("bytes", table_bytes_txn, [table])
        main = await store.db.run_interaction("bytes", table_bytes_txn, [table], True)
        return rows, size, main

    return {t: await one(t) for t in VISIBILITY_TABLES}


SYNAPSE_DDL = (
    "CREATE TABLE state_groups_state (state_group BIGINT, room_id TEXT, type TEXT, state_key TEXT, event_id TEXT)",
    "CREATE INDEX state_groups_state_type_idx ON state_groups_state (state_group, type, state_key)",
)


def _synapse_copy_txn(txn) -> None:
    for sql in SYNAPSE_DDL:
        txn.execute(sql)
    groups = [r[0] for r in txn.execute("SELECT state_group FROM state_groups ORDER BY state_group").fetchall()]
    # Group by group, in creation order, as Synapse writes them.
    for part in chunks(groups, 50):
        marks = ", ".join("?" for _ in part)
        rows = txn.execute(
            "SELECT d.state_group, r.room_id, k.type, k.state_key, i.event_id FROM state_group_deltas AS d"
            " JOIN state_groups AS g ON g.state_group = d.state_group JOIN rooms AS r ON r.room_nid = g.room_nid"
            " JOIN state_keys AS k ON k.type_key_nid = d.type_key_nid JOIN event_ids AS i ON i.event_nid = d.event_nid"
            f" WHERE d.state_group IN ({marks}) ORDER BY d.state_group, d.type_key_nid",
            list(part),
        ).fetchall()
        txn.insert_many("state_groups_state", ("state_group", "room_id", "type", "state_key", "event_id"), rows)


async def big_room(url: str, members: int, messages: int, rng: random.Random):
    store = await RoomStore.open(url)
    room = RoomBuilder(room_id=realistic_room_id(rng))
    await store.persist_events([room.to_persist(room.create()), room.to_persist(room.join(room.creator))])
    start = time.perf_counter()
    for part in chunks(range(members - 1), BATCH):
        await store.persist_events([room.to_persist(room.join(user(i))) for i in part])
    join_rate = (members - 1) / (time.perf_counter() - start)
    after_joins = await visibility_sizes(store)
    start = time.perf_counter()
    for part in chunks(range(messages), BATCH):
        await store.persist_events(
            [room.to_persist(room.message(user(rng.randrange(members - 1)), f"hello {i}")) for i in part]
        )
    message_rate = messages / (time.perf_counter() - start)
    after_messages = await visibility_sizes(store)
    return store, join_rate, message_rate, after_joins, after_messages


async def section_c_d(engines, size) -> None:
    members, messages = size["members"], size["messages"]
    names, vis, state, rates = [], {}, {}, {}
    for engine, new_url in engines:
        names.append(engine)
        store, join_rate, message_rate, after_joins, after_messages = await big_room(
            new_url(), members, messages, random.Random(3)
        )
        try:
            vis[engine] = (after_joins, after_messages)
            rates[engine] = (join_rate, message_rate)
            db = store.db
            ours_rows = await db.run_interaction("count", count_txn, "state_group_deltas")
            ours_bytes = await db.run_interaction("bytes", table_bytes_txn, ["state_group_deltas"])
            await db.run_interaction("synapse_copy", _synapse_copy_txn)
            theirs_rows = await db.run_interaction("count", count_txn, "state_groups_state")
            theirs_bytes = await db.run_interaction("bytes", table_bytes_txn, ["state_groups_state"])
            assert ours_rows == theirs_rows, (ours_rows, theirs_rows)
            state[engine] = (ours_rows, ours_bytes, theirs_bytes)
        finally:
            await store.close()

    print(f"\n(c) visibility tables, a room of {members:,} members then {messages:,} messages")
    table_rows = []
    for table in VISIBILITY_TABLES:
        table_rows.append([f"{table} rows", *[vis[e][1][table][0] for e in names]])

    def sums(sizes):
        return tuple(sum(v[i] for v in sizes.values()) for i in range(3))

    total = {e: sums(vis[e][1]) for e in names}
    before = {e: sums(vis[e][0]) for e in names}
    table_rows += [
        ["all visibility rows", *[total[e][0] for e in names]],
        ["all visibility bytes (tables + indexes)", *[total[e][1] for e in names]],
        [f"rows added by the {messages:,} messages", *[total[e][0] - before[e][0] for e in names]],
        [f"bytes added by the {messages:,} messages", *[total[e][1] - before[e][1] for e in names]],
        ["  of which in table/index pages (no FSM/VM)", *[total[e][2] - before[e][2] for e in names]],
        ["visibility bytes per member", *[total[e][1] / members for e in names]],
        ["(joins persisted/s)", *[rates[e][0] for e in names]],
        ["(messages persisted/s)", *[rates[e][1] for e in names]],
    ]
    print_table(["", *names], table_rows)

    print("\n(d) bytes per state entry, table + indexes: the state groups of (c)'s room")
    print_table(
        ["", *names],
        [
            ["state entries (rows, both tables)", *[state[e][0] for e in names]],
            ["state_group_deltas bytes/entry", *[state[e][1] / state[e][0] for e in names]],
            ["Synapse state_groups_state bytes/entry", *[state[e][2] / state[e][0] for e in names]],
            ["ratio ours/Synapse (goal <= 0.35x)", *[f"{state[e][1] / state[e][2]:.2f}x" for e in names]],
        ],
    )


async def section_e(engines, size) -> None:
    """Statements and time of an unchanged and a k-changed sync."""
    runs = size["lookup_runs"]
    rows = {}
    cases = ["unchanged", "1 room changed", "5 rooms changed", "20 rooms changed"]
    for engine, new_url in engines:
        store = await RoomStore.open(new_url())
        viewer = "@viewer:example.org"
        rooms = []
        for r in range(20):
            room = RoomBuilder(f"!sync{r}:example.org")
            events = [room.create(), room.join(viewer)]
            await store.persist_events([room.to_persist(e) for e in events])
            rooms.append(room)
        token = store.get_current_token()
        await store.sync(viewer, token)  # warm the rooms-for-user and interner caches
        figures = []
        for k in (0, 1, 5, 20):
            queries, times = [], []
            for run in range(runs):
                token = store.get_current_token()
                for room in rooms[:k]:
                    await store.persist_events([room.to_persist(room.message(viewer, f"k{k} run{run}"))])
                # Let the generators' background position writes finish, so
                # only the sync's own statements are counted.
                for gen in store.generators.values():
                    await gen.flush()
                before = store.db.query_count
                started = time.perf_counter()
                result = await store.sync(viewer, token)
                times.append((time.perf_counter() - started) * 1000)
                queries.append(store.db.query_count - before)
                assert sum(len(v) for v in result.rooms.values()) == k, "sync missed events"
            figures.append((statistics.median(queries), statistics.median(times)))
        rows[engine] = figures
        await store.close()
    names = [e for e, _ in engines]
    print(f"\n(e) sync for a user in 20 rooms: statements issued and time, median of {runs} runs")
    print_table(
        ["", *[f"{n} statements" for n in names], *[f"{n} ms" for n in names]],
        [[case, *[int(rows[n][i][0]) for n in names], *[rows[n][i][1] for n in names]] for i, case in enumerate(cases)],
    )


# ---------------------------------------------------------------------- (f)


class LatenessProbe:
    """Asks the reactor to call it every ``interval`` seconds and records, for each call, how late it came."""

    def __init__(self, reactor, interval: float = 0.001):
        self.reactor, self.interval = reactor, interval
        self.lateness: list[float] = []
        self._call = None

    def start(self) -> None:
        self._due = time.perf_counter() + self.interval
        self._call = self.reactor.callLater(self.interval, self._tick)

    def _tick(self) -> None:
        self.lateness.append(max(0.0, time.perf_counter() - self._due))
        self.start()

    def stop(self) -> dict[str, float]:
        if self._call is not None and self._call.active():
            self._call.cancel()
        ordered = sorted(self.lateness)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
        return {"p50": pick(0.50), "p99": pick(0.99), "max": ordered[-1] * 1000, "calls": len(ordered)}


async def lateness_run(reactor, url: str, setup, events) -> dict[str, float]:
    store = await open_writer(url)
    freeze = os.environ.get("BENCH_FREEZE", "1") == "1"
    try:
        await store.persist_events(setup)
        if freeze:
            # As `roomstore serve` does once started (and Synapse's processes):
            # what start-up made leaves the cyclic collector's generations.
            gc.collect()
            gc.freeze()
        probe = LatenessProbe(reactor)
        probe.start()
        start = time.perf_counter()
        await persist_all(store, events)
        rate = len(events) / (time.perf_counter() - start)
        figures = probe.stop()
    finally:
        await store.close()
        if freeze:
            gc.unfreeze()
    return {**figures, "events/s": rate}


async def idle_lateness(reactor, seconds: float = 2.0) -> dict[str, float]:
    probe = LatenessProbe(reactor)
    probe.start()
    await task.deferLater(reactor, seconds, lambda: None)
    return probe.stop()


async def section_f(reactor, engines, size) -> None:
    n, runs = size["lateness_events"], size["runs"]
    _room, setup, events = persist_workload(n, seed=2)
    columns = {"idle reactor": [await idle_lateness(reactor) for _ in range(runs)]}
    for engine, new_url in engines:
        columns[engine] = [await lateness_run(reactor, new_url(), setup, events) for _ in range(runs)]
    med = lambda samples, key: statistics.median(s[key] for s in samples)  # noqa: E731
    print(
        f"\n(f) reactor lateness during an import of {n:,} events in batches of {BATCH} (probe every 1 ms),"
        f" median of {runs} runs"
    )
    print_table(
        ["lateness", *columns],
        [
            ["p50 (ms)", *[f"{med(c, 'p50'):.2f}" for c in columns.values()]],
            ["p99 (ms) (goal <= 2)", *[f"{med(c, 'p99'):.2f}" for c in columns.values()]],
            ["max (ms) (goal <= 10)", *[f"{med(c, 'max'):.2f}" for c in columns.values()]],
            ["probe calls", *[f"{med(c, 'calls'):.0f}" for c in columns.values()]],
            ["events/s meanwhile", "", *[f"{med(c, 'events/s'):,.0f}" for c in list(columns.values())[1:]]],
        ],
    )


async def main(reactor, args) -> None:
    size = dict(SIZES[args.size])
    if args.runs:
        size["runs"] = size["lookup_runs"] = args.runs
    engines = bench_databases()
    started = time.perf_counter()
    print(
        f"bench/event_store.py --size {args.size}: engines {', '.join(e for e, _ in engines)}; writer: "
        f"{WRITER['in_flight']} call(s) in flight, validation_processes="
        f"{'default' if WRITER['validation_processes'] is None else WRITER['validation_processes']}, "
        f"{'in a writer process' if WRITER['writer_process'] else 'in process'}, "
        f"switch interval {sys.getswitchinterval() * 1000:g} ms; load average {os.getloadavg()[0]:.2f}"
    )
    if "a" in args.sections:
        await section_a(engines, size)
    if "b" in args.sections:
        await section_b(engines, size)
    if "c" in args.sections or "d" in args.sections:
        await section_c_d(engines, size)
    if "e" in args.sections:
        await section_e(engines, size)
    if "f" in args.sections:
        await section_f(reactor, engines, size)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--runs", type=int, default=0, help="override the number of timed runs (>= 3)")
    parser.add_argument("--sections", default="abcdef", help="which sections to run, e.g. 'a' (default: all)")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="(a), (f): persist_events calls in flight at once (default 1: each awaited)",
    )
    parser.add_argument(
        "--validation-processes",
        type=int,
        default=None,
        help="(a), (f): StoreConfig.validation_processes (default: the store's own default)",
    )
    parser.add_argument(
        "--writer-process",
        action="store_true",
        help="(a), (f): StoreConfig.writer_process (the writes in a child process)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run, in ms (default: the interpreter's, 5 ms)",
    )
    args = parser.parse_args()
    if args.in_flight < 1:
        parser.error("--in-flight must be at least 1")
    WRITER.update(
        in_flight=args.in_flight, validation_processes=args.validation_processes, writer_process=args.writer_process
    )
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if not set(args.sections) <= set("abcdef"):
        parser.error("--sections takes letters among a, b, c, d, e, f")
    if args.runs and args.runs < 3:
        parser.error("--runs must be at least 3 (medians)")
    task.react(lambda reactor: defer.ensureDeferred(main(reactor, args)))
