"""``roomstore-compact --synapse URL`` on the PostgreSQL database of a real, running Synapse.

``bin/test`` starts a Synapse on the test PostgreSQL server
(``ROOMSTORE_TEST_SYNAPSE_PG``); its database holds the schema Synapse made.
The test makes rooms with membership churn through Synapse's client API and
inserts long chains of groups in Synapse's layout (a group's rows are a delta
on its ``state_group_edges`` predecessor, or a snapshot when it has none;
snapshots every 100 hops; forks, so some bases would need a removal Synapse
cannot store) in rooms of its own, then runs the real job (spark-submit on
``local[2]``). Oracle: Synapse's own state read,
``StateGroupBackgroundUpdateStore._get_state_groups_from_groups_txn`` from
the installed matrix-synapse, for every group before and after.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import time

from twisted.trial import unittest

from tests.compaction.test_spark_job import FAST_START, WRAPPER, job_env
from tests.db import pg_connect, pg_query
from tests.synapse_oracle import prepare_synapse

PREFIX = "roomstore_compressor_"
SYNAPSE_TABLES = ("state_groups", "state_group_edges", "state_groups_state")


def synapse_server():
    from tests.synapse_server import SynapseServer

    return SynapseServer.from_env("ROOMSTORE_TEST_SYNAPSE_PG")


def exclusive(server):
    from tests.synapse_server import exclusive as lock

    return lock(server)


class SynapseOracle:
    """Synapse's ``_get_state_groups_from_groups_txn`` on a cursor of ours."""

    def __init__(self) -> None:
        if not prepare_synapse():
            raise unittest.SkipTest("matrix-synapse is not installed in this virtualenv")
        # Synapse's PostgresEngine disables psycopg2's bytes adapter for the
        # whole process (roomstore's own PostgreSQL writes pass bytes): keep
        # psycopg2's adapters as they were.
        import psycopg2.extensions
        from synapse.storage.database import DatabasePool, LoggingTransaction
        from synapse.storage.databases.state.bg_updates import StateGroupBackgroundUpdateStore
        from synapse.storage.engines import create_engine

        adapters = dict(psycopg2.extensions.adapters)
        try:
            self.engine = create_engine({"name": "psycopg2", "args": {}})
        finally:
            psycopg2.extensions.adapters.clear()
            psycopg2.extensions.adapters.update(adapters)
        self.LoggingTransaction = LoggingTransaction
        self.store = StateGroupBackgroundUpdateStore.__new__(StateGroupBackgroundUpdateStore)
        self.store.database_engine = self.engine
        self.store.db_pool = DatabasePool
        self.function = StateGroupBackgroundUpdateStore._get_state_groups_from_groups_txn

    def states(self, dsn: str, groups: list[int]) -> dict[int, dict]:
        conn = pg_connect(dsn)
        try:
            out: dict[int, dict] = {}
            with conn.cursor() as cur:
                txn = self.LoggingTransaction(txn=cur, name="oracle", server_name="test", database_engine=self.engine)
                for start in range(0, len(groups), 200):
                    part = groups[start : start + 200]
                    for group, state in self.function(self.store, txn, part).items():
                        out[group] = dict(state)
            return out
        finally:
            conn.close()


def all_groups(dsn: str) -> list[int]:
    return [r[0] for r in pg_query(dsn, "SELECT id FROM state_groups ORDER BY id")]


def representation(dsn: str, groups: list[int] | None = None) -> list:
    """Every group's edge and rows, as stored."""
    cond = "" if groups is None else " WHERE g.id = ANY(%s)"
    args = () if groups is None else (list(groups),)
    return pg_query(
        dsn,
        "SELECT g.id, e.prev_state_group, (SELECT array_agg(s.type || '|' || s.state_key || '|' || s.event_id"
        " ORDER BY s.type, s.state_key) FROM state_groups_state s WHERE s.state_group = g.id)"
        f" FROM state_groups g LEFT JOIN state_group_edges e ON e.state_group = g.id{cond} ORDER BY g.id",
        args,
    )


def schema_of_synapse_tables(dsn: str) -> list:
    """Columns, indexes and constraints of Synapse's state tables."""
    columns = pg_query(
        dsn,
        "SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns"
        " WHERE table_name = ANY(%s) ORDER BY table_name, ordinal_position",
        (list(SYNAPSE_TABLES),),
    )
    indexes = pg_query(
        dsn,
        "SELECT tablename, indexdef FROM pg_indexes WHERE tablename = ANY(%s) ORDER BY 1, 2",
        (list(SYNAPSE_TABLES),),
    )
    constraints = pg_query(
        dsn,
        "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid::regclass::text = ANY(%s) ORDER BY 1, 2",
        (list(SYNAPSE_TABLES),),
    )
    return [columns, indexes, constraints]


def insert_chain_room(dsn: str, room_id: str, groups: int, seed: int) -> list[int]:
    """A room of ``groups`` state groups in Synapse's layout: membership churn,
    a snapshot every 100 hops, a fork every 90 groups (the fork's branch lacks
    members the other branch added), now and then a group without rows; each
    group the state group of one (made-up) event in ``event_to_state_groups``."""
    rng = random.Random(seed)
    tag = room_id[1:].split(":")[0]
    conn = pg_connect(dsn)
    ids: list[int] = []
    states: dict[int, dict[tuple[str, str], str]] = {}
    hops: dict[int, int] = {}
    members = [f"@u{i}-{tag}:synapse.test" for i in range(300)]
    try:
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            for i in range(groups):
                cur.execute("SELECT nextval('state_group_id_seq')")
                gid = cur.fetchone()[0]
                if not ids:
                    prev = None
                    state = {("m.room.create", ""): f"$create-{tag}", ("m.room.power_levels", ""): f"$pl-{tag}"}
                    for m in members[:150]:
                        state[("m.room.member", m)] = f"$join-{tag}-{m}"
                else:
                    prev = ids[-6] if i % 90 == 45 and len(ids) > 6 else ids[-1]
                    state = dict(states[prev])
                    if i % 37 != 0:  # else: a group with the same state (no rows)
                        for _ in range(rng.choice((1, 1, 2, 3))):
                            m = rng.choice(members)
                            kind = "topic" if rng.random() < 0.1 else "member"
                            key = ("m.room.topic", "") if kind == "topic" else ("m.room.member", m)
                            state[key] = f"${kind}-{tag}-{i}-{rng.randrange(10**6)}"
                event_id = f"$ev-{tag}-{i}"
                cur.execute(
                    "INSERT INTO state_groups (id, room_id, event_id) VALUES (%s, %s, %s)", (gid, room_id, event_id)
                )
                # An event refers to every group, as in a real room: otherwise
                # Synapse's background update marks them pending deletion.
                cur.execute(
                    "INSERT INTO event_to_state_groups (event_id, state_group) VALUES (%s, %s)", (event_id, gid)
                )
                if prev is None or hops[prev] >= 99:
                    rows = state
                    hops[gid] = 0
                else:
                    cur.execute(
                        "INSERT INTO state_group_edges (state_group, prev_state_group) VALUES (%s, %s)", (gid, prev)
                    )
                    rows = {k: v for k, v in state.items() if states[prev].get(k) != v}
                    hops[gid] = hops[prev] + 1
                for (t, k), e in rows.items():
                    cur.execute(
                        "INSERT INTO state_groups_state (state_group, room_id, type, state_key, event_id)"
                        " VALUES (%s, %s, %s, %s, %s)",
                        (gid, room_id, t, k, e),
                    )
                ids.append(gid)
                states[gid] = state
                for old in [g for g in states if g < (ids[-8] if len(ids) > 8 else -1)]:
                    del states[old]
            cur.execute("COMMIT")
    finally:
        conn.close()
    return ids


def churn_room(server):
    """A room made by Synapse through its client API, with membership churn."""
    suffix = os.urandom(3).hex()
    alice = server.register(f"calice{suffix}")
    others = [server.register(f"c{n}{suffix}") for n in ("bob", "carol", "dave")]
    room = alice.create_room(name="compaction", topic="t0")
    inside: set = set()
    for round_ in range(4):
        for user in others:
            if user.user_id not in inside:
                alice.invite(room, user.user_id)
                user.join(room)
                inside.add(user.user_id)
            alice.send(room, f"hello {round_}")
        alice.state(room, "m.room.topic", {"topic": f"t{round_ + 1}"})
        for user in others[: 1 + round_ % 3]:
            user.leave(room)
            inside.discard(user.user_id)
    return room, alice


def run_job(dsn: str, *args: str, timeout: float = 900) -> tuple[int, str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        cmd = [
            WRAPPER,
            "--master",
            "local[2]",
            *FAST_START,
            "--synapse",
            dsn,
            "--heartbeat",
            "1",
            "--summary-json",
            summary,
            *args,
        ]
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_env(), timeout=timeout, text=True
        )
        data = json.load(open(summary)) if os.path.exists(summary) else {}
        return proc.returncode, proc.stdout, data


def own_tables(dsn: str) -> list[str]:
    return [
        r[0]
        for r in pg_query(dsn, "SELECT tablename FROM pg_tables WHERE tablename LIKE %s ORDER BY 1", (PREFIX + "%",))
    ]


class SynapseCompactionTests(unittest.TestCase):
    """One database, scenarios in order (each spark-submit costs seconds)."""

    timeout = 1800

    def setUp(self) -> None:
        self.server = synapse_server()
        self.addCleanup(exclusive(self.server).close)  # nobody else writes to Synapse meanwhile
        self.dsn = self.server.database
        self.oracle = SynapseOracle()
        tag = os.urandom(3).hex()
        self.api_room, self.alice = churn_room(self.server)
        served = self.alice._call("GET", self.alice._room(self.api_room) + "/state")
        self.api_state = sorted((e["type"], e["state_key"], e["event_id"]) for e in served)
        self.chain_rooms = [f"!chain{tag}{n}:synapse.test" for n in range(3)]
        self.chains = {
            room: insert_chain_room(self.dsn, room, groups, seed)
            for room, groups, seed in zip(self.chain_rooms, (650, 420, 150), (1, 2, 3), strict=True)
        }
        self.rooms_spec = ",".join([self.api_room] + self.chain_rooms)

    def mark_pending_deletion(self, group: int) -> None:
        pg_query(
            self.dsn,
            "INSERT INTO state_groups_pending_deletion (state_group, insertion_ts) VALUES (%s, %s)",
            (group, int(time.time() * 1000)),
        )

    def rows_of_rooms(self) -> int:
        return pg_query(
            self.dsn,
            "SELECT COUNT(*) FROM state_groups_state WHERE room_id = ANY(%s)",
            ([self.api_room] + self.chain_rooms,),
        )[0][0]

    def test_dry_run_run_rerun(self) -> None:
        dsn = self.dsn
        pending = self.chains[self.chain_rooms[0]][300]
        self.mark_pending_deletion(pending)
        groups = all_groups(dsn)
        before = self.oracle.states(dsn, groups)
        stored_before = representation(dsn)
        schema_before = schema_of_synapse_tables(dsn)
        rows_before = self.rows_of_rooms()
        last = self.chains[self.chain_rooms[0]][-1]
        self.assertGreaterEqual(len(before[last]), 150)  # the oracle reads real, large states
        self.assertEqual(len(before[self.chains[self.chain_rooms[0]][0]]), 152)
        tables_before = own_tables(dsn)

        # A dry run writes nothing: no table of ours, no row changed.
        status, out, summary = run_job(dsn, "--rooms", self.rooms_spec, "--chunk-groups", "200", "--dry-run")
        self.assertEqual(status, 0, out)
        self.assertTrue(summary["dry_run"])
        self.assertEqual(summary["layout"], "synapse")
        self.assertGreater(summary["totals"]["rows_before"], summary["totals"]["rows_after"], out)
        self.assertEqual(representation(dsn), stored_before)
        self.assertEqual(own_tables(dsn), tables_before)

        # The run; while it runs, Synapse (client API) and a writer in
        # Synapse's layout add groups after its snapshot: left alone, counted.
        extra_room = self.chain_rooms[2]
        added: list[int] = []

        def add_groups_once_started() -> None:
            deadline = time.time() + 300
            while time.time() < deadline:
                if PREFIX + "runs" in own_tables(dsn) and pg_query(
                    dsn, f"SELECT 1 FROM {PREFIX}runs WHERE finished_ts IS NULL"
                ):
                    break
                time.sleep(0.2)
            self.alice.state(self.api_room, "m.room.topic", {"topic": "late"})
            served = self.alice._call("GET", self.alice._room(self.api_room) + "/state")
            self.api_state = sorted((e["type"], e["state_key"], e["event_id"]) for e in served)
            last = self.chains[extra_room][-1]
            conn = pg_connect(dsn)
            with conn.cursor() as cur:
                cur.execute("SELECT nextval('state_group_id_seq')")
                gid = cur.fetchone()[0]
                cur.execute(
                    "INSERT INTO state_groups (id, room_id, event_id) VALUES (%s, %s, '$late')", (gid, extra_room)
                )
                cur.execute(
                    "INSERT INTO event_to_state_groups (event_id, state_group) VALUES (%s, %s)", (f"$late-{gid}", gid)
                )
                cur.execute("INSERT INTO state_group_edges VALUES (%s, %s)", (gid, last))
                cur.execute(
                    "INSERT INTO state_groups_state VALUES (%s, %s, 'm.room.topic', '', '$late-topic')",
                    (gid, extra_room),
                )
            conn.close()
            added.append(gid)

        import threading

        adder = threading.Thread(target=add_groups_once_started)
        adder.start()
        status, out, summary = run_job(dsn, "--rooms", self.rooms_spec, "--chunk-groups", "200", "--swap-delay", "1")
        adder.join()
        self.assertEqual(status, 0, out)
        totals = summary["totals"]
        self.assertEqual(totals["mismatched_groups"], 0, out)
        statuses = {r["room_id"]: r["status"] for r in summary["rooms"]}
        for room in self.chain_rooms[:2]:
            self.assertEqual(statuses[room], "written", out)
        # Ours, and any Synapse marked itself (it marks unreferenced groups).
        self.assertGreaterEqual(summary["skipped_groups"]["pending_deletion"], 1, out)
        self.assertGreaterEqual(summary["skipped_groups"]["created_after_start"], 1, out)
        self.assertTrue(added and all(g > summary["snapshot_max"] for g in added))
        rows_after = self.rows_of_rooms()
        self.assertLess(rows_after, rows_before - 1, out)  # minus the late row

        # Synapse's own read gives every group the state it had.
        after = self.oracle.states(dsn, groups)
        self.assertEqual(len(after), len(before))
        differing = [g for g in groups if after[g] != before[g]]
        self.assertEqual(differing, [], f"{len(differing)} group(s) changed state")
        # The group pending deletion and the late groups are stored as they were.
        self.assertEqual(representation(dsn, [pending]), [r for r in stored_before if r[0] == pending])
        late_state = self.oracle.states(dsn, added)[added[0]]
        self.assertEqual(late_state[("m.room.topic", "")], "$late-topic")
        # Synapse's table definitions as they were; chains within the hop bound.
        self.assertEqual(schema_of_synapse_tables(dsn), schema_before)
        deepest = pg_query(
            dsn,
            "WITH RECURSIVE walk(g, n) AS (SELECT id, 0 FROM state_groups WHERE room_id = ANY(%s)"
            " UNION ALL SELECT e.prev_state_group, w.n + 1 FROM walk w JOIN state_group_edges e ON e.state_group = w.g)"
            " SELECT MAX(n) FROM walk",
            (self.chain_rooms,),
        )[0][0]
        self.assertLessEqual(deepest, 172)
        self.assertIn("left alone", out)

        # A rerun is incremental: only the rooms with groups created since the
        # last run's snapshot are read again; the rest is left as it is.
        stored = representation(dsn, [g for g in groups if g not in added])
        status, out, summary = run_job(dsn, "--rooms", self.rooms_spec, "--chunk-groups", "200")
        self.assertEqual(status, 0, out)
        self.assertEqual({r["room_id"] for r in summary["rooms"]}, {self.api_room, extra_room}, out)
        self.assertEqual(summary["totals"]["mismatched_groups"], 0, out)
        for room in self.chain_rooms[:2]:
            ids = self.chains[room]
            self.assertEqual(representation(dsn, ids), [r for r in stored if r[0] in set(ids)])
        # ... and once nothing is new, nothing at all.
        stored = representation(dsn)
        status, out, summary = run_job(dsn, "--rooms", self.rooms_spec, "--chunk-groups", "200")
        self.assertEqual(status, 0, out)
        self.assertEqual(summary["rooms"], [], out)
        self.assertIn("nothing to do", out)
        self.assertEqual(representation(dsn), stored)
        self.assertEqual(self.oracle.states(dsn, groups), before)
        # Synapse, running all along, serves the room's state as before.
        served = self.alice._call("GET", self.alice._room(self.api_room) + "/state")
        self.assertEqual(sorted((e["type"], e["state_key"], e["event_id"]) for e in served), self.api_state)


class SynapseSwapTests(unittest.TestCase):
    """The swap on Synapse's tables without Spark: a chunk staged by hand is
    refused, with nothing written, when one of its groups is pending deletion,
    being persisted or changed since the read; otherwise swapped, and
    Synapse's read gives every group the same state."""

    def setUp(self) -> None:
        from roomstore.compaction import synapse_sql
        from roomstore.compaction.synapse_tables import SynapseTables
        from roomstore.compaction.write_back import CompactionWriter

        server = synapse_server()
        self.addCleanup(exclusive(server).close)  # nobody else writes to Synapse meanwhile
        self.dsn = server.database
        self.oracle = SynapseOracle()
        self.room = f"!swap{os.urandom(3).hex()}:synapse.test"
        self.ids = insert_chain_room(self.dsn, self.room, 6, seed=7)
        self.nid = pg_query(self.dsn, f"SELECT {synapse_sql.room_nid('%s')}", (self.room,))[0][0]
        self.writer = CompactionWriter(self.dsn, tables=SynapseTables(), heartbeat_s=0)
        self.addCleanup(self.writer.close)
        self.writer.check_schema()
        self.writer.tables.prepare(self.writer.db, False)
        self.writer.acquire_lock()
        self.run = self.writer.begin_run({"test": self.room})
        self.addCleanup(self.writer.finish_run, self.run)

    def chunk(self):
        """Group ids[3] rewritten as a delta on ids[0] (the chunk: ids[1..3])."""
        from roomstore.compaction import synapse_sql
        from roomstore.compaction.chunks import StagedChunk

        ids = self.ids
        states = self.oracle.states(self.dsn, ids[:4])
        groups = []
        for g in ids[1:4]:
            rows, checksum = pg_query(
                self.dsn,
                f"SELECT COUNT(*), COALESCE(SUM({synapse_sql.CHECKSUM_SQL}), 0) FROM state_groups_state d"
                " WHERE state_group = %s",
                (g,),
            )[0]
            prev = pg_query(self.dsn, "SELECT prev_state_group FROM state_group_edges WHERE state_group = %s", (g,))[0][
                0
            ]
            rewrite = g == ids[3]
            groups.append((g, prev, rows, int(checksum), ids[0] if rewrite else prev, 0, 1 if rewrite else 0))
        new = {k: v for k, v in states[ids[3]].items() if states[ids[0]].get(k) != v}
        self.assertFalse([k for k in states[ids[0]] if k not in states[ids[3]]])  # no removal needed
        deltas = [(ids[3], t, k, e) for (t, k), e in sorted(new.items())]
        return StagedChunk(self.nid, ids[1], ids[3], groups, [ids[0]], deltas, 0, 0, 1)

    def swap(self):
        chunk = self.chunk()
        self.writer.stage_chunk(self.run, chunk)
        return self.writer.swap_chunk(self.run, self.nid, chunk.first_group, (chunk.last_group, 0, 0, 1))

    def test_refused_when_pending_deletion_persisting_or_changed_then_swapped(self) -> None:
        dsn, ids = self.dsn, self.ids
        before = self.oracle.states(dsn, ids)
        stored = representation(dsn, ids)
        cases = [
            (
                "is pending deletion",
                ids[2],
                "INSERT INTO state_groups_pending_deletion (state_group, insertion_ts) VALUES (%s, 0)",
                "DELETE FROM state_groups_pending_deletion WHERE state_group = %s",
            ),
            (
                "is pending deletion",
                ids[0],  # the base outside the chunk
                "INSERT INTO state_groups_pending_deletion (state_group, insertion_ts) VALUES (%s, 0)",
                "DELETE FROM state_groups_pending_deletion WHERE state_group = %s",
            ),
            (
                "is being persisted",
                ids[3],
                "INSERT INTO state_groups_persisting (state_group, instance_name) VALUES (%s, 'master')",
                "DELETE FROM state_groups_persisting WHERE state_group = %s",
            ),
            (
                "changed since it was read",
                ids[3],  # the rewritten group: a row more
                "INSERT INTO state_groups_state VALUES (%s, 'x', 'm.room.topic', 'extra', '$extra')",
                "DELETE FROM state_groups_state WHERE state_group = %s AND state_key = 'extra'",
            ),
            (
                "changed since it was read",
                ids[3],  # the rewritten group: as many rows, one different
                "UPDATE state_groups_state SET event_id = event_id || '#changed' WHERE ctid = (SELECT MIN(ctid)"
                " FROM state_groups_state WHERE state_group = %(g)s) AND state_group = %(g)s",
                "UPDATE state_groups_state SET event_id = replace(event_id, '#changed', '') WHERE state_group = %s",
            ),
            (
                "changed since it was read",
                ids[2],  # the rewritten group's old predecessor, not rewritten
                "INSERT INTO state_groups_state VALUES (%s, 'x', 'm.room.topic', 'extra', '$extra')",
                "DELETE FROM state_groups_state WHERE state_group = %s AND state_key = 'extra'",
            ),
        ]
        for reason, group, make, undo in cases:
            chunk = self.chunk()
            self.writer.stage_chunk(self.run, chunk)
            pg_query(dsn, make, {"g": group} if "%(g)s" in make else (group,))
            try:
                result = self.writer.swap_chunk(self.run, self.nid, chunk.first_group, (chunk.last_group, 0, 0, 1))
            finally:
                pg_query(dsn, undo, (group,))
            self.assertEqual(result.status, "changed_underneath", reason)
            self.assertIn(f"state group {group} {reason}", result.detail)
            self.assertEqual(representation(dsn, ids), stored, reason)
        result = self.swap()
        self.assertEqual(result.status, "swapped")
        self.assertGreater(result.rows_deleted, 0)
        self.assertEqual(
            pg_query(dsn, "SELECT prev_state_group FROM state_group_edges WHERE state_group = %s", (ids[3],)),
            [(ids[0],)],
        )
        self.assertEqual(self.oracle.states(dsn, ids), before)
        self.assertEqual(
            pg_query(dsn, f"SELECT first_group, last_group FROM {PREFIX}chunks WHERE run_id = %s", (self.run.run_id,)),
            [(ids[1], ids[3])],
        )
        self.assertEqual(
            pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}staged_deltas WHERE run_id = %s", (self.run.run_id,)), [(0,)]
        )

    def test_a_large_staged_chunk_gets_fresh_statistics(self) -> None:
        # With the statistics of a small chunk staged before, PostgreSQL plans
        # a large chunk's re-check as a nested loop over the aggregated rows
        # (seconds per 10,000 groups); staging a large chunk analyses the
        # staging tables so the swap's plans see its size.
        from roomstore.compaction import synapse_sql
        from roomstore.compaction.chunks import StagedChunk
        from roomstore.compaction.write_back import ANALYZE_STAGED_ROWS

        def reltuples(table):
            return pg_query(self.dsn, "SELECT reltuples FROM pg_class WHERE relname = %s", (table,))[0][0]

        def staged(first, n):
            groups = [(first + i, None, 1, 0, None, 0, 0) for i in range(n)]
            deltas = [(first + i, "m.room.member", f"@u{i}:t", f"$e{i}") for i in range(n)]
            return StagedChunk(self.nid, first, first + n - 1, groups, [], deltas, 0, 0, 0)

        self.writer.stage_chunk(self.run, staged(10**12, 3))
        pg_query(self.dsn, f"ANALYZE {synapse_sql.STAGED_GROUPS}")
        pg_query(self.dsn, f"ANALYZE {synapse_sql.STAGED_DELTAS}")
        self.assertLess(reltuples(synapse_sql.STAGED_GROUPS), 10)
        # Below the threshold: no ANALYZE of its own (the statistics stay).
        self.writer.stage_chunk(self.run, staged(2 * 10**12, 50))
        self.assertLess(reltuples(synapse_sql.STAGED_GROUPS), 10)
        big = ANALYZE_STAGED_ROWS
        self.writer.stage_chunk(self.run, staged(3 * 10**12, big))
        self.assertGreaterEqual(reltuples(synapse_sql.STAGED_GROUPS), big)
        self.assertGreaterEqual(reltuples(synapse_sql.STAGED_DELTAS), big)
        # The real chunk still swaps, verified, after them.
        before = self.oracle.states(self.dsn, self.ids)
        self.assertEqual(self.swap().status, "swapped")
        self.assertEqual(self.oracle.states(self.dsn, self.ids), before)


class SynapseLiveTests(unittest.TestCase):
    """A run killed with SIGKILL mid-write while Synapse keeps sending events
    and purging history, then a rerun beside the same traffic: every group
    that existed keeps its state (Synapse's read), the rerun completes, and
    Synapse logs no error."""

    timeout = 1800

    def test_killed_while_synapse_sends_and_purges_then_rerun(self) -> None:
        import threading

        server = synapse_server()
        self.addCleanup(exclusive(server).close)  # nobody else writes to Synapse meanwhile
        dsn = server.database
        oracle = SynapseOracle()
        tag = os.urandom(3).hex()
        api_room, alice = churn_room(server)
        admin = server.register(f"admin{tag}", admin=True)
        chain_rooms = [f"!live{tag}{n}:synapse.test" for n in range(4)]
        for n, room in enumerate(chain_rooms):
            insert_chain_room(dsn, room, 450, seed=10 + n)
        spec = ",".join([api_room] + chain_rooms)
        log = os.path.join(server.folder, "homeserver.log")
        log_offset = os.path.getsize(log)
        groups = all_groups(dsn)
        before = oracle.states(dsn, groups)

        stop = threading.Event()
        sent: list[str] = []
        purges: list[str] = []
        errors: list[BaseException] = []

        def traffic() -> None:
            try:
                i = 0
                while not stop.is_set():
                    i += 1
                    sent.append(alice.send(api_room, f"live {i}"))
                    if i % 4 == 0:
                        alice.state(api_room, "m.room.topic", {"topic": f"live {i}"})
                    if i % 15 == 0 and len(sent) > 10:
                        result = admin._call(
                            "POST",
                            f"/_synapse/admin/v1/purge_history/{api_room}",
                            {"delete_local_events": True, "purge_up_to_event_id": sent[-5]},
                        )
                        purges.append(result["purge_id"])
                    time.sleep(0.05)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            cmd = [
                WRAPPER,
                "--master",
                "local[2]",
                *FAST_START,
                "--synapse",
                dsn,
                "--heartbeat",
                "1",
                "--rooms",
                spec,
                "--chunk-groups",
                "100",
                "--swap-delay",
                "0.7",
            ]
            with tempfile.TemporaryFile(mode="w+") as out:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=job_env(), start_new_session=True
                )
                try:
                    deadline = time.monotonic() + 600
                    while True:
                        if (
                            PREFIX + "rooms" in own_tables(dsn)
                            and pg_query(
                                dsn,
                                f"SELECT COUNT(*) FROM {PREFIX}rooms o JOIN {PREFIX}runs r USING (run_id)"
                                " WHERE r.finished_ts IS NULL",
                            )[0][0]
                            >= 1
                        ):
                            break
                        out.seek(0)
                        self.assertIsNone(proc.poll(), out.read())
                        self.assertLess(time.monotonic(), deadline)
                        time.sleep(0.1)
                finally:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            unfinished = pg_query(dsn, f"SELECT run_id FROM {PREFIX}runs WHERE finished_ts IS NULL")
            self.assertEqual(len(unfinished), 1)
            self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}lock")[0][0], 1)
            present = set(all_groups(dsn))
            mid = oracle.states(dsn, [g for g in groups if g in present])
            self.assertEqual(mid, {g: before[g] for g in groups if g in present})

            status, output, summary = run_job(dsn, "--rooms", spec, "--chunk-groups", "100")
            self.assertEqual(status, 0, output)
            self.assertIn("resuming run", output)
            self.assertIn("no longer running on this host", output)
            self.assertEqual(summary["totals"]["mismatched_groups"], 0, output)
        finally:
            stop.set()
            sender.join()
        self.assertEqual(errors, [])
        self.assertGreater(len(sent), 10)
        self.assertTrue(purges)
        # Every group that still exists (purges delete some) has its state.
        present = set(all_groups(dsn))
        kept = [g for g in groups if g in present]
        self.assertGreater(len(kept), len(groups) * 0.9)
        self.assertEqual(oracle.states(dsn, kept), {g: before[g] for g in kept})
        written = [r for r in summary["rooms"] if r["status"] == "written"]
        self.assertTrue(written or summary["resumed"], output)
        self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}runs WHERE finished_ts IS NULL")[0][0], 0)
        self.assertEqual(pg_query(dsn, f"SELECT COUNT(*) FROM {PREFIX}lock")[0][0], 0)
        with open(log) as f:
            f.seek(log_offset)
            logged = f.read()
        # (the log holds warnings and errors only)
        self.assertNotIn(" - ERROR - ", logged)
        done = [admin._call("GET", f"/_synapse/admin/v1/purge_history_status/{p}")["status"] for p in purges]
        self.assertIn("complete", done)
        self.assertNotIn("failed", done)


class NotSynapseTests(unittest.TestCase):
    def test_a_database_without_synapse_tables_is_one_line(self) -> None:
        from tests.db import create_postgres_database, drop_postgres_database

        if not os.environ.get("ROOMSTORE_TEST_POSTGRES"):
            raise unittest.SkipTest("no test PostgreSQL server (run through bin/test)")
        url = create_postgres_database()
        self.addCleanup(drop_postgres_database, url)
        status, out, _ = run_job(url, "--dry-run")
        self.assertEqual(status, 1, out)
        errors = [line for line in out.splitlines() if "ERROR" in line]
        self.assertEqual(len(errors), 1, out)
        self.assertIn("not a Synapse database", errors[0])
        self.assertNotIn("Traceback", out)
